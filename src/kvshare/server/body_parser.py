"""Decoding request bodies: small ones inline, large ones in a child process.

Decoding a body is CPU work that holds the GIL: `json.loads` of 4 MiB of small values takes
~40 ms in one C call, and walking or validating the result takes up to ~300 ms more. Done in
the server process, that time is taken from the engine thread and the event loop, so every
stream stalls. `BodyParser` therefore hands bodies over `OFF_LOOP_BYTES` to one child process
(`python -m kvshare.server.body_parser`) that decodes, checks the structure (`limits.
check_structure`) and validates the pydantic model, and sends back only the validated model,
whose size the limits bound. The server process only copies bytes through a pipe (the GIL is
released during the blocking I/O).

Invariants:
* `decode_body` is the one decoding path; the child runs the same function, so a body gets the
  same answer (model or APIError) whichever side decodes it.
* One body is in the child at a time (an asyncio lock orders them; one thread waits on the pipe).
* A child that dies, or takes over `limits.parse_timeout_s`, is killed and replaced on the next
  body; that body gets a 400 (timeout) or 500 (crash), and the server goes on.
* The child exits when its stdin closes, so it never outlives the server.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from pydantic import BaseModel, ValidationError

from kvshare.server.errors import APIError, from_validation_error
from kvshare.server.limits import OFF_LOOP_BYTES, RequestLimits, parse_json
from kvshare.server.memory import release_free_memory

M = TypeVar("M", bound=BaseModel)
_HEADER = struct.Struct("<Q")
_CHILD_NICE = 5  # the child yields the CPU to the engine when both want it


def decode_body(raw: bytes, model: type[M], limits: RequestLimits) -> M:
    """The JSON body `raw` validated as `model`; APIError 400 on malformed JSON, a limit passed, or an
    invalid field."""
    data = parse_json(raw, limits)
    if not isinstance(data, dict):
        raise APIError(400, "the JSON body must be an object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from e


class BodyParser:
    """Decodes bodies for one app: inline up to OFF_LOOP_BYTES, in the child process above."""

    def __init__(self, limits: RequestLimits) -> None:
        self.limits = limits
        self._order = asyncio.Lock()
        self._io = threading.Lock()
        self._proc: subprocess.Popen | None = None

    async def parse(self, raw: bytes, model: type[M]) -> M:
        """`decode_body(raw, model, limits)`, off this process for large bodies."""
        if len(raw) <= OFF_LOOP_BYTES:
            return decode_body(raw, model, self.limits)
        async with self._order:
            return await asyncio.to_thread(self._call, raw, model)

    def close(self) -> None:
        """Stop the child (if any); a later large body starts a new one."""
        with self._io:
            self._kill()

    # ---- the pipe (on a worker thread, one call at a time) -----------------------------------

    def _call(self, raw: bytes, model: type[M]) -> M:
        with self._io:
            proc = self._proc if self._proc is not None and self._proc.poll() is None else self._spawn()
            assert proc.stdin is not None and proc.stdout is not None
            try:
                _send(proc.stdin, pickle.dumps((raw, model, self.limits), protocol=pickle.HIGHEST_PROTOCOL))
                reply = _receive(proc.stdout, self.limits.parse_timeout_s)
            except TimeoutError:
                self._kill()
                raise APIError(400, f"the request body took over {self.limits.parse_timeout_s:g} s to decode",
                               code="invalid_json") from None
            except (OSError, EOFError) as e:
                self._kill()
                raise APIError(500, f"the body parser process failed: {e}", code="internal_error") from e
        if reply[0] == "ok":
            return reply[1]
        _, status, message, param, code = reply
        raise APIError(status, message, param=param, code=code)

    def _spawn(self) -> subprocess.Popen:
        self._kill()
        src = str(Path(__file__).resolve().parents[2])  # the kvshare this process runs, not another install
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}
        self._proc = subprocess.Popen([sys.executable, "-m", "kvshare.server.body_parser"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, env=env, close_fds=True, bufsize=0)
        return self._proc

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for f in (proc.stdin, proc.stdout):
            if f is not None:
                f.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait()


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


def _receive(f: BinaryIO, timeout_s: float) -> Any:
    ready, _, _ = select.select([f], [], [], timeout_s)
    if not ready:
        raise TimeoutError
    (size,) = _HEADER.unpack(_read_exact(f, _HEADER.size))
    return pickle.loads(_read_exact(f, size))


def _serve(stdin: BinaryIO, stdout: BinaryIO) -> None:
    """The child: decode one body per message until stdin closes."""
    while True:
        head = stdin.read(_HEADER.size)
        if len(head) < _HEADER.size:
            return
        raw, model, limits = pickle.loads(_read_exact(stdin, _HEADER.unpack(head)[0]))
        try:
            reply: tuple = ("ok", decode_body(raw, model, limits))
        except APIError as e:
            reply = ("err", e.status, e.message, e.param, e.code)
        except Exception as e:  # a bug, not the client's fault: the parent answers 500
            reply = ("err", 500, f"internal error while decoding the body: {type(e).__name__}: {e}", None,
                     "internal_error")
        del raw
        _send(stdout, pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
        del reply
        release_free_memory()


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle; stdin EOF ends us
    try:
        os.nice(_CHILD_NICE)
    except OSError:
        pass
    _serve(sys.stdin.buffer, sys.stdout.buffer)
