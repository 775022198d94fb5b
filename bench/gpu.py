"""deepserve's NVIDIA backend against transformers and the hardware floors, on one GPU, in one run.

    python bench/gpu.py [--out DIR] [--skip-hf] [--quick]

1. Hardware ceilings: device-to-device copy bandwidth (bytes read + written) and the bf16 matrix rate (8192^3
   random operands), each the median of timed repeats after warm-ups.
2. A synthetic checkpoint with V4-Flash's per-layer shapes (hidden 4096, 64 heads of 512, q_lora 1024, 8 output
   groups of rank 1024, window 128, CSA ratio 4 with a 64x128 indexer picking 512, HCA ratio 128, mHC 4 streams,
   vocab 129280) and fewer layers and experts (layers SW SW CSA HCA CSA HCA, 32 routed experts top-6 + 1 shared;
   the first three layers hash-routed as in V4): random bf16 weights drawn on the GPU, written with deepserve's
   writer, loaded by transformers' `DeepseekV4ForCausalLM` from that directory.
3. transformers: prefill tok/s (one sequence) and decode ms/step (batch B, every sequence at the same context).
4. deepserve (`NvidiaBackend`, model forward over the engine's paged cache, the runner's one device-to-host copy
   of the sampled ids per step): the same, at more sizes; decode both replaying CUDA graphs (`DecodeGraphs`, the
   engine's default) and launching every kernel (eager, `--enforce-eager` in the server), each over its own
   prefilled cache; a profile of one eager decode step (GPU-busy time vs wall time). Where DeepGEMM loads
   (`backends/nvidia/vendor.py`), each prefill is also timed with the Triton MoE kernels instead.
5. MBU = bytes a decode step must read (every non-expert weight incl. the LM head, the shared expert, the routed
   experts the batch touches in expectation under uniform routing, each sequence's KV rows) / step time /
   measured copy bandwidth. MFU = model FLOPs / time / measured matrix rate.

Prints a table last; writes gpu_bench.json and gpu_bench.png into --out ($OUT when set).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deepserve.core.config import ModelConfig  # noqa: E402

LAYERS = ["sliding_attention", "sliding_attention", "compressed_sparse_attention",
          "heavily_compressed_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
V4_FLASH_LAYER = dict(
    model_type="deepseek_v4", vocab_size=129280, hidden_size=4096, num_attention_heads=64, head_dim=512,
    q_lora_rank=1024, o_groups=8, o_lora_rank=1024, sliding_window=128, qk_rope_head_dim=64,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    index_n_heads=64, index_head_dim=128, index_topk=512, hc_mult=4, hc_sinkhorn_iters=20,
    moe_intermediate_size=2048, n_routed_experts=32, num_experts_per_tok=6, n_shared_experts=1,
    routed_scaling_factor=1.5, swiglu_limit=10.0, num_nextn_predict_layers=0, max_position_embeddings=1048576,
    layer_types=LAYERS, mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 3, num_hidden_layers=len(LAYERS),
    bos_token_id=0, eos_token_id=1,
)
# shapes for a run of the harness on a CPU (transformers and the reference backend): not a measurement
QUICK = dict(V4_FLASH_LAYER, vocab_size=512, hidden_size=64, num_attention_heads=4, head_dim=32, q_lora_rank=32,
             o_groups=2, o_lora_rank=16, sliding_window=16, qk_rope_head_dim=16, index_n_heads=16,
             index_head_dim=16, index_topk=4, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
             compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16})


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeats=5, warmup=1) -> float:
    """Median wall seconds of `fn()` with the device synchronized around each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        began = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def events(fn, repeats=10, warmup=3) -> float:
    """Median GPU seconds of `fn()` between two CUDA events (no host time in it)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return statistics.median(out)


# -- 1. the ceilings ----------------------------------------------------------------------------------------------
def measure_floors(device) -> dict:
    n = 4 << 30  # 4 GiB each way, far past the 60 MB L2
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = events(lambda: dst.copy_(src))
    del src, dst
    m = 8192
    a = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    mm_s = events(lambda: a @ b)
    del a, b
    torch.cuda.empty_cache()
    return {"copy_bytes": 2 * n, "copy_seconds": copy_s, "bandwidth_Bps": 2 * n / copy_s,
            "matmul_flops": 2 * m**3, "matmul_seconds": mm_s, "bf16_flops_per_s": 2 * m**3 / mm_s}


# -- 2. the checkpoint ----------------------------------------------------------------------------------------------
@torch.no_grad()
def randomize_on_device(model, seed: int) -> None:
    """The rules of `deepserve.model.factory.randomize`, drawn on the model's device (6.7B values on a CPU
    generator take minutes)."""
    g = torch.Generator(device=model.lm_head.weight.device).manual_seed(seed)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        val = torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32)
        if name.endswith("norm.weight"):
            val = 1.0 + 0.1 * val
        elif leaf in ("sinks", "base", "hc_base", "position_bias"):
            val = 0.5 * val
        elif leaf in ("scale", "hc_scale"):
            val = 1.0 + 0.2 * val
        elif leaf in ("fn", "hc_fn"):
            val = val * 0.5 / math.sqrt(p.shape[-1])
        elif not name.endswith("embed_tokens.weight"):
            val = val / math.sqrt(p.shape[-1])
        p.copy_(val)
        del val
    cfg = model.cfg
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn(b.shape, generator=g, device=b.device))
        elif name.endswith("tid2eid"):
            keys = torch.rand((b.shape[0], cfg.n_routed_experts), generator=g, device=b.device)
            b.copy_(keys.argsort(dim=1)[:, : b.shape[1]])


def build(cfg_dict: dict, backend, dtype, seed=0):
    from deepserve.model.factory import build_model, materialize

    cfg = ModelConfig.from_dict(cfg_dict)
    # (parameters made in `dtype` on the device, not first in the constructors' fp32: a 23B model fits an H100)
    model = materialize(build_model(cfg, backend, dtype, params_on_meta=True), backend.device)
    randomize_on_device(model, seed)
    model.share_projection_inputs()  # as load_model does
    return model


# -- accounting -----------------------------------------------------------------------------------------------------
def weight_bytes(model) -> dict:
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    embed = model.model.embed_tokens.weight
    rest = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
               if ".experts." not in n and not n.endswith("embed_tokens.weight"))
    params = sum(p.numel() for p in model.parameters())
    return {"parameters": params, "total_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "non_expert_bytes": rest, "routed_expert_bytes": experts, "embed_row_bytes": embed.shape[1] * embed.element_size()}


def decode_bytes(model, wb: dict, batch: int, context: int) -> float:
    """Bytes one decode step must read at `batch` sequences of `context` tokens."""
    cfg = model.cfg
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    per_expert = wb["routed_expert_bytes"] / (E * cfg.num_hidden_layers)
    touched = E * (1 - (1 - k / E) ** batch)  # expected distinct experts under uniform routing
    weights = wb["non_expert_bytes"] + cfg.num_hidden_layers * touched * per_expert + batch * wb["embed_row_bytes"]
    kv = 0.0
    d, el = cfg.head_dim, 2
    for lt in cfg.layer_types:
        rows = min(context, cfg.sliding_window)
        if lt == "compressed_sparse_attention":
            rows += min(cfg.index_topk, context // 4)
            kv += (context // 4) * cfg.index_head_dim * el  # the indexer scores every compressed key
        elif lt == "heavily_compressed_attention":
            rows += context // cfg.compress_rate(lt)
        kv += rows * d * el
    return weights + batch * kv


def token_flops(model, wb: dict, context: int, logits: bool) -> float:
    """FLOPs of one token at position `context` (weights x2, attention over its keys, indexer over its rows)."""
    cfg = model.cfg
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    per_expert = wb["routed_expert_bytes"] / (E * cfg.num_hidden_layers) / 2  # bf16 parameters
    lm_head = cfg.vocab_size * cfg.hidden_size
    dense = wb["non_expert_bytes"] / 2 - lm_head
    f = 2 * (dense + cfg.num_hidden_layers * k * per_expert + (lm_head if logits else 0))
    H, d = cfg.num_attention_heads, cfg.head_dim
    for lt in cfg.layer_types:
        keys = min(context + 1, cfg.sliding_window)
        if lt == "compressed_sparse_attention":
            keys += min(cfg.index_topk, (context + 1) // 4)
            f += 2 * cfg.index_n_heads * cfg.index_head_dim * ((context + 1) // 4)
        elif lt == "heavily_compressed_attention":
            keys += (context + 1) // cfg.compress_rate(lt)
        f += 4 * H * d * keys
    return f


def prefill_flops(model, wb, length: int) -> float:
    return sum(token_flops(model, wb, p, logits=p == length - 1) for p in range(length))


# -- 3. transformers ------------------------------------------------------------------------------------------------
def load_hf(path: Path, device, dtype):
    """transformers' `DeepseekV4ForCausalLM` from `path`, every parameter in `dtype`, in eval mode."""
    from transformers import DeepseekV4ForCausalLM

    where = {"device_map": device} if torch.device(device).type == "cuda" else {}  # accelerate is on the GPU box
    hf = DeepseekV4ForCausalLM.from_pretrained(path, dtype=dtype, **where).eval()
    # transformers 5.17 keeps its norms and mHC weights in fp32 and hands their fp32 outputs to bf16 projections
    # (a dtype error); every parameter in the run's dtype is how it runs at all
    return hf.to(dtype)


