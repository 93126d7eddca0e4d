"""Run the HTTP server on a background thread of this process (tests, notebooks, benchmarks).

`BackgroundServer(app)` binds 127.0.0.1 on a free port before uvicorn starts, so there is no
race for the port, and `base_url` is known as soon as `start()` returns.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn

from kvshare.server.serving import uvicorn_config


class BackgroundServer:
    """uvicorn serving `app` on a daemon thread; a context manager that starts and stops it."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        self.app = app
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = self._sock.getsockname()[:2]
        self._server = uvicorn.Server(uvicorn_config(app, log_level=log_level))
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        """`http://host:port` of the running server."""
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        """Start serving; return once uvicorn accepts connections."""
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="kvshare-uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Ask uvicorn to exit and wait for it (the app's engine loop stops with it)."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
