"""How long the rest of the server waits while one large request body is handled (issue 26, finding 1).

Starts `deepserve serve` (the embedded default model unless --model is given) on a free port, opens a long
stream, then posts one large chat (or completions) body while polling `/health` every 20 ms. Prints, as JSON:
the large request's status, error code and seconds; the slowest `/health` answer while it was in flight; the
longest gap between two chunks of the stream meanwhile; the server's event-loop lag histogram afterwards; and
the server's resident memory before and after it posts the body `--repeat` times more.

    .venv/bin/python bench/server_event_loop.py                      # a 4 MB chat body ("a " * 2**21)
    .venv/bin/python bench/server_event_loop.py --route completions --mb 10
    .venv/bin/python bench/server_event_loop.py --chars 150000       # under the byte bound: tokenized for real
    PYTHONPATH=/tmp/before .venv/bin/python bench/server_event_loop.py   # another tree's package (before/after)
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time

import aiohttp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_healthy(session: aiohttp.ClientSession, proc: subprocess.Popen) -> None:
    while proc.poll() is None:
        try:
            if (await session.get("/health")).status == 200:
                return
        except aiohttp.ClientConnectionError:
            pass
        await asyncio.sleep(0.1)
    raise SystemExit(f"the server exited with {proc.returncode}")


async def stream_gaps(session: aiohttp.ClientSession, model: str, gaps: list[float], stop: asyncio.Event) -> None:
    """Streams one request after another until `stop`, recording the time between consecutive chunks."""
    body = {"model": model, "prompt": "a", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    last = time.perf_counter()
    while not stop.is_set():
        async with session.post("/v1/completions", json=body) as r:
            if r.status != 200:
                raise SystemExit(f"the stream got {r.status}: {await r.text()}")
            async for _ in r.content:
                now = time.perf_counter()
                gaps.append(now - last)
                last = now
                if stop.is_set():
                    return


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


async def run(args: argparse.Namespace, base: str, model: str, pid: int) -> dict:
    text = "a " * (args.mb * 2**20 // 2) if args.chars is None else "a" * args.chars
    if args.route == "chat":
        path, body = "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": text}],
                                              "max_tokens": 1}
    else:
        path, body = "/v1/completions", {"model": model, "prompt": text, "max_tokens": 1}
    raw = json.dumps(body).encode()
    async with aiohttp.ClientSession(base, timeout=aiohttp.ClientTimeout(total=600)) as session:
        gaps, stop = [], asyncio.Event()
        streaming = asyncio.create_task(stream_gaps(session, model, gaps, stop))
        while len(gaps) < 5:  # the stream is flowing
            await asyncio.sleep(0.01)
        gaps.clear()
        began = time.perf_counter()
        big = asyncio.create_task(session.post(path, data=io.BytesIO(raw),
                                               headers={"Content-Type": "application/json"}))
        health = []
        while not big.done():
            t = time.perf_counter()
            await (await session.get("/health")).read()
            health.append(time.perf_counter() - t)
            await asyncio.sleep(0.02)
        response = await big
        seconds = time.perf_counter() - began
        answer = await response.json()
        stop.set()
        await asyncio.wait_for(streaming, 60)
        rss_before = rss_mib(pid)
        for _ in range(args.repeat):
            await (await session.post(path, data=io.BytesIO(raw), headers={"Content-Type": "application/json"})).read()
        rss_after = rss_mib(pid)
        lag = [line for line in (await (await session.get("/metrics")).text()).splitlines()
               if line.startswith("deepserve_event_loop_lag_seconds") and not line.startswith("#")]
    return {"route": path, "body_bytes": len(raw), "status": response.status,
            "code": (answer.get("error") or {}).get("code"), "seconds": round(seconds, 3),
            "health_polls": len(health), "health_max_seconds": round(max(health, default=0.0), 3),
            "stream_max_gap_seconds": round(max(gaps, default=0.0), 3),
            "rss_mib_before_repeats": round(rss_before), "rss_mib_after_repeats": round(rss_after),
            "event_loop_lag": {line.split(" ")[0]: float(line.split(" ")[1]) for line in lag
                               if "_count" in line or "_sum" in line or 'le="0.5"' in line}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    parser.add_argument("--route", choices=["chat", "completions"], default="chat")
    parser.add_argument("--mb", type=int, default=4, help="body size in MiB (text 'a a a ...')")
    parser.add_argument("--chars", type=int, default=None, help="instead of --mb: a prompt of this many 'a's")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=5, help="posts of the body after the measured one (RSS)")
    args = parser.parse_args()
    port, name = free_port(), "bench"
    cmd = [sys.executable, "-m", "deepserve", "serve", *([args.model] if args.model else []), "--port", str(port),
           "--served-model-name", name, "--accelerator", "cpu", "--thinking", "off", "--log-level", "warning",
           *(["--max-model-len", str(args.max_model_len)] if args.max_model_len else [])]
    # cwd: not this tree, so that `-m deepserve` imports the package PYTHONPATH names, if any
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.Popen(cmd, cwd="/", env=env, stdout=sys.stderr)  # stdout: the JSON alone
    try:
        async def go() -> dict:
            async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
                await wait_healthy(session, proc)
            return await run(args, f"http://127.0.0.1:{port}", name, proc.pid)

        print(json.dumps(asyncio.run(go()), indent=2))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    main()
