"""SWA host slots on the V4.1 engine path (docs/v41.md, "SWA host slots"): a finished sequence's state past its
last full page (rings, open groups, the partial page's rows and index keys, the host values, DSpark's rings) is
kept as stored, so a conversation's next turn restores exactly the state its previous turn ended with: the model's
own uninterrupted run, bit for bit, with `num_cached_tokens` counting the restored tail and the slot counters on
/metrics, found by its tokens or by `session_id` (also through `deepserve serve --swa-host-slots`), with or
without the base page's snapshot. A tail of prompt tokens gives the bits of an engine without slots; an edited
tail or a corrupt slot is a miss."""

from __future__ import annotations

import types
from concurrent.futures import wait

import pytest
import torch

from deepserve import LLM, SamplingParams
from deepserve.core.kv.prefix_hash import block_hashes
from deepserve.model.v41.swa_slots import pack_state, slot_bytes, unpack_state
from deepserve.server.metrics import ServerMetrics
from test_cache_swa_metrics import samples
from test_v41_engine import TINY_A, prompt

P = 128
DSPARK = {"method": "dspark", "num_speculative_tokens": 2}
TURN2 = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)


def make_llm(**options) -> LLM:
    torch.set_num_threads(1)
    return LLM(model=str(TINY_A), block_size=P, max_num_seqs=2, **options)


