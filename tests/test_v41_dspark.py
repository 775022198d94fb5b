"""DSpark as V4.1's proposer (`plugins/speculative/dspark_v41.py`): its drafts are the model's own DSpark pass
(one pass, up to 5 drafts, Markov-biased, with confidences); greedy output with speculation equals greedy output
without it, whether the drafts are rejected (rollback) or accepted; wrong settings are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepserve import LLM
from deepserve.core.sampling_params import SamplingParams
from deepserve.model.speculative import DraftChunk, RowSampling
from deepserve.model.v41 import load_v41
from deepserve.plugins.speculative.dspark_v41 import V41DSparkProposer
from test_v41_engine import greedy, prompt  # the contiguous model's own greedy decode, random prompts

TINY = Path(__file__).parent / "golden" / "v41" / "tiny_a" / "tiny"
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def spec_llm(k: int = 3) -> LLM:
    torch.set_num_threads(1)
    return LLM(model=str(TINY), block_size=128, max_num_seqs=2, kv_cache_bytes=16 * 2**20,
               speculative_config={"method": "dspark", "num_speculative_tokens": k})


def test_the_proposer_drafts_the_models_own_dspark_pass():
    torch.set_num_threads(1)
    model = load_v41(TINY)
    ids = prompt(20, seed=1)
    state = model.make_state()
    out = model.forward(ids, state, all_logits=True)
    golden = int(out.logits[-1].argmax())
    drafts = V41DSparkProposer(model, 5).propose(
        out.main_hidden, [DraftChunk(state, 0, 20, range(20), ids[1:] + [golden], 5)], _greedy_rows(1))
    ref_state = model.make_state()
    model.forward(ids, ref_state)
    model.dspark_seed(out.main_hidden[:-1], ref_state)
    ref = model.dspark_draft(golden, out.main_hidden[-1:], ref_state)
    assert drafts.token_ids.tolist() == [ref.tokens] and len(ref.tokens) == 5  # five drafts from one pass
    assert torch.equal(drafts.confidences[0], torch.sigmoid(ref.confidence_logit))
    assert drafts.probs is None and state.dspark_num_tokens == 20 == ref_state.dspark_num_tokens


def test_greedy_with_rejected_drafts_equals_greedy_without():
    llm = spec_llm()
    prompts = [prompt(5, seed=2), prompt(30, seed=3)]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert list(o.outputs[0].token_ids) == greedy(llm.model, p, 6)
    spec = llm.engine.stats.spec
    assert spec.num_verified_tokens > 0 and spec.num_accepted_tokens < spec.num_verified_tokens  # rolled back


def test_greedy_with_accepted_drafts_equals_greedy_without(monkeypatch):
    """Drafts replaced by the true continuation (the random tiny drafter rarely guesses it): they are kept,
    the steps commit several tokens, and the tokens stay the plain greedy ones."""
    llm = spec_llm()
    ids = prompt(9, seed=4)
    expected = greedy(llm.model, ids, 6)
    sequence = ids + expected + [0] * 8
    own = llm.model.dspark_draft

    def oracle(golden, taps, state):
        draft = own(golden, taps, state)
        p = state.dspark_num_tokens  # the golden token's position
        draft.tokens = sequence[p + 1 : p + 1 + len(draft.tokens)]
        return draft

    monkeypatch.setattr(llm.model, "dspark_draft", oracle)
    out = llm.generate([ids], GREEDY, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == expected
    assert llm.engine.stats.spec.num_accepted_tokens >= 3
    assert llm.engine.stats.num_steps <= 4  # prefill, then verify steps of several tokens


def test_wrong_settings_are_refused():
    model = load_v41(TINY)
    with pytest.raises(ValueError, match="DSpark drafts 1 to 5 tokens"):
        V41DSparkProposer(model, 6)
    with pytest.raises(ValueError, match="drafts with DSpark, not MTP"):
        LLM(model=str(TINY), block_size=128, speculative_config={"method": "mtp", "num_speculative_tokens": 1})


def _greedy_rows(n: int) -> RowSampling:
    zeros = torch.zeros(n)
    return RowSampling(zeros, zeros.long(), torch.ones(n), zeros, zeros.long(), all_greedy=True)


def test_a_prefix_hit_restores_the_drafters_rings():
    """The second prompt starts from the first's page snapshot, DSpark rings included: its drafts are the
    cold run's (the drafter checks its rings hold every position before the chunk) and so are its tokens."""
    llm = spec_llm()
    shared = prompt(130, seed=5)
    a, b = shared + prompt(4, seed=6), shared + prompt(7, seed=7)
    out_a = llm.generate([a], GREEDY, use_tqdm=False)[0]
    hits = llm.kv_manager.num_prefix_hits
    cold = spec_llm().generate([b], GREEDY, use_tqdm=False)[0]
    warm = llm.generate([b], GREEDY, use_tqdm=False)[0]
    assert llm.kv_manager.num_prefix_hits - hits == 128
    assert list(out_a.outputs[0].token_ids) == greedy(llm.model, a, 6)
    assert list(warm.outputs[0].token_ids) == list(cold.outputs[0].token_ids) == greedy(llm.model, b, 6)


def test_sampled_requests_verify_against_one_hot_drafts():
    llm = spec_llm()
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)
    out = llm.generate([prompt(12, seed=8)], params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 6 and llm.engine.stats.spec.num_verified_tokens > 0
