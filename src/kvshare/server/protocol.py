"""Request and response bodies of the OpenAI-compatible API (pydantic models).

The rules (README "Serving"), vLLM's: **a known field is honoured or refused** — a value kvshare
cannot honour is a 400 naming the field, never silently ignored — and **an unknown field is
ignored**: new SDK fields and other engines' extras (``truncation_side``, chat ``echo``, ...) are
accepted without effect, logged as a warning, and named in the response's ``X-Ignored-Fields``
header (`Ignored.ignored_fields`: the top level's, ``messages.N.x`` and ``stream_options.x``).
Fields accepted without effect on purpose: `user` (an end-user id OpenAI uses for abuse
monitoring), a message's `name` where the chat template has no place for it, and `model` checked
against the served name. Types are strict where OpenAI's are (`temperature: true` and
`stream: "yes"` are 400s; an integer is still a valid number); booleans also take the strings
``"true"`` / ``"false"`` (any case) that some SDKs and form encoders send.

Requests validate their sampling values here, so a bad value is a 400 naming the parameter
before anything reaches the engine.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import Annotated, Any

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator,
                      model_validator)

from kvshare.engine.param_ranges import (MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_TOKEN_IDS, SEED_MAX, SEED_MIN,
                                         TOP_K_MAX)
from kvshare.engine.structured_spec import StructuredSpec
from kvshare.server.request_checks import field_error, refuse_bools, structured_spec
from kvshare.server.tool_grammar import NAME_RE, PARAM_NAME_RE, ToolSpecError, check_tools

MAX_STOP_STRINGS = 256  # vLLM accepts any number; each costs a substring search per generated token
MAX_STOP_CHARS = 1024  # per stop string
MAX_CHOICES = 256  # n x prompts of one request
MAX_ALLOWED_TOKEN_IDS = 1 << 20
# fields clients send that this build cannot honour yet: any value but null is a 400 naming the field
NOT_HONOURED: tuple[str, ...] = ()
ROLE_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # standard and custom roles: written into a template as they are
CHAT_TEMPLATE_KWARGS = ("thinking", "enable_thinking")  # DeepSeek's and Qwen's spelling of thinking mode



def _str_bool(v: Any) -> Any:
    """``"true"`` / ``"false"`` (any case) as booleans; anything else is left to strict validation."""
    if isinstance(v, str) and v.lower() in ("true", "false"):
        return v.lower() == "true"
    return v


# a boolean that is strict (no 1, "yes") but takes the strings "true" / "false"
Bool = Annotated[bool, BeforeValidator(_str_bool), Field(strict=True)]


class Ignored(BaseModel):
    """A request model that accepts unknown fields and reports them (`ignored_fields`)."""

    model_config = ConfigDict(extra="allow")

    @property
    def ignored_fields(self) -> list[str]:
        """Unknown fields of this body (dotted paths into messages and stream_options), in order."""
        out = list(self.model_extra or {})
        for i, m in enumerate(getattr(self, "messages", None) or []):
            out += [f"messages.{i}.{k}" for k in m.model_extra or {}]
        so = getattr(self, "stream_options", None)
        if so is not None:
            out += [f"stream_options.{k}" for k in so.model_extra or {}]
        return out


def new_id(prefix: str) -> str:
    """A unique response id such as `cmpl-3f2a...`."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """Unix seconds, as OpenAI's `created`."""
    return int(time.time())


class StreamOptions(BaseModel):
    """`stream_options`: usage on the last chunk (`include_usage`), and with it on every chunk
    (`continuous_usage_stats`, vLLM's: only together with `include_usage`)."""

    model_config = ConfigDict(extra="allow")
    include_usage: Bool = False
    continuous_usage_stats: Bool = False


