"""The optional and composed ops of a `Backend`: what a backend may implement to go faster, never what it must
implement to be correct.

`deepserve.core.interfaces.Backend` holds the maths ops every accelerator implements (GEMMs, norms, RoPE, the
mHC sites, sparse attention, the indexer, the compressor's pooling, the MoE, sampling). The ops here have
defaults: a composed op (`rms_norm_rope`, `hc_pre_norm`, `sparse_attention_rope`, ...) defaults to the maths ops
it stands for, in order; an optional fused op (`route_hidden`, `moe_with_shared`, `compress_decode`, the paged
decode ops, `decoder_stack`) defaults to "not here" (None or False), and the model then runs the maths ops; an op over
packed KV rows (`sparse_attention_packed`, `indexer_topk_packed`) defaults to decoding the rows it reads, then the
maths op. A backend overrides one only with a kernel that gives the same result. This module imports nothing from
torch at run time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

# annotations only; on one line so that nothing in deepserve/core reads as a torch import
if TYPE_CHECKING: from torch import Tensor  # noqa: E701


@dataclass(frozen=True, slots=True)
class VisibleRows:
    """A query's compressed index list given by its rule rather than its entries: the query at position p sees
    its sequence's compressed rows 0, 1, ..., (p + 1) // ratio - 1 in that order, in `width` columns (-1 past
    its own). What a fixed-shape decode step's compressor gives the attention when nothing is chosen among the
    rows (HCA layers; CSA layers while the indexer's top-k holds every row), so that a backend's key-row kernel
    can form the list itself (`Backend.decode_key_rows`) instead of reading one made by a few small launches."""

    ratio: int
    width: int


class FusedOps:
    """The optional and composed ops, with their defaults (see the module docstring). Mixed into `Backend`: the
    composed defaults call its maths ops."""

    def rms_norm_rope(
        self, x: Tensor, weight: Tensor | None, eps: float, positions: Tensor, inv_freq: Tensor
    ) -> Tensor:
        """`rms_norm(x, weight, eps)` then RoPE (`apply_rope`) on the result: a backend may do both in one launch.
        Returns a new tensor."""
        return self.apply_rope(self.rms_norm(x, weight, eps), positions, inv_freq, inplace=True)

    def qk_norm_rope(
        self, q: Tensor, kv: Tensor, kv_weight: Tensor, eps: float, positions: Tensor, inv_freq: Tensor
    ) -> tuple[Tensor, Tensor]:
        """`rms_norm_rope` of the queries q [T, H, d] (no weight) and of the key kv [T, d] (with `kv_weight`):
        (q, kv), new tensors. One op, so that a backend can do both in one launch; the default is the two ops."""
        return (self.rms_norm_rope(q, None, eps, positions, inv_freq),
                self.rms_norm_rope(kv, kv_weight, eps, positions, inv_freq))

    def hc_pre_norm(
        self, streams: Tensor, fn: Tensor, base: Tensor, scale: Tensor, iters: int, hc_eps: float, norm_eps: float,
        weight: Tensor, eps: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """`hc_pre`, then the block's input RMSNorm (`rms_norm(collapsed, weight, eps)`): (normed [T, D], post,
        comb). One op, so that a backend can norm the collapsed rows before storing them; the default is the
        two ops."""
        x, post, comb = self.hc_pre(streams, fn, base, scale, iters, hc_eps, norm_eps)
        return self.rms_norm(x, weight, eps), post, comb

    def hc_head_norm(
        self, streams: Tensor, fn: Tensor, base: Tensor, scale: Tensor, hc_eps: float, norm_eps: float,
        weight: Tensor, eps: float,
    ) -> Tensor:
        """`hc_head`, then the model's final RMSNorm (`rms_norm(collapsed, weight, eps)`). One op, so that a
        backend can norm the collapsed rows before storing them; the default is the two ops."""
        return self.rms_norm(self.hc_head(streams, fn, base, scale, hc_eps, norm_eps), weight, eps)

    def sparse_attention_rope(self, q: Tensor, kv: Tensor, indices: Tensor, sinks: Tensor, scale: float,
                              positions: Tensor, inv_freq: Tensor) -> Tensor:
        """`sparse_attention`, then its output's rotary dims turned back by each query's position (V4 rotates
        the attention output by the inverse RoPE before the output projection). One op, so that a backend can
        turn the output before storing it; the default is the two ops."""
        out = self.sparse_attention(q, kv, indices, sinks, scale)
        return self.apply_rope(out, positions, inv_freq, inverse=True, inplace=True)

    def rms_norm_linear(self, x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor) -> Tensor:
        """`linear(rms_norm(x, norm_weight, eps), weight)`, the normed rows not kept. One op, so that a backend
        can norm the rows as its projection reads them; the default is the two ops."""
        return self.linear(self.rms_norm(x, norm_weight, eps), weight)

    # -- weights kept as stored (FP8 / FP4 blocks and their scales: `deepserve.model.quant.QuantizedWeight`) ----
    # The defaults dequantize (`weight.dequantize(x.dtype)`: fp32 then x's dtype, as the loader does) and run the
    # maths op: the oracle, bitwise the model loaded with `--quantization none`. A backend with FP8/FP4 kernels
    # multiplies the stored form instead.

    def quantized_linear(self, x: Tensor, weight) -> Tensor:
        """`linear(x, W)` for a stored weight W [N, K]: x [T, K] -> [T, N] in x's dtype."""
        return self.linear(x, weight.dequantize(x.dtype))

    def quantized_grouped_linear(self, x: Tensor, weight) -> Tensor:
        """`grouped_linear(x, W.view(G, N / G, K))` for a stored weight W [N, K]: x [T, G, K] -> [T, G, N / G]."""
        w = weight.dequantize(x.dtype)
        return self.grouped_linear(x, w.view(x.shape[1], -1, x.shape[-1]))

    def quantized_moe_experts(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w13, w2,
                              limit: float) -> Tensor:
        """`moe_experts` with stored expert stacks w13 [E, 2I, D] and w2 [E, D, I] (FP4 routed experts)."""
        return self.moe_experts(x, topk_ids, topk_weights, w13.dequantize(x.dtype), w2.dequantize(x.dtype), limit)

    # -- KV rows kept packed (`--kv-cache-dtype fp8`: a pool's `deepserve.model.kv_precision.RowCodec`) ----------
    # The defaults decode the rows a step reads (`codec.gather`, `codec.gather_pages`) and run the op over values;
    # a backend with kernels that read the stored form reads the pools in place instead.

    def sparse_attention_packed(self, q: Tensor, storage: Tensor, codec, indices: Tensor, sinks: Tensor,
                                scale: float, positions: Tensor, inv_freq: Tensor, fixed_shape: bool = False) -> Tensor:
        """`sparse_attention_rope` over key rows kept in `codec`'s stored form: storage [N, codec.stored_width],
        indices [T, K] rows of it (entries < 0 ignored). `fixed_shape`: no shape may depend on the values of
        `indices` (a CUDA graph's step). Returns [T, H, d] in `q.dtype`."""
        pool, rows = codec.gather(storage, indices, fixed_shape)
        return self.sparse_attention_rope(q, pool, rows, sinks, scale, positions, inv_freq)

    def indexer_topk_packed(self, q: Tensor, weights: Tensor, pages: Tensor, codec, tables: Tensor,
                            key_count: Tensor, topk: int, query_rows: Tensor | None = None) -> Tensor:
        """`indexer_topk_paged` over key pages kept in `codec`'s stored form (pages [num_pages, rpp,
        codec.stored_width]), query t reading row `query_rows[t]` of tables [B, P] (row t when None): [T, topk]
        int64 key numbers within the query's own keys, ascending, -1 unused. Shapes from T, B, P and rpp only."""
        decoded, numbered = codec.gather_pages(pages, tables, query_rows)
        return self.indexer_topk_paged(q, weights, decoded, numbered, key_count, topk)

    def store_packed_rows(self, storage: Tensor, codec, rows: Tensor, dest: Tensor | None = None,
                          base: int = 0) -> bool:
        """Optional fused op: rows [n, codec.width] in `codec`'s stored form into storage rows `dest` [n] (rows
        base .. base + n without dest) of storage [N, codec.stored_width], bit for bit `codec.encode`'s bytes. False
        (the default): not here; the caller encodes and scatters with torch ops (`layouts.paged.store_rows`)."""
        return False

    def linear_fp32(self, x: Tensor, weight: Tensor) -> Tensor | None:
        """`x @ weight.T` as fp32 [T, N] straight from low-precision (bf16/fp16) `x` and `weight` of one dtype, with
        fp32 accumulation: the same products as upcasting both (the LM head, the MoE router). None (the default)
        when the backend cannot; the model then multiplies fp32 copies."""
        return None

    def decoder_stack(self):
        """Optional fused step: the backend's own run of a V4 decoder stack and its final head, for work that
        crosses layers (the NVIDIA backend starts each mHC site's mix in the kernel that ends the site before it:
        `deepserve.backends.nvidia.fused_stack`). A function `run(body, batch, layout, logits_rows)` -> (last
        streams [T, n, D], final hidden [L, D] of `logits_rows`, or of every row in order when that is None),
        equal to the model's own loop (`DeepseekV4Body.forward`, `final_hidden`) up to the backend's rounding;
        it calls the model's layers for everything else. None (the default): the model runs its own loop.
        Called once, when the model is built."""
        return None

    def route_hidden(self, x: Tensor, weight: Tensor, bias: Tensor | None, tid2eid: Tensor | None,
                     token_ids: Tensor, top_k: int, scale: float):
        """Optional fused op: the router's logits `linear_fp32(x, weight)` and `route` on them in one, where hash
        layers give their table `tid2eid` [vocab, k] and the step's `token_ids` [T] instead of `hash_ids`.
        Returns (ids, weights) as `Backend.route` does, or None (the default) when the backend has no kernel for it."""
        return None

    def moe_with_shared(
        self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor, limit: float,
        shared_w13: Tensor, shared_w2: Tensor,
    ) -> Tensor | None:
        """Optional fused op: `moe_experts(x, topk_ids, topk_weights, w13, w2, limit)` plus the shared expert
        (`shared_w13` [2I, D]: gate rows then up rows; `shared_w2` [D, I]; the same clamped SwiGLU, weight 1) as
        one [T, D] sum. None (the default) when the backend has no kernel for these shapes; the model then runs
        the routed and the shared experts apart and adds them."""
        return None

    def quantized_moe_with_shared(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w13, w2, limit: float,
                                  shared_w13, shared_w2) -> Tensor | None:
        """Optional fused op: `moe_with_shared` with every weight kept as stored (`QuantizedWeight`s: the routed
        stacks w13 [E, 2I, D] and w2 [E, D, I], the shared expert's stacked gate/up [2I, D] and down [D, I]).
        None (the default) when the backend has no kernel for these; the model runs the parts apart."""
        return None

    def compress_decode(
        self, kv: Tensor, gate: Tensor, position_bias: Tensor, positions: Tensor, slot: Tensor, tables: Tensor,
        open_kv: Tensor, open_gate: Tensor, prev_kv: Tensor | None, prev_gate: Tensor | None, rows: Tensor,
        norm_weight: Tensor, inv_freq: Tensor, eps: float, codec=None, turn: Tensor | None = None,
    ) -> bool:
        """Optional fused op: one decode token per row into one compressed stream, in place. Row b's token (at
        `positions[b]`, in slot `slot[b]`, block table `tables[b]`) has raw projections `kv[b]`, `gate[b]`
        ([B, F]); its gate gets `position_bias[position % ratio]`. A token that does not close its block is
        stored in `open_kv/open_gate[slot, position % ratio]`; one that closes it pools the block (with
        `prev_kv/prev_gate`, the previous block's Ca halves, when given: CSA overlap) by a per-channel softmax over
        the slots, RMS-norms it with `norm_weight`, rotates it at the block's first position with `inv_freq`,
        writes it to `rows[page, row % rpp]` and (overlap) leaves this block's Ca halves in `prev_*`. Exactly
        `deepserve.model.layouts.static.emit_static`'s effect. `codec`: the pool's `RowCodec` where its rows are
        kept packed (the FP8 KV cache): the row is encoded as it is stored, bit for bit `codec.encode` of the fp32
        row (indexer keys turned by `turn` [D, D], the Hadamard matrix, first). Returns False (the default:
        nothing done) when the backend has no kernel for it; the model then runs its own torch ops."""
        return False

    def paged_key_rows(
        self, positions: Tensor, chunk_start: Tensor, chunk_offset: Tensor, slot: Tensor, tables: Tensor,
        compressed: Tensor | None, window: int, rows_per_page: int, comp_base: int, scratch_base: int,
    ) -> Tensor | None:
        """Optional fused op: the storage rows each query of a decode or verify step attends to, [T, W + K] int64
        (`deepserve.model.layouts.paged.paged_keys`): its W window keys (position p before its chunk
        at `slot * W + p % W`, its chunk's rows at `scratch_base + chunk_offset + p - chunk_start`, -1 before 0),
        then its K compressed rows r (`compressed`, -1 = none) at `comp_base + tables[t, r // rpp] * rpp + r %
        rpp`. chunk_start, chunk_offset and slot are [T, 1]. None (the default) when the backend has no kernel."""
        return None

    def decode_key_rows(
        self, storage: Tensor, kv: Tensor, positions: Tensor, slot: Tensor, tables: Tensor,
        compressed: Tensor | VisibleRows | None, window: int, rows_per_page: int, comp_base: int,
    ) -> Tensor | None:
        """Optional fused op for a step of one new token per row (a fixed-shape decode step): row t of kv [T, d]
        into its sequence's window ring (storage row `slot[t] * window + positions[t] % window`, which held a
        position no query of the step can see), then `paged_key_rows` for it, every window key now in the ring:
        [T, W + K] int64, the W window keys of position p at `slot * W + q % W` for q in (p - W, p] (-1 before
        0), then the K compressed rows (`compressed` [T, K] with -1 = none, or their rule, `VisibleRows`) at
        `comp_base + tables[t, r // rpp] * rpp + r % rpp`. positions and slot are [T]. None (the default) when
        the backend has no kernel: the model then writes the step's rows to the scratch region, forms the list
        with `paged_key_rows` or torch, and writes the rings after the attention."""
        return None

    def paged_window_write(self, storage: Tensor, kv: Tensor, positions: Tensor, slot: Tensor, window: int) -> bool:
        """Optional fused op: row t of kv [T, d] into its sequence's window ring, storage row `slot[t] * window +
        positions[t] % window` (the caller's rows name distinct ring slots). False (the default) when the backend
        has no kernel for it; the caller then scatters with torch."""
        return False

    #: whether a decode step of this backend's ops can be captured as a CUDA graph and replayed: no op syncs
    #: with the host or sizes an output from tensor values, and `indexer_topk_paged` is implemented
    cuda_graphs: bool = False

    def indexer_topk_paged(
        self, q: Tensor, weights: Tensor, pages: Tensor, tables: Tensor, key_count: Tensor, topk: int
    ) -> Tensor:
        """`indexer_topk` over keys kept in pages, for fixed-shape decode steps: query t's key r is
        `pages[tables[t, r // rpp], r % rpp]` (pages [num_pages, rpp, Di], tables [T, P] int64) for r <
        `key_count[t]`. Returns [T, topk] int64 key numbers r (not rows of `pages`), ascending, -1 unused. Its
        shapes depend on T, P and rpp only. Optional: a backend without it decodes without fixed-shape steps."""
        raise NotImplementedError(f"the {self.name} backend has no paged indexer (indexer_topk_paged)")
