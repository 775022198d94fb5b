"""Stored precision on one GPU (issue 20): the same checkpoint served as stored (FP8 dense, FP4 routed experts) and
dequantized to bf16 (`--quantization none`), in one run.

    python bench/stored_precision.py [--out DIR] [--checkpoint DIR] [--experts 16] [--quick]

1. Ceilings: device copy bandwidth and the bf16 matrix rate (bench/gpu.py's `measure_floors`), and the FP8
   matrix rate (`torch._scaled_mm`, e4m3 8192^3 with row-wise scales; where it does not run, deepserve's own FP8
   kernel at that shape, which is then said).
2. A checkpoint as DeepSeek stores V4-Flash, at full depth: 43 layers (0-1 window-only, then CSA on even and HCA
   on odd layers), the first three hash-routed, one MTP block, V4-Flash's shapes, the routed experts reduced to
   `--experts` (16: ~23B parameters, ~46 GB in bf16, ~15 GB stored). Random bf16 weights are drawn on the GPU and
   only the stored form is written (deepserve's writer, `quantization="fp8"`).
3. That checkpoint loaded twice: as stored (`quantization="auto"`) and dequantized (`"none"`). Each: the GPU memory
   its weights take, KV bytes per token, prefill tok/s (1K, 8K; MFU against the FP8 rate for the stored model and
   the bf16 rate for bf16), decode ms/step with CUDA graphs at batch 1 and 64 (context `--context`), MBU = bytes
   a step must read at that model's precision / step time / copy bandwidth, and the logprobs of a fixed prompt.
4. Stored against bf16: decode and prefill speed ratios, logprob differences (max and mean |d logprob| of the
   prompt's tokens, greedy agreement of the top token), and the largest batch x context the KV memory left after
   the weights holds (`gpu_memory_utilization` 0.9), with and without the FP8 KV cache (`--kv-cache-dtype fp8`):
   its bytes per token are the stored form's (`bytes_per_page(precision=..)`: 592 B rows, 68 B indexer keys), and
   its logprob rows compare the stored model with the FP8 KV rounding against the same model without it; and the
   stored model's decode step with the FP8 KV cache's packed pools (`ms_per_step_fp8_kv`: the packed kernels,
   FlashMLA's sparse decode where it loads; `--no-fp8-kv-decode` leaves it out).

Prints the table last; writes stored_precision.json into --out ($OUT when set). `--quick`: tiny shapes on any
device, a check of the harness, not a measurement.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import gpu as base  # noqa: E402  bench/gpu.py: floors, timing, the random-weight builder, byte and FLOP counts

FLASH_LAYERS = ["sliding_attention"] * 2 + ["compressed_sparse_attention" if i % 2 == 0 else
                                            "heavily_compressed_attention" for i in range(2, 43)]
PAGE = base.PAGE_SIZE


def flash_config(experts: int, quick: bool) -> dict:
    shapes = base.QUICK if quick else base.V4_FLASH_LAYER
    layers = FLASH_LAYERS[:8] if quick else FLASH_LAYERS
    return dict(shapes, n_routed_experts=experts, layer_types=layers, num_hidden_layers=len(layers),
                mlp_layer_types=["hash_moe"] * 3 + ["moe"] * (len(layers) - 3), num_nextn_predict_layers=1)


# -- 1. the FP8 ceiling -------------------------------------------------------------------------------------------
def fp8_matmul_rate(device) -> dict:
    m = 8192
    a = torch.randn(m, m, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(m, m, device=device).to(torch.float8_e4m3fn)
    sa, sb = torch.ones(m, 1, device=device), torch.ones(1, m, device=device)
    try:
        s = base.events(lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16))
        how = "torch._scaled_mm e4m3 row-wise scales"
    except (RuntimeError, TypeError, AttributeError) as e:  # this torch or GPU has no FP8 GEMM: our kernel's rate
        from deepserve.backends.nvidia.triton_ops.fp8_linear import fp8_linear
        from deepserve.model import quant

        w, ws = quant.quantize_fp8(torch.randn(m, m, device=device))
        x = torch.randn(m, m, device=device, dtype=torch.bfloat16)
        s = base.events(lambda: fp8_linear(x, w, ws, (128, 128), act_fp8=True))
        how = f"deepserve fp8_linear (torch._scaled_mm failed: {str(e)[:120]})"
    return {"fp8_flops_per_s": 2 * m**3 / s, "fp8_seconds": s, "fp8_how": how}


# -- accounting at the stored precision ---------------------------------------------------------------------------
def stored_weight_bytes(model) -> dict:
    """bench/gpu.py's `weight_bytes`, counting what is in memory: stored weights with their scale buffers."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())

    def size(name: str) -> int:
        scale = buffers.get(name + "_scale_inv")
        return params[name].nbytes + (scale.nbytes if scale is not None else 0)

    experts = sum(size(n) for n in params if ".experts." in n)
    rest = sum(size(n) for n in params if ".experts." not in n and not n.endswith("embed_tokens.weight"))
    embed = model.model.embed_tokens.weight
    logical = sum(p.numel() * (2 if p.dtype == torch.int8 else 1) for p in params.values())
    return {"parameters": logical, "total_bytes": sum(size(n) for n in params), "non_expert_bytes": rest,
            "routed_expert_bytes": experts, "embed_row_bytes": embed.shape[1] * embed.element_size()}


