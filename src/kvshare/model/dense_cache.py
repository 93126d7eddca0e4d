"""DenseCache: the reference `CacheBackend` with plain per-slot tensors.

Storage, allocated lazily on first use:

* history rings ``(name, layer) -> [num_slots, depth, w]``: position p of a slot lives in row
  ``p % depth``; the dtype is that of the first values stored (fp32 for compressor states);
* compressed rows ``(kind, owner) -> [num_slots, max_len // ratio(owner), w]`` in `dtype`
  ("kv": post-RoPE latents, "index_k": index keys), addressed by (slot, compressed index), one
  table per region of the cache's `RegionMap` (``regions``; shared unless ``share_cache=False``
  or the Topology says otherwise): ``write_rows(kind, L)`` stores into every region L writes,
  ``gather_*(kind, L)`` reads the region L reads, exactly as the paged backend resolves them.

Invariant: a sequence's history must be fed in position order, chunk after chunk, in the same
slot (a new sequence starting at position 0 may reuse a slot without clearing it: rows of
positions < 0 are never read, and compressed rows are rewritten before they become visible).

Gradients: with autograd on and values that require grad, compressed-row writes are out of place,
so a loss reaches the compressor and index-key projections through rows read later in the same
forward (training runs one prefill per fresh cache); history rows of this step are returned
undetached. What is kept for later steps is always detached.
"""

from __future__ import annotations

import torch

from kvshare.cache.regions import RegionMap
from kvshare.config import ModelConfig
from kvshare.runtime import StepBatch
from kvshare.topology import Topology


class DenseCache:
    """Plain-tensor `CacheBackend` for up to `num_slots` sequences of at most `max_len` tokens."""

    def __init__(self, cfg: ModelConfig, topo: Topology, num_slots: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 share_cache: bool | None = None) -> None:
        self.cfg, self.topo = cfg, topo
        self.regions = RegionMap(topo, topo.share_cache if share_cache is None else share_cache)
        self.num_slots, self.max_len = num_slots, max_len
        self.dtype, self.device = dtype, torch.device(device)
        self.rings: dict[tuple[str, int], torch.Tensor] = {}
        self.rows: dict[tuple[str, int], torch.Tensor] = {}

    # ---- history rings -------------------------------------------------------------------
    def history(self, name: str, layer: int, values: torch.Tensor, depth: int, batch: StepBatch,
                rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        key = (name, layer)
        ring = self.rings.get(key)
        if ring is None:
            ring = torch.zeros(self.num_slots, depth, values.shape[-1], dtype=values.dtype, device=self.device)
            self.rings[key] = ring
        if rows is None:
            rows = torch.arange(values.shape[0], device=values.device)
        seq = batch.seq_index[rows]
        want = batch.positions[rows].unsqueeze(1) - depth + 1 + torch.arange(depth, device=values.device)
        start = batch.starts[seq].unsqueeze(1)
        in_step = want >= start
        step_row = (batch.cu_seqlens[seq].unsqueeze(1) + want - start).clamp(min=0, max=max(values.shape[0] - 1, 0))
        slot = batch.slots[seq].unsqueeze(1).expand_as(want)
        from_ring = ring[slot, want.remainder(depth)]
        out = torch.where(in_step.unsqueeze(-1), values[step_row], from_ring.to(values.dtype))
        valid = want >= 0
        out = out.masked_fill(~valid.unsqueeze(-1), 0)

        keep = batch.positions >= (batch.ends[batch.seq_index] - depth)
        ring[batch.slots[batch.seq_index[keep]], batch.positions[keep] % depth] = values[keep].detach().to(ring.dtype)
        return out, valid

    # ---- compressed rows -----------------------------------------------------------------
    def _table(self, kind: str, owner: int, width: int) -> torch.Tensor:
        key = (kind, owner)
        t = self.rows.get(key)
        if t is None:
            n = self.max_len // max(self.cfg.compress_ratios[owner], 1)
            t = torch.zeros(self.num_slots, n, width, dtype=self.dtype, device=self.device)
            self.rows[key] = t
        return t

    def region_rows(self, kind: str, layer: int) -> torch.Tensor | None:
        """The row table layer `layer` reads, or None if nothing was written to it yet."""
        return self.rows.get((kind, self.regions.reads(kind, layer)))

    def write_rows(self, kind: str, layer: int, seq: torch.Tensor, index: torch.Tensor, values: torch.Tensor,
                   batch: StepBatch) -> None:
        for owner in self.regions.writes(kind, layer):
            table = self._table(kind, owner, values.shape[-1])
            if index.numel() and int(index.max()) >= table.shape[1]:
                raise IndexError(f"compressed row {int(index.max())} of layer {layer} exceeds max_len {self.max_len}")
            if values.requires_grad and torch.is_grad_enabled():
                # Training: rebuild the table out of place so later reads in this forward carry gradients.
                self.rows[(kind, owner)] = table.index_put((batch.slots[seq], index), values.to(table.dtype))
            else:
                table[batch.slots[seq], index] = values.detach().to(table.dtype)

    def _width(self, kind: str) -> int:
        return self.cfg.head_dim if kind == "kv" else self.cfg.index_head_dim

    def gather_rows(self, kind: str, layer: int, seq: torch.Tensor, index: torch.Tensor,
                    batch: StepBatch) -> torch.Tensor:
        table = self._table(kind, self.regions.reads(kind, layer), self._width(kind))
        if seq.dim() < index.dim():
            seq = seq.view(*seq.shape, *([1] * (index.dim() - seq.dim())))
        slot = batch.slots[seq].expand_as(index)
        out = table[slot, index.clamp(min=0)]
        return out.masked_fill((index < 0).unsqueeze(-1), 0)

    def gather_prefix(self, kind: str, layer: int, n_rows: torch.Tensor,
                      batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        table = self._table(kind, self.regions.reads(kind, layer), self._width(kind))
        width = int(n_rows.max()) if n_rows.numel() else 0
        j = torch.arange(width, device=n_rows.device)
        valid = j.unsqueeze(0) < n_rows.unsqueeze(1)
        out = table[batch.slots.unsqueeze(1), j.unsqueeze(0).expand(len(n_rows), -1)]
        return out.masked_fill(~valid.unsqueeze(-1), 0), valid
