"""Deterministic top-k over compressed positions (spec/model.md §4.6, §8, §13).

Rules:

* causality: row t may pick compressed position j only if ``j < compress_len[t]`` with
  ``compress_len = (t + 1) // ratio``;
* picks whose (masked) score is -inf are dropped, so a row with fewer than k reachable entries
  selects all of them and pads with -1 (-1 is never used as a tensor index);
* ties are broken toward the LOWER position (a stable descending sort), so the result does not
  depend on the top-k algorithm;
* each row's picks are returned sorted ascending, -1 padding last.
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


def select_topk(scores: torch.Tensor, compress_len: torch.Tensor, k: int) -> torch.Tensor:
    """[T, k] int64 ascending picks of each row (-1 padded) from [T, W] scores.

    Columns at or past ``compress_len[t]`` and -inf scores are never picked.
    """
    t, w = scores.shape
    masked = scores.masked_fill(~causal_mask(w, compress_len), float("-inf"))
    vals, idx = stable_topk(masked, k)
    idx = torch.where(vals > float("-inf"), idx, torch.full_like(idx, -1))
    key = torch.where(idx < 0, torch.full_like(idx, w), idx)
    idx = torch.sort(key, dim=-1).values
    idx = torch.where(idx >= w, torch.full_like(idx, -1), idx)
    if idx.shape[1] < k:
        idx = torch.cat([idx, idx.new_full((t, k - idx.shape[1]), -1)], dim=1)
    return idx


def boundary_ties(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[T] bool: rows whose k-th and (k+1)-th largest finite scores are exactly equal.

    At such a tie the selection depends on the tie-break rule; tests report these rows.
    """
    if scores.shape[-1] <= k or k <= 0:
        return torch.zeros(scores.shape[0], dtype=torch.bool, device=scores.device)
    vals, _ = stable_topk(scores, k + 1)
    kth, nxt = vals[:, k - 1], vals[:, k]
    return (kth == nxt) & torch.isfinite(nxt)
