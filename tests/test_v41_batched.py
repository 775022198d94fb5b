"""V4.1's batched decode (`DeepseekV41ForCausalLM.forward_decode`, the runner's lockstep decode steps): one
forward for every running sequence's decode token, and for the i-th tokens of every verifying chunk, gives each
sequence the bits of its own decode step alone, whatever the batch and the other sequences' lengths."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepserve import LLM
from deepserve.core.sampling_params import SamplingParams
from deepserve.model.v41 import load_v41
from test_v41_engine import prompt  # random prompts

GOLDEN = Path(__file__).parent / "golden" / "v41"
TINY_A = GOLDEN / "tiny_a" / "tiny"
LENGTHS = (5, 40, 70, 150)  # shorter than both windows, past them, and past a 128-token page


@pytest.mark.parametrize("tiny", ["tiny_a", "tiny_b"])  # tiny_b: two ratio-1 Reindex layers
def test_forward_decode_gives_each_row_its_own_decode_bits(tiny):
    torch.set_num_threads(1)
    model = load_v41(GOLDEN / tiny / "tiny")
    prompts = [prompt(n, seed) for seed, n in enumerate(LENGTHS)]
    alone = []  # per sequence: the logits of its decode steps, run one sequence at a time
    for p in prompts:
        state = model.make_state()
        token, steps = int(model.forward(p, state).logits.argmax()), []
        for _ in range(5):
            steps.append(model.forward([token], state).logits)
            token = int(steps[-1].argmax())
        alone.append(steps)
    states = [model.make_state() for _ in prompts]
    tokens = [int(model.forward(p, st).logits.argmax()) for p, st in zip(prompts, states)]
    for step in range(5):
        out = model.forward_decode(tokens, states)
        assert out.logits.shape == (len(prompts), model.cfg.vocab_size)
        for i in range(len(prompts)):
            assert torch.equal(out.logits[i], alone[i][step]), (i, step)
        tokens = out.logits.argmax(-1).tolist()
    assert [st.num_tokens for st in states] == [n + 5 for n in LENGTHS]
    with pytest.raises(ValueError, match="2 tokens for 1 sequences"):
        model.forward_decode([3, 4], states[:1])
    with pytest.raises(ValueError, match="position 0 needs forward"):
        model.forward_decode([3], [model.make_state()])


def _record_batches(llm) -> "_Sizes":
    """Wraps the runner's model so that each forward_decode's batch size (its sequences; a verifying chunk's
    tokens are rows of one) and its rows are kept."""
    sizes, own = _Sizes(), llm.model.forward_decode

    def recording(ids, states, keep=None):
        sizes.append(len({id(s) for s in states}))
        sizes.rows.append(len(states))
        return own(ids, states, keep)

    llm.model.forward_decode = recording
    return sizes


class _Sizes(list):
    """Sequences per forward_decode; `rows`: rows per forward_decode (cleared with it)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[int] = []

    def clear(self) -> None:
        super().clear()
        self.rows.clear()


def _bits(out) -> list:
    """The tokens, with their logprobs where the request asked for them."""
    o = out.outputs[0]
    return [(t, lp[t].logprob) for t, lp in zip(o.token_ids, o.logprobs)] if o.logprobs else list(o.token_ids)


@pytest.mark.parametrize("speculative", [None, {"method": "dspark", "num_speculative_tokens": 3}])
def test_a_sequences_tokens_and_logprobs_are_the_same_alone_and_in_a_batch(speculative):
    """Through LLM: each prompt alone, then all four together (decoding in one forward a step, and with DSpark
    the verifying chunks' tokens in lockstep): the same tokens and the same logprob bits (without DSpark: a
    request with logprobs is not speculated on)."""
    torch.set_num_threads(1)
    llm = LLM(model=str(TINY_A), block_size=128, max_num_seqs=4, max_num_batched_tokens=512,
              kv_cache_bytes=32 * 2**20, enable_prefix_caching=False, speculative_config=speculative)
    sizes = _record_batches(llm)
    prompts = [prompt(n, 10 + seed) for seed, n in enumerate(LENGTHS)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=None if speculative else 0)
    alone = [_bits(llm.generate([p], params, use_tqdm=False)[0]) for p in prompts]
    assert max(sizes) == 1
    sizes.clear()
    together = [_bits(o) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert max(sizes) == len(prompts)  # the sequences' decode steps ran in one forward
    assert together == alone
    if speculative:
        assert llm.engine.stats.spec.num_verified_tokens > 0
        assert max(sizes.rows) > len(prompts)  # verifying chunks ran as several rows of one forward
