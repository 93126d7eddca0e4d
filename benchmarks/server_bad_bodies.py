"""Do large bodies of small JSON values slow the streams of other clients? (issue 28, item 1)

Starts `kvshare serve` (the shipped model), runs 8 greedy streams alone, then the same 8 streams
while 8 clients post ~4 MiB bodies of small values (token ids, stop strings, messages), each of
which the server must refuse with a 400: once each, all at the same moment (`--mode burst`, the
issue's case), or again and again for the whole run (`--mode flood`). Prints the streams' aggregate decode rate, the
longest gap between two tokens of one stream, and the server's RSS growth (VmRSS of the process).

    python benchmarks/server_bad_bodies.py [--mode burst|flood] [--threads 1] [--tokens 200] [--port 8123]
"""

from __future__ import annotations

import argparse
import asyncio
import json
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


async def stream(client: httpx.AsyncClient, url: str, i: int, tokens: int) -> list[float]:
    body = {"prompt": f"Stream {i} says:", "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    times = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.status_code
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"text"' in line:
                times.append(time.perf_counter())
    return times


async def flood(client: httpx.AsyncClient, url: str, body: bytes, stop: asyncio.Event, codes: list[int],
                once: bool) -> None:
    path = "/v1/chat/completions" if b'"messages"' in body[:20] else "/v1/completions"
    while not stop.is_set():
        r = await client.post(url + path, content=body, headers={"Content-Type": "application/json"})
        codes.append(r.status_code)
        if once:
            return


async def phase(url: str, tokens: int, with_flood: bool, once: bool = False) -> tuple[float, float, list[int]]:
    bodies = bad_bodies()
    stop, codes = asyncio.Event(), []
    async with httpx.AsyncClient(timeout=600) as client:
        streams = asyncio.gather(*(stream(client, url, i, tokens) for i in range(8)))
        await asyncio.sleep(1.0)  # the streams are decoding when the bodies arrive
        sent = time.perf_counter()
        floods = [asyncio.create_task(flood(client, url, bodies[i % 3], stop, codes, once))
                  for i in range(8 if with_flood else 0)]
        if once:
            await asyncio.gather(*floods)
        answered = time.perf_counter()
        runs = await streams
        stop.set()
        await asyncio.gather(*floods)
    if once:  # the rate while the bodies were in the server
        start, end = sent, answered
        tokens = sum(1 for t in runs for x in t if start <= x <= end)
    else:
        start, end = min(t[0] for t in runs), max(t[-1] for t in runs)
        tokens = sum(len(t) - 1 for t in runs)
    rate = tokens / (end - start)
    gap = max(b - a for t in runs for a, b in zip(t, t[1:]))
    return rate, gap, codes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--mode", choices=["burst", "flood"], default="burst")
    a = ap.parse_args()
    with served(a.port, a.threads, "warning", 30) as (srv, url):
        asyncio.run(phase(url, 20, False))  # warm-up
        rss0 = rss_mb(srv.pid)
        base_rate, base_gap, _ = asyncio.run(phase(url, a.tokens, False))
        rate, gap, codes = asyncio.run(phase(url, a.tokens, True, once=a.mode == "burst"))
        rss1 = rss_mb(srv.pid)
        print(f"alone: {base_rate:.1f} tok/s, max gap {base_gap:.3f} s")
        window = "while the 8 bodies were in the server" if a.mode == "burst" else "flooded"
        print(f"with 8 x 4 MiB bad bodies ({window}): {rate:.1f} tok/s ({100 * rate / base_rate:.0f}%), max gap {gap:.3f} s, "
              f"{len(codes)} bodies answered {sorted(set(codes))}")
        print(f"RSS {rss0:.0f} MB -> {rss1:.0f} MB (+{rss1 - rss0:.0f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
