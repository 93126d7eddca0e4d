"""The OpenAI API as clients use it (issue 27): the official `openai` client against uvicorn on 127.0.0.1.

Two engines hold identical fp32 weights (tiny-v41, init seed 3): one serves, the other computes
offline references with `LLM.generate`; log-probabilities are checked against a hand log_softmax
of a dense forward (`test_api_logprobs.hand_logprobs`). Observed max |diff| of served logprobs:
2.9e-6 (tolerance 1e-5).
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterator

import httpx
import openai
import pytest

from kvshare.config import load_config
from kvshare.engine.sampling import SamplingParams
from kvshare.llm import LLM
from kvshare.model.deepseek import Transformer
from kvshare.server.app import create_app
from kvshare.server.background import BackgroundServer
from kvshare.tokenizer import load_tokenizer
from test_api_logprobs import hand_logprobs

MODEL = "tiny-v41"
ARGS = dict(max_num_seqs=16, max_model_len=256, block_size=16, num_blocks=160)
TOL = 1e-5
LONG = "The quick brown fox jumps over the lazy dog; " * 2  # 90 bytes: 5 full blocks of 16
TOK = load_tokenizer(MODEL)  # bytes 0-255, no special ids (vocab 256)


def make_model() -> Transformer:
    return Transformer(load_config(MODEL), quant=False).init_weights(3).eval()


@pytest.fixture(scope="module")
def ref_model() -> Transformer:
    return make_model()


@pytest.fixture(scope="module")
def ref() -> LLM:
    return LLM(make_model(), tokenizer=TOK, **ARGS)


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    llm = LLM(make_model(), tokenizer=TOK, **ARGS)
    app = create_app(llm.engine, TOK, MODEL, max_model_len=256)
    with BackgroundServer(app) as srv:
        yield srv


@pytest.fixture()
def client(server: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(server: BackgroundServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=120)


def metric(server: BackgroundServer, name: str) -> float:
    text = httpx.get(server.base_url + "/metrics").text
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def offline(ref: LLM, prompt: Any, **kw: Any) -> Any:
    return ref.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0]


# ---- n, batches ------------------------------------------------------------------------------------


def test_n4_seeded_choices_equal_offline_and_share_the_prompt(client: openai.OpenAI, server: BackgroundServer,
                                                             ref: LLM) -> None:
    hits = metric(server, "kvshare_engine_prefix_cache_hit_tokens_total")
    r = client.completions.create(model=MODEL, prompt=LONG, n=4, max_tokens=6, temperature=1.0, seed=11)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        assert c.text == offline(ref, LONG, temperature=1.0, seed=11 + c.index, max_tokens=6).text
    assert len({c.text for c in r.choices}) > 1  # distinct samples
    n_prompt = len(LONG)
    assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == 24
    # choices 1..3 adopt the first choice's cached blocks: floor((90 - 1) / 16) * 16 = 80 tokens each
    assert metric(server, "kvshare_engine_prefix_cache_hit_tokens_total") - hits >= 3 * 80


def test_batched_prompts_with_n(client: openai.OpenAI, ref: LLM) -> None:
    prompts = ["alpha beta", "gamma", "delta epsilon zeta"]
    r = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=5, temperature=0)
    assert sorted(c.index for c in r.choices) == list(range(6))
    for c in r.choices:
        assert c.text == offline(ref, prompts[c.index // 2], temperature=0, max_tokens=5).text
    ids = [[104, 105, 106], [120, 121]]
    r2 = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0)
    assert [c.text for c in r2.choices] == [offline(ref, p, temperature=0, max_tokens=3).text for p in ids]
    assert r2.usage.prompt_tokens == 5


def test_stream_n2_per_index_equals_whole(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt=["one", "two"], n=2, max_tokens=6, temperature=0.8, seed=5)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}
    assert reasons == {c.index: c.finish_reason for c in whole.choices}
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


# ---- log-probabilities ----------------------------------------------------------------------------


def test_completion_logprobs_5_against_hand(client: openai.OpenAI, ref_model: Transformer) -> None:
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=4, temperature=0, logprobs=5,
                                  extra_body={"return_token_ids": True})
    c = r.choices[0]
    lp = c.logprobs
    ids = c.model_extra["token_ids"]
    table = hand_logprobs(ref_model, [97, 98, 99] + ids)
    for j, t in enumerate(ids):
        row = table[2 + j]
        assert abs(lp.token_logprobs[j] - float(row[t])) < TOL
        top = lp.top_logprobs[j]
        assert len(top) in (5, 6) and top[lp.tokens[j]] == lp.token_logprobs[j]
        best = row.topk(5)
        assert max(abs(v - float(row[i])) for i, v in zip(best.indices.tolist(), best.values.tolist())) < TOL
        assert abs(max(top.values()) - float(best.values[0])) < TOL  # greedy: chosen is the best
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_logprobs_zero_gives_a_list_of_dicts(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=3, temperature=0, logprobs=0)
    lp = r.choices[0].logprobs
    assert isinstance(lp.top_logprobs, list) and len(lp.top_logprobs) == 3
    assert all(list(d.values()) == [v] for d, v in zip(lp.top_logprobs, lp.token_logprobs))


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_prompt_logprobs_as_lm_eval_asks(client: openai.OpenAI, ref_model: Transformer, max_tokens: int) -> None:
    """lm-eval's local-completions log-likelihood request: token ids, echo, logprobs 1, temperature 0."""
    prompt = list(b"Question: 2+2? Answer: 4")
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=1,
                                  echo=True)
    c = r.choices[0]
    lp = c.logprobs
    n = len(prompt)
    assert len(lp.tokens) == n + max_tokens and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert c.text.startswith("Question: 2+2? Answer: 4")
    table = hand_logprobs(ref_model, prompt)
    worst = max(abs(lp.token_logprobs[p] - float(table[p - 1, prompt[p]])) for p in range(1, n))
    assert worst < TOL, worst
    for p in range(1, n):
        top = lp.top_logprobs[p]
        assert abs(max(top.values()) - float(table[p - 1].max())) < TOL
    assert r.usage.completion_tokens == max_tokens


