"""The NVIDIA backend: cuBLAS GEMMs and Triton kernels for the hot ops, the reference ops for the rest."""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from deepserve.backends.reference import ReferenceBackend
from deepserve.core.env import cache_dir
from deepserve.core.interfaces import BackendUnavailable

from . import vendor
from .interpreted import interpreting, support_kernels
from .packed_kv import PackedKVOps

logger = logging.getLogger(__name__)

#: (token, expert) pairs from which a step's routed experts go to DeepGEMM when it is loaded: bench/gpu.py run 30
#: (H200) timed a 1K prefill (6K pairs at top-6) 11% slower with it and an 8K one 8% faster, so from ~2.7K tokens
DEEP_GEMM_MIN_PAIRS = 16384
#: rows from which a stored FP8 projection goes to DeepGEMM's FP8 GEMM where it loads (prefill; not measured yet,
#: bench/stored_precision.py times the prefill either way)
DEEP_GEMM_FP8_MIN_ROWS = 1024


def triton_available() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def _hc_mix(streams: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """RMS-normed flattened streams through `fn` in fp32; the norm is a per-row scalar, applied after the GEMM."""
    flat = streams.flatten(1).float()
    return torch.mm(flat, fn.float().t()) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)


def _mm_out_fp32_works(device: str) -> bool:
    """Whether `torch.mm(bf16, bf16, out_dtype=torch.float32)` runs here (torch >= 2.8 on CUDA)."""
    try:
        a = torch.ones((2, 8), dtype=torch.bfloat16, device=device)
        return torch.mm(a, a.t(), out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def _fp4_in_words(w13, w2) -> bool:
    """Whether both stored expert stacks are FP4 whose input dims are whole 32-bit words of eight codes (the FP4
    kernels' reads)."""
    return w13.fp4 and w2.fp4 and w13.data.shape[-1] % 4 == 0 and w2.data.shape[-1] % 4 == 0


def persist_compiled_kernels() -> None:
    """Compiled kernels (Triton's cache, DeepGEMM's JIT cache) kept under deepserve's cache directory, so that a
    restart compiles nothing; set before either compiles, and only where the user has not named their own."""
    root = cache_dir()
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))
    os.environ.setdefault("DG_JIT_CACHE_DIR", str(root / "deep_gemm"))


