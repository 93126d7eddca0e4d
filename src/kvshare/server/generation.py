"""Serving one generation request: admission, the engine round trip, streaming or a whole reply.

Every request holds one of `max_concurrent_requests` slots from admission until its response
ends (finished, failed, or the client went away); a request past the limit gets a 429. A client
that disconnects — mid-stream or while waiting for a whole reply — has its engine request
aborted, which frees its cache blocks.

Before its choices reach the engine, a request's grammar is compiled on the engine's compile
thread (`_compile_grammar`: 400 for a grammar refused or one no id of `allowed_token_ids` can
start) and its stop strings become one automaton (`stop_match`, built on a worker thread when
long), both shared by its choices. The choices of one request form one admission group in the
scheduler (`EngineLoop.add(group=...)`), so n x prompts count as the sequences they are.

Shutdown: `ServerState.begin_drain(timeout_s)` refuses new requests with a 503 and lets those in
flight finish; at the deadline each one still open gets a `ShuttingDown` on its queue, so a
stream ends with a final error event and ``data: [DONE]`` and a whole reply gets a 503 — even
when the engine thread is stuck, since the queues live on the event loop. A request still
waiting for the engine thread to take it in (`adding`: the thread is stuck in a step) gets the
same 503.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvshare.errors import RequestError
from kvshare.server.engine_loop import EngineLoop
from kvshare.server.errors import APIError, internal_error
from kvshare.server.metrics import ServerMetrics
from kvshare.server.protocol import new_id
from kvshare.server.responses import DONE, ChoiceSpec, ReplyOptions, ResponseBuilder
from kvshare.server.stop_match import StopPrefixes

log = logging.getLogger("kvshare.server")

_DISCONNECT_POLL_S = 0.25
_INLINE_STOP_CHARS = 4096


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
        """End every open engine request with a final ShuttingDown error (and abort it in the engine)."""
        for rid, queue in list(self.queues.items()):
            queue.put_nowait(ShuttingDown(f"the server is shutting down; the request did not finish within "
                                          f"the {timeout_s:g} s drain limit"))
            self.loop.abort(rid)
        for adding in list(self.adding.values()):
            adding.cancel()  # `generate` turns this into the 503


class ShuttingDown(RuntimeError):
    """The server stopped before this request finished."""


class _Slot:
    """One admitted HTTP request: releases its concurrency slot and aborts its unfinished engine
    requests (one per choice) once."""

    def __init__(self, state: ServerState) -> None:
        if state.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if state.active >= state.max_concurrent_requests:
            raise APIError(429, f"too many concurrent requests (limit {state.max_concurrent_requests}); "
                                "retry later", code="rate_limit_exceeded", headers={"Retry-After": "1"})
        self.state = state
        self.request_ids: list[str] = []
        self.done: set[str] = set()
        self.tasks: list[asyncio.Task] = []
        self._closed = False
        state.active += 1
        state.metrics.http_active = state.active

    @property
    def finished(self) -> bool:
        return all(r in self.done for r in self.request_ids)

    def close(self) -> None:
        """Abort the engine requests that did not finish, and free the slot (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for t in self.tasks:
            t.cancel()
        for rid in self.request_ids:
            self.state.queues.pop(rid, None)
            if rid not in self.done:
                self.state.loop.abort(rid)
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


@dataclass
class Job:
    """What one HTTP request runs: its prompts (ids, text to echo, and optionally what the engine gets:
    the text itself, which it tokenises to the same ids), engine params, n choices each."""

    kind: str
    prompts: list[tuple[Any, ...]]
    params: Any
    n: int = 1
    stream: bool = False
    options: ReplyOptions = field(default_factory=ReplyOptions)
    cache_salt: str | None = None


def _choice_params(params: Any, i: int) -> Any:
    """Choice i of a prompt samples with seed + i (distinct samples, each reproducible)."""
    if i == 0 or getattr(params, "seed", None) is None:
        return params
    return dataclasses.replace(params, seed=params.seed + i)


async def _add(state: ServerState, slot: _Slot, rid: str, prompt: list[int], params: Any, job: Job,
               merged: asyncio.Queue | None, index: int, group: str | None = None) -> asyncio.Queue:
    """Add one engine request; return its output queue, and with `merged` forward its outputs there as
    (choice index, item) (a request of one choice reads its queue directly: no extra hop per token)."""
    slot.request_ids.append(rid)
    try:
        queue = await _engine_add(state, rid, prompt, params, job.cache_salt, group)
    except RequestError as e:
        named = re.search(r"invalid sampling params: ([\w.]+)", str(e))
        param = named.group(1) if named else "prompt" if job.kind == "completion" else "messages"
        raise APIError(400, str(e), param=param, code="invalid_request") from e
    except APIError:
        raise
    except Exception as e:
        log.exception("adding request %s failed", rid)
        raise internal_error(e) from e
    state.queues[rid] = queue

    async def forward() -> None:
        while True:
            item = await queue.get()
            merged.put_nowait((index, item))
            if isinstance(item, BaseException) or item.finished:
                return

    if merged is not None:
        slot.tasks.append(asyncio.get_running_loop().create_task(forward()))
    return queue


async def _engine_add(state: ServerState, rid: str, prompt: str | list[int], params: Any,
                      cache_salt: str | None, group: str | None = None) -> asyncio.Queue:
    """`state.loop.add(...)`, which `ServerState.expire` can end with a 503 while the engine is stuck."""
    adding = asyncio.ensure_future(state.loop.add(rid, prompt, params, cache_salt, group=group))
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


async def generate(state: ServerState, request: Request, job: Job, slot: _Slot | None = None) -> Response:
    """Run one request's choices through the engine; reply with an SSE stream or one JSON body.

    ``n`` > 1: the first choice of each prompt is added alone; the others are added once its first
    output arrives, which the engine sends when the whole prompt has been computed — so with
    prefix caching (the default) they adopt its cached blocks and compute only the prompt's last
    partial block. Choice i samples with ``seed + i`` when a seed is given.

    `slot` is the request's admission (`admit`), taken here when not given; it is closed when the
    reply ends, however it ends."""
    slot = slot or _Slot(state)
    try:
        base = new_id("cmpl" if job.kind == "completion" else "chatcmpl")
        specs: list[ChoiceSpec] = []
        merged: asyncio.Queue = asyncio.Queue()
        followers: dict[int, list[int]] = {}
        for pi, (ids, text, *_) in enumerate(job.prompts):
            for i in range(job.n):
                specs.append(ChoiceSpec(pi * job.n + i, ids, text, leader=i == 0))
            followers[pi * job.n] = [pi * job.n + i for i in range(1, job.n)]
        single = len(specs) == 1

        def rid_of(index: int) -> str:
            return base if single else f"{base}-{index}"

        async def add(index: int) -> None:
            pi, i = divmod(index, job.n)
            prompt = job.prompts[pi][2] if len(job.prompts[pi]) > 2 else job.prompts[pi][0]  # type: ignore[misc]
            queue = await _add(state, slot, rid_of(index), prompt, _choice_params(job.params, i), job,
                               None if single else merged, index, None if single else base)
            if single:
                run.direct = queue

        await _compile_grammar(state, job)
        run = _Run(slot, merged, followers, add, rid_of, len(specs))
        for leader in list(followers):
            await add(leader)
        builder = ResponseBuilder(job.kind, base, state.model_name, tokenizer=state.tokenizer,  # type: ignore[arg-type]
                                  choices=specs, options=job.options, stop=await _stop_prefixes(job))
        if job.stream:
            return _GuardedStream(_events(state, run, builder), slot.close)
        try:
            outs = await run.collect(request)
        except ClientGone:
            return Response(status_code=499)
        return JSONResponse(builder.full(outs))
    except BaseException:
        slot.close()
        raise
    finally:
        if not job.stream:
            slot.close()


async def _stop_prefixes(job: Job) -> StopPrefixes:
    """The request's stop-string automaton, built once for all its choices (on a worker thread when
    the stop strings are long: 256 x 1,024 characters take ~1 s)."""
    stops = [s for s in (getattr(job.params, "stop", None) or []) if s]
    if sum(map(len, stops)) <= _INLINE_STOP_CHARS:
        return StopPrefixes(stops)
    return await asyncio.to_thread(StopPrefixes, stops)


async def _compile_grammar(state: ServerState, job: Job) -> None:
    """Compile the request's grammar before admission, on the engine's compile thread (never the engine
    thread), and hand the compiled grammar to every choice through `job.params.structured`; 400 for a
    grammar refused, or one that no id of `allowed_token_ids` can start."""
    spec = getattr(job.params, "structured", None)
    structured = getattr(state.loop.engine, "structured", None)
    if spec is None or not hasattr(structured, "submit"):
        return
    try:
        compiled = await asyncio.wrap_future(structured.submit(spec))  # type: ignore[union-attr]
    except RequestError as e:
        raise APIError(400, str(e), param=spec.field, code="invalid_value") from None
    allowed = getattr(job.params, "allowed_token_ids", None)
    if allowed and not compiled.first_ids_fit(allowed):
        raise APIError(400, f"allowed_token_ids: no id in it can start text that the {spec.field} grammar "
                            "accepts", param="allowed_token_ids", code="invalid_value")
    job.params.structured = dataclasses.replace(spec, compiled=compiled)


class _Run:
    """The choices of one request in flight: outputs by choice, followers added after their leader."""

    def __init__(self, slot: _Slot, merged: asyncio.Queue, followers: dict[int, list[int]],
                 add: Callable[[int], Awaitable[None]], rid_of: Callable[[int], str], total: int) -> None:
        self.slot, self.merged, self.followers, self.add, self.rid_of = slot, merged, followers, add, rid_of
        self.total = total
        self.outs: dict[int, Any] = {}
        self.direct: asyncio.Queue | None = None  # the one engine queue of a single-choice request
        self.finished: set[int] = set()

    async def next(self, request: Request | None) -> tuple[int, Any]:
        """The next (choice index, output); raises the failure of a choice (the request fails whole)."""
        if self.direct is not None:
            index, item = 0, await _next_output(self.direct, request)
        else:
            index, item = await _next_output(self.merged, request)
        if isinstance(item, BaseException):
            self.slot.done.add(self.rid_of(index))
            raise item
        self.outs[index] = item
        if item.finished:
            self.finished.add(index)
            self.slot.done.add(self.rid_of(index))
        for f in self.followers.pop(index, []):
            await self.add(f)
        return index, item

    @property
    def done(self) -> bool:
        return len(self.finished) == self.total

    async def collect(self, request: Request) -> dict[int, Any]:
        """Wait for every choice's final output (aborted if the client goes away)."""
        try:
            while not self.done:
                await self.next(request)
                if not self.done and await request.is_disconnected():  # also while outputs keep coming
                    raise ClientGone()
            return self.outs
        except (ClientGone, APIError):
            raise
        except Exception as e:
            raise _failure(e) from e


def _failure(e: BaseException) -> APIError:
    """The error reply for a request that failed after admission."""
    if isinstance(e, ShuttingDown):
        return APIError(503, str(e), code="shutting_down")
    return internal_error(e)


async def _next_output(queue: asyncio.Queue, request: Request | None = None) -> Any:
    """The next queue item; raises ClientGone when `request`'s client disconnects while none comes."""
    while True:
        try:
            return await asyncio.wait_for(queue.get(), timeout=_DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            if request is not None and await request.is_disconnected():
                raise ClientGone() from None


async def _events(state: ServerState, run: _Run, builder: ResponseBuilder) -> AsyncIterator[str]:
    """SSE events of one streaming request, ending with `data: [DONE]`.

    Disconnects surface as cancellation of this generator; `_GuardedStream` then closes the slot,
    which aborts the engine requests.
    """
    if builder.kind == "chat":
        for chunk in builder.role_chunks():
            yield chunk
    try:
        while not run.done:
            index, out = await run.next(None)
            for chunk in builder.stream_update(index, out, run.outs):
                yield chunk
        if builder.options.include_usage:
            yield builder.usage_chunk(run.outs)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # the engine failed this request: report it in-stream
        state.metrics.requests_failed += 1
        log.error("request %s failed mid-stream: %s", builder.response_id, e)
        yield _failure(e).sse()
    yield DONE
