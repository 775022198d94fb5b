"""Serving on one GPU as users run it, end to end (issue 23 item 5): the engine and the server against the kernels,
start-up, speculation and batch invariance, through the public API and `deepserve serve`, in named parts that each
fit one device command of at most 10 minutes.

    python3 bench/e2e.py --part startup      # first, on a fresh machine: the cold start
    python3 bench/e2e.py --part offline      # then each of these in its own command
    python3 bench/e2e.py --part server
    python3 bench/e2e.py --part speculative [--spec-args "--dtype float32"]
    python3 bench/e2e.py --part invariance
    python3 bench/e2e.py --table --records DIR [DIR ...]     # the records as one table in docs/benchmarks.md
    python3 bench/e2e.py --quick --part all --out DIR        # every part on the CPU at tiny shapes (the harness)

The checkpoint: bench/gpu.py's V4-Flash layer shapes (6 layers, 32 routed experts, vocabulary 129,280), random
bf16, written once by bench/startup.py's `write_checkpoint` (into `--checkpoint` when given, where later parts on
the same machine find it). Prompts are random token ids (the checkpoint has no tokenizer), greedy, `ignore_eos`,
and every call gets prompts of its own, so no prefix-cache hit helps a later call. The engine runs as the issue
measured it: `LLM(model=DIR, dtype="bfloat16", max_num_seqs=256, max_model_len=16384)`, the server with the same.

- `offline`: the decode step of `LLM.generate` at batch 1, 64 and 256 = (time of a 128-token generate - time of a
  1-token generate) / 127 on prompts of 512 tokens, from the second call of each shape (the first is recorded too),
  against bench/gpu.py's CUDA-graph step (`graph_decode`: the model over a paged cache, no engine) in the same
  process, and transformers' `DeepseekV4ForCausalLM.generate` at batch 1 by the same definition.
- `server`: `deepserve serve` in a child process (the engine in-process, then with `--engine-process` at the
  concurrencies past one); at concurrency 1, 64 and 256, asyncio clients stream
  `/v1/completions` (token-id prompts of 512, 128 tokens each, two requests one after another per client) after a
  first burst of the same size; tokens/s and the median time to first token, against `LLM.generate` of the same
  prompts (two calls of `concurrency` prompts) in this process after the server has stopped.
- `startup`: `deepserve serve` on a fresh `DEEPSERVE_CACHE_DIR` (cold; the page cache dropped first where this
  process may, never with --quick), again on the same directory (restart), on it with `--skip-warm-up` (what the
  first requests pay without the start-up warm-up of `deepserve.model.warm_up`), and on another fresh directory
  with `--skip-warm-up` (the cold start as it was before the warm-up): seconds from the process's start to
  `/health` answering 200, and of them the decode graphs' capture and the warm-up (from the server's log), the
  first request (32 tokens: time to first token and to its end), then a burst of 64 requests and a second one
  (median time to first token).
- `speculative`: bench/spec_graphs.py's `run` (a drafter of controlled acceptance, fixed-k and DSpark's planner
  against no speculation at batch 1, 16, 64), options through `--spec-args`.
- `invariance`: bench/batch_invariance_gpu.py's `run_mode` on this checkpoint, default and `batch_invariant=True`.

Each part writes `e2e_<part>.json` into `--out` ($OUT when set) as it goes, and `e2e_table.md`: the table of the
records in `--out`. `--table` merges the records of `--records` (later folders win) and writes the table into
docs/benchmarks.md between its markers; records made with `--quick` never go there (only into --out).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import batch_invariance_gpu  # noqa: E402
import gpu  # noqa: E402
import server_host  # noqa: E402
import spec_graphs  # noqa: E402
import startup  # noqa: E402
from server_event_loop import free_port, wait_healthy  # noqa: E402

PARTS = ("startup", "offline", "server", "speculative", "invariance")
DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- bench/e2e.py table: begin -->", "<!-- bench/e2e.py table: end -->"


@dataclass(frozen=True, slots=True)
class Plan:
    """What the parts run: the issue's shapes on a GPU, tiny ones on the CPU with `--quick` (a check of the
    harness, not a measurement)."""

    quick: bool
    batches: tuple[int, ...]  # offline decode batches and the server's concurrencies
    prompt_len: int
    output_len: int
    graph_steps: int  # bench/gpu.py's timed graph steps
    rounds: int  # server: requests per client, one after another
    burst: int  # startup: requests in a burst
    first_tokens: int  # startup: tokens of the first request
    max_num_seqs: int
    max_model_len: int
    experts: int
    invariance_tokens: int

    @classmethod
    def make(cls, quick: bool) -> Plan:
        if quick:
            return cls(quick=True, batches=(1, 4), prompt_len=32, output_len=8, graph_steps=3, rounds=1, burst=4,
                       first_tokens=4, max_num_seqs=8, max_model_len=512, experts=8, invariance_tokens=8)
        return cls(quick=False, batches=(1, 64, 256), prompt_len=512, output_len=128, graph_steps=20, rounds=2,
                   burst=64, first_tokens=32, max_num_seqs=256, max_model_len=16384, experts=32, invariance_tokens=24)

    @property
    def device(self) -> str:
        return "cpu" if self.quick else "cuda:0"

    @property
    def dtype(self) -> str:
        return "float32" if self.quick else "bfloat16"

    def sync(self) -> None:
        if not self.quick:
            torch.cuda.synchronize()

    def llm_options(self) -> dict:
        return {"dtype": self.dtype, "accelerator": "cpu" if self.quick else "nvidia",
                "max_num_seqs": self.max_num_seqs, "max_model_len": self.max_model_len}

    def serve_flags(self) -> list[str]:
        o = self.llm_options()
        return ["--dtype", o["dtype"], "--accelerator", o["accelerator"], "--max-num-seqs", str(o["max_num_seqs"]),
                "--max-model-len", str(o["max_model_len"]), "--max-waiting-requests", str(4 * max(self.batches)),
                "--log-level", "warning"]


class Record(dict):
    """A part's JSON record, rewritten on every `save()` so that a command cut short keeps what it finished."""

    def __init__(self, path: Path, **fields) -> None:
        super().__init__(fields)
        self.path = path

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self, indent=1, default=str) + "\n")


