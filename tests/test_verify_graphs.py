"""Speculative verify steps as the static forward and batched rollback their CUDA graphs capture
(`deepserve.model.verify_graphs`), run eagerly on the CPU reference backend: the logits of every row and every row
a sequence owns equal the paged verify path's and `SequenceUndo`'s, bit for bit, over random steps of several
widths whose rows close compressed blocks (several per CSA stream), wrap the window, cross page boundaries (their
prefix-hit snapshots), pad up to every bucket and pad shorter chunks up to the width, each rolled back to a random
number of kept tokens, then plain decode steps on the rolled-back state. Steps it cannot take are declined.
Through the engine (verify chunks alone, or beside prompt chunks), tokens with verify graphs equal eager
speculation's and, greedy, plain decoding's. Capture and replay need a GPU (tests/gpu/test_spec_graphs_gpu.py)."""

from __future__ import annotations

import random

import pytest
import torch

import tiny
from test_cuda_graphs import _owned_equal, _snaps, prefilled

from deepserve.model.batch import make_batch
from deepserve.model.kv_cache import PagedKVCache
from deepserve.model.speculative import SequenceUndo
from deepserve.model.verify_graphs import VerifyGraphs

PAGE = 64  # window 16, CSA ratio 4, HCA ratio 16 in the demo model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny.demo_model(tmp_path_factory, seed=5)


@pytest.mark.parametrize("width,seed", [(2, 0), (6, 1)])
@torch.inference_mode()
def test_static_verify_equals_paged_verify(model, width, seed):
    rng = random.Random(seed)
    num_slots, num_pages, steps = 6, 60, 14
    caches = [PagedKVCache(model, num_pages, PAGE, num_slots) for _ in range(2)]
    graphs = VerifyGraphs(model, caches[1], max_batch=num_slots, max_pages=5, width=width, capture=False)
    # prompts that end just before compression and window boundaries, or anywhere
    made = prefilled(model, caches, rng, num_slots, lambda: rng.choice([1, 3, 15, 16, 17, 62, rng.randrange(1, 150)]),
                     room=steps * width, snapshots=True)
    seqs_tables, seqs = [table for table, _ in made], [states for _, states in made]
    used = set()
    for step in range(steps):
        which = rng.sample(range(num_slots), rng.randrange(1, num_slots + 1))
        # every other step full width; else each sequence 1 to width tokens (DSpark's plans), padded up to width
        lengths = [width if step % 2 else rng.randrange(1, width + 1) for _ in which]
        tokens = [[rng.randrange(2, 258) for _ in range(n)] for n in lengths]
        kept = [rng.randrange(1, n + 1) for n in lengths]
        logits = []
        for k, cache in enumerate(caches):
            states = [seqs[i][k] for i in which]
            starts = [st.num_tokens for st in states]
            snaps = [_snaps(seqs_tables[i], st, n) for i, st, n in zip(which, starts, lengths)]
            batch = make_batch(tokens, starts, "cpu", logits_rows=[range(n) for n in lengths], snapshots=snaps)
            if k == 0:  # the eager pass covers each chunk, the graph's its width
                undo = [SequenceUndo(st, s, n) for st, s, n in zip(states, starts, lengths)]
                logits.append(model(batch, states).logits)
            else:
                assert graphs.supports(batch.chunks, states)
                undo = graphs.begin(batch, states)
                logits.append(graphs.forward(batch, states).logits)
            for u, s, a in zip(undo, starts, kept):
                u.rollback(s + a) if s + a < u.start + u.length else u.commit()
        assert torch.equal(logits[0], logits[1]), f"step {step}"
        for a, b in seqs:
            assert a.num_tokens == b.num_tokens
            for la, lb in zip(a.layers, b.layers):
                for ca, cb in ((la.compressor, lb.compressor), (la.indexer, lb.indexer)):
                    if ca is not None:
                        assert ca.rows.num_rows == cb.rows.num_rows and ca.journal is None
        used.update(graphs._buckets)
    _owned_equal(*caches, tokens={a.layers[0].slot: a.num_tokens for a, _ in seqs})
    assert len({s for s, _ in used}) >= 3  # several sequence buckets, padding sequences among them
    # and plain decode steps after the rolled-back passes agree too
    for k, cache in enumerate(caches):
        states = [seqs[i][k] for i in range(num_slots)]
        out = model(make_batch([[7]] * num_slots, [st.num_tokens for st in states], "cpu"), states).logits
        logits[k] = out
    assert torch.equal(logits[0], logits[1])


