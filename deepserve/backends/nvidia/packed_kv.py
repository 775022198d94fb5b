"""The NVIDIA backend's ops over the FP8 KV cache's packed rows (`--kv-cache-dtype fp8`): `PackedKVOps`, mixed into
`NvidiaBackend`.

Writes encode and store a step's rows in one launch (`store_packed_rows`, `triton_ops/packed_writes.py`).
The attention and the paged indexer read FP8 KV rows and FP4 indexer keys as stored (`triton_ops/packed_kv.py`),
so a step makes no decoded copy of the keys it reads; FlashMLA's sparse decode takes the attention instead where
it loads (`vendor.FlashMlaDecode`: V4-Flash / V4-Pro shapes on sm_90). Where a kernel does not apply (no Triton,
tensors on another device, a codec or shape it does not read, a GPU without e4m3 conversions) the ops take the
default of `deepserve.core.fused_ops.FusedOps`: decode the rows read, then the plain op (the backend's own kernels).
"""

from __future__ import annotations

import torch


class PackedKVOps:
    """`sparse_attention_packed`, `indexer_topk_packed` and `store_packed_rows` over packed pools with Triton
    kernels. Expects the
    backend's `kernels` (None without Triton), `_here(tensor)`, `compute_capability`, and for its batch-invariant
    mode `invariant` and `_attention_tiles(q)` (the attention's fixed tiles; the indexer's ties go to the lowest
    key). A codec is matched by its `stored_format` ("fp8": `kv_precision.FP8Rows`, "fp4": `FP4Keys`): backends
    import nothing from the model."""

    #: False: decode then the plain kernels (the fallback, which tests compare the packed reads against)
    read_packed = True
    #: False: writes encode with torch ops then scatter (the fallback, which tests compare the kernels' bytes with)
    write_packed = True
    #: `vendor.FlashMlaDecode` where FlashMLA loads (never in the batch-invariant mode: its split of the keys
    #: follows the batch), else None
    flash_mla = None

    def _packed_kernels(self, x: torch.Tensor):
        """The packed-row kernels' module where they take `x`: Triton loaded, x on the kernels' device, and a GPU
        that converts e4m3 (sm_89 and later; the interpreter stands for sm_90). Else None."""
        if not self.read_packed or self.kernels is None or not self._here(x) or self.compute_capability < (8, 9):
            return None
        from .triton_ops import packed_kv  # imported once triton is (the backend's kernels loaded)

        return packed_kv

    def sparse_attention_packed(self, q, storage, codec, indices, sinks, scale, positions, inv_freq,
                                fixed_shape=False):
        d = q.shape[-1]
        kernels = self._packed_kernels(q)
        if (kernels is None or codec.stored_format != "fp8" or d & (d - 1) or codec.width != d
                or codec.nope % 2 or codec.dtype != q.dtype or 2 * inv_freq.shape[0] > d
                or storage.stride(-1) != 1):
            return super().sparse_attention_packed(q, storage, codec, indices, sinks, scale, positions, inv_freq,
                                                   fixed_shape)
        if self.flash_mla is not None:  # FlashMLA's sparse decode where it loads and takes these shapes (vendor.py)
            def oracle(q, storage, indices, sinks, scale):  # FlashMLA's first call is checked against it
                return kernels.sparse_mqa_packed(q, storage, codec.nope, indices, sinks, scale)

            out = self.flash_mla(q, storage, codec, indices, sinks, scale, oracle)
            if out is not None:
                return self.apply_rope(out, positions, inv_freq, inverse=True, inplace=True)
        return kernels.sparse_mqa_packed(q, storage, codec.nope, indices, sinks, scale, rope=(positions, inv_freq),
                                         tiles=self._attention_tiles(q))

    def store_packed_rows(self, storage, codec, rows, dest=None, base=0):
        width = rows.shape[-1]
        if (not self.write_packed or self.kernels is None or not self._here(rows) or storage.dim() != 2
                or rows.dim() != 2 or width != codec.width):
            return False
        from .triton_ops import packed_writes

        if codec.stored_format == "fp8" and codec.nope % 2 == 0:
            packed_writes.store_fp8_rows(rows, storage, codec.nope, dest, base)
            return True
        if codec.stored_format == "fp4":
            packed_writes.store_fp4_keys(rows, storage, dest, base)
            return True
        return False

    def indexer_topk_packed(self, q, weights, pages, codec, tables, key_count, topk, query_rows=None):
        di = q.shape[-1]
        kernels = self._packed_kernels(q)
        if kernels is None or codec.stored_format != "fp4" or di & (di - 1) or codec.width != di:
            return super().indexer_topk_packed(q, weights, pages, codec, tables, key_count, topk, query_rows)
        return kernels.indexer_topk_packed(q, weights, pages, tables, key_count, topk, codec.dtype, query_rows,
                                           lowest_on_ties=self.invariant)
