"""Server hardening (issue 16): one poisoned request among 16 streams, body/JSON/time limits,
API key, JSON-only bodies, Host and CORS checks, stop_token_ids, the health watchdog, draining."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import httpx
import pytest

from kvshare.engine.engine import LLMEngine
from kvshare.engine.sampling import SamplingParams
from kvshare.server.app import create_app
from kvshare.server.background import BackgroundServer
from kvshare.server.limits import RequestLimits
from kvshare.server.security import AccessPolicy
from kvshare.tokenizer import load_tokenizer
from test_isolation import POISON, PoisonedModel, drain
from test_server_errors import _NeverEndingEngine

MODEL = "tiny-v41"
KEY = "s3cret-key"
N_STREAMS = 16
MAX_TOKENS = 12


def prompt_ids(i: int) -> list[int]:
    return [5 + i, 17, 99, 3, 40 + i, 41, 7][: 3 + i % 5]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    from kvshare.config import load_config
    from kvshare.model.deepseek import Transformer

    model = PoisonedModel(Transformer(load_config(MODEL), quant=False).init_weights(3).eval())
    return LLMEngine(model, tokenizer=load_tokenizer(MODEL), max_num_seqs=N_STREAMS + 2, max_model_len=64,
                     num_blocks=160, block_size=8)


@pytest.fixture(scope="module")
def reference(engine: LLMEngine) -> dict[int, list[int]]:
    """Greedy outputs of the clean prompts, run offline before the server owns the engine."""
    for i in range(N_STREAMS):
        engine.add_request(f"ref{i}", prompt_ids(i), SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                    ignore_eos=True))
    return {int(k[3:]): o.token_ids for k, o in drain(engine).items()}


LIMITS = RequestLimits(max_body_bytes=256 * 1024, max_json_depth=32, body_timeout_s=1.0, header_timeout_s=0.5)


@pytest.fixture(scope="module")
def server(engine: LLMEngine, reference: Any) -> Iterator[BackgroundServer]:
    app = create_app(engine, engine.tokenizer, MODEL, max_concurrent_requests=N_STREAMS + 4, max_model_len=64,
                     limits=LIMITS, access=AccessPolicy(api_key=KEY, allowed_hosts=["127.0.0.1", "localhost"],
                                                        cors_origins=["http://good.example"]))
    with BackgroundServer(app) as srv:
        yield srv


AUTH = {"Authorization": f"Bearer {KEY}"}


def post(server: BackgroundServer, body: Any, headers: dict[str, str] | None = None,
         path: str = "/v1/completions") -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    h = {"Content-Type": "application/json", **AUTH, **(headers or {})}
    return httpx.post(server.base_url + path, content=content, headers=h, timeout=60)


def metric(server: BackgroundServer, name: str) -> float:
    text = httpx.get(server.base_url + "/metrics", headers=AUTH).text
    line = next(l for l in text.splitlines() if l.startswith(name + " "))
    return float(line.split()[1])


async def _stream(client: httpx.AsyncClient, url: str, prompt: list[int]) -> tuple[list[int], str | None, str]:
    """One streaming completion: (token ids from the text, finish_reason, last data line before [DONE])."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True}
    text, finish, events = "", None, []
    async with client.stream("POST", url, json=body, headers=AUTH) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    for e in events[:-1]:
        obj = json.loads(e)
        if "choices" in obj and obj["choices"]:
            text += obj["choices"][0].get("text") or ""
            finish = obj["choices"][0].get("finish_reason") or finish
    return list(text.encode("utf-8", "surrogateescape")), finish, events[-2]


def test_one_poisoned_request_among_16_streams(server: BackgroundServer, reference: dict[int, list[int]]) -> None:
    url = server.base_url + "/v1/completions"
    tok = load_tokenizer(MODEL)

    async def run() -> list[Any]:
        async with httpx.AsyncClient(timeout=120) as client:
            tasks = [_stream(client, url, prompt_ids(i)) for i in range(N_STREAMS - 1)]
            tasks.insert(7, _stream(client, url, [9, 9, POISON, 9]))
            return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    poisoned = results.pop(7)
    assert '"error"' in poisoned[2] and "poison" in poisoned[2]
    for i, (_, finish, _) in enumerate(results):
        assert finish == "length", i
    expected = [tok.decode(reference[i]) for i in range(N_STREAMS - 1)]
    got = [bytes(t).decode("utf-8", "surrogateescape") for t, _, _ in results]
    assert got == expected
    assert metric(server, "kvshare_cache_blocks_used") == 0


def test_api_key_required_except_health(server: BackgroundServer) -> None:
    ok = {"model": MODEL, "prompt": [5, 6], "max_tokens": 1}
    assert post(server, ok, headers={"Authorization": "Bearer wrong"}).status_code == 401
    r = httpx.post(server.base_url + "/v1/completions", json=ok)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.base_url + "/v1/models").status_code == 401
    assert httpx.get(server.base_url + "/metrics").status_code == 401
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert post(server, ok).status_code == 200
    assert post(server, ok, headers={"Authorization": "", "X-API-Key": KEY}).status_code == 200


