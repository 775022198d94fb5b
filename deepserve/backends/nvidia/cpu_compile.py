"""The NVIDIA backend's kernels compiled for a GPU on a machine without one: Triton ships its whole compiler with
ptxas and nvdisasm, so a kernel's SASS for sm_90a can be had on a laptop CPU. For checks that need the compiler
and not a device: that every autotuning configuration compiles (tests/test_kernels_compile.py; a configuration
that fails to compile raises an error the autotuner does not catch, at a request's first step on the GPU), and how
many instructions a kernel's loop takes per byte (bench/investigations/sass_mix.py).
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path


def compile_for_gpu(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int,
                    odd: tuple = ("M", "top_k"), arch: int = 90):
    """`fn` (a JIT kernel, or an autotuned / heuristic one around it) compiled for sm_`arch` (90: Hopper, the
    H100 and H200). `signature`: its runtime arguments' types ("*bf16", "i32", ...). As the JIT specializes a
    launch, every pointer is taken as 16-byte aligned and every integer as a multiple of 16, except those named
    in `odd` (a decode step's row count, top-k). Returns Triton's compiled kernel (`.asm` holds ttir ... cubin);
    raises what the compiler raises."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    while not isinstance(fn, triton.JITFunction):
        fn = fn.fn
    names = list(fn.arg_names)
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k, v in signature.items()
             if (v.startswith("*") or v == "i32") and k not in odd}
    sig = {**signature, **{k: "constexpr" for k in constexprs}}
    source = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def sass(compiled) -> str:
    """A compiled kernel's SASS, disassembled by the nvdisasm Triton ships."""
    import triton

    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        return subprocess.run([str(nvdisasm), "-c", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
