"""The served OpenAPI document: request-body schemas, every reply a route can give, /metrics as text.

The generation routes take the raw `Request` and decode its body themselves (bounded, off the
event loop: `body_parser`), so FastAPI cannot see their request models. `install_openapi(app,
bodies)` documents them anyway: each POST route in `bodies` gets its pydantic model as the
`application/json` request body; every route lists the error replies the middleware and the
route can give (OpenAI's error body); generation routes answer JSON or an SSE stream; /metrics
answers Prometheus text. Schema-driven fuzzers (schemathesis) therefore send real bodies and
check real replies. Parsing is unchanged: the document only describes it.
"""

from __future__ import annotations

import warnings
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from kvshare.server.replies import ErrorResponse

REF = "#/components/schemas/{model}"

# status -> when a route answers it (every route: the middleware's replies; POST: the body's)
_ANY_ROUTE = {"401": "Missing or wrong API key (when the server has one).",
              "405": "Method not allowed on this path (the `Allow` header lists the allowed ones)."}
_POST_ROUTE = {"400": "Malformed JSON, a structural limit passed, or an invalid field (`param` names it).",
               "404": "The model named in the body is not served here.",
               "408": "The body did not arrive within the body timeout.",
               "413": "The body is larger than --max-body-bytes.",
               "415": "The body is not application/json.",
               "429": "Too many concurrent requests; retry later.",
               "500": "The request failed inside the engine (other requests go on).",
               "503": "The server is shutting down, or the body parser got no CPU for too long; retry later."}


def install_openapi(app: FastAPI, bodies: dict[str, type[BaseModel]], model_name: str | None = None) -> None:
    """Make `app.openapi()` document `bodies` (POST path -> request model) and every reply (see module doc).

    `model_name`: the one model id the server accepts; the bodies' `model` field is documented as it
    (or null), so a fuzzer's bodies reach generation instead of the 404 of an unknown model."""

    def build() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        with warnings.catch_warnings():  # a GET+HEAD route shares one operation id: made unique below
            warnings.filterwarnings("ignore", message="Duplicate Operation ID")
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        _add_model(components, ErrorResponse)
        error = {"application/json": {"schema": {"$ref": REF.format(model=ErrorResponse.__name__)}}}
        for path, ops in schema.get("paths", {}).items():
            for method, op in ops.items():
                if method == "head" and "operationId" in op:
                    op["operationId"] += "_head"
                responses = op.setdefault("responses", {})
                responses.pop("422", None)  # FastAPI's own validation reply: this server answers 400
                for status, why in _ANY_ROUTE.items():
                    responses.setdefault(status, {"description": why, "content": error})
                if method == "post":
                    for status, why in _POST_ROUTE.items():
                        responses.setdefault(status, {"description": why, "content": error})
                if path in bodies and method == "post":
                    model = bodies[path]
                    _add_model(components, model)
                    props = components[model.__name__].get("properties", {})
                    if model_name is not None and "model" in props:
                        props["model"] = {"anyOf": [{"type": "string", "enum": [model_name]}, {"type": "null"}],
                                          "description": "The served model's id (GET /v1/models); may be left out."}
                    op["requestBody"] = {"required": True, "content": {
                        "application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}}}
                    responses["200"] = {"description": "The reply: one JSON body, or with `stream: true` a "
                                                       "server-sent event stream ending with `data: [DONE]`.",
                                        "content": {"application/json": {"schema": {"type": "object"}},
                                                    "text/event-stream": {"schema": {"type": "string"}}}}
        metrics = schema.get("paths", {}).get("/metrics", {}).get("get")
        if metrics is not None:
            metrics["responses"]["200"] = {"description": "Prometheus text exposition (version 0.0.4).",
                                           "content": {"text/plain": {"schema": {"type": "string"}}}}
        for method, op in schema.get("paths", {}).get("/health", {}).items():
            op["responses"]["200"] = {"description": "Serving.", "content": {"application/json": {"schema": {
                "type": "object", "properties": {"status": {"type": "string"}}}}}}
            op["responses"]["503"] = {"description": "Draining, or the engine loop is dead or stalled.",
                                      "content": error}
        app.openapi_schema = schema
        return schema

    app.openapi = build  # type: ignore[method-assign]


def _add_model(components: dict[str, Any], model: type[BaseModel]) -> None:
    """`model`'s JSON schema (validation side) and its nested definitions as components."""
    js = model.model_json_schema(ref_template=REF, mode="validation")
    components.update(js.pop("$defs", {}))
    components[model.__name__] = js
