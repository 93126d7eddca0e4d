"""Window + compressed attention one sequence at a time, with exactly W keys per query row.

The maths is `prefix_attention`'s (spec/model.md §4.7): for query row r of a sequence whose chunk
starts at position p0, head h, over the window keys at positions p0+r-P .. p0+r (those >= 0,
P = W - 1) and the compressed rows ``comp_mask`` allows,
``o = sum_i e^(s_i - m) kv_i / (sum_i e^(s_i - m) + e^(sink_h - m))``, ``m = max(max_i s_i, sink_h)``.

A sequence's query rows are a contiguous run of the step (no regrouping) and its keys one
contiguous run ``win[n, :P + len]``; row r's W keys are the overlapping strided view
``unfold(0, W, 1)[r]``, scored by one batched matmul (batch = the sequence's rows, M = heads), so
no score is computed for a key outside the window (the banded blocks of `prefix_attention` score
``bq + P`` keys per row, about half of them masked). Only rows whose window reaches before
position 0 are masked. The cost is a few kernels per sequence, so the caller uses it for steps
with few, long sequences (prefill chunks). Sums run over the W window keys, then the compressed
rows, so results agree with the banded path to rounding, not bits.
"""

from __future__ import annotations

import torch

from kvshare.precision import wide


def attend_by_sequence(
    q: torch.Tensor,  # [T, H, d]; sequence n's rows are q[cu[n]:cu[n+1]]
    win: torch.Tensor,  # [N, >= P + len, d] window keys per sequence (see prefix_attention.window_keys)
    p_len: int,  # P = W - 1: stored rows before each sequence's chunk in `win`
    starts: list[int],  # [N] position of each sequence's first chunk row
    lens: list[int],  # [N] rows of each sequence in this step
    comp: torch.Tensor | None,  # [N, L, d] compressed rows per sequence, or None
    comp_mask: torch.Tensor | None,  # [T, L] bool
    sink: torch.Tensor,  # [H]
    scale: float,
    fresh: bool,  # autograd records: out-of-place ops only
) -> torch.Tensor:
    """[T, H, d] attention output in q's dtype (see module doc)."""
    t, h, d = q.shape
    width = p_len + 1
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32  # wide()'s dtype
    sink_f = wide(sink).to(acc).view(1, h)
    parts: list[torch.Tensor] = []
    out = None if fresh else q.new_empty(q.shape)
    begin = 0
    for n, (start, rows) in enumerate(zip(starts, lens)):
        if rows == 0:
            continue
        qf = wide(q[begin:begin + rows]).to(acc)  # [R, H, d]
        kb = wide(win[n, :p_len + rows]).to(acc).unfold(0, width, 1)  # [R, d, W] view: row r's keys
        s_w = torch.bmm(qf, kb)  # [R, H, W]
        s_w = s_w * scale if fresh else s_w.mul_(scale)
        if start < p_len:  # key i of row r sits at position start + r - P + i; mask those < 0
            r = torch.arange(rows, device=q.device)[:, None, None]
            i = torch.arange(width, device=q.device)
            before = start + r - p_len + i < 0
            s_w = s_w.masked_fill(before, float("-inf")) if fresh else s_w.masked_fill_(before, float("-inf"))
        m = torch.maximum(s_w.amax(dim=-1), sink_f)  # [R, H]
        s_c = cf = None
        if comp is not None and comp.shape[1] > 0:
            cf = wide(comp[n]).to(acc)  # [L, d]
            s_c = torch.matmul(qf, cf.t())  # [R, H, L]
            s_c = s_c * scale if fresh else s_c.mul_(scale)
            cmask = ~comp_mask[begin:begin + rows, None, :]
            s_c = s_c.masked_fill(cmask, float("-inf")) if fresh else s_c.masked_fill_(cmask, float("-inf"))
            m = torch.maximum(m, s_c.amax(dim=-1))
        mm = m.unsqueeze(-1)
        p_w = torch.exp(s_w - mm) if fresh else s_w.sub_(mm).exp_()
        denom = p_w.sum(dim=-1) + torch.exp(sink_f - m)
        o = torch.bmm(p_w, kb.transpose(1, 2))  # [R, H, d]
        if s_c is not None:
            p_c = torch.exp(s_c - mm) if fresh else s_c.sub_(mm).exp_()
            denom = denom + p_c.sum(dim=-1)
            o_c = torch.matmul(p_c, cf)
            o = o + o_c if fresh else o.add_(o_c)
        if out is not None:  # divided in fp32, rounded once on store into q's dtype
            torch.div(o, denom.unsqueeze(-1), out=out[begin:begin + rows])
        else:
            parts.append((o / denom.unsqueeze(-1)).to(q.dtype))
        begin += rows
    if out is not None:
        return out
    return torch.cat(parts) if parts else q.new_zeros(q.shape)
