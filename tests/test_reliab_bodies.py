"""Bounded request cost (issue 28, item 1): structural limits refuse abusive bodies by their shape
before validation; large bodies are decoded in a child process, so a burst of them does not stall
the streams of other clients; the concurrency limit comes before decoding."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import multiprocessing
import time
from typing import Any, Iterator

import httpx
import pytest

from kvshare.server.app import create_app
from kvshare.server.background import BackgroundServer
from kvshare.server.body_parser import BodyParser, decode_body
from kvshare.server.errors import APIError
from kvshare.server.limits import OFF_LOOP_BYTES, RequestLimits, check_structure
from kvshare.server.protocol import ChatCompletionRequest, CompletionRequest
from kvshare.tokenizer import load_tokenizer

MODEL = "tiny-v41"
LIMITS = RequestLimits(max_array_items=100, max_prompt_tokens=50, max_object_keys=20, max_json_nodes=500,
                       max_stop_chars=10)


def refused(data: Any, limits: RequestLimits = LIMITS) -> APIError:
    with pytest.raises(APIError) as e:
        check_structure(data, limits)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize("data, param, words", [
    ({"messages": [{"role": "user", "content": "a"}] * 101}, "messages", "101 elements (at most 100)"),
    ({"prompt": list(range(51))}, "prompt", "51 elements (at most 50)"),
    ({"prompt": [list(range(51))]}, "prompt.0", "51 elements (at most 50)"),
    ({"x": {str(i): i for i in range(21)}}, "x", "21 keys (at most 20)"),
    ({"stop": ["a"] * 257}, "stop", "at most 256 stop sequences"),
    ({"stop": "a" * 11}, "stop", "11 characters (at most 10)"),
    ({"stop": ["ok", "b" * 11]}, "stop", "11 characters (at most 10)"),
    ({"m": [[{"a": 1}] * 20] * 20}, "m.", "more than 500"),
    ({"m": [{"content": [{"text": "a\ud800"}]}]}, "m.0.content.0", "lone surrogate"),
    ({"m": ["ok", "\udc80"]}, "m.1", "lone surrogate"),
])
def test_each_limit_is_a_400_naming_where(data: Any, param: str, words: str) -> None:
    e = refused(data)
    assert words in e.message, e.message
    assert (e.param or "").startswith(param), e.param


def test_limits_at_their_edge_pass() -> None:
    check_structure({"messages": [{"role": "user", "content": "é"}] * 100, "prompt": list(range(50)),
                     "stop": ["a" * 10] * 4, "x": {str(i): i for i in range(20)}}, RequestLimits(
        max_array_items=100, max_prompt_tokens=50, max_object_keys=20, max_json_nodes=500, max_stop_chars=10))


def test_top_level_scalars_pass_the_structure_check() -> None:
    """Found by the schemathesis run: a body `null` or `5` crashed the check (a 500); the route refuses it."""
    for data in (None, 5, 1.5, True, "text"):
        check_structure(data, LIMITS)
    assert "lone surrogate" in refused("\ud800").message


def test_deep_nesting_is_refused_at_the_limit() -> None:
    deep: Any = 1
    for _ in range(33):
        deep = [deep]
    assert "nested deeper than 32" in refused({"a": deep}, RequestLimits()).message
    check_structure({"a": deep[0][0]}, RequestLimits())  # 32 levels with the top object


class _Untouchable(list):
    """A list whose elements must not be read (iterating or indexing it fails the test)."""

    def __iter__(self) -> Iterator[Any]:
        raise AssertionError("the structure check walked the elements of an over-long array")

    def __getitem__(self, i: Any) -> Any:
        raise AssertionError("the structure check read an element of an over-long array")


def test_a_huge_flat_array_is_refused_on_its_length_alone() -> None:
    """Refusing 2M ids or stops reads only len(): the elements are never visited (was a timing test,
    which flaked at 1.02 ms against a 1 ms bound on the loaded machine). Mutation caught: checking
    the elements before the length."""
    assert "2000000" in refused({"prompt": _Untouchable([7] * 2_000_000)}).message.replace(",", "")
    refused({"stop": _Untouchable(["s"] * 2_000_000)})


def test_child_and_inline_decoding_agree() -> None:
    """The child process returns the same model, or the same error, as decoding here."""
    async def both(raw: bytes, model: Any) -> tuple[Any, Any]:
        parser = BodyParser(RequestLimits(max_prompt_tokens=64))
        try:
            results = []
            for big in (False, True):
                body = raw + b" " * (OFF_LOOP_BYTES + 1) if big else raw
                try:
                    results.append(await parser.parse(body, model))
                except APIError as e:
                    results.append((e.status, e.message, e.param, e.code))
            return results[0], results[1]
        finally:
            parser.close()

    cases = [
        (b'{"prompt": [1, 2, 3], "max_tokens": 4, "stop": ["x"]}', CompletionRequest),
        (b'{"prompt": ' + json.dumps(list(range(65))).encode() + b'}', CompletionRequest),
        (b'{"prompt": "hi", "temperature": -1}', CompletionRequest),
        (b'{"messages": [{"role": "user", "content": "hi"}]}', ChatCompletionRequest),
        (b'{"messages": [}', ChatCompletionRequest),
        (b'[1, 2]', ChatCompletionRequest),
    ]
    for raw, model in cases:
        inline, child = asyncio.run(both(raw, model))
        assert inline == child, raw
    assert decode_body(cases[0][0], CompletionRequest, RequestLimits()).prompt == [1, 2, 3]


def test_a_dead_child_is_replaced() -> None:
    async def run() -> list[Any]:
        parser = BodyParser(RequestLimits())
        body = b'{"prompt": [1], "user": "' + b"u" * OFF_LOOP_BYTES + b'"}'
        try:
            first = await parser.parse(body, CompletionRequest)
            assert parser._proc is not None
            parser._proc.kill()
            parser._proc.wait()
            return [first, await parser.parse(body, CompletionRequest)]
        finally:
            parser.close()

    first, second = asyncio.run(run())
    assert first.prompt == second.prompt == [1]


def _ids_body(n: int) -> bytes:
    return json.dumps({"prompt": [7] * n, "max_tokens": 1}).encode()


def test_a_body_over_its_cpu_time_is_refused() -> None:
    """A 1.5 MB body of 500,000 ids costs the child ~0.1 s of CPU; with a 10 ms limit it is a 400
    naming the CPU time, and the next body goes to a fresh child. Mutation caught: the CPU-time
    check removed (the body is then decoded)."""
    async def run() -> tuple[APIError, int, int, Any]:
        parser = BodyParser(RequestLimits(parse_timeout_s=0.01))
        try:
            parser.start()
            first_pid = parser._proc.pid  # type: ignore[union-attr]
            with pytest.raises(APIError) as e:
                await parser.parse(_ids_body(500_000), CompletionRequest)
            second_pid = parser._proc.pid  # type: ignore[union-attr]
            parser.limits = RequestLimits()
            return e.value, first_pid, second_pid, await parser.parse(_ids_body(OFF_LOOP_BYTES // 2), CompletionRequest)
        finally:
            parser.close()

    err, first, second, ok = asyncio.run(run())
    assert (err.status, err.code) == (400, "invalid_json") and "s of CPU" in err.message, err.message
    assert first != second and len(ok.prompt) == OFF_LOOP_BYTES // 2


def test_a_stopped_child_gets_a_503_after_the_wall_limit_not_a_400() -> None:
    """A child that gets no CPU (SIGSTOP here; a starved nice-19 child alike) uses no CPU time, so
    the body is not blamed: after _WALL_FACTOR x parse_timeout_s of wall time it is a 503, the
    child is replaced, and the next body is decoded. Mutations caught: the CPU limit counted in
    wall time (a 400 after 0.2 s), the wall limit removed (the wait does not end: 20 s guard)."""
    import os
    import signal

    from kvshare.server import body_parser as bp

    limit = 0.2

    async def run() -> tuple[APIError, float, Any]:
        parser = BodyParser(RequestLimits(parse_timeout_s=limit))
        try:
            parser.start()
            stopped = parser._proc
            os.kill(stopped.pid, signal.SIGSTOP)  # type: ignore[union-attr]
            t0 = time.monotonic()
            with pytest.raises(APIError) as e:
                await asyncio.wait_for(parser.parse(_ids_body(200_000), CompletionRequest), 20)
            took = time.monotonic() - t0
            assert parser._proc is not stopped and stopped.poll() is not None  # type: ignore[union-attr]
            parser.limits = RequestLimits()
            return e.value, took, await parser.parse(_ids_body(OFF_LOOP_BYTES // 2), CompletionRequest)
        finally:
            parser.close()

    err, took, ok = asyncio.run(run())
    assert (err.status, err.code) == (503, "parser_timeout"), err.message
    assert bp._WALL_FACTOR * limit <= took < bp._WALL_FACTOR * limit + 5, took
    assert len(ok.prompt) == OFF_LOOP_BYTES // 2


# ---- the server under a burst of bad bodies -----------------------------------------------------

N_STREAMS = 4


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    from kvshare.engine.engine import LLMEngine

    engine = LLMEngine(MODEL, tokenizer=load_tokenizer(MODEL), seed=0, max_num_seqs=8, max_model_len=256)
    app = create_app(engine, engine.tokenizer, MODEL, max_concurrent_requests=2 * N_STREAMS + 8, max_model_len=256)
    with BackgroundServer(app) as srv:
        yield srv


def bad_bodies(size: int = 4 * 2**20 - 4096) -> list[tuple[str, bytes]]:
    ids = json.dumps({"prompt": [123456] * (size // 8)}).encode()
    stops = json.dumps({"prompt": "hi", "stop": ["ab"] * (size // 6)}).encode()
    msgs = json.dumps({"messages": [{"role": "user", "content": "a"}] * (size // 36)}).encode()
    return [("/v1/completions", ids), ("/v1/completions", stops), ("/v1/chat/completions", msgs)]


def test_the_child_starts_with_the_server(server: BackgroundServer) -> None:
    """The child's start-up (its imports: ~1.5 s of CPU) is paid when the server starts, not by the
    first burst of large bodies. Mutation caught: `parser.start()` left out of the lifespan."""
    proc = server.app.state.body_parser._proc
    assert proc is not None and proc.poll() is None


def test_large_bodies_are_decoded_in_the_child(server: BackgroundServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """No body over OFF_LOOP_BYTES is json-decoded in the server process; the child's 400 names the field."""
    import kvshare.server.body_parser as bp

    sizes: list[int] = []
    real = bp.parse_json
    monkeypatch.setattr(bp, "parse_json", lambda raw, limits: (sizes.append(len(raw)), real(raw, limits))[1])
    for path, raw in bad_bodies(2**20):
        r = httpx.post(server.base_url + path, content=raw, headers={"Content-Type": "application/json"}, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] in ("prompt", "stop", "messages"), r.text
    small = {"prompt": [5, 6], "max_tokens": 1}
    assert httpx.post(server.base_url + "/v1/completions", json=small, timeout=60).status_code == 200
    assert sizes and max(sizes) <= OFF_LOOP_BYTES  # the small body was decoded here, the large ones not