class _SamplingRequest(Ignored):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, strict=True)
    temperature: float = Field(default=1.0, strict=True)
    top_p: float = Field(default=1.0, strict=True)
    top_k: int = Field(default=0, strict=True)
    min_p: float = Field(default=0.0, strict=True)
    presence_penalty: float = Field(default=0.0, strict=True)
    frequency_penalty: float = Field(default=0.0, strict=True)
    repetition_penalty: float = Field(default=1.0, strict=True)
    n: int = Field(default=1, strict=True)
    seed: int | None = Field(default=None, strict=True)
    stop: str | list[str] | None = Field(default=None, validate_default=True)
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    stream: Bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: Bool = False
    user: str | None = None
    # vLLM's field: requests share cached prefix blocks only when their salts are equal.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = Field(default=None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)
    min_tokens: int = Field(default=0, strict=True, ge=0)
    include_stop_str_in_output: Bool = False
    return_token_ids: Bool = False
    return_tokens_as_token_ids: Bool = False
    truncate_prompt_tokens: int | None = Field(default=None, strict=True, ge=1)
    prompt_logprobs: int | None = Field(default=None, strict=True, ge=0, le=MAX_LOGPROBS)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    _structured: StructuredSpec | None = PrivateAttr(default=None)

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
        if v is not None and not SEED_MIN <= v <= SEED_MAX - MAX_CHOICES:
            raise ValueError(f"seed must be in [{SEED_MIN}, {SEED_MAX - MAX_CHOICES}]")
        return v

    @field_validator("allowed_token_ids", mode="before")
    @classmethod
    def _no_bool_ids(cls, v: Any, info: ValidationInfo) -> Any:
        return refuse_bools(v, info.field_name)

    @field_validator("stop_token_ids", "allowed_token_ids")
    @classmethod
    def _token_ids(cls, v: list[int] | None, info: ValidationInfo) -> list[int] | None:
        if v is not None and any(t < 0 for t in v):
            raise ValueError(f"{info.field_name} must be non-negative token ids")
        return v

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v: int | None) -> int | None:
        if v is not None and v < 0:
            raise ValueError("max_tokens must be >= 0")
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v: int) -> int:
        if not 1 <= v <= MAX_CHOICES:
            raise ValueError(f"n must be in [1, {MAX_CHOICES}]")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences")
        if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop sequences must be non-empty and at most {MAX_STOP_CHARS} characters")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} logit_bias entries")
        for k, b in v.items():
            if not (k.isascii() and k.isdigit()) or len(k) > 12:  # str.isdigit alone takes "²" and "٣"
                raise ValueError("logit_bias keys must be token ids written in ASCII decimal digits")
            if not math.isfinite(b) or not -100 <= b <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {b!r} for token {k}")
        return v

    @model_validator(mode="after")
    def _combinations(self) -> "_SamplingRequest":
        if self.stream_options is not None and not self.stream:
            raise field_error("stream_options", "stream_options is only allowed when stream is true")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise field_error("min_tokens", f"min_tokens ({self.min_tokens}) must be <= max_tokens")
        for name in NOT_HONOURED:
            if getattr(self, name, None) is not None:
                raise field_error(name, f"{name} is not supported by this server")
        self._structured = structured_spec(self.response_format, self.structured_outputs)
        return self

    @property
    def structured(self) -> StructuredSpec | None:
        """The output constraint of `response_format` / `structured_outputs` (None: free text)."""
        return self._structured

    @property
    def include_usage(self) -> bool:
        """Whether a streaming response ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Whether every streamed chunk carries the usage so far (vLLM: include_usage and
        continuous_usage_stats both true)."""
        return bool(self.stream_options and self.stream_options.include_usage
                    and self.stream_options.continuous_usage_stats)

    @property
    def bias(self) -> dict[int, float] | None:
        """`logit_bias` with integer token ids."""
        return {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None


Prompt = str | list[int]


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions. `prompt`: a string, a list of token ids, or a list of either (a batch)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: Bool = False
    best_of: int | None = Field(default=None, strict=True)
    logprobs: int | None = Field(default=None, strict=True, ge=-1, le=MAX_LOGPROBS)  # -1: all (up to the limit)
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _no_bool_prompt(cls, v: Any) -> Any:
        if isinstance(v, list):
            for p in v:
                refuse_bools(p, "prompt")
        return refuse_bools(v, "prompt")

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        prompts = v if isinstance(v, list) and v and isinstance(v[0], (str, list)) else [v]
        if len(prompts) > MAX_CHOICES:
            raise ValueError(f"at most {MAX_CHOICES} prompts per request")
        for p in prompts:
            if isinstance(p, str) and not p:
                raise ValueError("prompt must not be empty")
            if isinstance(p, list) and (not p or any(not isinstance(t, int) or t < 0 for t in p)):
                raise ValueError("prompt token ids must be a non-empty list of non-negative ids")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> "CompletionRequest":
        if self.best_of not in (None, 1) and self.best_of != self.n:
            raise field_error("best_of", "best_of must equal n (kvshare returns every sequence it samples)")
        if self.suffix:
            raise field_error("suffix", "suffix (fill-in-the-middle) is not supported")
        if len(self.prompts) * self.n > MAX_CHOICES:
            raise field_error("n", f"n x prompts must be <= {MAX_CHOICES}")
        return self

    @property
    def prompts(self) -> list[Prompt]:
        """The request's prompts (one or a batch), each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return list(p)  # type: ignore[arg-type]
        return [p]  # type: ignore[list-item]

    @property
    def num_logprobs(self) -> int | None:
        """None: no logprobs; k: the chosen tokens' and the top k alternatives (-1: MAX_LOGPROBS)."""
        return MAX_LOGPROBS if self.logprobs == -1 else self.logprobs


class ChatMessage(BaseModel):
    """One conversation turn. `content` may be OpenAI's list of text parts. `role`: the standard
    ones or a custom one (letters, digits, ``_``, ``-``) that the chat template renders or refuses;
    `name` reaches the template as the message's ``name`` (the built-in template has no place for
    it); unknown fields are ignored (`Ignored`)."""

    model_config = ConfigDict(extra="allow")
    role: str = Field(pattern=ROLE_PATTERN)
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

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
    max_completion_tokens: int | None = Field(default=None, strict=True)
    logprobs: Bool = False
    top_logprobs: int | None = Field(default=None, strict=True, ge=-1, le=MAX_LOGPROBS)  # -1: all (up to the limit)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: Bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("max_completion_tokens")
    @classmethod
    def _max_completion_tokens(cls, v: int | None) -> int | None:
        if v is not None and v < 0:
            raise ValueError("max_completion_tokens must be >= 0")
        return v

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise field_error("top_logprobs", "top_logprobs needs logprobs: true")
        return self

    @property
    def num_logprobs(self) -> int | None:
        """None: no logprobs; k: the chosen tokens' and the top k alternatives (-1: MAX_LOGPROBS)."""
        if not self.logprobs:
            return None
        return MAX_LOGPROBS if self.top_logprobs == -1 else (self.top_logprobs or 0)

    @model_validator(mode="after")
    def _tools(self) -> "ChatCompletionRequest":
        try:
            check_tools(self.tools or [])
        except ToolSpecError as e:
            raise field_error(e.field, e.message) from None
        for i, m in enumerate(self.messages):
            for j, call in enumerate(m.tool_calls or []):
                _check_history_call(call, f"messages.{i}.tool_calls.{j}")
        choice = self.tool_choice
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name")
            if choice.get("type") != "function" or name not in self.tool_names:
                raise field_error("tool_choice", "a named tool_choice must name one of the tools")
        elif choice not in (None, "none", "auto", "required"):
            raise field_error("tool_choice", "tool_choice must be none, auto, required or a named function")
        if choice not in (None, "none") and not self.tools:
            raise field_error("tool_choice", "tool_choice needs tools")
        for k in self.chat_template_kwargs or {}:
            if k not in CHAT_TEMPLATE_KWARGS or not isinstance(self.chat_template_kwargs[k], bool):  # type: ignore[index]
                raise field_error(f"chat_template_kwargs.{k}", f"supported: {', '.join(CHAT_TEMPLATE_KWARGS)} "
                                                                "(booleans)")
        if self.forced_tool is not False and self.thinking:
            raise field_error("tool_choice", "required or named tool_choice cannot be combined with thinking")
        if self.forced_tool is not False and self.structured is not None:
            raise field_error("tool_choice", "required or named tool_choice cannot be combined with "
                                              "response_format / structured_outputs")
        return self

    @property
    def tool_names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools or []]

    @property
    def uses_tools(self) -> bool:
        """Whether tool calls are offered (and parsed from the output)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced_tool(self) -> str | None | bool:
        """False: the model chooses; None: some tool call is required; a name: that function is."""
        if not self.uses_tools:
            return False
        if self.tool_choice == "required":
            return None
        if isinstance(self.tool_choice, dict):
            return self.tool_choice["function"]["name"]
        return False

    @property
    def thinking(self) -> bool:
        """Thinking mode (chat_template_kwargs thinking / enable_thinking)."""
        kw = self.chat_template_kwargs or {}
        return bool(kw.get("thinking", kw.get("enable_thinking", False)))

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as plain dicts for a chat template (role, content, and tool fields when set)."""
        out = []
        for m in self.messages:
            d: dict[str, Any] = {"role": m.role, "content": m.text()}
            for k in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
                if getattr(m, k) is not None:
                    d[k] = getattr(m, k)
            out.append(d)
        return out


