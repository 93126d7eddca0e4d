"""Candidate blocks of the two-level indexer (spec/model.md §4.6.1; REF41 `select_candidate_blocks`).

Per query row t, from the causally masked scores I[t, :] of width Wc:

1. pad to a multiple of the block size b with -inf; block score = max over its b positions;
2. pin the newest block ``(compress_len[t] - 1) // b`` to +inf (nothing when compress_len is 0);
3. keep the top ``min(topk_blocks, n_blocks)`` blocks (ties toward the lower block id), dropping
   blocks whose score is -inf (unreachable);
4. expand to a per-position bool mask of width Wc.

The mask is per block, so it may include positions >= compress_len inside the newest block;
those scores are -inf anyway.
"""

from __future__ import annotations

import torch

from kvshare.ops.topk import topk_mask


def block_scores(scores: torch.Tensor, block_size: int) -> torch.Tensor:
    """[T, ceil(W / b)] max score of each block of b consecutive positions (-inf padded)."""
    t, w = scores.shape
    nb = -(-w // block_size)
    pad = nb * block_size - w
    if pad:
        scores = torch.cat([scores, scores.new_full((t, pad), float("-inf"))], dim=1)
    return scores.view(t, nb, block_size).amax(dim=-1)


def candidate_block_mask(
    scores: torch.Tensor, compress_len: torch.Tensor, block_size: int, topk_blocks: int
) -> torch.Tensor:
    """[T, W] bool mask of the positions inside each row's candidate blocks (see module doc)."""
    t, w = scores.shape
    if w == 0:
        return torch.zeros(t, 0, dtype=torch.bool, device=scores.device)
    bs = block_scores(scores.float(), block_size)
    nb = bs.shape[1]
    newest = torch.div(compress_len - 1, block_size, rounding_mode="floor")
    pin = (newest >= 0).unsqueeze(1) & (torch.arange(nb, device=bs.device).unsqueeze(0) == newest.unsqueeze(1))
    bs = bs.masked_fill(pin, float("inf"))
    chosen = topk_mask(bs, topk_blocks) & (bs > float("-inf"))
    return chosen.repeat_interleave(block_size, dim=1)[:, :w]
