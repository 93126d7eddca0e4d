"""Acceptor: one forward's logits rows -> each sampling chunk's committed new tokens.

A chunk without drafts samples one token from its row (the batched `Sampler`); a chunk with drafts
is verified by the `verifier` (speculative decoding: accepted drafts plus a bonus token,
engine/speculative.py). Rows fail alone: a batch that raises is redone row by row
(`isolation.per_row`), and a row that still raises is returned as its exception, so the engine
fails that request only.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol

import torch

from kvshare.engine.executor import Forward
from kvshare.engine.isolation import per_row
from kvshare.engine.sampling import Sampler


@dataclass
class Accepted:
    """A chunk's new tokens (in order), their logprobs, and where the logits row behind the last one
    is (`row`: ``rows[index]``, indexed only when read). The raw rows behind all the tokens are
    contiguous, ending at `index` (`token_rows`, for top-k logprobs: logprobs.py)."""

    tokens: list[int]
    logprobs: list[float]
    rows: torch.Tensor
    index: int

    @property
    def row(self) -> torch.Tensor:
        return self.rows[self.index]

    @property
    def token_rows(self) -> torch.Tensor:
        """The raw logits rows [len(tokens), V] behind each new token."""
        return self.rows[self.index + 1 - len(self.tokens):self.index + 1]


Acceptance = dict[int, "Accepted | BaseException"]  # chunk index in the forward -> its result


class Verifier(Protocol):
    def verify(self, fwd: Forward, drafted: list[int], first_row: list[int]) -> Acceptance: ...


class Acceptor:
    def __init__(self, sampler: Sampler, verifier: Verifier | None = None) -> None:
        self.sampler = sampler
        self.verifier = verifier

    def accept(self, fwd: Forward) -> Acceptance:
        """Results of every sampling chunk of `fwd` (keys: chunk indices)."""
        chunks = fwd.chunks
        per = [1 + len(chunks[i].draft) for i in fwd.sampling]
        first = list(itertools.accumulate(per, initial=0))  # first logits row of each sampling chunk
        plain = [k for k, i in enumerate(fwd.sampling) if not chunks[i].draft]
        out: Acceptance = {}
        if plain:
            out.update(self._sample(fwd, plain, first, len(plain) == len(per)))
        drafted = [k for k, i in enumerate(fwd.sampling) if chunks[i].draft]
        if drafted:
            if self.verifier is None:
                raise RuntimeError("chunks carry drafts but the engine has no verifier")
            out.update(self.verifier.verify(fwd, [fwd.sampling[k] for k in drafted], [first[k] for k in drafted]))
        return out

    def _sample(self, fwd: Forward, plain: list[int], first: list[int], whole: bool) -> Acceptance:
        rows = fwd.logits if whole else fwd.logits.index_select(
            0, torch.tensor([first[k] for k in plain], dtype=torch.int64, device=fwd.logits.device))
        seqs = [fwd.chunks[fwd.sampling[k]].seq for k in plain]

        def sample(sub: list[int]) -> list[Accepted]:
            x = rows if len(sub) == len(plain) else rows[sub[0]:sub[0] + 1]
            ss = [seqs[j] for j in sub]
            toks, lps = self.sampler(x, [s.params for s in ss], [s.request_id for s in ss],
                                     [(s.prompt_token_ids, s.output_token_ids) for s in ss])
            return [Accepted([t], [lp], x, n) for n, (t, lp) in enumerate(zip(toks.tolist(), lps.tolist()))]

        return {fwd.sampling[k]: r for k, r in zip(plain, per_row(sample, len(plain)))}
