"""The DSpark stages' own sliding-window caches ("context KV", spec engram_dspark.md §2.4).

Each draft stage keeps, per request slot, a ring of its projection of the target's tapped hidden
states: ``kv_norm(wkv(main_x[p]))`` rotated and rounded like a backbone window row, stored at row
``p % depth`` of ring ``("window", stage_layer)``. The ring lives where the backbone's rings live:
the paged pool (packed in the layout's window format, created up front for every draft layer) or
a DenseCache (plain values), reached through the backend's ``draft_window`` (runtime.CacheBackend).

Invariants: only committed positions are written (the caller passes the anchor plus accepted
drafts of a verify, or every token of a prefill chunk), so rejected drafts never reach the ring;
a read returns the `window` positions ``a - window .. a - 1`` before the anchor position a (False
where negative); a write of more than `depth` positions of one slot keeps the newest `depth`.
"""

from __future__ import annotations

import torch

from kvshare.cache.rings import Ring


class DraftWindows:
    """Read / write access to the draft stages' window rings of one CacheBackend
    (``backend.draft_window(layer, width, dtype)``: a `cache.rings.Ring` of at least `window` rows)."""

    def __init__(self, cache: object, window: int, width: int) -> None:
        self.cache = cache
        self.window = window
        self.width = width

    def _ring(self, layer: int, dtype: torch.dtype) -> Ring:
        return self.cache.draft_window(layer, self.width, dtype)  # type: ignore[attr-defined]

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
        """Store values[e] as position positions[e] of slot slots[e] (the newest `depth` per slot)."""
        if values.shape[0] == 0:
            return
        ring = self._ring(layer, values.dtype)
        end = torch.full((ring.data.shape[0],), -1, dtype=positions.dtype, device=positions.device)
        end = end.scatter_reduce(0, slots, positions, reduce="amax")
        keep = positions > end[slots] - ring.rows
        ring.put(slots[keep], positions[keep], values[keep])

    def read(self, layer: int, slots: torch.Tensor, anchor_pos: torch.Tensor,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """([N, window, width] rows of positions a-window .. a-1, oldest first; [N, window] validity)."""
        ring = self._ring(layer, dtype)
        q = anchor_pos[:, None] - self.window + torch.arange(self.window, device=anchor_pos.device)[None, :]
        return ring.gather(slots[:, None], q, dtype)