def _check_history_call(call: Any, where: str) -> None:
    """A past assistant tool call: {id?, type?: function, function: {name, arguments: JSON object text}},
    with names that can be written into the prompt (`tool_grammar`'s rules)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not NAME_RE.match(fn["name"]):
        raise field_error(f"{where}.function.name", "a tool call names a function matching ^[a-zA-Z0-9_-]{1,64}$")
    args = fn.get("arguments", "{}")
    try:
        parsed = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise field_error(f"{where}.function.arguments", "must be a JSON object (as text)")
    for key in parsed:
        if not PARAM_NAME_RE.match(key):
            raise field_error(f"{where}.function.arguments", f"argument name {key!r} must be 1-256 characters "
                                                              'without ", <, > or control characters')


class TokenizeRequest(Ignored):
    """POST /tokenize (vLLM's shape): `prompt`, or chat `messages` rendered with the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: Bool = True
    add_generation_prompt: Bool = True
    return_token_strs: Bool = False

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise field_error("prompt", "give exactly one of prompt and messages")
        return self


class DetokenizeRequest(Ignored):
    """POST /detokenize (vLLM's shape)."""

    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)

    @field_validator("tokens", mode="before")
    @classmethod
    def _no_bools(cls, v: Any) -> Any:
        return refuse_bools(v, "tokens")

    @field_validator("tokens")
    @classmethod
    def _ids(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("tokens must be non-negative token ids")
        return v