def test_chat_logprobs_and_top_logprobs(client: openai.OpenAI, ref_model: Transformer) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body={"return_token_ids": True})
    ids = r.choices[0].model_extra["token_ids"]
    prompt = TOK.apply_chat_template(msgs)
    table = hand_logprobs(ref_model, list(prompt) + ids)
    for j, e in enumerate(r.choices[0].logprobs.content):
        row = table[len(prompt) - 1 + j]
        assert abs(e.logprob - float(row[ids[j]])) < TOL and e.bytes == [ids[j]]
        assert len(e.top_logprobs) == 3
        assert max(abs(t.logprob - v) for t, v in zip(e.top_logprobs, row.topk(3).values.tolist())) < TOL


def test_prompt_logprobs_field(server: BackgroundServer, ref_model: Transformer) -> None:
    body = {"model": MODEL, "prompt": [64, 65, 66, 67], "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2}
    r = post(server, "/v1/completions", body).json()
    pl = r["choices"][0]["prompt_logprobs"]
    table = hand_logprobs(ref_model, [64, 65, 66, 67])
    assert pl[0] is None and len(pl) == 4
    for p in range(1, 4):
        assert abs(pl[p][str(body["prompt"][p])]["logprob"] - float(table[p - 1, body["prompt"][p]])) < TOL
        assert len(pl[p]) in (2, 3)


# ---- sampling breadth -----------------------------------------------------------------------------


def test_logit_bias_and_allowed_token_ids(client: openai.OpenAI, ref: LLM) -> None:
    r = client.completions.create(model=MODEL, prompt="xyz", max_tokens=5, temperature=0, logit_bias={"97": 100})
    assert r.choices[0].text == "aaaaa"
    base = offline(ref, "xyz", temperature=0, max_tokens=1).token_ids[0]
    r = client.completions.create(model=MODEL, prompt="xyz", max_tokens=1, temperature=0,
                                  logit_bias={str(base): -100}, extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"][0] != base
    r = client.completions.create(model=MODEL, prompt="xyz", max_tokens=8, temperature=1.0, seed=1,
                                  extra_body={"allowed_token_ids": [120, 121], "return_token_ids": True})
    assert set(r.choices[0].model_extra["token_ids"]) <= {120, 121}


def test_min_tokens_masks_stop_tokens(client: openai.OpenAI, ref: LLM) -> None:
    first = offline(ref, "xyz", temperature=0, max_tokens=1).token_ids[0]
    r = client.completions.create(model=MODEL, prompt="xyz", max_tokens=4, temperature=0,
                                  extra_body={"stop_token_ids": [first], "return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == [first] and r.choices[0].model_extra["stop_reason"] == first
    r = client.completions.create(model=MODEL, prompt="xyz", max_tokens=4, temperature=0,
                                  extra_body={"stop_token_ids": [first], "min_tokens": 3, "return_token_ids": True})
    assert first not in r.choices[0].model_extra["token_ids"][:3]


def test_stop_strings_many_include_and_reason(client: openai.OpenAI, ref: LLM) -> None:
    full = offline(ref, "hello", temperature=0, max_tokens=12).text
    stop = full[4:6]
    k = full.find(stop)
    stops = [f"never{i}" for i in range(20)] + [stop]
    r = client.completions.create(model=MODEL, prompt="hello", max_tokens=12, temperature=0, stop=stops)
    assert r.choices[0].text == full[:k] and r.choices[0].model_extra["stop_reason"] == stop
    r = client.completions.create(model=MODEL, prompt="hello", max_tokens=12, temperature=0, stop=stops,
                                  extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text == full[:k + len(stop)]
    chunks = list(client.completions.create(model=MODEL, prompt="hello", max_tokens=12, temperature=0, stop=stops,
                                            stream=True, extra_body={"include_stop_str_in_output": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full[:k + len(stop)]


def test_truncate_prompt_tokens_and_token_ids(client: openai.OpenAI, ref: LLM) -> None:
    r = client.completions.create(model=MODEL, prompt="0123456789", max_tokens=3, temperature=0, echo=True,
                                  extra_body={"truncate_prompt_tokens": 4, "return_token_ids": True})
    c = r.choices[0]
    assert r.usage.prompt_tokens == 4 and c.model_extra["prompt_token_ids"] == list(b"6789")
    assert c.text == "6789" + offline(ref, list(b"6789"), temperature=0, max_tokens=3).text


# ---- refusals ---------------------------------------------------------------------------------------

OK = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {**OK, "temperature": True}, "temperature"),
    ("/v1/completions", {**OK, "stream": "yes"}, "stream"),
    ("/v1/completions", {**OK, "frobnicate": 1, "stream": 1}, "stream"),  # unknown fields ignored, known ones typed
    ("/v1/completions", {**OK, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {**OK, "cache_salt": ""}, "cache_salt"),
    ("/v1/completions", {**OK, "suffix": "tail"}, "suffix"),
    ("/v1/completions", {**OK, "best_of": 3}, "best_of"),
    ("/v1/completions", {**OK, "logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {**OK, "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {**OK, "logit_bias": {"256": 1}}, "logit_bias"),
    ("/v1/completions", {**OK, "min_tokens": 3}, "min_tokens"),
    ("/v1/completions", {**OK, "allowed_token_ids": [10**6]}, "allowed_token_ids"),
    ("/v1/completions", {**OK, "stop": ["x"] * 300}, "stop"),
    ("/v1/completions", {**OK, "n": 300}, "n"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
])
def test_refused_fields_name_the_field(server: BackgroundServer, path: str, body: dict, param: str) -> None:
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


# ---- /tokenize, /detokenize --------------------------------------------------------------------------


def test_tokenize_detokenize(server: BackgroundServer) -> None:
    r = post(server, "/tokenize", {"model": MODEL, "prompt": "hé", "return_token_strs": True}).json()
    assert r == {"count": 3, "max_model_len": 256, "tokens": [104, 0xC3, 0xA9],
                 "token_strs": ["h", "bytes:\\xc3", "bytes:\\xa9"]}
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "x"}]}).json()
    assert chat["tokens"] == TOK.apply_chat_template([{"role": "user", "content": "x"}])
    assert post(server, "/detokenize", {"tokens": [104, 0xC3, 0xA9]}).json() == {"prompt": "hé"}
    bad = post(server, "/detokenize", {"tokens": [256]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert post(server, "/tokenize", {"prompt": "a", "messages": []}).status_code == 400


# ---- /metrics histograms -------------------------------------------------------------------------------


def test_metrics_histograms_count_requests(client: openai.OpenAI, server: BackgroundServer) -> None:
    names = ("kvshare_request_generation_tokens", "kvshare_time_to_first_token_seconds",
             "kvshare_inter_token_latency_seconds", "kvshare_e2e_request_latency_seconds",
             "kvshare_request_queue_time_seconds", "kvshare_request_prompt_tokens")
    before = {n: (metric(server, n + "_count"), metric(server, n + "_sum")) for n in names}
    for i in range(3):
        client.completions.create(model=MODEL, prompt="m" * (i + 1), max_tokens=4 + i, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = {n: (metric(server, n + "_count"), metric(server, n + "_sum")) for n in names}
    delta = {n: (after[n][0] - before[n][0], after[n][1] - before[n][1]) for n in names}
    assert delta["kvshare_request_generation_tokens"] == (3, 4 + 5 + 6)
    assert delta["kvshare_request_prompt_tokens"] == (3, 1 + 2 + 3)
    assert delta["kvshare_time_to_first_token_seconds"][0] == 3
    assert delta["kvshare_inter_token_latency_seconds"][0] == 3 + 4 + 5
    assert delta["kvshare_e2e_request_latency_seconds"][0] == 3
    assert delta["kvshare_request_queue_time_seconds"][0] == 3
    text = httpx.get(server.base_url + "/metrics").text
    buckets = [float(v) for v in re.findall(r'^kvshare_time_to_first_token_seconds_bucket\{le="[^"]+"\} (\S+)$',
                                            text, re.M)]
    assert buckets == sorted(buckets) and buckets[-1] == after["kvshare_time_to_first_token_seconds"][0]


# ---- structured output -----------------------------------------------------------------------------------

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "ok", "tags"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"},
                         "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["x", "y"]}}}}


def test_response_format_and_structured_outputs(client: openai.OpenAI, server: BackgroundServer) -> None:
    pytest.importorskip("llguidance")
    jsonschema = pytest.importorskip("jsonschema")
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "give json"}],
                                       max_tokens=80, temperature=0, n=2,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "t", "schema": SCHEMA}})
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    r = client.completions.create(model=MODEL, prompt="pick:", max_tokens=10, temperature=1.0, seed=3, n=4,
                                  extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert all(c.text in ("red", "green", "blue") for c in r.choices)
    stream = client.completions.create(model=MODEL, prompt="code:", max_tokens=12, temperature=0, stream=True,
                                       extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}})
    assert re.fullmatch("[A-Z]{3}-[0-9]{2}", "".join(c.choices[0].text for c in stream))
    for body, param in (({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex"),
                        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
                        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
                         "response_format.json_schema.schema"),
                        ({"response_format": {"type": "xml"}}, "response_format"),
                        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
                         "structured_outputs")):
        resp = post(server, "/v1/completions", {**OK, **body})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
