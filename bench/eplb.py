"""EPLB on expert-load traces at V4-Flash's shape (256 routed experts x 43 MoE layers, top-6): the imbalance
(slowest GPU over mean, per MoE layer, per step) at EP 2, 4, 8, 16 and 64 with DeepInfer's settings, for no EPLB,
a static placement and EPLB (deepserve.core.balance.ExpertLoadBalancer, replayed step by step).

Sources of expert loads (each layer its own):
- skewed: a stationary Zipf law, load of the expert of rank r proportional to r^-0.6, ranks shuffled per layer;
- drifting: log-normal loads (sigma 1.0, about the same skew) whose logs follow an Ornstein-Uhlenbeck process
  with a correlation time of 5 reassignment intervals (5,000 prefill steps, 50,000 decode steps: about the same
  wall-clock time, a prefill step being ~10x longer than a decode step);
- recorded: the routing of a random V4-Flash-shaped model (deepserve's reference backend on CPU: 43 layers,
  3 hash + 40 routed, 256 experts, top-6, hidden 64) over this repository's docs as prompts, its per-layer expert
  frequencies taken as the load.
A step's counts are Poisson draws of tokens_per_rank x EP x 6 expert assignments per layer spread by those loads
(prefill 8,192 tokens per rank per step, decode 256: ~64 sequences with MTP drafts).

Policies: none = experts e*E/G.. on GPU g, no replicas; static = EPLB's placement from the first window (a profile
run), never changed; eplb = the same start, then ExpertLoadBalancer's reassignments (prefill: 4 redundant experts
per GPU, 100-step window, every 1,000 steps; decode: 1, 1,000, 10,000); eplb_gated = the same with
min_rebalancing_utilization_threshold 0.98 (a layer is re-placed only when its window's imbalance passes ~1.02). Steps after the first window are
measured (every 5th prefill step of 10,000, every 20th decode step of 40,000). V4 has no expert groups, so the
node count does not change the placement.

    .venv/bin/python bench/eplb.py                # ~10 min on 2 cores; writes the JSON and the plot
    .venv/bin/python bench/eplb.py --quick        # short traces, a smoke run
    .venv/bin/python bench/eplb.py --plot-only    # redraw docs/eplb_imbalance.png from the JSON
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deepserve.core.balance import EplbConfig, ExpertLoadBalancer, Placement  # noqa: E402

NUM_LAYERS, NUM_EXPERTS, TOP_K = 43, 256, 6
EP_SIZES = (2, 4, 8, 16, 64)
ZIPF_EXPONENT, DRIFT_SIGMA = 0.6, 1.0
GATED_UTILIZATION = 0.98  # eplb_gated re-places a layer only below this utilization (imbalance above ~1.02)
# DeepSeek's reported imbalance (production traffic, DeepInfer): EP2/DP2 and EP4/DP4 prefill, decode (EP64-128)
DEEPSEEK = {"prefill": {2: 1.045, 4: 1.074}, "decode": {"EP64-128": 1.090}}


@dataclass(frozen=True)
class Phase:
    name: str
    config: EplbConfig
    tokens_per_rank: int
    steps: int
    stride: int  # measure every stride-th step
    drift_tau: int


def phases(quick: bool) -> list[Phase]:
    if quick:
        return [Phase("prefill", EplbConfig(20, 200, 4), 8192, 1000, 2, 600),
                Phase("decode", EplbConfig(100, 1000, 1), 256, 3000, 5, 3000)]
    return [Phase("prefill", EplbConfig.prefill(), 8192, 10_000, 5, 5_000),
            Phase("decode", EplbConfig.decode(), 256, 40_000, 20, 50_000)]


class Stationary:
    """The same expert probabilities [layers, experts] at every step."""

    def __init__(self, probs: np.ndarray):
        self.probs = probs / probs.sum(-1, keepdims=True)

    def at(self, steps: np.ndarray) -> np.ndarray:
        return np.broadcast_to(self.probs, (len(steps), *self.probs.shape))


def zipf_source(seed: int) -> Stationary:
    rng = np.random.default_rng(seed)
    ranks = np.stack([rng.permutation(NUM_EXPERTS) + 1 for _ in range(NUM_LAYERS)])
    return Stationary(ranks.astype(float) ** -ZIPF_EXPONENT)


class Drifting:
    """Log-loads follow an OU process (stationary std DRIFT_SIGMA, correlation time tau steps), sampled exactly on
    a grid of tau/300 steps and held between grid points."""

    def __init__(self, steps: int, tau: int, seed: int):
        rng = np.random.default_rng(seed)
        self.grid = max(1, tau // 300)
        rho = math.exp(-self.grid / tau)
        x = rng.normal(0, DRIFT_SIGMA, (NUM_LAYERS, NUM_EXPERTS))
        path = []
        for _ in range(steps // self.grid + 2):
            path.append(x)
            x = rho * x + math.sqrt(1 - rho * rho) * DRIFT_SIGMA * rng.normal(size=x.shape)
        w = np.exp(np.stack(path))
        self.path = w / w.sum(-1, keepdims=True)

    def at(self, steps: np.ndarray) -> np.ndarray:
        return self.path[steps // self.grid]


def record_routing(max_tokens: int, seed: int) -> tuple[Stationary, dict]:
    """Expert frequencies per layer of a random V4-Flash-shaped model run over the repo's docs (prefill)."""
    import tokenizers
    import torch

    from deepserve import LLM, SamplingParams
    from deepserve.backends.reference import ReferenceBackend
    from deepserve.core.config import ModelConfig
    from deepserve.model.factory import build_model, randomize
    from deepserve.model.moe import Router
    from deepserve.model.tokenizer import make_byte_tokenizer
    from deepserve.model.writer import save_checkpoint
    from deepserve.tools.demo_checkpoint import DEMO_CONFIG, chat_special_tokens

    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    corpus = "\n\n".join(f.read_text() for f in files)
    layer_types = (["sliding_attention"] * 2
                   + ["compressed_sparse_attention", "heavily_compressed_attention"] * 20
                   + ["compressed_sparse_attention"])
    with tempfile.TemporaryDirectory() as tmp:
        specials = chat_special_tokens()
        tok_file = make_byte_tokenizer(Path(tmp) / "tok", specials, train_text=corpus, num_merges=2000)
        vocab = tokenizers.Tokenizer.from_file(str(tok_file)).get_vocab_size()
        cfg = ModelConfig.from_dict({**DEMO_CONFIG, "vocab_size": vocab, "num_hidden_layers": NUM_LAYERS,
                                     "layer_types": layer_types, "n_routed_experts": NUM_EXPERTS,
                                     "num_experts_per_tok": TOP_K, "moe_intermediate_size": 16,
                                     "num_hash_layers": 3, "num_nextn_predict_layers": 0})
        model = randomize(build_model(cfg, ReferenceBackend("cpu"), torch.float32), seed)
        num_params = sum(p.numel() for p in model.parameters())
        path = save_checkpoint(model, Path(tmp) / "model")
        make_byte_tokenizer(path, specials, train_text=corpus, num_merges=2000)
        del model
        # one forward per prompt (no cost-model chunking), torch's kernels (routing is what is recorded)
        llm = LLM(str(path), accelerator="cpu", dtype="float32", block_size=128, max_num_batched_tokens=4096,
                  step_time_target=1e9, batch_invariant=False)
        counts = np.zeros((NUM_LAYERS, NUM_EXPERTS), dtype=np.int64)
        for name, module in llm.model.named_modules():
            if isinstance(module, Router) and name.startswith("model.layers."):
                layer = int(name.split(".")[2])

                def hook(_m, _inp, out, layer=layer):
                    counts[layer] += np.bincount(out[0].reshape(-1).numpy(), minlength=NUM_EXPERTS)
                module.register_forward_hook(hook)
        ids = llm.tokenizer.encode(corpus)[:max_tokens]
        prompts = [ids[i:i + 1024] for i in range(0, len(ids), 1024)]
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        seconds = time.perf_counter() - t0
    tokens = int(counts[0].sum()) // TOP_K
    meta = {"model": f"random V4-Flash-shaped: {NUM_LAYERS} layers (2 SW, 21 CSA, 20 HCA; 3 hash + 40 routed "
                     f"MoE), {NUM_EXPERTS} experts top-{TOP_K}, hidden 64, expert width 16, vocab {vocab} "
                     f"(byte BPE on the corpus), seed {seed}",
            "parameters": num_params, "prompts": len(prompts), "tokens_recorded": tokens,
            "corpus": [str(f.relative_to(ROOT)) for f in files], "seconds": round(seconds, 1),
            "max_over_mean_expert_load": round(float((counts.max(1) / counts.mean(1)).mean()), 3)}
    return Stationary(counts.astype(float) + 1e-9), meta