def run_facts(plan: Plan) -> dict:
    def git(*a: str) -> str | None:  # (None where the tree is a copy without .git, as on the device machine)
        try:
            done = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True)
        except OSError:
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    return {"quick": plan.quick, "device": "cpu" if plan.quick else torch.cuda.get_device_name(0),
            "torch": torch.__version__, "commit": git("rev-parse", "--short", "HEAD"),
            "uncommitted_changes": bool(git("status", "--porcelain", "--untracked-files=no")),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpus": os.cpu_count(),
            "plan": asdict(plan)}


def ensure_checkpoint(path: Path, plan: Plan) -> Path:
    """The checkpoint at `path`, written there first unless a config.json is there already."""
    if not (path / "config.json").is_file():
        began = time.perf_counter()
        startup.write_checkpoint(path, plan.experts, plan.quick)
        print(f"checkpoint written to {path} in {time.perf_counter() - began:.1f} s", flush=True)
    return path


def vocab_of(ckpt: Path) -> int:
    return json.loads((ckpt / "config.json").read_text())["vocab_size"]


def prompts(n: int, plan: Plan, vocab: int, seed: int) -> list[list[int]]:
    return server_host.prompts(n, plan.prompt_len, vocab, seed)


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- offline ----------------------------------------------------------------------------------------------------------
def decode_step(generate, make_prompts, tokens: int, plan: Plan) -> dict:
    """The issue's decode step of `generate(max_tokens, prompts)`: a 1-token and a `tokens`-token call, each shape
    twice, every call on new prompts (`make_prompts(seed)`, made before the clock starts); (second `tokens` call -
    second 1-token call) / (tokens - 1), and the same of the first calls."""
    seconds, seed = {}, 0
    for n in (1, tokens):
        for label in ("first", "second"):
            batch = make_prompts(seed)
            seed += 1
            plan.sync()
            began = time.perf_counter()
            generate(n, batch)
            plan.sync()
            seconds[f"{label}_{n}"] = time.perf_counter() - began
    per_step = {label: 1e3 * (seconds[f"{label}_{tokens}"] - seconds[f"{label}_1"]) / (tokens - 1)
                for label in ("first", "second")}
    return {"step_ms": per_step["second"], "first_call_step_ms": per_step["first"], "seconds": seconds}


