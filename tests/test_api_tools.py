"""DeepSeek-V4 tool calls (DSML) and thinking-mode reasoning: the parsers on scripted outputs, and
the server with a scripted sampler (the model's tokens replaced by a fixed text) through the
openai client, whole and streamed; tool_choice required / named enforced by a grammar."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterator

import httpx
import openai
import pytest
import torch

from kvshare.config import load_config
from kvshare.llm import LLM
from kvshare.model.deepseek import Transformer
from kvshare.server.app import create_app
from kvshare.server.background import BackgroundServer
from kvshare.server.reasoning import ReasoningSplitter, split_reasoning
from kvshare.server.tool_calls import (BLOCK_END, BLOCK_START, DSML, ToolCallStream, parse_tool_calls,
                                       render_tool_calls)
from kvshare.tokenizer import ByteTokenizer

MODEL = "scripted"
CALLS_TEXT = (f"Let me check.\n{BLOCK_START}\n"
              f'<{DSML}invoke name="get_weather">\n'
              f'<{DSML}parameter name="city" string="true">Paris "centre"</{DSML}parameter>\n'
              f'<{DSML}parameter name="days" string="false">3</{DSML}parameter>\n'
              f"</{DSML}invoke>\n"
              f'<{DSML}invoke name="get_time">\n'
              f'<{DSML}parameter name="zones" string="false">["UTC", "CET"]</{DSML}parameter>\n'
              f"</{DSML}invoke>\n{BLOCK_END}")
WANT = [("get_weather", {"city": 'Paris "centre"', "days": 3}), ("get_time", {"zones": ["UTC", "CET"]})]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "description": "the time", "parameters": {
             "type": "object", "properties": {"zones": {"type": "array", "items": {"type": "string"}}}}}}]


def calls_of(calls: list[Any]) -> list[tuple[str, Any]]:
    def get(c: Any, k: str) -> Any:
        return c[k] if isinstance(c, dict) else getattr(c, k)

    return [(get(get(c, "function"), "name"), json.loads(get(get(c, "function"), "arguments"))) for c in calls]


# ---- parsers ------------------------------------------------------------------------------------------


def test_parse_whole_and_streamed_char_by_char() -> None:
    content, calls = parse_tool_calls(CALLS_TEXT)
    assert content == "Let me check." and calls_of(calls) == WANT
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    s = ToolCallStream()
    got_content, deltas = "", []
    for ch in CALLS_TEXT:
        c, new = s.feed(ch)
        got_content += c
        deltas += new
    got_content += s.finish()
    assert got_content == "Let me check." and calls_of(deltas) == WANT and [d["index"] for d in deltas] == [0, 1]
    assert parse_tool_calls(render_tool_calls(calls)) [1] and calls_of(parse_tool_calls(render_tool_calls(calls))[1]) == WANT
    unfinished = "hi " + BLOCK_START + f'<{DSML}invoke name="x">'
    assert parse_tool_calls(unfinished) == (unfinished, [])
    s = ToolCallStream()
    assert "".join(s.feed(ch)[0] for ch in unfinished) + s.finish() == unfinished
    bad_json = f'{BLOCK_START}\n<{DSML}invoke name="f">\n<{DSML}parameter name="a" string="false">{{</{DSML}parameter>\n</{DSML}invoke>\n{BLOCK_END}'
    assert parse_tool_calls(bad_json) == (bad_json, [])


@pytest.mark.parametrize("text,want", [
    ("plan it</think>The answer.", ("plan it", "The answer.")),
    ("<think>plan</think>x", ("plan", "x")),
    ("never closed </thin", ("never closed </thin", "")),
    ("</think>", ("", "")),
])
def test_reasoning_split_whole_and_char_by_char(text: str, want: tuple[str, str]) -> None:
    assert split_reasoning(text) == want
    s = ReasoningSplitter()
    parts = [s.feed(ch) for ch in text] + [s.finish()]
    assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == want
    assert all("</think>" not in p[0] and not p[0].endswith("</") for p in parts[:-1]) or "</think>" not in text


# ---- server with a scripted model -----------------------------------------------------------------------

SCRIPT = {"text": CALLS_TEXT}


class ScriptedSampler:
    """Returns the bytes of SCRIPT["text"] one per step per row (by the row's output length), then eos."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def __call__(self, logits: torch.Tensor, params: list, ids: list[str], histories: list) -> Any:
        toks, lps = self.real(logits, params, ids, histories)
        script = SCRIPT["text"].encode()
        for i, (_, out) in enumerate(histories):
            toks[i] = script[len(out)] if len(out) < len(script) else 257
        return toks, lps


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    cfg = dataclasses.replace(load_config("tiny-v41"), vocab_size=259, eos_token_ids=(257,), bos_token_id=256)
    llm = LLM(Transformer(cfg, quant=False).init_weights(4).eval(), tokenizer=ByteTokenizer(259), max_model_len=2048,
              num_blocks=600)
    llm.engine.sampler = ScriptedSampler(llm.engine.sampler)
    with BackgroundServer(create_app(llm.engine, ByteTokenizer(259), MODEL, max_model_len=2048)) as srv:
        yield srv


@pytest.fixture()
def client(server: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


MSGS = [{"role": "user", "content": "weather?"}]


def test_tool_calls_whole_and_streamed(client: openai.OpenAI) -> None:
    SCRIPT["text"] = CALLS_TEXT
    r = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=600, temperature=0,
                                       extra_body={"return_token_ids": True})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Let me check."
    assert calls_of(c.message.tool_calls) == WANT
    prompt = bytes(t for t in r.model_extra["prompt_token_ids"] if t < 256).decode()
    assert "## Tools" in prompt and '"name": "get_weather"' in prompt and prompt.endswith("<|assistant|>\n")
    stream = list(client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=600,
                                                 temperature=0, stream=True))
    content = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    deltas = [tc for ch in stream if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert content == "Let me check." and calls_of(deltas) == WANT and [d.index for d in deltas] == [0, 1]
    assert stream[-1].choices[0].finish_reason == "tool_calls"
    r = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="none", max_tokens=600,
                                       temperature=0)
    assert r.choices[0].message.content == CALLS_TEXT and not r.choices[0].message.tool_calls
    # parallel_tool_calls false: the grammar allows one invoke (the scripted sampler bypasses the mask, so its
    # script must be one call; test_tool_grammar shows the grammar refusing a second)
    SCRIPT["text"] = CALLS_TEXT[:CALLS_TEXT.index(f'<{DSML}invoke name="get_time"')] + BLOCK_END
    r = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, parallel_tool_calls=False,
                                       max_tokens=600, temperature=0)
    assert calls_of(r.choices[0].message.tool_calls) == WANT[:1]


