"""CUDA graphs for speculative verify steps: the target model over every sequence's base token and drafts in one
replay.

A verify step computes `width` = 1 + k tokens a sequence (the token sampled last step and the k drafts after it)
and keeps logits for all of them. With the same k for every sequence of the step, its kernels and shapes depend
only on how many sequences it holds and how wide their block tables are, so it is captured per bucket like a
decode step (`cuda_graphs.DecodeGraphs`, whose buckets, capture and host bookkeeping this reuses) over the static
layout with `StaticDecode.width` rows a sequence (`layouts.static`): each row's position, slot, chunk start and
block table sit in fixed device buffers; the compressors gather a fixed-size frontier per sequence and close every
block its rows may close, writing the ones that did not close to the trash page.

The undo of each sequence (`speculative.SequenceUndo`: ring rows saved, journals begun) is taken before the step,
eagerly, as for the eager verify step; after the replay the host advances the row and token counts and hands each
compressor's journal its frontier (views of the graph's output, valid until the next replay: the rollback that
reads them runs in the same step). A step the graphs do not take runs eagerly: drafts of different lengths (DSpark's
planner), prompt chunks or plain decode tokens beside the verify chunks, a chunk that crosses a page boundary (its
prefix-hit snapshot is taken inside the chunk), more sequences than the largest bucket. With `capture=False` the
same static forward runs eagerly: on the reference backend it gives the paged verify step's bits
(tests/test_verify_graphs.py).
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from .batch import ForwardBatch
from .cuda_graphs import DecodeGraphs, _Bucket
from .deepseek_v4 import DeepseekV4ForCausalLM, ForwardOutput
from .kv_cache import PagedKVCache
from .layouts import StaticDecode, StaticStep
from .layouts.paged import PagedIndex, block_table
from .state import SequenceState

logger = logging.getLogger(__name__)


class VerifyGraphs(DecodeGraphs):
    """Verify steps of `width` tokens a sequence (1 + the proposer's k) over `cache`, as static forwards captured
    per (sequences, table width) bucket. Arguments as `DecodeGraphs`'; `batch_sizes` count sequences."""

    def __init__(self, model: DeepseekV4ForCausalLM, cache: PagedKVCache, max_batch: int, max_pages: int, width: int,
                 capture: bool | None = None, batch_sizes=None) -> None:
        if width < 2:
            raise ValueError(f"a verify step holds a token and at least one draft a sequence, got width {width}")
        windows = [spec.window for spec in model.state_owners()[model.main_state_owner]]
        if windows and width > min(windows):
            raise ValueError(f"verify width {width} exceeds the sliding window ({min(windows)})")
        if cache.layers and max_batch * width > cache.layers[0].scratch_rows:
            max_batch = cache.layers[0].scratch_rows // width  # a step's rows must fit the scratch region
        super().__init__(model, cache, max_batch, max_pages, capture, batch_sizes)
        self.width = width
        self._ratios = {name: ratio for _, name, ratio in self._streams}

    def supports(self, batch: ForwardBatch, states: list[SequenceState]) -> bool:
        """Whether this verify step can run as a static forward: `width` tokens for every sequence, no page
        boundary inside a chunk, every sequence paged in this cache and journaling its pass (its undo taken), at
        most the largest bucket's sequences, tables that fit."""
        if not batch.chunks or len(batch.chunks) > self.batch_buckets[-1] or not self.cache.layers:
            return False
        if any(c.length != self.width or c.snapshots for c in batch.chunks):
            return False
        pools, layer = self.cache.layers[0], self._table_layer
        for st in states:
            if st.layers[0].pools is not pools:
                return False
            if layer is not None:
                comp = st.layers[layer].compressor
                if comp.journal is None or len(comp.rows.table) > self.page_buckets[-1]:
                    return False
        return True

    def forward(self, batch: ForwardBatch, states: list[SequenceState]) -> ForwardOutput:
        """Run a step `supports` accepted: logits [B * width, V] (and the last layer's streams) in the batch's row
        order, every state advanced past its chunk and every journal holding the pass's frontier."""
        B, chunks, width = len(states), batch.chunks, self.width
        tables = [block_table(st.layers[self._table_layer or 0]) for st in states]
        P = self.page_buckets[bisect.bisect_left(self.page_buckets, max(map(len, tables), default=1) or 1)]
        seqs = self.batch_buckets[bisect.bisect_left(self.batch_buckets, B)]
        page_size = self.cache.page_size
        for c, table in zip(chunks, tables):
            if self._table_layer is not None and c.end > len(table) * page_size:
                raise RuntimeError(f"block table holds {len(table)} pages, too few for position {c.end - 1}")
        bucket = self._buckets.get((seqs, P)) or self._make_bucket(seqs, P)
        if bucket.copied is not None:
            bucket.copied.synchronize()
        meta = bucket.host_meta.numpy().reshape(seqs, width, -1)
        j = list(range(width))
        meta[:, :, 3:] = self.cache.trash_page
        for s, (c, st, table) in enumerate(zip(chunks, states, tables)):
            meta[s, :, 0] = [c.start + i for i in j]
            meta[s, :, 1] = st.layers[0].slot
            meta[s, :, 2] = c.start
            meta[s, :, 3 : 3 + len(table)] = table
        meta[B:, :, 0], meta[B:, :, 1], meta[B:, :, 2] = j, self.cache.pad_slot, 0  # padding sequences
        bucket.meta.copy_(bucket.host_meta, non_blocking=True)
        if bucket.copied is not None:
            bucket.copied.record()
        bucket.tokens[: B * width].copy_(batch.token_ids)
        if bucket.graph is not None:
            bucket.graph.replay()
            output = bucket.output
        else:
            output = self.model(bucket.batch, layout=bucket.layout)
        frontiers = bucket.layout.frontiers
        for s, (c, st) in enumerate(zip(chunks, states)):  # what the graph leaves to the host
            for layer, name, ratio in self._streams:
                comp = getattr(st.layers[layer], name)
                comp.rows.num_rows = c.end // ratio
                f_kv, f_gate = frontiers[(layer, name)]
                held = c.start % ratio
                comp.record(c.start - held, f_kv[s, : held + width], f_gate[s, : held + width])
            st.num_tokens = c.end
        return ForwardOutput(streams=output.streams[: B * width], logits=output.logits[: B * width])

    def _make_bucket(self, seqs: int, pages: int) -> _Bucket:
        cache, device, width = self.cache, self.device, self.width
        rows = seqs * width
        host_meta = torch.zeros((rows, 3 + pages), dtype=torch.long, pin_memory=device.type == "cuda")
        host_meta[:, 0] = torch.arange(width).repeat(seqs)
        host_meta[:, 1] = cache.pad_slot
        host_meta[:, 3:] = cache.trash_page
        meta = host_meta.to(device)
        tokens = torch.zeros(rows, dtype=torch.long, device=device)
        offset = (torch.arange(rows, device=device) // width * width)[:, None]  # each row's chunk's first row
        index = PagedIndex(slot=meta[:, 1:2], chunk_start=meta[:, 2:3], chunk_offset=offset, tables=meta[:, 3:],
                           query_tables=meta[:, 3:])
        static = StaticDecode(cache.layers, index, cache.pad_slot, cache.trash_page, width=width)
        batch = ForwardBatch(token_ids=tokens, positions=meta[:, 0], chunks=(),
                             logits_indices=torch.arange(rows, device=device))
        layout = StaticStep(batch, static, self.model.backend)
        copied = torch.cuda.Event() if device.type == "cuda" else None
        bucket = self._buckets[(seqs, pages)] = _Bucket(meta, host_meta, tokens, batch, layout, copied=copied)
        if self.capture:
            began = time.perf_counter()
            self._capture(bucket)
            self.capture_seconds += time.perf_counter() - began
            logger.info("captured the verify graph for %d sequences x %d tokens, %d pages (%.2f s)", seqs, width,
                        pages, time.perf_counter() - began)
        return bucket
