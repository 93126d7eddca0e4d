"""Does one request harm the others? (issue 36)

Starts `kvshare serve` (the shipped model), runs 6 greedy victim streams, and then, one at a time,
each of the issue's single requests beside them:

* ``grammar3000``: a Lark grammar of 3,000 chained rules (it crashed the server);
* ``stops``: n=64 with 256 stop strings of 1,024 characters, streamed, disconnected after 5 s;
* ``echo``: 8 prompts of 3,990 characters with echo + logprobs 20;
* ``prefill``: one uncached prompt of 3,990 characters (its prefill beside the victims' decodes);
* ``schema``: n=128 with a 200-property JSON schema;
* ``tokenize``: /tokenize of 4 MB of text with token strings;
* ``n256``: n=256, max_tokens 3000 (disconnected after 12 s), and a new 2-token request 1 s after it;
* ``bodies``: 8 concurrent ~4 MB token-id bodies (each refused with a 400).

For each: the victims' token rate while the request is in the server as a ratio of the rate in the
`--window` seconds before it (targets: >= 0.5; bodies >= 0.8), the largest gap between two tokens
of one victim (<= 1.5 s; bodies <= 0.5 s), the new request's time to first token (n256, <= 2 s),
the server's RSS growth and the status. A request answered in under 1 s is measured over the
second from its start. On a shared machine the rate drifts; the load average is
printed beside the numbers.

    python benchmarks/isolation.py [--port 8124] [--threads 1] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from typing import Any, Awaitable, Callable

import httpx
from served import rss_mb, served

VICTIMS = 6
BODY_BYTES = 4 * 2**20 - 4096


def chain_grammar(rules: int) -> str:
    return "start: r0\n" + "".join(f'r{i}: r{i + 1} "a" | "b"\n' for i in range(rules)) + f'r{rules}: "c"\n'


def schema(props: int) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False, "required": [f"p{i}" for i in range(props)],
            "properties": {f"p{i}": {"type": "integer"} for i in range(props)}}


async def victim(client: httpx.AsyncClient, url: str, i: int, times: list[float], stop: asyncio.Event) -> None:
    """One greedy stream, restarted until `stop`; each token's arrival time goes to `times`."""
    while not stop.is_set():
        body = {"prompt": f"Victim {i} writes:", "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
                "stream": True}
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"text"' in line:
                    times.append(time.perf_counter())
                if stop.is_set():
                    return


def rate(runs: list[list[float]], start: float, end: float) -> float:
    return sum(1 for t in runs for x in t if start <= x < end) / max(end - start, 1e-9)


def max_gap(runs: list[list[float]], start: float, end: float) -> float:
    """The longest wait for a victim's next token in [start, end] (a stream silent to the end counts)."""
    gaps = []
    for t in runs:
        inside = [x for x in t if start <= x <= end]
        prev = max((x for x in t if x < start), default=start)
        points = [prev, *inside, end]
        gaps.append(max(b - a for a, b in zip(points, points[1:])))
    return max(gaps, default=0.0)


