"""The DSpark stages' own sliding-window caches ("context KV", spec engram_dspark.md §2.4).

Each draft stage keeps, per request slot, a ring of its projection of the target's tapped hidden
states: ``kv_norm(wkv(main_x[p]))`` rotated and rounded like a backbone window row, stored at row
``p % depth`` of ring ``("window", stage_layer)``. The ring lives where the backbone's rings live:
the paged pool (``backend.pool``, packed in the layout's window format, created up front for
every draft layer) or a DenseCache's plain ``rings``.

Invariants: only committed positions are written (the caller passes the anchor plus accepted
drafts of a verify, or every token of a prefill chunk), so rejected drafts never reach the ring;
a read returns the `window` positions ``a - window .. a - 1`` before the anchor position a (False
where negative); a write of more than `depth` positions of one slot keeps the newest `depth`.
"""

from __future__ import annotations

import torch

from kvshare.cache.formats import RowFormat


class DraftWindows:
    """Read / write access to the draft stages' window rings of one CacheBackend."""

    def __init__(self, cache: object, window: int, width: int) -> None:
        self.cache = cache
        self.window = window
        self.width = width

    def _ring(self, layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, RowFormat | None]:
        pool = getattr(self.cache, "pool", None)
        if pool is not None:
            return pool.ring("window", layer, self.window, self.width)
        rings: dict = self.cache.rings  # type: ignore[attr-defined]
        key = ("window", layer)
        if key not in rings:
            rings[key] = torch.zeros(self.cache.num_slots, self.window, self.width,  # type: ignore[attr-defined]
                                     dtype=dtype, device=self.cache.device)  # type: ignore[attr-defined]
        return rings[key], None

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
        """Store values[e] as position positions[e] of slot slots[e] (the newest `depth` per slot)."""
        if values.shape[0] == 0:
            return
        ring, fmt = self._ring(layer, values.dtype)
        depth = ring.shape[1]
        end = torch.full((int(slots.max()) + 1,), -1, dtype=positions.dtype, device=positions.device)
        end = end.scatter_reduce(0, slots, positions, reduce="amax")
        keep = positions > end[slots] - depth
        rows = values[keep]
        ring[slots[keep], positions[keep].remainder(depth)] = fmt.pack(rows) if fmt is not None else rows.to(ring.dtype)

    def read(self, layer: int, slots: torch.Tensor, anchor_pos: torch.Tensor,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """([N, window, width] rows of positions a-window .. a-1, oldest first; [N, window] validity)."""
        ring, fmt = self._ring(layer, dtype)
        depth = ring.shape[1]
        q = anchor_pos[:, None] - self.window + torch.arange(self.window, device=anchor_pos.device)[None, :]
        valid = q >= 0
        rows = ring[slots[:, None].expand_as(q), q.remainder(depth)]
        rows = (fmt.unpack(rows) if fmt is not None else rows).to(dtype)
        return rows.masked_fill(~valid[..., None], 0), valid
