"""What the engine reports: RequestOutput per request and EngineStats per engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from kvshare.engine.sequence import RequestMetrics, Sequence


@dataclass
class Logprob:
    """One token's log-probability in vLLM's shape: `rank` 1 = most likely (None when unknown: a chosen
    token outside the reported top k), `decoded_token` its text (None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sequence of a prompt, as vLLM's `outputs[i]`: ``index`` (0..n-1), ``text``,
    ``token_ids``, ``cumulative_logprob`` (sum of the chosen tokens' logprobs; None without logprobs),
    ``logprobs`` (per output token a {token id: Logprob} of the chosen token and the top k; None
    without logprobs), ``finish_reason`` and ``stop_reason`` (as on `RequestOutput`)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        """Whether this sequence has finished (vLLM's method)."""
        return self.finish_reason is not None


class RequestOutput:
    """A request's state after a step (cumulative; ``new_token_ids`` are this step's tokens only).

    vLLM's shape: ``outputs`` (one `CompletionOutput` per sequence; ``LLM.generate`` with
    ``SamplingParams(n=k)`` fills k), ``prompt``, ``prompt_token_ids``, ``finished``. The fields
    ``text``, ``token_ids``, ``logprobs`` and ``top_logprobs`` on the request itself are the first
    sequence's, kept for code written against kvshare's earlier API (deprecated for user code: read
    ``outputs[0]``; the server reads them).

    ``finish_reason`` is "stop" (eos, stop token or stop string), "length" (max_tokens or
    max_model_len), "abort", or "error" (the request was rejected by ``LLM.generate``, or failed
    alone inside a step; ``error`` says why); None while running. ``stop_reason`` is the stop token id
    or stop string that ended it (None for eos, length, abort). Log-probabilities (raw, see
    ``logprobs.py``) when the request asked for them: ``logprobs`` of the chosen tokens,
    ``top_logprobs`` (one {id: logprob} dict of the k most likely per output token, empty for k = 0),
    ``prompt_logprobs`` (None first, then per prompt token) and ``prompt_top_logprobs`` alike.

    Cost per step independent of the request's history: `of` copies nothing that grows.
    ``prompt_token_ids`` is the request's own list (never mutated after admission); ``token_ids``,
    ``logprobs`` and ``top_logprobs`` are the first n entries of the request's append-only lists,
    materialised (and cached) when first read, so a step's outputs cost only their new tokens unless
    a caller reads the cumulative lists. Entries before n never change, so a later read (another
    thread, a later step) sees this step's values.
    """

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], text: str,
                 token_ids: list[int] | _Prefix, new_token_ids: list[int], finished: bool,
                 finish_reason: str | None, logprobs: list[float] | _Prefix | None, metrics: RequestMetrics,
                 error: str | None = None, num_cached_tokens: int = 0,
                 top_logprobs: list[dict[int, float]] | _Prefix | None = None,
                 prompt_logprobs: list[float | None] | None = None,
                 prompt_top_logprobs: list[dict[int, float] | None] | None = None,
                 stop_reason: int | str | None = None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.text = text
        self._token_ids = token_ids
        self.new_token_ids = new_token_ids
        self.finished = finished
        self.finish_reason = finish_reason
        self._logprobs = logprobs
        self.metrics = metrics
        self.error = error
        self.num_cached_tokens = num_cached_tokens  # prompt tokens served by the prefix cache at admission
        self._top_logprobs = top_logprobs
        self.prompt_logprobs = prompt_logprobs
        self.prompt_top_logprobs = prompt_top_logprobs
        self.stop_reason = stop_reason
        self._outputs: list[CompletionOutput] | None = None

    @property
    def outputs(self) -> list[CompletionOutput]:
        """The sequences of this prompt (vLLM's shape; one unless `LLM.generate` grouped n of them)."""
        return self._outputs if self._outputs is not None else [self.completion(0)]

    @outputs.setter
    def outputs(self, value: list[CompletionOutput]) -> None:
        self._outputs = value

    def completion(self, index: int, decode_token: Callable[[int], str] | None = None) -> CompletionOutput:
        """This request's sequence as a vLLM `CompletionOutput` numbered `index` (`decode_token`: a
        token id's text, for `Logprob.decoded_token`; None leaves it None)."""
        def decoded(i: int) -> str | None:
            return decode_token(i) if decode_token is not None else None

        lps, tops = self.logprobs, self.top_logprobs
        per_token = None
        if lps is not None:
            per_token = []
            for t, lp, top in zip(self.token_ids, lps, tops or [{}] * len(lps)):
                ranked = {i: r + 1 for r, i in enumerate(top or {})}
                entry = {i: Logprob(v, ranked[i], decoded(i)) for i, v in (top or {}).items()}
                entry.setdefault(t, Logprob(lp, ranked.get(t), decoded(t)))
                per_token.append(entry)
        cumulative = float(sum(per_token[k][t].logprob for k, t in enumerate(self.token_ids[:len(per_token)]))) \
            if per_token is not None else None
        return CompletionOutput(index, self.text, list(self.token_ids), cumulative, per_token, self.finish_reason,
                                self.stop_reason)

    @property
    def token_ids(self) -> list[int]:
        if isinstance(self._token_ids, _Prefix):
            self._token_ids = self._token_ids.materialise()
        return self._token_ids

    @property
    def logprobs(self) -> list[float] | None:
        if isinstance(self._logprobs, _Prefix):
            self._logprobs = self._logprobs.materialise()
        return self._logprobs

    @property
    def top_logprobs(self) -> list[dict[int, float]] | None:
        if isinstance(self._top_logprobs, _Prefix):
            self._top_logprobs = self._top_logprobs.materialise()
        return self._top_logprobs

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, text={self.text!r}, token_ids={self.token_ids!r}, "
                f"finished={self.finished}, finish_reason={self.finish_reason!r}, error={self.error!r})")

    @classmethod
    def of(cls, seq: Sequence) -> "RequestOutput":
        n = len(seq.output_token_ids)
        prompt_lps = _prompt_lps(seq)
        return cls(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            text=seq.output_text,
            token_ids=_Prefix(seq.output_token_ids, n),
            new_token_ids=list(seq.new_token_ids),
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            logprobs=_Prefix(seq.output_logprobs, n) if seq.params.num_logprobs is not None else None,
            metrics=seq.metrics,
            error=seq.error,
            num_cached_tokens=seq.num_cached_tokens or 0,
            top_logprobs=_Prefix(seq.output_top_logprobs, n) if seq.params.num_logprobs is not None else None,
            prompt_logprobs=prompt_lps,
            prompt_top_logprobs=list(seq.prompt_top_logprobs) if prompt_lps is not None else None,  # type: ignore[arg-type]
            stop_reason=seq.stop_reason,
        )


