"""Vendor kernels, used when their packages are installed and load here; the Triton kernels stay the fallback.

DeepGEMM (PyPI `sgl-deep-gemm`; the plain `deep-gemm` name is a placeholder) has Hopper grouped GEMMs over
expert-sorted rows, JIT-compiled with the CUDA toolkit's nvcc on first use. deepserve takes its bf16
`m_grouped_bf16_gemm_nt_contiguous` for the routed experts of long steps (prefill), where the Triton grouped
kernels reach about half the matrix rate (bench/investigations/vendor_probe.py, H200 run 28: 808 TFLOP/s for an 8K
prefill's gate/up against 406 for Triton's two GEMMs). Which builds load depends on the torch they were built against:
on torch 2.11 + CUDA 13, sgl-deep-gemm 0.1.5 loads and runs; 0.2.0 loads but rejects the 1-D expert layout
(its first call fails, and the backend drops it for the Triton kernels), 0.2.5 needs a newer libtorch, and 0.0.1 /
0.1.0 have no bf16 grouped GEMM. A shape's first long step also JIT-compiles DeepGEMM's kernel for it.
FlashMLA's PyPI build (`sgl-flash-mla`) and DeepEP's (`sgl-deep-ep`) require torch 2.14.1;
`scripts/build_vendor_kernels.sh` builds both from source against the GPU machine's torch (docs/quantization.md).

FlashMLA's SM90 sparse decode reads V4's FP8 KV format ("MODEL1": per token 448 e4m3 values, 64 bf16 RoPE values,
7 UE8M0 scales) and takes the attention over packed pools (`--kv-cache-dtype fp8`) where it loads
(`FlashMlaDecode`): a pool's rows are 16-byte-aligned one-token MODEL1 blocks (`kv_precision.FP8Rows`), so it
reads them in place, a query's row numbers being its indices. Its output's RoPE dims are turned back afterwards.

For weights kept as stored, DeepGEMM's FP8 GEMM (`fp8_gemm_nt`, 1x128 activation and 128x128 weight scales) takes
the FP8 projections of long steps where it is present (`Fp8Gemm`); its scale layouts differ between releases, so
each shape's first product is checked against the Triton kernel's and a mismatch or an error drops it.

`DEEPSERVE_VENDOR_KERNELS=0` turns the vendor kernels off.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging

import torch
import torch.nn.functional as F

from deepserve.core.env import env_value

logger = logging.getLogger(__name__)


def _vendor_module(name: str):
    """The vendor package `name` imported, or None where `DEEPSERVE_VENDOR_KERNELS=0` or it does not import (logged
    at debug level: most installs do not have it)."""
    if env_value("DEEPSERVE_VENDOR_KERNELS") == "0":
        return None
    try:
        return importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - a missing or broken vendor package means "use Triton"
        try:
            installed = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            installed = False
        # installed but broken is worth a warning (the user meant to use it); not installed is the usual case
        (logger.warning if installed else logger.debug)("%s not used: %s: %s", name, type(e).__name__, e)
        return None


def load_deep_gemm(device_index: int):
    """The `deep_gemm` module when it imports and has the bf16 grouped GEMM deepserve calls, and the device is a
    Hopper GPU; else None."""
    deep_gemm = _vendor_module("deep_gemm")
    if deep_gemm is None:
        return None
    if not hasattr(deep_gemm, "m_grouped_bf16_gemm_nt_contiguous"):
        logger.info("deep_gemm %s has no m_grouped_bf16_gemm_nt_contiguous: not used",
                    getattr(deep_gemm, "__version__", "?"))
        return None
    if torch.cuda.get_device_capability(device_index)[0] != 9:
        logger.info("deep_gemm's grouped GEMM is used on Hopper only here")
        return None
    return deep_gemm


def moe_experts_deep_gemm(dg, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                          w13: torch.Tensor, w2: torch.Tensor, limit: float) -> torch.Tensor:
    """`Backend.moe_experts` with DeepGEMM's grouped GEMMs: the (token, expert) pairs sorted by expert into
    runs padded to DeepGEMM's alignment, x's rows gathered in that order, gate/up as one grouped GEMM, the
    clamped SwiGLU (Triton), down as a second grouped GEMM, then each token's rows weighted and summed in fp32
    (Triton). Every GEMM output is rounded to x's dtype, as in the Triton path."""
    from .triton_ops import elementwise, moe

    T, D = x.shape
    I = w2.shape[2]
    token, expert, pair_slot = moe.sorted_rows(topk_ids, w13.shape[0], dg.get_mk_alignment_for_contiguous_layout())
    rows = x[token]
    gate_up = torch.empty((rows.shape[0], 2 * I), dtype=x.dtype, device=x.device)
    dg.m_grouped_bf16_gemm_nt_contiguous(rows, w13, gate_up, expert)
    h = elementwise.swiglu(gate_up[:, :I], gate_up[:, I:], limit)
    y = torch.empty((rows.shape[0], D), dtype=x.dtype, device=x.device)
    dg.m_grouped_bf16_gemm_nt_contiguous(h, w2, y, expert)
    return moe.combine(y, pair_slot, topk_weights, torch.empty_like(x))