@torch.no_grad()
def bench_hf(path: Path, device, dtype, prefill_lens, decode_batches, context, steps, vocab) -> dict:
    began = time.perf_counter()
    hf = load_hf(path, device, dtype)
    out = {"load_seconds": time.perf_counter() - began, "prefill": {}, "decode": {}}
    g = torch.Generator().manual_seed(1)
    for n in prefill_lens:
        ids = torch.randint(2, vocab, (1, n), generator=g).to(device)
        try:
            s = timed(lambda: hf(ids, use_cache=True, logits_to_keep=1), device, repeats=3)
            out["prefill"][n] = {"seconds": s, "tok_s": n / s}
        except torch.OutOfMemoryError as e:
            out["prefill"][n] = {"error": f"out of memory: {e}"[:200]}
            torch.cuda.empty_cache()
        print(f"  transformers prefill {n}: {out['prefill'][n]}", flush=True)
    for b in decode_batches:
        ids = torch.randint(2, vocab, (b, context), generator=g).to(device)
        res = hf(ids, use_cache=True, logits_to_keep=1)
        cache = res.past_key_values
        toks = torch.randint(2, vocab, (steps + 2, b, 1), generator=g).to(device)
        for i in range(2):
            res = hf(toks[i], past_key_values=cache, use_cache=True)
            res.logits[:, -1].argmax(-1).tolist()
        sync(device)
        t0 = time.perf_counter()
        for i in range(2, steps + 2):
            res = hf(toks[i], past_key_values=cache, use_cache=True)
            res.logits[:, -1].argmax(-1).tolist()  # the step's device-to-host copy, as a server makes
        sync(device)
        s = (time.perf_counter() - t0) / steps
        out["decode"][f"{b}@{context}"] = {"batch": b, "context": context, "ms_per_step": 1e3 * s, "tok_s": b / s}
        print(f"  transformers decode batch {b}: {out['decode'][f'{b}@{context}']}", flush=True)
        del cache, res
    del hf
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return out


