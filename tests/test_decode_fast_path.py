"""The batched zero-copy path over the paged cache (`layouts.PagedStep`) gives the general path's bits: the
same logits and every pool tensor equal after each step, on random paged batches (mixed positions crossing
compression, window and page boundaries, shared-prefix pages, verify-length and prompt-length chunks beside
decode tokens, slots in random order).
And its device-op count per layer does not grow with the batch."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

import tiny
from torch.utils._python_dispatch import TorchDispatchMode

from deepserve.model import layouts
from deepserve.model.attention import Attention
from deepserve.model.batch import make_batch
from deepserve.model.layouts.paged import PagedLayer
from deepserve.model.kv_cache import PagedKVCache
from deepserve.model.speculative import SequenceUndo

PAGE = 64  # window 16, CSA ratio 4, HCA ratio 16 in the demo model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny.demo_model(tmp_path_factory, seed=3)


@pytest.fixture
def general_path(monkeypatch):
    def force(on: bool):
        monkeypatch.setattr(layouts, "PAGED", not on)
    return force


class Twin:
    """The same sequences in two caches: `fast` steps with the paged decode path, `slow` with the general one."""

    def __init__(self, model, num_slots=20, num_pages=80):
        self.model = model
        self.caches = [PagedKVCache(model, num_pages, PAGE, num_slots, max_step_tokens=1024) for _ in range(2)]
        self.seqs = []  # (table, [fast state, slow state])
        self.next_page = 0

    def add(self, table, cached=0):
        states = [cache.new_sequence(table, cached)[0] for cache in self.caches]
        self.seqs.append((table, states))

    def grow(self, table, end):
        while len(table) * PAGE < end:
            table.append(self.next_page)
            self.next_page += 1

    def step(self, which, token_lists, general_path, logits_rows=None, keep=None):
        """Run one forward of sequences `which` (in that order) in both caches; return both logits. With `keep`
        (one kept length per chunk), the pass is a speculative verify: journaled, then rolled back to it."""
        out = []
        for k, force_general in ((0, False), (1, True)):
            starts, snaps, states, undos = [], [], [], []
            for i, ids in zip(which, token_lists):
                table, st = self.seqs[i]
                start = st[k].num_tokens
                self.grow(table, start + len(ids))
                starts.append(start)
                # what the runner asks for: a snapshot at every page boundary the chunk crosses
                snaps.append([(b, table[b // PAGE - 1]) for b in range((start // PAGE + 1) * PAGE,
                                                                       start + len(ids) + 1, PAGE)])
                states.append(st[k])
                if keep is not None:
                    undos.append(SequenceUndo(st[k], start, len(ids)))
            batch = make_batch(token_lists, starts, "cpu", logits_rows=logits_rows, snapshots=snaps)
            general_path(force_general)
            out.append(self.model(batch, states).logits)
            for undo, start, n, kept in zip(undos, starts, map(len, token_lists), keep or ()):
                undo.rollback(start + kept) if kept < n else undo.commit()
        general_path(False)
        return out

    def assert_same_state(self):
        fast, slow = self.caches
        for a, b in zip(fast.layers, slow.layers):
            assert torch.equal(a.storage[: a.scratch_base], b.storage[: b.scratch_base])  # rings + rows
            assert torch.equal(a.snap_window, b.snap_window)
            for sa, sb in ((a.compressor, b.compressor), (a.indexer, b.indexer)):
                if sa is None:
                    continue
                for name in ("rows", "open_kv", "open_gate", "prev_kv", "prev_gate", "snap_kv", "snap_gate"):
                    assert torch.equal(getattr(sa, name), getattr(sb, name)), name
        for _, (x, y) in self.seqs:
            assert x.num_tokens == y.num_tokens
            for la, lb in zip(x.layers, y.layers):
                for ca, cb in ((la.compressor, lb.compressor), (la.indexer, lb.indexer)):
                    if ca is not None:
                        assert ca.rows.num_rows == cb.rows.num_rows


def ids(rng, n):
    return [rng.randrange(2, 258) for _ in range(n)]


@pytest.mark.parametrize("seed", [0, 1])
@torch.inference_mode()
def test_fast_path_equals_general_path_on_random_paged_batches(model, general_path, monkeypatch, seed):
    taken = Counter()
    for name in ("attend", "_emit_single_tokens", "_emit_chunks"):
        def spy(self, *a, _fn=getattr(PagedLayer, name), _name=name, **k):
            taken[_name] += 1
            if _name == "attend" and any(c.length > 16 for c in self.batch.chunks):
                taken["long chunks"] += 1
            return _fn(self, *a, **k)
        monkeypatch.setattr(PagedLayer, name, spy)
    snap = PagedLayer._snapshot_windows

    def snap_spy(self):
        taken["snapshots"] += sum(len(c.snapshots) for c in self.batch.chunks)
        return snap(self)
    monkeypatch.setattr(PagedLayer, "_snapshot_windows", snap_spy)
    rng = random.Random(seed)
    twin = Twin(model)
    shared = ids(rng, PAGE)
    first = []
    twin.add(first)
    twin.step([0], [shared + ids(rng, 7)], general_path)  # prefill (general path in both)
    for _ in range(11):
        if rng.random() < 0.5:  # a sequence that starts from the first one's shared first page
            table = [first[0]]
            twin.add(table, cached=PAGE)
            twin.step([len(twin.seqs) - 1], [ids(rng, rng.randint(1, 40))], general_path)
        else:
            twin.add([])
            twin.step([len(twin.seqs) - 1], [ids(rng, rng.choice((rng.randint(1, 6), rng.randint(1, 90))))],
                      general_path)
    twin.assert_same_state()
    for step in range(40):
        which = rng.sample(range(len(twin.seqs)), rng.randint(1, len(twin.seqs)))  # random order of slots
        verify = step % 5 == 4
        tokens = [ids(rng, rng.randint(1, 6) if verify or step % 5 == 2 else 1) for _ in which]
        if step % 5 == 3:  # prompt-length chunks (past the window, across compression blocks and pages) beside
            tokens = [ids(rng, rng.choice((1, rng.randint(17, 70)))) for _ in which]  # decode tokens
        rows = [range(len(t)) for t in tokens]
        keep = [rng.randint(1, len(t)) for t in tokens] if verify else None  # speculative: journal, roll back
        fast, slow = twin.step(which, tokens, general_path, logits_rows=rows, keep=keep)
        assert torch.equal(fast, slow), f"step {step}"
        twin.assert_same_state()
    assert taken["attend"] > 100 and taken["_emit_single_tokens"] > 100  # the fast path did run
    assert taken["_emit_chunks"] > 10  # verify-length and prompt chunks too
    assert taken["long chunks"] > 20  # prompt chunks past the window took the batched path
    assert taken["snapshots"] > 0  # and crossed page boundaries


class OpCounter(TorchDispatchMode):
    """Counts aten ops while `active`, i.e. inside an attention layer but outside the backend's attention and
    indexer kernels (the reference kernels loop over widths, which is theirs, not the state handling's)."""

    def __init__(self):
        super().__init__()
        self.ops, self.active = Counter(), False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.active:
            self.ops[func] += 1
        return func(*args, **(kwargs or {}))


def count_attention_ops(model, twin, which, general_path, force_general, monkeypatch, length=1):
    counter = OpCounter()
    backend = model.backend

    def paused(fn):
        def call(*a, **k):
            counter.active = False
            try:
                return fn(*a, **k)
            finally:
                counter.active = True
        return call

    monkeypatch.setattr(backend, "sparse_attention", paused(backend.sparse_attention))
    monkeypatch.setattr(backend, "indexer_topk", paused(backend.indexer_topk))
    hooks = []
    for m in model.modules():
        if isinstance(m, Attention):
            hooks.append(m.register_forward_pre_hook(lambda *_: setattr(counter, "active", True)))
            hooks.append(m.register_forward_hook(lambda *_: setattr(counter, "active", False)))
    k = 1 if force_general else 0
    starts = [twin.seqs[i][1][k].num_tokens for i in which]
    batch = make_batch([[5] * length for _ in which], starts, "cpu")
    general_path(force_general)
    with counter:
        model(batch, [twin.seqs[i][1][k] for i in which])
    general_path(False)
    for h in hooks:
        h.remove()
    monkeypatch.undo()
    return sum(counter.ops.values())


@pytest.mark.parametrize("length", [1, 3])
@torch.inference_mode()
def test_fast_path_ops_per_step_do_not_grow_with_the_batch(model, general_path, monkeypatch, length):
    """A decode step (or a verify step of 3 tokens) from positions 47 (closes a CSA and an HCA block), 45, 43
    and 46, repeated: every kind of frontier update happens at every batch size."""
    rng = random.Random(7)
    counts = {}
    for size in (4, 16):
        twin = Twin(model, num_slots=size)
        for n in ([47, 45, 43, 46] * 4)[:size]:
            twin.add([])
            twin.step([len(twin.seqs) - 1], [ids(rng, n)], general_path)
        for force_general in (False, True):
            counts[force_general, size] = count_attention_ops(model, twin, list(range(size)), general_path,
                                                              force_general, monkeypatch, length)
    assert counts[False, 4] == counts[False, 16], counts  # the fast path: the same ops at any batch size
    assert counts[True, 16] > counts[True, 4], counts  # the general path grows with the batch (the counter works)
    assert counts[False, 16] < counts[True, 16]