class Fp8Gemm:
    """DeepGEMM's block-scaled FP8 GEMM for stored projections, checked once per shape against `fp8_linear`."""

    #: relative L2 difference to the Triton kernel's product above which DeepGEMM is not used (both quantize the
    #: activations the same way; only summation order differs)
    TOLERANCE = 1e-2

    def __init__(self, dg) -> None:
        self.dg = dg
        self.checked: set[tuple[int, int]] = set()
        self.enabled = hasattr(dg, "fp8_gemm_nt")

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
        """x [M, K] bf16, weight e4m3 [N, K] with 128x128 e8m0 scales -> [M, N] bf16, or None (not here)."""
        from .triton_ops.fp8_linear import act_quant, fp8_linear

        if not self.enabled or torch.cuda.is_current_stream_capturing():
            return None
        xq, xs = act_quant(x, 128)
        ws = scale.view(torch.uint8).float().sub_(127).exp2_() if scale.element_size() == 1 else scale.float()
        out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
        try:
            self.dg.fp8_gemm_nt((xq, xs), (weight, ws), out)
        except Exception as e:  # noqa: BLE001 - a vendor kernel that fails here is dropped, not fatal
            logger.warning("deep_gemm's fp8_gemm_nt failed (%s): the Triton FP8 kernel takes over", e)
            self.enabled = False
            return None
        key = tuple(weight.shape)
        if key not in self.checked:
            ref = fp8_linear(x, weight, scale, (128, 128), act_fp8=True)
            err = ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30)).item()
            if not err < self.TOLERANCE:
                logger.warning("deep_gemm's fp8_gemm_nt differs from the Triton FP8 kernel by %.3g at %s: not used",
                               err, key)
                self.enabled = False
                return None
            self.checked.add(key)
        return out


def load_flash_mla(device_index: int):
    """The `flash_mla` module when it imports, has the sparse decode deepserve calls, and the device is a Hopper
    GPU (the build script's wheels hold sm_90a code only); else None."""
    flash_mla = _vendor_module("flash_mla")
    if flash_mla is None:
        return None
    if not all(hasattr(flash_mla, name) for name in ("flash_mla_with_kvcache", "get_mla_metadata")):
        logger.info("flash_mla has no flash_mla_with_kvcache / get_mla_metadata: not used")
        return None
    if torch.cuda.get_device_capability(device_index) != (9, 0):
        logger.info("flash_mla's sparse decode is used on sm_90 only here")
        return None
    return flash_mla


