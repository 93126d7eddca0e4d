"""Deterministic top-k over compressed positions (spec/model.md §4.6, §8, §13).

Rules:

* causality: row t may pick compressed position j only if ``j < compress_len[t]`` with
  ``compress_len = (t + 1) // ratio``;
* picks whose (masked) score is -inf are dropped, so a row with fewer than k reachable entries
  selects all of them and pads with -1 (-1 is never used as a tensor index);
* ties are broken toward the LOWER position (a stable descending sort), so the result does not
  depend on the top-k algorithm;
* each row's picks are returned sorted ascending, -1 padding last.

`topk_mask` finds the set without sorting the row: ``torch.topk`` gives the k-th largest value
v; every entry > v is in, and of the entries == v the lowest positions fill the remaining
places (a cumulative count). This is exactly the set a stable descending sort keeps, in
O(W) work plus topk's partial selection; `select_topk` then lists the set in ascending order
with a cumulative count and a scatter instead of a second sort.
"""

from __future__ import annotations

import torch


def causal_mask(width: int, compress_len: torch.Tensor) -> torch.Tensor:
    """[T, width] bool: True where column j < compress_len[t]."""
    j = torch.arange(width, device=compress_len.device)
    return j.unsqueeze(0) < compress_len.unsqueeze(1)


def stable_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest entries per row, ties toward the lower index.

    `k` may exceed the row width; the result is then only `width` wide.
    """
    k = min(k, scores.shape[-1])
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    return scores.gather(-1, order), order


def topk_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[T, W] bool: the min(k, W) largest entries of each row, ties toward the lower position.

    Rows must not hold NaN. -inf entries can be part of the set (when a row has fewer than k
    finite entries); callers that drop them mask with ``scores > -inf``.
    """
    t, w = scores.shape
    k = min(k, w)
    if k <= 0:
        return torch.zeros(t, w, dtype=torch.bool, device=scores.device)
    if k == w:
        return torch.ones(t, w, dtype=torch.bool, device=scores.device)
    kth = torch.topk(scores, k, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
    above = scores > kth
    tied = scores == kth
    room = k - above.sum(dim=-1, keepdim=True)
    return above | (tied & (tied.cumsum(dim=-1) <= room))


def mask_to_ascending(mask: torch.Tensor, k: int) -> torch.Tensor:
    """[T, k] int64: the column ids of each row's True entries in ascending order, -1 padded
    (a row must have at most k True entries)."""
    t, w = mask.shape
    slot = mask.cumsum(dim=-1) - 1
    slot = torch.where(mask, slot, torch.full_like(slot, k))  # unpicked columns land in a spare slot
    out = torch.full((t, k + 1), -1, dtype=torch.int64, device=mask.device)
    cols = torch.arange(w, device=mask.device).expand(t, w)
    out.scatter_(1, slot, cols)
    return out[:, :k]


def select_topk(scores: torch.Tensor, compress_len: torch.Tensor, k: int) -> torch.Tensor:
    """[T, k] int64 ascending picks of each row (-1 padded) from [T, W] scores.

    Columns at or past ``compress_len[t]`` and -inf scores are never picked.
    """
    w = scores.shape[1]
    masked = scores.masked_fill(~causal_mask(w, compress_len), float("-inf"))
    picked = topk_mask(masked, k) & (masked > float("-inf"))
    return mask_to_ascending(picked, k)


def boundary_ties(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[T] bool: rows whose k-th and (k+1)-th largest finite scores are exactly equal.

    At such a tie the selection depends on the tie-break rule; tests report these rows.
    """
    if scores.shape[-1] <= k or k <= 0:
        return torch.zeros(scores.shape[0], dtype=torch.bool, device=scores.device)
    vals, _ = stable_topk(scores, k + 1)
    kth, nxt = vals[:, k - 1], vals[:, k]
    return (kth == nxt) & torch.isfinite(nxt)
