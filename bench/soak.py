"""Soak benchmark: an hour-shaped hostile workload, compressed, against a real `deepserve serve` process.

Mixed traffic for `--seconds`: streamed and unstreamed chat and completions of mixed lengths, clients that
disconnect mid-stream, explicit aborts (a client timeout), oversized and malformed bodies, pathological grammars
(outlines regexes whose automaton explodes) beside trivial ones, while a probe measures how long `/health`
takes to answer (the event loop's lag as a client sees it). Reports the count of 5xx answers, the lag's
percentiles, the server's RSS over time, and, after the load stops, the KV pages and running requests left
(both must be zero) as `/metrics` gives them. Writes a JSON report and, with matplotlib, a plot of RSS and lag.

    .venv/bin/python bench/soak.py --seconds 120 --out bench/results   # the embedded model on the CPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from server_event_loop import free_port, wait_healthy  # bench/, beside this script

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PATHOLOGICAL = "([a-z]{1,30}[0-9]{1,30}){1500}"
MODEL = "soak"  # the name the server is started with


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def metric(text: str, name: str) -> float | None:
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    return float(match.group(1)) if match else None


class Soak:
    def __init__(self, base: str, server: subprocess.Popen, seconds: float, concurrency: int, seed: int) -> None:
        self.base, self.server, self.seconds, self.concurrency = base, server, seconds, concurrency
        self.rng = random.Random(seed)
        self.statuses: dict[str, int] = {}
        self.lags: list[float] = []
        self.kinds: dict[str, int] = {}

    def count(self, kind: str, status: int | str) -> None:
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        key = str(status)
        self.statuses[key] = self.statuses.get(key, 0) + 1

    async def one(self, session: aiohttp.ClientSession) -> None:
        r = self.rng.random()
        tokens = self.rng.choice([4, 16, 64, 200])
        chat = {"model": MODEL, "messages": [{"role": "user", "content": f"Write a function number {self.rng.randint(0, 99)}."}],
                "max_tokens": tokens, "stream": self.rng.random() < 0.7}
        if r < 0.45:
            await self.request(session, "chat", CHAT, chat)
        elif r < 0.60:
            await self.request(session, "completion", COMPLETIONS,
                               {"model": MODEL, "prompt": "def f(x):", "max_tokens": tokens, "stream": True})
        elif r < 0.72:
            await self.request(session, "disconnect", CHAT, {**chat, "stream": True, "max_tokens": 200},
                               read_chunks=self.rng.randint(1, 5))
        elif r < 0.78:
            await self.request(session, "abort", CHAT, {**chat, "max_tokens": 200}, timeout=0.3)
        elif r < 0.84:
            big = {"model": MODEL, "messages": [{"role": "user", "content": "a " * self.rng.choice([10**5, 10**6])}]}
            await self.request(session, "oversized", CHAT, big)
        elif r < 0.90:
            await self.raw(session, "malformed", self.rng.choice(
                [b"{", b'{"messages": 5}', b"\xff\xfe", b'{"model": MODEL, "messages": [], "max_tokens": -1}']))
        elif r < 0.94:
            await self.request(session, "pathological", CHAT, {**chat, "stream": False, "max_tokens": 8,
                               "structured_outputs": {"regex": PATHOLOGICAL, "backend": "outlines"}})
        else:
            await self.request(session, "grammar", CHAT, {**chat, "stream": False, "max_tokens": 8,
                               "structured_outputs": {"regex": "[0-9]{5}"}})

    async def request(self, session, kind, path, body, read_chunks=None, timeout=None) -> None:
        try:
            client_timeout = aiohttp.ClientTimeout(total=timeout) if timeout else aiohttp.ClientTimeout(total=300)
            async with session.post(self.base + path, json=body, timeout=client_timeout) as resp:
                if read_chunks is not None:
                    for _ in range(read_chunks):
                        if not await resp.content.readline():
                            break
                    self.count(kind, resp.status)
                    return  # leaving the block closes the connection mid-stream
                await resp.read()
                self.count(kind, resp.status)
        except asyncio.TimeoutError:
            self.count(kind, "client-timeout")
        except aiohttp.ClientError as exc:
            self.count(kind, f"client-error:{type(exc).__name__}")

    async def raw(self, session, kind, data: bytes) -> None:
        async with session.post(self.base + CHAT, data=data, headers={"Content-Type": "application/json"}) as resp:
            await resp.read()
            self.count(kind, resp.status)

    async def worker(self, session, until: float) -> None:
        while time.monotonic() < until:
            await self.one(session)

    async def probe(self, session, until: float) -> None:
        while time.monotonic() < until:
            began = time.perf_counter()
            async with session.get(self.base + "/health") as resp:
                await resp.read()
            self.lags.append(time.perf_counter() - began)
            await asyncio.sleep(0.2)

    async def run(self) -> dict:
        async with aiohttp.ClientSession(self.base) as probe:
            await wait_healthy(probe, self.server)
        pid, rss = self.server.pid, []
        start = time.monotonic()
        until = start + self.seconds

        async def sample_rss():
            while time.monotonic() < until:
                rss.append((time.monotonic() - start, rss_bytes(pid)))
                await asyncio.sleep(1.0)

        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            await asyncio.gather(sample_rss(), self.probe(session, until),
                                 *(self.worker(session, until) for _ in range(self.concurrency)))
            await asyncio.sleep(3.0)  # let aborted requests drain
            async with session.get(self.base + "/metrics") as resp:
                metrics = await resp.text()
        lags = sorted(self.lags)

        def pct(p):
            return lags[min(len(lags) - 1, int(p * len(lags)))] if lags else None

        return {
            "seconds": self.seconds, "concurrency": self.concurrency, "requests": self.kinds,
            "statuses": self.statuses,
            "num_5xx": sum(n for s, n in self.statuses.items() if s.isdigit() and int(s) >= 500),
            "health_latency_s": {"p50": pct(0.5), "p99": pct(0.99), "max": lags[-1] if lags else None},
            "rss_mib": [(round(t, 1), round(b / 2**20, 1)) for t, b in rss],
            "after": {"kv_pages_used": metric(metrics, "deepserve_kv_cache_pages_used"),
                      "requests_running": metric(metrics, "deepserve_num_requests_running"),
                      "requests_open": metric(metrics, "deepserve_num_requests_open")},
        }


def plot(report: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    t, mib = zip(*report["rss_mib"]) if report["rss_mib"] else ((), ())
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(t, mib)
    ax.set_xlabel("seconds")
    ax.set_ylabel("server RSS (MiB)")
    ax.set_title(f"soak: {sum(report['requests'].values())} requests, {report['num_5xx']} 5xx, "
                 f"/health p99 {report['health_latency_s']['p99']:.3f} s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--serve-args", default="--grammar-compile-timeout 3 --max-num-seqs 16",
                    help="extra arguments for deepserve serve")
    args = ap.parse_args()
    port = free_port()
    cmd = [sys.executable, "-m", "deepserve", "serve", *([args.model] if args.model else []), "--port", str(port),
           "--served-model-name", MODEL, "--log-level", "warning", *args.serve_args.split()]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    server = subprocess.Popen(cmd, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        report = asyncio.run(Soak(base, server, args.seconds, args.concurrency, args.seed).run())
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    report["exit_code"] = server.returncode
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(report, indent=1))
    plot(report, out / "soak.png")
    print(json.dumps({k: v for k, v in report.items() if k != "rss_mib"}, indent=1))
    rss = [m for _, m in report["rss_mib"]]
    if rss:
        print(f"RSS MiB: start {rss[0]}, max {max(rss)}, end {rss[-1]}")


if __name__ == "__main__":
    main()
