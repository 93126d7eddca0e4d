"""Lightning-indexer scores (spec/model.md §4.6): I[t, j] = sum_h w[t, h] * ReLU(q[t, h] . k[j]).

**kvshare decision (§13):** the dot products and the head sum are accumulated in fp64 and the
result is rounded to fp32 once. Every product of two fp32 (or FP4-rounded) numbers is exact in
fp64 and the fp64 sum's rounding error is far below fp32 resolution, so a row's scores do not
depend on how many rows or keys share the batch (the kernel's reduction order no longer shows
up after the final fp32 rounding). This keeps one-shot prefill, chunked prefill, decode and
batched serving on the same selections.

Memory: query rows are processed in blocks so that the fp64 intermediates stay near
`budget` elements (a memory bound, not a per-token loop); results do not depend on the block size.
"""

from __future__ import annotations

import torch

DEFAULT_BUDGET = 1 << 26  # fp64 elements per intermediate (512 MiB)


def index_scores(
    q: torch.Tensor,  # [T, H, d] index queries (post-RoPE, quantised as configured)
    weights: torch.Tensor,  # [T, H] head weights, already scaled
    keys: torch.Tensor,  # [N, L, d] index keys of each sequence
    seq_index: torch.Tensor,  # [T] sequence of each query row
    budget: int = DEFAULT_BUDGET,
) -> torch.Tensor:
    """[T, L] fp32 scores of every query row against all L key rows of its own sequence."""
    t, h, d = q.shape
    length = keys.shape[1]
    out = torch.empty(t, length, dtype=torch.float32, device=q.device)
    if t == 0 or length == 0:
        return out
    kd = keys.double()
    rows = max(1, budget // max(1, length * max(h, d)))
    for start in range(0, t, rows):
        end = min(t, start + rows)
        dots = torch.einsum("thd,tld->thl", q[start:end].double(), kd[seq_index[start:end]])
        out[start:end] = torch.einsum("thl,th->tl", torch.relu(dots), weights[start:end].double()).float()
    return out
