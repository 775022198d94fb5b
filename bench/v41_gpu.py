"""DeepSeek-V4.1 on one GPU (issue 22's benchmark): a V4.1-Flash-shaped synthetic model in bf16.

    .venv/bin/python bench/v41_gpu.py                   # H200: writes bench/results/v41_gpu_h200.json
    .venv/bin/python bench/v41_gpu.py --quick           # CPU, small shapes, < 60 s: checks the harness

The model has V4.1-Flash's per-layer shapes (hidden 5120, 64 heads x 512, q_lora 1280, 8 x 1024 grouped output,
window 128, indexer 32 x 128 with top-512, candidate blocks 2048 x 8, experts 2304 wide, top-6, the 129,280
vocabulary) with fewer layers and experts to fit one GPU, keeping the producer/consumer pattern: layers 0-1
window-only, 2 a ratio-2 kv source ("Full", index source), 3 its Reuse, 4 the ratio-1 kv source (candidate
source), 5 and 7 Reuse, 6 a Reindex, so 5-7 own nothing per token but their window (Flash's 21-39). No Engram (its
tables are 98 GB a layer) and no DSpark blocks. Weights are random, made on the device in the device path's form
(FP8/FP4 weights dense in bf16, `numerics.QuantWeight.to`).

Measured (torch ops, the V4.1 device path as the engine runs it; CUDA time by synchronize around the steps):
* decode ms/step at batch 1 and 64 (`forward_decode`, every sequence at --context tokens), and MBU: the bytes a
  step must read (every dense weight, the routed experts the step's tokens picked, the fp32 head, the sequences'
  compressed rows and rings) over the step time, against the H200's 4.8 TB/s;
* prefill tok/s at --prefill tokens (one sequence from empty) and MFU: the step's model FLOPs (2 x the weights a
  token multiplies, top-k experts only, plus attention over each query's window and picks and the indexer's
  scores) against 989 TFLOP/s dense bf16;
* the prefill compute SWA bounded replay saves against exact (`deepserve.model.v41.replay`): the time to rebuild
  the state at a boundary of --prefill / 2 tokens from the last 128 tokens, from the last window x depth (1,024
  here; 5,120 on Flash's 40 layers), and by recomputing the prefix.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deepserve.model.v41.config import V41Config  # noqa: E402
from deepserve.model.v41.loader import fill_weights  # noqa: E402
from deepserve.model.v41.model import DeepseekV41ForCausalLM  # noqa: E402
from deepserve.model.v41.numerics import BLOCK, QuantWeight  # noqa: E402
from deepserve.model.v41.replay import BOUNDED_LENGTH, exact_length, replay_state  # noqa: E402

H200_BYTES_PER_S = 4.8e12
H200_BF16_FLOPS = 989e12

# V4.1-Flash's per-layer shapes (v41-architecture.md §1.1), 8 layers in its producer/consumer pattern
FLASH_SHAPES = dict(
    vocab_size=129280, dim=5120, n_heads=64, head_dim=512, rope_head_dim=64, q_lora_rank=1280, o_groups=8,
    o_lora_rank=1024, window_size=128, index_n_heads=32, index_head_dim=128, index_topk=512,
    candidate_topk_blocks=2048, candidate_block_size=8, moe_inter_dim=2304, n_activated_experts=6,
    n_routed_experts=32)
QUICK_SHAPES = dict(
    vocab_size=1024, dim=256, n_heads=4, head_dim=128, rope_head_dim=32, q_lora_rank=128, o_groups=2,
    o_lora_rank=128, window_size=32, index_n_heads=4, index_head_dim=64, index_topk=32,
    candidate_topk_blocks=4, candidate_block_size=8, moe_inter_dim=128, n_activated_experts=2, n_routed_experts=8)
LAYOUT = dict(n_layers=8, n_mtp_layers=0, compress_ratios=[0, 0, 2, 2, 1, 1, 1, 1], kv_source_layers=[2, 4],
              index_source_layers=[2, 4, 6], candidate_source_layer=4)


def config(shapes: dict) -> V41Config:
    d = dict(shapes, **LAYOUT, dtype="fp8", expert_dtype="fp4", n_shared_experts=1, score_func="sqrtsoftplus",
             gate_temp=1.0, norm_topk_prob=True, route_scale=1.5, swiglu_limit=10.0, norm_eps=1e-20,
             rope_theta=10000.0, compress_rope_theta=160000.0, original_seq_len=65536, rope_factor=16.0,
             beta_fast=32, beta_slow=1, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, engram_layer_ids=[],
             engram_num_embeddings=[], engram_max_ngram_size=4, engram_vocab_size=101, engram_n_heads=8,
             engram_head_dim=256, engram_pad_id=2, engram_compressed_vocab_size=0, dspark_block_size=5,
             dspark_noise_token_id=shapes["vocab_size"] - 1, dspark_target_layer_ids=[], dspark_markov_rank=256,
             dspark_n_routed_experts=0, dspark_n_activated_experts=0, max_seq_len=65536)
    return V41Config.from_reference(d)


class SyntheticWeights:
    """What `loader.fill_weights` reads, made up: each name gets a random tensor of the shape and kind it asks
    for, scaled by 1/sqrt(fan-in) so activations keep their size. On the CPU the FP8/FP4 weights are in their
    stored form (e4m3 with UE8M0 tiles, e2m1 codes with UE8M0 scales); on a GPU directly in the device form."""

    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.gen = torch.Generator(device=device).manual_seed(seed)

    def has(self, name: str) -> bool:
        return False

    def _randn(self, *shape, dtype=torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, device=self.device, dtype=dtype)

    def tensor(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=dtype, device=self.device)
        if name.endswith(("_scale", "_base", "attn_sink", "gate.bias", "gate.bias_vl")):
            return (0.1 * self._randn(*shape)).to(dtype)
        fan_in = shape[-1] if len(shape) > 1 and not name.startswith("embed") else 1
        return (self._randn(*shape) * fan_in**-0.5).to(dtype)

    def dequant(self, prefix: str, out_f: int, in_f: int, dtype: torch.dtype) -> torch.Tensor:
        return (self._randn(out_f, in_f) * in_f**-0.5).to(dtype)

    def fp8(self, prefix: str, out_f: int, in_f: int) -> QuantWeight:
        if self.device.type != "cpu":
            return QuantWeight("fp8", None, None, self._randn(out_f, in_f, dtype=torch.bfloat16) * in_f**-0.5)
        codes = (self._randn(out_f, in_f) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        scale = torch.full((math.ceil(out_f / BLOCK), math.ceil(in_f / BLOCK)), 2.0 ** round(math.log2(
            in_f**-0.5 / 64)), device=self.device)
        return QuantWeight.fp8(codes, scale)

    def fp4(self, prefix: str, out_f: int, in_f: int) -> QuantWeight:
        if self.device.type != "cpu":
            return QuantWeight("fp4", None, None, self._randn(out_f, in_f, dtype=torch.bfloat16) * in_f**-0.5)
        packed = torch.randint(0, 256, (out_f, in_f // 2), generator=self.gen, dtype=torch.uint8)
        scale = torch.full((out_f, in_f // BLOCK), 2.0 ** round(math.log2(in_f**-0.5 / 3)))
        return QuantWeight.fp4(packed, scale)


def build(shapes: dict, device: torch.device) -> DeepseekV41ForCausalLM:
    model = DeepseekV41ForCausalLM(config(shapes))
    fill_weights(model, SyntheticWeights(device))
    model.to(device)  # the RoPE frequency buffers
    return model


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def nbytes(w) -> int:
    if isinstance(w, QuantWeight):
        t = w.dense if w.dense is not None else w.values
        return t.numel() * (2 if w.dense is not None else 1)  # bf16 dense; one byte a stored FP8 value
    return w.numel() * w.element_size()


def dense_bytes(model) -> tuple[int, int]:
    """(bytes every token reads: attention, shared experts, router, mHC, norms, head; bytes of one routed
    expert)."""
    total = nbytes(model.head) + nbytes(model.norm)
    expert = 0
    for blk in model.layers:
        a, m = blk.attn, blk.ffn
        for w in (a.wq_a, a.wq_b, a.wkv, a.wo_a, a.wo_b, a.c_wkv, a.c_wgate, a.i_wq_b, a.i_weights, a.i_wk,
                  m.gate_weight, m.shared.w1, m.shared.w2, m.shared.w3, blk.hc_attn[0], blk.hc_ffn[0]):
            total += nbytes(w) if w is not None else 0
        e = m.experts[0]
        expert = nbytes(e.w1) + nbytes(e.w2) + nbytes(e.w3)
    return total, expert


def state_bytes(model, states) -> int:
    total = 0
    for st in states:
        for ls in st.layers:
            total += ls.ring.numel() * 2
            if ls.rows is not None:
                total += ls.rows.numel() * 2
            if ls.index_keys is not None:
                total += ls.index_keys.numel() * 2
    return total


def experts_touched(model, ids, states) -> int:
    """Routed experts a decode step of `ids` reads, summed over layers (counted on a copy of the states)."""
    counts, routes = [], []
    for blk in model.layers:
        own = blk.ffn.route

        def route(x, min_rows=1, own=own):
            w, idx = own(x, min_rows)
            routes.append(idx)
            return w, idx

        blk.ffn.route = route
    try:
        copies = [clone_state(model, st) for st in states]
        model.forward_decode(ids, copies)
    finally:
        for blk in model.layers:
            del blk.ffn.route
    per_layer = len(routes) // len(model.layers)
    for j in range(len(model.layers)):
        counts.append(len(torch.unique(torch.cat(routes[j * per_layer : (j + 1) * per_layer]))))
    return sum(counts)


def clone_state(model, state):
    copy = model.make_state(state.layers[0].ring.device)
    copy.load(state.save())
    return copy


def decode(model, device, batch: int, context: int, steps: int) -> dict:
    g = torch.Generator().manual_seed(batch)
    prompt = torch.randint(3, model.cfg.vocab_size - 2, (context,), generator=g).tolist()
    base = model.make_state(device)
    model.forward(prompt, base)
    states = [clone_state(model, base) for _ in range(batch)]
    ids = torch.randint(3, model.cfg.vocab_size - 2, (batch,), generator=g)
    touched = experts_touched(model, ids, states)
    model.forward_decode(ids, states)  # warm-up
    sync(device)
    began = time.perf_counter()
    for _ in range(steps):
        model.forward_decode(ids, states)
    sync(device)
    ms = (time.perf_counter() - began) / steps * 1e3
    dense, expert = dense_bytes(model)
    read = dense + touched * expert + state_bytes(model, states) + batch * model.cfg.dim * 2
    return {"batch": batch, "context": context, "ms_per_step": round(ms, 3), "tok_per_s": round(batch / ms * 1e3, 1),
            "bytes_read_per_step": read, "experts_touched": touched,
            "mbu": round(read / (ms * 1e-3) / H200_BYTES_PER_S, 4)}


def nparams(w) -> int:
    if w is None:
        return 0
    if isinstance(w, QuantWeight):
        return (w.dense if w.dense is not None else w.values).numel()
    return w.numel()


def prefill_flops(model, n: int) -> float:
    """Model FLOPs of a prefill of n tokens from empty (last-position logits)."""
    c = model.cfg
    per_token = 0  # weights a token multiplies
    for blk in model.layers:
        a, m = blk.attn, blk.ffn
        e = m.experts[0]
        per_token += sum(nparams(w) for w in (a.wq_a, a.wq_b, a.wkv, a.wo_a, a.wo_b, a.c_wkv, a.c_wgate, a.i_wq_b,
                                              a.i_weights, m.gate_weight, m.shared.w1, m.shared.w2, m.shared.w3,
                                              blk.hc_attn[0], blk.hc_ffn[0]))
        per_token += m.top_k * (nparams(e.w1) + nparams(e.w2) + nparams(e.w3))
    flops = 2.0 * n * per_token + 2.0 * nparams(model.head)  # the head on the last row
    q = torch.arange(1, n + 1, dtype=torch.float64)
    window = q.clamp(max=c.window_size)
    for j, blk in enumerate(model.layers):
        keys = window.clone()
        r = c.compress_ratios[j]
        if r:
            keys += (q // r).clamp(max=c.index_topk)
        flops += 4.0 * c.n_heads * c.head_dim * float(keys.sum())  # QK^T and PV
        if j in c.index_source_layers:
            flops += 2.0 * c.index_n_heads * c.index_head_dim * float((q // r).sum())
    return flops


def prefill(model, device, n: int) -> dict:
    ids = torch.randint(3, model.cfg.vocab_size - 2, (n,), generator=torch.Generator().manual_seed(7)).tolist()
    model.forward(ids[:256], model.make_state(device))  # warm-up
    sync(device)
    began = time.perf_counter()
    model.forward(ids, model.make_state(device))
    sync(device)
    s = time.perf_counter() - began
    flops = prefill_flops(model, n)
    return {"tokens": n, "seconds": round(s, 3), "tok_per_s": round(n / s, 1), "model_flops": flops,
            "mfu": round(flops / s / H200_BF16_FLOPS, 4)}


def replay_saving(model, device, boundary: int) -> dict:
    """Time to rebuild the state at `boundary` (a prefix of that many tokens) by an exact replay (window x depth
    tokens), a bounded one (128) and a recompute of the whole prefix, each from the exact compressed rows."""
    ids = torch.randint(3, model.cfg.vocab_size - 2, (boundary,), generator=torch.Generator().manual_seed(9)).tolist()
    exact_state = model.make_state(device)
    model.forward(ids, exact_state)
    out = {"boundary": boundary}
    for name, length in (("bounded", BOUNDED_LENGTH), ("exact", exact_length(model.cfg)), ("recompute", boundary)):
        replay_state(model, ids, boundary, length, exact_state)  # warm-up
        sync(device)
        began = time.perf_counter()
        replay_state(model, ids, boundary, length, exact_state)
        sync(device)
        out[name] = {"tokens": length, "ms": round((time.perf_counter() - began) * 1e3, 2)}
    out["bounded_saves_vs_exact"] = round(1 - out["bounded"]["ms"] / out["exact"]["ms"], 3)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="CPU, small shapes: check the harness in < 60 s")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=None, help="tokens each decoding sequence holds")
    ap.add_argument("--prefill", type=int, default=None, help="prefill length (default 8192; quick 256)")
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        device, shapes = torch.device("cpu"), QUICK_SHAPES
        torch.set_num_threads(1)
        context, n_prefill, steps, batches = args.context or 160, args.prefill or 256, args.steps or 2, [1, 4]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench/v41_gpu.py needs a CUDA GPU (or --quick for the CPU harness check)")
        device, shapes = torch.device("cuda"), FLASH_SHAPES
        context, n_prefill, steps = args.context or 2048, args.prefill or 8192, args.steps or 5
        batches = [int(b) for b in args.batches.split(",")]
    began = time.perf_counter()
    with torch.inference_mode():
        model = build(shapes, device)
        dense, expert = dense_bytes(model)
        result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
                  "torch": torch.__version__, "quick": args.quick, "shapes": shapes, "layout": LAYOUT,
                  "dense_weight_bytes": dense, "routed_expert_bytes": expert,
                  "decode": [decode(model, device, b, context, steps) for b in batches],
                  "prefill": prefill(model, device, n_prefill),
                  "swa_replay": replay_saving(model, device, max(n_prefill // 2, exact_length(model.cfg)))}
    result["wall_s"] = round(time.perf_counter() - began, 1)
    print(json.dumps(result, indent=1))
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / (
        "v41_gpu_quick_cpu.json" if args.quick else "v41_gpu_h200.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
