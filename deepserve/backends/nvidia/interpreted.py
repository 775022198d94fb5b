"""The NVIDIA backend's kernels on the CPU under Triton's interpreter (TRITON_INTERPRET=1), for tests and
investigations without a GPU (`NvidiaBackend(device="cpu")`).

The interpreter runs each program's block operations in numpy. One of its helpers turns a scalar it holds as a
one-element array into a Python int with `int(array)`, which numpy 2.4 refuses for an array of one dimension:
every kernel that loops from a program id (`range(pid * chunk, ...)`) then fails to interpret. And the
`libdevice` functions (the GPU's accurate `cos`, `sin`, `log1p`) are declarations only, which the interpreter
cannot call; an autotuned kernel times its configurations through a GPU driver, which there is none of; and
`tl.dot` of bf16 operands multiplies their raw 16-bit patterns (the interpreter keeps bf16 as uint16), which is
garbage. `support_kernels` makes the conversion read the array's one element, the value it meant, points those
functions at the interpreter's own math (numpy's, in fp32), has the autotuner take each kernel's first
configuration (its timings all equal), and widens bf16 dot operands to fp32 first (their products are exact
there, as on tensor cores); it changes nothing on a GPU, where the interpreter is not used.
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
    import numpy as np

    def widen(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        data = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    create_dot.deepserve_bf16 = True
    return create_dot