class NvidiaBackend(PackedKVOps, ReferenceBackend):
    """Backend for NVIDIA GPUs (Hopper H100/H200 and Blackwell).

    GEMMs go straight to cuBLAS; sparse attention, the indexer's scores, the routed experts (grouped GEMMs with
    the clamped SwiGLU fused), the mHC mixing, RMSNorm and RoPE are Triton kernels (`triton_ops/`), each checked
    against the reference ops in `tests/gpu/`. Sampling is the reference's. Where DeepGEMM (`sgl-deep-gemm`)
    is installed and loads, the routed experts of long steps use its grouped GEMMs (`vendor.py`).

    Not batch-invariant: cuBLAS and the kernels pick tiles by batch size, the indexer's ties go to whichever row
    `torch.topk` returns first, and the MoE sums each token's experts in bf16 pairs. The reference backend (on
    CPU, or this class with `fast=False`) is the deterministic one.

    `fast=False` runs the reference ops on the GPU (the oracle, batch-invariant, slow). Without triton the
    GEMMs still use cuBLAS directly and the other ops fall back to the reference.

    `device="cpu"` with TRITON_INTERPRET=1 set runs the same path, kernels included, on CPU tensors under
    Triton's interpreter (no DeepGEMM, no CUDA graphs): slow, for tests and investigations without a GPU
    (tests/test_nvidia_interpreted.py, bench/investigations/stale_reads.py --interpret).

    Raises `BackendUnavailable` when torch sees no CUDA device, or `device` is not one it sees.
    """

    name = "nvidia"

    def __init__(self, device: str = "cuda:0", fast: bool = True, invariant: bool = False) -> None:
        dev = torch.device(device)
        if dev.type == "cpu" and interpreting():
            # the whole path, Triton kernels included, on CPU tensors under Triton's interpreter: slow, for
            # tests and investigations on machines without a GPU (the kernels' own reads and writes, unchanged)
            super().__init__(device="cpu")
            self.device_name, self.compute_capability = "triton interpreter", (9, 0)
        else:
            index = self._cuda_index(device, dev)
            super().__init__(device=f"cuda:{index}")
            self.device_name: str = torch.cuda.get_device_name(index)
            self.compute_capability: tuple[int, int] = torch.cuda.get_device_capability(index)
        self._kernel_device = torch.device(self.device).type
        self.fast = fast
        self.invariant = fast and invariant
        self._mixed_head = fast and _mm_out_fp32_works(self.device)
        self.kernels = None
        on_gpu = self._kernel_device == "cuda"  # `vendor.py`: DeepGEMM, None unless it loads
        if fast:
            persist_compiled_kernels()
        self.deep_gemm = vendor.load_deep_gemm(torch.device(self.device).index) \
            if fast and on_gpu and not self.invariant else None
        self.deep_gemm_fp8 = vendor.Fp8Gemm(self.deep_gemm) if self.deep_gemm is not None else None
        self.flash_mla = vendor.FlashMlaDecode.load(torch.device(self.device).index) \
            if fast and on_gpu and not self.invariant else None
        # arrival counters of the kernels whose last program sums the others' parts (`route_hidden`, `moe_small`,
        # `gemv`): zero between launches, so one stream's kernels share them
        self._arrivals: torch.Tensor | None = None
        if fast and triton_available():
            try:  # at start-up, not mid-forward: a broken triton install leaves cuBLAS + the reference ops
                from .triton_ops import attention, decode, elementwise, fp4_moe, fp8_linear, gemv, indexer, mhc, moe
                from .triton_ops import invariant as invariant_ops
            except Exception as e:  # noqa: BLE001 - any import failure of triton means "no kernels"
                logger.warning("triton is installed but its kernels do not import (%s): running without them", e)
            else:
                self.kernels = SimpleNamespace(attention=attention, decode=decode, elementwise=elementwise,
                                               gemv=gemv, indexer=indexer, mhc=mhc, moe=moe, fp8_linear=fp8_linear,
                                               fp4_moe=fp4_moe, invariant=invariant_ops)
                # every op on the decode path is a kernel or a sync-free torch op. Not in the batch-invariant mode:
                # a graphed decode step forms a closing block's compressed row with its own kernel, a step with a
                # prefill in it with the prefill's pooling, so the row's bits would depend on what shared its step
                self.cuda_graphs = not self.invariant
                if self._kernel_device == "cpu":
                    support_kernels()
                self._arrivals = torch.zeros(4096, dtype=torch.int32, device=self.device)

    @staticmethod
    def _cuda_index(device: str, dev: torch.device) -> int:
        """The CUDA device index `device` names; BackendUnavailable where there is none."""
        if not torch.cuda.is_available():
            raise BackendUnavailable(
                "the nvidia backend needs a CUDA GPU, but torch.cuda.is_available() is False here "
                f"(torch {torch.__version__}, built for CUDA {torch.version.cuda or 'none'}); "
                "use accelerator 'cpu' or 'auto', or install a CUDA build of torch (device 'cpu' with "
                "TRITON_INTERPRET=1 runs the kernels under Triton's interpreter, for tests)"
            )
        if dev.type != "cuda":
            raise BackendUnavailable(f"the nvidia backend runs on a cuda device, not {device!r} (or on 'cpu' "
                                     "under Triton's interpreter, TRITON_INTERPRET=1)")
        index = torch.cuda.current_device() if dev.index is None else dev.index
        if index >= torch.cuda.device_count():
            raise BackendUnavailable(
                f"device {device!r} does not exist: torch sees {torch.cuda.device_count()} CUDA device(s)"
            )
        return index

    def _here(self, x: torch.Tensor) -> bool:
        """Whether the kernels take `x`: a tensor on the device they run on (CUDA, or the CPU when interpreted)."""
        return x.device.type == self._kernel_device

    def __repr__(self) -> str:
        major, minor = self.compute_capability
        path = "reference ops" if not self.fast else ("triton" if self.kernels else "cuBLAS only")
        path += ", batch-invariant" if self.invariant else ""
        path += " + deep_gemm" if self.deep_gemm is not None else ""
        path += " + flash_mla" if self.flash_mla is not None else ""
        return f"NvidiaBackend(device={self.device!r}, gpu={self.device_name!r}, sm_{major}{minor}, {path})"

    # -- GEMMs: cuBLAS, no row padding; `gemv` for the wide projections of 1-4 rows --------------------------------
    def _gemv(self, x, weight) -> bool:
        """Whether `gemv` takes this product: 1-4 rows, 16-bit operands of one dtype, at least 1024 columns
        (narrower ones have too few column blocks for the K split to fill the GPU; cuBLAS does them)."""
        return (self.kernels is not None and not self.invariant and x.shape[0] <= self.kernels.gemv.MAX_ROWS
                and self._here(x)
                and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16)
                and weight[..., 0].numel() >= 1024)

    def _invariant_gemm(self, x, weight) -> bool:
        """Whether the batch-invariant GEMM takes this product (the batch-invariant mode's kernels, operands of one
        dtype; else the reference's exact GEMM, invariant too)."""
        return self.invariant and self.kernels is not None and self._here(x) and x.dtype == weight.dtype

    def linear(self, x, weight):
        if not self.fast:
            return super().linear(x, weight)
        if self.invariant:
            if self._invariant_gemm(x, weight):
                return self.kernels.invariant.matmul(x, weight)
            return super().linear(x, weight)
        if self._gemv(x, weight):
            return self.kernels.gemv.gemv(x, weight, counters=self._arrivals)
        return F.linear(x, weight)

    def rms_norm_linear(self, x, norm_weight, eps, weight):
        if not self.fast or x.dim() != 2 or not self._gemv(x, weight) or norm_weight.shape != x.shape[-1:]:
            return super().rms_norm_linear(x, norm_weight, eps, weight)
        return self.kernels.gemv.gemv(x, weight, counters=self._arrivals, norm=(norm_weight, eps))

    def linear_fp32(self, x, weight):
        """fp32 output from bf16/fp16 operands as they are: cuBLAS multiplies them with fp32 accumulation and fp32
        output (the products of the operands' values, as the fp32 reference computes them), reading the weight at
        half the bytes of an fp32 copy. None when this torch or GPU cannot, or the operands differ in dtype (an
        fp32 operand would be rounded)."""
        if self._invariant_gemm(x, weight) and weight.dtype in (torch.bfloat16, torch.float16):
            return self.kernels.invariant.matmul(x, weight, torch.float32)
        if (self.invariant or not self._mixed_head or x.dtype != weight.dtype
                or weight.dtype not in (torch.bfloat16, torch.float16)):
            return None
        return torch.mm(x, weight.t(), out_dtype=torch.float32)

    def grouped_linear(self, x, weight):
        if not self.fast:
            return super().grouped_linear(x, weight)
        if self.invariant:
            if self._invariant_gemm(x, weight):
                return self.kernels.invariant.matmul(x, weight)
            return super().grouped_linear(x, weight)
        if self._gemv(x, weight):
            return self.kernels.gemv.grouped_gemv(x, weight, counters=self._arrivals)
        # cuBLAS writes each group's product straight into its columns of a [T, G, r] result (a transposed view
        # as the batched output), so the caller's flatten to [T, G * r] copies nothing (was 1 ms of an 8K prefill)
        out = torch.empty((x.shape[0], weight.shape[0], weight.shape[1]), dtype=x.dtype, device=x.device)
        torch.bmm(x.transpose(0, 1), weight.transpose(1, 2), out=out.transpose(0, 1))
        return out

    # -- weights kept as stored: FP8 projections (`fp8_linear`), FP4 experts (`fp4_moe`) --------------------------
    def _stored_path(self, x) -> str | None:
        """`gemv` (a few rows: W8A16, split K), `fp8` (FP8 activations on FP8 tensor cores, sm_89 and later), or
        None: dequantize and take the bf16 path (no kernels, fp32 activations, or a long step on an older GPU)."""
        if (self.kernels is None or self.invariant or not self._here(x)
                or x.dtype not in (torch.bfloat16, torch.float16)):
            return None
        if x.shape[0] <= self.kernels.fp8_linear.GEMV_ROWS:
            return "gemv"
        return "fp8" if self.compute_capability >= (8, 9) else None

    def quantized_linear(self, x, weight):
        path = None if weight.fp4 else self._stored_path(x)
        if path is None:
            return super().quantized_linear(x, weight)
        if (path == "fp8" and self.deep_gemm_fp8 is not None and x.shape[0] >= DEEP_GEMM_FP8_MIN_ROWS
                and weight.block == (128, 128) and x.dtype == torch.bfloat16):
            out = self.deep_gemm_fp8(x, weight.data, weight.scale)
            if out is not None:
                return out
        return self.kernels.fp8_linear.fp8_linear(x, weight.data, weight.scale, weight.block, act_fp8=path == "fp8",
                                                  counters=self._arrivals)

    def quantized_grouped_linear(self, x, weight):
        path = None if weight.fp4 else self._stored_path(x)
        if path is None:
            return super().quantized_grouped_linear(x, weight)
        return self.kernels.fp8_linear.fp8_linear(x, weight.data, weight.scale, weight.block, groups=x.shape[1],
                                                  act_fp8=path == "fp8", counters=self._arrivals)

    def quantized_moe_experts(self, x, topk_ids, topk_weights, w13, w2, limit):
        """FP4 experts through the W4A16 kernels (input dims in words of eight codes; in the batch-invariant mode
        with its fixed tiles and routing-order sum, as its bf16 experts); FP8 experts dequantized for the bf16
        kernels; fp32 activations against the experts' values (the FP4 ones decoded by the kernels' decode)."""
        if self.kernels is None or not self._here(x):
            return super().quantized_moe_experts(x, topk_ids, topk_weights, w13, w2, limit)
        fp4 = _fp4_in_words(w13, w2)
        if self.invariant and fp4:
            return self.kernels.fp4_moe.fp4_moe_experts(x, topk_ids, topk_weights, w13.data, w13.scale, w2.data,
                                                        w2.scale, limit, tiles=self.kernels.moe.INVARIANT_TILES,
                                                        per_pair=False, ordered_sum=True)
        if self.invariant or x.dtype not in (torch.bfloat16, torch.float16):
            return self.moe_experts(x, topk_ids, topk_weights, self._dequantized(w13, x.dtype, fp4),
                                    self._dequantized(w2, x.dtype, fp4), limit)
        if fp4:
            return self.kernels.fp4_moe.fp4_moe_experts(x, topk_ids, topk_weights, w13.data, w13.scale, w2.data,
                                                        w2.scale, limit)
        return self.moe_experts(x, topk_ids, topk_weights, w13.dequantize(x.dtype), w2.dequantize(x.dtype), limit)

    def quantized_moe_with_shared(self, x, topk_ids, topk_weights, w13, w2, limit, shared_w13, shared_w2):
        """`fp4_moe.fp4_moe_with_shared` for a decode step's few pairs (at most `PAIR_GEMV_PAIRS`): FP4 routed
        experts in words of eight codes, the shared expert FP8 with e8m0 scales in blocks of at least 32 columns
        and the routed experts' shapes; else None (the routed kernels, then the shared expert's projections)."""
        fp4 = self.kernels.fp4_moe if self.kernels is not None else None
        if (fp4 is None or self.invariant or not self._here(x)
                or x.dtype not in (torch.bfloat16, torch.float16)
                or not 0 < topk_ids.numel() <= fp4.PAIR_GEMV_PAIRS
                or not _fp4_in_words(w13, w2)
                or shared_w13.fp4 or shared_w2.fp4 or shared_w13.block != shared_w2.block
                or shared_w13.data.dtype != torch.float8_e4m3fn or shared_w2.data.dtype != torch.float8_e4m3fn
                or any(s.scale.dtype not in (torch.uint8, getattr(torch, "float8_e8m0fnu", None))
                       for s in (shared_w13, shared_w2))
                or shared_w13.block[1] < 32 or shared_w13.block[1] & (shared_w13.block[1] - 1)
                or tuple(shared_w13.data.shape) != (w13.data.shape[1], x.shape[1])
                or tuple(shared_w2.data.shape) != (x.shape[1], w13.data.shape[1] // 2)):
            return None
        return fp4.fp4_moe_with_shared(x, topk_ids, topk_weights, w13.data, w13.scale, w2.data, w2.scale, limit,
                                       shared_w13.data, shared_w13.scale, shared_w2.data, shared_w2.scale,
                                       shared_w13.block)

    def _dequantized(self, weight, dtype, fp4: bool):
        """A stored weight's values in `dtype`: FP4 by the kernels' decode (one launch, bitwise
        `QuantizedWeight.dequantize`'s), else `QuantizedWeight.dequantize`."""
        if fp4:
            return self.kernels.fp4_moe.dequantize(weight.data, weight.scale, dtype)
        return weight.dequantize(dtype)

    # -- elementwise ---------------------------------------------------------------------------------------------
    def rms_norm(self, x, weight, eps):
        if self.kernels is None or not self._here(x):
            return super().rms_norm(x, weight, eps)
        return self.kernels.elementwise.rms_norm(x, weight, eps)

    def apply_rope(self, x, positions, inv_freq, inverse=False, inplace=False):
        if self.kernels is None or not self._here(x):
            return super().apply_rope(x, positions, inv_freq, inverse)
        return self.kernels.elementwise.apply_rope(x, positions, inv_freq, inverse, inplace=inplace)

    def rms_norm_rope(self, x, weight, eps, positions, inv_freq):
        if self.kernels is None or not self._here(x) or x.shape[-1] > 4096 or 2 * inv_freq.shape[0] > x.shape[-1]:
            return super().rms_norm_rope(x, weight, eps, positions, inv_freq)
        return self.kernels.elementwise.rms_norm_rope(x, weight, eps, positions, inv_freq)

    def qk_norm_rope(self, q, kv, kv_weight, eps, positions, inv_freq):
        d = q.shape[-1]
        if (self.kernels is None or not self._here(q) or q.dim() != 3 or kv.dim() != 2 or d > 4096
                or 2 * inv_freq.shape[0] > d or kv.shape[-1] != d):
            return super().qk_norm_rope(q, kv, kv_weight, eps, positions, inv_freq)
        return self.kernels.elementwise.qk_norm_rope(q, kv, kv_weight, eps, positions, inv_freq)

    def router_scores(self, logits):
        if not self.fast:
            return super().router_scores(logits)
        return torch.sqrt(F.softplus(logits.float()))

    def swiglu(self, gate, up, limit):
        if not self.fast:
            return super().swiglu(gate, up, limit)
        if self.kernels is not None and self._here(gate) and gate.dim() == 2:
            return self.kernels.elementwise.swiglu(gate, up, limit)
        return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)

    def route_hidden(self, x, weight, bias, tid2eid, token_ids, top_k, scale):
        """`route_hidden` for up to 16 tokens with a 16-bit router weight of x's dtype, at most 256 experts."""
        if (self._arrivals is None or self.invariant or not self._here(x)
                or not 0 < x.shape[0] <= self.kernels.moe.ROUTE_HIDDEN_TOKENS
                or x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype
                or weight.shape[0] > 256 or x.stride(-1) != 1 or weight.stride(-1) != 1):
            return None
        return self.kernels.moe.route_hidden(x, weight, bias, tid2eid, token_ids, top_k, scale, self._arrivals)

    def route(self, logits, bias, hash_ids, top_k, scale):
        if self.kernels is None or not self._here(logits) or logits.shape[1] > 4096:
            return super().route(logits, bias, hash_ids, top_k, scale)
        return self.kernels.moe.route(logits, bias, hash_ids, top_k, scale)

    # -- mHC -----------------------------------------------------------------------------------------------------
    def _hc_fast(self, streams) -> bool:
        n = streams.shape[1]
        # (the batch-invariant mode: the reference's exact ops; these kernels split the mix by the batch's rows)
        return self.kernels is not None and not self.invariant and self._here(streams) and n & (n - 1) == 0

    def hc_pre(self, streams, fn, base, scale, iters, hc_eps, norm_eps):
        if not self._hc_fast(streams):
            return super().hc_pre(streams, fn, base, scale, iters, hc_eps, norm_eps)
        return self.kernels.mhc.hc_pre(streams, fn, base, scale, iters, hc_eps, norm_eps)

    def hc_pre_norm(self, streams, fn, base, scale, iters, hc_eps, norm_eps, weight, eps, mix=None):
        """`mix` (this backend's own, from `hc_post_mix`): the site's mix partial sums, already made."""
        if not self._hc_fast(streams) or streams.shape[2] > 8192:
            return super().hc_pre_norm(streams, fn, base, scale, iters, hc_eps, norm_eps, weight, eps)
        return self.kernels.mhc.hc_pre(streams, fn, base, scale, iters, hc_eps, norm_eps, norm=(weight, eps),
                                       mix=mix)

    def hc_post_mix(self, streams, block_out, post, comb, next_fn):
        """`hc_post`, and a start on the next mHC site's mix (weights `next_fn`) from the new streams while they
        are at hand: (new streams, the partial sums `hc_pre_norm` / `hc_head_norm` take as `mix`, or None).
        This backend's own op, used by its decoder stack (`fused_stack`)."""
        if not self._hc_fast(streams):
            return self.hc_post(streams, block_out, post, comb), None
        return self.kernels.mhc.hc_post_mix(streams, block_out, post, comb, next_fn)

    def decoder_stack(self):
        if self.invariant:
            return super().decoder_stack()
        from .fused_stack import run_decoder_stack

        return functools.partial(run_decoder_stack, self)

    def hc_post(self, streams, block_out, post, comb):
        if not self._hc_fast(streams):
            return super().hc_post(streams, block_out, post, comb)
        return self.kernels.mhc.hc_post(streams, block_out, post, comb)

    def _hc_head_fast(self, streams, fn, scale) -> bool:
        """Whether the Triton `hc_head` takes this head: `_hc_fast` streams, one mix row per stream, one scale."""
        return self.fast and self._hc_fast(streams) and fn.shape[0] == streams.shape[1] and scale.numel() == 1

    def hc_head(self, streams, fn, base, scale, hc_eps, norm_eps):
        if not self.fast or self.invariant:
            return super().hc_head(streams, fn, base, scale, hc_eps, norm_eps)
        if self._hc_head_fast(streams, fn, scale):
            return self.kernels.mhc.hc_head(streams, fn, base, scale, hc_eps, norm_eps)
        mix = _hc_mix(streams, fn, norm_eps)
        pre = torch.sigmoid(mix * scale.float() + base.float()) + hc_eps
        return torch.einsum("tn,tnd->td", pre, streams.float()).to(streams.dtype)

    def hc_head_norm(self, streams, fn, base, scale, hc_eps, norm_eps, weight, eps, mix=None):
        """`mix`: as `hc_pre_norm`'s, from the last layer's `hc_post_mix`."""
        if not self._hc_head_fast(streams, fn, scale) or streams.shape[2] > 8192:
            return super().hc_head_norm(streams, fn, base, scale, hc_eps, norm_eps, weight, eps)
        return self.kernels.mhc.hc_head(streams, fn, base, scale, hc_eps, norm_eps, norm=(weight, eps), mix=mix)

    # -- attention -----------------------------------------------------------------------------------------------
    def _attention_tiles(self, q) -> dict | None:
        """The batch-invariant mode's fixed tiles (`attention.invariant_tiles`); else None (chosen per step)."""
        return self.kernels.attention.invariant_tiles(q.shape[1], q.shape[2]) if self.invariant else None

    def sparse_attention(self, q, kv, indices, sinks, scale):
        d = q.shape[-1]
        if self.kernels is None or not self._here(q) or d & (d - 1):
            return super().sparse_attention(q, kv, indices, sinks, scale)
        return self.kernels.attention.sparse_mqa(q, kv.to(q.dtype), indices, sinks, scale,
                                                 tiles=self._attention_tiles(q))

    def sparse_attention_rope(self, q, kv, indices, sinks, scale, positions, inv_freq):
        d = q.shape[-1]
        if self.kernels is None or not self._here(q) or d & (d - 1) or 2 * inv_freq.shape[0] > d:
            return super().sparse_attention_rope(q, kv, indices, sinks, scale, positions, inv_freq)
        return self.kernels.attention.sparse_mqa(q, kv.to(q.dtype), indices, sinks, scale, rope=(positions, inv_freq),
                                                 tiles=self._attention_tiles(q))

    def softmax_pool(self, values, gates):
        if not self.fast or self.invariant:
            return super().softmax_pool(values, gates)
        return (values.float() * torch.softmax(gates.float(), dim=1)).sum(dim=1)

    def compress_decode(self, kv, gate, position_bias, positions, slot, tables, open_kv, open_gate, prev_kv,
                        prev_gate, rows, norm_weight, inv_freq, eps, codec=None, turn=None):
        D = norm_weight.shape[0]
        if self.kernels is None or self.invariant or not self._here(kv) or D & (D - 1):
            return False
        store = "values" if codec is None or codec.holds_values else codec.stored_format
        if store == "values" and rows.shape[-1] != D:
            return False
        if store not in ("values", "fp8", "fp4") or (store == "fp4") != (turn is not None) \
                or (store == "fp8" and codec.nope != D - 2 * inv_freq.shape[0]) or (store == "fp4" and D < 2):
            return False
        self.kernels.decode.compress_decode(kv, gate, position_bias, positions, slot, tables, open_kv, open_gate,
                                            prev_kv, prev_gate, rows, norm_weight, inv_freq, eps, store, turn)
        return True

    def paged_key_rows(self, positions, chunk_start, chunk_offset, slot, tables, compressed, window, rows_per_page,
                       comp_base, scratch_base):
        if self.kernels is None or not self._here(positions):
            return None
        return self.kernels.decode.paged_key_rows(positions, chunk_start, chunk_offset, slot, tables, compressed,
                                                  window, rows_per_page, comp_base, scratch_base)

    def decode_key_rows(self, storage, kv, positions, slot, tables, compressed, window, rows_per_page, comp_base):
        if (self.kernels is None or not self._here(kv) or kv.stride(-1) != 1 or storage.stride(-1) != 1
                or kv.dtype != storage.dtype):
            return None
        return self.kernels.decode.decode_key_rows(storage, kv, positions, slot, tables, compressed, window,
                                                   rows_per_page, comp_base)

    def paged_window_write(self, storage, kv, positions, slot, window):
        if self.kernels is None or not self._here(kv) or kv.stride(-1) != 1 or storage.stride(-1) != 1:
            return False
        self.kernels.decode.paged_window_write(storage, kv, positions, slot, window)
        return True

    def indexer_topk_paged(self, q, weights, pages, tables, key_count, topk):
        di = q.shape[-1]
        if self.kernels is None or not self._here(q) or di & (di - 1):
            return super().indexer_topk_paged(q, weights, pages, tables, key_count, topk)
        return self.kernels.indexer.indexer_topk_paged(q, weights, pages, tables, key_count, topk,
                                                       lowest_on_ties=self.invariant)

    def indexer_topk(self, q, weights, keys, key_start, key_count, topk):
        di = q.shape[-1]
        if self.kernels is None or not self._here(q) or di & (di - 1):
            return super().indexer_topk(q, weights, keys, key_start, key_count, topk)
        return self.kernels.indexer.indexer_topk(q, weights, keys, key_start, key_count, topk,
                                                 lowest_on_ties=self.invariant)

    # -- MoE -----------------------------------------------------------------------------------------------------
    def moe_experts(self, x, topk_ids, topk_weights, w13, w2, limit):
        if self.kernels is None or not self._here(x):
            return super().moe_experts(x, topk_ids, topk_weights, w13, w2, limit)
        if self.invariant:
            return self.kernels.moe.moe_experts(x, topk_ids, topk_weights, w13, w2, limit,
                                                tiles=self.kernels.moe.INVARIANT_TILES, ordered_sum=True)
        if self._deep_gemm_moe(x, topk_ids, w13, w2):
            try:
                return vendor.moe_experts_deep_gemm(self.deep_gemm, x, topk_ids, topk_weights, w13, w2, limit)
            except Exception as e:  # noqa: BLE001 - a vendor kernel that fails here is dropped, not fatal
                logger.warning("deep_gemm's grouped GEMM failed (%s): the Triton MoE kernels take over", e)
                self.deep_gemm = None
        return self.kernels.moe.moe_experts(x, topk_ids, topk_weights, w13, w2, limit)

    def _deep_gemm_moe(self, x, topk_ids, w13, w2) -> bool:
        """Whether DeepGEMM takes these routed experts: loaded, a long step (at least DEEP_GEMM_MIN_PAIRS pairs,
        never a captured decode step), bf16 operands, dims in whole 128-wide tiles."""
        return (self.deep_gemm is not None and topk_ids.numel() >= DEEP_GEMM_MIN_PAIRS
                and x.dtype == w13.dtype == w2.dtype == torch.bfloat16 and x.shape[1] % 128 == 0
                and w2.shape[2] % 128 == 0 and w13.is_contiguous() and w2.is_contiguous()
                and not torch.cuda.is_current_stream_capturing())

    def moe_with_shared(self, x, topk_ids, topk_weights, w13, w2, limit, shared_w13, shared_w2):
        """`moe_small` for a single token (`SMALL_TOKENS`) with 16-bit weights of x's dtype, contiguous rows, and a
        shared expert of the routed experts' shapes, hidden size at most 64K; else None (the grouped kernels, then
        the shared expert)."""
        if (self._arrivals is None or self.invariant or not self._here(x)
                or not 0 < x.shape[0] <= self.kernels.moe.SMALL_TOKENS
                or x.shape[1] > 65536
                or x.dtype not in (torch.bfloat16, torch.float16)
                or any(w.dtype != x.dtype or w.stride(-1) != 1 for w in (w13, w2, shared_w13, shared_w2))
                or shared_w13.shape != w13.shape[1:] or shared_w2.shape != w2.shape[1:]):
            return None
        return self.kernels.moe.moe_small(x, topk_ids, topk_weights, w13, w2, limit, shared_w13, shared_w2,
                                          self._arrivals)