def test_health_answers_while_a_large_body_waits_on_the_child(server: BackgroundServer) -> None:
    """With the child stopped, a 4 MiB body waits in the parser; meanwhile the event loop still
    answers /health and generates for a small body, and once the child goes on the body gets its
    400. Mutation caught: the pipe worked on the event loop (`parse` calling `_call` directly):
    /health then times out."""
    import os
    import signal

    async def run() -> tuple[list[int], int]:
        os.kill(server.app.state.body_parser._proc.pid, signal.SIGSTOP)
        stopped = True
        try:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
                path, raw = bad_bodies()[0]
                big = asyncio.create_task(client.post(path, content=raw, headers={"Content-Type": "application/json"}))
                await asyncio.sleep(0.5)  # the body is in the parser, the child does not read it
                assert not big.done()
                seen = [(await client.get("/health", timeout=5)).status_code,
                        (await client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2},
                                           timeout=30)).status_code]
                assert not big.done()
                os.kill(server.app.state.body_parser._proc.pid, signal.SIGCONT)
                stopped = False
                return seen, (await big).status_code
        finally:
            if stopped:
                os.kill(server.app.state.body_parser._proc.pid, signal.SIGCONT)

    seen, big = asyncio.run(run())
    assert seen == [200, 200] and big == 400, (seen, big)


