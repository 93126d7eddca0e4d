"""A `kvshare serve` subprocess for the server tests, started and waited for in one place."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

SRC = str(Path(__file__).resolve().parents[1] / "src")


def start_serve(port: int, *args: str, timeout_s: float = 120.0) -> subprocess.Popen:
    """``python -m kvshare serve --port PORT ARGS...`` of this checkout (its src first on PYTHONPATH),
    returned once `/health` answers 200; AssertionError with the server's output when it exits or
    does not answer within `timeout_s`. The output goes to a temporary file (`proc.log`), never a
    pipe nobody drains (a full pipe would stop the server)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p)}
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, "-m", "kvshare", "serve", "--port", str(port), *args],
                            stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    proc.log = log  # type: ignore[attr-defined]

    def output() -> str:
        log.seek(0)
        return log.read()[-2000:]

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise AssertionError(f"the server exited: {output()}")
        time.sleep(0.1)
    proc.kill()
    proc.wait()
    raise AssertionError(f"the server did not start: {output()}")