# -- 4. deepserve ---------------------------------------------------------------------------------------------------
PAGE_SIZE = 256


@torch.no_grad()
def prefill_states(model, device, prompts, group: int, extra_tokens: int = 64, paged: bool = True):
    """Prefill `prompts` and return their states: over a `PagedKVCache` as the engine's runner keeps them (the
    batched zero-copy decode path), or self-contained contiguous states with `paged=False`."""
    from deepserve.model.batch import make_batch

    cache = None
    if paged:
        from deepserve.model.kv_cache import PagedKVCache

        pages = [-(-(len(p) + extra_tokens) // PAGE_SIZE) for p in prompts]
        cache = PagedKVCache(model, sum(pages), PAGE_SIZE, len(prompts), device=device)
        first = [sum(pages[:i]) for i in range(len(prompts))]
        states = [cache.new_sequence(list(range(f, f + n)))[0] for f, n in zip(first, pages)]
    else:
        states = [model.make_state() for _ in prompts]
    for i in range(0, len(prompts), group):
        part = prompts[i : i + group]
        model(make_batch(part, [0] * len(part), device), states[i : i + group])
    return states, cache


@torch.no_grad()
def decode_steps(model, device, states, tokens, start: int, graphs=None, pipelined: bool = False):
    """One decode step per row of `tokens` [steps][B] (through `graphs`, a `DecodeGraphs`, when given); returns
    the mean seconds per step. Each step reads its greedy tokens back to the host. `pipelined`: as the engine's
    runner does it, a step's tokens are fed to the next step on the device and read back (a non-blocking copy
    into pinned memory) only after the next step is launched, so the host's work for a step overlaps the step
    before it; else each step waits for its own tokens before the next is built."""
    from deepserve.model.batch import make_batch

    B = len(states)
    forward = graphs.forward if graphs is not None else model
    sync(device)
    t0 = time.perf_counter()
    previous = pending = None
    for i, row in enumerate(tokens):
        batch = make_batch([[t] for t in row], [start + i] * B, device)
        if not pipelined:
            forward(batch, states).logits.argmax(-1).tolist()  # the one device-to-host copy of the step
            continue
        if previous is not None:
            batch.token_ids.copy_(previous)  # the runner's placeholders, filled on the device
        previous = forward(batch, states).logits.argmax(-1)
        host = torch.empty(B, dtype=torch.long, pin_memory=torch.device(device).type == "cuda")
        host.copy_(previous, non_blocking=True)
        copied = torch.cuda.Event() if torch.device(device).type == "cuda" else None
        if copied is not None:
            copied.record()
        if pending is not None:  # the step before this one: its tokens reach the host now
            if pending[1] is not None:
                pending[1].synchronize()
            pending[0].tolist()
        pending = (host, copied)
    sync(device)
    return (time.perf_counter() - t0) / len(tokens)


@torch.no_grad()
def profile_step(model, device, states, row, start) -> dict:
    """GPU-busy time of one decode step (sum of kernel times) and its top kernels, against its wall time."""
    from torch.profiler import ProfilerActivity, profile

    from deepserve.model.batch import make_batch

    B = len(states)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        sync(device)
        t0 = time.perf_counter()
        logits = model(make_batch([[t] for t in row], [start] * B, device), states).logits
        logits.argmax(-1).tolist()
        sync(device)
        wall = time.perf_counter() - t0
    from torch.autograd import DeviceType

    rows = []  # kernels only: the aten rows carry their kernels' device time too
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        if t > 0 and e.device_type == DeviceType.CUDA:
            rows.append((e.key, t / 1e6, e.count))
    rows.sort(key=lambda r: -r[1])
    busy = sum(r[1] for r in rows)
    return {"wall_seconds": wall, "gpu_busy_seconds": busy, "num_kernels": sum(r[2] for r in rows),
            "top": [{"kernel": k[:90], "seconds": s, "count": c} for k, s, c in rows[:25]],
            "host": host_profile(model, device, states, row, start + 1)}


def kernel_profile(fn) -> dict:
    """Kernel times of one call of `fn`, largest first."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.self_device_time_total / 1e6, e.count) for e in prof.key_averages()
            if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
    rows.sort(key=lambda r: -r[1])
    return {"gpu_busy_seconds": sum(r[1] for r in rows), "num_kernels": sum(r[2] for r in rows),
            "top": [{"kernel": k[:90], "seconds": s, "count": c} for k, s, c in rows[:25]]}


@torch.no_grad()
def host_profile(model, device, states, row, start) -> list[dict]:
    """Where the host's time in one decode step goes: deepserve's functions by cumulative time (cProfile)."""
    import cProfile
    import pstats

    from deepserve.model.batch import make_batch

    prof = cProfile.Profile()
    prof.enable()
    model(make_batch([[t] for t in row], [start] * len(states), device), states).logits.argmax(-1).tolist()
    prof.disable()
    stats = pstats.Stats(prof).stats
    rows = [(f"{Path(f).parent.name}/{Path(f).name}:{line}({fn})", ct, nc) for (f, line, fn), (_, nc, _, ct, _)
            in stats.items() if "deepserve" in f]
    rows.sort(key=lambda r: -r[1])
    return [{"function": f, "seconds": ct, "calls": nc} for f, ct, nc in rows[:20]]


@torch.no_grad()
def graph_decode(model, device, prompts, toks, ctx: int, steps: int, profile: bool = True) -> dict:
    """The engine's decode step as CUDA graphs (`DecodeGraphs`) over a `PagedKVCache` prefilled with `prompts`
    (each `ctx` tokens): rows of `toks` [steps + 3][B] are the fed tokens; two steps capture the bucket, then half
    the rest each step waiting for its tokens and half pipelined as the runner does. On a CPU the static forward
    runs eagerly. `profile` (CUDA): also the replay's GPU time and its kernels."""
    from deepserve.model.cuda_graphs import DecodeGraphs

    b = len(prompts)
    states, cache = prefill_states(model, device, prompts, group=max(1, 16384 // ctx), extra_tokens=steps + 8)
    dg = DecodeGraphs(model, cache, max_batch=b, max_pages=-(-(ctx + steps + 8) // PAGE_SIZE))
    decode_steps(model, device, states, toks[:2], ctx, dg)  # captures this bucket
    half = (len(toks) - 3) // 2
    blocking = decode_steps(model, device, states, toks[2 : 2 + half], ctx + 2, dg)
    s = decode_steps(model, device, states, toks[2 + half : -1], ctx + 2 + half, dg, pipelined=True)
    row = {"batch": b, "context": ctx, "ms_per_step": 1e3 * s, "tok_s": b / s, "ms_per_step_blocking": 1e3 * blocking,
           "capture_seconds": dg.capture_seconds}
    if profile and torch.device(device).type == "cuda":  # the replay alone: GPU time, and its kernels
        graph = next(iter(dg._buckets.values())).graph
        kp = kernel_profile(graph.replay)
        row.update(replay_ms=1e3 * events(graph.replay, repeats=20), graph_kernels=kp["num_kernels"],
                   graph_busy_ms=1e3 * kp["gpu_busy_seconds"], graph_top=kp["top"][:40])
        print(f"    replay {row['replay_ms']:.3f} ms GPU, {kp['num_kernels']} kernels,"
              f" busy {1e3 * kp['gpu_busy_seconds']:.3f} ms", flush=True)
        for k in kp["top"][:15]:
            print(f"      {1e3 * k['seconds']:7.3f} ms {k['count']:6d}x {k['kernel'][:70]}")
    del states, cache, dg
    return row


@torch.no_grad()
def bench_deepserve(model, device, prefill_lens, decode_batches, context, steps, vocab, long_context,
                    paged: bool = True, graphs: bool = True) -> dict:
    from deepserve.model.batch import make_batch

    g = torch.Generator().manual_seed(2)
    out = {"prefill": {}, "decode": {}, "decode_graphs": {}, "profile": {}}
    # warm-up: compiles the Triton kernels for prefill- and decode-sized tiles
    st, _ = prefill_states(model, device, [torch.randint(2, vocab, (context,), generator=g).tolist()] * 2, group=2)
    decode_steps(model, device, st, [[5, 6]] * 2, context)
    del st
    for n in prefill_lens:
        ids = torch.randint(2, vocab, (n,), generator=g).tolist()

        def run():
            model(make_batch([ids], [0], device), [model.make_state()])
        try:
            s = timed(run, device, repeats=3)
            out["prefill"][n] = {"seconds": s, "tok_s": n / s}
            vendor = getattr(model.backend, "deep_gemm", None)
            if vendor is not None:  # the same prefill with the Triton MoE kernels: what the vendor GEMMs buy
                model.backend.deep_gemm = None
                try:
                    s = timed(run, device, repeats=3)
                finally:
                    model.backend.deep_gemm = vendor
                out["prefill"][n].update(seconds_triton_moe=s, tok_s_triton_moe=n / s)
        except torch.OutOfMemoryError as e:
            out["prefill"][n] = {"error": f"out of memory: {e}"[:200]}
        torch.cuda.empty_cache() if torch.device(device).type == "cuda" else None
        print(f"  deepserve prefill {n}: {out['prefill'][n]}", flush=True)
        if n == 8192 and torch.device(device).type == "cuda":
            out["prefill_profile"] = kernel_profile(run)
            for k in out["prefill_profile"]["top"][:10]:
                print(f"      {1e3 * k['seconds']:7.3f} ms {k['count']:6d}x {k['kernel'][:70]}")
    for b in decode_batches:
        for ctx in sorted({context, long_context if b in (1, 64) else context}):
            prompts = [torch.randint(2, vocab, (ctx,), generator=g).tolist() for _ in range(b)]
            states, cache = prefill_states(model, device, prompts, group=max(1, 16384 // ctx),
                                           extra_tokens=steps + 8, paged=paged)
            toks = torch.randint(2, vocab, (steps + 3, b), generator=g).tolist()
            key = f"{b}@{ctx}"
            if graphs and cache is not None:  # (on a CPU: the static forward, eagerly)
                # the graphs decode a second cache prefilled with the same prompts; the eager rows the first
                out["decode_graphs"][key] = graph_decode(model, device, prompts, toks, ctx, steps)
                print(f"  deepserve decode (CUDA graphs) batch {b} context {ctx}: {out['decode_graphs'][key]}",
                      flush=True)
            decode_steps(model, device, states, toks[:2], ctx)
            s = decode_steps(model, device, states, toks[2:-1], ctx + 2)
            out["decode"][key] = {"batch": b, "context": ctx, "ms_per_step": 1e3 * s, "tok_s": b / s}
            print(f"  deepserve decode batch {b} context {ctx}: {out['decode'][key]}", flush=True)
            if b in (1, 64) and torch.device(device).type == "cuda":
                out["profile"][key] = profile_step(model, device, states, toks[-1], ctx + 2 + steps)
                p = out["profile"][key]
                print(f"    profile: wall {1e3 * p['wall_seconds']:.2f} ms, GPU busy {1e3 * p['gpu_busy_seconds']:.2f} ms,"
                      f" {p['num_kernels']} kernels", flush=True)
                for k in p["top"][:8]:
                    print(f"      {1e3 * k['seconds']:7.3f} ms {k['count']:6d}x {k['kernel'][:70]}")
                for h in p["host"][:12]:
                    print(f"      host {1e3 * h['seconds']:8.2f} ms {h['calls']:6d}x {h['function']}")
            del states
    return out


def bench_engine(path: Path, device: str, num_seqs: int, input_len: int, output_len: int, vocab: int) -> dict:
    """The whole engine (`LLM.generate`: scheduler, runner, sampling, asynchronous scheduling) on the written
    checkpoint: `num_seqs` prompts of `input_len` random tokens, `output_len` greedy tokens each, with decode
    CUDA graphs and with `enforce_eager`. A warm-up pass of the same prompts (8 tokens each) compiles the kernels
    and captures the buckets the timed pass uses."""
    from deepserve import LLM, SamplingParams

    g = torch.Generator().manual_seed(5)
    prompts = [{"prompt_token_ids": torch.randint(2, vocab, (input_len,), generator=g).tolist()} for _ in range(num_seqs)]
    out = {"num_seqs": num_seqs, "input_len": input_len, "output_len": output_len}
    for eager in (False, True):
        llm = LLM(str(path), accelerator="nvidia" if device.startswith("cuda") else "cpu", max_num_seqs=num_seqs,
                  kv_cache_bytes=8 << 30 if device.startswith("cuda") else 256 << 20,
                  max_model_len=input_len + output_len + 256, enforce_eager=eager, load_plugins=False)
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        sync(device)
        began = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True),
                            use_tqdm=False)
        seconds = time.perf_counter() - began
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        key = "eager" if eager else "graphs"
        out[key] = {"seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds,
                    "graph_buckets": len(llm.graphs._buckets) if llm.graphs is not None else 0}
        print(f"  engine ({key}): {out[key]}", flush=True)
        del llm, outs
        gc.collect()
        torch.cuda.empty_cache() if device.startswith("cuda") else None
    out["graphs_over_eager"] = out["graphs"]["output_tok_s"] / out["eager"]["output_tok_s"]
    return out


# -- 5. report ------------------------------------------------------------------------------------------------------
def report(res: dict) -> str:
    f, wb = res["floors"], res["weights"]
    bw, peak = f.get("bandwidth_Bps"), f.get("bf16_flops_per_s")
    lines = [f"checkpoint: {wb['parameters'] / 1e9:.2f}B parameters, {wb['total_bytes'] / 2**30:.2f} GiB",
             f"floors: copy {bw / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s" if bw else "floors: -",
             "", f"{'decode':<26}{'ms/step':>10}{'tok/s':>10}{'GiB read':>10}{'floor ms':>10}{'MBU':>8}{'busy MBU':>10}"]
    for who, kind, label in (("transformers", "decode", "transformers"), ("deepserve", "decode", "deepserve eager"),
                             ("deepserve", "decode_graphs", "deepserve graphs")):
        for key, d in res.get(who, {}).get(kind, {}).items():
            need = d["bytes"]
            floor = need / bw if bw else float("nan")
            prof = res.get(who, {}).get("profile", {}).get(key) if kind == "decode" else None
            busy = f"{floor / prof['gpu_busy_seconds']:.1%}" if prof and bw else "-"
            if kind == "decode_graphs" and "graph_busy_ms" in d and bw:
                busy = f"{1e3 * floor / d['graph_busy_ms']:.1%}"
            lines.append(f"{label + ' b' + str(d['batch']) + ' ctx' + str(d['context']):<26}{d['ms_per_step']:>10.2f}"
                         f"{d['tok_s']:>10.0f}{need / 2**30:>10.2f}{1e3 * floor:>10.2f}"
                         f"{floor / (d['ms_per_step'] / 1e3):>8.1%}{busy:>10}")
            if "ms_per_step_blocking" in d and bw:
                ms = d["ms_per_step_blocking"]
                lines.append(f"{'  (each step waiting)':<26}{ms:>10.2f}{d['batch'] / ms * 1e3:>10.0f}{'':>20}"
                             f"{floor / (ms / 1e3):>8.1%}")
    eng = res.get("engine")
    if eng:
        lines += ["", f"engine, {eng['num_seqs']} prompts x {eng['input_len']} tokens, {eng['output_len']} greedy tokens each:"
                  f" graphs {eng['graphs']['output_tok_s']:.0f} output tok/s, eager {eng['eager']['output_tok_s']:.0f}"
                  f" ({eng['graphs_over_eager']:.2f}x)"]
    lines += ["", f"{'prefill':<26}{'tok/s':>10}{'TFLOP/s':>10}{'MFU':>8}"]
    for who in ("transformers", "deepserve"):
        for n, d in res.get(who, {}).get("prefill", {}).items():
            if "error" in d:
                lines.append(f"{who + ' ' + str(n):<26}{d['error'][:60]}")
                continue
            for tag, key in (("", "seconds"), (" (triton MoE)", "seconds_triton_moe")):
                if key in d:
                    rate = d["flops"] / d[key]
                    lines.append(f"{who + ' ' + str(n) + tag:<26}{int(n) / d[key]:>10.0f}{rate / 1e12:>10.1f}"
                                 f"{rate / peak if peak else float('nan'):>8.1%}")
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for who, kind, label, color in (("transformers", "decode", "transformers", "#999"),
                                    ("deepserve", "decode", "deepserve eager", "#8c8"),
                                    ("deepserve", "decode_graphs", "deepserve CUDA graphs", "#2a6")):
        dec = {d["batch"]: d for d in res.get(who, {}).get(kind, {}).values() if d["context"] == res["context"]}
        if dec:
            xs = sorted(dec)
            a.plot(xs, [dec[x]["tok_s"] for x in xs], "o-", color=color, label=label)
        if kind == "decode_graphs":
            continue
        pre = {int(n): d for n, d in res.get(who, {}).get("prefill", {}).items() if "tok_s" in d}
        if pre:
            xs = sorted(pre)
            b.plot(xs, [pre[x]["tok_s"] for x in xs], "o-", color=color, label=who)
    bw = res["floors"].get("bandwidth_Bps")
    if bw:
        xs = [1, 16, 64, 256]
        a.plot(xs, [x / (res["bytes_at"][str(x)] / bw) for x in xs], "k--", lw=1, label="bandwidth floor")
    a.set(xscale="log", yscale="log", xlabel="batch (sequences)", ylabel="decode tokens/s",
          title=f"decode, context {res['context']}")
    b.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="prefill tokens/s", title="prefill, one sequence")
    for ax in (a, b):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"V4-Flash layer shapes, 6 layers, 32 experts; {res['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "docs"))
    ap.add_argument("--checkpoint", type=Path, default=None, help="where to write the checkpoint (default: a temp dir)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--reuse-hf", type=Path, default=None,
                    help="take transformers' numbers from an earlier gpu_bench.json (same shapes) instead of rerunning it")
    ap.add_argument("--quick", action="store_true", help="tiny shapes: a check of this script, not a measurement")
    ap.add_argument("--context", type=int, default=512, help="tokens of context before decoding")
    ap.add_argument("--long-context", type=int, default=4096, help="a second decode context (deepserve, batch 1 and 64)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--contiguous", action="store_true",
                    help="decode over self-contained per-sequence states instead of the paged cache the engine uses")
    ap.add_argument("--decode-only", action="store_true", help="skip deepserve's prefill rows")
    ap.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph decode rows")
    ap.add_argument("--engine", action="store_true",
                    help="also time the whole engine (LLM.generate) on the written checkpoint, graphs vs eager")
    ap.add_argument("--skip-deepserve", action="store_true", help="skip the model-level deepserve rows")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    device = "cuda:0" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    if cuda:
        from deepserve.backends.nvidia import NvidiaBackend
        backend = NvidiaBackend(device)
    else:
        from deepserve.backends.reference import ReferenceBackend
        backend = ReferenceBackend("cpu")
    quick = args.quick or not cuda
    cfg = QUICK if quick else V4_FLASH_LAYER
    hf_prefill, ds_prefill = ([64, 256], [64, 256, 512]) if quick else ([1024, 8192], [1024, 8192, 32768])
    hf_batches, ds_batches = ([1, 4], [1, 4, 8]) if quick else ([1, 16, 64], [1, 16, 64, 256])
    if quick:
        args.context, args.long_context, args.steps = 48, 96, 3

    res = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
           "backend": repr(backend), "context": args.context, "steps": args.steps, "config": cfg}
    print(res["backend"], flush=True)
    res["floors"] = measure_floors(device) if cuda else {}
    if cuda:
        f = res["floors"]
        print(f"floors: copy {f['bandwidth_Bps'] / 1e12:.2f} TB/s, bf16 matmul {f['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s",
              flush=True)

    began = time.perf_counter()
    model = build(cfg, backend, dtype)
    wb = res["weights"] = weight_bytes(model)
    res["build_seconds"] = time.perf_counter() - began
    print(f"model: {wb['parameters'] / 1e9:.2f}B parameters, {wb['total_bytes'] / 2**30:.2f} GiB", flush=True)
    res["bytes_at"] = {str(b): decode_bytes(model, wb, b, args.context) for b in (1, 16, 64, 256)}

    if args.reuse_hf:
        earlier = json.loads(args.reuse_hf.read_text())
        res["transformers"] = dict(earlier["transformers"], reused_from=str(args.reuse_hf))
        res["transformers_floors"] = earlier["floors"]
    tmp = None
    if (not args.reuse_hf and not args.skip_hf) or args.engine:
        from deepserve.model.writer import save_checkpoint

        tmp = args.checkpoint or Path(tempfile.mkdtemp(prefix="deepserve-gpu-bench-"))
        began = time.perf_counter()
        save_checkpoint(model, tmp)
        res["write_seconds"] = time.perf_counter() - began
    if not args.reuse_hf and not args.skip_hf:
        res["transformers"] = bench_hf(tmp, device, dtype, hf_prefill, hf_batches, args.context, args.steps,
                                       cfg["vocab_size"])
    res["deepserve_state"] = "contiguous" if args.contiguous else "paged"
    if not args.skip_deepserve:
        res["deepserve"] = bench_deepserve(model, device, [] if args.decode_only else ds_prefill, ds_batches,
                                           args.context, args.steps, cfg["vocab_size"], args.long_context,
                                           paged=not args.contiguous, graphs=not args.no_graphs)
    if args.engine:  # (on a CPU: a check of the harness; the reference backend has no graphs)
        res["engine"] = bench_engine(tmp, device, 64 if cuda else 4, args.context, 128 if cuda else 8, cfg["vocab_size"])

    for who in ("transformers", "deepserve"):
        for key, d in list(res.get(who, {}).get("decode", {}).items()) + \
                list(res.get(who, {}).get("decode_graphs", {}).items()):
            d["bytes"] = decode_bytes(model, wb, d["batch"], d["context"])
        for n, d in res.get(who, {}).get("prefill", {}).items():
            d["flops"] = prefill_flops(model, wb, int(n))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_bench.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    plot(res, args.out / "gpu_bench.png")
    print(report(res))


if __name__ == "__main__":
    main()
