"""The NVIDIA backend's kernels on the CPU under Triton's interpreter (TRITON_INTERPRET=1), for tests and
investigations without a GPU (`NvidiaBackend(device="cpu")`).

The interpreter runs each program's block operations in numpy. One of its helpers turns a scalar it holds as a
one-element array into a Python int with `int(array)`, which numpy 2.4 refuses for an array of one dimension:
every kernel that loops from a program id (`range(pid * chunk, ...)`) then fails to interpret. And the
`libdevice` functions (the GPU's accurate `cos`, `sin`, `log1p`) are declarations only, which the interpreter
cannot call; an autotuned kernel times its configurations through a GPU driver, which there is none of; and
`tl.dot` of bf16 operands multiplies their raw 16-bit patterns (the interpreter keeps bf16 as uint16), which is
garbage, as is a bf16 multiplication. `support_kernels` makes the conversion read the array's one element, the
value it meant, points those functions at the interpreter's own math (numpy's, in fp32), has the autotuner take
each kernel's first configuration (its timings all equal), widens bf16 dot operands to fp32 first (their products
are exact there, as on tensor cores) and multiplies bf16 values in fp32, rounded once to bf16; it changes nothing
on a GPU, where the interpreter is not used.
"""

from __future__ import annotations

import os


def interpreting() -> bool:
    """Whether Triton runs its kernels under its CPU interpreter here (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def support_kernels() -> None:
    """Make the interpreter run this backend's kernels: `tensor.__index__` of a scalar held as a one-element
    array (numpy >= 2.4), and the `libdevice` math they call. Only under TRITON_INTERPRET=1."""
    if not interpreting():
        raise RuntimeError("support_kernels is for Triton's interpreter (TRITON_INTERPRET=1)")
    import triton.language as tl
    from triton.language.extra import libdevice
    from triton.runtime import interpreter
    from triton.runtime.autotuner import Autotuner

    Autotuner.do_bench = property(lambda self: _untimed)
    builder = type(interpreter.interpreter_builder)
    if not getattr(builder.create_dot, "deepserve_bf16", False):
        builder.create_dot = _bf16_widening(builder.create_dot, interpreter, tl)
        builder.create_fmul = _bf16_multiplication(builder.create_fmul, interpreter, tl)
    # looked up at each call: the interpreter swaps tl.math's functions in while a kernel runs
    libdevice.cos = lambda x: tl.math.cos(x)
    libdevice.sin = lambda x: tl.math.sin(x)
    libdevice.log1p = lambda x: tl.math.log(x + 1.0)

    patch = interpreter._patch_lang_tensor
    if getattr(patch, "deepserve_scalar_index", False):
        return

    def patch_with_scalar_index(tensor, scope) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0])
                       if self.handle.data.size == 1 else int(self.handle.data))

    patch_with_scalar_index.deepserve_scalar_index = True
    interpreter._patch_lang_tensor = patch_with_scalar_index


def _untimed(kernel_call, quantiles=None, **kwargs):
    """The autotuner's benchmark without a GPU: every configuration takes the same (no) time."""
    return [0.0] * len(quantiles) if quantiles else 0.0


def _bf16_widening(original, interpreter, tl):
    """The interpreter's `create_dot` with bf16 operands (uint16 bit patterns) widened to fp32 values first."""

    def widen(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        return interpreter.TensorHandle(_bf16_values(handle.data), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    create_dot.deepserve_bf16 = True
    return create_dot


def _bf16_multiplication(original, interpreter, tl):
    """The interpreter's `create_fmul` for bf16 operands (uint16 bit patterns, which it would multiply as
    integers): the product of their values in fp32 (exact), rounded once to bf16, as the GPU's bf16 multiply."""

    def create_fmul(self, lhs, rhs):
        if lhs.dtype.scalar != tl.bfloat16:
            return original(self, lhs, rhs)
        return interpreter.TensorHandle(_bf16_bits(_bf16_values(lhs.data) * _bf16_values(rhs.data)), tl.bfloat16)

    return create_fmul


def _bf16_values(bits):
    """bf16 bit patterns (uint16) as fp32 values: the bits are the float's upper half (subnormals too, which the
    interpreter's own conversion flushes to zero)."""
    import numpy as np

    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def _bf16_bits(values):
    """fp32 values rounded to bf16 bit patterns, to nearest, ties to even (NaN stays NaN)."""
    import numpy as np

    bits = np.asarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), np.uint16(0x7FC0), rounded)
