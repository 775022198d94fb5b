"""The server's own host cost per streamed token, without a model: does it keep up with the engine?

    python bench/server_host.py [--concurrency 64,256] [--max-tokens 128] [--prompt-len 512] [--rounds 2]
    python bench/server_host.py --concurrency 256 --device-ms 5.75     # a device step as long as the H200's
    PYTHONPATH=/tmp/old python bench/server_host.py ...    # another tree's package
    python bench/server_host.py --baseline /tmp/old --repeats 3 ...   # both, alternately (before/after)
    python bench/server_host.py --baseline /tmp/old --stream-interval 1,4 ...   # this tree at each interval too
    python bench/server_host.py --route chat ...    # streamed /v1/chat/completions (deepseek-recipe) instead
    python bench/server_host.py --engine-process 0,1 ...   # the server with the engine in-process, then in its own

The server side is the real app (`deepserve.server.create_app`, run on uvloop as `deepserve serve` runs it) over
an `EngineCore` whose executor returns every step's samples at once (bench/engine_host.py's `InstantExecutor`:
random ids above the byte tokenizer's 256, detokenized by the embedded model's tokenizer). It runs in a child
process; this process is the client: `concurrency` asyncio clients stream `/v1/completions` (token-id prompts,
greedy, `ignore_eos`, `max_tokens` each, `rounds` requests one after another per client) and count the tokens of
the final usage chunk. In the same run, the same engine alone: `concurrency` requests added at once and stepped to
the end with final outputs only (as `LLM.generate` drives it) and with a snapshot per step (as the server's
engine thread makes them). Prints and writes (`--out`) tokens/s of each and the server's share of the engine's,
by wall time and by CPU time (the server process's user + system seconds; the engine's process time): on a
machine shared with other work the CPU-time share is the steadier of the two.

With a zero-cost executor every step is host work, so the share is the server's Python (SSE chunks, JSON, the
hops from the engine thread to each stream) against the engine's own. On a GPU the engine's step overlaps the
device's and the server's work competes with it for the GIL: `--device-ms 5.75` makes every step also wait that
long without the GIL (the H200 decode graph's step at 256), so the share says whether the server keeps up with
that device (a projection: this CPU is not the GPU host's). `--stream-interval` is the server's (`deepserve serve
--stream-interval`): tokens per streamed chunk; with `--baseline` the old tree runs at 1 (it may not have the
option) and this one at each interval listed. `--route chat` streams `/v1/chat/completions` instead: a user
message of about `prompt-len` tokens of text, `max_tokens` each (the instant executor never samples EOS, so every
request makes them all), through deepseek-recipe's stream processor. `--engine-process 0,1` measures the server
twice per repeat: with the engine on a thread of the server's process (0), and in a process of its own behind the
front (1: `deepserve.distributed.engine_process`, as `deepserve serve --engine-process` runs it; the same instant
engine, built in the child by `make_rank_engine`). The server's CPU seconds are then its process's alone; the
engine process's are recorded apart (`server_engine_process_engine_cpu_s`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # after PYTHONPATH: `PYTHONPATH=/tmp/old` measures that tree's package

MODEL = ROOT / "deepserve" / "assets" / "deepserve-tiny-v4"
PAGE = 128


def make_engine(max_num_seqs: int, max_model_len: int, device_ms: float = 0.0):
    """An `EngineCore` over the instant executor, the tokenizer and the model config of the embedded model;
    `device_ms`: each step also waits that long, without the GIL, as a runner waits for its device."""
    from deepserve.core.config import ModelConfig
    from deepserve.core.engine import EngineCore
    from deepserve.core.kv.manager import KVCacheManager
    from deepserve.core.scheduler.cost_model import CostModelConfig, StepCostModel
    from deepserve.core.scheduler.scheduler import Scheduler
    from deepserve.model.tokenizer import IncrementalDetokenizer, Tokenizer

    sys.path.insert(0, str(ROOT / "bench"))
    from engine_host import InstantExecutor

    cfg = ModelConfig.from_dict(json.loads((MODEL / "config.json").read_text()))
    tokenizer = Tokenizer(MODEL, cfg)
    kv = KVCacheManager(max_num_seqs * -(-max_model_len // PAGE) + 8, PAGE, True)
    scheduler = Scheduler(kv, StepCostModel(CostModelConfig()), max_num_seqs, 8192, max_model_len, cfg.eos_token_ids)
    class DeviceExecutor(InstantExecutor):
        def execute(self, step):
            out = super().execute(step)
            if step.chunks:
                time.sleep(device_ms / 1e3)
            return out

    executor = (DeviceExecutor if device_ms else InstantExecutor)(cfg.vocab_size, max_num_seqs)
    engine = EngineCore(scheduler, executor, page_size=PAGE,
                        make_detokenizer=lambda ids, skip: IncrementalDetokenizer(tokenizer, ids, skip))
    return engine, cfg, tokenizer


def make_rank_engine(max_num_seqs: int, max_model_len: int, device_ms: float = 0.0):
    """`make_engine`'s engine as the engine process builds it (`deepserve.distributed.rank.RankEngine`), in the
    child."""
    from deepserve.distributed.rank import RankEngine

    engine, _, _ = make_engine(max_num_seqs, max_model_len, device_ms)
    return RankEngine(engine, max_model_len, max_num_seqs)


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256, vocab) for _ in range(length)] for _ in range(n)]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def engine_alone(concurrency: int, args, views: bool) -> tuple[float, float]:
    """(tokens/s, tokens per CPU second) of the engine stepped to the end over `rounds` batches of `concurrency`
    requests; `views`: a snapshot of every request each step (as the server's engine thread), else final outputs
    only."""
    from deepserve.core.sampling_params import SamplingParams

    engine, cfg, _ = make_engine(concurrency, args.prompt_len + args.max_tokens + PAGE, args.device_ms)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    began, cpu, tokens = time.perf_counter(), time.process_time(), 0
    for r in range(args.rounds):
        for i, ids in enumerate(prompts(concurrency, args.prompt_len, cfg.vocab_size, r)):
            engine.add_request(f"{r}-{i}", ids, params, final_only=not views, views=views)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens += len(out.outputs[0].token_ids)
    seconds, cpu = time.perf_counter() - began, time.process_time() - cpu
    engine.shutdown()
    if tokens != concurrency * args.rounds * args.max_tokens:
        raise RuntimeError(f"the engine made {tokens} tokens, not {concurrency * args.rounds * args.max_tokens}")
    return tokens / seconds, tokens / cpu


def serve(port: int, concurrency: int, max_model_len: int, device_ms: float, switch_interval: float,
          stream_interval: int = 1, engine_process: bool = False) -> None:
    """The child: the real app on uvloop over the instant engine (`engine_process`: in a process of its own behind
    the front), until SIGTERM."""
    import functools

    import uvloop

    if switch_interval:
        sys.setswitchinterval(switch_interval)  # how soon a thread waiting for the GIL gets it (default 5 ms)
    from aiohttp import web

    from deepserve.core.async_engine import AsyncEngine
    from deepserve.server import ServerConfig, create_app

    def factory() -> AsyncEngine:
        if engine_process:
            from deepserve.distributed.engine_process import start_engine_process
            from deepserve.model.tokenizer import Tokenizer
            from deepserve.core.config import ModelConfig

            cfg = ModelConfig.from_dict(json.loads((MODEL / "config.json").read_text()))
            tokenizer = Tokenizer(MODEL, cfg)
            engine = start_engine_process(functools.partial(make_rank_engine, concurrency, max_model_len, device_ms),
                                          vocab_size=cfg.vocab_size)
        else:
            engine, cfg, tokenizer = make_engine(concurrency, max_model_len, device_ms)
        wrapped = AsyncEngine(engine)
        # what the server reads of an `LLM` (deepserve.server.state.ModelInfo.from_engine)
        wrapped.llm = SimpleNamespace(model=SimpleNamespace(cfg=cfg), tokenizer=tokenizer, max_model_len=max_model_len)
        return wrapped

    extra = {"stream_interval": stream_interval} if stream_interval != 1 else {}  # (a tree without the option)
    config = ServerConfig(model=str(MODEL), max_waiting_requests=4 * concurrency, **extra)
    web.run_app(create_app(config, engine_factory=factory), host="127.0.0.1", port=port,
                loop=uvloop.new_event_loop(), handler_cancellation=True, shutdown_timeout=1.0, access_log=None,
                print=None)


async def _client(session, ids_list: list[list[int]], args, counts: list[int]) -> None:
    for ids in ids_list:
        if args.route == "chat":  # a third of the ids as words of text: a prompt of about as many tokens
            text = " ".join(map(str, ids[: len(ids) // 3]))
            body = {"model": MODEL.name, "messages": [{"role": "user", "content": text}],
                    "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}
        else:
            body = {"model": MODEL.name, "prompt": ids, "max_tokens": args.max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        path = "/v1/chat/completions" if args.route == "chat" else "/v1/completions"
        counts.append((await stream_request(session, path, body))[0])


async def stream_request(session, path: str, body: dict) -> tuple[int, float]:
    """POST a streamed request (`body` asks for `stream_options.include_usage`) and read it to the end; returns
    the completion tokens of its final usage chunk and the seconds until its first chunk arrived."""
    began = time.perf_counter()
    first = None
    async with session.post(path, json=body) as r:
        if r.status != 200:
            raise SystemExit(f"the server answered {r.status}: {await r.text()}")
        tail = b""
        async for data in r.content.iter_any():  # only the end is parsed: the usage chunk before [DONE]
            if first is None:
                first = time.perf_counter() - began
            tail = (tail + data)[-4096:]
    usage_line = tail.rsplit(b"data: [DONE]", 1)[0].strip().rsplit(b"data: ", 1)[-1]
    return json.loads(usage_line)["usage"]["completion_tokens"], first


async def through_server(concurrency: int, args, engine_process: bool = False) -> tuple[float, float, float]:
    """(tokens/s, tokens per CPU second of the server process, CPU seconds of its engine process (0 without one))
    of `concurrency` streaming clients, `rounds` requests each, through a fresh server."""
    import aiohttp

    sys.path.insert(0, str(ROOT / "bench"))
    from server_event_loop import free_port, wait_healthy

    port = free_port()
    max_model_len = args.prompt_len + args.max_tokens + PAGE
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--concurrency", str(concurrency),
                             "--max-model-len", str(max_model_len), "--device-ms", str(args.device_ms),
                             "--switch-interval", str(args.switch_interval),
                             "--stream-interval", str(args.stream_interval)]
                            + (["--engine-process", "1"] if engine_process else []),
                            env=os.environ.copy())
    try:
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}", connector=connector, timeout=timeout) as session:
            await wait_healthy(session, proc)
            vocab = json.loads((MODEL / "config.json").read_text())["vocab_size"]
            per_client = [[] for _ in range(concurrency)]
            for r in range(args.rounds):  # the same prompts as the engine alone gets
                for i, ids in enumerate(prompts(concurrency, args.prompt_len, vocab, r)):
                    per_client[i].append(ids)
            counts: list[int] = []
            children = engine_children(proc.pid) if engine_process else []
            began, cpu = time.perf_counter(), cpu_seconds(proc.pid)
            child_cpu = sum(map(cpu_seconds, children))
            await asyncio.gather(*(_client(session, ids, args, counts) for ids in per_client))
            seconds, cpu = time.perf_counter() - began, cpu_seconds(proc.pid) - cpu
            child_cpu = sum(map(cpu_seconds, children)) - child_cpu
    finally:
        proc.terminate()
        proc.wait(30)
    if sum(counts) != concurrency * args.rounds * args.max_tokens:
        raise RuntimeError(f"the server streamed {sum(counts)} tokens, not {concurrency * args.rounds * args.max_tokens}")
    return sum(counts) / seconds, sum(counts) / cpu, child_cpu


def engine_children(pid: int) -> list[int]:
    """The engine process among `pid`'s children (spawn also starts a resource tracker, which is not counted)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():  # (a child belongs to the thread that started it)
        for child in (task / "children").read_text().split():
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(int(child))
    if not found:
        raise RuntimeError(f"the server {pid} has no engine process")
    return found


def compare(args) -> None:
    import tempfile

    intervals = [int(i) for i in str(args.stream_interval).split(",")]
    trees = {"baseline": (str(args.baseline.resolve()), 1)}
    for interval in intervals:
        trees["current" if interval == 1 else f"current_stream_interval_{interval}"] = ("", interval)
    res = {"python": sys.version.split()[0], "cpus": os.cpu_count(), "baseline": trees["baseline"][0],
           "stream_intervals": intervals, "route": args.route,
           "max_tokens": args.max_tokens, "prompt_len": args.prompt_len, "rounds": args.rounds, "repeats": args.repeats,
           "device_ms": args.device_ms_of, "switch_interval": args.switch_interval or sys.getswitchinterval(),
           "tokens_per_s": {}}
    for c in args.concurrency.split(","):
        runs: dict[str, list[dict]] = {name: [] for name in trees}
        for _ in range(args.repeats):
            for name, (tree, interval) in trees.items():
                with tempfile.NamedTemporaryFile(suffix=".json") as f:
                    env = {**os.environ, "PYTHONPATH": tree} if tree else \
                        {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
                    subprocess.run([sys.executable, __file__, "--concurrency", c, "--max-tokens", str(args.max_tokens),
                                    "--prompt-len", str(args.prompt_len), "--rounds", str(args.rounds),
                                    "--repeats", "1", "--device-ms", str(args.device_ms_of[c]),
                                    "--switch-interval", str(args.switch_interval),
                                    "--stream-interval", str(interval), "--route", args.route, "--out", f.name],
                                   env=env, check=True, stdout=subprocess.DEVNULL)
                    runs[name].append(json.loads(Path(f.name).read_text())["tokens_per_s"][c])
        row = {name: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for name, rs in runs.items()}
        res["tokens_per_s"][c] = row
        print(f"concurrency {int(c):4d}: " + "\n    ".join(
            f"{name}: engine {r['engine_final_only']:7.0f} tok/s, server {r['server']:7.0f} = "
            f"{100 * r['server_share_of_engine']:5.1f}% ({100 * r['server_share_of_engine_cpu']:5.1f}% per CPU s)"
            for name, r in row.items()), flush=True)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="64,256")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2, help="requests per client, one after another")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each measurement; the median is reported")
    ap.add_argument("--device-ms", default="0",
                    help="a device step's milliseconds, slept by the executor's thread (0: none, pure host work); a "
                         "list pairs with --concurrency (64,256 with 3.86,5.75: the H200's steps at those batches)")
    ap.add_argument("--switch-interval", type=float, default=0.0,
                    help="the server process's sys.setswitchinterval seconds (0: Python's default, 5 ms)")
    ap.add_argument("--route", choices=["completions", "chat"], default="completions",
                    help="the streamed route the clients call")
    ap.add_argument("--stream-interval", default="1",
                    help="the server's tokens per streamed chunk; with --baseline a list, e.g. 1,4")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="a tree holding the old package: each concurrency is measured `repeats` times with it and "
                         "with this one, alternately, in child processes (medians of each)")
    ap.add_argument("--engine-process", default="0",
                    help="0: the engine on the server's thread; 1: in its own process behind the front; 0,1: both, "
                         "alternately in each repeat")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)  # the child: serve on this port
    ap.add_argument("--max-model-len", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    device_ms = [float(d) for d in args.device_ms.split(",")]
    if len(device_ms) not in (1, len(args.concurrency.split(","))):
        ap.error("--device-ms takes one value, or one per --concurrency")
    args.device_ms_of = dict(zip(args.concurrency.split(","), device_ms * len(args.concurrency.split(","))
                                 if len(device_ms) == 1 else device_ms))
    args.device_ms = device_ms[0]
    if args.serve is not None:
        serve(args.serve, int(args.concurrency), args.max_model_len, args.device_ms, args.switch_interval,
              int(args.stream_interval), args.engine_process == "1")
        return
    if args.baseline is not None:
        compare(args)
        return
    import deepserve

    res = {"python": sys.version.split()[0], "package": str(Path(deepserve.__file__).parent), "cpus": os.cpu_count(),
           "max_tokens": args.max_tokens, "prompt_len": args.prompt_len, "rounds": args.rounds,
           "device_ms": args.device_ms_of, "switch_interval": args.switch_interval or sys.getswitchinterval(),
           "stream_interval": int(args.stream_interval), "route": args.route, "repeats": args.repeats,
           "engine_process": args.engine_process, "load_before": os.getloadavg(), "tokens_per_s": {}}
    servers = {"0": "server", "1": "server_engine_process"}
    modes = [servers[mode] for mode in args.engine_process.split(",")]
    for c in map(int, args.concurrency.split(",")):
        args.device_ms = args.device_ms_of[str(c)]
        runs = {"engine_final_only": [], "engine_streamed": [], **{name: [] for name in modes}}
        for _ in range(args.repeats):  # interleaved, so that a burst of load elsewhere hits them all alike
            runs["engine_final_only"].append(engine_alone(c, args, views=False))
            runs["engine_streamed"].append(engine_alone(c, args, views=True))
            for name in modes:
                runs[name].append(asyncio.run(through_server(c, args, name == "server_engine_process")))
        row = {}
        for name, values in runs.items():
            row[name] = statistics.median(v[0] for v in values)
            row[f"{name}_per_cpu_s"] = statistics.median(v[1] for v in values)
            row[f"{name}_runs"] = [v[0] for v in values]
        for name in modes:
            share = "server_share_of_engine" + name.removeprefix("server")
            row[share] = row[name] / row["engine_final_only"]
            row[f"{share}_cpu"] = row[f"{name}_per_cpu_s"] / row["engine_final_only_per_cpu_s"]
        if "server_engine_process" in modes:
            row["server_engine_process_engine_cpu_s"] = statistics.median(
                v[2] for v in runs["server_engine_process"])
        res["tokens_per_s"][str(c)] = row
        print(f"concurrency {c:4d}, device step {args.device_ms} ms: engine alone "
              f"{row['engine_final_only']:7.0f} tok/s "
              f"({row['engine_final_only_per_cpu_s']:7.0f} per CPU s) with final outputs, "
              f"{row['engine_streamed']:7.0f} ({row['engine_streamed_per_cpu_s']:7.0f}) streamed", flush=True)
        for name in modes:
            share = "server_share_of_engine" + name.removeprefix("server")
            print(f"    {name}: {row[name]:7.0f} tok/s ({row[f'{name}_per_cpu_s']:7.0f} per server CPU s) = "
                  f"{100 * row[share]:5.1f}% of the engine ({100 * row[f'{share}_cpu']:5.1f}% per CPU second)",
                  flush=True)
    res["load_after"] = os.getloadavg()
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
