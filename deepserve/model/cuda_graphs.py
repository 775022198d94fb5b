"""CUDA graphs for decode steps: the whole forward of a decode batch replayed with one launch.

A decode step over the paged cache is a fixed sequence of ~1,000 kernels whose shapes depend only on how many
rows it has and how wide its block tables are; launching them one by one from Python costs far more host time
than the GPU spends on them (bench/gpu.py). So a step runs as a *static* forward (`layouts.StaticStep`): its
rows' tokens, positions, slots and padded block tables sit in fixed device buffers, every per-row decision (does
this token close a compressed block? which keys can it see?) is made on the device, and the writes a row does not
want go to the cache's padding slot or trash page. Such a forward is captured once per bucket (rows padded up to
the next batch size in `batch_buckets`, tables to the next page count in `page_buckets`) and replayed: a step
copies its inputs into the bucket's buffers, replays, and does on the host what the graph cannot: advance each
sequence's row counts and token count, and (when a token ends a page) save the page's prefix-hit snapshot from
the rings the step wrote.

With `capture=False` the same static forward runs eagerly: on the reference backend it gives the same bits as
the ordinary paged decode path (tests/test_cuda_graphs.py), which is how the static path is checked without a
GPU. Graph outputs are valid until the next replay of any bucket (the graphs share one memory pool).
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch

from .batch import ForwardBatch, to_device
from .deepseek_v4 import DeepseekV4ForCausalLM, ForwardOutput
from .layouts import StaticDecode, StaticStep
from .layouts.paged import PagedIndex, block_table
from .kv_cache import PagedKVCache
from .state import SequenceState

logger = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """Padded batch sizes: 1, 2, 4, 8, then steps of about 1.5x (12, 16, 24, 32, 48, ...), up to `max_batch`."""
    sizes, n = [1, 2, 4, 8], 8
    while n < max_batch:
        n = n * 3 // 2 if n & (n - 1) == 0 else n // 3 * 4
        sizes.append(n)
    return sorted({min(s, max_batch) for s in sizes})


def page_buckets(max_pages: int) -> list[int]:
    """Padded block-table widths: powers of two up to `max_pages`, and `max_pages` itself."""
    sizes, n = [], 1
    while n < max_pages:
        sizes.append(n)
        n *= 2
    return sizes + [max(max_pages, 1)]


@dataclass(slots=True)
class _Bucket:
    """One bucket's input buffers, its static batch and (when captured) its graph and the outputs it writes."""

    meta: torch.Tensor  # [rows, 2 + pages] int64: position, slot, block table (padded with the trash page)
    host_meta: torch.Tensor  # its staging copy on the host (pinned on CUDA, so the copy does not wait)
    tokens: torch.Tensor  # [rows] int64
    batch: ForwardBatch
    layout: StaticStep
    copied: torch.cuda.Event | None = None  # recorded after the last copy out of host_meta
    graph: torch.cuda.CUDAGraph | None = None
    output: ForwardOutput | None = None


def capture_plan(device, backend, capture: bool | None, max_batch: int, num_slots: int,
                 batch_sizes=None) -> tuple[bool, list[int]]:
    """Whether graphs are captured (None: on CUDA when the backend's ops allow it; True off CUDA is an error)
    and the batch buckets: `batch_sizes` (clipped to the slots) or the default buckets up to the most
    sequences a step can hold."""
    if capture is None:
        capture = device.type == "cuda" and backend.cuda_graphs
    if capture and device.type != "cuda":
        raise ValueError(f"CUDA graphs need a CUDA device, the cache is on {device}")
    most = min(max_batch, num_slots)
    buckets = batch_buckets(most) if batch_sizes is None else sorted({min(int(s), most) for s in batch_sizes})
    if not buckets:
        raise ValueError("batch_sizes names no batch size to capture")
    return capture, buckets


