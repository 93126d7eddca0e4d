"""Request limits, enforced before a route runs: body size and read time, JSON depth, valid text.

* `BodyLimitMiddleware` reads a POST body in full before the app sees it: a declared or actual
  size over `max_body_bytes` gets a 413, a body slower than `body_timeout_s` a 408, and a client
  that disconnects mid-body gets no reply and is counted as a disconnect, not a failed request.
* `parse_json(raw, max_depth)` decodes a body; nesting deeper than `max_depth`, and strings that
  are not valid Unicode (a lone surrogate such as ``"\\ud800"``), are 400s naming where.
  `app._parse` runs it (and pydantic validation) on a worker thread for bodies over
  `OFF_LOOP_BYTES`, so one large body does not stall the other streams.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvshare.server.errors import APIError

OFF_LOOP_BYTES = 64 * 1024
MAX_CHARS_PER_TOKEN = 64  # a text prompt longer than max_model_len x this is refused before tokenising


@dataclass
class RequestLimits:
    """Limits on one HTTP request (the `serve` flags of the same names set them)."""

    max_body_bytes: int = 4 * 2**20
    max_json_depth: int = 32
    max_array_items: int = 8192  # any array but a token-id prompt (messages, content parts, ...)
    max_prompt_tokens: int = 2**20  # token ids in a prompt; `create_app` lowers it to the model's context
    max_object_keys: int = 1024
    max_json_nodes: int = 2**17  # objects, arrays, strings and keys in one body
    max_stop_chars: int = 1024  # characters of one stop sequence
    parse_timeout_s: float = 10.0  # a body the parse worker has not decoded by then is refused
    body_timeout_s: float = 30.0
    header_timeout_s: float = 10.0
    keep_alive_s: float = 5.0
    max_response_bytes: int = 8 * 2**20  # a whole reply (echo, prompt logprobs, /tokenize) estimated larger: 413


# Bytes of JSON one prompt token adds to a reply: its text or id, and per logprob entry (chosen + top k).
REPLY_BYTES_PER_TOKEN = 16
REPLY_BYTES_PER_LOGPROB = 40


def check_reply_size(limits: RequestLimits, tokens: int, logprobs: int | None, what: str, param: str) -> None:
    """413 when a reply listing `tokens` prompt tokens (each with 1 + `logprobs` logprobs when not None)
    would pass `limits.max_response_bytes`; checked before the engine runs, from the token counts alone."""
    per = REPLY_BYTES_PER_TOKEN + (REPLY_BYTES_PER_LOGPROB * (1 + logprobs) if logprobs is not None else 0)
    size = tokens * per
    if size > limits.max_response_bytes:
        raise APIError(413, f"the reply would hold {what} for {tokens} prompt tokens, about {size // 2**20 + 1} MiB, "
                            f"over the server's response limit of {limits.max_response_bytes // 2**20} MiB "
                            "(max_response_bytes); ask for less", param=param, code="response_too_large")


class _TooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """Buffer each request body under a size and time limit, then replay it to the app."""

    def __init__(self, app: ASGIApp, limits: RequestLimits, metrics: Any = None) -> None:
        self.app = app
        self.limits = limits
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        limit = self.limits.max_body_bytes
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _too_large(limit)(scope, receive, send)
            return
        try:
            body = await asyncio.wait_for(_read_body(receive, limit), self.limits.body_timeout_s)
        except _TooLarge:
            await _too_large(limit)(scope, receive, send)
            return
        except asyncio.TimeoutError:
            err = APIError(408, f"the request body did not arrive within {self.limits.body_timeout_s:g} s",
                           code="request_timeout")
            await err.response()(scope, receive, send)
            return
        if body is None:  # the client went away mid-body: nothing to answer
            if self.metrics is not None:
                self.metrics.client_disconnects += 1
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole body, or None when the client disconnected first; _TooLarge past `limit` bytes."""
    chunks: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return None
        part = msg.get("body", b"")
        size += len(part)
        if size > limit:
            raise _TooLarge()
        chunks.append(part)
        if not msg.get("more_body", False):
            return b"".join(chunks)


def _too_large(limit: int) -> Any:
    return APIError(413, f"the request body is larger than {limit} bytes (the server's --max-body-bytes)",
                    code="request_too_large").response()


