"""Lightning-indexer scores (spec/model.md §4.6): I[t, j] = sum_h w[t, h] * ReLU(q[t, h] . k[j]).

**kvshare decision (§13):** the dot products and the head sum are accumulated in fp64 and the
result is rounded to fp32 once. Every product of two fp32 (or FP4-rounded) numbers is exact in
fp64 and the fp64 sum's rounding error is far below fp32 resolution, so a row's scores do not
depend on how many rows or keys share the batch (the kernel's reduction order no longer shows
up after the final fp32 rounding). This keeps one-shot prefill, chunked prefill, decode and
batched serving on the same selections.

Layout: query rows are regrouped per sequence into a padded [N, S, H, d] tensor so that each
sequence's keys are multiplied once by all of its rows (a batched matmul), instead of copying the
keys once per query row. Rows are processed in blocks of the padded S axis, and each block only
involves the sequences that have rows in it, so fp64 intermediates stay near `budget` elements
(a memory bound, not a per-token loop); results do not depend on the block size.
"""

from __future__ import annotations

import torch

DEFAULT_BUDGET = 1 << 25  # fp64 elements per intermediate (256 MiB)


def _rank_in_sequence(seq_index: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row's rank within its sequence [T], rows per sequence [N]); rows keep their order."""
    t = seq_index.numel()
    counts = torch.bincount(seq_index, minlength=n)
    order = torch.argsort(seq_index, stable=True)
    first = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(seq_index)
    rank[order] = torch.arange(t, device=seq_index.device) - first[seq_index[order]]
    return rank, counts


def index_scores(
    q: torch.Tensor,  # [T, H, d] index queries (post-RoPE, quantised as configured)
    weights: torch.Tensor,  # [T, H] head weights, already scaled
    keys: torch.Tensor,  # [N, L, d] index keys of each sequence
    seq_index: torch.Tensor,  # [T] sequence of each query row
    budget: int = DEFAULT_BUDGET,
) -> torch.Tensor:
    """[T, L] fp32 scores of every query row against all L key rows of its own sequence."""
    t, h, d = q.shape
    n, length = keys.shape[0], keys.shape[1]
    out = torch.empty(t, length, dtype=torch.float32, device=q.device)
    if t == 0 or length == 0:
        return out
    rank, counts = _rank_in_sequence(seq_index, n)
    s_max = int(counts.max())
    q_pad = q.new_zeros((n, s_max, h, d), dtype=torch.float64)
    q_pad[seq_index, rank] = q.double()
    w_pad = weights.new_zeros((n, s_max, h), dtype=torch.float64)
    w_pad[seq_index, rank] = weights.double()
    scores = torch.empty(n, s_max, length, dtype=torch.float32, device=q.device)
    kd_t = keys.double().transpose(1, 2)  # [N, d, L]
    block = max(1, budget // max(1, n * h * max(length, d)))
    for s0 in range(0, s_max, block):
        s1 = min(s_max, s0 + block)
        active = (counts > s0).nonzero().squeeze(1)  # sequences with rows in this block
        qb = q_pad[active, s0:s1].reshape(active.numel(), (s1 - s0) * h, d)
        dots = torch.bmm(qb, kd_t[active]).view(active.numel(), s1 - s0, h, length)
        summed = torch.einsum("nshl,nsh->nsl", torch.relu(dots), w_pad[active, s0:s1])
        scores[active, s0:s1] = summed.float()
    out[:] = scores[seq_index, rank]
    return out
