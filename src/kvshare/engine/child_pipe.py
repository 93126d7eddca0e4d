"""A length-prefixed pickle pipe to a helper child process, with CPU- and wall-time limits.

Used by the server's body parser (server/body_parser.py) and the grammar compile child
(engine/grammar_worker.py): each message is an 8-byte little-endian length and that many bytes;
`_exchange` writes a request and reads the reply without blocking, so a stopped or crashed child
cannot hang the caller, and measures the child's CPU time from /proc.
"""

from __future__ import annotations

import fcntl
import os
import pickle
import select
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, BinaryIO

_HEADER = struct.Struct("<Q")
_READ_CHUNK = 1 << 20
_PIPE_BYTES = 1 << 20  # Linux's default pipe-max-size: a 4 MiB body crosses in 4 writes, not 64


def _send(f: BinaryIO, payload: bytes) -> None:
    f.write(_HEADER.pack(len(payload)))
    f.write(payload)
    f.flush()


def _read_exact(f: BinaryIO, n: int) -> bytes:
    parts, left = [], n
    while left:
        part = f.read(left)
        if not part:
            raise EOFError("the pipe closed")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def _widen(f: BinaryIO | None) -> None:
    """Grow the pipe behind `f` to _PIPE_BYTES where Linux allows (each write wakes the GIL once)."""
    if f is None or not hasattr(fcntl, "F_SETPIPE_SZ"):
        return
    try:
        fcntl.fcntl(f.fileno(), fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
    except OSError:  # over the system's pipe-max-size: the default size works, in more writes
        pass


class _CpuTimeout(TimeoutError):
    """The child used more CPU time on one body than the limit allows."""


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of process `pid` in seconds, from /proc; None where unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _exchange(proc: subprocess.Popen, payload: bytes, cpu_limit_s: float, wall_limit_s: float) -> Any:
    """Send `payload` to the child and return its unpickled reply.

    Writing and reading are interleaved without blocking (the child may answer before it has read
    everything, e.g. a crash), so a stopped child cannot hang the caller. Raises _CpuTimeout once
    the child has spent over `cpu_limit_s` of CPU since the call began (wall time where /proc is
    missing), TimeoutError after `wall_limit_s`, EOFError when the child closes its end.
    """
    assert proc.stdin is not None and proc.stdout is not None
    out_fd, in_fd = proc.stdin.fileno(), proc.stdout.fileno()
    os.set_blocking(out_fd, False)
    pending = [memoryview(_HEADER.pack(len(payload))), memoryview(payload)]
    reply = bytearray()
    size: int | None = None
    cpu0 = _cpu_seconds(proc.pid)
    start = time.monotonic()
    poll_s = min(0.1, cpu_limit_s / 4)
    while True:
        readable, writable, _ = select.select([in_fd], [out_fd] if pending else [], [], poll_s)
        if writable:
            try:
                n = os.write(out_fd, pending[0])
            except BlockingIOError:  # the pipe filled up between select and write
                n = 0
            pending[0] = pending[0][n:]
            if not len(pending[0]):
                pending.pop(0)
        if readable:
            part = os.read(in_fd, _READ_CHUNK)
            if not part:
                raise EOFError("the pipe closed")
            reply += part
            if size is None and len(reply) >= _HEADER.size:
                size = _HEADER.size + _HEADER.unpack_from(reply)[0]
            if size is not None and len(reply) >= size:
                return pickle.loads(memoryview(reply)[_HEADER.size:size])
        waited = time.monotonic() - start
        cpu = _cpu_seconds(proc.pid)
        used = waited if cpu is None or cpu0 is None else cpu - cpu0
        if used > cpu_limit_s:
            raise _CpuTimeout
        if waited > wall_limit_s:
            raise TimeoutError




def spawn(module: str) -> subprocess.Popen:
    """A helper child running ``python -m module`` of the kvshare this process runs (its source
    directory first on PYTHONPATH, not another install), with pipes on stdin / stdout."""
    src = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}
    return subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                            close_fds=True, bufsize=0)


def kill(proc: subprocess.Popen | None) -> None:
    """Close a child's pipes, kill it if it still runs, and reap it (None: nothing to do)."""
    if proc is None:
        return
    for f in (proc.stdin, proc.stdout):
        if f is not None:
            f.close()
    if proc.poll() is None:
        proc.kill()
    proc.wait()
