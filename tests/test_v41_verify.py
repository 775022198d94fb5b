"""A V4.1 DSpark verify of 1 + k tokens in one forward (docs/v41.md, "DSpark as the proposer"): a sequence's
consecutive tokens as rows of one `forward_decode` give, bit for bit on the CPU, the logits, DSpark taps and
states of one-token decode steps one after another (the reference's stale index keys included), and the engine's
verify in one forward gives the tokens and logprobs of the verify one token at a time, with accepted drafts,
rejected ones and a page boundary crossed inside a verifying chunk."""

from __future__ import annotations

import pytest
import torch

from deepserve import LLM, SamplingParams
from deepserve.model.v41 import load_v41
from test_v41_engine import TINY_A, TINY_B, greedy, prompt

P = 128


def same(a, b) -> bool:
    """Equal values and dtypes all the way down (tensors bit for bit)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and \
            torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("tiny", [TINY_A, TINY_B])
@pytest.mark.parametrize("length", [150, 151])  # the chunk starts with a ratio-2 group closed or open
def test_a_sequences_tokens_in_one_forward_are_its_decode_steps_bit_for_bit(tiny, length):
    """Past index_topk compressed rows, so the stale index keys pick differently from a prompt's; another
    sequence's decode token in the same forward."""
    torch.set_num_threads(1)
    model = load_v41(tiny)
    a, b = model.make_state(), model.make_state()
    model.forward(prompt(length, seed=1), a)
    model.forward(prompt(60, seed=2), b)
    tokens, other = prompt(4, seed=3), prompt(1, seed=4)
    start_a, start_b = a.save(), b.save()
    steps = []
    for i, t in enumerate(tokens):  # one decode step at a time (the other sequence's with the first)
        out = model.forward_decode([t] + (other if i == 0 else []), [a] + ([b] if i == 0 else []))
        steps.append((out.logits[0], out.main_hidden[0] if out.main_hidden is not None else None, a.save()))
        other_logits = out.logits[1] if i == 0 else other_logits
    end_a, end_b = a.save(), b.save()
    a.load(start_a)
    b.load(start_b)
    out = model.forward_decode(tokens + other, [a, a, a, a, b], keep=[True, True, True, False, False])
    for i, (logits, taps, _) in enumerate(steps):
        assert torch.equal(out.logits[i], logits)
        assert taps is None or torch.equal(out.main_hidden[i], taps)
    assert all(same(out.saved[i], steps[i][2]) for i in range(3)) and set(out.saved) == {0, 1, 2}
    assert torch.equal(out.logits[4], other_logits)
    assert same(a.save(), end_a) and same(b.save(), end_b) and a.num_tokens == length + 4


def test_a_sequence_shorter_than_its_rows_is_refused():
    torch.set_num_threads(1)
    model = load_v41(TINY_A)
    state = model.make_state()
    model.forward(prompt(3, seed=5), state)
    with pytest.raises(ValueError, match="fewer tokens than rows"):
        model.forward_decode(prompt(4, seed=6), [state] * 4)
    assert state.num_tokens == 3


def make_llm(one_forward: bool) -> LLM:
    torch.set_num_threads(1)
    llm = LLM(model=str(TINY_A), block_size=P, max_num_seqs=2, kv_cache_bytes=16 * 2**20,
              speculative_config={"method": "dspark", "num_speculative_tokens": 3})
    llm.runner.one_forward_verify = one_forward
    return llm


def test_the_engines_verify_in_one_forward_gives_the_stepped_verifys_bits(monkeypatch):
    """A 126-token prompt whose drafts are the true continuation for its first tokens (accepted: the chunks
    cross the page boundary at 128) and the drafter's own after (rejected); then a request that hits the page
    whose snapshot the crossing chunk took, and a sampled one. Every step's logits are compared (requests that
    ask for logprobs do not draft)."""
    ids = prompt(126, seed=7)
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)]
    results, calls = [], []
    for one_forward in (True, False):
        llm = make_llm(one_forward)
        truth = ids + greedy(llm.model, ids, 8)
        own, decode, forward = llm.model.dspark_draft, llm.model.forward_decode, llm.runner._forward
        logits = []

        def oracle(golden, taps, state, own=own, truth=truth):
            draft = own(golden, taps, state)
            p = state.dspark_num_tokens  # the golden token's position
            if p + 1 + len(draft.tokens) <= len(truth):
                draft.tokens = truth[p + 1 : p + 1 + len(draft.tokens)]
            return draft

        def counted(ids, states, keep=None, decode=decode, one_forward=one_forward):
            calls.append((one_forward, len(states), len({id(s) for s in states})))
            return decode(ids, states, keep)

        def step_logits(*args, forward=forward, logits=logits):
            out = forward(*args)
            logits.append(out.logits.clone())
            return out

        monkeypatch.setattr(llm.model, "dspark_draft", oracle)
        # every draft verified: the planner's choice follows measured step times, which differ run to run
        monkeypatch.setattr(llm.engine.scheduler, "verify_planner", lambda conf, **_: [len(c) for c in conf])
        monkeypatch.setattr(llm.model, "forward_decode", counted)
        monkeypatch.setattr(llm.runner, "_forward", step_logits)
        first = llm.generate([ids], params[0], use_tqdm=False)[0].outputs[0].token_ids
        hit = llm.generate([(ids + list(first))[:P] + prompt(5, seed=8)], params[0], use_tqdm=False)[0]
        sampled = llm.generate([prompt(40, seed=9)], params[1], use_tqdm=False)[0].outputs[0].token_ids
        spec = llm.engine.stats.spec
        results.append(((first, hit.outputs[0].token_ids, sampled, hit.num_cached_tokens, spec.num_accepted_tokens,
                         spec.num_verified_tokens), logits))
    (one, one_logits), (stepped, stepped_logits) = results
    assert one == stepped and len(one_logits) == len(stepped_logits)
    assert all(torch.equal(a, b) for a, b in zip(one_logits, stepped_logits))
    assert one[0] == truth[len(ids):] + one[0][8:]  # greedy: the model's own tokens
    assert one[3] == P  # the hit started from the snapshot the crossing chunk took
    assert 0 < one[4] < one[5]  # drafts accepted and rejected
    assert any(rows > seqs for on, rows, seqs in calls if on)  # a chunk's tokens in one forward
    assert all(rows == seqs for on, rows, seqs in calls if not on)
