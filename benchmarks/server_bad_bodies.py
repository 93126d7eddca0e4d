"""Do large bodies of small JSON values slow the streams of other clients? (issue 28, item 1)

Starts `kvshare serve` (the shipped model) and runs 8 greedy streams. `--mode burst` (the issue's
case): while they decode, 8 clients post ~4 MiB bodies of small values (token ids, stop strings,
messages) at the same moment, each of which the server must refuse with a 400. The streams'
aggregate decode rate while the bodies are in the server is compared with its rate in the
`--window` seconds just before and just after, on the same streams (a paired measurement: on a
machine shared with other work the rate alone drifts by 2x between runs, much more than the
effect measured). This repeats `--repeats` times; the median ratio is the result.
`--mode flood`: the bodies are posted again and again for a whole run of streams, compared with a
run without them. Prints the ratios, the longest gap between two tokens of one stream, and the
server's RSS growth (VmRSS of the process).

    python benchmarks/server_bad_bodies.py [--mode burst|flood] [--repeats 15] [--threads 1] [--port 8123]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

import httpx
from served import rss_mb, served

BODY_BYTES = 4 * 2**20 - 4096


def bad_bodies() -> list[bytes]:
    """Three ~4 MiB bodies of small values: token ids, stop strings, chat messages."""
    n_ids = BODY_BYTES // 8
    ids = json.dumps({"prompt": [123456] * n_ids, "max_tokens": 4}).encode()
    stops = json.dumps({"prompt": "hi", "stop": ["ab"] * (BODY_BYTES // 6), "max_tokens": 4}).encode()
    msg = {"role": "user", "content": "a"}
    msgs = json.dumps({"messages": [msg] * (BODY_BYTES // 36), "max_tokens": 4}).encode()
    assert all(len(b) < 4 * 2**20 for b in (ids, stops, msgs))
    return [ids, stops, msgs]


async def stream(client: httpx.AsyncClient, url: str, i: int, tokens: int, times: list[float]) -> None:
    """One greedy stream; the arrival time of each token is appended to `times`."""
    body = {"prompt": f"Stream {i} says:", "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.status_code
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"text"' in line:
                times.append(time.perf_counter())


async def post(client: httpx.AsyncClient, url: str, body: bytes) -> int:
    path = "/v1/chat/completions" if b'"messages"' in body[:20] else "/v1/completions"
    r = await client.post(url + path, content=body, headers={"Content-Type": "application/json"})
    return r.status_code


def rate(runs: list[list[float]], start: float, end: float) -> float:
    """Tokens per second of all streams together that arrived in [start, end)."""
    return sum(1 for t in runs for x in t if start <= x < end) / (end - start)


def max_gap(runs: list[list[float]], start: float, end: float) -> float:
    """The longest time between two tokens of one stream, both arriving in [start, end]."""
    return max((b - a for t in runs for a, b in zip(t, t[1:]) if start <= a and b <= end), default=0.0)


async def burst(url: str, bodies: list[bytes], window: float) -> tuple[float, float, float, float, float, list[int]]:
    """(rate before, rate while the bodies are in the server, rate after, seconds they were in it,
    max gap, status codes)."""
    runs: list[list[float]] = [[] for _ in range(8)]
    async with httpx.AsyncClient(timeout=600) as client:
        streams = [asyncio.create_task(stream(client, url, i, 3000, runs[i])) for i in range(8)]
        while min(map(len, runs)) < 2:  # every stream is decoding
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        before = time.perf_counter()
        await asyncio.sleep(window)
        sent = time.perf_counter()
        codes = await asyncio.gather(*(post(client, url, bodies[i % 3]) for i in range(8)))
        answered = time.perf_counter()
        await asyncio.sleep(window)
        after = time.perf_counter()
        for s in streams:
            s.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
    return (rate(runs, before, sent), rate(runs, sent, answered), rate(runs, answered, after), answered - sent,
            max_gap(runs, before, after), list(codes))


async def flood(url: str, bodies: list[bytes], tokens: int, with_bodies: bool) -> tuple[float, float, list[int]]:
    """(rate of a whole run of 8 streams of `tokens`, max gap, codes) with bodies posted throughout."""
    runs: list[list[float]] = [[] for _ in range(8)]
    codes: list[int] = []
    stop = asyncio.Event()

    async def poster(body: bytes) -> None:
        while not stop.is_set():
            codes.append(await post(client, url, body))

    async with httpx.AsyncClient(timeout=600) as client:
        posters = [asyncio.create_task(poster(bodies[i % 3])) for i in range(8 if with_bodies else 0)]
        await asyncio.gather(*(stream(client, url, i, tokens, runs[i]) for i in range(8)))
        stop.set()
        await asyncio.gather(*posters)
    start, end = min(t[0] for t in runs), max(t[-1] for t in runs)
    return sum(len(t) - 1 for t in runs) / (end - start), max_gap(runs, start, end), codes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--mode", choices=["burst", "flood"], default="burst")
    ap.add_argument("--repeats", type=int, default=15, help="bursts (burst mode)")
    ap.add_argument("--window", type=float, default=1.5, help="seconds measured before and after a burst")
    ap.add_argument("--tokens", type=int, default=200, help="tokens per stream (flood mode)")
    ap.add_argument("--serve-arg", action="append", default=[], metavar="FLAG",
                    help="a further `kvshare serve` flag (repeatable), e.g. --serve-arg=--no-batch-invariant")
    a = ap.parse_args()
    bodies = bad_bodies()
    with served(a.port, a.threads, "warning", 30, a.serve_arg) as (srv, url):
        asyncio.run(flood(url, bodies, 20, False))  # warm-up
        rss0 = rss_mb(srv.pid)
        print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} before")
        if a.mode == "burst":
            ratios, gaps, codes = [], [], set()
            for i in range(a.repeats):
                before, during, after, took, gap, got = asyncio.run(burst(url, bodies, a.window))
                ratios.append(during / ((before + after) / 2))
                gaps.append(gap)
                codes |= set(got)
                print(f"burst {i + 1}: {before:.1f} tok/s before, {during:.1f} while the bodies were in the "
                      f"server ({took:.2f} s; {100 * ratios[-1]:.0f}%), {after:.1f} after; max gap {gap:.3f} s; "
                      f"replies {sorted(set(got))}")
            print(f"median {100 * statistics.median(ratios):.0f}% of the rate around the bursts "
                  f"(min {100 * min(ratios):.0f}%, max {100 * max(ratios):.0f}%), max gap {max(gaps):.3f} s, "
                  f"replies {sorted(codes)}")
        else:
            base, base_gap, _ = asyncio.run(flood(url, bodies, a.tokens, False))
            r, gap, got = asyncio.run(flood(url, bodies, a.tokens, True))
            print(f"alone: {base:.1f} tok/s, max gap {base_gap:.3f} s")
            print(f"flooded by 8 clients: {r:.1f} tok/s ({100 * r / base:.0f}%), max gap {gap:.3f} s, "
                  f"{len(got)} bodies answered {sorted(set(got))}")
        rss1 = rss_mb(srv.pid)
        print(f"RSS {rss0:.0f} MB -> {rss1:.0f} MB (+{rss1 - rss0:.0f} MB); load average {os.getloadavg()[0]:.2f} after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
