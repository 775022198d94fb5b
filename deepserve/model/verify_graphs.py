"""CUDA graphs for speculative verify steps: the target model over every sequence's base token and drafts in one
replay, and the rollback of the rejected drafts of every sequence in a second.

A verify step computes `width` = 1 + k tokens a sequence (the token sampled last step and the k drafts after it)
and keeps logits for all of them. Its kernels and shapes depend only on how many sequences it holds and how wide
their block tables are, so it is captured per bucket like a decode step (`cuda_graphs.DecodeGraphs`, whose buckets
and capture this reuses) over the static layout with `StaticDecode.width` rows a sequence (`layouts.static`): each
row's position, slot, chunk start and block table sit in fixed device buffers; the compressors gather a fixed-size
frontier per sequence and close every block its rows may close, writing the ones that did not close to the trash
page. A sequence with fewer drafts (DSpark's planner gives each its own count, 0 included) is padded up to
`width` rows: its rollback drops the padding rows' writes as it drops rejected drafts'.

The graph first saves the window-ring rows of the step's positions that the pass overwrites; the pass leaves the
compressors' open blocks and overlap states as they were. Once the host knows how many tokens each sequence keeps,
the rollback graph (`VerifyUndo`, the same bucket) puts back, in every layer at once and for every sequence
(those that keep everything included), the ring rows of the positions not kept, and sets the open block of the
last kept token and the overlap state after the last kept block from the pass's frontiers
(`StaticStep.frontiers`). The per-sequence undo of the eager verify step (`speculative.SequenceUndo`:
a few launches per layer and sequence) is not taken.

The prefix-hit snapshots of page boundaries inside a chunk are taken after the pass, from the rings, the saved
rows and the frontiers (`_chunk_snapshots`). Prompt chunks in the same step run eagerly beside the graph (the runner
merges the two outputs, `ModelRunner._verify_beside_prompts`). A step runs eagerly when a chunk's padded end has
no page yet or it holds more sequences than the largest bucket. With `capture=False` the same static forward and
rollback run eagerly: on the reference backend they give the paged verify step's and `SequenceUndo`'s bits
(tests/test_verify_graphs.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from .batch import ForwardBatch, to_device
from .cuda_graphs import DecodeGraphs, _Bucket
from .deepseek_v4 import DeepseekV4ForCausalLM, ForwardOutput
from .kv_cache import PagedKVCache
from .layouts import StaticDecode, StaticStep
from .layouts.paged import PagedIndex, block_table
from .state import SequenceState

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _VerifyBucket(_Bucket):
    """A verify bucket: besides the forward's buffers, the ring rows the pass overwrote (per main layer), the
    tokens each sequence keeps (`keep`, [sequences], and its host staging) and the rollback's graph."""

    rings: list | None = None
    keep: torch.Tensor | None = None
    host_keep: torch.Tensor | None = None
    undo_graph: torch.cuda.CUDAGraph | None = None


