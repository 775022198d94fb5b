"""The static decode forward that CUDA graphs capture (`deepserve.model.cuda_graphs`), run eagerly on the CPU
reference backend: it gives the ordinary paged decode path's bits (logits and every row a sequence owns) over
random decode batches that cross compression, window and page boundaries (page snapshots included), in every
batch and page bucket, with padding rows that touch nothing real. Through the engine, outputs are token for
token those of the eager runner. Capture and replay themselves are checked on the GPU (tests/gpu/)."""

from __future__ import annotations

import random

import pytest
import torch

import tiny

from deepserve.model.batch import make_batch
from deepserve.model.cuda_graphs import DecodeGraphs, batch_buckets, page_buckets
from deepserve.model.kv_cache import PagedKVCache

PAGE = 64  # window 16, CSA ratio 4, HCA ratio 16 in the demo model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny.demo_model(tmp_path_factory, seed=5)


def test_buckets():
    assert batch_buckets(256) == [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    assert batch_buckets(20) == [1, 2, 4, 8, 12, 16, 20]
    assert batch_buckets(1) == [1]
    assert page_buckets(1) == [1] and page_buckets(5) == [1, 2, 4, 5] and page_buckets(8) == [1, 2, 4, 8]


def _owned_equal(a: PagedKVCache, b: PagedKVCache, tokens: dict[int, int] | None = None) -> None:
    """Every tensor row a sequence can own equal in both caches (the padding slot and trash page excluded).
    `tokens` (slot -> the sequence's length): compare only the open blocks' rows in use, `length % ratio` of them
    (rows past them are written before they are read: a rolled-back pass may leave anything there)."""
    S, P = a.num_slots, a.num_pages
    for x, y in zip(a.layers, b.layers):
        W = x.spec.window
        assert torch.equal(x.window[:S], y.window[:S])
        assert torch.equal(x.snap_window[:P], y.snap_window[:P])
        assert torch.equal(x.storage[x.comp_base : x.comp_base + P * x.rows_per_page],
                           y.storage[y.comp_base : y.comp_base + P * y.rows_per_page]) if x.rows_per_page else True
        assert x.window.shape[1] == W
        for sx, sy in ((x.compressor, y.compressor), (x.indexer, y.indexer)):
            if sx is None:
                continue
            assert torch.equal(sx.rows[:P], sy.rows[:P])
            for name in ("open_kv", "open_gate", "prev_kv", "prev_gate"):
                tx, ty = getattr(sx, name), getattr(sy, name)
                if tokens is not None and name.startswith("open"):
                    m = tx.shape[1]
                    for slot, n in tokens.items():
                        assert torch.equal(tx[slot, : n % m], ty[slot, : n % m]), name
                    continue
                assert torch.equal(tx[:S], ty[:S]), name
            for name in ("snap_kv", "snap_gate"):
                tx, ty = getattr(sx, name), getattr(sy, name)
                assert torch.equal(tx[:P], ty[:P]), name


@pytest.mark.parametrize("seed", [0, 1])
@torch.inference_mode()
def test_static_decode_equals_paged_decode(model, seed):
    _check_static_equals_paged(model, seed)


@torch.inference_mode()
def test_static_decode_with_every_row_chosen(tmp_path_factory, monkeypatch):
    """The same with the indexer's top-k raised to 32 (two pages' rows): a static step over one or two pages
    then gives its CSA layers' rows as a rule (`VisibleRows`, no indexer query) and its query latent's norm to
    q_b's projection (`rms_norm_linear`), over more pages it scores; the same bits as the paged path either way."""
    from deepserve.model.compressor import Indexer
    from deepserve.model.layouts.static import StaticLayer

    model = tiny.demo_model(tmp_path_factory, seed=6)
    for m in model.modules():
        if isinstance(m, Indexer):
            m.topk = 32
    seen = []
    scored = StaticLayer.index_scored

    def counted(self, indexer):
        seen.append(scored(self, indexer))
        return seen[-1]

    monkeypatch.setattr(StaticLayer, "index_scored", counted)
    _check_static_equals_paged(model, 3)
    assert True in seen and False in seen


def _check_static_equals_paged(model, seed, steps=40, batch_sizes=None):
    rng = random.Random(seed)
    num_slots, num_pages = 12, 80
    caches = [PagedKVCache(model, num_pages, PAGE, num_slots) for _ in range(2)]
    graphs = DecodeGraphs(model, caches[1], max_batch=num_slots, max_pages=6, capture=False, batch_sizes=batch_sizes)
    assert not graphs.capture
    if batch_sizes is not None:  # made ahead, as the engine does at start-up: no step makes one
        made = graphs.warm_up(progress=False)
        assert made == len(graphs.batch_buckets) * len(graphs.page_buckets) and graphs.warm_up(progress=False) == 0
    # prompts that end just before compression and page boundaries, or anywhere
    seqs = prefilled(model, caches, rng, num_slots, lambda: rng.choice([1, 3, 15, 16, 62, 63, 64, rng.randrange(1, 200)]),
                     room=40, snapshots=True)
    used_buckets, warm = set(), set(graphs._buckets)
    for step in range(steps):
        which = rng.sample(range(num_slots), rng.randrange(1, num_slots + 1))  # random subsets, random order
        tokens = [rng.randrange(2, 258) for _ in which]
        logits = []
        for k, cache in enumerate(caches):
            states = [seqs[i][1][k] for i in which]
            starts = [st.num_tokens for st in states]
            batch = make_batch([[t] for t in tokens], starts, "cpu",
                               snapshots=[_snaps(seqs[i][0], s, 1) for i, s in zip(which, starts)])
            if k == 0:
                logits.append(model(batch, states).logits)
            else:
                assert graphs.supports(batch, states)
                logits.append(graphs.forward(batch, states).logits)
        assert torch.equal(logits[0], logits[1]), f"step {step}"
        for _, (a, b) in seqs:
            assert a.num_tokens == b.num_tokens
            for la, lb in zip(a.layers, b.layers):
                for ca, cb in ((la.compressor, lb.compressor), (la.indexer, lb.indexer)):
                    if ca is not None:
                        assert ca.rows.num_rows == cb.rows.num_rows
        used_buckets.update(graphs._buckets)
    _owned_equal(*caches)
    if batch_sizes is not None:
        assert used_buckets == warm
        return
    assert len({rows for rows, _ in used_buckets}) >= 4  # several batch buckets, padded rows among them
    crossed = sum(st.num_tokens // PAGE for _, (st, _) in seqs)
    assert crossed > 0


@torch.inference_mode()
def test_cuda_graph_sizes_are_made_at_start_and_steps_pad_up_to_them(model):
    """`cuda_graph_sizes` (vLLM's `--cuda-graph-sizes`): `warm_up` makes every (size, table width) bucket before
    the first step, steps of any size pad up to the next one and give the paged path's bits; sizes past the
    cache's slots are capped; an empty or non-positive list is refused."""
    _check_static_equals_paged(model, 4, steps=12, batch_sizes=[1, 5, 40])
    from deepserve.core.config import EngineConfig

    assert EngineConfig(cuda_graph_sizes=[8, 1, 8]).cuda_graph_sizes == (1, 8)
    for bad in ([], [0], [2, -1], 4, [True]):
        with pytest.raises(ValueError, match="cuda_graph_sizes"):
            EngineConfig(cuda_graph_sizes=bad)


def prefilled(model, caches, rng, count: int, length, room: int, snapshots: bool = False) -> list:
    """`count` sequences with the same random prompt (`length()` tokens) in every cache, their pages (`room`
    tokens past the prompt) shared: [(table, [state per cache])]. `snapshots`: the prompts save their page
    boundaries' snapshots."""
    seqs, next_page = [], 0
    for _ in range(count):
        n = length()
        table = []
        while len(table) * PAGE < n + room:
            table.append(next_page)
            next_page += 1
        prompt = [rng.randrange(2, 258) for _ in range(n)]
        states = []
        for cache in caches:
            st = cache.new_sequence(table)[0]
            model(make_batch([prompt], [0], "cpu", snapshots=[_snaps(table, 0, n)] if snapshots else None), [st])
            states.append(st)
        seqs.append((table, states))
    return seqs


def _snaps(table, start, n):
    return [(b, table[b // PAGE - 1]) for b in range((start // PAGE + 1) * PAGE, start + n + 1, PAGE)]


@torch.inference_mode()
def test_static_decode_declines_what_it_cannot_run(model):
    cache = PagedKVCache(model, 8, PAGE, 3)
    graphs = DecodeGraphs(model, cache, max_batch=2, max_pages=2, capture=False)
    tables = [[0, 1], [2, 3], [4, 5, 6]]
    states = [cache.new_sequence(t)[0] for t in tables]
    for st in states:
        model(make_batch([[5, 6, 7]], [0], "cpu"), [st])
    assert graphs.supports(make_batch([[1], [2]], [3, 3], "cpu"), states[:2])
    assert not graphs.supports(make_batch([[1, 2], [2]], [3, 3], "cpu"), states[:2])  # a verify-length chunk
    assert not graphs.supports(make_batch([[1], [2], [3]], [3, 3, 3], "cpu"), states)  # past max_batch
    assert not graphs.supports(make_batch([[1]], [3], "cpu"), states[2:])  # a table past max_pages
    contiguous = model.make_state()
    model(make_batch([[5, 6, 7]], [0], "cpu"), [contiguous])
    assert not graphs.supports(make_batch([[1]], [3], "cpu"), [contiguous])  # not in this cache
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphs(model, cache, max_batch=2, max_pages=2, capture=True)


@torch.inference_mode()
def test_static_decode_refuses_a_step_past_its_pages(model):
    cache = PagedKVCache(model, 8, PAGE, 2)
    graphs = DecodeGraphs(model, cache, max_batch=2, max_pages=2, capture=False)
    st = cache.new_sequence([0])[0]
    model(make_batch([list(range(2, 2 + PAGE))], [0], "cpu"), [st])  # the page is full
    batch = make_batch([[9]], [PAGE], "cpu")
    with pytest.raises(RuntimeError, match="too few"):
        graphs.forward(batch, [st])
    assert st.num_tokens == PAGE


def test_engine_outputs_equal_with_static_decode(tmp_path):
    from deepserve import LLM, SamplingParams
    from deepserve.tools.demo_checkpoint import build_demo_checkpoint

    path = build_demo_checkpoint(tmp_path / "m", seed=2)
    prompts = [[5, 6, 7, 8], list(range(10, 110)), [9] * 33, list(range(10, 110))]
    params = [SamplingParams(max_tokens=70, temperature=0), SamplingParams(max_tokens=40, temperature=0.8, seed=4),
              SamplingParams(max_tokens=55, temperature=1.0, top_k=20, seed=9), SamplingParams(max_tokens=3)]
    outs = []
    for static in (False, True):
        llm = LLM(model=str(path), accelerator="cpu", dtype="float32", max_num_seqs=4, block_size=128,
                  load_plugins=False)
        assert llm.graphs is None  # the reference backend does not declare CUDA graphs
        if static:
            llm.runner.graphs = DecodeGraphs(llm.model, llm.cache, 4, 4, capture=False)
            calls = []
            forward = llm.runner.graphs.forward
            llm.runner.graphs.forward = lambda b, s: calls.append(len(s)) or forward(b, s)
        outs.append([o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)])
        if static:
            assert len(calls) > 50  # the decode steps went through it
        assert llm.runner.num_active_sequences == 0 and llm.cache.num_free_slots == llm.cache.num_slots
    assert outs[0] == outs[1]


def test_mixed_steps_split_decode_from_prompt_chunks(tmp_path, monkeypatch):
    """A step holding decode tokens beside prompt chunks runs its one-token chunks as their own forward (a graph,
    or the batched paged path) and the rest as another; tokens, logprobs and prompt logprobs equal those of the
    whole step run as one forward."""
    from deepserve import LLM, SamplingParams
    from deepserve.model import runner as runner_mod
    from deepserve.model.batch import select_chunks
    from deepserve.tools.demo_checkpoint import build_demo_checkpoint

    path = build_demo_checkpoint(tmp_path / "m", seed=4)
    prompts = [[5, 6, 7], list(range(10, 150)), [9] * 90, list(range(20, 60)), [7, 8]]
    params = [SamplingParams(max_tokens=30, temperature=0, logprobs=2),
              SamplingParams(max_tokens=20, temperature=0.9, seed=1, prompt_logprobs=1),
              SamplingParams(max_tokens=25, temperature=0), SamplingParams(max_tokens=12, temperature=0.7, seed=3),
              SamplingParams(max_tokens=40, temperature=0)]
    results, splits = [], []
    for split in (False, True):
        if not split:
            monkeypatch.setattr(runner_mod.ModelRunner, "_forward", lambda self, b, s, r: self.model(b, s))
        else:
            monkeypatch.undo()
            monkeypatch.setattr(runner_mod, "select_chunks",
                                lambda *a, **k: splits.append(len(a[1])) or select_chunks(*a, **k))
        llm = LLM(model=str(path), accelerator="cpu", dtype="float32", max_num_seqs=5, block_size=128,
                  max_num_batched_tokens=48, load_plugins=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs or []],
                         [sorted(d.items()) if d else None for d in o.prompt_logprobs or []]) for o in outs])
        assert llm.runner.num_active_sequences == 0 and llm.cache.num_free_slots == llm.cache.num_slots
    assert splits, "no mixed step was split"
    assert results[0] == results[1]
