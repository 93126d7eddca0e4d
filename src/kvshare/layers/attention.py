"""Sparse / paged attention of one layer (spec/model.md §4.7), bound once: `PagedAttention`.

``attend(q, kv, picks, ctx, sink)`` -> o [T, H, d]: each query row attends, with the per-head sink,
over its window (the W positions up to its own: this step's rows `kv` and the sequence's ring) plus
its compressed rows: the top-k `picks` [T, k] (-1 padded) of a top-k layer, every causal entry of
a V4 HCA layer (ratio > 0, picks None), none on a ratio-0 layer. The compressed rows of this step
are written before the call (`Attention.compress_and_select`), so a row may attend an entry made
in the same step. The window ring update is deferred by the cache backend.

Implementations (picked by `select` from the `KernelChoice`; the maths is the same, only the
summation shapes and orders differ):
* ``forward_torch`` (the batched mode): per sequence where that is cheaper (`PER_SEQ_FACTOR`: every
  compressed row of a sequence read once, prefix attention), else the picks gathered per row;
* ``forward_invariant`` (batch-invariant, torch): every query row attends its own gathered keys
  with a product shape set by the row alone (ops/invariant.py): its W window rows, then its picks
  (top-k layers) or its causal compressed entries padded to a length bucket (V4 HCA; rows grouped
  by bucket). On top-k layers a row whose bucket is below k reads only min(bucket, k) pick columns
  (the rest are -1 for it): prefill at short contexts gathers its few compressed rows, not k;
* ``forward_native`` (batch-invariant with the native attention, head_dim % 8 == 0): the same keys
  in the same order through `kernels.decode.sparse_attention` (its own summation order, bounded
  against the torch code in tests), and, where the cache backend offers in-place reads
  (`CacheBackend.window_keys` / ``pool_keys``: plain rows of q's dtype, or FP8 / FP4 rows the
  kernel decodes), read where they are stored (`kernels.attn.paged_attention`, all rows in one
  call: the bits of the native kernel over gathered rows). Per-call facts fall back inside it:
  activations the kernels do not take (a model cast after it was bound; autograd recording) run
  ``forward_invariant``; q and cached rows of different dtypes run the torch product for that call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from kvshare.kernels import decode as native
from kvshare.kernels.attn import paged_attention
from kvshare.layers.bound import BoundOp
from kvshare.layers.choice import KernelChoice
from kvshare.ops import invariant, sparse_attention
from kvshare.ops.prefix_attention import picks_to_mask, prefix_attention, window_keys

if TYPE_CHECKING:
    from kvshare.step.context import StepContext

PER_SEQ_FACTOR = 2  # read a sequence's compressed rows whole while there are at most 2k of them
_FLOATS = (torch.float32, torch.bfloat16)

#: the product of query rows over their keys: (q, win, win_valid, sink, rows, rows_valid) -> o
Attend = Callable[..., torch.Tensor]


class PagedAttention(BoundOp):
    """Attention of layer `layer` (compress ratio `ratio`, window `window`) over the cache (module doc)."""

    def __init__(self, layer: int, ratio: int, window: int, head_dim: int) -> None:
        super().__init__()
        self.layer, self.ratio, self.window, self.head_dim = layer, ratio, window, head_dim
        self.scale = head_dim**-0.5

    def select(self, choice: KernelChoice) -> Callable[..., Any]:
        if not choice.batch_invariant:
            return self.forward_torch
        if choice.attention and self.head_dim % 8 == 0:
            return self.forward_native
        return self.forward_invariant

    def extra_repr(self) -> str:
        return f"layer={self.layer}, ratio={self.ratio}, impl={self.impl.__name__}"

    # ---- the batched mode -------------------------------------------------------------------------
    def forward_torch(self, q: torch.Tensor, kv: torch.Tensor, picks: torch.Tensor | None, ctx: "StepContext",
                      sink: torch.Tensor) -> torch.Tensor:
        batch, addr = ctx.batch, ctx.addr
        comp, comp_valid, per_seq = self._compressed(ctx, picks) if self.ratio > 0 else (None, None, True)
        if per_seq:
            # window keys per sequence: the W-1 stored rows before the chunk (the window of each
            # sequence's first row, minus that row), then the chunk's own rows
            hist, _ = ctx.cache.history("window", self.layer, kv, self.window, batch, addr.first)
            keys = window_keys(hist[:, :self.window - 1], kv, ctx.seq_index, addr.rank, addr.max_len)
            return prefix_attention(q, keys, batch.starts, comp, comp_valid, ctx.seq_index, addr.rank, sink,
                                    self.scale, rows=addr.rows_layout())
        win, win_valid = ctx.cache.history("window", self.layer, kv, self.window, batch)
        win = torch.cat([win, comp.to(win.dtype)], dim=1)
        win_valid = torch.cat([win_valid, comp_valid], dim=1)
        return sparse_attention(q, win, win_valid, sink, self.scale)

    def _compressed(self, ctx: "StepContext", picks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(rows, mask, per_seq) of the batched mode.

        per_seq False: rows [T, M, d] gathered per query row (the top-k picks), mask [T, M].
        per_seq True: rows [N, L, d], every compressed row of each sequence, read once, with
        mask [T, L] of the rows each query attends: V4 HCA layers (every causal entry), and
        top-k layers when L <= PER_SEQ_FACTOR * index_topk, where one dense pass over a
        sequence's rows is cheaper than copying k rows per query (prefill, short contexts).
        """
        batch = ctx.batch
        pre = ctx.addr.prefix(self.ratio)  # host width: the choice below reads nothing from the device
        if picks is not None and pre.width > PER_SEQ_FACTOR * picks.shape[1]:
            return ctx.cache.gather_rows("kv", self.layer, ctx.seq_index, picks, batch), picks >= 0, False
        rows, valid = ctx.cache.gather_prefix("kv", self.layer, pre.n_rows, batch)
        if picks is not None:
            return rows, picks_to_mask(picks, rows.shape[1]), True
        return rows, valid[ctx.seq_index] & pre.causal, True  # V4 HCA: every causal compressed entry

    # ---- batch-invariant ------------------------------------------------------------------------------
    def forward_invariant(self, q: torch.Tensor, kv: torch.Tensor, picks: torch.Tensor | None, ctx: "StepContext",
                          sink: torch.Tensor) -> torch.Tensor:
        return self._rows(q, kv, picks, ctx, sink, self._attend_torch)

    def forward_native(self, q: torch.Tensor, kv: torch.Tensor, picks: torch.Tensor | None, ctx: "StepContext",
                       sink: torch.Tensor) -> torch.Tensor:
        if not servable(q):  # (kv of another dtype than q: `in_place` and `_attend_native` decline it)
            return self.forward_invariant(q, kv, picks, ctx, sink)
        o = self.in_place(q, kv, picks, ctx, sink)
        return o if o is not None else self._rows(q, kv, picks, ctx, sink, self._attend_native)

    def in_place(self, q: torch.Tensor, kv: torch.Tensor, picks: torch.Tensor | None, ctx: "StepContext",
                 sink: torch.Tensor) -> torch.Tensor | None:
        """`forward_native` with every key read where the cache stores it (`kernels/attn.py`: the
        window ring and this step's rows, the pool's compressed rows through the block table), all
        rows in one call; the same keys in the same order as the gathers. None (nothing read,
        nothing deferred) where the backend does not offer in-place reads of these rows (the dense
        cache; rows of a format the kernel does not decode) or q and kv differ in dtype. Quantised
        rows are decoded once into a copy where that pays (`decode_pays`: prefill chunks), else
        decoded by the kernel as it reads them (decode steps)."""
        cache = ctx.cache
        if q.dtype != kv.dtype:
            return None
        decode = self.decode_pays(ctx, picks)
        rows = (cache.pool_keys("kv", self.layer, q.dtype, ctx.batch, decode=decode, reader_decodes=True)
                if self.ratio > 0 else None)
        if self.ratio > 0 and rows is None:
            return None
        win = cache.window_keys("window", self.layer, kv, self.window, ctx.batch, decode=decode, reader_decodes=True)
        if win is None:
            return None
        if rows is None:
            return paged_attention(q, win.ring, win.step, win.meta, win.depth, sink, self.scale, ring_codec=win.codec)
        pre = ctx.addr.prefix(self.ratio)
        counts = pre.compress_len if picks is None else None  # V4 HCA: every causal entry
        if picks is not None and picks.shape[1] > pre.width:
            # a row picks at most its causal count <= width entries, listed first: the columns past
            # the width are -1 for every row (they add nothing; the kernel need not visit them)
            picks = picks[:, :pre.width]
        return paged_attention(q, win.ring, win.step, win.meta, win.depth, sink, self.scale, rows.view,
                               rows.tables, ctx.seq_index, picks, counts, rows.ratio, rows.block_size, win.codec,
                               rows.codec)

    def decode_pays(self, ctx: "StepContext", picks: torch.Tensor | None) -> bool:
        """Whether quantised cache rows are better decoded once for this step (the step's window
        rings and prefix blocks, `in_place` then reads the copies) than gathered per query row (T
        rows x (window + picks), each decoded): when the step reads more rows than its sequences
        hold (a prefill chunk of T tokens: T x (W + k) rows gathered vs about W + its compressed
        rows decoded; one decode token per sequence: the gather). Host ints only; either way the
        kernel sees the same keys in the same order (the same bits)."""
        addr = ctx.addr
        width = addr.prefix(self.ratio).width if self.ratio > 0 else 0
        per_row = self.window + (min(width, picks.shape[1]) if picks is not None else width)
        return addr.num_tokens * per_row > addr.num_seqs * (self.window + width)

    def _rows(self, q: torch.Tensor, kv: torch.Tensor, picks: torch.Tensor | None, ctx: "StepContext",
              sink: torch.Tensor, attend: Attend) -> torch.Tensor:
        """Every query row over its own gathered keys (``forward_invariant``'s shapes), by `attend`."""
        win, win_valid = ctx.cache.history("window", self.layer, kv, self.window, ctx.batch)
        if self.ratio == 0:
            return attend(q, win, win_valid, sink)
        seq = ctx.seq_index
        buckets = ctx.addr.length_buckets(self.ratio, invariant.BUCKET)  # a few per step, host ints
        if picks is not None:
            k = picks.shape[1]
            if buckets[0][0] >= k:  # every row may hold k picks: one product shape for all
                return self._picked(ctx, q, win, win_valid, seq, picks, sink, attend)
            out = q.new_empty(q.shape)
            for b, rows_b in buckets:
                # a row picks at most its causal count (pos + 1) // ratio <= b entries, listed first
                # (ops/topk.py): columns past min(b, k) are -1 padding for every row of the bucket
                out[rows_b] = self._picked(ctx, q[rows_b], win[rows_b], win_valid[rows_b], seq[rows_b],
                                           picks[rows_b, :min(b, k)], sink, attend)
            return out
        n_causal = ctx.addr.prefix(self.ratio).compress_len
        out = q.new_empty(q.shape)
        for b, rows_b in buckets:
            j = torch.arange(b, device=q.device).unsqueeze(0).expand(rows_b.numel(), -1)
            j = j.masked_fill(j >= n_causal[rows_b].unsqueeze(1), -1)
            out[rows_b] = self._picked(ctx, q[rows_b], win[rows_b], win_valid[rows_b], seq[rows_b], j, sink, attend)
        return out

    def _picked(self, ctx: "StepContext", q: torch.Tensor, win: torch.Tensor, win_valid: torch.Tensor,
                seq: torch.Tensor, picks: torch.Tensor, sink: torch.Tensor, attend: Attend) -> torch.Tensor:
        """Query rows q [T, H, d] over their window keys, then their picked compressed rows
        (picks [T, m], -1 = none) gathered from the cache. `seq` [T] goes as it is (the backend
        broadcasts it): the step's own tensor, so a layer reading the same region with the same picks
        (a Reuse layer when sharing) gets the rows its source gathered (StepReadCache keys by identity)."""
        rows = ctx.cache.gather_rows("kv", self.layer, seq, picks, ctx.batch)
        return attend(q, win, win_valid, sink, rows, picks >= 0)

    def _attend_torch(self, q: torch.Tensor, win: torch.Tensor, win_valid: torch.Tensor, sink: torch.Tensor,
                      rows: torch.Tensor | None = None, rows_valid: torch.Tensor | None = None) -> torch.Tensor:
        """`sparse_attention` of each query row over its window keys, then its compressed `rows` (if any)."""
        if rows is not None:
            win = torch.cat([win, rows.to(win.dtype)], dim=1)
            win_valid = torch.cat([win_valid, rows_valid], dim=1)
        return sparse_attention(q, win, win_valid, sink, self.scale)

    def _attend_native(self, q: torch.Tensor, win: torch.Tensor, win_valid: torch.Tensor, sink: torch.Tensor,
                       rows: torch.Tensor | None = None, rows_valid: torch.Tensor | None = None) -> torch.Tensor:
        """`_attend_torch` through the native kernel (no concatenation, its own summation order)
        where the window rows have q's dtype (they are the cache's decoded rows)."""
        if q.dtype != win.dtype:
            return self._attend_torch(q, win, win_valid, sink, rows, rows_valid)
        return native.sparse_attention(q, win, win_valid, sink, self.scale, rows, rows_valid)


def servable(t: torch.Tensor) -> bool:
    """Whether the native kernels take the activation `t` in this call: bf16 / fp32 (a model cast
    after it was bound may run other dtypes), autograd not tracking it. The device is a bind-time
    fact (`KernelChoice`: native only for a CPU model). One tensor attribute read without autograd."""
    return t.dtype in _FLOATS and not (torch.is_grad_enabled() and t.requires_grad)
