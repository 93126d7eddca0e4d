"""Banded window + per-sequence compressed attention, without per-query-row copies.

Same maths as `sparse_attention` (spec/model.md §4.7): for query row t at position p, head h,
over the window rows at positions p-W+1..p (those >= 0) and the selected compressed rows,
``o = sum_i exp(s_i - m) kv_i / (sum_i exp(s_i - m) + exp(sink_h - m))`` with
``m = max(max_i s_i, sink_h)``.

Layout (queries regrouped per sequence into a padded [N, S, H, d] tensor; a sequence's rows
are contiguous in the step):

* window: each sequence's keys are one contiguous run ``win`` [N, P + S, d] — the P = W-1 rows
  before the chunk (ring) followed by the chunk's own rows — so key index i is position
  ``start - P + i``. Query rank r attends key indices r..r+P. Queries are taken in blocks of
  `block` rows; a block's keys are one strided view (``unfold``) of width block + P, scored by
  one batched matmul and masked by a fixed band, so nothing is copied per query row;
* compressed: every row of the sequence ``comp`` [N, L, d], read once, with a per-row mask
  ``comp_mask`` [T, L] (top-k picks scattered into a mask, or every causal entry).

A sequence with a long chunk (a prefill) skips the blocks: `sequence_band` scores exactly its W
window keys per row (no masked half-band), one sequence at a time.

The sums run in a different order than `sparse_attention`'s single concatenated sum (window and
compressed parts reduced separately, masked zeros included), so results agree to rounding, not
bits. Computed in fp32 (float64 for float64 inputs), returned in q's dtype.
"""

from __future__ import annotations

import torch

from kvshare.ops.sequence_band import attend_by_sequence
from kvshare.precision import wide
from kvshare.step.addresses import SeqRows

# a sequence with this many rows in the step (a prefill chunk) is attended on its own, W scores
# per row; its ~15 kernel launches are then small next to the half-band scores they save.
# Decode rows and short chunks stay banded (and bit for bit as before).
BY_SEQUENCE_MIN_ROWS = 64


def picks_to_mask(picks: torch.Tensor, width: int) -> torch.Tensor:
    """[T, width] bool: True at each row's picked positions (-1 entries ignored)."""
    mask = torch.zeros(picks.shape[0], width + 1, dtype=torch.bool, device=picks.device)
    mask.scatter_(1, torch.where(picks >= 0, picks, torch.full_like(picks, width)), True)
    return mask[:, :width]


def regroup(x: torch.Tensor, seq_index: torch.Tensor, rank: torch.Tensor, n: int, s: int) -> torch.Tensor:
    """Rows [T, ...] -> zero-padded [N, S, ...] with row t at [seq_index[t], rank[t]]."""
    out = x.new_zeros((n, s, *x.shape[1:]))
    out[seq_index, rank] = x
    return out


def window_keys(prior: torch.Tensor, values: torch.Tensor, seq_index: torch.Tensor, rank: torch.Tensor,
                s: int) -> torch.Tensor:
    """[N, P + S, d]: each sequence's P stored rows before the chunk, then its chunk rows (zero-padded)."""
    return torch.cat([prior, regroup(values.to(prior.dtype), seq_index, rank, prior.shape[0], s)], dim=1)


