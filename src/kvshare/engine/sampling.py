"""SamplingParams and the batched Sampler.

Sampling of one step is batched over all sequences, in this order (vLLM's): penalties
(`penalties.py`, only on rows that ask), then greedy rows (temperature == 0) take the argmax
(ties: lowest id) with no softmax or sort; random rows are divided by their temperature, masked
by ``min_p`` (drop tokens whose probability is below ``min_p`` times the row's largest, done in
logit space: ``x < max + log(min_p)``), then by top-k / top-p (a sort, only over the rows that
ask for one), and draw with the exponential race ``argmax(x - log E)``, E ~ Exp(1), which samples
from ``softmax(x)`` without computing it. Rows without a seed draw E from the engine's generator
in one call; rows with a seed draw from their own ``torch.Generator`` seeded once per request, so
a seeded request's tokens do not depend on what else is in the batch (one small draw per seeded row).

Before penalties, the request's logits processors run (``logits_processors.py``: allowed_token_ids,
min_tokens, logit_bias, a structured-output mask), as in vLLM.

The returned logprob is that of the chosen token under the model's unmodified distribution
(``log_softmax`` of the raw logits), as vLLM reports by default (``logprobs.py`` says more).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from kvshare.engine.logits_processors import apply_processors
from kvshare.engine.logprobs import num_logprobs
from kvshare.engine.param_ranges import MAX_LOGIT_BIAS, MAX_LOGPROBS
from kvshare.engine.structured_spec import KINDS, StructuredSpec
from kvshare.engine.param_ranges import check_ranges
from kvshare.engine.penalties import History, PenaltyCounts, penalise
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
    # None/False: no logprobs; True or 0: the chosen tokens' logprobs; k <= 20: also the top k of each step
    logprobs: int | bool | None = None
    prompt_logprobs: int | None = None  # None: none; k in [0, 20]: each prompt token's logprob and top k
    presence_penalty: float = 0.0  # in [-2, 2]; subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # in [-2, 2]; subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # > 0, 1 = off; over prompt + output (see penalties.py)
    min_p: float = 0.0  # in [0, 1]; 0 = off
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100], added to the logit
    allowed_token_ids: list[int] | None = None  # sample only these ids
    min_tokens: int = 0  # stop tokens are masked until this many tokens are generated
    include_stop_str_in_output: bool = False  # keep a matched stop string at the end of the text
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (k >= 1)
    structured: Any = None  # engine/structured_spec.StructuredSpec: a grammar the output must follow
    n: int = 1  # sequences per prompt: LLM.generate runs n requests (seed + i each); an engine request samples one

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
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -2.0 <= v <= 2.0:
                raise bad(f"{name} must be a number in [-2, 2], got {v!r}")
        r = self.repetition_penalty
        if not _is_real(r) or not 0 < r <= 1e6:
            raise bad(f"repetition_penalty must be a number > 0 (1 = off), got {r!r}")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 0:
            raise bad(f"max_tokens must be an integer >= 0 (0: score the prompt only), got {self.max_tokens!r}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise bad(f"n must be an integer >= 1, got {self.n!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad(f"seed must be an integer or None, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad(f"stop must be a list of non-empty strings, got {self.stop!r}")
        check_ranges(self)
        _check_extras(self, vocab_size, bad)
        for tid in self.stop_token_ids:
            if not isinstance(tid, int) or tid < 0 or (vocab_size is not None and tid >= vocab_size):
                raise bad(f"stop_token_ids entry {tid!r} is not a token id in [0, {vocab_size})")

    @property
    def num_logprobs(self) -> int | None:
        """None: no logprobs; 0: the chosen tokens' only; k: also the top k alternatives per step."""
        return num_logprobs(self.logprobs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def _check_extras(p: SamplingParams, vocab: int | None, bad: Callable[[str], RequestError]) -> None:
    """Validate the logprob, processor and truncation fields (module doc of each says what they do)."""
    def is_id(t: object) -> bool:
        return isinstance(t, int) and not isinstance(t, bool) and t >= 0 and (vocab is None or t < vocab)

    for name in ("logprobs", "prompt_logprobs"):
        v = getattr(p, name)
        if v is not None and not isinstance(v, bool) and (not isinstance(v, int) or not 0 <= v <= MAX_LOGPROBS):
            raise bad(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {v!r}")
    if p.logit_bias is not None:
        if not isinstance(p.logit_bias, dict) or len(p.logit_bias) > MAX_LOGIT_BIAS:
            raise bad(f"logit_bias must be a dict of at most {MAX_LOGIT_BIAS} token id -> bias entries")
        for t, b in p.logit_bias.items():
            if not is_id(t) or not _is_real(b) or not -100 <= b <= 100:
                raise bad(f"logit_bias entry {t!r}: {b!r} must map a token id in [0, {vocab}) to a bias in [-100, 100]")
    if p.allowed_token_ids is not None:
        ids = p.allowed_token_ids
        if not isinstance(ids, (list, tuple)) or not ids or not all(is_id(t) for t in ids):
            raise bad(f"allowed_token_ids must be a non-empty list of token ids in [0, {vocab})")
    if not isinstance(p.min_tokens, int) or isinstance(p.min_tokens, bool) or not 0 <= p.min_tokens <= p.max_tokens:
        raise bad(f"min_tokens must be an integer in [0, max_tokens = {p.max_tokens}], got {p.min_tokens!r}")
    if p.structured is not None:

        if not isinstance(p.structured, StructuredSpec) or p.structured.kind not in KINDS:
            raise bad(f"structured must be a StructuredSpec of kind {'/'.join(KINDS)}, got {p.structured!r}")
    t = p.truncate_prompt_tokens
    if t is not None and (not isinstance(t, int) or isinstance(t, bool) or t < 1):
        raise bad(f"truncate_prompt_tokens must be None or an integer >= 1, got {t!r}")


def _is_real(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class Sampler:
    """Batched next-token selection for one step."""

    def __init__(self, device: torch.device | str = "cpu", seed: int = 0) -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self._seq_generators: dict[str, torch.Generator] = {}
        self.penalty_counts = PenaltyCounts()  # per-request, incremental (penalties.py)
        self.eos_ids: frozenset[int] = frozenset()  # masked by min_tokens (the engine sets them)
        # Structured output: request ids -> per row a boolean [V] mask of allowed ids or None (engine sets it).
        self.masks_for: Callable[[list[str]], list[torch.Tensor | None]] | None = None

    def generator_for(self, request_id: str, seed: int) -> torch.Generator:
        g = self._seq_generators.get(request_id)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(seed)
            self._seq_generators[request_id] = g
        return g

    def forget(self, request_id: str) -> None:
        self._seq_generators.pop(request_id, None)
        self.penalty_counts.forget(request_id)

    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], request_ids: list[str],
        histories: list[History] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (tokens [N] int64, logprobs [N] fp32 of the chosen tokens; NaN for a greedy batch
        none of whose requests asks for logprobs, which are then never reported).

        `histories[i]` is row i's (prompt ids, output ids); needed only when a row has penalties.
        The logprob is under the raw logits (before penalties, temperature and filters).
        """
        raw = logits.float()
        n, vocab = raw.shape
        dev = raw.device
        out_lens = [len(h[1]) for h in histories] if histories is not None else [0] * n
        masks = self.masks_for(request_ids) if self.masks_for is not None else None
        logits = apply_processors(raw, params, out_lens, self.eos_ids, masks)
        logits = self._penalised(logits, params, request_ids, histories)
        rand = [i for i, p in enumerate(params) if p.temperature > 0]
        if logits is raw and not rand:  # greedy on the raw logits: the max is the chosen token's logit
            best, tokens = raw.max(dim=-1)  # (first index of the max, as argmax)
            if all(p.num_logprobs is None for p in params):  # nobody reads them: no full-vocab logsumexp
                return tokens, best.fill_(float("nan"))
            return tokens, best - raw.logsumexp(dim=-1)
        tokens = logits.argmax(dim=-1)
        if rand:
            idx = torch.tensor(rand, dtype=torch.int64, device=dev)
            rp = [params[i] for i in rand]
            temp = torch.tensor([p.temperature for p in rp], dtype=torch.float32, device=dev)
            x = logits.index_select(0, idx) / temp[:, None]
            if any(p.min_p > 0 for p in rp):
                min_p = torch.tensor([p.min_p for p in rp], dtype=torch.float32, device=dev)
                x = x.masked_fill(x < x.max(dim=-1, keepdim=True).values + min_p.log()[:, None], float("-inf"))
            filt = [j for j, p in enumerate(rp) if 0 < p.top_k < vocab or p.top_p < 1]
            if filt:
                fi = torch.tensor(filt, dtype=torch.int64, device=dev)
                top_k = torch.tensor([rp[j].top_k if 0 < rp[j].top_k < vocab else vocab for j in filt],
                                     dtype=torch.int64, device=dev)
                top_p = torch.tensor([rp[j].top_p for j in filt], dtype=torch.float32, device=dev)
                x = x.index_copy(0, fi, _top_k_top_p(x.index_select(0, fi), top_k, top_p))
            race = torch.empty_like(x).exponential_(generator=self.generator)
            for j, p in enumerate(rp):  # per-request streams: one draw per seeded row
                if p.seed is not None:
                    g = self.generator_for(request_ids[rand[j]], int(p.seed))
                    race[j] = torch.empty(vocab, device=dev).exponential_(generator=g)
            sampled = (x - race.clamp_min(torch.finfo(race.dtype).tiny).log()).argmax(dim=-1)
            tokens = tokens.index_copy(0, idx, sampled)
        logprobs = raw.gather(1, tokens[:, None]).squeeze(1) - raw.logsumexp(dim=-1)
        return tokens, logprobs

    def _penalised(self, logits: torch.Tensor, params: list[SamplingParams], request_ids: list[str],
                   histories: list[History] | None) -> torch.Tensor:
        """`logits` with each penalised row's penalties applied (the same tensor when no row has any)."""
        rows = [i for i, p in enumerate(params) if p.has_penalties]
        if not rows:
            return logits
        if histories is None or len(histories) != len(params):
            raise ValueError("Sampler: penalties need each row's (prompt ids, output ids) history")
        dev = logits.device
        idx = torch.tensor(rows, dtype=torch.int64, device=dev)

        def vec(name: str) -> torch.Tensor:
            return torch.tensor([getattr(params[i], name) for i in rows], dtype=torch.float32, device=dev)

        out_counts, in_prompt = self.penalty_counts.rows([request_ids[i] for i in rows], [histories[i] for i in rows],
                                                         logits.shape[1], dev)
        sub = penalise(logits.index_select(0, idx), out_counts, in_prompt,
                       vec("repetition_penalty"), vec("frequency_penalty"), vec("presence_penalty"))
        return logits.index_copy(0, idx, sub)


def _top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`x` [M, vocab] with everything outside each row's top-k and top-p set set to -inf (batched).

    The top-p set is the smallest prefix of the descending order whose probability reaches top_p
    (the first token is always kept); ties keep the lower id first.
    """
    sorted_vals, order = x.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(x.shape[1], device=x.device)[None, :]
    drop = rank >= top_k[:, None]
    sorted_vals = sorted_vals.masked_fill(drop, float("-inf"))
    sp = torch.softmax(sorted_vals, dim=-1)
    before = sp.cumsum(dim=-1) - sp  # mass strictly above this entry
    drop = drop | ((before >= top_p[:, None]) & (rank > 0))
    sorted_vals = sorted_vals.masked_fill(drop, float("-inf"))
    return torch.full_like(x, float("-inf")).scatter(1, order, sorted_vals)
