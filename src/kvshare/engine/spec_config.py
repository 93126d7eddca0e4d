"""``speculative_config`` in vLLM's shape: ``{"method": "dspark", "num_speculative_tokens": 5}``.

Accepted forms: None (off), a dict, a JSON string (the CLI's ``--speculative-config``), or a
SpeculativeConfig. ``num_speculative_tokens`` defaults to the model's ``dspark_block_size`` and may
be smaller (fewer drafts verified; the draft block keeps the trained width, spec §4 Q5).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvshare.errors import ConfigError

METHODS = ("dspark",)
FIELD = "speculative_config"


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "dspark"
    num_speculative_tokens: int | None = None

    @classmethod
    def parse(cls, raw: Any) -> "SpeculativeConfig | None":
        """The config, or None when speculation is off; ConfigError naming the bad field."""
        if raw is None or isinstance(raw, SpeculativeConfig):
            return raw
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ConfigError(f"is not valid JSON ({e.msg})", field=FIELD,
                                  fix='e.g. \'{"method": "dspark", "num_speculative_tokens": 5}\'') from None
        if not isinstance(raw, dict):
            raise ConfigError(f"must be a JSON object, got {type(raw).__name__}", field=FIELD)
        unknown = sorted(set(raw) - {"method", "num_speculative_tokens"})
        if unknown:
            raise ConfigError(f"unknown keys {unknown}", field=FIELD, fix="use method and num_speculative_tokens")
        method = raw.get("method", "dspark")
        if method not in METHODS:
            raise ConfigError(f"method {method!r} is not supported", field=f"{FIELD}.method",
                              fix=f"use one of {list(METHODS)}")
        n = raw.get("num_speculative_tokens")
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ConfigError(f"must be an integer >= 1, got {n!r}", field=f"{FIELD}.num_speculative_tokens")
        return cls(method, n)

    def num_tokens(self, cfg: Any) -> int:
        """Drafts verified per step for model config `cfg` (checked against its block size)."""
        block = int(getattr(cfg, "dspark_block_size", 0) or 0)
        if block <= 0 or getattr(cfg, "num_draft_layers", 0) <= 0:
            raise ConfigError("the model has no DSpark draft stages (num_nextn_predict_layers / dspark_block_size)",
                              field=f"{FIELD}.method", fix="use a DSpark checkpoint, or drop speculative_config")
        n = self.num_speculative_tokens if self.num_speculative_tokens is not None else block
        if n > block:
            raise ConfigError(f"{n} exceeds the model's dspark_block_size {block}",
                              field=f"{FIELD}.num_speculative_tokens", fix=f"use at most {block}")
        if n >= cfg.sliding_window:
            raise ConfigError(f"{n} must be below the sliding window {cfg.sliding_window}",
                              field=f"{FIELD}.num_speculative_tokens")
        return n