def prefix_attention(
    q: torch.Tensor,  # [T, H, d]
    win: torch.Tensor,  # [N, P + S, d] window keys per sequence (see `window_keys`)
    starts: torch.Tensor,  # [N] position of each sequence's first chunk row
    comp: torch.Tensor | None,  # [N, L, d] compressed rows per sequence, or None
    comp_mask: torch.Tensor | None,  # [T, L] bool
    seq_index: torch.Tensor,  # [T]
    rank: torch.Tensor,  # [T] row's index within its sequence's chunk
    sink: torch.Tensor,  # [H]
    scale: float,
    block: int = 64,
    by_sequence: bool | None = None,
    rows: SeqRows | None = None,
) -> torch.Tensor:
    """[T, H, d] attention output (see module doc).

    Sequences with at least BY_SEQUENCE_MIN_ROWS rows in the step go through
    `sequence_band.attend_by_sequence` (W scores per row instead of block + W - 1), the others
    through the banded blocks; `by_sequence` True / False sends every sequence one way. The
    choice depends only on a sequence's own chunk length, so a row's result does not depend on
    the other sequences of the step. `rows` (the step's addresses: host chunk lengths and starts,
    rows contiguous per sequence and in order) spares every host read of device values.
    """
    t, n = q.shape[0], win.shape[0]
    fresh = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, win, comp, sink))
    if rows is not None:
        return _by_host_rows(q, win, starts, comp, comp_mask, seq_index, rows, sink, scale, block, by_sequence, fresh)
    if t == 0 or by_sequence is False:
        return _banded(q, win, starts, comp, comp_mask, seq_index, rank, sink, scale, block, fresh)
    lens = torch.bincount(seq_index, minlength=n)
    long = torch.ones_like(lens, dtype=torch.bool) if by_sequence else lens >= BY_SEQUENCE_MIN_ROWS
    n_long = int(long.sum())
    if n_long == 0:
        return _banded(q, win, starts, comp, comp_mask, seq_index, rank, sink, scale, block, fresh)
    p_len = win.shape[1] - int(lens.max())
    if n_long == n:
        return attend_by_sequence(q, win, p_len, starts.tolist(), lens.tolist(), comp, comp_mask, sink, scale, fresh)
    # both kinds: each part on its own rows (sequence order and row order kept), then merged
    row_long = long[seq_index]
    rows_l, rows_s = row_long.nonzero().squeeze(1), (~row_long).nonzero().squeeze(1)
    o_l = attend_by_sequence(q[rows_l], win[long], p_len, starts[long].tolist(), lens[long].tolist(),
                             None if comp is None else comp[long],
                             None if comp_mask is None else comp_mask[rows_l], sink, scale, fresh)
    short = ~long
    renumber = torch.cumsum(short, 0) - 1  # old sequence index -> index among the short ones
    s_short = int(lens[short].max())
    o_s = _banded(q[rows_s], win[short][:, :p_len + s_short], starts[short], None if comp is None else comp[short],
                  None if comp_mask is None else comp_mask[rows_s], renumber[seq_index[rows_s]], rank[rows_s],
                  sink, scale, block, fresh)
    out = q.new_zeros(q.shape)
    out[rows_l] = o_l
    out[rows_s] = o_s
    return out


def _by_host_rows(q: torch.Tensor, win: torch.Tensor, starts: torch.Tensor, comp: torch.Tensor | None,
                  comp_mask: torch.Tensor | None, seq_index: torch.Tensor, rows: SeqRows, sink: torch.Tensor,
                  scale: float, block: int, by_sequence: bool | None, fresh: bool) -> torch.Tensor:
    """`prefix_attention` with the row layout known on the host: the same split and the same
    kernels as the device-derived path, decided without reading device values."""
    t, n, lens, rank = q.shape[0], win.shape[0], rows.lens, rows.rank
    if by_sequence is None:
        long = [k >= BY_SEQUENCE_MIN_ROWS for k in lens]
    else:
        long = [bool(by_sequence)] * n
    if t == 0 or not any(long):
        return _banded(q, win, starts, comp, comp_mask, seq_index, rank, sink, scale, block, fresh, rows.max_len)
    p_len = win.shape[1] - rows.max_len
    if all(long):
        return attend_by_sequence(q, win, p_len, rows.starts, lens, comp, comp_mask, sink, scale, fresh)
    # both kinds: each part on its own rows (sequence order and row order kept), then merged
    first = [sum(lens[:i]) for i in range(n)]
    dev = q.device
    seq_l = [i for i in range(n) if long[i]]
    seq_s = [i for i in range(n) if not long[i]]
    idx = torch.tensor([r for i in seq_l for r in range(first[i], first[i] + lens[i])]
                       + [r for i in seq_s for r in range(first[i], first[i] + lens[i])]
                       + seq_l + seq_s + [k for k, i in enumerate(seq_s) for _ in range(lens[i])], device=dev)
    n_rl = sum(lens[i] for i in seq_l)
    n_rs = t - n_rl
    rows_l, rows_s = idx[:n_rl], idx[n_rl:t]
    sl, ss = idx[t:t + len(seq_l)], idx[t + len(seq_l):t + n]
    renum = idx[t + n:]
    o_l = attend_by_sequence(q[rows_l], win[sl], p_len, [rows.starts[i] for i in seq_l], [lens[i] for i in seq_l],
                             None if comp is None else comp[sl],
                             None if comp_mask is None else comp_mask[rows_l], sink, scale, fresh)
    s_short = max(lens[i] for i in seq_s)
    o_s = _banded(q[rows_s], win[ss][:, :p_len + s_short], starts[ss], None if comp is None else comp[ss],
                  None if comp_mask is None else comp_mask[rows_s], renum, rank[rows_s], sink, scale, block, fresh,
                  s_short)
    assert renum.shape[0] == n_rs
    out = q.new_zeros(q.shape)
    out[rows_l] = o_l
    out[rows_s] = o_s
    return out


