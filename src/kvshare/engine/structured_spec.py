"""What a request asks structured output for: `StructuredSpec` (no torch import: the server's
body-parser child builds it while validating a request; engine/structured.py compiles it)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredSpec:
    """One constraint: `kind` in KINDS, its `value` (schema dict or JSON text, regex, list of strings,
    EBNF text) and the request `field` it came from (named in errors). `compiled`: the grammar
    compiled before admission (engine/structured.Compiled; None until then), shared by the
    request's choices."""

    kind: str
    value: Any = None
    field: str = "structured_outputs"
    compiled: Any = dataclasses.field(default=None, compare=False, repr=False)
