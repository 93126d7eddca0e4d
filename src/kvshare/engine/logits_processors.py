"""Per-request logits processors: allowed_token_ids, min_tokens, logit_bias (and a structured-output mask).

Applied to a batch of rows before penalties and temperature (vLLM's order), each in one batched
tensor operation over the rows that ask for it (rows that ask for none are not touched):

* ``allowed_token_ids``: every other id gets ``-inf``;
* ``min_tokens``: while the request has produced fewer than ``min_tokens`` tokens, its stop
  tokens (eos unless ``ignore_eos``, and ``stop_token_ids``) get ``-inf`` — unless
  ``allowed_token_ids`` or the structured-output mask leave nothing else (a grammar that is
  complete, say): the hard constraints win and the request may stop early;
* ``logit_bias``: ``logit[id] += bias`` (OpenAI clamps biases to [-100, 100]; so does validation).
* ``masks``: a boolean [N, V] (True = allowed) from structured output; None rows are unmasked.

Row i's output length is ``out_lens[i]`` (under speculative verification, row j of a request
follows j drafts, so its length is the output length plus j).
"""

from __future__ import annotations

import itertools
from typing import Any, Iterable

import torch


def needs_processing(p: Any) -> bool:
    """Whether `p` (SamplingParams) asks for any processor besides structured output."""
    return bool(p.allowed_token_ids) or p.min_tokens > 0 or bool(p.logit_bias)


def apply_processors(logits: torch.Tensor, params: list[Any], out_lens: list[int], eos_ids: Iterable[int],
                     masks: list[torch.Tensor | None] | None = None) -> torch.Tensor:
    """A processed copy of `logits` [N, V] (the same tensor when no row asks for anything)."""
    n, vocab = logits.shape
    dev = logits.device
    eos = sorted(eos_ids)
    allowed = [i for i, p in enumerate(params) if p.allowed_token_ids]
    stopping = [i for i, p in enumerate(params) if out_lens[i] < p.min_tokens]
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    masked = [i for i, m in enumerate(masks or []) if m is not None]
    if not (allowed or stopping or biased or masked):
        return logits
    out = logits.float().clone()
    block = torch.zeros(n, vocab, dtype=torch.bool, device=dev)  # True: forbidden
    if allowed:
        ok = torch.zeros(len(allowed), vocab, dtype=torch.bool, device=dev)
        _set(ok, [params[i].allowed_token_ids for i in allowed], True)
        block[torch.tensor(allowed, device=dev)] |= ~ok
    if masked:
        assert masks is not None
        block[torch.tensor(masked, device=dev)] |= ~torch.stack([masks[i].to(dev) for i in masked])  # type: ignore[union-attr]
    if stopping:
        stops = [[*(() if params[i].ignore_eos else eos), *params[i].stop_token_ids] for i in stopping]
        sub = torch.zeros(len(stopping), vocab, dtype=torch.bool, device=dev)
        _set(sub, stops, True)
        at = torch.tensor(stopping, device=dev)
        hard = block[at]
        both = hard | sub
        # min_tokens yields to the hard constraints: where they leave only stop tokens, those stay
        # allowed (otherwise every logit would be -inf and the sampler would emit a forbidden id)
        block[at] = torch.where(both.all(dim=-1, keepdim=True), hard, both)
    if biased:
        rows = torch.tensor([i for i in biased for _ in params[i].logit_bias], dtype=torch.int64, device=dev)
        ids = torch.tensor([t for i in biased for t in params[i].logit_bias], dtype=torch.int64, device=dev)
        vals = torch.tensor([v for i in biased for v in params[i].logit_bias.values()], dtype=out.dtype, device=dev)
        out.index_put_((rows, ids), vals, accumulate=True)
    return out.masked_fill(block, float("-inf"))


def _set(mask: torch.Tensor, lists: list[list[int]], value: bool) -> None:
    """mask[r, lists[r]] = value for every row r (one index_put)."""
    lens = [len(x) for x in lists]
    if not sum(lens):
        return
    rows = torch.repeat_interleave(torch.arange(len(lists), device=mask.device), torch.tensor(lens, device=mask.device))
    ids = torch.tensor(list(itertools.chain.from_iterable(lists)), dtype=torch.int64, device=mask.device)
    mask[rows, ids] = value


def processed_rows(logits: torch.Tensor, seqs: list[Any], eos_ids: Iterable[int],
                   masks: list[list[torch.Tensor | None]] | None = None) -> torch.Tensor:
    """Speculative verification: `logits` [N, K+1, V] with each request's processors applied row by
    row; row j follows the request's first j drafts, so its output length is the request's plus j.
    `masks[i][j]`: the structured-output mask after those drafts (None: unmasked)."""
    n, r, v = logits.shape
    params = [s.params for s in seqs for _ in range(r)]
    if not any(needs_processing(p) for p in params) and masks is None:
        return logits
    out_lens = [len(s.output_token_ids) + j for s in seqs for j in range(r)]
    flat_masks = [m for row in masks for m in row] if masks is not None else None
    return apply_processors(logits.reshape(n * r, v), params, out_lens, eos_ids, flat_masks).view(n, r, v)
