"""The OpenAI-compatible server, for real: uvicorn on 127.0.0.1, the official `openai` client.

One tiny-model engine serves the whole module. Greedy outputs over HTTP (whole replies, streams,
32 concurrent streams) must equal offline `LLM.generate` on the same engine.
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any, Iterator

import httpx
import openai
import pytest

from kvshare.cli.engine_args import max_model_len_of, tokenizer_of
from kvshare.engine.sampling import SamplingParams
from kvshare.server.app import create_app
from kvshare.server.background import BackgroundServer

MODEL = "tiny-v41"
MAX_TOKENS = 8
PROMPTS = [f"prompt {i}: " + "abcdefghij"[: i % 10] for i in range(32)]


@pytest.fixture(scope="module")
def llm() -> Any:
    from kvshare.llm import LLM

    return LLM(MODEL, seed=0, max_num_seqs=32, max_model_len=256)


CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def offline(llm: Any) -> dict[str, Any]:
    """Greedy offline outputs for PROMPTS (by prompt) and for CHAT (key "chat").

    Computed before the server takes the engine: only the engine loop may step it afterwards.
    """
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    refs = {o.prompt: o for o in outs}
    chat_ids = tokenizer_of(llm.engine, MODEL).apply_chat_template(CHAT)
    refs["chat"] = llm.generate([chat_ids], greedy, use_tqdm=False)[0]
    return refs


@pytest.fixture(scope="module")
def server(llm: Any, offline: dict[str, Any]) -> Iterator[BackgroundServer]:
    engine = llm.engine
    app = create_app(engine, tokenizer_of(engine, MODEL), MODEL, max_concurrent_requests=48,
                     max_model_len=max_model_len_of(engine))
    with BackgroundServer(app) as srv:
        yield srv


@pytest.fixture()
def client(server: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def metrics(server: BackgroundServer) -> dict[str, float]:
    text = httpx.get(server.base_url + "/metrics").text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(kvshare_\w+) (\S+)$", text, re.M)}


def wait_idle(server: BackgroundServer, timeout: float = 20.0) -> dict[str, float]:
    """Poll /metrics until no request runs or waits and no cache block is used."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if m["kvshare_requests_running"] == 0 and m["kvshare_requests_waiting"] == 0 \
                and m["kvshare_cache_blocks_used"] == 0 and m["kvshare_http_requests_active"] == 0:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"server did not go idle: {m}")
        time.sleep(0.05)


def test_health_and_models(server: BackgroundServer, client: openai.OpenAI) -> None:
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_matches_offline(client: openai.OpenAI, offline: dict[str, Any]) -> None:
    prompt = PROMPTS[3]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    ref = offline[prompt]
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_stream_matches_offline(client: openai.OpenAI, offline: dict[str, Any]) -> None:
    prompt = PROMPTS[5]
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == offline[prompt].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [offline[prompt].finish_reason]
    assert chunks[-1].usage.completion_tokens == len(offline[prompt].token_ids)


def test_chat_whole_and_streamed_match_offline(client: openai.OpenAI, offline: dict[str, Any]) -> None:
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    msg = r.choices[0].message
    assert r.object == "chat.completion" and msg.role == "assistant"
    ref = offline["chat"]
    assert msg.content == ref.text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.token_ids)

    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason


def test_32_concurrent_streams_match_offline(server: BackgroundServer, offline: dict[str, Any]) -> None:
    async def one(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, str | None]:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True)
        text, reason = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def main() -> list[tuple[str, str | None]]:
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(one(client, p) for p in PROMPTS))

    steps_before = metrics(server)["kvshare_engine_steps_total"]
    results = asyncio.run(main())
    for prompt, (text, reason) in zip(PROMPTS, results):
        assert text == offline[prompt].text, prompt
        assert reason == offline[prompt].finish_reason
    # batched: far fewer engine steps than 32 requests x MAX_TOKENS tokens
    assert metrics(server)["kvshare_engine_steps_total"] - steps_before < 32 * MAX_TOKENS / 2
    wait_idle(server)


def test_disconnected_stream_frees_blocks(server: BackgroundServer) -> None:
    wait_idle(server)
    aborted = metrics(server)["kvshare_requests_aborted_total"]
    body = {"model": MODEL, "prompt": "a long story: ", "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server.base_url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            got = [next(lines) for _ in range(3)]
            assert all(line.startswith("data: ") or not line for line in got)
            during = metrics(server)
            assert during["kvshare_cache_blocks_used"] > 0 and during["kvshare_requests_running"] == 1
        # leaving the block closes the connection mid-stream
    m = wait_idle(server)
    assert m["kvshare_requests_aborted_total"] == aborted + 1
    assert m["kvshare_cache_blocks_used"] == 0


def test_disconnected_whole_reply_request_is_aborted(server: BackgroundServer) -> None:
    import json
    import socket

    wait_idle(server)
    aborted = metrics(server)["kvshare_requests_aborted_total"]
    body = json.dumps({"model": MODEL, "prompt": "wait for it: ", "max_tokens": 200, "temperature": 0}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {server.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection((server.host, server.port)) as sock:
        sock.sendall(head + body)
        deadline = time.monotonic() + 20
        while metrics(server)["kvshare_requests_running"] < 1:  # in the engine, generating
            assert time.monotonic() < deadline
            time.sleep(0.01)
    # the client hung up before its whole reply was ready
    m = wait_idle(server)
    assert m["kvshare_requests_aborted_total"] == aborted + 1


def test_metrics_exposition(server: BackgroundServer, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt="count me", max_tokens=2, temperature=0)
    text = httpx.get(server.base_url + "/metrics").text
    for name in ("kvshare_requests_running", "kvshare_requests_waiting", "kvshare_cache_blocks_used",
                 "kvshare_cache_blocks_total", "kvshare_generated_tokens_total",
                 "kvshare_generation_tokens_per_second", "kvshare_prompt_tokens_per_second",
                 "kvshare_engine_prompt_tokens_total", "kvshare_cache_bytes_used", "kvshare_cache_bytes_total"):
        assert f"# TYPE {name} " in text and re.search(rf"^{name} \S+$", text, re.M), name
    m = metrics(server)
    assert m["kvshare_cache_blocks_total"] > 0 and m["kvshare_generated_tokens_total"] > 0


def test_kvshare_serve_command(tmp_path: Any) -> None:
    """`kvshare serve` as a user starts it: a subprocess on a loopback port."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "kvshare", "serve", "--model", MODEL, "--random-weights",
                             "--host", "127.0.0.1",
                             "--port", str(port), "--max-model-len", "128", "--max-num-seqs", "2",
                             "--max-concurrent-requests", "3", "--log-level", "warning"],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log.seek(0) or log.read()
            time.sleep(0.2)
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == [MODEL]
        assert client.models.list().data[0].max_model_len == 128
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=2, temperature=0)
        assert r.usage.completion_tokens == 2
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_logprobs_of_chosen_tokens(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=4, temperature=0, logprobs=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == r.usage.completion_tokens
    assert all(x <= 0 for x in lp.token_logprobs) and lp.text_offset[0] == 0

    messages = [{"role": "user", "content": "hi"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                           logprobs=True)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens and all(c.logprob <= 0 for c in content)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                                 logprobs=True, stream=True))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs
                for c in ch.choices[0].logprobs.content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content])
    assert [c.bytes for c in streamed] == [c.bytes for c in content]
