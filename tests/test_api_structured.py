"""Structured output (llguidance): JSON schemas, regex and choice constraints hold for every
generation; the mask under speculative verification gives the same greedy tokens as without; the
server's response_format / structured_outputs, and bad grammars refused with a 400 naming the field."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from kvshare.config import load_config
from kvshare.engine.sampling import SamplingParams
from kvshare.engine.structured_spec import StructuredSpec
from kvshare.errors import RequestError
from kvshare.llm import LLM
from kvshare.model.deepseek import Transformer
from kvshare.tokenizer import ByteTokenizer

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "kind", "tags", "addr"],
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "kind": {"enum": ["cat", "dog", "bird"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
                         "addr": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                                  "properties": {"city": {"type": "string", "maxLength": 8},
                                                 "zip": {"type": "integer", "minimum": 0, "maximum": 99999}}}}}


@pytest.fixture(scope="module")
def llm() -> LLM:
    """tiny-v41 with a 259-id vocabulary (bos 256, eos 257), random fp32 weights."""
    cfg = dataclasses.replace(load_config("tiny-v41"), vocab_size=259, eos_token_ids=(257,), bos_token_id=256)
    model = Transformer(cfg, quant=False).init_weights(4).eval()
    return LLM(model, tokenizer=ByteTokenizer(259), max_num_seqs=100, max_model_len=512, num_blocks=400)


def test_100_json_schema_generations_parse_and_validate(llm: LLM) -> None:
    p = SamplingParams(temperature=0, max_tokens=200, structured=StructuredSpec("json", SCHEMA))
    outs = llm.generate([f"Record {i}: " for i in range(100)], p, use_tqdm=False)
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)  # json.loads is strict: no raw control characters
    assert len({o.text for o in outs}) > 10


def test_regex_choice_and_json_object(llm: LLM) -> None:
    prompts = [f"item {i} " for i in range(20)]
    regex = r"[a-z]{2,6}-[0-9]{3}"
    for o in llm.generate(prompts, SamplingParams(temperature=1.0, seed=1, max_tokens=30,
                                                  structured=StructuredSpec("regex", regex)), use_tqdm=False):
        assert re.fullmatch(regex, o.text), o.text
    choices = ["yes", "no", "maybe so"]
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, seed=2, max_tokens=30,
                                                structured=StructuredSpec("choice", choices)), use_tqdm=False)
    assert all(o.text in choices for o in outs)
    outs = llm.generate(prompts[:5], SamplingParams(temperature=0, max_tokens=120,
                                                    structured=StructuredSpec("json_object")), use_tqdm=False)
    for o in outs:
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict)
    lark = 'start: "x" NUM\nNUM: /[0-9]{2}/'
    gbnf = 'root ::= "a" [0-9] [0-9]'
    for g, pat in ((lark, r"x[0-9]{2}"), (gbnf, r"a[0-9]{2}")):
        o = llm.generate(["g"], SamplingParams(temperature=0, max_tokens=10, structured=StructuredSpec("grammar", g)),
                         use_tqdm=False)[0]
        assert re.fullmatch(pat, o.text), o.text


def test_bad_grammars_are_request_errors(llm: LLM) -> None:
    for spec in (StructuredSpec("regex", "(a", "structured_outputs.regex"),
                 StructuredSpec("json", {"type": "nonsense"}, "response_format"),
                 StructuredSpec("grammar", "start: @@", "structured_outputs.grammar")):
        with pytest.raises(RequestError, match=re.escape(spec.field)):
            llm.engine.add_request("bad", [1, 2], SamplingParams(structured=spec))
    assert not llm.engine.has_unfinished_requests()


def test_structured_under_speculation_equals_plain() -> None:
    prompts = [[5, 9, 200, 3], [17] * 11, [40, 41]]
    specs = [StructuredSpec("regex", r"[a-f]{4}-[0-9]{4}"), StructuredSpec("json", SCHEMA),
             StructuredSpec("choice", ["alpha", "beta", "gamma"])]
    params = [SamplingParams(temperature=0, max_tokens=200, structured=s, logprobs=2) for s in specs]
    exact = dict(dtype="float32", quantize=False)  # fp32 rows: with the quantized cache plain and speculative greedy drift apart after ~160 tokens, structured or not
    plain = LLM("tiny-v41-dspark", **exact).generate(prompts, params, use_tqdm=False)
    want = {tuple(p): o.token_ids for p, o in zip(prompts, plain)}
    llm = LLM("tiny-v41-dspark", **exact, speculative_config={"method": "dspark", "num_speculative_tokens": 4})
    calls = {"n": 0}

    def oracle(seq, k):  # the plain continuation, every other proposal with a wrong last draft
        done = len(seq.output_token_ids)
        drafts = list(want[tuple(seq.prompt_token_ids)][done:done + k])
        calls["n"] += 1
        if calls["n"] % 2 == 0 and drafts:
            drafts[-1] = (drafts[-1] + 7) % 256
        return drafts + [ord("z")] * (k - len(drafts))

    llm.engine.speculator.draft_override = oracle
    spec = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(spec, plain):
        assert a.token_ids == b.token_ids and a.text == b.text and a.finish_reason == b.finish_reason == "stop"
    assert re.fullmatch(r"[a-f]{4}-[0-9]{4}", spec[0].text) and spec[2].text in ("alpha", "beta", "gamma")
    jsonschema.validate(json.loads(spec[1].text), SCHEMA)
    assert llm.engine.stats().extra["spec_accepted_tokens"] > 0
