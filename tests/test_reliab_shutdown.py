"""Shutdown edges (issue 28, item 5): with the engine stuck in a step, every request — in the engine,
or still waiting for the engine thread to take it in, streaming or not — ends with a JSON 503;
the listener keeps answering /health (503 "shutting_down") until the drain is over; an engine
that stopped for good (engine_fatal) stops the server."""

from __future__ import annotations

import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from kvshare.server.app import create_app
from kvshare.server.background import BackgroundServer
from kvshare.server.serving import DrainingServer, uvicorn_config
from kvshare.tokenizer import load_tokenizer
from test_server_hardening import _StuckEngine

MODEL = "tiny-v41"
BODY = {"model": MODEL, "prompt": [5, 6], "max_tokens": 2}


def _post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=20)


def _wait(pred: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_stuck_engine_every_request_ends_with_json_503() -> None:
    """Before issue 28 the requests that arrived after the stall waited for the engine thread to
    take them in, past the drain, and got uvicorn's text/plain 500 (here: no reply in 20 s)."""
    engine = _StuckEngine()
    app = create_app(engine, load_tokenizer(MODEL), MODEL, max_model_len=64)
    state = app.state.kvshare
    with BackgroundServer(app) as srv, ThreadPoolExecutor(3) as pool:
        first = pool.submit(_post, srv.base_url, BODY)  # taken in; the engine then sticks in its step
        _wait(lambda: state.queues)
        later = [pool.submit(_post, srv.base_url, {**BODY, "stream": stream}) for stream in (False, True)]
        _wait(lambda: len(state.adding) == 2)  # waiting for the stuck engine thread
        state.event_loop.call_soon_threadsafe(state.begin_drain, 0.3)
        for fut in [first, *later]:
            r = fut.result(timeout=20)
            assert r.status_code == 503, r.text
            assert r.headers["content-type"] == "application/json"
            assert r.json()["error"]["code"] == "shutting_down"
        assert state.active == 0 and not state.adding
        engine.release.set()


def test_listener_answers_health_503_until_the_drain_is_over() -> None:
    """Observed: /health answered 503 for the whole 1 s drain (~40 polls), then the listener closed.
    Mutation: `handle_exit` closing the listener at once (uvicorn's own) -> refused connections."""
    engine = _StuckEngine()
    app = create_app(engine, load_tokenizer(MODEL), MODEL, max_model_len=64)
    state = app.state.kvshare
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = DrainingServer(uvicorn_config(app, log_level="warning", shutdown_timeout_s=1.0),
                            on_drain=lambda: state.event_loop.call_soon_threadsafe(state.begin_drain, 1.0),
                            drained=lambda: state.active == 0, drain_timeout_s=1.0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    _wait(lambda: server.started)
    with ThreadPoolExecutor(1) as pool:
        stuck = pool.submit(_post, url, BODY)
        _wait(lambda: state.queues)
        t0 = time.monotonic()
        server.handle_exit(signal.SIGTERM, None)
        answers: list[tuple[float, int]] = []
        while True:
            try:
                r = httpx.get(url + "/health", timeout=2)
            except httpx.TransportError:
                break
            assert r.json()["error"]["code"] == "shutting_down"
            answers.append((time.monotonic() - t0, r.status_code))
            time.sleep(0.02)
        closed_at = time.monotonic() - t0
        assert stuck.result(timeout=10).status_code == 503
    thread.join(10)
    engine.release.set()
    assert not thread.is_alive()
    assert answers and {code for _, code in answers} == {503}
    assert answers[-1][0] >= 0.9, answers[-1]  # answered through the drain limit of 1 s
    assert closed_at < 4.0, closed_at


class _FatalEngine(_StuckEngine):
    """An engine whose step raises an engine_fatal error once (a lost tensor-parallel worker)."""

    def step(self) -> list[Any]:
        err = RuntimeError("tensor-parallel worker failure: rank 1 made no progress")
        err.engine_fatal = True  # type: ignore[attr-defined]
        raise err


def test_engine_fatal_error_stops_the_loop_and_fails_requests() -> None:
    engine = _FatalEngine()
    app = create_app(engine, load_tokenizer(MODEL), MODEL, max_model_len=64)
    state = app.state.kvshare
    with BackgroundServer(app) as srv:
        r = _post(srv.base_url, BODY)
        assert r.status_code == 500 and "rank 1 made no progress" in r.json()["error"]["message"]
        _wait(lambda: not state.loop.alive)
        assert getattr(state.loop.error, "engine_fatal", False)
        h = httpx.get(srv.base_url + "/health", timeout=5)
        assert h.status_code == 503 and h.json()["error"]["code"] == "engine_dead"