def parse_json(raw: bytes, limits: RequestLimits) -> Any:
    """Decode `raw` and check its structure; APIError 400 on malformed JSON or a limit passed."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise APIError(400, f"the JSON body is nested deeper than {limits.max_json_depth} levels",
                       code="invalid_json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from e
    check_structure(data, limits)
    return data


_SCALARS = frozenset({int, float, bool, type(None)})
_PROMPT_IDS = ("prompt",)  # token-id lists at ("prompt",) or ("prompt", i) may be as long as the context


def check_structure(data: Any, limits: RequestLimits) -> None:
    """Check a decoded body against `limits` before any model validation sees it.

    Invariants on success: nesting <= max_json_depth; every array <= max_array_items elements
    (a token-id `prompt` <= max_prompt_tokens); every object <= max_object_keys keys; at most
    max_json_nodes containers, strings and keys in all; `stop` <= MAX_STOP_STRINGS strings of
    <= max_stop_chars characters; every string encodable as UTF-8. An array is refused on its
    length alone, before its elements are visited, and an array of numbers is classified in C
    (`map(type, ...)`), so the cost is bounded by max_json_nodes, not by the body's size.
    """
    budget = limits.max_json_nodes
    stack: list[tuple[Any, int, tuple[Any, ...]]] = [(data, 1, ())]
    while stack:
        value, depth, path = stack.pop()
        if not isinstance(value, (dict, list)):  # only the top level can be a scalar here
            if isinstance(value, str):
                _check_text(value, path)
            continue
        if depth > limits.max_json_depth:
            raise _limit(f"the JSON body is nested deeper than {limits.max_json_depth} levels", path,
                         code="invalid_json")
        budget -= 1
        if isinstance(value, dict):
            if len(value) > limits.max_object_keys:
                raise _limit(f"an object has {len(value)} keys (at most {limits.max_object_keys})", path)
            budget -= len(value)
            if budget < 0:
                raise _limit(f"the JSON body has more than {limits.max_json_nodes} objects, arrays and strings",
                             path)
            for k, v in value.items():
                _check_text(k, path)
                if isinstance(v, str):
                    _check_text(v, path + (k,))
                elif isinstance(v, (dict, list)):
                    stack.append((v, depth + 1, path + (k,)))
            if not path and "stop" in value:
                _check_stop(value["stop"], limits)
            continue
        # a list
        cap = limits.max_prompt_tokens if path[:1] == _PROMPT_IDS and len(path) <= 2 else limits.max_array_items
        if len(value) > cap:
            raise _limit(f"an array has {len(value)} elements (at most {cap})", path)
        kinds = set(map(type, value))
        if kinds <= _SCALARS:
            continue  # numbers, booleans, nulls: nothing inside to check
        budget -= len(value)
        if budget < 0:
            raise _limit(f"the JSON body has more than {limits.max_json_nodes} objects, arrays and strings", path)
        if str in kinds and not "".join(v for v in value if type(v) is str).isascii():
            for i, v in enumerate(value):
                if type(v) is str:
                    _check_text(v, path + (i,))
        if dict in kinds or list in kinds:
            stack.extend((v, depth + 1, path + (i,)) for i, v in enumerate(value) if type(v) in (dict, list))


MAX_STOP_STRINGS = 256  # = protocol.MAX_STOP_STRINGS (vLLM takes any number; lm-eval tasks send 5+)


def _check_stop(stop: Any, limits: RequestLimits) -> None:
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    if len(stops) > MAX_STOP_STRINGS:
        raise _limit(f"at most {MAX_STOP_STRINGS} stop sequences (got {len(stops)})", ("stop",))
    for s in stops:
        if isinstance(s, str) and len(s) > limits.max_stop_chars:
            raise _limit(f"a stop sequence has {len(s)} characters (at most {limits.max_stop_chars})", ("stop",))


def _limit(message: str, path: tuple[Any, ...], code: str = "invalid_value") -> APIError:
    where = ".".join(str(p) for p in path)
    return APIError(400, f"{message} (at {where or 'top'})", param=where or None, code=code)


def _check_text(s: str, path: tuple[Any, ...]) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        where = ".".join(str(p) for p in path)
        bad = s[e.start:e.end].encode("unicode_escape").decode()
        raise APIError(400, f"{where or 'body'}: text is not valid Unicode (lone surrogate {bad})",
                       param=where or None, code="invalid_value") from None
