"""Bad input and failures get OpenAI error bodies with the right status; the server keeps serving."""

from __future__ import annotations

import json
import time
from typing import Any, Iterator

import httpx
import openai
import pytest

from kvshare.cli.engine_args import tokenizer_of
from kvshare.server.app import create_app
from kvshare.server.background import BackgroundServer
from kvshare.tokenizer import load_tokenizer

MODEL = "tiny-v41"
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def engine() -> Any:
    from kvshare.engine.engine import LLMEngine

    return LLMEngine(MODEL, tokenizer=load_tokenizer(MODEL), seed=0, max_num_seqs=8, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def server(engine: Any) -> Iterator[BackgroundServer]:
    app = create_app(engine, tokenizer_of(engine, MODEL), MODEL, max_concurrent_requests=4,
                     max_model_len=MAX_MODEL_LEN)
    with BackgroundServer(app) as srv:
        yield srv


def post(server: BackgroundServer, path: str, body: Any) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.base_url + path, content=content, headers={"Content-Type": "application/json"},
                      timeout=30)


def assert_error(resp: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == ("rate_limit_error" if status == 429 else
                           "internal_error" if status >= 500 else "invalid_request_error")
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code


def still_serving(server: BackgroundServer) -> None:
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "ok ", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


OK = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
CASES = [
    ("malformed json", "/v1/completions", '{"model": "tiny-v41", "prompt": ', 400, None, "invalid_json"),
    ("not an object", "/v1/completions", "[1, 2]", 400, None, "invalid_json"),
    ("unknown model", "/v1/completions", {**OK, "model": "gpt-9"}, 404, "model", "model_not_found"),
    ("missing prompt", "/v1/completions", {"model": MODEL}, 400, "prompt", "missing_parameter"),
    ("negative temperature", "/v1/completions", {**OK, "temperature": -0.5}, 400, "temperature", None),
    ("top_p zero", "/v1/completions", {**OK, "top_p": 0}, 400, "top_p", None),
    ("top_p above one", "/v1/completions", {**OK, "top_p": 1.5}, 400, "top_p", None),
    ("max_tokens negative", "/v1/completions", {**OK, "max_tokens": -1}, 400, "max_tokens", None),
    ("n zero", "/v1/completions", {**OK, "n": 0}, 400, "n", None),
    ("logprobs past 20", "/v1/completions", {**OK, "logprobs": 21}, 400, "logprobs", None),
    ("chat top_logprobs without logprobs", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs", None),
    ("top_k below -1", "/v1/completions", {**OK, "top_k": -3}, 400, "top_k", None),
    ("wrong type", "/v1/completions", {**OK, "max_tokens": "many"}, 400, "max_tokens", None),
    ("token id out of vocab", "/v1/completions", {**OK, "prompt": [1, 2, 99999]}, 400, "prompt", None),
    ("too-long prompt", "/v1/completions", {**OK, "prompt": "x" * (MAX_MODEL_LEN + 10)}, 400, "prompt",
     "context_length_exceeded"),
    ("prompt + max_tokens too long", "/v1/completions", {**OK, "prompt": "x" * 100, "max_tokens": 100}, 400,
     "max_tokens", "context_length_exceeded"),
    ("chat without messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages", None),
    # custom roles are accepted (issue 35); a role the template could not write as it is is not
    ("chat bad role", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "a\nb", "content": "x"}]},
     400, None, None),
    ("chat unknown model", "/v1/chat/completions",
     {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model", "model_not_found"),
    ("chat negative temperature", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": -1}, 400, "temperature", None),
    # issue 16: values that used to reach the engine and fail every request in flight, or give a 500
    ("greedy top_k 2^63", "/v1/completions", {**OK, "temperature": 0, "top_k": 2**63}, 400, "top_k", None),
    ("seed 2^64", "/v1/completions", {**OK, "temperature": 1, "seed": 2**64}, 400, "seed", None),
    ("seed below int64", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "seed": -(2**63) - 1}, 400, "seed", None),
    ("lone surrogate prompt", "/v1/completions", {**OK, "prompt": "ab\ud800cd"}, 400, "prompt", "invalid_value"),
    ("lone surrogate chat", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "\udfff"}]}, 400, "messages.0.content", None),
    ("JSON nested 1000 deep", "/v1/completions",
     '{"model": "tiny-v41", "prompt": "x", "extra": ' + "[" * 1000 + "]" * 1000 + "}", 400, None, "invalid_json"),
    ("JSON nested 40 deep", "/v1/completions",
     '{"model": "tiny-v41", "prompt": "x", "extra": ' + "[" * 40 + "]" * 40 + "}", 400, None, "invalid_json"),
    ("negative stop token id", "/v1/completions", {**OK, "stop_token_ids": [-1]}, 400, "stop_token_ids", None),
    ("stop token id past vocab", "/v1/completions", {**OK, "stop_token_ids": [10**6]}, 400, "stop_token_ids", None),
]


