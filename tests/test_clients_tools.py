"""Tool calls and structured output through real clients against the shipped default model
(issue 35): every sample's arguments validate against the tool's schema, for a named, a required and
an auto tool_choice, greedy and at temperature 1 (10 samples), whole and streamed.

Greedy sampling is deterministic, so its "10 samples" are one request (n = 10 would repeat it).
langchain-openai and instructor are used where installed (`pytest.importorskip`: instructor pins
jiter < 0.15, which moves pip to an older openai, so neither is in the `test` extra).
"""

from __future__ import annotations

import json
from typing import Any, Iterator, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from kvshare.engine.json_schema import closed
from kvshare.llm import LLM
from kvshare.server.app import create_app
from kvshare.server.background import BackgroundServer

pytest.importorskip("llguidance")

MODEL = "kvshare-mini-v41"
WEATHER = {"type": "object", "required": ["city", "unit", "days", "where"], "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "where": {"type": "object", "required": ["zip", "country"], "properties": {
        "zip": {"type": "string", "maxLength": 6}, "country": {"type": "string", "enum": ["FR", "DE", "IT"]}}}}}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": closed(WEATHER), "get_time": closed(TIME)}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    llm = LLM(max_model_len=2048)  # the shipped default model
    with BackgroundServer(create_app(llm.engine, llm.tokenizer, MODEL, max_model_len=2048)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=600)


def check(calls: list[Any], only: str | None = None) -> int:
    """Validate every call's arguments against its tool's schema; the number of calls."""
    for c in calls:
        name = c.function.name if hasattr(c, "function") else c["function"]["name"]
        args = c.function.arguments if hasattr(c, "function") else c["function"]["arguments"]
        assert only is None or name == only
        jsonschema.validate(json.loads(args), SCHEMAS[name])
    return len(calls)


@pytest.mark.parametrize("choice", ["named", "required", "auto"])
def test_every_sample_follows_the_schema(client: openai.OpenAI, choice: str) -> None:
    tool_choice = {"named": {"type": "function", "function": {"name": "get_weather"}}, "required": "required",
                   "auto": "auto"}[choice]
    only = "get_weather" if choice == "named" else None
    for n, temperature in ((1, 0.0), (10, 1.0)):
        # a required choice may call tools again and again (a random-weight model keeps choosing another
        # invoke); the 10 samples ask for one call each so that none runs into max_tokens
        one = {"parallel_tool_calls": False} if choice == "required" and n > 1 else {}
        r = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice=tool_choice,
                                           n=n, temperature=temperature, seed=1, max_tokens=1000, **one)
        assert len(r.choices) == n
        for c in r.choices:
            calls = c.message.tool_calls or []
            if choice != "auto":
                assert c.finish_reason == "tool_calls" and check(calls, only) >= 1, c
                assert c.message.content is None
            else:
                check(calls)
                assert (c.finish_reason == "tool_calls") == bool(calls)


def test_streamed_calls_follow_the_schema(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="required",
                                            n=3, temperature=1.0, seed=2, max_tokens=1000, stream=True,
                                            parallel_tool_calls=False)
    calls: dict[int, list] = {}
    finish: dict[int, str] = {}
    for ch in stream:
        for c in ch.choices:
            calls.setdefault(c.index, []).extend(c.delta.tool_calls or [])
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert finish == {0: "tool_calls", 1: "tool_calls", 2: "tool_calls"}
    assert all(check(cs) == 1 for cs in calls.values())  # parallel_tool_calls false: one call each


class City(BaseModel):
    name: str = Field(max_length=12)  # bounded, so a random-weight model's sample ends
    country: Literal["FR", "DE", "IT"]
    population: int = Field(ge=0, le=10_000_000)


def test_openai_parse(client: openai.OpenAI) -> None:
    for seed in range(3):
        r = client.chat.completions.parse(model=MODEL, messages=MSGS, response_format=City, temperature=1.0,
                                          seed=seed, max_tokens=800)
        assert isinstance(r.choices[0].message.parsed, City)


def test_langchain_openai(server: BackgroundServer) -> None:
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(model=MODEL, base_url=server.base_url + "/v1", api_key="unused", temperature=1.0,
                        max_tokens=1000, max_retries=0, seed=3)
    msg = llm.bind_tools(TOOLS, tool_choice="get_weather").invoke("weather in Paris?")
    assert msg.tool_calls and all(jsonschema.validate(c["args"], SCHEMAS[c["name"]]) is None for c in msg.tool_calls)
    for method in ("function_calling", "json_schema"):
        assert isinstance(llm.with_structured_output(City, method=method).invoke("a city"), City), method
    out = llm.with_structured_output({"title": "any", "type": "object"}, method="json_mode").invoke("a JSON object")
    assert isinstance(out, dict)


def test_instructor_modes(server: BackgroundServer) -> None:
    instructor = pytest.importorskip("instructor")
    raw = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        client = instructor.from_openai(raw, mode=mode)
        city = client.chat.completions.create(model=MODEL, response_model=City, max_retries=0, temperature=1.0,
                                              seed=4, max_tokens=800, messages=[{"role": "user", "content": "a city"}])
        assert isinstance(city, City), mode

    class Loose(BaseModel):  # JSON mode sends no schema to the server: any JSON object must do
        pass

    client = instructor.from_openai(raw, mode=instructor.Mode.JSON)
    assert isinstance(client.chat.completions.create(model=MODEL, response_model=Loose, max_retries=0, max_tokens=800,
                                                     messages=[{"role": "user", "content": "x"}]), Loose)
