"""JSON schemas as structured output reads them: an object's listed properties are the only ones allowed
unless the schema says otherwise.

JSON Schema itself allows any unlisted property when ``additionalProperties`` is absent; a model
constrained by such a schema may then add keys until ``max_tokens`` (instructor's JSON_SCHEMA mode
sends such schemas). OpenAI's strict mode and xgrammar's default read an absent
``additionalProperties`` as false, and so does kvshare: `closed` sets ``additionalProperties: false``
on every object schema that lists ``properties`` and says nothing about extra ones
(``additionalProperties``, ``patternProperties``, ``unevaluatedProperties``). A schema that lists no
properties (``{"type": "object"}``, what ``json_object`` uses) still allows any object, and an
``allOf`` and its members stay open (closing one would refuse the properties the others list).
A client that wants extra keys says ``"additionalProperties": true`` (or gives their schema).
"""

from __future__ import annotations

import json
from typing import Any

_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
               "unevaluatedProperties", "additionalItems")


def closed(schema: Any) -> Any:
    """A copy of `schema` with ``additionalProperties: false`` on each object that lists properties and
    leaves extra ones unsaid (see the module doc); `schema` itself is not changed. JSON text is read
    first (text that is not JSON is returned as it is, for the compiler to report)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            return schema
    return _close(schema, True)


def _close(s: Any, close_here: bool) -> Any:
    if isinstance(s, list):
        return [_close(x, True) for x in s]
    if not isinstance(s, dict):
        return s
    out: dict[str, Any] = {}
    for k, v in s.items():
        if k in _SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: _close(sub, True) for name, sub in v.items()}
        elif k in _SCHEMA_LISTS and isinstance(v, list):
            out[k] = [_close(sub, True) for sub in v]
        elif k == "allOf" and isinstance(v, list):
            out[k] = [_close(sub, False) for sub in v]
        elif k in _SCHEMA_ONE:
            out[k] = _close(v, True)
        else:
            out[k] = v
    if close_here and isinstance(out.get("properties"), dict) and not any(k in out for k in (*_OPEN_KEYS, "allOf")):
        out["additionalProperties"] = False
    return out
