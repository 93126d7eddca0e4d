"""SamplingParams and the batched Sampler.

Sampling of one step is batched over all sequences: temperature scaling, top-k and top-p masks
are tensor ops over [N, vocab]. Greedy rows (temperature == 0) take the argmax (ties: lowest id).
Random rows draw with the exponential race ``argmax(p / E)``, E ~ Exp(1), which samples from p;
rows without a seed draw E from the engine's generator in one call, rows with a seed draw from
their own ``torch.Generator`` seeded once per request, so a seeded request's tokens do not depend
on what else is in the batch (one small draw per seeded row).

The returned logprob is that of the chosen token under the model's unmodified distribution
(``log_softmax`` of the raw logits), as vLLM reports by default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvshare.engine.param_ranges import check_ranges
from kvshare.errors import RequestError


@dataclass
class SamplingParams:
    """How one request samples and when it stops. ``validate()`` raises RequestError on bad values."""

    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: whole vocabulary
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] | str = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False

    def validate(self, vocab_size: int | None = None) -> None:
        def bad(msg: str) -> RequestError:
            return RequestError(f"invalid sampling params: {msg}")

        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or math.isnan(t) or t < 0 or math.isinf(t):
            raise bad(f"temperature must be a finite number >= 0, got {t!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise bad(f"top_k must be an integer >= -1 (0 or -1 = off), got {self.top_k!r}")
        p = self.top_p
        if not isinstance(p, (int, float)) or isinstance(p, bool) or math.isnan(p) or not 0 < p <= 1:
            raise bad(f"top_p must be in (0, 1], got {p!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad(f"seed must be an integer or None, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad(f"stop must be a list of non-empty strings, got {self.stop!r}")
        check_ranges(self)
        for tid in self.stop_token_ids:
            if not isinstance(tid, int) or tid < 0 or (vocab_size is not None and tid >= vocab_size):
                raise bad(f"stop_token_ids entry {tid!r} is not a token id in [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """Batched next-token selection for one step."""

    def __init__(self, device: torch.device | str = "cpu", seed: int = 0) -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self._seq_generators: dict[str, torch.Generator] = {}

    def generator_for(self, request_id: str, seed: int) -> torch.Generator:
        g = self._seq_generators.get(request_id)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(seed)
            self._seq_generators[request_id] = g
        return g

    def forget(self, request_id: str) -> None:
        self._seq_generators.pop(request_id, None)

    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], request_ids: list[str]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (tokens [N] int64, logprobs [N] fp32 of the chosen tokens)."""
        logits = logits.float()
        n, vocab = logits.shape
        dev = logits.device
        temp = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], dtype=torch.int64, device=dev)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
        greedy = temp == 0
        tokens = logits.argmax(dim=-1)
        if not bool(greedy.all()):
            probs = _filtered_probs(logits, temp.clamp_min(1e-6), top_k.clamp(1, vocab), top_p)
            race = torch.empty_like(probs).exponential_(generator=self.generator)
            seeded = [i for i, p in enumerate(params) if p.seed is not None and p.temperature > 0]
            for i in seeded:  # per-request streams: one draw per seeded row
                g = self.generator_for(request_ids[i], int(params[i].seed))  # type: ignore[arg-type]
                race[i] = torch.empty(vocab, device=dev).exponential_(generator=g)
            sampled = (probs / race).argmax(dim=-1)
            tokens = torch.where(greedy, tokens, sampled)
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1)
        return tokens, logprobs


def _filtered_probs(logits: torch.Tensor, temp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Softmax of logits/temp restricted to each row's top-k and top-p set (batched)."""
    scaled = logits / temp[:, None]
    sorted_vals, order = scaled.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(scaled.shape[1], device=scaled.device)[None, :]
    drop = rank >= top_k[:, None]
    sorted_vals = sorted_vals.masked_fill(drop, float("-inf"))
    sp = torch.softmax(sorted_vals, dim=-1)
    before = sp.cumsum(dim=-1) - sp  # mass strictly above this entry
    drop = drop | ((before >= top_p[:, None]) & (rank > 0))
    sorted_vals = sorted_vals.masked_fill(drop, float("-inf"))
    masked = torch.full_like(scaled, float("-inf")).scatter(1, order, sorted_vals)
    return torch.softmax(masked, dim=-1)
