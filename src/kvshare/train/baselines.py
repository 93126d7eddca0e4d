"""Unigram and bigram byte models: the floor a trained model has to beat, on the same held-out bytes.

Both are fitted on the training split's token stream (bos counts as a context, never as a
target) and score each evaluation piece exactly as the model is scored: targets are the piece's
bytes, the context of the first byte is bos.

* unigram: add-one smoothed byte frequencies.
* bigram: ``p(b | a) = (c(a, b) + k * p_uni(b)) / (c(a) + k)``, i.e. additive smoothing towards the
  unigram, with ``k = BIGRAM_PRIOR``.
"""

from __future__ import annotations

import math

import torch

from kvshare.train.data import BOS

BIGRAM_PRIOR = 1.0
_CTX = 257  # contexts: bytes 0-255 and bos


class ByteNgram:
    """Unigram and bigram byte statistics of a token stream."""

    def __init__(self, tokens: torch.Tensor) -> None:
        t = tokens.long()
        prev, nxt = t[:-1], t[1:]
        keep = nxt < 256  # targets are bytes only
        ctx = torch.where(prev == BOS, torch.full_like(prev, 256), prev)
        self.bigram = torch.zeros(_CTX, 256, dtype=torch.float64)
        flat = ctx[keep] * 256 + nxt[keep]
        self.bigram.view(-1).index_add_(0, flat, torch.ones_like(flat, dtype=torch.float64))
        uni = torch.bincount(t[t < 256], minlength=256).double()
        self.unigram = (uni + 1.0) / (uni.sum() + 256.0)
        self.log_uni = self.unigram.log()
        row = self.bigram.sum(1, keepdim=True)
        self.log_bi = ((self.bigram + BIGRAM_PRIOR * self.unigram[None]) / (row + BIGRAM_PRIOR)).log()

    def bits_per_byte(self, pieces: list[torch.Tensor]) -> dict[str, float]:
        """Bits per byte of the unigram and bigram models over the pieces (each scored after a bos)."""
        nll_u = nll_b = 0.0
        n = 0
        for p in pieces:
            p = p.long()
            ctx = torch.cat([torch.tensor([256]), p[:-1]])
            nll_u -= float(self.log_uni[p].sum())
            nll_b -= float(self.log_bi[ctx, p].sum())
            n += int(p.numel())
        return {"unigram": nll_u / n / math.log(2), "bigram": nll_b / n / math.log(2)}
