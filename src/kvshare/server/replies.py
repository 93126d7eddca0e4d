"""OpenAI-shaped reply bodies that are not per-endpoint choices: usage, errors, the model list.

Request bodies live in `protocol`; completion / chat choices and stream chunks in `responses`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from kvshare.server.protocol import now


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
