"""Vendor kernels, used when their packages are installed and load here; the Triton kernels stay the fallback.

DeepGEMM (PyPI `sgl-deep-gemm`; the plain `deep-gemm` name is a placeholder) has Hopper grouped GEMMs over
expert-sorted rows, JIT-compiled with the CUDA toolkit's nvcc on first use. deepserve takes its bf16
`m_grouped_bf16_gemm_nt_contiguous` for the routed experts of long steps (prefill), where the Triton grouped
kernels reach about half the matrix rate (bench/investigations/vendor_probe.py, H200 run 28: 808 TFLOP/s for an 8K
prefill's gate/up against 406 for Triton's two GEMMs). Which builds load depends on the torch they were built against:
on torch 2.11 + CUDA 13, sgl-deep-gemm 0.1.5 loads and runs; 0.2.0 loads but rejects the 1-D expert layout
(its first call fails, and the backend drops it for the Triton kernels), 0.2.5 needs a newer libtorch, and 0.0.1 /
0.1.0 have no bf16 grouped GEMM. A shape's first long step also JIT-compiles DeepGEMM's kernel for it.
FlashMLA (`sgl-flash-mla`) and DeepEP (`sgl-deep-ep`) require torch 2.14.1 and are not used.

For weights kept as stored, DeepGEMM's FP8 GEMM (`fp8_gemm_nt`, 1x128 activation and 128x128 weight scales) takes
the FP8 projections of long steps where it is present (`Fp8Gemm`); its scale layouts differ between releases, so
each shape's first product is checked against the Triton kernel's and a mismatch or an error drops it.

`DEEPSERVE_VENDOR_KERNELS=0` turns the vendor kernels off.
"""

from __future__ import annotations

import logging

import torch

from deepserve.core.env import env_value

logger = logging.getLogger(__name__)


def load_deep_gemm(device_index: int):
    """The `deep_gemm` module when it imports and has the bf16 grouped GEMM deepserve calls, and the device is a
    Hopper GPU; else None (a missing package is logged at debug level: most installs do not have it)."""
    if env_value("DEEPSERVE_VENDOR_KERNELS") == "0":
        return None
    try:
        import deep_gemm
    except Exception as e:  # noqa: BLE001 - a missing or broken vendor package means "use Triton"
        logger.debug("deep_gemm not used: %s", e)
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
