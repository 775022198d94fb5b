"""CUDA graphs for the MTP drafter's chain: drafts 2..k of every drafting sequence in one replay.

After each target step the MTP proposer (`deepserve.plugins.speculative.mtp`) catches its block up on the kept
tokens (one varlen pass, whose shape follows the kept counts, so it stays eager) and takes draft 1 from that
pass's last row of each drafting sequence. Drafts 2..k are a chain of k - 1 single-token passes of the block,
each one position further on its own output streams and its own previous draft: a fixed sequence of kernels whose
shapes depend only on how many sequences draft. Eagerly it costs k - 1 launch-bound forwards a step; here it is
captured once per batch bucket (the sequences padded up to the next of `batch_sizes`) as one graph that

1. saves the window-ring rows the chain will overwrite (positions L .. L + k - 2 of each sequence, L being its
   committed length),
2. runs the k - 1 passes as static forwards (`layouts.StaticStep` over the MTP block's pools: one token a row,
   positions and slots in fixed device buffers, padding rows in the cache's padding slot), each followed by the
   greedy draw (the argmax with the lowest id on ties, as `MTPProposer._draw`) and, for DSpark, the draft's
   confidence,
3. puts the saved ring rows back: the chain's writes are speculative, the next step's catch-up starts from
   committed state (what the eager chain does with `WindowRing.save` / `undo`).

Only greedy drafting runs here (a sampled request draws from q under its own sampling parameters, and keeps q for
the rejection rule): a step with any sampled drafter, or more sequences than the largest bucket, runs the eager
chain. With `capture=False` the same static passes run eagerly: on the reference backend they give the eager
chain's bits (tests/test_spec_graphs.py), which is how the graph body is checked without a GPU. Outputs are valid
until the next replay of any bucket (the buckets share one memory pool); `run` returns copies.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch

from deepserve.sampling import argmax_lowest

from .batch import ForwardBatch
from .cuda_graphs import capture_plan
from .kv_cache import PagedKVCache
from .layouts import StaticDecode, StaticStep
from .layouts.paged import PagedIndex

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _ChainBucket:
    """One bucket's input buffers, the static layouts of its k - 1 passes and (when captured) its graph."""

    meta: torch.Tensor  # [rows, k] int64: positions L .. L + k - 2 (one column a pass), then the slot
    host_meta: torch.Tensor  # its staging copy on the host (pinned on CUDA)
    tokens: torch.Tensor  # [k, rows] int64: row 0 draft 1 (the input), row j + 1 the draft pass j makes
    prev: torch.Tensor  # [rows, n, D]: the streams of the catch-up's last row (the input)
    confidences: torch.Tensor  # [k - 1, rows] fp32: the confidences of drafts 2..k (with confidences)
    batches: list[ForwardBatch]
    layouts: list[StaticStep]
    copied: torch.cuda.Event | None = None  # recorded after the last copy out of host_meta
    graph: torch.cuda.CUDAGraph | None = None


