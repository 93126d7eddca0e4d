"""Boundary checkpoints of the per-request rings: which rows, taking them in a step, restoring them.

A ring (name, layer) of depth d holds the last d positions of a sequence; a read at position p
touches positions ``[p - d + 1, p]``. After a boundary H, what tokens ``>= H`` can still read of
positions ``< H`` is ``boundary_rows`` rows:

* a ring read at every position (the sliding window, and any ring this module does not know):
  ``d - 1`` rows, ``[H - d + 1, H)``;
* a compressor ring, read only by the last token of a group, with H a multiple of the ratio r
  (the block size is a multiple of every ratio): ``d - r`` rows. That is V4's ratio-4 overlap
  carry (4 rows of the previous group) and nothing for the non-overlapping compressors.

``BoundaryCapture`` is set on the paged backend for one step. On the first ``history`` call of each
ring it takes, for every target (sequence i of the batch, boundary H inside this step's chunk), the
rows positions ``[H - k, H)`` will hold once the step's ring update is applied: earlier positions
from the pre-step ring, this step's from its values, packed exactly as the ring update packs them.
``restore`` writes a checkpoint's rows into a fresh slot's rings, so the slot holds bitwise what a
cold run holds after H tokens (rows no later read touches stay zero). The ring arithmetic (position
q -> row ``q mod rows``, the stored encoding) is `cache.rings.Ring`'s: ``snapshot`` / ``pack`` take
the rows, ``restore`` writes them back.
"""

from __future__ import annotations

import torch

from kvshare.cache.layout import CacheLayout
from kvshare.cache.rings import Ring

COMPRESSOR_RINGS = ("compressor", "indexer_compressor")


def boundary_rows(name: str, depth: int, ratio: int) -> int:
    """Rows of ring `name` (depth `depth`, layer compress ratio `ratio`) a boundary checkpoint keeps."""
    if name in COMPRESSOR_RINGS and ratio > 0:
        return max(0, depth - ratio)
    return max(0, depth - 1)


def checkpoint_bytes_by_ring(layout: CacheLayout, draft: bool = False) -> dict[str, int]:
    """Bytes of one boundary checkpoint per ring name ("window", "compressor", ...); `draft`: also
    the draft (MTP / DSpark) layers' rings, which a checkpoint holds only when drafts run."""
    out: dict[str, int] = {}
    for s in layout.states:
        if s.layer >= layout.topo.num_layers and not draft:
            continue
        k = boundary_rows(s.name, s.depth, layout.topo[s.layer].ratio)  # depth: rows less the slack
        out[s.name] = out.get(s.name, 0) + s.tensors * k * s.row_bytes
    return out


def checkpoint_bytes(layout: CacheLayout, draft: bool = False) -> int:
    """Bytes of one boundary checkpoint for this layout (what ``kvshare plan`` shows per boundary)."""
    return sum(checkpoint_bytes_by_ring(layout, draft).values())


class BoundaryCapture:
    """Targets of one step: ``seqs[c]`` (index in the batch) is captured at boundary ``bounds[c]``.

    Invariant: ``starts[seqs[c]] < bounds[c] <= ends[seqs[c]]``. After the step ``rings`` holds, per
    ring, ``(depth, width, rows [C, k, row_bytes])``.
    """

    def __init__(self, seqs: list[int], bounds: list[int], ratio_of: dict[int, int], device: torch.device) -> None:
        self.seqs = torch.tensor(seqs, dtype=torch.int64, device=device)
        self.bounds = torch.tensor(bounds, dtype=torch.int64, device=device)
        self.ratio_of = ratio_of
        self.rings: dict[tuple[str, int], tuple[int, int, torch.Tensor]] = {}

    def take(self, name: str, layer: int, ring: Ring, values: torch.Tensor, batch) -> None:  # noqa: ANN001
        """Record ring (name, layer) at the targets' boundaries; `ring` still holds the pre-step rows."""
        if (name, layer) in self.rings:
            return
        depth = ring.depth
        k = boundary_rows(name, depth, self.ratio_of.get(layer, 0))
        c = self.seqs.numel()
        q = self.bounds[:, None] - k + torch.arange(k, device=ring.data.device)[None, :]  # [C, k]
        start = batch.starts[self.seqs][:, None]
        old = ring.snapshot(batch.slots[self.seqs][:, None], q)
        t_all = values.shape[0]
        step_row = (batch.cu_seqlens[self.seqs][:, None] + q - start).clamp(0, max(t_all - 1, 0))
        new = ring.pack(values[step_row.reshape(-1)]).reshape(c, k, old.shape[-1])
        rows = torch.where((q >= start)[..., None], new, old).masked_fill((q < 0)[..., None], 0)
        self.rings[(name, layer)] = (depth, ring.width, rows)

    def rows_of(self, c: int) -> dict[tuple[str, int], tuple[int, int, torch.Tensor]]:
        """Target c's rows of every ring, as a checkpoint's ``rings`` (cloned, so the step's tensors can go)."""
        return {key: (d, w, r[c].clone()) for key, (d, w, r) in self.rings.items()}


def restore(pool, slot: int, boundary: int, rings: dict[tuple[str, int], tuple[int, int, torch.Tensor]]) -> None:  # noqa: ANN001
    """Write checkpoint rows (positions ``[boundary - k, boundary)``) into `slot`'s rings."""
    for (name, layer), (depth, width, rows) in rings.items():
        ring = pool.ring(name, layer, depth, width)
        k = rows.shape[0]
        if k:
            ring.restore(slot, torch.arange(boundary - k, boundary), rows)