@torch.inference_mode()
def test_static_verify_declines_what_it_cannot_run(model):
    cache = PagedKVCache(model, 12, PAGE, 3)
    graphs = VerifyGraphs(model, cache, max_batch=2, max_pages=2, width=3, capture=False)
    tables = [[0, 1], [2, 3], [4, 5, 6]]
    states = [cache.new_sequence(t)[0] for t in tables]
    for st in states:
        model(make_batch([[5, 6, 7]], [0], "cpu"), [st])
    assert graphs.supports(make_batch([[1, 2, 3], [2, 3, 4]], [3, 3], "cpu").chunks, states[:2])
    assert graphs.supports(make_batch([[1, 2], [2]], [3, 3], "cpu").chunks, states[:2])  # fewer drafts: padded
    assert not graphs.supports(make_batch([[1, 2, 3, 4], [2]], [3, 3], "cpu").chunks, states[:2])  # past the width
    assert not graphs.supports(make_batch([[1, 2, 3]] * 3, [3, 3, 3], "cpu").chunks, states)  # past max_batch
    assert not graphs.supports(make_batch([[1, 2, 3]], [3], "cpu").chunks, states[2:])  # a table past max_pages
    cache.free_sequence(2)
    short = cache.new_sequence([7])[0]
    model(make_batch([list(range(2, PAGE - 1))], [0], "cpu"), [short])
    assert not graphs.supports(make_batch([[1]], [PAGE - 2], "cpu").chunks, [short])  # the padded end has no page
    batch = make_batch([[1, 2, 3], [2, 3, 4]], [3, 3], "cpu")
    with pytest.raises(RuntimeError, match="begin"):  # no handles taken for the step
        graphs.forward(batch, states[:2])
    handles = graphs.begin(batch, states[:2])
    graphs.forward(batch, states[:2])
    with pytest.raises(ValueError, match="cannot roll back to 3"):
        handles[0].rollback(3)  # the base token is always kept
    handles[0].rollback(5)
    with pytest.raises(RuntimeError, match="reported already"):
        handles[0].commit()
    assert [st.num_tokens for st in states[:2]] == [3, 3]  # counts move once every sequence has reported
    handles[1].commit()
    assert [st.num_tokens for st in states[:2]] == [5, 6]
    with pytest.raises(ValueError, match="width"):
        VerifyGraphs(model, cache, max_batch=2, max_pages=2, width=1, capture=False)
    with pytest.raises(ValueError, match="window"):
        VerifyGraphs(model, cache, max_batch=2, max_pages=2, width=17, capture=False)
    with pytest.raises(ValueError, match="CUDA"):
        VerifyGraphs(model, cache, max_batch=2, max_pages=2, width=3, capture=True)


@pytest.mark.parametrize("method", ["mtp", "dspark"])
def test_engine_with_verify_graphs_equals_eager_speculation(tmp_path, method):
    """Greedy and seeded sampled requests: the same tokens with verify steps through the static forward as with
    eager verify steps (and, greedy, as plain decoding); DSpark's planned draft counts padded up to the width; a
    long prompt prefilled in chunks while the others verify (those steps split: graph and eager, one output)."""
    from deepserve import LLM, SamplingParams
    from deepserve.model.runner import ModelRunner
    from deepserve.tools.demo_checkpoint import build_demo_checkpoint

    path = build_demo_checkpoint(tmp_path / "m", seed=2)
    prompts = [[5, 6, 7, 8], list(range(10, 110)), [9] * 33, [(7 * j) % 250 + 2 for j in range(200)]]
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=30, temperature=0.8, seed=3, ignore_eos=True)
    spec = {"method": method, "num_speculative_tokens": 3}
    outs, calls, snapshots, split = {}, [], {}, []
    beside = ModelRunner._verify_beside_prompts
    for name in ("plain", "eager", "graphs", "graphs, no prefix caching"):
        llm = LLM(path, dtype="float32", max_num_seqs=4, block_size=128, max_num_batched_tokens=64,
                  speculative_config=None if name == "plain" else spec,
                  enable_prefix_caching=not name.endswith("no prefix caching"))
        if name.startswith("graphs"):
            llm.runner._verify_beside_prompts = lambda *a, runner=llm.runner: split.append(1) or beside(runner, *a)
            llm.runner.verify_graphs = VerifyGraphs(llm.model, llm.cache, 4, 4, width=4, capture=False)
            forward = llm.runner.verify_graphs.forward
            snapshots[name] = seen = []

            def counted(b, s, forward=forward, seen=seen):
                calls.append([c.length for c in b.chunks])
                seen.extend(c.snapshots for c in b.chunks if c.snapshots)
                return forward(b, s)

            llm.runner.verify_graphs.forward = counted
        params = [greedy, greedy, sampled, greedy]
        outs[name] = [o.outputs[0].token_ids for o in
                      llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
        assert llm.runner.num_active_sequences == 0 and llm.cache.num_free_slots == llm.cache.num_slots
    assert len(calls) > 3 and any(min(lengths) < 4 for lengths in calls)  # some padded (drafts cut by max_tokens)
    # DSpark plans each step's drafts from measured step times: a sampled request's tokens follow its drafts
    # (kept by coin), so only fixed-k speculation repeats them run to run; greedy tokens are plain decoding's
    same = [0, 1, 2, 3] if method == "mtp" else [0, 1, 3]
    assert [outs["graphs"][i] for i in same] == [outs["eager"][i] for i in same] == \
        [outs["graphs, no prefix caching"][i] for i in same]
    assert [outs["graphs"][i] for i in (0, 1, 3)] == [outs["plain"][i] for i in (0, 1, 3)]
    assert split  # steps that held prompt chunks beside the verify chunks took the graphs for the latter
    # page boundaries inside verify chunks: snapshots taken where prefix caching reads them, none found without
    assert snapshots["graphs"] and not snapshots["graphs, no prefix caching"]