def turn(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def run(llm, ids: list[int], params: SamplingParams):
    return llm.generate([ids], params, use_tqdm=False)[0]


def bits(out) -> list[tuple[int, float]]:
    c = out.outputs[0]
    return [(t, lp[t].logprob) for t, lp in zip(c.token_ids, c.logprobs)]


def uninterrupted(model, first: list[int], generated: int, more: list[int], n: int) -> tuple[list, list]:
    """The contiguous model's own run of a conversation: the first turn's prefill and decode steps, then the
    second turn's new tokens as one prompt chunk on the same state, then `n` greedy steps with their logprobs."""
    state, out1 = model.make_state(), []
    logits = model.forward(first, state).logits
    for i in range(generated):
        out1.append(int(logits.argmax()))
        if i < generated - 1:
            logits = model.forward([out1[-1]], state).logits
    logits, out2 = model.forward(out1[-1:] + more, state, prompt=True).logits, []
    for _ in range(n):
        t = int(logits.argmax())
        out2.append((t, float(torch.log_softmax(logits.float(), -1)[t])))
        logits = model.forward([t], state).logits
    return out1, out2


def swa_metrics(llm) -> dict[str, float]:
    """The slot series of /metrics, once the saves on the runner's thread are done."""
    wait(llm.engine._slot_saves)
    server = ServerMetrics()
    server.engine = types.SimpleNamespace(snapshot=llm.engine.snapshot, engine=llm.engine)
    found = samples(server.render().decode())
    return {name[len("deepserve_"):]: v for (name, labels), v in found.items() if name.startswith("deepserve_swa_slot")}


@pytest.fixture(scope="module")
def conversation():
    first, more = prompt(150, seed=21), prompt(9, seed=22)
    return first, more


def test_a_continued_conversation_restores_the_state_its_last_turn_ended_with(conversation):
    first, more = conversation
    llm = make_llm(swa_host_slots=2)
    out1 = run(llm, first, turn(6)).outputs[0].token_ids
    second = first + list(out1) + more
    warm = run(llm, second, TURN2)
    n = len(first) + 5  # the last sampled token of the first turn is not in its state
    assert warm.num_cached_tokens == n  # 128 from the page, 27 from the slot
    expected1, expected2 = uninterrupted(llm.model, first, 6, more, 4)
    assert list(out1) == expected1 and bits(warm) == expected2  # the model's own run, bit for bit
    found = swa_metrics(llm)
    assert found == {"swa_slot_saves_total": 2, "swa_slot_restores_total": 1,
                                "swa_slot_misses_total": 1, "swa_slot_corrupt_total": 0,
                                "swa_slot_evictions_total": 0, "swa_slots": 2, "swa_slots_used": 1,
                                "swa_slot_bytes": slot_bytes(llm.cache)}
    (entry,) = [llm.engine.swa_slots.directory.get(k) for k in list(llm.engine.swa_slots.directory._entries)]
    assert entry.location.num_tokens == len(second) + 3  # the second turn's state replaced the first's


def test_a_tail_of_prompt_tokens_gives_the_bits_of_an_engine_without_slots(conversation):
    """A first turn of one token leaves a state of prompt tokens only, computed as a prompt as the engine
    without slots recomputes them: the same bits, the tail restored instead of recomputed."""
    first, more = conversation
    outs = []
    for slots in (None, 2):
        llm = make_llm(swa_host_slots=slots)
        second = first + list(run(llm, first, turn(1)).outputs[0].token_ids) + more
        outs.append(run(llm, second, TURN2))
    without, warm = outs
    assert (without.num_cached_tokens, warm.num_cached_tokens) == (P, len(first))
    assert bits(warm) == bits(without)


def test_a_slot_holds_the_state_byte_for_byte_dspark_rings_included(conversation):
    first, _ = conversation
    llm = make_llm(swa_host_slots=2, speculative_config=DSPARK)
    runner, states = llm.runner, llm.cache
    seen = {}
    save = runner.save_sequence

    def spy(request_id):  # the state as it is packed
        st = runner._seqs[request_id].state
        seen["state"] = (st.num_tokens, st.dspark_num_tokens, st.index_key_publisher, list(st.engram_history),
                         [tuple(None if t is None else t.clone() for t in (s.ring, s.kv_open, s.score_open, s.rows,
                                                                           s.index_keys))
                          for s in st.layers + st.dspark])
        return save(request_id)

    runner.save_sequence = spy
    run(llm, first, turn(6))
    wait(llm.engine._slot_saves)  # the save runs on the runner's thread after the request finished
    n, dspark_n, publisher, history, layers = seen["state"]
    assert n == len(first) + 5 and dspark_n == n and history
    assert len(states.dspark) == 2 and all(bool(ring.any()) for ring, *_ in layers[-2:])  # seeded DSpark rings
    entry = llm.engine.swa_slots.directory.get(list(llm.engine.swa_slots.directory._entries)[0])
    payload = llm.engine.swa_slots.pool.read(entry.location.slot)
    assert len(payload) == slot_bytes(states) == llm.engine.swa_slots.pool.slot_bytes

    base = [llm.kv_manager.pool.get_cached(h) for h in block_hashes(first[:P], P)]
    spare = [p for p in range(states.num_pages) if p not in base][0]
    for tensors in states.page_pools().values():  # the partial page's rows come from the payload, nowhere else
        for t in tensors:
            t[spare] = 0
    for name in ("layers.snapshot", "dspark_layers.snapshot", "sequence.snapshot"):
        for t in states.page_pools()[name]:  # nor is the base page's snapshot read (a store may keep none)
            t[base[-1]] = -1
    state, slot = unpack_state(states, base + [spare], n, payload)
    try:
        assert (state.num_tokens, state.dspark_num_tokens, state.index_key_publisher, state.engram_history) == \
            (n, dspark_n, publisher, history)
        for st, (ring, kv_open, score_open, rows, keys) in zip(state.layers + state.dspark, layers):
            for got, want in ((st.ring, ring), (st.kv_open, kv_open), (st.score_open, score_open),
                              (st.rows, rows), (st.index_keys, keys)):
                assert (got is None) == (want is None)
                if want is not None:  # the same values, -inf of an open group's empty entries included
                    assert got.dtype == want.dtype and torch.equal(got, want)
        assert pack_state(states, state) == payload  # and it packs back to the same bytes
        state.layers[0].ring[0] = 1.0078125  # not FP8 at any scale: a ring the MXFP8 form would round
        with pytest.raises(ValueError, match="would round them"):
            pack_state(states, state)
    finally:
        states.free_sequence(slot)
    with pytest.raises(ValueError, match="holds"):
        unpack_state(states, base + [spare], n, payload[:-1])
    with pytest.raises(ValueError, match="not 151"):
        unpack_state(states, base + [spare], 151, payload)
    assert states.num_free_slots == states.num_slots  # the failed restores gave their slots back


def test_with_dspark_the_next_turn_restores_the_drafters_state_and_keeps_the_greedy_tokens(conversation):
    first, more = conversation
    llm = make_llm(swa_host_slots=2, speculative_config=DSPARK)
    out1 = run(llm, first, turn(6)).outputs[0].token_ids
    drafted = llm.engine.stats.spec.num_draft_tokens
    warm = run(llm, first + list(out1) + more, turn(8))
    expected1, expected2 = uninterrupted(llm.model, first, 6, more, 8)
    assert warm.num_cached_tokens == len(first) + 5 and llm.engine.snapshot().swa_slots.num_restores == 1
    assert list(out1) == expected1 and warm.outputs[0].token_ids == [t for t, _ in expected2]
    # the second turn drafted on the restored rings (the drafter refuses rings that lag the chunk's start)
    assert llm.engine.stats.spec.num_draft_tokens > drafted


def finish(engine, request_id: str, ids: list[int], params: SamplingParams, session_id: str):
    engine.add_request(request_id, ids, params, session_id=session_id, final_only=True)
    done = None
    while engine.has_unfinished_requests():
        done = next((o for o in engine.step() if o.request_id == request_id and o.finished), done)
    return done


def test_a_session_id_finds_its_slot_and_an_edited_tail_is_a_miss(conversation):
    first, more = conversation
    llm = make_llm(swa_host_slots=2)
    engine = llm.engine
    out1 = finish(engine, "t1", first, turn(6), "chat-1").outputs[0].token_ids
    wait(engine._slot_saves)
    assert engine.swa_slots.directory.locate("chat-1").num_tokens == len(first) + 5  # what a router asks
    second = first + list(out1) + more
    edited = list(second)
    edited[P + 3] = (edited[P + 3] + 1) % 500  # the conversation was edited inside the saved tail
    assert finish(engine, "t2", edited, TURN2, "chat-1").num_cached_tokens == P  # a miss: recomputed
    wait(engine._slot_saves)
    assert engine.swa_slots.snapshot().num_restores == 0
    assert finish(engine, "t3", first, turn(6), "chat-2").outputs[0].token_ids == out1  # the first turn again
    warm = finish(engine, "t4", second, TURN2, "chat-2")
    assert warm.num_cached_tokens == len(first) + 5 and engine.swa_slots.snapshot().num_restores == 1
    assert bits(warm) == uninterrupted(llm.model, first, 6, more, 4)[1]


def test_a_corrupt_slot_is_a_miss_with_the_bits_of_an_engine_without_slots(conversation):
    first, more = conversation
    cold = make_llm()
    second = first + list(run(cold, first, turn(6)).outputs[0].token_ids) + more
    expected = bits(run(cold, second, TURN2))
    llm = make_llm(swa_host_slots=2)
    run(llm, first, turn(6))
    wait(llm.engine._slot_saves)
    pool = llm.engine.swa_slots.pool
    pool.buffer[pool.order()[0] * pool.slot_bytes + 3] ^= 0xFF
    out = run(llm, second, TURN2)
    assert out.num_cached_tokens == P and bits(out) == expected
    found = swa_metrics(llm)
    assert (found["swa_slot_corrupt_total"], found["swa_slot_misses_total"], found["swa_slot_restores_total"]) == \
        (1, 2, 0)


async def test_serve_with_swa_host_slots_restores_a_sessions_next_turn(aiohttp_client, conversation):
    from deepserve.cli import build_parser, engine_options
    from deepserve.core.plugins import make_plugin_manager
    from deepserve.server import ServerConfig, create_app
    from deepserve.server.state import ENGINE
    from test_server_sessions import saved_slot

    first, more = conversation
    args = build_parser().parse_args(["serve", str(TINY_A), "--block-size", str(P), "--max-num-seqs", "2",
                                      "--swa-host-slots", "2"])
    config = ServerConfig(model=str(TINY_A), served_model_name="v41", engine_kwargs=engine_options(args))
    torch.set_num_threads(1)
    client = await aiohttp_client(create_app(config, plugin_manager=make_plugin_manager(load_entrypoints=False)))

    async def complete(ids: list[int], max_tokens: int) -> dict:
        body = {"model": "v41", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "session_id": "chat-7"}
        r = await client.post("/v1/completions", json=body)
        assert r.status == 200, await r.text()
        return await r.json()

    await complete(first, 6)
    entry = await saved_slot(client.app, "chat-7")  # the tokens its state is at: the prompt and 5 generated
    assert entry is not None and entry.location.num_tokens == len(first) + 5
    again = await complete(first[:P] + list(entry.tail) + more, 2)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(first) + 5
    assert client.app[ENGINE].engine.swa_slots.snapshot().num_restores == 1
