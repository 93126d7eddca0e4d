"""Prefix caching through the real server: multi-turn chat with the official `openai` client.

Two servers on the same tiny model, prefix caching on and off. Each turn resends the whole
conversation; with caching on, turn n+1 must report ``usage.prompt_tokens_details.cached_tokens``
covering the previous turns (at least every full block of turn n's prompt), the replies must equal
the caching-off server's, and /metrics must count the queried and hit prompt tokens.
"""

from __future__ import annotations

import re
from typing import Any, Iterator

import httpx
import openai
import pytest

from kvshare.cli.engine_args import max_model_len_of, tokenizer_of
from kvshare.server.app import create_app
from kvshare.server.background import BackgroundServer

MODEL = "kvshare-mini-v41"
BLOCK = 8
TURNS = ["hello there, how are you today?", "tell me more about that", "and then what happened next?"]


def _server(caching: bool) -> tuple[BackgroundServer, Any]:
    from kvshare.llm import LLM

    engine = LLM(MODEL, seed=0, max_num_seqs=4, max_model_len=512, block_size=BLOCK,
                 enable_prefix_caching=caching).engine
    app = create_app(engine, tokenizer_of(engine, MODEL), MODEL, max_model_len=max_model_len_of(engine))
    return BackgroundServer(app), engine


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[bool, tuple[BackgroundServer, Any]]]:
    out = {c: _server(c) for c in (True, False)}
    for srv, _ in out.values():
        srv.__enter__()
    yield out
    for srv, _ in out.values():
        srv.__exit__(None, None, None)


def _chat(srv: BackgroundServer) -> list[tuple[str, int, int]]:
    """(reply, prompt_tokens, cached_tokens) of each turn of one conversation."""
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    messages: list[dict[str, str]] = [{"role": "system", "content": "be brief"}]
    out = []
    for text in TURNS:
        messages.append({"role": "user", "content": text})
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
        reply = r.choices[0].message.content or ""
        out.append((reply, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens))
        messages.append({"role": "assistant", "content": reply})
    return out


def _metrics(srv: BackgroundServer) -> dict[str, float]:
    text = httpx.get(srv.base_url + "/metrics").text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(kvshare_\w+) (\S+)$", text, re.M)}


def test_multi_turn_chat_hits_and_matches_caching_off(servers) -> None:
    on, off = _chat(servers[True][0]), _chat(servers[False][0])
    assert [r for r, _, _ in on] == [r for r, _, _ in off]
    assert [p for _, p, _ in on] == [p for _, p, _ in off]
    assert on[0][2] == 0 and all(c == 0 for _, _, c in off)
    for n in range(1, len(TURNS)):
        prev_prompt = on[n - 1][1]
        assert on[n][2] >= prev_prompt // BLOCK * BLOCK, f"turn {n + 1}: {on[n][2]} cached of {on[n][1]}"
        assert on[n][2] < on[n][1]
    m = _metrics(servers[True][0])
    assert m["kvshare_engine_prefix_cache_queried_tokens_total"] == sum(p for _, p, _ in on)
    assert m["kvshare_engine_prefix_cache_hit_tokens_total"] == sum(c for _, _, c in on)
    assert servers[True][1].stats().num_blocks_used == 0  # every reference returned


def test_cache_salt_over_http_isolates_prefixes(servers) -> None:
    """vLLM's `cache_salt` request field: the same prompt hits only under the same salt."""
    srv = servers[True][0]
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    prompt = "salted prompt that is long enough to fill several blocks of eight tokens each"

    def cached(salt: str | None) -> int:
        extra = {} if salt is None else {"cache_salt": salt}
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("alice") == 0
    assert cached("bob") == 0  # another tenant never reuses alice's blocks
    assert cached("alice") > 0 and cached("bob") > 0
    assert cached(None) == 0  # unsalted requests share only with unsalted ones
