"""One engine loop serving every HTTP request concurrently.

A background thread owns the `LLMEngine`: it is the only thread that calls into it. Request
handlers (on the asyncio event loop) send it commands — add a request, abort a request — through a
thread-safe queue, and receive each request's `RequestOutput`s through that request's own
`asyncio.Queue`. Between commands the thread calls `engine.step()` while there is work, so all
requests in flight are batched together by the engine's scheduler.

Failure isolation: `add_request` errors go back to the one handler that asked. A request that
fails alone inside a step (the engine reports finish_reason "error") gets a `RequestFailed` on
its queue; the others go on. If `step()` itself raises, the requests that were in flight get the
exception (each handler reports a 500), are aborted so their blocks are freed, and the loop
carries on with new requests — unless the exception is marked `engine_fatal` (a lost or stuck
tensor-parallel worker): then the engine is unusable, so the loop fails every request, stops
(`error` holds the exception, /health reports 503) and calls `on_fatal(error)`, with which
`kvshare serve` shuts the server down and exits with that error.

Memory: when the loop goes idle after requests finished, it hands the C heap's free pages back to
the OS (`memory.release_free_memory`, glibc `malloc_trim`), at most once per `_TRIM_EVERY_S`;
without it the RSS stays at the peak of the busiest moment (freed tensors and request buffers
stay in malloc's per-thread arenas).

Watchdog: `progress_at` is the monotonic time the loop last finished a step or idled; `stalled(s)`
says whether work is pending and the loop has not advanced for `s` seconds (an engine stuck in
a step), which /health reports as a 503. `step_overdue()` says sooner whether the step running
now has taken far longer than the recent ones (`overdue_after_s`: 4x the longest of the last
_RECENT_STEPS steps, at least _MIN_OVERDUE_S): a stopped tensor-parallel worker turns /health 503
within seconds, not after the worker's step timeout.

Groups: `add(..., group=...)` marks the engine sequence with its HTTP request's id, so the
scheduler admits the choices of one request as one group (engine/scheduler.py, Fairness).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from kvshare.server.memory import release_free_memory
from kvshare.server.metrics import ServerMetrics

log = logging.getLogger("kvshare.server")

_IDLE_WAIT_S = 0.05
_TRIM_EVERY_S = 1.0
_MAX_BACKOFF_S = 1.0
_RECENT_STEPS = 64
_MIN_OVERDUE_S = 5.0
_OVERDUE_FACTOR = 4.0


@dataclass
class _Stream:
    """Where one request's outputs go: a queue living on `loop`."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class RequestFailed(RuntimeError):
    """The engine failed this one request inside a step (the message says why)."""