@torch.no_grad()
def transformers_step(ckpt: Path, plan: Plan, vocab: int) -> dict:
    """transformers' `generate` at batch 1 (one prompt: its batched generation left-pads, wrong for V4's
    compressed layers when lengths differ)."""
    began = time.perf_counter()
    hf = gpu.load_hf(ckpt, plan.device, getattr(torch, plan.dtype))
    loaded = time.perf_counter() - began

    def generate(n: int, ids: torch.Tensor) -> None:
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0)
        if out.shape[1] != ids.shape[1] + n:
            raise RuntimeError(f"transformers made {out.shape[1] - ids.shape[1]} tokens, not {n}")

    def make_prompts(seed: int) -> torch.Tensor:
        return torch.tensor(prompts(1, plan, vocab, 900 + seed), device=plan.device)

    row = dict(decode_step(generate, make_prompts, plan.output_len, plan), batch=1, load_seconds=loaded)
    del hf
    free_device_memory()
    return row


def graph_steps(ckpt: Path, plan: Plan) -> dict:
    """bench/gpu.py's CUDA-graph decode step at each batch, on a model with the checkpoint's shapes and seed."""
    if plan.quick:
        from deepserve.backends.reference import ReferenceBackend
        backend = ReferenceBackend("cpu")
    else:
        from deepserve.backends.nvidia import NvidiaBackend
        backend = NvidiaBackend(plan.device)
    shapes = json.loads((ckpt / "config.json").read_text())
    model = gpu.build(shapes, backend, getattr(torch, plan.dtype))
    rows = {}
    for b in plan.batches:
        g = torch.Generator().manual_seed(b)
        ps = [torch.randint(2, shapes["vocab_size"], (plan.prompt_len,), generator=g).tolist() for _ in range(b)]
        toks = torch.randint(2, shapes["vocab_size"], (plan.graph_steps + 3, b), generator=g).tolist()
        row = gpu.graph_decode(model, plan.device, ps, toks, plan.prompt_len, plan.graph_steps)
        row.pop("graph_top", None)
        rows[str(b)] = row
        print(f"graph step, batch {b}: {row['ms_per_step']:.3f} ms", flush=True)
    del model
    free_device_memory()
    return rows


def part_offline(ckpt: Path, plan: Plan, rec: Record) -> None:
    from deepserve import LLM, SamplingParams

    vocab = vocab_of(ckpt)
    rec["graph_step"] = graph_steps(ckpt, plan)
    rec.save()
    began = time.perf_counter()
    llm = LLM(str(ckpt), **plan.llm_options())
    rec["llm_init_seconds"] = time.perf_counter() - began
    rec["generate"] = {}

    def generate(n: int, batch: list[dict]) -> None:
        outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        if any(len(o.outputs[0].token_ids) != n for o in outs):
            raise RuntimeError(f"LLM.generate made other than {n} tokens a prompt")

    for b in plan.batches:
        def make_prompts(seed: int, b=b) -> list[dict]:
            return [{"prompt_token_ids": p} for p in prompts(b, plan, vocab, 1000 * b + seed)]

        rec["generate"][str(b)] = dict(decode_step(generate, make_prompts, plan.output_len, plan), batch=b)
        print(f"LLM.generate, batch {b}: {rec['generate'][str(b)]['step_ms']:.3f} ms a step", flush=True)
        rec.save()
    llm.engine.shutdown()
    del llm
    free_device_memory()
    try:  # last, and a failure kept in the record: the baseline is a third party's API
        rec["transformers"] = transformers_step(ckpt, plan, vocab)
        print(f"transformers generate, batch 1: {rec['transformers']['step_ms']:.2f} ms a step", flush=True)
    except Exception as e:  # noqa: BLE001
        rec["transformers"] = {"error": f"{type(e).__name__}: {e}"[:500]}
        print(f"transformers failed: {rec['transformers']['error']}", flush=True)
    rec.save()