@pytest.mark.parametrize("name,path,body,status,param,code", CASES, ids=[c[0] for c in CASES])
def test_bad_input(server: BackgroundServer, name: str, path: str, body: Any, status: int, param: str | None,
                   code: str | None) -> None:
    assert_error(post(server, path, body), status, param, code)


def test_bad_inputs_leave_server_serving(server: BackgroundServer) -> None:
    for _, path, body, *_ in CASES:
        post(server, path, body)
    still_serving(server)


def test_unknown_route_is_openai_404(server: BackgroundServer) -> None:
    assert_error(httpx.get(server.base_url + "/v1/nothing"), 404)


def test_openai_client_sees_typed_errors(server: BackgroundServer) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, top_p=2.0)
    assert e.value.body["param"] == "top_p"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])


def test_too_many_concurrent_requests_is_429(server: BackgroundServer) -> None:
    body = {"model": MODEL, "prompt": "s", "max_tokens": 100, "stream": True, "temperature": 0}
    with httpx.Client(timeout=30) as http:
        streams = [http.stream("POST", server.base_url + "/v1/completions", json=body) for _ in range(4)]
        responses = [s.__enter__() for s in streams]
        try:
            assert all(r.status_code == 200 for r in responses)
            r429 = post(server, "/v1/completions", OK)
            assert_error(r429, 429, None, "rate_limit_exceeded")
            assert r429.headers["Retry-After"] == "1"
        finally:
            for s in streams:
                s.__exit__(None, None, None)
    deadline = time.monotonic() + 20
    while True:  # the aborted streams release their slots
        r = post(server, "/v1/completions", {**OK, "temperature": 0})
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert r.status_code == 200, r.text


def test_internal_error_in_add_is_500_for_that_request(server: BackgroundServer, engine: Any,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    real_add = engine.add_request

    def add(request_id: str, prompt: Any, params: Any, cache_salt: str | None = None) -> None:
        if prompt == "boom":
            raise RuntimeError("injected failure")
        real_add(request_id, prompt, params, cache_salt=cache_salt)

    monkeypatch.setattr(engine, "add_request", add)
    assert_error(post(server, "/v1/completions", {**OK, "prompt": "boom"}), 500, None, "internal_error")
    still_serving(server)


def test_internal_error_in_step_fails_requests_in_flight_only(server: BackgroundServer, engine: Any,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    real_step = engine.step
    calls = {"n": 0}

    def step() -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected step failure")
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    assert_error(post(server, "/v1/completions", {**OK, "max_tokens": 4}), 500, None, "internal_error")
    with httpx.Client(timeout=30) as http:  # a stream that fails reports the error in-stream
        calls["n"] = 0
        r = http.post(server.base_url + "/v1/completions", json={**OK, "stream": True})
        assert r.status_code == 200
        events = [line for line in r.text.splitlines() if line.startswith("data: ")]
        assert '"error"' in events[-2] and events[-1] == "data: [DONE]"
    still_serving(server)
    m = httpx.get(server.base_url + "/metrics").text
    assert "kvshare_cache_blocks_used 0" in m


class _NeverEndingEngine:
    """A stand-in engine whose one request never finishes (only the loop's own logic is under test)."""

    def __init__(self) -> None:
        self.live: set[str] = set()

    def add_request(self, request_id: str, prompt: Any, params: Any, cache_salt: str | None = None) -> None:
        self.live.add(request_id)

    def abort_request(self, request_id: str) -> None:
        self.live.discard(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def step(self) -> list[Any]:
        time.sleep(0.01)
        return []

    def stats(self) -> dict[str, int]:
        return {"num_running": len(self.live), "num_blocks_used": len(self.live), "num_blocks_total": 4}


def test_engine_loop_stop_fails_requests_in_flight() -> None:
    import asyncio

    from kvshare.server.engine_loop import EngineLoop

    engine = _NeverEndingEngine()
    loop = EngineLoop(engine)

    async def main() -> BaseException:
        loop.start()
        queue = await loop.add("r1", "x", None)
        assert engine.live == {"r1"}
        await asyncio.get_running_loop().run_in_executor(None, loop.stop)
        return await asyncio.wait_for(queue.get(), timeout=5)

    item = asyncio.run(main())
    assert isinstance(item, RuntimeError) and "shutting down" in str(item)
    assert engine.live == set()  # aborted, so its blocks would be freed
    assert "kvshare_cache_blocks_used 0" in loop.metrics.render()
