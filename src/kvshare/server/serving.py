"""Running the app under uvicorn with bounded timeouts and a bounded, graceful shutdown.

* `HeaderTimeoutH11Protocol`: a connection that has not sent a complete request head within
  `header_timeout_s` (after connecting, or after its previous response) is closed, so slow
  clients cannot hold connections open (slowloris); idle keep-alive uses uvicorn's own timeout.
* `DrainingServer`: the first SIGTERM / SIGINT calls `on_drain()`, which refuses new requests
  (503) and, after the drain limit, ends every open request with its protocol's error
  (`ServerState.begin_drain`). The listener stays open meanwhile, so /health keeps answering
  503 "shutting_down" (a load balancer sees a draining server, not refused connections); once
  `drained()` holds (no request open) or the limit (+1 s) passes, uvicorn closes it and exits.
  A second signal exits at once. When `fatal()` turns true (the engine loop stopped for good, e.g.
  a lost tensor-parallel worker) the server exits the same way without a signal.
* `uvicorn_config(app, ...)` / `run_app(app, ...)` wire both into uvicorn (`BackgroundServer`
  uses the same config).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from typing import Any, Callable

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("kvshare.server")


def header_timeout_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """An h11 protocol class closing connections whose request head takes over `header_timeout_s`."""

    class HeaderTimeoutH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_timeout)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a complete request head arrived
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request on this connection gets the same limit

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderTimeoutH11Protocol


class DrainingServer(uvicorn.Server):
    """uvicorn.Server that drains before closing its listener (see the module doc)."""

    def __init__(self, config: uvicorn.Config, on_drain: Callable[[], None] | None = None,
                 drained: Callable[[], bool] | None = None, drain_timeout_s: float = 20.0,
                 fatal: Callable[[], bool] | None = None) -> None:
        super().__init__(config)
        self.on_drain = on_drain
        self.drained = drained
        self.drain_timeout_s = drain_timeout_s
        self.fatal = fatal
        self._signals = 0
        self._drain_deadline: float | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        self._signals += 1
        if self._signals > 1:
            log.warning("second %s: exiting now", signal.Signals(sig).name)
            os._exit(128 + int(sig))
        log.info("%s: draining requests in flight, then exiting (send it again to exit now)",
                 signal.Signals(sig).name)
        if self.drained is None:
            super().handle_exit(sig, frame)
        else:
            self._captured_signals.append(sig)  # re-raised by uvicorn once it has shut down
            self._drain_deadline = time.monotonic() + self.drain_timeout_s + 1.0
        if self.on_drain is not None:
            self.on_drain()

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's 0.1 s tick: exit once the drain is over, or at once when the engine is gone."""
        if self._drain_deadline is not None and not self.should_exit:
            if self.drained is not None and self.drained() or time.monotonic() > self._drain_deadline:
                self.should_exit = True
        if self.fatal is not None and not self.should_exit and self.fatal():
            log.error("the engine stopped for good; shutting the server down")
            self.should_exit = True
        return await super().on_tick(counter)


def uvicorn_config(app: Any, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "info",
                   shutdown_timeout_s: float = 20.0) -> uvicorn.Config:
    """uvicorn settings for `app`, with the header and keep-alive timeouts of its RequestLimits."""
    limits = getattr(getattr(app, "state", None), "limits", None)
    header_s = getattr(limits, "header_timeout_s", 10.0)
    keep_alive_s = getattr(limits, "keep_alive_s", 5.0)
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                          http=header_timeout_protocol(header_s), timeout_keep_alive=keep_alive_s,
                          timeout_graceful_shutdown=shutdown_timeout_s + 1.0)


def run_app(app: Any, host: str, port: int, *, log_level: str = "info", shutdown_timeout_s: float = 20.0,
            on_drain: Callable[[], None] | None = None, drained: Callable[[], bool] | None = None,
            fatal: Callable[[], bool] | None = None) -> None:
    """Serve `app` until a signal (or `fatal()`); the drain ends within `shutdown_timeout_s` (+1 s backstop)."""
    config = uvicorn_config(app, host, port, log_level=log_level, shutdown_timeout_s=shutdown_timeout_s)
    DrainingServer(config, on_drain, drained, shutdown_timeout_s, fatal).run()