def bf16_weight_bytes(model) -> dict:
    """The same counts as if every weight were bf16 (what `base.token_flops` reads parameters from)."""
    def logical(p):
        return p.numel() * (2 if p.dtype == torch.int8 else 1) * 2

    params = dict(model.named_parameters())
    embed = model.model.embed_tokens.weight
    return {"parameters": sum(p.numel() for p in params.values()),
            "non_expert_bytes": sum(logical(p) for n, p in params.items()
                                    if ".experts." not in n and not n.endswith("embed_tokens.weight")),
            "routed_expert_bytes": sum(logical(p) for n, p in params.items() if ".experts." in n),
            "embed_row_bytes": embed.shape[1] * 2}


# -- 3. one model -------------------------------------------------------------------------------------------------
@torch.no_grad()
def bench_model(path: Path, quantization: str, backend, device, args, prompt: list[int], floors: dict) -> dict:
    from deepserve.model.batch import make_batch
    from deepserve.model.cuda_graphs import DecodeGraphs
    from deepserve.model.factory import load_model
    from deepserve.model.kv_cache import bytes_per_page
    from deepserve.model.kv_precision import KVPrecision, use_kv_cache_dtype

    cuda = torch.device(device).type == "cuda"
    before = torch.cuda.memory_allocated(device) if cuda else 0
    began = time.perf_counter()
    model = load_model(path, backend, "bfloat16" if cuda else "float32", progress=False, quantization=quantization)
    out = {"quantization": quantization, "load_seconds": time.perf_counter() - began}
    out["weight_memory_bytes"] = (torch.cuda.memory_allocated(device) - before) if cuda else None
    wb = out["weights"] = stored_weight_bytes(model)
    flops_wb = bf16_weight_bytes(model)
    page_bytes = bytes_per_page(model, PAGE, model.lm_head.weight.dtype)
    out["kv_bytes_per_token"] = page_bytes / PAGE
    fp8_page_bytes = bytes_per_page(model, PAGE, model.lm_head.weight.dtype,
                                    precision=KVPrecision("fp8", model.cfg.qk_rope_head_dim))
    out["kv_bytes_per_token_fp8_kv"] = fp8_page_bytes / PAGE
    if cuda:
        free, total = torch.cuda.mem_get_info(device)
        budget = max(int(free - 0.1 * total), 0)
        out["kv_budget_bytes"] = budget
        out["max_tokens"] = budget // page_bytes * PAGE
        out["max_tokens_fp8_kv"] = budget // fp8_page_bytes * PAGE
    print(f"[{quantization}] weights {wb['total_bytes'] / 2**30:.2f} GiB counted, "
          f"{(out['weight_memory_bytes'] or 0) / 2**30:.2f} GiB allocated; KV {out['kv_bytes_per_token']:.0f} B/token",
          flush=True)

    def prompt_logprobs():
        batch = make_batch([prompt], [0], device, logits_rows=[range(len(prompt))])
        return torch.log_softmax(model(batch, [model.make_state()]).logits.float(), dim=-1).cpu()

    out["_logprobs"] = prompt_logprobs()
    use_kv_cache_dtype(model, "fp8")  # the same prompt with the KV rows rounded as the FP8 cache keeps them
    out["_logprobs_fp8_kv"] = prompt_logprobs()
    use_kv_cache_dtype(model, "auto")

    rate = floors.get("fp8_flops_per_s" if quantization != "none" else "bf16_flops_per_s")
    g = torch.Generator().manual_seed(2)
    out["prefill"] = {}
    for n in args.prefill:
        ids = torch.randint(2, model.cfg.vocab_size, (n,), generator=g).tolist()
        s = base.timed(lambda: model(make_batch([ids], [0], device), [model.make_state()]), device, repeats=3)
        row = out["prefill"][n] = {"seconds": s, "tok_s": n / s}
        if rate:
            row["mfu"] = base.prefill_flops(model, flops_wb, n) / s / rate
        vendor = getattr(backend, "deep_gemm_fp8", None)
        if quantization != "none" and vendor is not None and vendor.enabled:  # what DeepGEMM's FP8 GEMM buys
            vendor.enabled = False
            try:
                s = base.timed(lambda: model(make_batch([ids], [0], device), [model.make_state()]), device, repeats=3)
            finally:
                vendor.enabled = True
            row.update(seconds_triton_fp8=s, tok_s_triton_fp8=n / s)
        print(f"[{quantization}] prefill {n}: {row}", flush=True)

    def decode_seconds(b: int, kv_cache_dtype: str) -> float:
        """Seconds a graphed decode step of b sequences at `args.context`, the cache's pools in `kv_cache_dtype`
        (`fp8`: packed, read by the packed kernels or FlashMLA where it loads, written by the packed writes)."""
        use_kv_cache_dtype(model, kv_cache_dtype)
        try:
            prompts = [torch.randint(2, model.cfg.vocab_size, (args.context,), generator=g).tolist() for _ in range(b)]
            states, cache = base.prefill_states(model, device, prompts, group=max(1, 16384 // args.context),
                                                extra_tokens=args.steps + 8)
            toks = torch.randint(2, model.cfg.vocab_size, (args.steps + 2, b), generator=g).tolist()
            graphs = DecodeGraphs(model, cache, max_batch=b,
                                  max_pages=-(-(args.context + args.steps + 8) // PAGE)) if cuda else None
            base.decode_steps(model, device, states, toks[:2], args.context, graphs)  # captures / warms up
            return base.decode_steps(model, device, states, toks[2:], args.context + 2, graphs, pipelined=True)
        finally:
            use_kv_cache_dtype(model, "auto")
            gc.collect()

    out["decode"] = {}
    for b in args.batches:
        s = decode_seconds(b, "auto")
        read = base.decode_bytes(model, wb, b, args.context)
        row = out["decode"][b] = {"batch": b, "context": args.context, "ms_per_step": 1e3 * s, "tok_s": b / s,
                                  "bytes_per_step": read}
        if floors.get("bandwidth_Bps"):
            row["mbu"] = read / s / floors["bandwidth_Bps"]
        if quantization != "none" and not args.no_fp8_kv_decode:  # the stored model with the FP8 KV cache too
            row["ms_per_step_fp8_kv"] = 1e3 * decode_seconds(b, "fp8")
            row["flash_mla"] = getattr(backend, "flash_mla", None) is not None
        print(f"[{quantization}] decode batch {b}: {row}", flush=True)
    del model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def logprob_diff(a: torch.Tensor, b: torch.Tensor, prompt: list[int]) -> dict:
    """max and mean |d logprob| of the prompt's tokens, the largest over the vocabulary, top-1 agreement."""
    targets = torch.tensor(prompt[1:])
    pa, pb = a[:-1].gather(1, targets[:, None])[:, 0], b[:-1].gather(1, targets[:, None])[:, 0]
    diff = (pa - pb).abs()
    return {"prompt_logprob_abs_diff_max": diff.max().item(), "prompt_logprob_abs_diff_mean": diff.mean().item(),
            "full_logprob_abs_diff_max": (a - b).abs().max().item(),
            "top1_agreement": (a.argmax(-1) == b.argmax(-1)).float().mean().item()}


def compare(stored: dict, plain: dict, prompt: list[int]) -> dict:
    a, b = stored.pop("_logprobs"), plain.pop("_logprobs")
    fp8_kv = {"stored": logprob_diff(stored.pop("_logprobs_fp8_kv"), a, prompt),
              "bf16": logprob_diff(plain.pop("_logprobs_fp8_kv"), b, prompt)}
    return {**logprob_diff(a, b, prompt), "fp8_kv_against_model_dtype_kv": fp8_kv,
            "decode_speedup": {k: stored["decode"][k]["tok_s"] / plain["decode"][k]["tok_s"] for k in stored["decode"]},
            "prefill_speedup": {k: stored["prefill"][k]["tok_s"] / plain["prefill"][k]["tok_s"]
                                for k in stored["prefill"]},
            "weight_memory_ratio": (stored["weight_memory_bytes"] / plain["weight_memory_bytes"]
                                    if plain.get("weight_memory_bytes") else None)}


def fits(row: dict, key: str = "max_tokens", contexts=(4096, 32768, 131072)) -> dict:
    """Largest batch at each context the KV budget holds (pages of PAGE tokens); `key`: the row's token count
    (`max_tokens`, or `max_tokens_fp8_kv` with the FP8 KV cache's stored bytes)."""
    if not row.get(key):
        return {}
    return {c: row[key] // (-(-c // PAGE) * PAGE) for c in contexts}


def report(res: dict) -> str:
    lines = [f"{res['device']}  torch {res['torch']}  {res['backend']}",
             f"model: {res['config_summary']}",
             f"floors: copy {res['floors'].get('bandwidth_Bps', 0) / 1e12:.2f} TB/s, bf16 "
             f"{res['floors'].get('bf16_flops_per_s', 0) / 1e12:.0f} TFLOP/s, fp8 "
             f"{res['floors'].get('fp8_flops_per_s', 0) / 1e12:.0f} TFLOP/s ({res['floors'].get('fp8_how', '-')})",
             "", f"{'':28}{'stored FP8/FP4':>18}{'bf16':>14}{'ratio':>10}"]
    s, p, c = res["stored"], res["bf16"], res["compare"]

    def row(label, a, b, fmt="{:.2f}", ratio=True):
        r = f"{a / b:.2f}x" if ratio and a and b else ""
        lines.append(f"{label:28}{fmt.format(a) if a is not None else '-':>18}{fmt.format(b) if b is not None else '-':>14}{r:>10}")

    row("weights, GiB allocated", (s["weight_memory_bytes"] or 0) / 2**30, (p["weight_memory_bytes"] or 0) / 2**30)
    row("KV bytes per token", s["kv_bytes_per_token"], p["kv_bytes_per_token"], "{:.0f}")
    row("KV bytes per token, FP8 KV", s["kv_bytes_per_token_fp8_kv"], p["kv_bytes_per_token_fp8_kv"], "{:.0f}")
    for k in s["prefill"]:
        row(f"prefill {k} tok/s", s["prefill"][k]["tok_s"], p["prefill"][k]["tok_s"], "{:.0f}")
        row(f"prefill {k} MFU", s["prefill"][k].get("mfu"), p["prefill"][k].get("mfu"), "{:.1%}", ratio=False)
    for k in s["decode"]:
        row(f"decode b{k} ms/step", s["decode"][k]["ms_per_step"], p["decode"][k]["ms_per_step"])
        row(f"decode b{k} tok/s", s["decode"][k]["tok_s"], p["decode"][k]["tok_s"], "{:.1f}")
        row(f"decode b{k} MBU", s["decode"][k].get("mbu"), p["decode"][k].get("mbu"), "{:.1%}", ratio=False)
        if s["decode"][k].get("ms_per_step_fp8_kv"):  # the stored model: FP8 KV cache | the model dtype's
            flash = " (FlashMLA)" if s["decode"][k].get("flash_mla") else ""
            row(f"decode b{k} ms FP8|auto KV{flash}", s["decode"][k]["ms_per_step_fp8_kv"],
                s["decode"][k]["ms_per_step"], ratio=True)
    lines += ["", f"logprobs (stored vs bf16, prompt tokens): max |d| {c['prompt_logprob_abs_diff_max']:.4f}, mean "
              f"{c['prompt_logprob_abs_diff_mean']:.4f}; top-1 agreement {c['top1_agreement']:.1%}",
              f"largest batch per context (KV budget after weights): stored {res['fits_stored']}, bf16 "
              f"{res['fits_bf16']}",
              f"  with the FP8 KV cache (its stored form's bytes): stored {res['fits_stored_fp8_kv']}, bf16 "
              f"{res['fits_bf16_fp8_kv']}"]
    for name, d in c["fp8_kv_against_model_dtype_kv"].items():
        lines.append(f"FP8 KV against the model-dtype KV ({name} weights): max |d| "
                     f"{d['prompt_logprob_abs_diff_max']:.4f}, mean {d['prompt_logprob_abs_diff_mean']:.4f}; "
                     f"top-1 agreement {d['top1_agreement']:.1%}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "bench" / "results"))
    ap.add_argument("--checkpoint", type=Path, default=None, help="where the stored checkpoint goes (default: temp)")
    ap.add_argument("--experts", type=int, default=16, help="routed experts per layer (V4-Flash has 256)")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="tiny shapes: a check of this script, not a measurement")
    ap.add_argument("--no-fp8-kv-decode", action="store_true",
                    help="leave out the stored model's decode steps with the FP8 KV cache")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    device = "cuda:0" if cuda else "cpu"
    if cuda:
        from deepserve.backends.nvidia import NvidiaBackend
        backend = NvidiaBackend(device)
    else:
        from deepserve.backends.reference import ReferenceBackend
        backend = ReferenceBackend("cpu", exact=False)
    quick = args.quick or not cuda
    args.prefill, args.batches = ([64], [1, 4]) if quick else ([1024, 8192], [1, 64])
    if quick:
        args.context, args.steps, args.experts = 48, 3, min(args.experts, 8)
    cfg = flash_config(args.experts, quick)
    res = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
           "backend": repr(backend), "config": cfg, "context": args.context, "steps": args.steps,
           "command": " ".join(sys.argv)}
    res["floors"] = {**base.measure_floors(device), **fp8_matmul_rate(device)} if cuda else {}

    began = time.perf_counter()
    model = base.build(cfg, backend, torch.bfloat16 if cuda else torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    res["config_summary"] = (f"{cfg['num_hidden_layers']} layers + MTP, {args.experts} routed experts, "
                             f"{n_params / 1e9:.2f}B parameters")
    print(res["config_summary"], flush=True)
    from deepserve.model.writer import save_checkpoint

    path = args.checkpoint or Path(tempfile.mkdtemp(prefix="deepserve-stored-"))
    save_checkpoint(model, path, quantization="fp8")
    res["checkpoint_bytes"] = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    res["build_write_seconds"] = time.perf_counter() - began
    print(f"stored checkpoint: {res['checkpoint_bytes'] / 2**30:.2f} GiB in {res['build_write_seconds']:.0f} s",
          flush=True)
    del model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()

    prompt = torch.randint(2, cfg["vocab_size"], (256 if not quick else 40,),
                           generator=torch.Generator().manual_seed(5)).tolist()
    args.out.mkdir(parents=True, exist_ok=True)
    record = args.out / ("stored_precision_quick.json" if quick else "stored_precision.json")

    def save() -> None:  # after each model too: a run cut short keeps the stored model's rows
        record.write_text(json.dumps(res, indent=2, default=str) + "\n")

    res["stored"] = bench_model(path, "auto", backend, device, args, prompt, res["floors"])
    save()
    res["bf16"] = bench_model(path, "none", backend, device, args, prompt, res["floors"])
    res["compare"] = compare(res["stored"], res["bf16"], prompt)
    res["fits_stored"], res["fits_bf16"] = fits(res["stored"]), fits(res["bf16"])
    res["fits_stored_fp8_kv"] = fits(res["stored"], "max_tokens_fp8_kv")
    res["fits_bf16_fp8_kv"] = fits(res["bf16"], "max_tokens_fp8_kv")
    save()
    print(report(res))


if __name__ == "__main__":
    main()
