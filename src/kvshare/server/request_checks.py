"""Checks of request values that the body models share: field-named errors, booleans refused as
ids, JSON nesting depth, and `structured_spec` (OpenAI's `response_format` / vLLM's
`structured_outputs` turned into the engine's `StructuredSpec`)."""

from __future__ import annotations

import json
from typing import Any

from kvshare.engine.structured_spec import StructuredSpec


MAX_SCHEMA_DEPTH = 32  # a JSON schema sent as JSON text: as deep as a body may be (limits.max_json_depth)


def refuse_bools(v: Any, name: str) -> Any:
    """`v` unchanged; ValueError when it is a list holding a boolean (pydantic's lax int takes true as 1)."""
    if isinstance(v, list) and any(isinstance(t, bool) for t in v):
        raise ValueError(f"{name} must be integer token ids, not booleans")
    return v


def depth_over(value: Any, limit: int) -> bool:
    """Whether `value` (decoded JSON) nests containers deeper than `limit` (iterative: no recursion)."""
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            if d > limit:
                return True
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return False


def structured_spec(response_format: dict[str, Any] | None,
                    structured_outputs: dict[str, Any] | None) -> StructuredSpec | None:
    """The constraint a request asks for: OpenAI's `response_format` or vLLM's `structured_outputs`
    (json, regex, choice, grammar, json_object; exactly one). Raises FieldError naming the field."""
    if response_format is not None and structured_outputs is not None:
        raise field_error("structured_outputs", "give response_format or structured_outputs, not both")
    if response_format is not None:
        kind = response_format.get("type")
        if kind == "text" and len(response_format) == 1:
            return None
        if kind == "json_object" and len(response_format) == 1:
            return StructuredSpec("json_object", None, "response_format")
        if kind == "json_schema" and set(response_format) <= {"type", "json_schema"}:
            js = response_format.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
                raise field_error("response_format.json_schema.schema", "a JSON schema object is required")
            unknown = set(js) - {"name", "schema", "strict", "description"}
            if unknown:
                raise field_error(f"response_format.json_schema.{sorted(unknown)[0]}", "unknown field")
            return StructuredSpec("json", js["schema"], "response_format.json_schema.schema")
        raise field_error("response_format", "type must be text, json_object or json_schema (with its fields only)")
    if structured_outputs is None:
        return None
    keys = [k for k, v in structured_outputs.items() if v is not None and v is not False]
    if len(keys) != 1 or keys[0] not in ("json", "regex", "choice", "grammar", "json_object"):
        raise field_error("structured_outputs", "give exactly one of json, regex, choice, grammar, json_object")
    key = keys[0]
    value = structured_outputs[key]
    field = f"structured_outputs.{key}"
    if key == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except RecursionError:
                raise field_error(field, "the JSON text is nested too deeply") from None
            except ValueError as e:
                raise field_error(field, f"not valid JSON: {e}") from None
            if depth_over(value, MAX_SCHEMA_DEPTH):
                raise field_error(field, f"the JSON schema is nested deeper than {MAX_SCHEMA_DEPTH} levels")
        if not isinstance(value, dict):
            raise field_error(field, "a JSON schema object is required")
    elif key in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise field_error(field, "a non-empty string is required")
    elif key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise field_error(field, "a non-empty list of non-empty strings is required")
    elif value is not True:
        raise field_error(field, "must be true")
    return StructuredSpec(key, None if key == "json_object" else value, field)


class FieldError(ValueError):
    """A validation error that belongs to one named field (app.py reports it as the 400's param)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def field_error(field: str, message: str) -> ValueError:
    return FieldError(field, message)
