"""SWA host slots (docs/cache.md): a finished sequence's window state past its last full page is kept in an MXFP8
host slot, and the next turn of the conversation restores it instead of recomputing its tail. On the tiny model
(window 16, CSA 4, HCA 16, 128-token pages): the slot round trip stays within MXFP8's bound, a continued
conversation matches a cold re-prefill within the bound that leaves (and `num_cached_tokens` counts the tail),
slots are reused least recently used first, and a corrupt or mismatched slot is a miss with exact output."""

from __future__ import annotations

import random

import pytest
import torch

from deepserve import LLM, SamplingParams
from deepserve.core.kv.swa_slots import SWASlots
from deepserve.model.swa_slots import (mxfp8_decode, mxfp8_encode, mxfp8_error_bound, slot_bytes, slot_num_values,
                                       state_values)

P = 128
TURN1 = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
TURN2 = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)


def make_llm(tiny_dir, **kw):
    return LLM(tiny_dir, dtype="float32", accelerator="cpu", block_size=P, **kw)


def conversation(seed: int, first: int = 150, second: int = 12) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    return [rng.randrange(2, 512) for _ in range(first)], [rng.randrange(2, 512) for _ in range(second)]


def run(llm, prompt, params):
    return llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]


def logprobs(out) -> list[float]:
    return [entry[t].logprob for t, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs)]


@pytest.fixture(scope="module")
def cold(tiny_dir):
    """Each conversation's first turn, and its second turn re-prefilled cold (an engine with no slots)."""
    llm = make_llm(tiny_dir)
    out = {}
    for seed in (0, 1):
        first, more = conversation(seed)
        turn1 = run(llm, first, TURN1).outputs[0].token_ids
        second = first + turn1 + more
        out[seed] = (first, second, run(make_llm(tiny_dir), second, TURN2))  # fresh: nothing cached
    return out


def test_mxfp8_round_trip_is_within_its_bound():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * torch.logspace(-6, 3, 4096)  # every block its own magnitude
    x[:32] = 0  # an all-zero block
    y = mxfp8_decode(mxfp8_encode(x), x.numel())
    err = (y - x).abs()
    assert torch.all(err <= mxfp8_error_bound(x)) and y[:32].eq(0).all()
    assert err.max() > 0  # it is lossy: the bound is what is checked, not equality
    assert len(mxfp8_encode(x)) == 4096 + 4096 // 32  # one e4m3 byte per value, one UE8M0 scale per 32


def test_a_finished_sequences_slot_holds_its_state_within_the_mxfp8_bound(tiny_dir, cold):
    llm = make_llm(tiny_dir, swa_host_slots=2)
    runner, slots = llm.runner, llm.engine.swa_slots
    assert slots.pool.slot_bytes == slot_bytes(runner.cache)
    seen = {}
    save = runner.save_sequence

    def spy(request_id):  # the unquantized state, at the moment it is packed
        seen["values"] = state_values(runner.cache, runner._seqs[request_id].state)
        return save(request_id)

    runner.save_sequence = spy
    first, _, _ = cold[0]
    run(llm, first, TURN1)
    (entry,) = [slots.directory.get(k) for k in list(slots.directory._entries)]
    n = entry.location.num_tokens
    assert n % P and P < n <= len(first) + TURN1.max_tokens  # past its last full page
    payload = slots.pool.read(entry.location.slot)
    restored = mxfp8_decode(payload, slot_num_values(runner.cache))
    assert torch.all((restored - seen["values"]).abs() <= mxfp8_error_bound(seen["values"]))
    assert slots.directory.locate(entry.key) == entry.location  # what a router asks


def test_a_continued_conversation_restores_its_tail_from_the_slot(tiny_dir, cold):
    llm = make_llm(tiny_dir, swa_host_slots=2)
    first, second, cold_out = cold[0]
    run(llm, first, TURN1)
    warm = run(llm, second, TURN2)
    slots = llm.engine.swa_slots
    assert slots.stats.num_restored == 1
    assert warm.num_cached_tokens > P and warm.num_cached_tokens % P  # pages, then the slot's tail
    assert warm.outputs[0].token_ids == cold_out.outputs[0].token_ids
    diff = max(abs(a - b) for a, b in zip(logprobs(warm), logprobs(cold_out)))
    assert diff < 0.1, diff  # the MXFP8 state's effect on the next tokens' logprobs
    (entry,) = [slots.directory.get(k) for k in list(slots.directory._entries)]  # the second turn's, in its place
    assert entry.location.num_tokens > warm.num_cached_tokens and slots.pool.num_free == 1