# -- the server -------------------------------------------------------------------------------------------------------
class Server:
    """`deepserve serve CKPT` in a child process on a free port (its output in `log`), as an async context manager
    that waits for `/health` and stops it on the way out; `ready_seconds`: from its start to the first 200."""

    def __init__(self, ckpt: Path, plan: Plan, log: Path, cache_dir: Path | None = None,
                 flags: tuple[str, ...] = ()) -> None:
        self.ckpt, self.plan, self.log, self.cache_dir, self.flags = ckpt, plan, log, cache_dir, flags
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.session = None
        self.ready_seconds = None

    async def __aenter__(self) -> Server:
        import aiohttp

        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)])))
        if self.cache_dir is not None:
            env["DEEPSERVE_CACHE_DIR"] = str(self.cache_dir)
            env.pop("TRITON_CACHE_DIR", None)  # (this process's backend may have set it)
        began = time.perf_counter()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "deepserve", "serve", str(self.ckpt), "--port",
                                          str(self.port), "--served-model-name", "e2e", *self.plan.serve_flags(),
                                          *self.flags],
                                         stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        self.session = aiohttp.ClientSession(f"http://127.0.0.1:{self.port}", timeout=aiohttp.ClientTimeout(total=None),
                                             connector=aiohttp.TCPConnector(limit=0))
        try:
            await wait_healthy(self.session, self.proc)
        except BaseException:
            await self.__aexit__(None, None, None)
            print(self.log.read_text()[-3000:], flush=True)
            raise
        self.ready_seconds = time.perf_counter() - began
        return self

    async def __aexit__(self, *exc) -> None:
        await self.session.close()
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def burst(server: Server, per_client: list[list[list[int]]], max_tokens: int) -> dict:
    """Every client streams its prompts one after another, all clients at once; tokens/s over the burst's wall
    time and the time to first token of its requests."""

    async def client(ids_list: list[list[int]]) -> list[tuple[int, float]]:
        done = []
        for ids in ids_list:
            body = {"model": "e2e", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            done.append(await server_host.stream_request(server.session, "/v1/completions", body))
        return done

    began = time.perf_counter()
    results = [r for c in await asyncio.gather(*(client(c) for c in per_client)) for r in c]
    seconds = time.perf_counter() - began
    tokens, ttft = sum(t for t, _ in results), sorted(f for _, f in results)
    if tokens != len(results) * max_tokens:
        raise RuntimeError(f"the server streamed {tokens} tokens, not {len(results) * max_tokens}")
    return {"requests": len(results), "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
            "ttft_median_s": statistics.median(ttft), "ttft_max_s": ttft[-1]}


def by_client(rounds: list[list[list[int]]]) -> list[list[list[int]]]:
    """Round-major prompt lists -> each client's prompts, one per round."""
    return [list(p) for p in zip(*rounds)]


async def part_server(ckpt: Path, plan: Plan, rec: Record, work: Path) -> None:
    from deepserve import LLM, SamplingParams

    vocab = vocab_of(ckpt)

    def rounds_of(c: int) -> tuple[list[list[int]], list[list[list[int]]]]:  # the first burst's, the timed ones'
        return prompts(c, plan, vocab, 10_000 * c), [prompts(c, plan, vocab, 10_000 * c + 1 + r)
                                                     for r in range(plan.rounds)]

    # the engine on a thread of the server's process (the default), then in a process of its own behind the
    # front (`--engine-process`, as vLLM's AsyncLLM runs it: the server's Python no longer shares the engine's
    # GIL), at the concurrencies past one
    variants = (("server", (), plan.batches),
                ("server_engine_process", ("--engine-process",), tuple(c for c in plan.batches if c > 1)))
    for key, flags, batches in variants:
        rec[key] = {}
        async with Server(ckpt, plan, work / f"{key}.log", flags=flags) as server:
            rec[f"{key}_ready_seconds"] = server.ready_seconds
            for c in batches:
                first, timed = rounds_of(c)
                row = {"first": await burst(server, by_client([first]), plan.output_len),
                       "timed": await burst(server, by_client(timed), plan.output_len)}
                rec[key][str(c)] = row
                print(f"{key}, concurrency {c}: {row['timed']['tok_s']:.0f} tok/s, median TTFT "
                      f"{row['timed']['ttft_median_s']:.3f} s", flush=True)
                rec.save()
        free_device_memory()
    llm = LLM(str(ckpt), **plan.llm_options())
    params = SamplingParams(temperature=0, max_tokens=plan.output_len, ignore_eos=True)
    rec["generate"] = {}
    for c in plan.batches:
        first, timed = rounds_of(c)
        llm.generate([{"prompt_token_ids": p} for p in first], params, use_tqdm=False)
        tokens, seconds = 0, 0.0
        for batch in timed:
            plan.sync()
            began = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
            plan.sync()
            seconds += time.perf_counter() - began
            tokens += sum(len(o.outputs[0].token_ids) for o in outs)
        rec["generate"][str(c)] = {"requests": c * plan.rounds, "tokens": tokens, "seconds": seconds,
                                   "tok_s": tokens / seconds}
        print(f"LLM.generate, {c} prompts: {tokens / seconds:.0f} tok/s", flush=True)
        rec.save()
    llm.engine.shutdown()
    del llm
    free_device_memory()


# -- start-up ---------------------------------------------------------------------------------------------------------
def caches_present() -> dict:
    """Which compile caches existed before this run (a fresh machine has none of them)."""
    from deepserve.core.env import cache_dir

    home = Path.home()
    return {str(p): p.exists() for p in (cache_dir(), home / ".triton" / "cache", home / ".nv" / "ComputeCache")}


def drop_page_cache() -> bool:
    """Ask the kernel to drop its clean page cache (root only), so the cold start reads the checkpoint from disk."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def start_up_phases(log: Path) -> dict:
    """Seconds of the server's start-up phases, from its log (at level info): the decode graphs' capture
    (`DecodeGraphs.warm_up`) and the step warm-up (`deepserve.model.warm_up`); None where the log has no line."""
    import re

    text = log.read_text(errors="replace")
    found = {name: re.findall(pattern, text) for name, pattern in
             (("capture_seconds", r"\d+ decode buckets made in ([\d.]+) s"),
              ("warm_up_seconds", r"warm-up: \d+ steps .* in ([\d.]+) s"))}
    return {name: float(hits[-1]) if hits else None for name, hits in found.items()}


#: the start-up runs: label, DEEPSERVE_CACHE_DIR (under the work folder), `deepserve serve` flags
STARTUP_RUNS = (("cold", "deepserve_cache", ()), ("restart", "deepserve_cache", ()),
                ("restart_no_warm_up", "deepserve_cache", ("--skip-warm-up",)),
                ("cold_no_warm_up", "deepserve_cache_no_warm_up", ("--skip-warm-up",)))


async def part_startup(ckpt: Path, plan: Plan, rec: Record, work: Path) -> None:
    vocab = vocab_of(ckpt)
    rec["caches_before"] = caches_present()
    rec["runs"] = {}
    for i, (label, cache, flags) in enumerate(STARTUP_RUNS):
        # (never on the shared CPU box of a --quick run: the page cache is the whole machine's)
        row = {"page_cache_dropped": drop_page_cache() if label.startswith("cold") and not plan.quick else False}
        log = work / f"startup_{label}.log"
        async with Server(ckpt, plan, log, cache_dir=work / cache, flags=("--log-level", "info", *flags)) as server:
            row["ready_seconds"] = server.ready_seconds
            one = [prompts(1, plan, vocab, 20_000 + 10 * i)]
            row["first_request"] = await burst(server, by_client(one), plan.first_tokens)
            for name, k in (("first_burst", 1), ("second_burst", 2)):
                row[name] = await burst(server, by_client([prompts(plan.burst, plan, vocab, 20_000 + 10 * i + k)]),
                                        plan.first_tokens)
        row.update(start_up_phases(log))
        rec["runs"][label] = row
        print(f"{label}: ready {row['ready_seconds']:.1f} s (capture {row['capture_seconds']} s, warm-up "
              f"{row['warm_up_seconds']} s); first request TTFT "
              f"{row['first_request']['ttft_median_s']:.2f} s; burst of {plan.burst}: median TTFT "
              f"{row['first_burst']['ttft_median_s']:.2f} s, then {row['second_burst']['ttft_median_s']:.2f} s",
              flush=True)
        rec.save()


# -- speculation and invariance: the scripts that measure them --------------------------------------------------------
def part_speculative(plan: Plan, rec: Record, work: Path, extra: str) -> None:
    argv = (["--quick", "--p", "0.7"] if plan.quick else []) + ["--out", str(work / "spec")] + shlex.split(extra)
    rec["spec_graphs_args"] = argv
    rec["spec_graphs"] = spec_graphs.run(spec_graphs.parse_args(argv))
    free_device_memory()


def part_invariance(ckpt: Path, plan: Plan, rec: Record) -> None:
    rec["modes"] = []
    for invariant in (False, True):
        rec["modes"].append(batch_invariance_gpu.run_mode(ckpt, invariant, plan.invariance_tokens, plan.quick))
        print(json.dumps(rec["modes"][-1]), flush=True)
        rec.save()
        free_device_memory()


# -- the table --------------------------------------------------------------------------------------------------------
def load_records(folders: list[Path]) -> dict[str, dict]:
    records = {}
    for folder in folders:
        for part in PARTS:
            path = folder / f"e2e_{part}.json"
            if path.is_file():
                records[part] = json.loads(path.read_text())
    return records


def _ms(x: float) -> str:
    return f"{x:.2f} ms" if abs(x) >= 0.1 else f"{1e3 * x:.1f} us"


def _s(x: float) -> str:
    return f"{x:.2f} s" if x < 10 else f"{x:.1f} s"


def table(records: dict[str, dict]) -> str:
    """Markdown of the records present, part by part, each headed by where and when it ran."""
    out = []
    for part, r in records.items():
        where = (f"`--part {part}`: {r['device']}, torch {r['torch']}, commit {r['commit'] or 'unknown'}"
                 f"{' + uncommitted changes' if r['uncommitted_changes'] else ''}, {r['date']}"
                 f"{' (--quick: tiny shapes on the CPU, not a measurement)' if r['quick'] else ''}")
        out += [f"**{part}** ({where})", ""]
        out += TABLES[part](r)
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def _table_offline(r: dict) -> list[str]:
    n = r["plan"]["output_len"]
    lines = [f"| decode step ((t({n} tokens) - t(1)) / {n - 1}) | `LLM.generate`, second call | first call | "
             f"bench/gpu.py graph step | share (graph step / `LLM.generate`) |", "| --- | --- | --- | --- | --- |"]
    for b, g in r.get("generate", {}).items():
        graph = r.get("graph_step", {}).get(b, {}).get("ms_per_step")
        share = f"{graph / g['step_ms']:.0%}" if graph else "-"
        lines.append(f"| batch {b} | {_ms(g['step_ms'])} | {_ms(g['first_call_step_ms'])} | "
                     f"{_ms(graph) if graph else '-'} | {share} |")
    hf = r.get("transformers")
    if hf and "error" in hf:
        lines += ["", f"transformers' `DeepseekV4ForCausalLM.generate` failed: {hf['error']}"]
    elif hf:
        ours = r.get("generate", {}).get("1", {}).get("step_ms")
        vs = f", {hf['step_ms'] / ours:.1f}x `LLM.generate`'s" if ours else ""
        lines += ["", f"transformers' `DeepseekV4ForCausalLM.generate` in the same run, batch 1: {_ms(hf['step_ms'])} "
                      f"a step (first call {_ms(hf['first_call_step_ms'])}){vs}."]
    return lines


def _table_server(r: dict) -> list[str]:
    lines = ["| server | concurrency | server tok/s | `LLM.generate` tok/s, same prompts | share | server median "
             "TTFT: first burst / timed |", "| --- | --- | --- | --- | --- | --- |"]
    for key, label in (("server", "engine in-process"), ("server_engine_process", "`--engine-process`")):
        for c, s in r.get(key, {}).items():
            served, g = s["timed"]["tok_s"], r.get("generate", {}).get(c)
            offline, share = (f"{g['tok_s']:,.0f}", f"{served / g['tok_s']:.0%}") if g else ("-", "-")
            lines.append(f"| {label} | {c} | {served:,.0f} | {offline} | {share} | "
                         f"{_s(s['first']['ttft_median_s'])} / {_s(s['timed']['ttft_median_s'])} |")
    return lines


def _table_startup(r: dict) -> list[str]:
    p = r["plan"]
    lines = [f"| start | `/health` ready | of it: graph capture / warm-up | first request ({p['first_tokens']} "
             f"tokens): TTFT / total | burst of {p['burst']}: median TTFT | next burst: median TTFT |",
             "| --- | --- | --- | --- | --- | --- |"]
    for label, row in r.get("runs", {}).items():
        note = ", page cache dropped" if row["page_cache_dropped"] else ""
        first = row["first_request"]
        phases = " / ".join(_s(row[k]) if row.get(k) is not None else "-"
                            for k in ("capture_seconds", "warm_up_seconds"))
        lines.append(f"| {label}{note} | {_s(row['ready_seconds'])} | {phases} | {_s(first['ttft_median_s'])} / "
                     f"{_s(first['seconds'])} | {_s(row['first_burst']['ttft_median_s'])} | "
                     f"{_s(row['second_burst']['ttft_median_s'])} |")
    return lines


def _table_speculative(r: dict) -> list[str]:
    s = r.get("spec_graphs")
    if not s:
        return ["(no record)"]
    return [f"k = {s['k']}, {s['dtype']}, prompts of {s['input_len']}, {s['output_len']} tokens, "
            f"{len(s['layers'])} layers, {s['experts']} experts:", "", spec_graphs.table(s)]


def _table_invariance(r: dict) -> list[str]:
    lines = ["| mode | decode step, batch 1 / 4 | request A's bits as alone: beside 3 / beside 63 / alone again | "
             "max abs logprob difference |", "| --- | --- | --- | --- |"]
    for m in r.get("modes", []):
        same = m["same_as_alone"]
        bits = " / ".join("equal" if same[k]["tokens"] and same[k]["logprob_bits"] else
                          ("tokens equal" if same[k]["tokens"] else "differ")
                          for k in ("with 3", "with 63", "alone again"))
        steps = " / ".join(_ms(m["decode_step_ms"][b]) for b in ("1", "4"))
        worst = max(v["max_abs_dlogprob"] for v in same.values())
        lines.append(f"| {'`batch_invariant=True`' if m['batch_invariant'] else 'default'} | {steps} | {bits} | "
                     f"{worst:.3g} |")
    return lines


TABLES = {"startup": _table_startup, "offline": _table_offline, "server": _table_server,
          "speculative": _table_speculative, "invariance": _table_invariance}


def write_doc(doc: Path, text: str) -> None:
    """Replace what stands between the markers in `doc` with `text`."""
    body = doc.read_text()
    if BEGIN not in body or END not in body:
        raise SystemExit(f"{doc} lacks the markers {BEGIN} ... {END}")
    head, rest = body.split(BEGIN, 1)
    doc.write_text(head + BEGIN + "\n" + text + rest[rest.index(END):])


# -- main -------------------------------------------------------------------------------------------------------------
def run_part(part: str, args: argparse.Namespace, plan: Plan, ckpt_dir: Path, work: Path) -> None:
    rec = Record(args.out / f"e2e_{part}.json", part=part, **run_facts(plan))
    began = time.perf_counter()
    print(f"== {part}", flush=True)
    if part == "speculative":
        part_speculative(plan, rec, work, args.spec_args)
    else:
        ckpt = ensure_checkpoint(ckpt_dir, plan)
        free_device_memory()  # (the model that wrote it): the server's KV budget is sized from free memory
        if part == "offline":
            part_offline(ckpt, plan, rec)
        elif part == "server":
            asyncio.run(part_server(ckpt, plan, rec, work))
        elif part == "startup":
            asyncio.run(part_startup(ckpt, plan, rec, work))
        else:
            part_invariance(ckpt, plan, rec)
    rec["seconds"] = time.perf_counter() - began
    rec.save()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", default=None, help=f"comma-separated, of {', '.join(PARTS)}; or all")
    ap.add_argument("--quick", action="store_true", help="tiny shapes on the CPU: a check of the harness")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "e2e_out"))
    ap.add_argument("--checkpoint", type=Path, default=None,
                    help="where the checkpoint is, or is written if absent (default: a temporary directory)")
    ap.add_argument("--spec-args", default="", help="options for bench/spec_graphs.py in the speculative part")
    ap.add_argument("--table", action="store_true",
                    help="merge the records of --records into docs/benchmarks.md (--quick records: into --out only)")
    ap.add_argument("--records", type=Path, nargs="+", default=None, help="folders of e2e_*.json (default: --out)")
    ap.add_argument("--doc", type=Path, default=DOC)
    args = ap.parse_args(argv)
    parts = [] if args.part is None else list(PARTS) if args.part == "all" else args.part.split(",")
    if unknown := set(parts) - set(PARTS):
        ap.error(f"unknown parts {sorted(unknown)}: choose from {', '.join(PARTS)} or all")
    if not parts and not args.table:
        ap.error("nothing to do: give --part or --table")
    if parts and not args.quick and not torch.cuda.is_available():
        ap.error("no GPU here: --quick runs the parts on the CPU at tiny shapes")
    plan = Plan.make(args.quick)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="deepserve_e2e_") as tmp:
        work = Path(tmp)
        for part in parts:
            run_part(part, args, plan, args.checkpoint or work / "ckpt", work)
            free_device_memory()
    if parts:
        text = table(load_records([args.out]))
        (args.out / "e2e_table.md").write_text(text)
        print(text)
    if args.table:
        records = load_records(args.records or [args.out])
        text = table(records)
        if any(r["quick"] for r in records.values()):
            (args.out / "e2e_table.md").write_text(text)
            print(f"--quick records: the table went to {args.out / 'e2e_table.md'}, not {args.doc}")
        else:
            write_doc(args.doc, text)
            print(f"wrote the table of {', '.join(records)} into {args.doc}")
        print(text)


if __name__ == "__main__":
    main()
