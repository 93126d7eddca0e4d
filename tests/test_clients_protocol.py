"""Request shapes that real clients send and kvshare used to refuse (issue 35): each is now a 200 with
the field used or ignored, never a 400 for a well-typed request, while known fields stay typed."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterator

import httpx
import openai
import pytest

from kvshare.config import load_config
from kvshare.engine.param_ranges import MAX_LOGPROBS
from kvshare.llm import LLM
from kvshare.model.deepseek import Transformer
from kvshare.server.app import create_app
from kvshare.server.background import BackgroundServer
from kvshare.tokenizer import ByteTokenizer

MODEL = "tiny"
MSGS = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    cfg = dataclasses.replace(load_config("tiny-v41"), vocab_size=259, eos_token_ids=(257,), bos_token_id=256)
    llm = LLM(Transformer(cfg, quant=False).init_weights(5).eval(), tokenizer=ByteTokenizer(259), max_model_len=1024)
    with BackgroundServer(create_app(llm.engine, ByteTokenizer(259), MODEL, max_model_len=1024)) as srv:
        yield srv


def chat(server: BackgroundServer, **body: Any) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/chat/completions", timeout=120,
                      json={"model": MODEL, "messages": MSGS, "max_tokens": 4, "temperature": 0, **body})


def prompt_of(r: httpx.Response) -> str:
    return bytes(t for t in r.json()["prompt_token_ids"] if t < 256).decode()


def test_name_and_custom_roles(server: BackgroundServer) -> None:
    msgs = [{"role": "system", "content": "s", "name": "sys"}, {"role": "critic", "content": "c"},
            {"role": "user", "content": "u", "name": "bob"}]
    r = chat(server, messages=msgs, return_token_ids=True)
    assert r.status_code == 200, r.text
    assert prompt_of(r) == "<|system|>\ns\n<|critic|>\nc\n<|user|>\nu\n<|assistant|>\n"  # no place for a name
    assert chat(server, messages=[{"role": "a b", "content": "x"}]).status_code == 400  # not writable as it is


def test_unknown_fields_ignored_and_named(server: BackgroundServer) -> None:
    body = {"truncation_side": "left", "echo": True, "messages": [{"role": "user", "content": "x", "weight": 1}],
            "stream": True, "stream_options": {"include_usage": True, "future": 1}}
    r = chat(server, **body)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
    assert r.headers["x-ignored-fields"] == "truncation_side, echo, messages.0.weight, stream_options.future"
    r = httpx.post(server.base_url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                              "priority": 3})
    assert r.status_code == 200 and r.headers["x-ignored-fields"] == "priority"
    assert "x-ignored-fields" not in chat(server).headers
    r = chat(server, frobnicate=1, temperature="hot")  # a known field keeps its type
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text


def test_models_by_id_and_responses_route(server: BackgroundServer) -> None:
    r = httpx.get(server.base_url + f"/v1/models/{MODEL}")
    assert r.status_code == 200 and r.json()["id"] == MODEL and r.json()["object"] == "model"
    assert httpx.get(server.base_url + "/v1/models/other").status_code == 404
    r = httpx.post(server.base_url + "/v1/responses", json={"model": MODEL, "input": "hi"})
    assert r.status_code == 404 and "/v1/chat/completions" in r.json()["error"]["message"]


def test_string_booleans_and_all_top_logprobs(server: BackgroundServer) -> None:
    r = chat(server, logprobs="true", top_logprobs=-1, stream="false")
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(len(e["top_logprobs"]) == MAX_LOGPROBS for e in content)
    for e in content:  # the chosen token's logprob is the one its own top entry shows
        assert e["logprob"] == next(t["logprob"] for t in e["top_logprobs"] if t["token"] == e["token"])
    assert chat(server, stream="yes").status_code == 400
    r = httpx.post(server.base_url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                              "logprobs": -1, "echo": "True"})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"][1] == "x" and all(len(t) >= MAX_LOGPROBS for t in lp["top_logprobs"][1:])  # bos, x, ...


def test_stop_token_ids_keep_the_token_text(server: BackgroundServer) -> None:
    free = chat(server, max_tokens=6, return_token_ids=True).json()["choices"][0]
    ids = free["token_ids"]
    stop = next(t for t in ids if 32 <= t < 127)  # a printable byte the model writes
    k = ids.index(stop)
    r = chat(server, max_tokens=6, stop_token_ids=[stop]).json()["choices"][0]
    assert r["stop_reason"] == stop and r["message"]["content"] == bytes(ids[:k + 1]).decode()  # vLLM keeps it


def test_continuous_usage_stats_as_vllm(server: BackgroundServer) -> None:
    def chunks(**so: Any) -> list[dict]:
        r = chat(server, stream=True, stream_options=so)
        return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]

    both = chunks(include_usage=True, continuous_usage_stats=True)
    assert all("usage" in c for c in both)  # the role chunk too
    assert both[0]["usage"]["completion_tokens"] == 0 and both[-1]["choices"] == []
    assert all("usage" not in c for c in chunks(include_usage=False, continuous_usage_stats=True))
    usage_only = chunks(include_usage=True)
    assert [("usage" in c) for c in usage_only] == [False] * (len(usage_only) - 1) + [True]


def test_openai_sdk_sends_name(server: BackgroundServer) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x", "name": "retry"}],
                                       max_tokens=2)
    assert r.choices[0].finish_reason == "length"
    assert client.models.retrieve(MODEL).id == MODEL


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]},
     "tools.0.function.parameters.type"),
    ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools.0.function.name"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": 'f"><x', "arguments": "{}"}}]}]},
     "messages.0.tool_calls.0.function.name"),
])
def test_bad_tools_are_one_line_400s(server: BackgroundServer, body: dict, param: str) -> None:
    r = chat(server, **body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert "\n" not in r.json()["error"]["message"]