def _start_server(port: int) -> Any:
    from serve_proc import start_serve

    return start_serve(port, "--model", MODEL, "--random-weights", "--max-model-len", "1024", "--log-level",
                       "warning", "--threads", "1")


async def _stream(client: httpx.AsyncClient, url: str, i: int, times: list[float]) -> None:
    """One greedy stream of up to 1,000 tokens; each token's arrival time goes to `times`."""
    body = {"prompt": [5 + i, 9, 13], "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"text"' in line:
                times.append(time.monotonic())


def _post_all(url: str, bodies: list[tuple[str, bytes]]) -> tuple[list[int], float, float]:
    """(status codes, monotonic time sent, time all answered) of `bodies` posted at once, run in a
    helper process: the client posting 32 MB must not be the process that reads the streams, or its
    own work shows up as the streams' gaps (CLOCK_MONOTONIC is one clock for every process)."""

    async def post() -> list[int]:
        async with httpx.AsyncClient(timeout=120) as client:
            replies = await asyncio.gather(*(client.post(url + path, content=raw,
                                                         headers={"Content-Type": "application/json"})
                                             for path, raw in bodies))
        return [r.status_code for r in replies]

    sent = time.monotonic()
    codes = asyncio.run(post())
    return codes, sent, time.monotonic()


async def _burst(url: str, bodies: list[tuple[str, bytes]], window: float = 1.0) -> tuple[float, float, float, list[int]]:
    """(rate around, rate while `bodies` are in the server, max gap, status codes): one burst of
    bodies posted at once into running streams; "around" is the mean rate of the same streams in
    the `window` seconds before and after (paired: the rate alone drifts by 2x on this machine)."""
    runs: list[list[float]] = [[] for _ in range(N_STREAMS)]

    def rate(a: float, b: float) -> float:
        return sum(1 for t in runs for x in t if a <= x < b) / (b - a)

    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as helper:
        helper.submit(int).result()  # the helper is up before anything is measured
        async with httpx.AsyncClient(timeout=120) as client:
            streams = [asyncio.create_task(_stream(client, url, i, runs[i])) for i in range(N_STREAMS)]
            while min(map(len, runs)) < 2:
                await asyncio.sleep(0.02)
            before = time.monotonic()
            await asyncio.sleep(window)
            codes, sent, answered = await asyncio.get_running_loop().run_in_executor(helper, _post_all, url, bodies)
            await asyncio.sleep(window)
            after = time.monotonic()
            for s in streams:
                s.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
    assert all(len(t) < 1000 for t in runs)  # every stream was still decoding when measured
    gap = max(b - a for t in runs for a, b in zip(t, t[1:]) if before <= a and b <= after)
    return (rate(before, sent) + rate(answered, after)) / 2, rate(sent, answered), gap, codes


def test_bad_bodies_do_not_stall_streams() -> None:
    """8 concurrent ~4 MiB bodies of small values (each a 400) while 4 streams run, against a
    `kvshare serve` process (so this client's own work is not counted).

    The bodies are posted from a helper process (`_post_all`): posted from this process, the client's
    own 32 MB of sending showed up as the streams' slowdown (0.44-0.61 of the rate around the burst
    on an AMD EPYC VM, failing the bound half the time). Loose bounds, since the server's engine
    thread, the parser child and both clients share 2 cores: observed 62-71% of the rate around the
    burst (paired), gaps 0.20-0.35 s, server RSS +0-2 MB (an AMX Xeon VM at load 4-5 gave 103-139%).
    Mutation caught (an earlier session): the bodies decoded inline (`BodyParser.parse`), 13% of the
    rate around the burst."""
    from kvshare.server.memory import rss_bytes as rss

    with socket_port() as port:
        pass
    proc = _start_server(port)
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(_burst(url, []))  # warm-up
        rss0 = rss(proc.pid)
        bodies = bad_bodies()
        around, rate, gap, codes = asyncio.run(_burst(url, [bodies[i % 3] for i in range(8)]))
        growth_mb = (rss(proc.pid) - rss0) / 2**20  # type: ignore[operator]
    finally:
        proc.terminate()
        proc.wait(30)
    print(f"rate {rate:.1f} vs {around:.1f} around the burst, gap {gap:.3f} s, RSS +{growth_mb:.0f} MB")
    assert codes == [400] * 8
    assert rate >= 0.5 * around, (rate, around)
    assert gap < 2.0, gap
    assert growth_mb < 100, growth_mb


class socket_port:
    """A free TCP port (the socket is closed on exit, so the server can bind it)."""

    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return self.sock.getsockname()[1]

    def __exit__(self, *exc: Any) -> None:
        self.sock.close()


def test_admission_comes_before_decoding(server: BackgroundServer) -> None:
    """Over the concurrency limit, even a malformed body gets the 429, not a 400 from parsing."""
    state = server.app.state.kvshare
    deadline = time.monotonic() + 10
    while state.active and time.monotonic() < deadline:  # the previous test's streams closing
        time.sleep(0.05)
    held = state.active
    state.active = state.max_concurrent_requests
    try:
        r = httpx.post(server.base_url + "/v1/completions", content=b'{"prompt": [', timeout=30,
                       headers={"Content-Type": "application/json"})
    finally:
        state.active = held
    assert r.status_code == 429, r.text
    r = httpx.post(server.base_url + "/v1/completions", content=b'{"prompt": [', timeout=30,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and state.active == held


def test_the_body_parser_child_does_not_import_torch() -> None:
    """What the child imports to decode and validate a body (the parser and the request models)
    pulls in no torch: it started in ~1.5 s of CPU and ~230 MB of RSS per server when the protocol
    took its bounds from engine modules that import torch (mutation caught: `StructuredSpec`
    imported from engine/structured.py again)."""
    import subprocess
    import sys

    code = ("import sys, kvshare.server.body_parser, kvshare.server.protocol; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))[:3])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
