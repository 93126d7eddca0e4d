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
    body_timeout_s: float = 30.0
    header_timeout_s: float = 10.0
    keep_alive_s: float = 5.0


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


def parse_json(raw: bytes, max_depth: int) -> Any:
    """Decode `raw`; APIError 400 on malformed JSON, nesting past `max_depth`, or invalid Unicode."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise APIError(400, f"the JSON body is nested deeper than {max_depth} levels", code="invalid_json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from e
    check_tree(data, max_depth)
    return data


def check_tree(data: Any, max_depth: int) -> None:
    """Walk the decoded JSON (iteratively): depth <= `max_depth`, every string encodable as UTF-8."""
    stack: list[tuple[Any, int, str]] = [(data, 1, "")]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > max_depth:
            raise APIError(400, f"the JSON body is nested deeper than {max_depth} levels (at {path or 'top'})",
                           param=path or None, code="invalid_json")
        if isinstance(value, dict):
            for k, v in value.items():
                _check_text(k, path)
                stack.append((v, depth + 1, f"{path}.{k}" if path else k))
        else:
            stack.extend((v, depth + 1, f"{path}.{i}") for i, v in enumerate(value))


def _check_text(s: str, path: str) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = s[e.start:e.end].encode("unicode_escape").decode()
        raise APIError(400, f"{path or 'body'}: text is not valid Unicode (lone surrogate {bad})",
                       param=path or None, code="invalid_value") from None