def test_thinking_reasoning_content(client: openai.OpenAI) -> None:
    SCRIPT["text"] = "First, the city.</think>" + CALLS_TEXT
    kw = dict(model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=700, temperature=0,
              extra_body={"chat_template_kwargs": {"thinking": True}, "return_token_ids": True})
    r = client.chat.completions.create(**kw)
    m = r.choices[0].message
    assert m.model_extra["reasoning_content"] == "First, the city." and calls_of(m.tool_calls) == WANT
    assert bytes(t for t in r.model_extra["prompt_token_ids"] if t < 256).decode().endswith("<|assistant|>\n<think>")
    stream = list(client.chat.completions.create(**{**kw, "stream": True}))
    reasoning = "".join((ch.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                        for ch in stream if ch.choices)
    assert reasoning == "First, the city."


def test_history_with_tool_calls_is_rendered(client: openai.OpenAI) -> None:
    SCRIPT["text"] = "It is sunny."
    history = [*MSGS, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=50, temperature=0,
                                       extra_body={"return_token_ids": True})
    assert r.choices[0].message.content == "It is sunny." and r.choices[0].finish_reason == "stop"
    prompt = bytes(t for t in r.model_extra["prompt_token_ids"] if t < 256).decode()
    assert f'<{DSML}parameter name="city" string="true">Paris</{DSML}parameter>' in prompt
    assert "<|tool|>\nsunny, 21 C\n" in prompt


def test_tool_choice_grammar_allows_only_a_call_block() -> None:
    pytest.importorskip("llguidance")
    from kvshare.engine.structured import StructuredOutputs
    from kvshare.engine.structured_spec import StructuredSpec
    from kvshare.errors import RequestError  # noqa: F401
    from kvshare.server.tool_grammar import tool_grammar

    block = CALLS_TEXT[CALLS_TEXT.index(BLOCK_START):]
    only_time = render_tool_calls([{"function": {"name": "get_time", "arguments": '{"zones": ["UTC"]}'}}])
    so = StructuredOutputs(ByteTokenizer(259), 259, frozenset({257}))
    cases = [(None, block, True), (None, "Let me check." + block, False), ("get_time", only_time, True),
             ("get_time", block, False)]
    for i, (name, text, ok) in enumerate(cases):
        so.add(str(i), StructuredSpec("grammar", tool_grammar(TOOLS, name), "tool_choice"))
        data = text.encode()
        try:
            done = [so.accept(str(i), b) for b in data]
        except RuntimeError:
            assert not ok, text
            continue
        assert ok and done[-1] and not any(done[:-1]), text


def test_tool_choice_required_and_named_over_http(client: openai.OpenAI) -> None:
    pytest.importorskip("llguidance")
    SCRIPT["text"] = CALLS_TEXT[CALLS_TEXT.index(BLOCK_START):]
    r = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="required",
                                       max_tokens=600, temperature=0)
    assert r.choices[0].finish_reason == "tool_calls" and calls_of(r.choices[0].message.tool_calls) == WANT
    SCRIPT["text"] = render_tool_calls([{"function": {"name": "get_time", "arguments": '{"zones": ["UTC"]}'}}])
    r = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=600, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert calls_of(r.choices[0].message.tool_calls) == [("get_time", {"zones": ["UTC"]})]


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "bogus": 1}}]}, "tools.0.function.bogus"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "chat_template_kwargs": {"thinking": True}}, "tool_choice"),
    ({"chat_template_kwargs": {"temperature": 1}}, "chat_template_kwargs.temperature"),
    ({"messages": [{"role": "user two", "content": "x"}]}, "messages.0.role"),
])
def test_tool_fields_refused(server: BackgroundServer, body: dict, param: str) -> None:
    r = httpx.post(server.base_url + "/v1/chat/completions", json={"model": MODEL, "messages": MSGS, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
