"""What SIGTERM does to open streams (issue 26, finding 3): `deepserve serve --drain-timeout D` (the embedded
default model unless --model is given), N streams of T tokens each (half chat, half completions), SIGTERM once
every stream has its first chunk. Prints, as JSON: how each stream ended (`done`: its normal end; `error_event`:
the protocol's error event; `truncated`: neither), seconds from SIGTERM to the last chunk any stream got, and
to the process's exit.

    .venv/bin/python bench/server_shutdown.py --drain-timeout 3 --streams 20 --tokens 1000
    PYTHONPATH=/tmp/before .venv/bin/python bench/server_shutdown.py    # another tree's package (before/after)
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import subprocess
import sys
import time

import aiohttp

from server_event_loop import free_port, wait_healthy


async def one_stream(session: aiohttp.ClientSession, i: int, tokens: int, started: asyncio.Event,
                     counter: list[int], last_chunk: list[float]) -> str:
    if i % 2:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": 1.0}
    else:
        path, body = "/v1/completions", {"prompt": "hi", "ignore_eos": True}
    body = {"model": "bench", "max_tokens": tokens, "stream": True, **body}
    lines = []
    try:
        async with session.post(path, json=body) as r:
            async for line in r.content:
                if not lines:
                    counter[0] += 1
                    if counter[0] == counter[1]:
                        started.set()
                lines.append(line.decode())
                last_chunk[0] = time.perf_counter()
    except aiohttp.ClientError:
        pass
    text = "".join(lines)
    if "data: [DONE]" in text:
        return "done"
    if '"error"' in text.strip().split("\n\n")[-1]:
        return "error_event"
    return "truncated"


async def run(args: argparse.Namespace, port: int, proc: subprocess.Popen) -> dict:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(f"http://127.0.0.1:{port}", connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        await wait_healthy(session, proc)
        started, counter, last_chunk = asyncio.Event(), [0, args.streams], [0.0]
        streams = [asyncio.create_task(one_stream(session, i, args.tokens, started, counter, last_chunk))
                   for i in range(args.streams)]
        await started.wait()
        sigterm = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        endings = await asyncio.gather(*streams)
        exit_code = await asyncio.to_thread(proc.wait, 600)
        exited = time.perf_counter()
    return {"drain_timeout": args.drain_timeout, "streams": args.streams, "tokens": args.tokens,
            "endings": dict(collections.Counter(endings)),
            "last_chunk_after_sigterm_seconds": round(last_chunk[0] - sigterm, 2),
            "exit_after_sigterm_seconds": round(exited - sigterm, 2), "exit_code": exit_code}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    parser.add_argument("--drain-timeout", type=float, default=3.0)
    parser.add_argument("--streams", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=1000)
    args = parser.parse_args()
    port = free_port()
    cmd = [sys.executable, "-m", "deepserve", "serve", *([args.model] if args.model else []), "--port", str(port),
           "--served-model-name", "bench", "--accelerator", "cpu", "--thinking", "off", "--log-level", "warning",
           "--drain-timeout", str(args.drain_timeout)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    # cwd: not this tree, so that `-m deepserve` imports the package PYTHONPATH names, if any
    proc = subprocess.Popen(cmd, cwd="/", env=env, stdout=sys.stderr)  # stdout: the JSON alone
    try:
        print(json.dumps(asyncio.run(run(args, port, proc)), indent=2))
    finally:
        if proc.poll() is None:
            proc.kill()


if __name__ == "__main__":
    main()