class DraftChainGraphs:
    """The chain of `proposer` (an `MTPProposer` drafting `num_speculative_tokens` = k >= 2 tokens) over the MTP
    pools of `cache`, as static forwards per batch bucket, captured as CUDA graphs when `capture` (default: the
    cache is on CUDA and the backend declares `cuda_graphs`).

    `max_batch`: the most sequences a step drafts for (the engine's `max_num_seqs`); `batch_sizes`: the padded
    batch sizes (vLLM's `--cuda-graph-sizes`, as for the decode graphs; default `cuda_graphs.batch_buckets`).
    """

    def __init__(self, proposer, cache: PagedKVCache, max_batch: int, capture: bool | None = None,
                 batch_sizes=None) -> None:
        model, k = proposer.model, proposer.num_speculative_tokens
        if k < 2:
            raise ValueError(f"a draft chain needs num_speculative_tokens >= 2 (draft 1 comes from the catch-up), "
                             f"got {k}")
        owner = proposer.state_owners[0]
        if owner not in cache.pools:
            raise ValueError(f"the cache holds no {owner!r} pools: build it with the proposer's state owners")
        self.proposer, self.model, self.cache, self.k = proposer, model, cache, k
        self.pools = cache.pools[owner][proposer.depth]
        self.device = self.pools.storage.device
        self.capture, self.batch_buckets = capture_plan(self.device, model.backend, capture, max_batch,
                                                        cache.num_slots, batch_sizes)
        self._buckets: dict[int, _ChainBucket] = {}
        self._pool = None
        self.capture_seconds = 0.0

    def warm_up(self, progress: bool = True) -> int:
        """Make (and, with `capture`, compile and capture) every bucket: the engine calls this at start-up.
        Returns how many were made."""
        from tqdm.auto import tqdm

        todo = [rows for rows in self.batch_buckets if rows not in self._buckets]
        began = time.perf_counter()
        for rows in tqdm(todo, desc="capturing draft-chain graphs" if self.capture else "draft-chain buckets",
                         unit="graph", disable=not progress or not todo):
            self._make_bucket(rows)
        if todo:
            logger.info("%d draft-chain buckets made in %.1f s (%s)", len(todo), time.perf_counter() - began,
                        "captured" if self.capture else "eager")
        return len(todo)

    def supports(self, num_drafting: int, all_greedy: bool) -> bool:
        """Whether a chain of `num_drafting` sequences runs here: every drafter greedy, within the largest bucket."""
        return all_greedy and 0 < num_drafting <= self.batch_buckets[-1]

    def run(self, first_tokens: torch.Tensor, prev_streams: torch.Tensor, lengths: list[int], slots: list[int]):
        """Drafts 2..k for D sequences: `first_tokens` [D] (draft 1), `prev_streams` [D, n, D_model] (the
        catch-up's last row of each), `lengths` (each sequence's committed length L), `slots` (their cache slots).
        Returns (tokens [D, k - 1] int64, confidences [D, k - 1] fp32 or None), copies of the bucket's outputs.
        The MTP rings are left as they were; the caller keeps `mtp_num_tokens` at L."""
        D = len(lengths)
        rows = self.batch_buckets[bisect.bisect_left(self.batch_buckets, D)]
        bucket = self._buckets.get(rows) or self._make_bucket(rows)
        if bucket.copied is not None:
            bucket.copied.synchronize()  # the previous replay's copy has left the staging buffer
        meta = bucket.host_meta.numpy()
        for j in range(self.k - 1):
            meta[:D, j] = [n + j for n in lengths]
            meta[D:, j] = j  # padding rows: positions 0.., in the padding slot
        meta[:D, -1] = slots
        meta[D:, -1] = self.cache.pad_slot
        bucket.meta.copy_(bucket.host_meta, non_blocking=True)
        if bucket.copied is not None:
            bucket.copied.record()
        bucket.tokens[0, :D].copy_(first_tokens)
        bucket.prev[:D].copy_(prev_streams)
        if bucket.graph is not None:
            bucket.graph.replay()
        else:
            self._chain(bucket)
        tokens = bucket.tokens[1:, :D].t().clone()
        confidences = bucket.confidences[:, :D].t().clone() if self.proposer.with_confidences else None
        return tokens, confidences

    def _chain(self, bucket: _ChainBucket) -> None:
        """The graph's body: save the rings, k - 1 passes with their draws, put the rings back."""
        W = self.pools.spec.window
        storage, slot = self.pools.storage, bucket.meta[:, -1]
        ring_rows = slot[:, None] * W + bucket.meta[:, :-1] % W  # [rows, k - 1]: the rows the passes write
        saved = storage[ring_rows]  # advanced indexing: a copy
        prev = bucket.prev
        for j, (batch, layout) in enumerate(zip(bucket.batches, bucket.layouts)):
            out = self.model.mtp_forward(self.proposer.depth, batch, (), prev, layout=layout)
            bucket.tokens[j + 1].copy_(argmax_lowest(out.logits))
            if self.proposer.with_confidences:
                bucket.confidences[j].copy_(self.proposer._confidence(out.hidden, out.logits, j + 1))
            prev = out.streams
        storage[ring_rows] = saved

    def _make_bucket(self, rows: int) -> _ChainBucket:
        cache, device, k = self.cache, self.device, self.k
        host_meta = torch.zeros((rows, k), dtype=torch.long, pin_memory=device.type == "cuda")
        host_meta[:, : k - 1] = torch.arange(k - 1)
        host_meta[:, -1] = cache.pad_slot
        meta = host_meta.to(device)
        tokens = torch.zeros((k, rows), dtype=torch.long, device=device)
        cfg = self.model.cfg
        prev = torch.zeros((rows, cfg.hc_mult, cfg.hidden_size), dtype=self.model.model.embed_tokens.weight.dtype,
                           device=device)
        confidences = torch.zeros((k - 1, rows), dtype=torch.float32, device=device)
        arange = torch.arange(rows, device=device)
        no_table = torch.full((rows, 1), cache.trash_page, dtype=torch.long, device=device)  # a window-only block
        batches, layouts = [], []
        for j in range(k - 1):
            index = PagedIndex(slot=meta[:, -1:], chunk_start=meta[:, j : j + 1], chunk_offset=arange[:, None],
                               tables=no_table, query_tables=no_table)
            static = StaticDecode([self.pools], index, cache.pad_slot, cache.trash_page)
            batch = ForwardBatch(token_ids=tokens[j], positions=meta[:, j], chunks=(), logits_indices=arange)
            batches.append(batch)
            layouts.append(StaticStep(batch, static, self.model.backend))
        copied = torch.cuda.Event() if device.type == "cuda" else None
        bucket = self._buckets[rows] = _ChainBucket(meta, host_meta, tokens, prev, confidences, batches, layouts,
                                                    copied=copied)
        if self.capture:
            began = time.perf_counter()
            self._capture(bucket)
            self.capture_seconds += time.perf_counter() - began
            logger.info("captured the draft-chain graph for %d rows (%.2f s)", rows, time.perf_counter() - began)
        return bucket

    def _capture(self, bucket: _ChainBucket) -> None:
        """Warm up on the padding rows (nothing may compile inside a capture), then record the chain."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(2):
                self._chain(bucket)
        current.wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._chain(bucket)
        bucket.graph = graph