class Evaluator:
    """Per-step, per-layer imbalance of counts [T, L, E] under a placement (numpy; the same rule as
    `Placement.imbalance`, which a check below compares it with)."""

    def __init__(self, placement: Placement):
        self.idx = np.array(placement.phy2log)
        self.share = 1.0 / np.take_along_axis(np.array(placement.logcnt), self.idx, 1)
        self.gpus = placement.num_gpus

    def __call__(self, counts: np.ndarray) -> np.ndarray:
        slots = np.take_along_axis(counts, self.idx[None], 2) * self.share
        gpu = slots.reshape(*slots.shape[:2], self.gpus, -1).sum(-1)
        mean = gpu.mean(-1)
        return np.where(mean > 0, gpu.max(-1) / np.where(mean > 0, mean, 1), 1.0)


def simulate(phase: Phase, source, ep: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    cfg, w = phase.config, phase.config.window_size
    assignments = phase.tokens_per_rank * ep * TOP_K

    def draw(first: int, n: int) -> np.ndarray:  # steps first .. first + n - 1
        return rng.poisson(assignments * source.at(np.arange(first, first + n))).astype(float)

    profile = draw(1, w).sum(0)
    static = Placement.from_loads(profile.tolist(), ep, cfg.redundant_experts_per_gpu * ep)
    gated_cfg = dataclasses.replace(cfg, min_rebalancing_utilization_threshold=GATED_UTILIZATION)
    balancers = {"eplb": ExpertLoadBalancer(cfg, NUM_LAYERS, NUM_EXPERTS, ep, initial=static),
                 "eplb_gated": ExpertLoadBalancer(gated_cfg, NUM_LAYERS, NUM_EXPERTS, ep, initial=static)}
    for b in balancers.values():
        b.observe(None, w)  # the profile steps precede the first window (2 * window <= interval)
    balancer = balancers["eplb"]
    fixed = {"none": Evaluator(Placement.contiguous(NUM_LAYERS, NUM_EXPERTS, ep)), "static": Evaluator(static)}
    current = {name: (static, fixed["static"]) for name in balancers}  # each balancer's placement, evaluator
    sums = {k: 0.0 for k in ("none", "static", *balancers)}
    expected = {k: 0.0 for k in sums}
    moved = {name: 0 for name in balancers}
    timeline, measured = [], 0
    interval_sum, interval_n = 0.0, 0
    while balancer.step < phase.steps:
        n = min(balancer.max_steps_per_observe, phase.steps - balancer.step, 500)
        first = balancer.step + 1
        if balancer.needs_counts:
            counts = draw(first, n)
            window_part = counts.sum(0).tolist()
            picked = np.arange(n)[(np.arange(first, first + n) % phase.stride) == 0]
            sample, sample_steps = counts[picked], np.arange(first, first + n)[picked]
        else:
            window_part = None
            sample_steps = np.arange(first, first + n)
            sample_steps = sample_steps[sample_steps % phase.stride == 0]
            sample = draw_at(rng, assignments, source, sample_steps)
        if len(sample_steps):
            evaluators = dict(fixed)
            for name, b in balancers.items():
                if b.placement is not current[name][0]:
                    current[name] = (b.placement, Evaluator(b.placement))
                evaluators[name] = current[name][1]
            probs = source.at(sample_steps)
            for name, e in evaluators.items():
                per_step = e(sample)
                sums[name] += float(per_step.sum())
                expected[name] += float(e(probs).sum())
                if name == "eplb":
                    interval_sum += float(per_step.mean(1).sum())
            interval_n += len(sample_steps)
            measured += len(sample_steps)
        for b in balancers.values():
            b.observe(window_part, n)
        if balancer.step % cfg.step_interval == 0 and interval_n:
            for name, b in balancers.items():
                moved[name] += b.last_rebalance.num_moved_slots
            report = balancer.last_rebalance
            timeline.append({"step": balancer.step, "eplb_mean_imbalance_since_last": round(interval_sum / interval_n, 4),
                             "window_imbalance_before": round(float(np.mean(report.imbalance_before)), 4),
                             "window_imbalance_after": round(float(np.mean(report.imbalance_after)), 4),
                             "moved_slots": report.num_moved_slots,
                             "gated_moved_slots": balancers["eplb_gated"].last_rebalance.num_moved_slots})
            interval_sum, interval_n = 0.0, 0
    denom = measured * NUM_LAYERS
    return {"mean_imbalance": {k: round(v / denom, 4) for k, v in sums.items()},
            "noise_free_imbalance": {k: round(v / denom, 4) for k, v in expected.items()},
            "measured_steps": measured, "num_rebalances": balancer.num_rebalances, "moved_slots": moved,
            "timeline": timeline}


def draw_at(rng, assignments: int, source, steps: np.ndarray) -> np.ndarray:
    return rng.poisson(assignments * source.at(steps)).astype(float)


def check_evaluator() -> None:
    """The numpy evaluator agrees with Placement.imbalance (the metric the rank loop reports)."""
    rng = np.random.default_rng(0)
    counts = rng.poisson(50, (3, NUM_LAYERS, NUM_EXPERTS)).astype(float)
    placement = Placement.from_loads(counts[0].tolist(), 8, 32)
    ours = Evaluator(placement)(counts)
    for t in range(3):
        assert np.allclose(ours[t], placement.imbalance(counts[t].tolist()))


def plot(results: list[dict], path: Path) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sources = sorted({r["source"] for r in results}, key=["skewed", "drifting", "recorded"].index)
    fig, axes = plt.subplots(2, len(sources), figsize=(4.2 * len(sources), 7), sharey=True, squeeze=False)
    for row, phase in enumerate(("prefill", "decode")):
        for col, source in enumerate(sources):
            ax = axes[row][col]
            rows = sorted((r for r in results if r["phase"] == phase and r["source"] == source), key=lambda r: r["ep"])
            eps = [r["ep"] for r in rows]
            for policy, style in (("none", "o-"), ("static", "s--"), ("eplb", "^-"), ("eplb_gated", "x:")):
                if all(policy in r["mean_imbalance"] for r in rows):
                    ax.plot(eps, [r["mean_imbalance"][policy] for r in rows], style, label=policy)
            for ep, value in DEEPSEEK["prefill"].items() if phase == "prefill" else ():
                ax.plot([ep], [value], "k*", markersize=11, label="DeepSeek (production)" if ep == 2 else None)
            if phase == "decode":
                ax.axhline(DEEPSEEK["decode"]["EP64-128"], color="k", linestyle=":", label="DeepSeek decode 1.090")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_yticks([1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 4.0], ["1.0", "1.1", "1.25", "1.5", "2", "3", "4"])
            ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_xticks(eps, [str(e) for e in eps])
            ax.set_title(f"{phase}, {source}")
            ax.set_xlabel("EP size")
            ax.grid(True, which="both", alpha=0.3)
            if col == 0:
                ax.set_ylabel("imbalance (slowest GPU / mean)")
            ax.legend(fontsize=7)
    fig.suptitle("EPLB imbalance at V4-Flash's 256 experts x 43 layers (bench/eplb.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short traces and windows (a smoke run)")
    parser.add_argument("--sources", default="skewed,drifting,recorded")
    parser.add_argument("--recorded-tokens", type=int, default=32_768, help="tokens of routing to record")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "bench/results/eplb.json"))
    parser.add_argument("--plot", default=str(ROOT / "docs/eplb_imbalance.png"))
    parser.add_argument("--plot-only", action="store_true", help="redraw the plot from the JSON at --out")
    args = parser.parse_args(argv)
    if args.plot_only:
        plot(json.loads(Path(args.out).read_text())["results"], Path(args.plot))
        return
    check_evaluator()
    wanted = args.sources.split(",")
    meta = {"command": "python bench/eplb.py" + (" --quick" if args.quick else ""),
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                     text=True).stdout.strip(),
            "machine": f"{platform.machine()}, {platform.python_implementation()} {platform.python_version()}",
            "layers": NUM_LAYERS, "experts": NUM_EXPERTS, "top_k": TOP_K, "zipf_exponent": ZIPF_EXPONENT,
            "drift": f"log-normal loads, sigma {DRIFT_SIGMA}, OU log-loads with correlation time drift_tau steps",
            "load_model": "Poisson counts of tokens_per_rank * EP * top_k assignments per layer and step",
            "imbalance": "per MoE layer and step: the most loaded GPU's tokens over the mean GPU's, averaged over "
                         "layers and measured steps (noise_free: the same under the expected loads)",
            "deepseek_reported": {"prefill_EP2": 1.045, "prefill_EP4": 1.074, "decode": 1.090,
                                  "note": "DeepSeek's figures come from production traffic, not these traces"}}
    recorded = None
    if "recorded" in wanted:
        t0 = time.perf_counter()
        recorded, meta["recorded"] = record_routing(args.recorded_tokens // (10 if args.quick else 1), args.seed)
        print(f"recorded routing: {meta['recorded']['tokens_recorded']} tokens in {time.perf_counter() - t0:.0f} s",
              flush=True)
    results = []
    for phase in phases(args.quick):
        meta.setdefault("phases", {})[phase.name] = {
            "window_size": phase.config.window_size, "step_interval": phase.config.step_interval,
            "redundant_experts_per_gpu": phase.config.redundant_experts_per_gpu,
            "tokens_per_rank": phase.tokens_per_rank, "steps": phase.steps, "measure_every": phase.stride,
            "drift_tau": phase.drift_tau}
        for source_name in wanted:
            for ep in EP_SIZES:
                t0 = time.perf_counter()
                seed = args.seed * 1000 + ep
                source = {"skewed": lambda: zipf_source(args.seed + 1),
                          "drifting": lambda: Drifting(phase.steps, phase.drift_tau, args.seed + 2),
                          "recorded": lambda: recorded}[source_name]()
                out = simulate(phase, source, ep, seed)
                slots = NUM_LAYERS * (NUM_EXPERTS + phase.config.redundant_experts_per_gpu * ep)
                results.append({"phase": phase.name, "source": source_name, "ep": ep, "physical_slots": slots,
                                **out})
                print(f"{phase.name:7} {source_name:8} EP{ep:<3} " + "  ".join(
                    f"{k} {v:.3f}" for k, v in out["mean_imbalance"].items())
                    + f"  ({out['num_rebalances']} reassignments, {time.perf_counter() - t0:.0f} s)", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    plot(results, Path(args.plot))
    print(f"wrote {args.out} and {args.plot}")


if __name__ == "__main__":
    main()
