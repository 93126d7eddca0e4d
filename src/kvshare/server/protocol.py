"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Requests validate their sampling values here, so a bad value is a 400 naming the parameter
before anything reaches the engine. Fields OpenAI defines but kvshare does not use are accepted
and ignored (clients send them by default); fields that would change the result in a way kvshare
cannot honour (`n` > 1, `best_of` > 1, `echo`, alternatives in `logprobs` / `top_logprobs`)
are rejected. Log-probabilities of the chosen tokens are supported (`logprobs: 0` for
completions, `logprobs: true` for chat).
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from kvshare.engine.param_ranges import MAX_STOP_TOKEN_IDS, SEED_MAX, SEED_MIN, TOP_K_MAX


def new_id(prefix: str) -> str:
    """A unique response id such as `cmpl-3f2a...`."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """Unix seconds, as OpenAI's `created`."""
    return int(time.time())


class StreamOptions(BaseModel):
    """`stream_options`: whether the last chunk carries usage counts."""

    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = Field(default=None, validate_default=True)
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    # vLLM's field: requests share cached prefix blocks only when their salts are equal.
    cache_salt: str | None = Field(default=None, max_length=256)

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        if math.isnan(v) or math.isinf(v) or v < 0:
            raise ValueError("temperature must be a finite number >= 0")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float) -> float:
        if math.isnan(v) or not 0 < v <= 1:
            raise ValueError("top_p must be in (0, 1]")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, v: float, info: ValidationInfo) -> float:
        if math.isnan(v) or not -2 <= v <= 2:
            raise ValueError(f"{info.field_name} must be in [-2, 2]")
        return v

    @field_validator("repetition_penalty")
    @classmethod
    def _repetition_penalty(cls, v: float) -> float:
        if not math.isfinite(v) or v <= 0:
            raise ValueError("repetition_penalty must be a finite number > 0 (1 = off)")
        return v

    @field_validator("min_p")
    @classmethod
    def _min_p(cls, v: float) -> float:
        if math.isnan(v) or not 0 <= v <= 1:
            raise ValueError("min_p must be in [0, 1]")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v < -1 or v > TOP_K_MAX:
            raise ValueError(f"top_k must be in [-1, {TOP_K_MAX}] (0 or -1 means no top-k)")
        return v

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: int | None) -> int | None:
        if v is not None and not SEED_MIN <= v <= SEED_MAX:
            raise ValueError(f"seed must be in [{SEED_MIN}, {SEED_MAX}]")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(t < 0 for t in v):
            raise ValueError("stop_token_ids must be non-negative token ids")
        return v

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError("max_tokens must be >= 1")
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n = 1 is supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stops

    @property
    def include_usage(self) -> bool:
        """Whether a streaming response ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions. `prompt` is a string, a list of token ids, or a one-element list of either."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    best_of: int | None = None
    logprobs: int | None = None  # 0: the chosen tokens' logprobs (alternatives are not supported)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> str | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("one prompt per request is supported (got a batch of %d)" % len(v))
            v = v[0]
        if isinstance(v, str) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and (not v or any(t < 0 for t in v)):
            raise ValueError("prompt token ids must be a non-empty list of non-negative ids")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> "CompletionRequest":
        if self.echo:
            raise ValueError("echo is not supported")
        if self.best_of not in (None, 1):
            raise ValueError("only best_of = 1 is supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v: int | None) -> int | None:
        if v not in (None, 0):
            raise ValueError("only logprobs = 0 is supported (the chosen tokens' log-probabilities)")
        return v

    @property
    def wants_logprobs(self) -> bool:
        """Whether the reply carries the chosen tokens' log-probabilities."""
        return self.logprobs is not None


class ChatMessage(BaseModel):
    """One conversation turn. `content` may be OpenAI's list of text parts."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The message's text, joining text parts."""
        if isinstance(self.content, list):
            parts = []
            for p in self.content:
                if p.get("type") != "text":
                    raise ValueError(f"only text content parts are supported, got {p.get('type')!r}")
                parts.append(str(p.get("text", "")))
            return "".join(parts)
        return self.content or ""


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v: int | None) -> int | None:
        if v not in (None, 0):
            raise ValueError("only top_logprobs = 0 is supported (the chosen tokens' log-probabilities)")
        return v

    @field_validator("max_completion_tokens")
    @classmethod
    def _max_completion_tokens(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError("max_completion_tokens must be >= 1")
        return v

    @property
    def wants_logprobs(self) -> bool:
        """Whether the reply carries the chosen tokens' log-probabilities."""
        return self.logprobs

    def conversation(self) -> list[dict[str, str]]:
        """The messages as plain {role, content} dicts for a chat template."""
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class PromptTokensDetails(BaseModel):
    """`usage.prompt_tokens_details`: prompt tokens served by the prefix cache."""

    cached_tokens: int = 0


class Usage(BaseModel):
    """Token counts of one request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> "Usage":
        """Usage with the total and the cached prompt tokens filled in."""
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class ErrorInfo(BaseModel):
    """The `error` object of an OpenAI error body."""

    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """`{"error": {...}}`, the body of every 4xx / 5xx reply."""

    error: ErrorInfo


class ModelCard(BaseModel):
    """One entry of GET /v1/models."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "kvshare"
    max_model_len: int | None = None


class ModelList(BaseModel):
    """GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
