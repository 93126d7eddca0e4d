"""Repetition, frequency and presence penalties, applied to a batch of logits in tensor ops.

Semantics (those of the OpenAI API and vLLM), per row, with ``c[v]`` the number of times token
``v`` occurs in the request's OUTPUT so far and ``seen[v]`` whether ``v`` occurs in its prompt or
output:

* repetition_penalty ``r`` (> 0, 1 = off): where ``seen[v]``, ``logit / r`` if ``logit > 0``
  else ``logit * r`` (so ``r > 1`` always makes a seen token less likely);
* then ``logit -= frequency_penalty * c[v] + presence_penalty * (c[v] > 0)``.

`apply_penalties` counts from the histories (one batched scatter-add of the concatenated ids);
the engine's Sampler keeps `PenaltyCounts` instead: per request, the prompt's token set (counted
once) and the output's counts, brought up to date with only the tokens appended since the last
step, so a step's penalty work does not grow with the request's history. Rows without
penalties are not touched.
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
    if len(histories) != n:
        raise ValueError(f"apply_penalties: {n} rows but {len(histories)} histories")
    out_counts = _scatter_counts([h[1] for h in histories], vocab, logits.device)
    in_prompt = _scatter_counts([h[0] for h in histories], vocab, logits.device) > 0
    return penalise(logits, out_counts, in_prompt, repetition, frequency, presence)


def penalise(logits: torch.Tensor, out_counts: torch.Tensor, in_prompt: torch.Tensor, repetition: torch.Tensor,
             frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """The formulas (module doc) given each row's output counts [N, vocab] and prompt set [N, vocab]."""
    n = logits.shape[0]
    if not (out_counts.shape[0] == in_prompt.shape[0] == repetition.numel() == frequency.numel()
            == presence.numel() == n):
        raise ValueError(f"apply_penalties: {n} rows but {out_counts.shape[0]} histories and "
                         f"{repetition.numel()}/{frequency.numel()}/{presence.numel()} penalty values")
    out = logits
    if bool((repetition != 1).any()):
        seen = in_prompt | (out_counts > 0)
        r = repetition[:, None]
        out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
    return out - frequency[:, None] * out_counts - presence[:, None] * (out_counts > 0).to(out.dtype)


class PenaltyCounts:
    """Per-request penalty state, updated incrementally (module doc).

    Invariant: for a request id, ``out[v]`` counts ``v`` in the first ``n`` output ids of the
    (prompt, output) lists it was last given, and ``in_prompt`` is that prompt's token set. A
    request's output list only grows, so bringing the counts up to date reads only the new ids; a
    history whose lists are not the ones counted (another request under a reused id) is recounted.
    """

    def __init__(self) -> None:
        self._state: dict[str, tuple[Sequence[int], Sequence[int], int, torch.Tensor, torch.Tensor]] = {}

    def rows(self, request_ids: list[str], histories: list[History], vocab: int,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(output counts [N, vocab] float32, prompt set [N, vocab] bool) of the given requests."""
        outs, prompts = [], []
        for rid, (prompt, output) in zip(request_ids, histories):
            st = self._state.get(rid)
            if st is None or st[0] is not prompt or st[1] is not output or st[2] > len(output) \
                    or st[3].shape[0] != vocab or st[3].device != device:
                st = (prompt, output, 0, torch.zeros(vocab, dtype=torch.float32, device=device),
                      _scatter_counts([prompt], vocab, device)[0] > 0)
            prompt_, output_, n, out, in_prompt = st
            if len(output) > n:
                new = torch.tensor(list(output[n:]), dtype=torch.int64, device=device)
                out.index_put_((new,), torch.ones(new.numel(), dtype=torch.float32, device=device), accumulate=True)
            self._state[rid] = (prompt_, output_, len(output), out, in_prompt)
            outs.append(out)
            prompts.append(in_prompt)
        return torch.stack(outs), torch.stack(prompts)

    def forget(self, request_id: str) -> None:
        self._state.pop(request_id, None)