class VerifyGraphs(DecodeGraphs):
    """Verify steps of `width` tokens a sequence (1 + the proposer's k) over `cache`, as static forwards captured
    per (sequences, table width) bucket, with their rollback. Arguments as `DecodeGraphs`'; `batch_sizes` count
    sequences. `begin` gives the step's undo handles, `forward` runs it; the rollback runs once every handle has
    said how many tokens its sequence keeps."""

    kind = "verify"

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
        self.steps = 0  # verify steps run here (the rest ran eagerly)
        self._step: VerifyUndo | None = None  # the step in flight, between `begin` and its rollback

    def supports(self, chunks, states: list[SequenceState]) -> bool:
        """Whether a verify step of these chunks (a batch's `SeqChunk`s) and states can run as a static forward:
        at most `width` tokens a sequence (shorter chunks are padded up to it), every sequence paged in this cache
        with pages for `width` tokens, at most the largest bucket's sequences, tables that fit. Host-side checks
        only."""
        if not chunks or len(chunks) > self.batch_buckets[-1] or not self.cache.layers:
            return False
        if any(c.length > self.width for c in chunks):
            return False
        pools, layer, page_size = self.cache.layers[0], self._table_layer, self.cache.page_size
        for c, st in zip(chunks, states):
            if st.layers[0].pools is not pools:
                return False
            if layer is not None:
                table = st.layers[layer].compressor.rows.table
                if len(table) > self.page_buckets[-1] or c.start + self.width > len(table) * page_size:
                    return False
        return True

    def begin(self, batch: ForwardBatch, states: list[SequenceState]) -> list[VerifyUndo.Handle]:
        """The undo handles of a step `supports` accepted, one per sequence in batch order (`rollback(n)` /
        `commit()`, as `SequenceUndo`'s); `forward` runs the step next."""
        if self._step is not None and not self._step.done:  # (a step that raised before its handles reported)
            logger.warning("a verify graph step was left without its rollback; its sequences keep their counts")
        self._step = VerifyUndo(self, batch, states)
        return self._step.handles

    def forward(self, batch: ForwardBatch, states: list[SequenceState]) -> ForwardOutput:
        """Run the step `begin` opened: logits (and the last layer's streams) of the batch's rows in its order.
        The states advance once the handles have reported (the rollback sets their counts)."""
        step = self._step
        if step is None or step.done or step.batch is not batch:
            raise RuntimeError("a verify graph step starts with begin() on the same batch")
        B, chunks, width = len(states), batch.chunks, self.width
        tables = [block_table(st.layers[self._table_layer or 0]) for st in states]
        bucket = self._bucket_for(B, tables)
        seqs = bucket.keep.shape[0]
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
        full = all(c.length == width for c in chunks)
        # the batch's rows in the bucket: chunk s's row i at s * width + i (padding rows hold token 0)
        where = None if full else to_device([s * width + i for s, c in enumerate(chunks) for i in range(c.length)],
                                            torch.long, self.device)
        if full:
            bucket.tokens[: B * width].copy_(batch.token_ids)
        else:
            bucket.tokens.zero_()
            bucket.tokens[where] = batch.token_ids
        if bucket.graph is not None:
            bucket.graph.replay()
            output = bucket.output
        else:
            output = self._pass(bucket)
        step.bucket = bucket
        self.steps += 1
        self._chunk_snapshots(bucket, chunks)
        if full:
            return ForwardOutput(streams=output.streams[: B * width], logits=output.logits[: B * width])
        return ForwardOutput(streams=output.streams[where], logits=output.logits[where])

    # -- the graphs' bodies ----------------------------------------------------------------------------------------
    def _pass(self, bucket: _VerifyBucket):
        """Save the window-ring rows the pass overwrites, then the static forward (which leaves the compressors'
        open blocks and overlap states to `_rollback`)."""
        index, positions = bucket.layout.static.index, bucket.batch.positions
        slot = index.slot[:, 0]
        bucket.rings = [pools.storage[slot * pools.spec.window + positions % pools.spec.window]
                        for pools in self.cache.layers]
        return self.model(bucket.batch, layout=bucket.layout)

    def _rollback(self, bucket: _VerifyBucket) -> None:
        """Every sequence to its `keep` tokens: ring rows of later positions put back, the open block and the
        overlap state set from the pass's frontier (`CompressorState.rollback`'s arithmetic, batched; the pass
        left both as they were before it, so a sequence whose kept tokens close no block keeps its overlap)."""
        width, device = self.width, self.device
        index, positions = bucket.layout.static.index, bucket.batch.positions
        slot = index.slot[:, 0]
        keep = bucket.keep
        S = keep.shape[0]
        restore = (positions >= keep.repeat_interleave(width))[:, None]
        for pools, saved in zip(self.cache.layers, bucket.rings):
            W = pools.spec.window
            ring = slot * W + positions % W
            pools.storage.index_put_((ring,), torch.where(restore, saved, pools.storage[ring]))
        first_slot, start = slot.view(S, width)[:, 0], positions.view(S, width)[:, 0]
        ar = torch.arange(S, device=device)
        for layer, name, stream in self._stream_pools():
            m, d = stream.spec.ratio, stream.spec.dim
            f_kv, f_gate = bucket.layout.frontiers[(layer, name)]
            kept_rows = keep // m
            block = kept_rows * m - (start - start % m)  # the kept open block's first row in the frontier
            r = torch.arange(m, device=device)
            src = (block[:, None] + r[None, :]).clamp(max=f_kv.shape[1] - 1)
            open_slot = torch.where(r[None, :] < (keep % m)[:, None], first_slot[:, None], self.cache.pad_slot)
            stream.open_kv.index_put_((open_slot, r.expand(S, m)), f_kv[ar[:, None], src])
            stream.open_gate.index_put_((open_slot, r.expand(S, m)), f_gate[ar[:, None], src])
            if stream.spec.overlap:  # the last kept block's Ca half if it closed in the pass, else as it was
                closed = (kept_rows > start // m)[:, None, None]
                src = (block[:, None] - m + r[None, :]).clamp(min=0)
                stream.prev_kv.index_put_((first_slot,), torch.where(closed, f_kv[ar[:, None], src, :d],
                                                                     stream.prev_kv[first_slot]))
                stream.prev_gate.index_put_((first_slot,), torch.where(closed, f_gate[ar[:, None], src, :d],
                                                                       stream.prev_gate[first_slot]))

    def _chunk_snapshots(self, bucket: _VerifyBucket, chunks) -> None:
        """The prefix-hit snapshots of the page boundaries inside the step's chunks, after the pass and before
        any rollback, in one gather per layer and stream for all of them: the window rows before the boundary
        (the chunk's own from the ring as the pass wrote it, earlier ones from the ring or, where the pass
        overwrote them, from the rows it saved) and the Ca half of the CSA block that ends at the boundary (from
        the pass's frontier). What the paged verify step takes during its pass."""
        snaps = [(s, c.start, b, page) for s, c in enumerate(chunks) for b, page in c.snapshots]
        if not snaps:
            return
        width, device = self.width, self.device
        seq, start, boundary, page = to_device(snaps, torch.long, device).unbind(1)
        slot = bucket.meta[seq * width, 1]
        where: dict[tuple[int, int], tuple] = {}  # per window size and saved-rows length: made once a step
        for layer, pools in enumerate(self.cache.layers):
            W, saved_rows = pools.spec.window, bucket.rings[layer]
            key = (W, saved_rows.shape[0])
            if key not in where:
                q = boundary[:, None] - W + torch.arange(W, device=device)[None, :]  # the window's positions
                later = q + W  # the position whose ring row took q's
                saved = (q < start[:, None]) & (later >= start[:, None]) & (later < start[:, None] + width)
                saved_row = (seq[:, None] * width + later - start[:, None]).clamp(0, saved_rows.shape[0] - 1)
                where[key] = (saved[..., None], saved_row, slot[:, None] * W + q % W)
            saved, saved_row, ring_row = where[key]
            pools.snap_window[page] = torch.where(saved, saved_rows[saved_row], pools.storage[ring_row])
        for layer, name, stream in self._stream_pools():
            if not stream.spec.overlap:
                continue
            m, d = stream.spec.ratio, stream.spec.dim
            f_kv, f_gate = bucket.layout.frontiers[(layer, name)]
            rows = (boundary - m - (start - start % m))[:, None] + torch.arange(m, device=device)[None, :]
            stream.snap_kv[page] = f_kv[seq[:, None], rows, :d]
            stream.snap_gate[page] = f_gate[seq[:, None], rows, :d]

    def _stream_pools(self):
        for layer, name, _ in self._streams:
            yield layer, name, getattr(self.cache.layers[layer], name)

    def _finish(self, step: VerifyUndo) -> None:
        """The rollback of a step whose handles have all reported, then the host's counts."""
        bucket = step.bucket
        if bucket is None:
            raise RuntimeError("the verify step's handles reported before its forward ran")
        keep = bucket.host_keep.numpy()
        keep[:] = 0
        keep[: len(step.keep)] = step.keep
        bucket.keep.copy_(bucket.host_keep, non_blocking=True)
        if bucket.undo_graph is not None:
            bucket.undo_graph.replay()
        else:
            self._rollback(bucket)
        if bucket.copied is not None:
            bucket.copied.record()  # (both staging buffers are free once this point is reached)
        streams = self._streams
        for st, n in zip(step.states, step.keep):
            st.advance(n, streams)

    def _make_bucket(self, seqs: int, pages: int) -> _VerifyBucket:
        cache, device, width = self.cache, self.device, self.width
        rows = seqs * width
        pinned = device.type == "cuda"
        host_meta = torch.zeros((rows, 3 + pages), dtype=torch.long, pin_memory=pinned)
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
        copied = torch.cuda.Event() if pinned else None
        host_keep = torch.zeros(seqs, dtype=torch.long, pin_memory=pinned)
        bucket = self._buckets[(seqs, pages)] = _VerifyBucket(
            meta, host_meta, tokens, batch, layout, copied=copied, keep=host_keep.to(device), host_keep=host_keep)
        if self.capture:
            began = time.perf_counter()
            bucket.graph, bucket.output = self._record(lambda: self._pass(bucket))
            bucket.undo_graph, _ = self._record(lambda: self._rollback(bucket))
            self.capture_seconds += time.perf_counter() - began
            logger.info("captured the verify graphs for %d sequences x %d tokens, %d pages (%.2f s)", seqs, width,
                        pages, time.perf_counter() - began)
        return bucket


class VerifyUndo:
    """The undo of one verify graph step: a handle per sequence, which reports the tokens it keeps; when the last
    has reported, the graphs roll every sequence back at once (`VerifyGraphs._finish`)."""

    class Handle:
        __slots__ = ("owner", "i", "start", "length")

        def __init__(self, owner: VerifyUndo, i: int, start: int, length: int) -> None:
            self.owner, self.i, self.start, self.length = owner, i, start, length

        def rollback(self, num_tokens: int) -> None:
            """Keep the sequence's first `num_tokens` tokens (a length inside the pass)."""
            if not self.start < num_tokens <= self.start + self.length:
                raise ValueError(f"cannot roll back to {num_tokens}: the pass covered ({self.start}, "
                                 f"{self.start + self.length}]")
            self.owner.report(self.i, num_tokens)

        def commit(self) -> None:
            self.owner.report(self.i, self.start + self.length)

    def __init__(self, graphs: VerifyGraphs, batch: ForwardBatch, states: list[SequenceState]) -> None:
        self.graphs, self.batch, self.states = graphs, batch, states
        self.bucket: _VerifyBucket | None = None
        self.keep: list[int | None] = [None] * len(states)
        self.handles = [self.Handle(self, i, c.start, graphs.width) for i, c in enumerate(batch.chunks)]
        self._waiting, self.done = len(states), False

    def report(self, i: int, num_tokens: int) -> None:
        if self.done or self.keep[i] is not None:
            raise RuntimeError(f"sequence {i} of the verify step has reported already")
        self.keep[i] = num_tokens
        self._waiting -= 1
        if not self._waiting:
            self.done = True
            self.graphs._finish(self)