class FlashMlaDecode:
    """FlashMLA's sparse decode over a pool of packed FP8 rows, as `sparse_attention_packed` without the RoPE turn:
    q [T, H, 512] bf16, storage [N, stored bytes] uint8 (`FP8Rows` of 512 dims, 64 of them RoPE), indices [T, K]
    rows of it (< 0: none), sinks [H], scale -> [T, H, 512] bf16 whose last 64 dims are still rotated.

    Each query is its own "batch" of one query (FlashMLA's b = T, s_q = 1); the pool is seen as N one-token blocks
    (`kv_view`), so a row number is FlashMLA's index (block * block size + offset) as it is; K is padded with -1 to
    FlashMLA's multiple of 64. The first call for a head count is checked against `oracle` (the Triton packed
    kernel) on random rows; a difference above `TOLERANCE` or an error drops FlashMLA for good. A call inside a
    CUDA-graph capture before that check returns None (the capture's warm-up runs check it first)."""

    HEADS = (64, 128)
    NOPE, ROPE = 448, 64
    TOKEN_BYTES = NOPE + 2 * ROPE + 8  # MODEL1's bytes a token: values, RoPE values, 7 scales and a pad
    INDEX_BLOCK = 64  # FlashMLA takes K in blocks of 64 indices
    #: the most queries a call takes (decode and verify steps): FlashMLA keeps fp32 partial outputs for every query
    #: plus one per SM part, [T + 132, H, 512], which a prompt chunk of thousands of queries would make a GiB;
    #: longer steps take the Triton kernel
    MAX_QUERIES = 512
    #: relative L2 difference to the Triton kernel above which FlashMLA is not used (both decode the same e4m3
    #: codes and power-of-two scales exactly; FlashMLA rounds the probabilities to bf16 for its P.V product)
    TOLERANCE = 2e-2

    def __init__(self, fm) -> None:
        self.fm = fm
        self.checked: dict[int, bool] = {}

    @classmethod
    def load(cls, device_index: int) -> FlashMlaDecode | None:
        fm = load_flash_mla(device_index)
        return cls(fm) if fm is not None else None

    @classmethod
    def takes(cls, q: torch.Tensor, storage: torch.Tensor, codec) -> bool:
        """Whether FlashMLA reads this step: V4's MODEL1 shapes (64 or 128 heads of 512 dims, 448 of them FP8),
        bf16 queries, and a pool whose rows start 16-byte aligned (FlashMLA's 16-byte loads)."""
        return (q.dim() == 3 and q.shape[1] in cls.HEADS and q.shape[2] == cls.NOPE + cls.ROPE
                and q.dtype == torch.bfloat16 and codec.stored_format == "fp8"
                and (codec.nope, codec.rope) == (cls.NOPE, cls.ROPE) and storage.dtype == torch.uint8
                and storage.dim() == 2 and storage.shape[1] >= cls.TOKEN_BYTES and storage.stride(1) == 1
                and storage.stride(0) % 16 == 0 and storage.data_ptr() % 16 == 0)

    @classmethod
    def kv_view(cls, storage: torch.Tensor) -> torch.Tensor:
        """The pool [N, stored bytes] as FlashMLA's MODEL1 cache of N one-token blocks, [N, 1, 1, 584]: a block's
        values, RoPE values and scales lie at 0, 448 and 576 bytes from its start, as in `FP8Rows`; the block stride
        is the row's (16-byte aligned)."""
        return storage.as_strided((storage.shape[0], 1, 1, cls.TOKEN_BYTES),
                                  (storage.stride(0), cls.TOKEN_BYTES, cls.TOKEN_BYTES, 1))

    def attend(self, q: torch.Tensor, storage: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor,
               scale: float) -> torch.Tensor:
        """FlashMLA's call itself (shapes from T and K only: a CUDA graph captures it)."""
        T, K = indices.shape
        idx = indices.clamp(min=-1).to(torch.int32)  # FlashMLA skips -1 only: another negative would be read
        if K % self.INDEX_BLOCK or K == 0:
            idx = F.pad(idx, (0, self.INDEX_BLOCK - K % self.INDEX_BLOCK), value=-1)
        meta, _ = self.fm.get_mla_metadata()
        out, _ = self.fm.flash_mla_with_kvcache(
            q.unsqueeze(1), self.kv_view(storage), None, None, self.NOPE + self.ROPE, meta, softmax_scale=scale,
            is_fp8_kvcache=True, indices=idx.view(T, 1, -1), attn_sink=sinks.float().contiguous())
        return out.view(T, q.shape[1], -1)

    def __call__(self, q, storage, codec, indices, sinks, scale, oracle) -> torch.Tensor | None:
        """`attend` where FlashMLA takes the step and passed its check; else None (the caller's kernel runs).
        `oracle(q, storage, indices, sinks, scale)`: the Triton packed kernel, for the check."""
        if not 0 < q.shape[0] <= self.MAX_QUERIES or not self.takes(q, storage, codec):
            return None
        heads = q.shape[1]
        if heads not in self.checked:
            if q.is_cuda and torch.cuda.is_current_stream_capturing():
                return None
            self.checked[heads] = self._check(q, codec, oracle)
        return self.attend(q, storage, indices, sinks, scale) if self.checked[heads] else None

    def _check(self, like: torch.Tensor, codec, oracle) -> bool:
        """FlashMLA against `oracle` on random rows of widely ranging size, random indices with gaps (-1), a K that
        is not a multiple of 64, and sinks: whether it may be used for `like`'s head count."""
        g = torch.Generator(device="cpu").manual_seed(0)
        T, H, d, N, K = 3, like.shape[1], like.shape[2], 300, 100
        rows = torch.randn(N, d, generator=g) * torch.logspace(-2, 1, d)[torch.randperm(d, generator=g)]
        storage = torch.zeros((N, codec.stored_width), dtype=torch.uint8, device=like.device)
        storage.copy_(codec.encode(rows.to(like.device, like.dtype)))
        q = torch.randn(T, H, d, generator=g).to(like.device, like.dtype)
        indices = torch.randint(0, N, (T, K), generator=g)
        indices[torch.rand(T, K, generator=g) < 0.25] = -1
        indices = indices.to(like.device)
        sinks = torch.randn(H, generator=g).to(like.device)
        scale = d ** -0.5
        try:
            out = self.attend(q, storage, indices, sinks, scale)
        except Exception as e:  # noqa: BLE001 - a vendor kernel that fails here is dropped, not fatal
            logger.warning("flash_mla's sparse decode failed (%s): the Triton packed kernel takes over", e)
            return False
        ref = oracle(q, storage, indices, sinks, scale)
        err = ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30)).item()
        if not err < self.TOLERANCE:
            logger.warning("flash_mla's sparse decode differs from the Triton packed kernel by %.3g at %d heads: "
                           "not used", err, H)
            return False
        logger.info("flash_mla's sparse decode takes the attention over FP8 KV pools at %d heads (checked: %.2g "
                    "relative difference to the Triton kernel)", H, err)
        return True
