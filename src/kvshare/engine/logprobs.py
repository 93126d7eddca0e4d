"""Log-probabilities reported to the client: of sampled tokens, their top-k alternatives, and prompts.

Which logits (vLLM's ``logprobs_mode``): always the model's **raw** distribution,
``log_softmax`` of the fp32 logits before logit_bias, allowed_token_ids, min_tokens, structured
output masks, penalties, temperature and the top-k / top-p / min-p filters (vLLM's default
``raw_logprobs``). A chosen token therefore has a finite logprob even when a processor forced it.

* Sampled tokens: ``Sequence.output_logprobs[i]`` is the chosen token's logprob (``Sampler``),
  ``Sequence.output_top_logprobs[i]`` the ``k`` most likely ids with their logprobs when the
  request asked for ``logprobs = k > 0`` (an empty dict for ``k = 0``).
* Prompt tokens (``prompt_logprobs = k``): entry ``p`` (``1 <= p < len(prompt)``) is the logprob of
  prompt token ``p`` given tokens ``[0, p)``, taken from the logits row at position ``p - 1``;
  entry 0 is None (nothing predicts the first token). Rows arrive chunk by chunk (chunked prefill,
  recompute after preemption writes the same entries again), so entries are stored by position.

Invariant: every reported value is ``logits[row, t] - logsumexp(logits[row])`` in fp32.
"""

from __future__ import annotations

from typing import Any

import torch



def num_logprobs(value: int | bool | None) -> int | None:
    """The number of alternatives asked for: None (no logprobs), 0 (chosen token only) or k."""
    if value is None or value is False:
        return None
    if value is True:
        return 0
    return int(value)


def top_k(lsm: torch.Tensor, k: int) -> list[dict[int, float]]:
    """Per row of `lsm` [R, V] (log-softmaxed), its `k` most likely ids -> logprob (k = 0: empty)."""
    if k <= 0:
        return [{} for _ in range(lsm.shape[0])]
    vals, ids = lsm.topk(min(k, lsm.shape[-1]), dim=-1)
    return [dict(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]


def sampled_top_logprobs(rows: torch.Tensor, k: int) -> list[dict[int, float]]:
    """Top-k alternatives of the tokens sampled from the raw logits rows [R, V]."""
    return top_k(torch.log_softmax(rows.float(), dim=-1), k)


def record_prompt_logprobs(seq: Any, start: int, rows: torch.Tensor) -> None:
    """Store the prompt logprobs that the logits `rows` [L, V] of positions ``start .. start+L-1``
    give `seq` (a Sequence whose params ask for ``prompt_logprobs``); rows past the prompt are ignored."""
    n_prompt = len(seq.prompt_token_ids)
    k = seq.params.prompt_logprobs
    if seq.prompt_logprobs is None:
        seq.prompt_logprobs = [None] * n_prompt
        seq.prompt_top_logprobs = [None] * n_prompt
    last = min(rows.shape[0], n_prompt - 1 - start)  # row j predicts position start + j + 1
    if last <= 0:
        return
    lsm = torch.log_softmax(rows[:last].float(), dim=-1)
    targets = torch.tensor(seq.prompt_token_ids[start + 1:start + 1 + last], dtype=torch.int64, device=lsm.device)
    chosen = lsm.gather(1, targets[:, None]).squeeze(1).tolist()
    tops = top_k(lsm, k)
    for j in range(last):
        seq.prompt_logprobs[start + 1 + j] = chosen[j]
        seq.prompt_top_logprobs[start + 1 + j] = tops[j]