def test_only_json_bodies(server: BackgroundServer) -> None:
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1})
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        r = post(server, body, headers={"Content-Type": ctype})
        assert r.status_code == 415, (ctype, r.text)
    assert post(server, body, headers={"Content-Type": "application/json; charset=utf-8"}).status_code == 200


def test_host_and_cors(server: BackgroundServer) -> None:
    r = httpx.get(server.base_url + "/health", headers={"Host": "attacker.example"})
    assert r.status_code == 400  # DNS rebinding: a foreign Host name is refused
    pre = {"Origin": "http://good.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(server.base_url + "/v1/completions", headers=pre)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://good.example"
    r = httpx.options(server.base_url + "/v1/completions", headers={**pre, "Origin": "http://evil.example"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers


def test_body_size_limit(server: BackgroundServer) -> None:
    big = json.dumps({"model": MODEL, "prompt": "x" * (LIMITS.max_body_bytes + 10), "max_tokens": 1})
    r = post(server, big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit counts the bytes as they come
        yield b'{"model": "tiny-v41", "prompt": "'
        for _ in range(LIMITS.max_body_bytes // 1024 + 2):
            yield b"x" * 1024
        yield b'"}'

    r = httpx.post(server.base_url + "/v1/completions", content=chunks(),
                   headers={"Content-Type": "application/json", **AUTH}, timeout=30)
    assert r.status_code == 413


def _raw(server: BackgroundServer) -> socket.socket:
    s = socket.create_connection((server.host, server.port), timeout=10)
    return s


def test_slow_headers_are_cut_off(server: BackgroundServer) -> None:
    s = _raw(server)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finishes the head
    t0 = time.monotonic()
    assert s.recv(1024) == b""  # closed by the server
    waited = time.monotonic() - t0
    assert LIMITS.header_timeout_s * 0.8 < waited < LIMITS.header_timeout_s + 2, waited
    s.close()


def test_slow_body_is_408_and_disconnect_mid_body_is_not_a_failure(server: BackgroundServer) -> None:
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n").encode()
    s = _raw(server)
    s.sendall(head + b'{"model": ')
    reply = s.recv(4096)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:80]
    s.close()
    failed, gone = metric(server, "kvshare_requests_failed_total"), metric(server, "kvshare_http_client_disconnects_total")
    s = _raw(server)
    s.sendall(head + b'{"model": ')
    time.sleep(0.1)
    s.close()  # gone mid-body
    deadline = time.monotonic() + 5
    while metric(server, "kvshare_http_client_disconnects_total") == gone and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(server, "kvshare_http_client_disconnects_total") == gone + 1
    assert metric(server, "kvshare_requests_failed_total") == failed


def test_stop_token_ids_are_honoured(server: BackgroundServer, reference: dict[int, list[int]]) -> None:
    ref = reference[2]
    stop = ref[3]
    first = ref.index(stop)
    body = {"model": MODEL, "prompt": prompt_ids(2), "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stop_token_ids": [stop]}
    r = post(server, body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert r.json()["usage"]["completion_tokens"] == first + 1


def test_large_valid_body_is_parsed(server: BackgroundServer) -> None:
    """A body above the off-loop threshold (parsed on a worker thread) still works."""
    from kvshare.server.limits import OFF_LOOP_BYTES

    body = {"model": MODEL, "prompt": [5, 6], "max_tokens": 1, "user": "u" * (OFF_LOOP_BYTES + 100)}
    assert post(server, body).status_code == 200


class _StuckEngine(_NeverEndingEngine):
    """An engine whose step blocks until released (a hung kernel, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def step(self) -> list[Any]:
        self.release.wait(30)
        return []


def test_watchdog_fails_health_when_the_engine_is_stuck() -> None:
    engine = _StuckEngine()
    app = create_app(engine, load_tokenizer(MODEL), MODEL, max_model_len=64, watchdog_timeout_s=0.5)
    with BackgroundServer(app) as srv:
        assert httpx.get(srv.base_url + "/health").status_code == 200
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(httpx.post, srv.base_url + "/v1/completions",
                              json={"model": MODEL, "prompt": [5, 6], "max_tokens": 2}, timeout=30)
            deadline = time.monotonic() + 10
            while httpx.get(srv.base_url + "/health").status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.1)
            r = httpx.get(srv.base_url + "/health")
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stalled"
            # draining ends the stuck request with a final error even though the engine never returns
            state = app.state.kvshare
            state.event_loop.call_soon_threadsafe(state.begin_drain, 0.2)
            reply = fut.result(timeout=10)
            assert reply.status_code == 503 and reply.json()["error"]["code"] == "shutting_down"
            assert httpx.get(srv.base_url + "/health").status_code == 503
            engine.release.set()
