"""Lightning-indexer scores (spec/model.md §4.6): I[t, j] = sum_h w[t, h] * ReLU(q[t, h] . k[j]).

**kvshare decision (§13):** the dot products and the head sum are accumulated in fp64 and the
result is rounded to fp32 once. Every product of two fp32 (or FP4-rounded) numbers is exact in
fp64 and the fp64 sum's rounding error is far below fp32 resolution, so a row's scores do not
depend on how many rows or keys share the batch (the kernel's reduction order no longer shows
up after the final fp32 rounding). This keeps one-shot prefill, chunked prefill, decode and
batched serving on the same selections.
"""

from __future__ import annotations

import torch


def index_scores(
    q: torch.Tensor,  # [T, H, d] index queries (post-RoPE, quantised as configured)
    weights: torch.Tensor,  # [T, H] head weights, already scaled
    keys: torch.Tensor,  # [N, L, d] index keys of each sequence
    seq_index: torch.Tensor,  # [T] sequence of each query row
) -> torch.Tensor:
    """[T, L] fp32 scores of every query row against all L key rows of its own sequence.

    With several rows per sequence (prefill) each sequence's rows are one matmul against its own
    keys, so the keys are never copied per query row (a [T, L, d] fp64 gather was 17 GB at a
    2048-token chunk over 16K keys); the values are bit-identical to the gathered form.
    """
    t, h, d = q.shape
    length = keys.shape[1]
    qd, wd = q.double(), weights.double()
    if t <= keys.shape[0]:  # at most one row per sequence (decode): the gather duplicates nothing
        dots = torch.einsum("thd,tld->thl", qd, keys.double()[seq_index])
        return torch.einsum("thl,th->tl", torch.relu(dots), wd).float()
    out = torch.empty(t, length, dtype=torch.float32, device=q.device)
    for i in torch.unique(seq_index).tolist():
        rows = (seq_index == i).nonzero().squeeze(1)
        dots = (qd.index_select(0, rows).reshape(-1, d) @ keys[i].double().T).view(-1, h, length)
        out.index_copy_(0, rows, torch.einsum("thl,th->tl", torch.relu(dots), wd.index_select(0, rows)).float())
    return out
