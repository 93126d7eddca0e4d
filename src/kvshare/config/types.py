"""The config package's plain value types: the architecture tag and YaRN scaling."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Arch = Literal["v4", "v41"]


@dataclass(frozen=True)
class YarnConfig:
    """YaRN frequency interpolation, applied only to layers with compress ratio > 0."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