async def post_status(client: httpx.AsyncClient, url: str, path: str, body: Any) -> tuple[int, int]:
    """(status, reply bytes)."""
    if isinstance(body, bytes):
        r = await client.post(url + path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = await client.post(url + path, json=body)
    return r.status_code, len(r.content)


async def stream_for(client: httpx.AsyncClient, url: str, body: dict[str, Any], seconds: float,
                     first: list[float]) -> tuple[int, int]:
    """Stream `body`, leave after `seconds` (the client disconnects); (status, bytes read)."""
    got = 0
    t0 = time.perf_counter()
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        try:
            async with asyncio.timeout(seconds):
                async for chunk in r.aiter_bytes():
                    if not first:
                        first.append(time.perf_counter() - t0)
                    got += len(chunk)
        except TimeoutError:
            pass
        return r.status_code, got


def _post_in_helper(url: str, path: str, body: bytes, copies: int) -> list[tuple[int, int]]:
    """(status, reply bytes) of `copies` concurrent posts of `body`, sent from this helper process (a
    4 MB upload from the benchmark's own event loop would delay its reading of the victims' tokens)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(_: int) -> tuple[int, int]:
        r = httpx.post(url + path, content=body, headers={"Content-Type": "application/json"}, timeout=600)
        return r.status_code, len(r.content)

    with ThreadPoolExecutor(copies) as pool:
        return list(pool.map(one, range(copies)))


HELPER: Any = None  # a ProcessPoolExecutor(1), started before any measurement


async def post_big(url: str, path: str, body: bytes, copies: int = 1) -> list[tuple[int, int]]:
    return await asyncio.wrap_future(HELPER.submit(_post_in_helper, url, path, body, copies))


def scenarios() -> dict[str, Callable[[httpx.AsyncClient, str, dict[str, Any]], Awaitable[str]]]:
    async def grammar3000(c: httpx.AsyncClient, url: str, info: dict[str, Any]) -> str:
        body = {"prompt": "x", "max_tokens": 8, "structured_outputs": {"grammar": chain_grammar(3000)}}
        return str((await post_status(c, url, "/v1/completions", body))[0])

    async def stops(c: httpx.AsyncClient, url: str, info: dict[str, Any]) -> str:
        import random
        rng = random.Random(0)
        s = ["".join(rng.choice("abcdefgh ") for _ in range(1024)) for _ in range(256)]
        body = {"prompt": "Tell a story:", "n": 64, "max_tokens": 3000, "ignore_eos": True, "stream": True, "stop": s}
        status, _ = await stream_for(c, url, body, 5.0, [])
        await asyncio.sleep(3.0)  # the disconnect must stop the work: measured too
        return str(status)

    async def echo(c: httpx.AsyncClient, url: str, info: dict[str, Any]) -> str:
        prompts = [("word%d " % i) * 665 for i in range(8)]  # ~3,990 characters each
        body = {"prompt": [p[:3990] for p in prompts], "echo": True, "logprobs": 20, "max_tokens": 4}
        status, size = await post_status(c, url, "/v1/completions", body)
        return f"{status} ({size} B)"

    async def prefill(c: httpx.AsyncClient, url: str, info: dict[str, Any]) -> str:
        import random
        rng = random.Random(time.time_ns())  # uncached: a new prompt each run
        body = {"prompt": "".join(rng.choice("abcdefghij ") for _ in range(3990)), "max_tokens": 1}
        return str((await post_status(c, url, "/v1/completions", body))[0])

    async def schema128(c: httpx.AsyncClient, url: str, info: dict[str, Any]) -> str:
        body = {"prompt": "JSON:", "n": 128, "max_tokens": 40,
                "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema(200)}}}
        return str((await post_status(c, url, "/v1/completions", body))[0])

    async def tokenize(c: httpx.AsyncClient, url: str, info: dict[str, Any]) -> str:
        body = json.dumps({"prompt": "ab" * (BODY_BYTES // 2 - 64), "return_token_strs": True}).encode()
        status, size = (await post_big(url, "/tokenize", body))[0]
        return f"{status} ({size} B)"

    async def n256(c: httpx.AsyncClient, url: str, info: dict[str, Any]) -> str:
        big = {"prompt": "Count:", "n": 256, "max_tokens": 3000, "ignore_eos": True, "stream": True}
        task = asyncio.create_task(stream_for(c, url, big, 12.0, []))
        await asyncio.sleep(1.0)
        first: list[float] = []
        small = {"prompt": "Hi", "max_tokens": 2, "stream": True}
        s2, _ = await stream_for(c, url, small, 60.0, first)
        info["ttft"] = first[0] if first else None
        status, _ = await task
        return f"{status}, new {s2}"

    async def bodies(c: httpx.AsyncClient, url: str, info: dict[str, Any]) -> str:
        raw = json.dumps({"prompt": [123456] * (BODY_BYTES // 8), "max_tokens": 4}).encode()
        codes = await post_big(url, "/v1/completions", raw, 8)
        return ",".join(sorted({str(s) for s, _ in codes}))

    return {"grammar3000": grammar3000, "stops": stops, "echo": echo, "prefill": prefill, "schema": schema128, "tokenize": tokenize,
            "n256": n256, "bodies": bodies}


async def run(url: str, pid: int, names: list[str], window: float) -> None:
    runs: list[list[float]] = [[] for _ in range(VICTIMS)]
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=400, max_keepalive_connections=50)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        tasks = [asyncio.create_task(victim(client, url, i, runs[i], stop)) for i in range(VICTIMS)]
        while min(map(len, runs)) < 3:
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)
        table = scenarios()
        for name in names:
            t_before = time.perf_counter()
            await asyncio.sleep(window)
            rss0 = rss_mb(pid)
            info: dict[str, Any] = {}
            start = time.perf_counter()
            status = await table[name](client, url, info)
            end = time.perf_counter()
            if end - start < 1.0:  # a quick refusal: measure the second that follows it (a rate needs tokens)
                await asyncio.sleep(start + 1.0 - end)
                end = start + 1.0
            rss1 = rss_mb(pid)
            before = rate(runs, t_before, start)
            during = rate(runs, start, end)
            ttft = f", new request TTFT {info['ttft']:.2f} s" if "ttft" in info and info["ttft"] is not None else ""
            print(f"{name:12s} status {status}; {end - start:6.2f} s in the server; victims {during:6.1f} tok/s vs "
                  f"{before:6.1f} before (ratio {during / max(before, 1e-9):.2f}); largest gap "
                  f"{max_gap(runs, start, end):.2f} s; RSS {rss0:.0f} -> {rss1:.0f} MB "
                  f"({rss1 - rss0:+.0f}){ttft}; load {os.getloadavg()[0]:.2f}", flush=True)
            await asyncio.sleep(2.0)  # let aborted work drain before the next window
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8124)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--window", type=float, default=4.0, help="seconds of victim rate measured before each request")
    ap.add_argument("--only", nargs="*", default=None, help="scenario names (default: all)")
    ap.add_argument("--serve-arg", action="append", default=[], metavar="FLAG")
    a = ap.parse_args()
    names = a.only or list(scenarios())
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start", flush=True)
    global HELPER
    from concurrent.futures import ProcessPoolExecutor

    HELPER = ProcessPoolExecutor(1)
    HELPER.submit(int).result()  # the helper process is up before any measurement
    with served(a.port, a.threads, "warning", 30, a.serve_arg) as (srv, url):
        asyncio.run(run(url, srv.pid, names, a.window))
    HELPER.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