class EngineLoop:
    """Runs `engine.step()` on a background thread and routes outputs to per-request queues.

    Queue items are `RequestOutput`s; an `Exception` item means the request failed inside the
    engine and will get no more outputs.
    """

    def __init__(self, engine: Any, metrics: ServerMetrics | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None) -> None:
        self.engine = engine
        self.on_fatal = on_fatal
        self.metrics = metrics or ServerMetrics()
        self._cmds: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._thread: threading.Thread | None = None
        self._backoff = 0.0  # pause after consecutive failed steps, so a broken engine cannot spin
        self.error: BaseException | None = None  # set if the thread itself dies
        self.progress_at = time.monotonic()  # last time the loop finished a step or idled
        self._pending = 0  # requests in flight, as last seen by the engine thread
        self._freed = False  # requests ended since the last heap trim
        self._trimmed_at = 0.0
        self.step_started_at: float | None = None  # monotonic start of the step running now
        self._recent: collections.deque[float] = collections.deque(maxlen=_RECENT_STEPS)  # step durations

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="kvshare-engine-loop", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread after its current step; requests in flight are aborted."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._thread = None

    @property
    def alive(self) -> bool:
        """Whether the engine thread is running."""
        return self._thread is not None and self._thread.is_alive()

    def stalled(self, timeout_s: float) -> bool:
        """Whether work is pending and the loop has not advanced for more than `timeout_s` seconds."""
        busy = self._pending > 0 or not self._cmds.empty()
        return busy and time.monotonic() - self.progress_at > timeout_s

    @property
    def overdue_after_s(self) -> float:
        """How long one step may run before `step_overdue` says so."""
        return max(_MIN_OVERDUE_S, _OVERDUE_FACTOR * max(self._recent, default=0.0))

    def step_overdue(self) -> bool:
        """Whether the step running now has run longer than `overdue_after_s`."""
        started = self.step_started_at
        return started is not None and time.monotonic() - started > self.overdue_after_s

    # ---- called from the event loop ----------------------------------------------------------

    async def add(self, request_id: str, prompt: str | list[int], params: Any,
                  cache_salt: str | None = None, group: str | None = None) -> asyncio.Queue:
        """Add a request; return the queue its outputs arrive on.

        Raises whatever `engine.add_request` raised (`RequestError` for bad input).
        """
        if not self.alive:
            raise RuntimeError("the engine loop is not running")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        done: asyncio.Future = loop.create_future()
        self._cmds.put(("add", request_id, prompt, params, cache_salt, group, _Stream(loop, q), done))
        self._wake.set()
        await done
        return q

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op when it already finished); its blocks are freed on the engine thread."""
        self._cmds.put(("abort", request_id))
        self._wake.set()

    # ---- the engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._refresh_stats()  # /metrics shows the pool before the first request
            while not self._stop.is_set():
                self._drain_commands()
                self._pending = len(self._streams)
                if self.engine.has_unfinished_requests():
                    self._step()
                else:
                    self._trim_when_idle()
                    self._wake.wait(_IDLE_WAIT_S)
                    self._wake.clear()
                self.progress_at = time.monotonic()
            self._close(RuntimeError("the server is shutting down"))
        except BaseException as e:  # the loop must never die silently
            if getattr(e, "engine_fatal", False):
                log.error("the engine cannot go on: %s", e)
            else:
                log.exception("engine loop crashed")
            self.error = e
            self._close(e)
            if self.on_fatal is not None:
                self.on_fatal(e)

    def _trim_when_idle(self) -> None:
        now = time.monotonic()
        if self._freed and now - self._trimmed_at >= _TRIM_EVERY_S:
            release_free_memory()
            self._freed = False
            self._trimmed_at = time.monotonic()
            self.metrics.heap_trims += 1

    def _close(self, e: BaseException) -> None:
        """Fail the requests in flight and refuse the adds still queued."""
        self._fail_all(e)
        self._refresh_stats()
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _call(cmd[5].loop, _resolve, cmd[6], e)

    def _drain_commands(self) -> None:
        changed = False
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            changed = True
            if cmd[0] == "add":
                self._add(*cmd[1:])
            else:
                self._abort(cmd[1])
        if changed:
            self._refresh_stats()

    def _add(self, rid: str, prompt: str | list[int], params: Any, cache_salt: str | None, group: str | None,
             stream: _Stream, done: asyncio.Future) -> None:
        try:
            self.engine.add_request(rid, prompt, params, cache_salt=cache_salt)
        except Exception as e:
            _call(stream.loop, _resolve, done, e)
            return
        seq = getattr(self.engine, "requests", {}).get(rid) if group is not None else None
        if seq is not None:
            seq.group = group  # the scheduler's admission group (engine/scheduler.py)
        self._streams[rid] = stream
        self.metrics.on_request_added()
        if not _call(stream.loop, _resolve, done, None):
            self._abort(rid)  # the client's event loop is gone

    def _abort(self, rid: str) -> None:
        if self._streams.pop(rid, None) is None:
            return  # already finished or never added
        try:
            self.engine.abort_request(rid)
        except Exception:  # already finished inside the engine
            log.debug("abort of %s: engine had nothing to abort", rid, exc_info=True)
        self.metrics.on_request_done(aborted=True)
        self._freed = True

    def _fail(self, rid: str, e: BaseException) -> None:
        stream = self._streams.pop(rid, None)
        if stream is not None:
            _call(stream.loop, stream.queue.put_nowait, e)
            self.metrics.on_request_done(aborted=True)

    def _fail_all(self, e: BaseException) -> None:
        """Fail every request in flight with `e` and abort it in the engine (frees its blocks)."""
        for rid in list(self._streams):
            self._fail(rid, e)
            try:
                self.engine.abort_request(rid)
            except Exception:
                log.debug("abort of failed request %s", rid, exc_info=True)

    def _step(self) -> None:
        t0 = time.perf_counter()
        self.step_started_at = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as e:
            self.step_started_at = None
            if getattr(e, "engine_fatal", False):
                raise  # `_run` fails every request and stops the loop
            log.exception("engine step failed; failing the %d requests in flight", len(self._streams))
            self._fail_all(e)
            self._refresh_stats()
            self._backoff = min(_MAX_BACKOFF_S, max(0.01, 2 * self._backoff))
            self._wake.wait(self._backoff)
            self._wake.clear()
            return
        self._recent.append(time.monotonic() - self.step_started_at)
        self.step_started_at = None
        self._backoff = 0.0
        new_tokens = 0
        for out in outputs:
            new_tokens += len(getattr(out, "new_token_ids", None) or ())
            self.metrics.on_output(out)
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
                self._freed = True
                failed = out.finish_reason == "error"
                self.metrics.on_request_done(aborted=failed)
                if failed:
                    _call(stream.loop, stream.queue.put_nowait, RequestFailed(out.error or "the request failed"))
                    continue
            if not _call(stream.loop, stream.queue.put_nowait, out) and not out.finished:
                self._abort(out.request_id)
        self.metrics.on_step(new_tokens, time.perf_counter() - t0)
        self._refresh_stats()

    def _refresh_stats(self) -> None:
        try:
            self.metrics.on_stats(self.engine.stats())
        except Exception:
            log.debug("engine.stats() failed", exc_info=True)


def _resolve(fut: asyncio.Future, error: BaseException | None) -> None:
    """Complete `fut` unless its waiter gave up (cancelled) already."""
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)


def _call(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> bool:
    """Schedule `fn(*args)` on `loop` from this thread; False when the loop is closed."""
    try:
        loop.call_soon_threadsafe(fn, *args)
        return True
    except RuntimeError:
        return False
