"""Paged sparse attention (csrc/attn.cpp): the attention of `model/attention.py` over keys read in
place, where the cache keeps them, instead of gathered into new [T, M, d] tensors first.

A query row's keys are its window (the W positions ending at its own: this step's rows for
positions inside its chunk, its slot's window ring for earlier ones, nothing before position 0),
then its compressed entries (top-k picks, -1 = none, or every entry below a per-row count) read
from the paged pool through the block table. The arithmetic is `decode.sparse_attention`'s, in
the same order over the same keys, so the output has the same bits as gathering the rows and
calling that kernel (tests/test_native_attention.py asserts it). A row's bits depend on that row's
inputs only; the call splits its rows over torch's intra-op threads.

The caller (`cache/paged_backend.PagedBackend.window_keys` / `pool_keys`) hands over the stored
bytes with their row layout (`RowFormat.codec`): plain values of the query's dtype (bf16 / fp32 row
formats), or the quantised schemes of `kernels/rows.py` (FP8 / FP4), which the kernel decodes with
`unpack_rows`' decoder (csrc/row_codec.h) and rounds to q's dtype, once per query row and key: the
bits of the kernel over `RowFormat.unpack(rows, q.dtype)`.
"""

from __future__ import annotations

import torch

from kvshare.kernels.ops import ops

#: the row layout (scheme, block, rope dims) of rows stored as values of q's dtype
PLAIN: tuple[int, int, int] = (-1, 0, 0)


def paged_attention(q: torch.Tensor, ring: torch.Tensor, step: torch.Tensor, meta: torch.Tensor, window: int,
                    sink: torch.Tensor, scale: float, pool: torch.Tensor | None = None,
                    tables: torch.Tensor | None = None, seq: torch.Tensor | None = None,
                    picks: torch.Tensor | None = None, counts: torch.Tensor | None = None,
                    ratio: int = 1, block_size: int = 1, ring_codec: tuple[int, int, int] = PLAIN,
                    pool_codec: tuple[int, int, int] = PLAIN) -> torch.Tensor:
    """[T, H, d] in q's dtype.

    q [T, H, d] (bf16 / fp32); ring uint8 [slots, rows, bytes] (rows of q's dtype in the first
    d * itemsize bytes); step [S, d] this step's window rows; meta int64 [T, 4] = (slot, position,
    chunk start, the chunk's first step row) per query row; `window` keys per row. Optional pool
    uint8 [blocks, rows per block, bytes] with block `tables` [N, C], each row's sequence `seq` [T]
    and its entries: `picks` [T, m] (-1 = none) or `counts` [T] (entries 0 .. count - 1), at
    `ratio` tokens per entry in blocks of `block_size` tokens. `ring_codec` / `pool_codec`: the layout of
    their rows (`RowFormat.codec`; `PLAIN`: values of q's dtype in a row's first d * itemsize bytes)."""
    def c(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.contiguous()

    return ops.paged_attention(q.contiguous(), ring, step.contiguous(), meta, window, pool, c(tables), c(seq),
                               c(picks), c(counts), ratio, block_size, sink.float().contiguous(), scale,
                               [*ring_codec, *pool_codec])


def index_topk(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, keys_dtype: torch.dtype, seq: torch.Tensor,
               counts: torch.Tensor, k: int, tables: torch.Tensor | None = None, ratio: int = 1,
               block_size: int = 1) -> torch.Tensor:
    """[T, k] int64 ascending picks (-1 padded): the k highest lightning-indexer scores
    ``sum_h w[t, h] relu(q[t, h] . key_j)`` over entries j < counts[t] of row t's sequence seq[t], ties to
    the lower j (csrc/index.h: the order of every sum). q [T, H, d] and w [T, H] are taken in fp32. Keys:
    the pool in place (`tables` given: keys uint8 [blocks, rows per block, bytes], rows of `keys_dtype`) or
    gathered rows [N, L, d] of `keys_dtype` (bf16 or fp32)."""
    return ops.index_topk(q.float().contiguous(), w.float().contiguous(), keys, keys_dtype == torch.bfloat16,
                          None if tables is None else tables.contiguous(), seq.contiguous(), counts.contiguous(),
                          ratio, block_size, k)
