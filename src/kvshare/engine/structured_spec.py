"""What a request asks structured output for: `StructuredSpec` (no torch import: the server's
body-parser child builds it while validating a request; engine/structured.py compiles it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredSpec:
    """One constraint: `kind` in KINDS, its `value` (schema dict or JSON text, regex, list of strings,
    EBNF text) and the request `field` it came from (named in errors)."""

    kind: str
    value: Any = None
    field: str = "structured_outputs"
