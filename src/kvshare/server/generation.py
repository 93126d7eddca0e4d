"""Serving one generation request: admission, the engine round trip, streaming or a whole reply.

Every request holds one of `max_concurrent_requests` slots from admission until its response
ends (finished, failed, or the client went away); a request past the limit gets a 429. A client
that disconnects — mid-stream or while waiting for a whole reply — has its engine request
aborted, which frees its cache blocks.

Shutdown: `ServerState.begin_drain(timeout_s)` refuses new requests with a 503 and lets those in
flight finish; at the deadline each one still open gets a `ShuttingDown` on its queue, so a
stream ends with a final error event and ``data: [DONE]`` and a whole reply gets a 503 — even
when the engine thread is stuck, since the queues live on the event loop. A request still
waiting for the engine thread to take it in (`adding`: the thread is stuck in a step) gets the
same 503.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvshare.errors import RequestError
from kvshare.server.engine_loop import EngineLoop
from kvshare.server.errors import APIError, internal_error
from kvshare.server.metrics import ServerMetrics
from kvshare.server.protocol import new_id
from kvshare.server.responses import DONE, ResponseBuilder, TextDeltas

log = logging.getLogger("kvshare.server")

_DISCONNECT_POLL_S = 0.25


@dataclass
class ServerState:
    """What the routes share: the engine loop, tokenizer, limits and counters."""

    loop: EngineLoop
    tokenizer: Any
    model_name: str
    max_concurrent_requests: int = 64
    max_model_len: int | None = None
    default_max_tokens: int = 256
    sampling_defaults: dict[str, Any] = field(default_factory=dict)  # the model's generation_config
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    active: int = 0
    draining: bool = False
    queues: dict[str, asyncio.Queue] = field(default_factory=dict)  # open requests' output queues
    adding: dict[str, asyncio.Future] = field(default_factory=dict)  # requests the engine has not taken yet
    event_loop: asyncio.AbstractEventLoop | None = None

    def begin_drain(self, timeout_s: float) -> None:
        """Refuse new requests; after `timeout_s`, end every open request (call on the event loop)."""
        if self.draining:
            return
        self.draining = True
        asyncio.get_running_loop().call_later(timeout_s, self.expire, timeout_s)

    def expire(self, timeout_s: float = 0.0) -> None:
        """End every open request with a final ShuttingDown error (and abort it in the engine)."""
        for rid, queue in list(self.queues.items()):
            queue.put_nowait(ShuttingDown(f"the server is shutting down; the request did not finish within "
                                          f"the {timeout_s:g} s drain limit"))
            self.loop.abort(rid)
        for adding in list(self.adding.values()):
            adding.cancel()  # `generate` turns this into the 503


class ShuttingDown(RuntimeError):
    """The server stopped before this request finished."""


class _Slot:
    """One admitted request: releases its concurrency slot and aborts its engine request once."""

    def __init__(self, state: ServerState) -> None:
        if state.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if state.active >= state.max_concurrent_requests:
            raise APIError(429, f"too many concurrent requests (limit {state.max_concurrent_requests}); "
                                "retry later", code="rate_limit_exceeded", headers={"Retry-After": "1"})
        self.state = state
        self.request_id: str | None = None
        self.finished = False
        self._closed = False
        state.active += 1
        state.metrics.http_active = state.active

    def close(self) -> None:
        """Abort the engine request unless it finished, and free the slot (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.request_id is not None:
            self.state.queues.pop(self.request_id, None)
        if self.request_id is not None and not self.finished:
            self.state.loop.abort(self.request_id)
        self.state.active -= 1
        self.state.metrics.http_active = self.state.active


class _GuardedStream(StreamingResponse):
    """A streaming response that always runs `on_close`, however the stream ends."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class ClientGone(Exception):
    """The HTTP client disconnected before its reply was ready."""


def admit(state: ServerState) -> _Slot:
    """Take a concurrency slot (429 when none is free, 503 while draining); the caller must close it."""
    return _Slot(state)


async def generate(state: ServerState, request: Request, kind: str, prompt: str | list[int], params: Any,
                   stream: bool, include_usage: bool, logprobs: bool = False,
                   cache_salt: str | None = None, slot: _Slot | None = None) -> Response:
    """Run one request through the engine; reply with an SSE stream or one JSON body.

    `slot` is the request's admission (`admit`), taken here when not given; it is closed when the
    reply ends, however it ends."""
    slot = slot or _Slot(state)
    try:
        rid = new_id("cmpl" if kind == "completion" else "chatcmpl")
        slot.request_id = rid  # from here on, leaving early aborts it (a no-op if it never got in)
        try:
            queue = await _add(state, rid, prompt, params, cache_salt)
        except RequestError as e:
            named = re.search(r"invalid sampling params: (\w+)", str(e))
            param = named.group(1) if named else "prompt" if kind == "completion" else "messages"
            raise APIError(400, str(e), param=param, code="invalid_request") from e
        except APIError:
            raise
        except Exception as e:
            log.exception("adding request %s failed", rid)
            raise internal_error(e) from e
        state.queues[rid] = queue
        builder = ResponseBuilder(kind, rid, state.model_name,  # type: ignore[arg-type]
                                  tokenizer=state.tokenizer if logprobs else None)
        if stream:
            events = _events(state, slot, queue, builder, include_usage, list(getattr(params, "stop", None) or []))
            return _GuardedStream(events, slot.close)
        try:
            out = await _collect(slot, queue, request)
        except ClientGone:
            return Response(status_code=499)
        return JSONResponse(builder.full(out))
    except BaseException:
        slot.close()
        raise
    finally:
        if not stream:
            slot.close()


async def _add(state: ServerState, rid: str, prompt: str | list[int], params: Any,
               cache_salt: str | None) -> asyncio.Queue:
    """`state.loop.add(...)`, which `ServerState.expire` can end with a 503 while the engine is stuck."""
    adding = asyncio.ensure_future(state.loop.add(rid, prompt, params, cache_salt))
    state.adding[rid] = adding
    try:
        return await adding
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if adding.cancelled() and state.draining and not (task is not None and task.cancelling()):
            raise APIError(503, "the server is shutting down; the engine did not take the request in before "
                                "the drain limit", code="shutting_down") from None
        raise
    finally:
        state.adding.pop(rid, None)


def _failure(e: BaseException) -> APIError:
    """The error reply for a request that failed after admission."""
    if isinstance(e, ShuttingDown):
        return APIError(503, str(e), code="shutting_down")
    return internal_error(e)


async def _next_output(queue: asyncio.Queue, request: Request | None = None) -> Any:
    """The next queue item; raises ClientGone when `request`'s client disconnects while none comes."""
    while True:
        try:
            item = await asyncio.wait_for(queue.get(), timeout=_DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            if request is not None and await request.is_disconnected():
                raise ClientGone() from None
            continue
        if isinstance(item, BaseException):
            raise item
        return item


async def _collect(slot: _Slot, queue: asyncio.Queue, request: Request) -> Any:
    """Wait for the final output of a non-streaming request (aborted if the client goes away)."""
    try:
        while True:
            out = await _next_output(queue, request)
            if out.finished:
                slot.finished = True
                return out
            if await request.is_disconnected():  # also while outputs keep coming
                raise ClientGone()
    except (ClientGone, APIError):
        raise
    except Exception as e:
        slot.finished = True  # the engine loop already dropped it
        raise _failure(e) from e


async def _events(state: ServerState, slot: _Slot, queue: asyncio.Queue, builder: ResponseBuilder,
                  include_usage: bool, stop: list[str]) -> AsyncIterator[str]:
    """SSE events of one streaming request, ending with `data: [DONE]`.

    Disconnects surface as cancellation of this generator; `_GuardedStream` then closes the slot,
    which aborts the engine request.
    """
    deltas = TextDeltas(stop)
    if builder.kind == "chat":
        yield builder.role_chunk()
    try:
        while True:
            out = await _next_output(queue, None)
            text = deltas.next(out)
            if text:
                yield builder.delta_chunk(text, out)
            if out.finished:
                slot.finished = True
                yield builder.finish_chunk(out.finish_reason, out)
                if include_usage:
                    yield builder.usage_chunk(out)
                break
    except asyncio.CancelledError:
        raise
    except Exception as e:  # the engine failed this request: report it in-stream
        slot.finished = True
        state.metrics.requests_failed += 1
        log.error("request %s failed mid-stream: %s", builder.response_id, e)
        yield _failure(e).sse()
    yield DONE
