"""DenseCache: the reference `CacheBackend` with plain per-slot tensors.

Storage, allocated lazily on first use:

* history rings ``(name, layer) -> [num_slots, depth, w]`` (`cache.rings.Ring`, tensors also in
  ``rings``): position p of a slot lives in row ``p % depth``; the dtype is that of the first
  values stored (fp32 for compressor states); DSpark draft windows likewise (``draft_window``);
* compressed rows ``(kind, owner) -> [num_slots, max_len // ratio(owner), w]`` in `dtype`
  ("kv": post-RoPE latents, "index_k": index keys), addressed by (slot, compressed index), one
  table per region of the cache's `RegionMap` (``regions``; shared unless ``share_cache=False``
  or the Topology says otherwise): ``write_rows(kind, L)`` stores into every region L writes,
  ``gather_*(kind, L)`` reads the region L reads, exactly as the paged backend resolves them.

No in-place reads: ``window_keys`` / ``pool_keys`` return None (readers gather).

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
from kvshare.cache.rings import Ring
from kvshare.config import ModelConfig
from kvshare.step import StepBatch
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
        self.rings: dict[tuple[str, int], torch.Tensor] = {}  # the ring tensors of `_rings`
        self._rings: dict[tuple[str, int], Ring] = {}
        self.rows: dict[tuple[str, int], torch.Tensor] = {}
        self.capture = None  # no prefix checkpoints over a dense cache

    # ---- rings ------------------------------------------------------------------------------
    def _ring(self, name: str, layer: int, depth: int, width: int, dtype: torch.dtype) -> Ring:
        key = (name, layer)
        ring = self._rings.get(key)
        if ring is None:
            self.rings[key] = torch.zeros(self.num_slots, depth, width, dtype=dtype, device=self.device)
            ring = self._rings[key] = Ring(self.rings[key], None, depth, width)
        return ring

    def begin_step(self, addresses, capture=None) -> None:  # noqa: ANN001
        """Nothing to bind: reads and writes take the batch's addresses; no checkpoints here."""
        if capture is not None:
            raise ValueError("the dense cache takes no prefix checkpoint capture")

    def end_step(self) -> None:
        """Nothing deferred: the dense cache updates its rings as it reads them."""

    def draft_window(self, layer: int, width: int, dtype: torch.dtype) -> Ring:
        """The DSpark stage `layer`'s window ring (W rows, created on first use in `dtype`)."""
        return self._ring("window", layer, self.cfg.sliding_window, width, dtype)

    def history(self, name: str, layer: int, values: torch.Tensor, depth: int, batch: StepBatch,
                rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        ring = self._ring(name, layer, depth, values.shape[-1], values.dtype)
        addr = batch.addresses()
        read = addr.ring_read(rows, depth, ring.rows)
        out = ring.window(read, values)
        ring.write(addr.ring_write(ring.rows), values.detach())
        return out, read.valid

    def remember(self, name: str, layer: int, values: torch.Tensor, depth: int, batch: StepBatch) -> None:
        """`history`'s ring update alone (no read)."""
        ring = self._ring(name, layer, depth, values.shape[-1], values.dtype)
        ring.write(batch.addresses().ring_write(ring.rows), values.detach())

    def window_keys(self, name: str, layer: int, values: torch.Tensor, depth: int, batch: StepBatch,
                    decode: bool = False, reader_decodes: bool = False) -> None:
        """No in-place reads here (the protocol's capability): readers gather with `history`."""
        return None

    def pool_keys(self, kind: str, layer: int, dtype: torch.dtype, batch: StepBatch, decode: bool = False,
                  reader_decodes: bool = False) -> None:
        """No in-place reads here (the protocol's capability): readers gather with ``gather_*``."""
        return None

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
            groups = batch.addresses().groups(max(self.topo[layer].ratio, 1))
            last = groups.last if index is groups.j else (int(index.max()) if index.numel() else -1)
            if last >= table.shape[1]:
                raise IndexError(f"compressed row {last} of layer {layer} exceeds max_len {self.max_len}")
            if values.requires_grad:
                # Training (values autograd tracks): rebuild the table out of place so later reads in
                # this forward carry gradients (the same values as the in-place write).
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
        if table.shape[1] == 0:  # a ratio longer than the cache's length: only -1 (padding) can be asked
            return table.new_zeros(*index.shape, table.shape[-1])
        out = table[slot, index.clamp(min=0)]
        return out.masked_fill((index < 0).unsqueeze(-1), 0)

    def gather_prefix(self, kind: str, layer: int, n_rows: torch.Tensor,
                      batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        table = self._table(kind, self.regions.reads(kind, layer), self._width(kind))
        pre = batch.addresses().prefix_of(n_rows)
        if pre is None:
            width = int(n_rows.max()) if n_rows.numel() else 0
            valid = torch.arange(width, device=n_rows.device).unsqueeze(0) < n_rows.unsqueeze(1)
        else:
            width, valid = pre.width, pre.mask
        j = torch.arange(width, device=n_rows.device)
        out = table[batch.slots.unsqueeze(1), j.unsqueeze(0).expand(len(n_rows), -1)]
        return out.masked_fill(~valid.unsqueeze(-1), 0), valid