def _banded(q: torch.Tensor, win: torch.Tensor, starts: torch.Tensor, comp: torch.Tensor | None,
            comp_mask: torch.Tensor | None, seq_index: torch.Tensor, rank: torch.Tensor, sink: torch.Tensor,
            scale: float, block: int, fresh: bool, max_rows: int | None = None) -> torch.Tensor:
    """`prefix_attention` by banded blocks of `block` query rows (see the module doc). `max_rows`
    (host): the longest sequence's rows, given when rows are known to be contiguous per sequence
    and in order (then no device value is read)."""
    t, h, d = q.shape
    n = win.shape[0]
    if max_rows is None:
        p_len = win.shape[1] - (int(rank.max()) + 1 if t else 0)
    else:
        p_len = win.shape[1] - (max_rows if t else 0)
    s = win.shape[1] - p_len
    bq = max(1, min(block, s))
    nb = -(-s // bq)
    sp = nb * bq
    qf = wide(q)
    acc = qf.dtype
    kw = wide(win).to(acc)
    if sp > s:
        kw = torch.cat([kw, kw.new_zeros(n, sp - s, d)], dim=1)
    # rows already in [N, Sp] order (equal-length sequences, no block padding): views, not copies
    if max_rows is not None:  # rows in sequence order: t == n * sp means every sequence fills its sp rows
        dense = t == n * sp
    else:
        dense = t == n * sp and bool(torch.equal(seq_index * sp + rank, torch.arange(t, device=q.device)))
    q_pad = qf.view(n, sp, h, d) if dense else regroup(qf, seq_index, rank, n, sp)  # [N, Sp, H, d]
    width = bq + p_len
    kb = kw.unfold(1, width, bq)  # [N, nb, d, width] view: block b's keys are indices b*bq .. b*bq+width-1
    # without autograd the score/probability blocks are rewritten in place (same values, bit for
    # bit, minus four full-size temporaries); with autograd (`fresh`) the out-of-place ops keep the graph
    s_w = torch.matmul(q_pad.view(n, nb, bq * h, d), kb).view(n, nb, bq, h, width)
    s_w = s_w * scale if fresh else s_w.mul_(scale)
    a = torch.arange(bq, device=q.device)
    j = torch.arange(width, device=q.device)
    band = (j[None, :] >= a[:, None]) & (j[None, :] <= a[:, None] + p_len)  # [bq, width]
    key_pos = starts[:, None, None] - p_len + torch.arange(nb, device=q.device)[None, :, None] * bq + j  # [N, nb, width]
    ok = band[None, None, :, None, :] & (key_pos >= 0)[:, :, None, None, :]
    s_w = (s_w.masked_fill(~ok, float("-inf")) if fresh else s_w.masked_fill_(~ok, float("-inf"))).view(n, sp, h, width)
    sink_f = wide(sink).to(acc).view(1, 1, h)
    m = torch.maximum(s_w.amax(dim=-1), sink_f)
    s_c = None
    if comp is not None and comp.shape[1] > 0:
        cf = wide(comp).to(acc)
        length = cf.shape[1]
        s_c = torch.bmm(q_pad.view(n, sp * h, d), cf.transpose(1, 2)).view(n, sp, h, length)
        s_c = s_c * scale if fresh else s_c.mul_(scale)
        cm = comp_mask.view(n, sp, -1) if dense else regroup(comp_mask, seq_index, rank, n, sp)
        cmask = ~cm[:, :, None, :]  # [N, Sp, 1, L]
        s_c = s_c.masked_fill(cmask, float("-inf")) if fresh else s_c.masked_fill_(cmask, float("-inf"))
        m = torch.maximum(m, s_c.amax(dim=-1))
    p_w = torch.exp(s_w - m.unsqueeze(-1)) if fresh else s_w.sub_(m.unsqueeze(-1)).exp_()
    denom = p_w.sum(dim=-1) + torch.exp(sink_f - m)
    o = torch.matmul(p_w.view(n, nb, bq * h, width), kb.transpose(-1, -2)).view(n, sp, h, d)
    if s_c is not None:
        p_c = torch.exp(s_c - m.unsqueeze(-1)) if fresh else s_c.sub_(m.unsqueeze(-1)).exp_()
        denom = denom + p_c.sum(dim=-1)
        o_c = torch.bmm(p_c.view(n, sp * h, -1), cf).view(n, sp, h, d)
        o = o + o_c if fresh else o.add_(o_c)
    o = o / denom.unsqueeze(-1) if fresh else o.div_(denom.unsqueeze(-1))
    return (o.view(t, h, d) if dense else o[seq_index, rank]).to(q.dtype)
