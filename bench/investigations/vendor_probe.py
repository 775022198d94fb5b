"""Can the vendor kernels (DeepGEMM from `sgl-deep-gemm`) run on this machine, and how fast are they here?

    python bench/investigations/vendor_probe.py [--out DIR] [--wheels DIR]

Prints what the machine has for them (nvcc, CUDA_HOME, the CUDA runtime libraries), then for each
`sgl_deep_gemm` wheel in --wheels (default .whl/vendor; their dependencies in its deps/), in a process of its
own, tries `import deep_gemm`, and on failure the dynamic loader's own message. When it imports: its bf16 grouped
GEMM over expert-sorted rows
(`m_grouped_bf16_gemm_nt_contiguous`) at an 8K prefill's expert shapes, checked against torch per expert and
timed against deepserve's Triton MoE gate/up kernel on the same rows. Every step reports its error instead of
stopping the script. Writes vendor_probe.json into --out ($OUT when set).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import traceback
import zipfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def sh(cmd: str) -> str:
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=60).stdout.strip()
    except Exception as e:  # noqa: BLE001 - a probe reports, it does not stop
        return f"error: {e}"


def events(fn, repeats=20, warmup=3) -> float:
    for _ in range(warmup):
        fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(repeats):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3 / repeats


def environment() -> dict:
    patterns = ("/usr/local/cuda*/lib64/libcudart.so*", "/usr/lib/x86_64-linux-gnu/libcuda*",
                "/usr/local/lib/python3*/dist-packages/nvidia/*/lib/*.so*",
                "/usr/local/lib/python3*/site-packages/nvidia/*/lib/*.so*")
    libs = sorted({Path(p).name for pat in patterns for p in glob.glob(pat)})
    return {"nvcc": shutil.which("nvcc"), "nvcc_version": sh("nvcc --version | tail -2"),
            "CUDA_HOME": os.environ.get("CUDA_HOME"), "cuda_dirs": sorted(glob.glob("/usr/local/cuda*")),
            "torch": torch.__version__, "torch_cuda": torch.version.cuda, "libs": libs,
            "driver": sh("nvidia-smi --query-gpu=driver_version --format=csv,noheader")}


def grouped_case(dg, E=32, rows_per_expert=1536, N=4096, K=4096) -> dict:
    """m_grouped_bf16_gemm_nt_contiguous: rows sorted by expert, each expert's run padded to the alignment."""
    align = dg.get_mk_alignment_for_contiguous_layout()
    per = -(-rows_per_expert // align) * align
    M = E * per
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
    d = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    layout = torch.arange(E, device="cuda", dtype=torch.int32).repeat_interleave(per)
    dg.m_grouped_bf16_gemm_nt_contiguous(a, b, d, layout)
    torch.cuda.synchronize()
    err = 0.0
    for e in (0, E // 2, E - 1):
        ref = a[e * per : (e + 1) * per].float() @ b[e].float().t()
        err = max(err, ((d[e * per : (e + 1) * per].float() - ref).abs().max() / ref.abs().max()).item())
    s = events(lambda: dg.m_grouped_bf16_gemm_nt_contiguous(a, b, d, layout))
    flops = 2 * M * N * K
    res = {"alignment": align, "M": M, "N": N, "K": K, "experts": E, "max_rel_err": err, "seconds": s,
           "tflops": flops / s / 1e12}
    # deepserve's Triton gate/up (+ clamped SwiGLU) on the same routing: every row's token picks its expert
    from deepserve.backends.nvidia.triton_ops import moe

    x = a[:: 1][: E * rows_per_expert]
    ids = torch.arange(E, device="cuda").repeat_interleave(rows_per_expert)[:, None]
    w = torch.ones_like(ids, dtype=torch.float32)
    w2 = torch.randn(E, K, N // 2, device="cuda", dtype=torch.bfloat16) / (N // 2) ** 0.5
    full = events(lambda: moe.moe_experts(x, ids, w, b, w2, 10.0), repeats=10)
    res["triton_moe_both_gemms_seconds"] = full
    res["triton_moe_tflops"] = (2 * x.shape[0] * N * K + 2 * x.shape[0] * K * (N // 2)) / full / 1e12
    return res


def probe_one(site: str) -> dict:
    """In this process (PYTHONPATH holds `site`): import deep_gemm and, when it imports, run the cases."""
    out: dict = {}
    try:
        import deep_gemm as dg

        out["deep_gemm"] = {"imported": True, "file": dg.__file__, "num_sms": dg.get_num_sms()}
    except Exception as e:  # noqa: BLE001
        out["deep_gemm"] = {"imported": False, "error": f"{type(e).__name__}: {e}"[:2000]}
        lib = next(Path(site).glob("deep_gemm/_C*.so"), None)
        if lib is not None:  # the loader's own words (torch.ops.load_library hides them)
            import ctypes

            try:
                ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
                out["deep_gemm"]["dlopen"] = "loads"
            except OSError as err:
                out["deep_gemm"]["dlopen"] = str(err)[:2000]
        return out
    for name, kw in (("small", dict(E=4, rows_per_expert=256, N=512, K=512)), ("prefill_8k_gate_up", {})):
        try:
            out[name] = grouped_case(dg, **kw)
        except Exception as e:  # noqa: BLE001
            out[name] = {"error": f"{type(e).__name__}: {e}"[:3000], "trace": traceback.format_exc()[-3000:]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "."))
    ap.add_argument("--wheels", type=Path, default=ROOT / ".whl" / "vendor",
                    help="sgl_deep_gemm wheels to try, one at a time (their deps in WHEELS/deps)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: probe the site on PYTHONPATH
    args = ap.parse_args()
    if args.one:
        print(json.dumps(probe_one(args.one)))
        return
    out: dict = {"environment": environment(), "wheels": {}}
    print(json.dumps(out["environment"], indent=1), flush=True)
    deps = sorted((args.wheels / "deps").glob("*.whl"))
    for wheel in sorted(args.wheels.glob("sgl_deep_gemm-*.whl")):
        site = Path("/tmp") / ("probe-" + wheel.name.split("-")[1])
        with zipfile.ZipFile(wheel) as z:  # its pinned dependencies, from the wheel's METADATA
            meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        pins = [line.split(":", 1)[1].strip().replace("-", "_") for line in meta.splitlines()
                if line.startswith("Requires-Dist:") and "==" in line and "extra ==" not in line]
        wanted = [d for d in deps if any(d.name.startswith(pin.replace("==", "-") + "-") for pin in pins)]
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site),
               str(wheel)] + [str(d) for d in wanted]
        subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        env = dict(os.environ, PYTHONPATH=f"{site}:{ROOT}")
        try:
            run = subprocess.run([sys.executable, __file__, "--one", str(site)], capture_output=True, text=True,
                                 timeout=600, env=env)
            res = json.loads(run.stdout.strip().splitlines()[-1]) if run.returncode == 0 and run.stdout.strip() \
                else {"returncode": run.returncode, "stderr": run.stderr[-3000:]}
        except Exception as e:  # noqa: BLE001
            res = {"error": f"{type(e).__name__}: {e}"[:2000]}
        out["wheels"][wheel.name] = res
        print(wheel.name, json.dumps(res, indent=1)[:2500], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "vendor_probe.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
