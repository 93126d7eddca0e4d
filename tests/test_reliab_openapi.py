"""The served OpenAPI document (issue 28, item 7): request bodies are the protocol models, every
reply is documented (4xx / 5xx as OpenAI error bodies, /metrics as text), 405s carry `Allow`,
HEAD /health works; schemathesis fuzzes the real bodies against it: no 5xx, and every status
and content type it gets is documented.

The short run here (KVSHARE_FUZZ_EXAMPLES per operation, default 25, no coverage phase) takes
~30 s; the long run is the same test with KVSHARE_FUZZ_EXAMPLES=1000 KVSHARE_FUZZ_COVERAGE=1."""

from __future__ import annotations

import os
from typing import Iterator

import httpx
import pytest

from kvshare.server.app import create_app
from kvshare.server.background import BackgroundServer
from kvshare.tokenizer import load_tokenizer

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import content_type_conformance, not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import status_code_conformance  # noqa: E402

MODEL = "tiny-v41"
EXAMPLES = int(os.environ.get("KVSHARE_FUZZ_EXAMPLES", "25"))


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    from kvshare.engine.engine import LLMEngine

    engine = LLMEngine(MODEL, tokenizer=load_tokenizer(MODEL), seed=0, max_num_seqs=8, max_model_len=16)
    app = create_app(engine, engine.tokenizer, MODEL, max_concurrent_requests=16, max_model_len=16)
    with BackgroundServer(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def api_schema(server: BackgroundServer) -> object:
    loaded = schemathesis.openapi.from_url(server.base_url + "/openapi.json")
    # the coverage phase's hundreds of boundary cases per operation are for the long run only
    loaded.config.phases.coverage.enabled = bool(os.environ.get("KVSHARE_FUZZ_COVERAGE"))
    return loaded


def test_document_has_request_bodies_and_replies(server: BackgroundServer) -> None:
    doc = httpx.get(server.base_url + "/openapi.json").json()
    for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")):
        op = doc["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + model)
        assert {"200", "400", "404", "413", "415", "429", "500", "503"} <= set(op["responses"])
        assert "422" not in op["responses"]
    props = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "max_tokens", "temperature", "stop", "stream"} <= set(props)
    assert props["model"]["anyOf"][0]["enum"] == [MODEL]
    assert list(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert set(doc["paths"]["/health"]) == {"get", "head"}


def test_405_has_allow_and_head_health(server: BackgroundServer) -> None:
    r = httpx.get(server.base_url + "/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["code"] == "method_not_allowed"
    r = httpx.delete(server.base_url + "/health")
    assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == {"GET", "HEAD"}
    r = httpx.head(server.base_url + "/health")
    assert r.status_code == 200 and r.content == b""


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_fuzz_no_5xx_and_documented_replies(case: object) -> None:
    """Observed (25 examples per operation): 0 failures. Mutations: the 405 handler dropping `Allow`
    or /metrics documented as JSON -> conformance failures; a 500 on a bad `stop` type -> not_a_server_error."""
    case.call_and_validate(checks=[not_a_server_error, status_code_conformance, content_type_conformance],
                           timeout=30)
