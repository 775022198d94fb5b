"""Rolling back rejected drafts leaves every piece of per-sequence state equal to a run that never saw them:
window rings, compressed rows, the open compression block and the CSA overlap half (main KV and indexer), the
token counters, and the MTP drafter's window; in contiguous state and in the paged cache."""

from __future__ import annotations

import pytest
import torch

import tiny

from deepserve.model.batch import make_batch
from deepserve.model.kv_cache import PagedKVCache
from deepserve.model.speculative import DraftChunk, RowSampling, SequenceUndo


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny.demo_model(tmp_path_factory, seed=5)


def tokens(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 258, (n,), generator=g).tolist()


def run(model, state, ids, start):
    return model(make_batch([ids], [start], "cpu", logits_rows=[range(len(ids))]), [state])


def assert_same_state(a, b):
    assert a.num_tokens == b.num_tokens
    for i, (x, y) in enumerate(zip(a.layers, b.layers)):
        assert torch.equal(x.window.ring, y.window.ring), f"layer {i}: window ring"
        for name in ("compressor", "indexer"):
            cx, cy = getattr(x, name), getattr(y, name)
            if cx is None:
                continue
            m = cx.open_kv.shape[0]
            held = a.num_tokens % m
            assert cx.rows.num_rows == cy.rows.num_rows == a.num_tokens // m, f"layer {i} {name}: rows"
            assert torch.equal(cx.rows.view(), cy.rows.view()), f"layer {i} {name}: row values"
            assert torch.equal(cx.open_kv[:held], cy.open_kv[:held]), f"layer {i} {name}: open block kv"
            assert torch.equal(cx.open_gate[:held], cy.open_gate[:held]), f"layer {i} {name}: open block gate"
            if cx.prev_kv is not None and a.num_tokens >= m:
                assert torch.equal(cx.prev_kv, cy.prev_kv), f"layer {i} {name}: overlap kv"
                assert torch.equal(cx.prev_gate, cy.prev_gate), f"layer {i} {name}: overlap gate"


# prompt lengths and pass lengths so that passes start and end inside CSA blocks, close them, cross an HCA
# boundary (16) and wrap the window ring (16) several times
CASES = [(13, 6), (15, 6), (16, 6), (30, 6), (31, 3), (45, 6), (62, 5)]


@pytest.mark.parametrize("prompt_len,length", CASES)
@torch.inference_mode()
def test_rollback_to_every_length_equals_never_computing_the_rest(model, prompt_len, length):
    ids = tokens(prompt_len, prompt_len + length + 4)
    for keep in range(1, length + 1):
        spec, plain = model.make_state(), model.make_state()
        run(model, spec, ids[:prompt_len], 0)
        run(model, plain, ids[:prompt_len], 0)
        undo = SequenceUndo(spec, prompt_len, length)
        verified = run(model, spec, ids[prompt_len : prompt_len + length], prompt_len).logits
        undo.rollback(prompt_len + keep) if keep < length else undo.commit()
        kept = run(model, plain, ids[prompt_len : prompt_len + keep], prompt_len).logits
        assert torch.equal(verified[:keep], kept)  # the kept rows' logits are the plain decode's
        assert_same_state(spec, plain)
        nxt = ids[prompt_len + keep : prompt_len + keep + 4]  # and both continue identically
        assert torch.equal(run(model, spec, nxt, prompt_len + keep).logits,
                           run(model, plain, nxt, prompt_len + keep).logits)


@torch.inference_mode()
def test_rollback_in_the_paged_cache(model):
    cache = PagedKVCache(model, num_pages=8, page_size=64, num_slots=2, owners=("layers", "mtp_layers"))
    ids = tokens(3, 80)
    table_a, table_b = [0, 1], [2, 3]
    spec, slot_a = cache.new_sequence(table_a)
    plain, slot_b = cache.new_sequence(table_b)
    for st in (spec, plain):
        run(model, st, ids[:60], 0)  # the pass below crosses the page boundary at 64
    undo = SequenceUndo(spec, 60, 6)
    run(model, spec, ids[60:66], 60)
    undo.rollback(62)
    run(model, plain, ids[60:62], 60)
    assert_same_state(spec, plain)
    assert torch.equal(run(model, spec, ids[62:70], 62).logits, run(model, plain, ids[62:70], 62).logits)
    cache.free_sequence(slot_a)
    cache.free_sequence(slot_b)
    assert cache.num_free_slots == 2


def test_rollback_outside_the_pass_is_refused(model):
    state = model.make_state()
    with torch.inference_mode():
        run(model, state, tokens(1, 10), 0)
        undo = SequenceUndo(state, 10, 3)
        run(model, state, tokens(2, 3), 10)
    with pytest.raises(ValueError, match="cannot roll back to 14"):
        undo.rollback(14)
    with pytest.raises(ValueError, match="undo taken at 9"):
        SequenceUndo(state, 9, 2)


def greedy_rows(n):
    z = torch.zeros(n)
    return RowSampling(z, z.long(), torch.ones(n), z, z.long())


@torch.inference_mode()
def test_drafting_leaves_the_mtp_state_of_a_plain_catch_up(model):
    """The chained drafts write the MTP window speculatively; afterwards it equals a catch-up without drafts."""
    from deepserve.plugins.speculative.mtp import MTPProposer

    proposer = MTPProposer(model, num_speculative_tokens=5)
    ids = tokens(9, 40)
    states = []
    for drafts in (5, 0):
        state = model.make_state()
        out = run(model, state, ids[:37], 0)
        chunk = DraftChunk(state, 0, 37, range(37), ids[1:38], drafts)
        result = proposer.propose(out.streams, [chunk], greedy_rows(1 if drafts else 0))
        assert (result is None) == (drafts == 0)
        if drafts:
            assert result.token_ids.shape == (1, 5) and result.probs.shape == (1, 5, model.cfg.vocab_size)
        states.append(state)
    a, b = states
    assert a.mtp_num_tokens == b.mtp_num_tokens == 37
    for x, y in zip(a.mtp_layers, b.mtp_layers):
        assert torch.equal(x.window.ring, y.window.ring)


@torch.inference_mode()
def test_verify_steps_take_the_constant_launch_key_pool_with_the_same_logits(model):
    """Chunks of at most `window` tokens each (decode and verify steps, equal or mixed lengths) use the whole-ring
    key pool; a batch with a longer chunk takes the general path. A token's logits are the same either way."""
    lens = [3, 10, 15, 16, 17, 40, 1]
    ids = [tokens(L, L + 60) for L in lens]

    def run(force_general):
        states = [model.make_state() for _ in range(len(lens) + 1)]
        for st, L, t in zip(states, lens, ids):
            run_ids = t[:L]
            model(make_batch([run_ids], [0], "cpu"), [st])
        outs = []
        for ns in ([1] * 7, [4] * 7, [1, 6, 3, 16, 2, 5, 6], [6, 1, 1, 1, 2, 2, 16]):
            toks = [t[st.num_tokens : st.num_tokens + n] for st, t, n in zip(states, ids, ns)]
            starts, rows, use = [st.num_tokens for st in states[: len(lens)]], [range(n) for n in ns], states[:-1]
            if force_general:
                toks.append(list(range(5, 22)))  # 17 tokens > window 16
                starts.append(states[-1].num_tokens)
                rows.append(range(17))
                use = states
            outs.append(model(make_batch(toks, starts, "cpu", logits_rows=rows), use).logits[: sum(ns)])
        return outs

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))
