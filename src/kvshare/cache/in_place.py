"""Cache rows handed to a native kernel where they are stored (no gather, no copy).

`PagedBackend.window_keys` / `pool_keys` return these instead of gathered tensors when the
stored rows are plain values of the reader's dtype (bf16 / fp32 row formats), or, to a reader that
decodes rows itself (`kernels/attn.py`), quantised rows of a native scheme (FP8 / FP4, with their
`codec`), so a kernel reads them in place. Other readers (the indexer's top-k) keep the gather path
for quantised rows.

Invariants: the tensors are the cache's own storage (uint8 bytes, a row's values in its first
``dim * itemsize`` bytes) and the step's addresses; nothing here is a copy, so a reader must use
them within the step that produced them (the window ring is updated at ``end_step``, after every
reader of the step: in-step positions come from `step`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvshare.kernels.attn import PLAIN


@dataclass(frozen=True)
class WindowKeys:
    """The window read of a history ring (depth `depth`) for every token row of a step: positions
    inside a row's chunk are rows of `step` [T, d] (this step's values), earlier ones ring rows
    ``position mod ring.shape[1]`` of the row's slot in `ring` [slots, rows, bytes];
    ``meta`` [T, 4] int64 = (slot, position, chunk start, chunk's first token row) per token row;
    `codec`: the ring rows' layout (`RowFormat.codec`, `PLAIN`: values of the step's dtype)."""

    ring: torch.Tensor
    step: torch.Tensor
    meta: torch.Tensor
    depth: int
    codec: tuple[int, int, int] = PLAIN


@dataclass(frozen=True)
class PoolKeys:
    """Compressed rows of one region in place: `view` [blocks, rows per block, bytes] (the pool's
    strided region view), the step's block `tables` [N, C]; entry j of sequence i is at position
    j * ratio, block ``tables[i, pos // block_size]``, row ``(pos % block_size) // ratio``; `codec` as
    `WindowKeys.codec`."""

    view: torch.Tensor
    tables: torch.Tensor
    ratio: int
    block_size: int
    codec: tuple[int, int, int] = PLAIN
