"""Does the server's memory come back after many requests? (issue 28, item 6)

Starts `kvshare serve` (the shipped model), sends 10 requests and reads the server's RSS, then
1,000 mixed requests (completions and chat, streaming and whole, short and long prompts and
outputs, a few clients gone mid-stream, bad bodies of up to 4 MiB) from 8 clients at a time,
waits idle for a minute, and reads the RSS again (VmRSS of the server process; the body-parser
child is reported apart).

    python benchmarks/server_memory.py [--requests 1000] [--idle 60] [--port 8124]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time

import httpx
from served import rss_mb, served


def anon_file_mb(pid: int) -> str:
    """RssAnon (heap, arenas, anonymous maps) and RssFile (touched pages of mapped files) of `pid`."""
    with open(f"/proc/{pid}/status") as f:
        kb = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f) if k in ("RssAnon", "RssFile")}
    return f"anon {kb['RssAnon'] / 1024:.0f} MB, file {kb['RssFile'] / 1024:.0f} MB"


def children_rss_mb(pid: int) -> float:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout.split()
    return sum(rss_mb(int(c)) for c in out if os.path.exists(f"/proc/{c}"))


def request(i: int, rng: random.Random) -> tuple[str, bytes, bool]:
    """(path, body, streaming) of mixed request number i."""
    kind = i % 10
    words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "memory", "cache"]) for _ in range(rng.randint(1, 60)))
    if kind == 9:  # a bad body: a large array of small values, or a big string
        big = rng.choice([{"prompt": [7] * 500_000}, {"prompt": "hi", "stop": ["x"] * 600_000},
                          {"messages": [{"role": "user", "content": "a"}] * 100_000},
                          {"prompt": "z" * 3_000_000}])
        path = "/v1/chat/completions" if "messages" in big else "/v1/completions"
        return path, json.dumps(big).encode(), False
    stream = kind % 2 == 0
    n = rng.choice([1, 4, 8, 16])
    if kind in (1, 3, 5):
        body = {"messages": [{"role": "user", "content": words}], "max_tokens": n, "stream": stream}
        return "/v1/chat/completions", json.dumps(body).encode(), stream
    body = {"prompt": words, "max_tokens": n, "stream": stream, "temperature": rng.choice([0, 0.8])}
    return "/v1/completions", json.dumps(body).encode(), stream


async def one(client: httpx.AsyncClient, url: str, i: int, rng: random.Random) -> int:
    path, body, stream = request(i, rng)
    headers = {"Content-Type": "application/json"}
    if not stream:
        return (await client.post(url + path, content=body, headers=headers)).status_code
    async with client.stream("POST", url + path, content=body, headers=headers) as r:
        lines = 0
        async for _ in r.aiter_lines():
            lines += 1
            if i % 20 == 0 and lines > 3:  # a client gone mid-stream
                break
        return r.status_code


async def run(url: str, start: int, n: int, concurrency: int) -> dict[int, int]:
    rng = random.Random(start)
    sem = asyncio.Semaphore(concurrency)
    codes: dict[int, int] = {}

    async def task(i: int) -> None:
        async with sem:
            code = await one(client, url, i, rng)
            codes[code] = codes.get(code, 0) + 1

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(task(i) for i in range(start, start + n)))
    return codes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8124)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--idle", type=float, default=60.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--serve-arg", action="append", default=[], metavar="FLAG",
                    help="a further `kvshare serve` flag (repeatable), e.g. --serve-arg=--no-batch-invariant")
    a = ap.parse_args()
    with served(a.port, a.threads, "error", 60, a.serve_arg) as (srv, url):
        asyncio.run(run(url, 0, 10, 8))
        time.sleep(2)
        first, first_parts = rss_mb(srv.pid), anon_file_mb(srv.pid)
        t0 = time.time()
        codes = asyncio.run(run(url, 10, a.requests, 8))
        busy, busy_parts = rss_mb(srv.pid), anon_file_mb(srv.pid)
        took = time.time() - t0
        time.sleep(a.idle)
        last, last_parts = rss_mb(srv.pid), anon_file_mb(srv.pid)
        metric = [l for l in httpx.get(url + "/metrics").text.splitlines() if l.startswith("process_resident")]
        print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the end")
        print(f"RSS after the first 10 requests: {first:.0f} MB ({first_parts})")
        print(f"RSS right after {a.requests} mixed requests ({took:.0f} s, replies {codes}): {busy:.0f} MB ({busy_parts})")
        print(f"RSS after {a.idle:g} s idle: {last:.0f} MB ({last_parts}; {last / first:.2f}x the first); "
              f"body-parser child {children_rss_mb(srv.pid):.0f} MB; /metrics: {metric}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