class DecodeGraphs:
    """Decode steps of `model` over `cache` as static forwards, captured as CUDA graphs per bucket.

    `max_batch`: the most sequences a step holds (the engine's `max_num_seqs`); `max_pages`: the longest block
    table (the model length over the page size). `capture`: record and replay CUDA graphs (default: when the
    cache is on a CUDA device and the backend declares `cuda_graphs`); False runs the static forward eagerly.
    `batch_sizes`: the padded batch sizes (vLLM's `--cuda-graph-sizes`; default `batch_buckets`); a step of more
    sequences than the largest runs without a graph. `warm_up` captures every bucket ahead of the first step.
    """

    kind = "decode"  # what the progress bar and the log call its buckets

    def __init__(self, model: DeepseekV4ForCausalLM, cache: PagedKVCache, max_batch: int, max_pages: int,
                 capture: bool | None = None, batch_sizes=None) -> None:
        self.model, self.cache = model, cache
        self.device = cache.layers[0].storage.device if cache.layers else model.lm_head.weight.device
        self.capture, self.batch_buckets = capture_plan(self.device, model.backend, capture, max_batch,
                                                        cache.num_slots, batch_sizes)
        self.page_buckets = page_buckets(max_pages)
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self._pool = None  # the graphs' shared memory pool, made at the first capture
        main = model.state_owners()[model.main_state_owner]
        # (layer, stream attribute, ratio) of every compressed stream: the row counts the host advances
        self._streams = [(i, name, s.ratio) for i, spec in enumerate(main)
                         for name, s in (("compressor", spec.compressor), ("indexer", spec.indexer)) if s is not None]
        # a compressed layer, whose state reads the sequence's block table (None: a window-only model)
        self._table_layer = self._streams[0][0] if self._streams else None
        self.capture_seconds = 0.0

    def warm_up(self, progress: bool = True) -> int:
        """Make (and, with `capture`, compile and capture) every bucket, batch sizes x table widths, so that no
        step pays for it: the engine calls this at start-up, before it serves. Returns how many were made."""
        from tqdm.auto import tqdm

        todo = [(rows, pages) for rows in self.batch_buckets for pages in self.page_buckets
                if (rows, pages) not in self._buckets]
        began = time.perf_counter()
        for rows, pages in tqdm(todo, desc=f"capturing {self.kind} graphs" if self.capture else f"{self.kind} buckets",
                                unit="graph", disable=not progress or not todo):
            self._make_bucket(rows, pages)
        if todo:
            logger.info("%d %s buckets made in %.1f s (%s)", len(todo), self.kind, time.perf_counter() - began,
                        "captured" if self.capture else "eager")
        return len(todo)

    def supports(self, batch: ForwardBatch, states: list[SequenceState]) -> bool:
        """Whether this step can run as a static forward: one new token per sequence, every sequence paged in
        this cache and not journaling a speculative pass, at most `max_batch` sequences, tables that fit."""
        if not batch.chunks or len(batch.chunks) > self.batch_buckets[-1] or not self.cache.layers:
            return False
        if any(c.length != 1 for c in batch.chunks):
            return False
        pools, layer = self.cache.layers[0], self._table_layer
        for st in states:
            if st.layers[0].pools is not pools:
                return False
            if layer is not None:
                comp = st.layers[layer].compressor
                if comp.journal is not None or len(comp.rows.table) > self.page_buckets[-1]:
                    return False
        return True

    def forward(self, batch: ForwardBatch, states: list[SequenceState]) -> ForwardOutput:
        """Run a step `supports` accepted: logits [B, V] (and the last layer's streams) for its B sequences,
        with every state advanced as the ordinary forward would."""
        B, chunks = len(states), batch.chunks
        tables = [block_table(st.layers[self._table_layer or 0]) for st in states]
        page_size = self.cache.page_size
        for c, table in zip(chunks, tables):
            if self._table_layer is not None and c.end > len(table) * page_size:
                raise RuntimeError(f"block table holds {len(table)} pages, too few for position {c.start}")
        bucket = self._bucket_for(B, tables)
        meta = bucket.host_meta.numpy()
        meta[:B, 0] = [c.start for c in chunks]
        meta[:B, 1] = [st.layers[0].slot for st in states]
        meta[:, 2:] = self.cache.trash_page
        meta[B:, 0], meta[B:, 1] = 0, self.cache.pad_slot  # padding rows (a bigger step may have used them)
        for i, t in enumerate(tables):
            meta[i, 2 : 2 + len(t)] = t
        bucket.meta.copy_(bucket.host_meta, non_blocking=True)
        if bucket.copied is not None:
            bucket.copied.record()
        bucket.tokens[:B].copy_(batch.token_ids)
        if bucket.graph is not None:
            bucket.graph.replay()
            output = bucket.output
        else:
            output = self.model(bucket.batch, layout=bucket.layout)
        streams = self._streams
        for c, st in zip(chunks, states):  # what the graph leaves to the host: the row and token counts
            st.advance(c.end, streams)
        self._snapshots(chunks, states)
        return ForwardOutput(streams=output.streams[:B], logits=output.logits[:B])

    def _bucket_for(self, count: int, tables: list[list[int]]) -> _Bucket:
        """The bucket of `count` sequences with these block tables (made now if no warm-up made it), once its host
        staging buffer is free: the previous step's copy out of it has left (with the host a step ahead of the
        device, this waits until the device has reached the bucket's previous step, never for its results)."""
        pages = self.page_buckets[bisect.bisect_left(self.page_buckets, max(map(len, tables), default=1) or 1)]
        rows = self.batch_buckets[bisect.bisect_left(self.batch_buckets, count)]
        bucket = self._buckets.get((rows, pages)) or self._make_bucket(rows, pages)
        if bucket.copied is not None:
            bucket.copied.synchronize()
        return bucket

    def _snapshots(self, chunks, states) -> None:
        """The prefix-hit snapshots of the pages that this step's tokens ended, as `layouts.paged.PagedLayer._snapshot_windows`
        and the compressors take them, but from the state after the step: the window rows of [end - W, end) are
        the ring as written, the CSA overlap halves are the streams' `prev` rows."""
        snaps = [(st.layers[0].slot, c.end, page) for c, st in zip(chunks, states) for _, page in c.snapshots]
        if not snaps:
            return
        slot, end, page = to_device(snaps, torch.long, self.device).unbind(1)
        ring_rows: dict[int, torch.Tensor] = {}  # per window size (every layer's, as a rule): made once a step
        for pools in self.cache.layers:
            W = pools.spec.window
            rows = ring_rows.get(W)
            if rows is None:
                positions = end[:, None] - W + torch.arange(W, device=self.device)[None, :]
                rows = ring_rows[W] = slot[:, None] * W + positions % W
            pools.snap_window[page] = pools.storage[rows]
            for stream in (pools.compressor, pools.indexer):
                if stream is not None and stream.spec.overlap:
                    stream.snap_kv[page] = stream.prev_kv[slot]
                    stream.snap_gate[page] = stream.prev_gate[slot]

    def _make_bucket(self, rows: int, pages: int) -> _Bucket:
        cache, device = self.cache, self.device
        host_meta = torch.zeros((rows, 2 + pages), dtype=torch.long, pin_memory=device.type == "cuda")
        host_meta[:, 1] = cache.pad_slot  # padding rows keep these
        host_meta[:, 2:] = cache.trash_page
        meta = host_meta.to(device)
        tokens = torch.zeros(rows, dtype=torch.long, device=device)
        arange = torch.arange(rows, device=device)
        index = PagedIndex(slot=meta[:, 1:2], chunk_start=meta[:, 0:1], chunk_offset=arange[:, None],
                           tables=meta[:, 2:], query_tables=meta[:, 2:])
        static = StaticDecode(cache.layers, index, cache.pad_slot, cache.trash_page)
        batch = ForwardBatch(token_ids=tokens, positions=meta[:, 0], chunks=(), logits_indices=arange)
        layout = StaticStep(batch, static, self.model.backend)
        copied = torch.cuda.Event() if device.type == "cuda" else None
        bucket = self._buckets[(rows, pages)] = _Bucket(meta, host_meta, tokens, batch, layout, copied=copied)
        if self.capture:
            began = time.perf_counter()
            self._capture(bucket)
            self.capture_seconds += time.perf_counter() - began
            logger.info("captured the decode graph for %d rows, %d pages (%.2f s)", rows, pages,
                        time.perf_counter() - began)
        return bucket

    def _capture(self, bucket: _Bucket) -> None:
        """Record the bucket's static forward."""
        bucket.graph, bucket.output = self._record(lambda: self.model(bucket.batch, layout=bucket.layout))

    def _record(self, body):
        """(graph, what `body` returns) with `body`'s launches captured in the graphs' shared pool, after two warm-up
        runs on a side stream (they compile and tune the kernels for these shapes: nothing may compile inside a
        capture; the buckets' buffers hold padding rows then, whose writes touch nothing a sequence owns)."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(2):
                body()
        current.wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            result = body()
        return graph, result
