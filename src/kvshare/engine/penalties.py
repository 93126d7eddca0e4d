"""Repetition, frequency and presence penalties, applied to a batch of logits in tensor ops.

Semantics (those of the OpenAI API and vLLM), per row, with ``c[v]`` the number of times token
``v`` occurs in the request's OUTPUT so far and ``seen[v]`` whether ``v`` occurs in its prompt or
output:

* repetition_penalty ``r`` (> 0, 1 = off): where ``seen[v]``, ``logit / r`` if ``logit > 0``
  else ``logit * r`` (so ``r > 1`` always makes a seen token less likely);
* then ``logit -= frequency_penalty * c[v] + presence_penalty * (c[v] > 0)``.

Counting is one batched scatter-add of the concatenated token ids of every penalised row (no
Python loop over the vocabulary); rows without penalties are not touched.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

# (prompt token ids, output token ids) of one request
History = tuple[Sequence[int], Sequence[int]]


def _scatter_counts(lists: list[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(lists), vocab] float32: how often each token id occurs in each list (one scatter-add)."""
    lens = torch.tensor([len(x) for x in lists], dtype=torch.int64)
    counts = torch.zeros(len(lists), vocab, dtype=torch.float32, device=device)
    total = int(lens.sum())
    if total:
        ids = torch.tensor(list(itertools.chain.from_iterable(lists)), dtype=torch.int64, device=device)
        rows = torch.repeat_interleave(torch.arange(len(lists), device=device), lens.to(device))
        counts.index_put_((rows, ids), torch.ones(total, dtype=torch.float32, device=device), accumulate=True)
    return counts


def apply_penalties(logits: torch.Tensor, histories: list[History], repetition: torch.Tensor,
                    frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """Penalised copy of `logits` [N, vocab]; the other arguments hold one entry per row.

    `repetition`, `frequency`, `presence`: float32 [N]. Token ids must lie in [0, vocab).
    """
    n, vocab = logits.shape
    if not (len(histories) == repetition.numel() == frequency.numel() == presence.numel() == n):
        raise ValueError(f"apply_penalties: {n} rows but {len(histories)} histories and "
                         f"{repetition.numel()}/{frequency.numel()}/{presence.numel()} penalty values")
    out_counts = _scatter_counts([h[1] for h in histories], vocab, logits.device)
    out = logits
    if bool((repetition != 1).any()):
        seen = (_scatter_counts([h[0] for h in histories], vocab, logits.device) + out_counts) > 0
        r = repetition[:, None]
        out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
    return out - frequency[:, None] * out_counts - presence[:, None] * (out_counts > 0).to(out.dtype)
