"""A model's sampling defaults, read from the ``generation_config.json`` next to its weights.

The file uses the Hugging Face names (``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``; ``do_sample: false`` means
greedy, i.e. temperature 0). Other keys (``bos_token_id``, ``max_new_tokens``, ...) are ignored.
Values are checked with ``SamplingParams.validate`` so a bad file fails with the file and field
named, not at the first request.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvshare.errors import ConfigError, RequestError

FILE = "generation_config.json"
KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def model_dir(model: str | Path) -> Path | None:
    """The directory holding `model`'s files: a path as given, or a shipped model's directory."""
    from kvshare.shipped import shipped_model_dir

    p = Path(model)
    if p.is_dir():
        return p
    if p.is_file():
        return p.parent
    return shipped_model_dir(str(model))


def generation_defaults(model: str | Path) -> dict[str, Any]:
    """The sampling defaults of `model` (SamplingParams field -> value); {} when it ships none."""
    from kvshare.engine.sampling import SamplingParams

    d = model_dir(model)
    path = d / FILE if d is not None else None
    if path is None or not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})", field="<file>", fix="fix or remove the file") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object", field="<file>", fix="fix or remove the file")
    out = {k: raw[k] for k in KEYS if raw.get(k) is not None}
    if raw.get("do_sample") is False:
        out["temperature"] = 0.0
    try:
        SamplingParams(**out).validate()
    except RequestError as e:
        raise ConfigError(f"{path}: {e}", field=next((k for k in out if k in str(e)), "<file>"),
                          fix="fix the value in the file") from None
    return out