def _prompt_lps(seq: Sequence) -> list[float | None] | None:
    """The prompt logprobs once the whole prompt has been computed (None before, or not asked)."""
    if seq.params.prompt_logprobs is None or seq.prompt_logprobs is None:
        return None
    if seq.num_computed < len(seq.prompt_token_ids) and not seq.is_finished:
        return None
    return list(seq.prompt_logprobs)


class _Prefix:
    """The first `n` entries of an append-only list, copied only when asked for."""

    __slots__ = ("items", "n")

    def __init__(self, items: list, n: int) -> None:
        self.items, self.n = items, n

    def materialise(self) -> list:
        return self.items[:self.n]


@dataclass
class EngineStats:
    """Counters since the engine started; ``*_tokens`` are tokens processed by the model."""

    num_running: int = 0
    num_waiting: int = 0
    num_blocks_used: int = 0
    num_blocks_total: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    prompt_tokens: int = 0  # prefill (and recompute) tokens run through the model
    generation_tokens: int = 0  # tokens sampled
    bytes_per_block: int = 0
    prefix_cache_queried_tokens: int = 0  # prompt tokens looked up at admission
    prefix_cache_hit_tokens: int = 0  # of those, tokens served from the cache
    prefix_cache_checkpoint_bytes: int = 0
    prefix_cache_checkpoints: int = 0
    prefix_cache_evictable_blocks: int = 0  # cached blocks no request holds (reclaimed LRU first)
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def block_usage(self) -> float:
        return self.num_blocks_used / self.num_blocks_total if self.num_blocks_total else 0.0
