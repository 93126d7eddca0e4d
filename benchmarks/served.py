"""A `kvshare serve` process for the server benchmarks: started on a loopback port, waited for
until /health answers, terminated on exit; and its resident memory (from server/memory.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import httpx

from kvshare.server.memory import rss_bytes


def rss_mb(pid: int) -> float:
    """Resident memory of process `pid` in MB."""
    n = rss_bytes(pid)
    if n is None:
        raise RuntimeError(f"no resident memory readable for pid {pid}")
    return n / 2**20


@contextmanager
def served(port: int, threads: int, log_level: str, stop_timeout: float,
           extra: Sequence[str] = ()) -> Iterator[tuple[subprocess.Popen, str]]:
    """(server process, base URL) of `kvshare serve` on 127.0.0.1:`port` (more `serve` flags in
    `extra`), ready to answer."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    srv = subprocess.Popen([sys.executable, "-m", "kvshare", "serve", "--port", str(port), "--log-level", log_level,
                            "--threads", str(threads), *extra], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield srv, url
    finally:
        srv.terminate()
        srv.wait(stop_timeout)
