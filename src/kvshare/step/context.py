"""StepContext: everything one forward step threads through the layers (never global)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvshare.step.addresses import StepAddresses
from kvshare.step.backend import CacheBackend
from kvshare.step.batch import StepBatch
from kvshare.step.state import StepState


class RotaryEmbedding(Protocol):
    """A RoPE table set as the layers use it (`layers.rope.RotaryEmbedding`; named here by its
    methods, so the step package imports no model code)."""

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False,
               inplace: bool = False) -> torch.Tensor: ...

    def native_tables(self, positions: torch.Tensor) -> Any: ...


@dataclass
class StepContext:
    """Per-step inputs and hand-offs.

    Invariants: ``positions`` and ``seq_index`` are ``batch.positions`` / ``batch.seq_index``;
    ``state`` is fresh for this step; ``ties`` (when not None) collects ``(layer, kind, rows)``
    for every top-k whose boundary was an exact tie (kind "index" or "candidates");
    ``engram_ids`` [T, n_engram_layers, cols] are this step's Engram row ids (None without Engram);
    ``addr`` is ``batch.addresses()``: every index the layers need, derived once per step (layers
    read it instead of deriving indices from device values, so the layer loop has no host sync).
    """

    batch: StepBatch
    cache: CacheBackend
    state: StepState
    input_ids: torch.Tensor
    rope_main: RotaryEmbedding
    rope_compress: RotaryEmbedding
    ties: list[tuple[int, str, int]] | None = field(default=None)
    engram_ids: torch.Tensor | None = field(default=None)
    addr: StepAddresses = field(init=False)

    def __post_init__(self) -> None:
        self.addr = self.batch.addresses()

    @property
    def positions(self) -> torch.Tensor:
        return self.batch.positions

    @property
    def seq_index(self) -> torch.Tensor:
        return self.batch.seq_index

    def rope_for(self, ratio: int) -> RotaryEmbedding:
        """Ratio-0 layers use the main table; every ratio > 0 layer the compress (YaRN) table."""
        return self.rope_main if ratio == 0 else self.rope_compress