def test_slots_are_reused_least_recently_used_first(tiny_dir, cold):
    llm = make_llm(tiny_dir, swa_host_slots=1)
    (first0, second0, cold0), (first1, second1, cold1) = cold[0], cold[1]
    run(llm, first0, TURN1)
    run(llm, first1, TURN1)  # takes conversation 0's slot
    slots = llm.engine.swa_slots
    assert slots.stats.num_evicted == 1 and len(slots.directory) == 1
    miss = run(llm, second0, TURN2)
    assert miss.num_cached_tokens == P  # its pages only: it recomputes its tail
    assert miss.outputs[0].token_ids == cold0.outputs[0].token_ids and logprobs(miss) == logprobs(cold0)


def test_a_corrupt_or_mismatched_slot_is_a_miss_with_exact_output(tiny_dir, cold):
    llm = make_llm(tiny_dir, swa_host_slots=2)
    first, second, cold_out = cold[0]
    run(llm, first, TURN1)
    slots = llm.engine.swa_slots
    slot = slots.pool.order()[0]
    slots.pool.buffer[slot * slots.pool.slot_bytes + 7] ^= 0xFF
    out = run(llm, second, TURN2)
    assert slots.stats.num_corrupt == 1 and out.num_cached_tokens == P
    assert out.outputs[0].token_ids == cold_out.outputs[0].token_ids and logprobs(out) == logprobs(cold_out)
    # a session id whose slot the prompt does not continue: a miss too
    engine = llm.engine
    engine.add_request("s1", first, TURN1, session_id="chat-1")
    while engine.has_unfinished_requests():
        engine.step()
    assert slots.directory.locate("chat-1") is not None
    edited = list(second)
    edited[P + 3] = (edited[P + 3] + 1) % 512  # the conversation was edited inside the saved tail
    misses = slots.stats.num_misses
    engine.add_request("s2", edited, TURN2, session_id="chat-1")
    assert "s2" not in engine._resumes and slots.stats.num_misses == misses + 1
    engine.abort(["s2"])


def test_the_slot_directory_by_session_and_by_sequence():
    slots = SWASlots(2, 4, page_size=P, layout="L", node="node-a")
    tokens = list(range(2, 2 + P + 5))
    assert slots.save(None, tokens[:P], None, b"abcd") is None  # ends on a page: the page's snapshot holds it
    by_seq = slots.save(None, tokens, None, b"abcd")
    by_session = slots.save("s", tokens[:P + 3], "salt", b"wxyz")
    assert by_seq.location.node == "node-a" and slots.directory.locate("s").num_tokens == P + 3
    hit = slots.find(None, tokens + [9], None)
    assert hit is not None and (hit.base_tokens, hit.num_tokens, hit.payload) == (P, P + 5, b"abcd")
    assert slots.find(None, tokens, None) is None  # the prompt must leave a token to compute
    assert slots.find("s", tokens, None) is None  # another tenant's salt
    assert slots.find("s", tokens, "salt").payload == b"wxyz"
    assert slots.find(None, tokens[:P + 3] + [9], "salt").payload == b"wxyz"  # by its tokens too
    with pytest.raises(ValueError, match="swa_host_slots"):
        SWASlots(0, 4, page_size=P, layout="L", node="n")
    with pytest.raises(ValueError, match="holds 4 bytes"):
        slots.save(None, tokens, None, b"abc")


def test_swa_host_slots_must_be_a_positive_count_over_prefix_caching():
    from deepserve.core.config import EngineConfig

    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="swa_host_slots must be a positive integer"):
            EngineConfig(model="m", swa_host_slots=bad)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(model="m", swa_host_slots=4, enable_prefix_caching=False)
