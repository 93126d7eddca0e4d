"""StepState: the cross-layer hand-offs of one step (top-k rows, candidate masks, DSpark taps).

It is created per step, never global, and readers assert that what they need is there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepState:
    """Hand-offs published during one forward step, in layer order.

    ``topk[src]``: [T, k] int64 compressed-entry indices picked by index source `src` for every
    token row (-1 = none; never used as a tensor index). ``candidates``: [T, Wc] bool mask over
    compressed positions published by the candidate source for later index sources.
    """

    topk: dict[int, torch.Tensor] = field(default_factory=dict)
    candidates: torch.Tensor | None = None
    candidate_source: int | None = None
    # DSpark taps: keys are the layers whose input stream to record (set by the caller before the
    # forward); the model fills each with the [T, D] mean over the mHC copies entering that layer.
    taps: dict[int, torch.Tensor | None] | None = None

    def publish_topk(self, layer: int, idx: torch.Tensor) -> None:
        self.topk[layer] = idx

    def topk_of(self, source: int, reader: int) -> torch.Tensor:
        if source not in self.topk:
            raise RuntimeError(f"layer {reader}: index source {source} published no top-k this step")
        return self.topk[source]

    def publish_candidates(self, layer: int, mask: torch.Tensor) -> None:
        self.candidates = mask
        self.candidate_source = layer

    def candidates_of(self, source: int, reader: int) -> torch.Tensor:
        if self.candidates is None or self.candidate_source != source:
            raise RuntimeError(f"layer {reader}: candidate source {source} published no candidates this step")
        return self.candidates
