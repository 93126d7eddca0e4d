"""Decoding request bodies: small ones inline, large ones in a child process.

Decoding a body is CPU work that holds the GIL: `json.loads` of 4 MiB of small values takes
~40-80 ms in one C call, and walking or validating the result takes as long again. Done in the
server process, that time is taken from the engine thread and the event loop, so every stream
stalls. `BodyParser` therefore hands bodies over `OFF_LOOP_BYTES` to one child process
(`python -m kvshare.server.body_parser`) that decodes, checks the structure (`limits.
check_structure`) and validates the pydantic model, and sends back only the validated model,
whose size the limits bound. The server process only copies bytes through a pipe (from a worker
thread, with the GIL released while it waits).

Invariants:
* `decode_body` is the one decoding path; the child runs the same function, so a body gets the
  same answer (model or APIError) whichever side decodes it.
* One body is in the child at a time (an asyncio lock orders them; one thread works the pipe).
* The child runs at nice 19: on a machine with a free core it takes that core, and where cores
  are contended it takes almost nothing from the engine thread (measured: the streams kept a
  median 78% of their rate through bursts of 8 x 4 MiB bodies at nice 5, 89% at nice 10, 99% at
  nice 19, 2 shared cores at load 4-5). So that a busy machine slows a body down without refusing
  it, `limits.parse_timeout_s` counts the child's CPU time on that body (from /proc; wall time
  where there is no /proc), and only `_WALL_FACTOR` times as much wall time (a stopped or starved
  child) ends the wait regardless: a 400 for the CPU limit (the body's cost), a 503 for the
  wall limit (the server's state).
* The child is started with the server (`start()`, from the app's lifespan): its start-up imports
  the protocol models, and through them torch (~1.5 s of CPU), which must not be paid while
  streams decode and the first burst of large bodies waits. A child that dies or runs out of
  time is killed and at once replaced; that body gets its 400 / 503 (timeout) or 500 (crash), and
  the server goes on.
* The child exits when its stdin closes, so it never outlives the server.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import subprocess
import sys
import threading
from typing import BinaryIO, TypeVar

from pydantic import BaseModel, ValidationError

from kvshare.engine.child_pipe import _HEADER, _CpuTimeout, _exchange, _read_exact, _send, _widen, kill, spawn
from kvshare.server.errors import APIError, from_validation_error
from kvshare.server.limits import OFF_LOOP_BYTES, RequestLimits, parse_json
from kvshare.server.memory import release_free_memory

M = TypeVar("M", bound=BaseModel)
_CHILD_NICE = 19  # the child yields the CPU to the engine when both want it (module doc)
_WALL_FACTOR = 6  # wall time allowed per body, in multiples of its CPU-time limit


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
        self._closing = False

    async def parse(self, raw: bytes, model: type[M]) -> M:
        """`decode_body(raw, model, limits)`, off this process for large bodies."""
        if len(raw) <= OFF_LOOP_BYTES:
            return decode_body(raw, model, self.limits)
        async with self._order:
            return await asyncio.to_thread(self._call, raw, model)

    def start(self) -> None:
        """Start the child now (the server's start-up), unless one is running."""
        with self._io:
            self._running()

    def close(self) -> None:
        """Stop the child (if any); a later large body starts a new one."""
        self._closing = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()  # a worker waiting on it sees the pipe close and lets go of the lock
        with self._io:
            self._kill()
        self._closing = False

    # ---- the pipe (on a worker thread, one call at a time) -----------------------------------

    def _call(self, raw: bytes, model: type[M]) -> M:
        cpu_s = self.limits.parse_timeout_s
        with self._io:
            proc = self._running()
            try:
                reply = _exchange(proc, pickle.dumps((raw, model, self.limits), protocol=pickle.HIGHEST_PROTOCOL),
                                  cpu_s, _WALL_FACTOR * cpu_s)
            except _CpuTimeout:
                self._replace()
                raise APIError(400, f"the request body took over {cpu_s:g} s of CPU to decode",
                               code="invalid_json") from None
            except TimeoutError:
                self._replace()
                raise APIError(503, f"the body parser did not answer within {_WALL_FACTOR * cpu_s:g} s; try again",
                               code="parser_timeout", headers={"Retry-After": "1"}) from None
            except (OSError, EOFError) as e:
                self._replace()
                raise APIError(500, f"the body parser process failed: {e}", code="internal_error") from e
        if reply[0] == "ok":
            return reply[1]
        _, status, message, param, code = reply
        raise APIError(status, message, param=param, code=code)

    def _running(self) -> subprocess.Popen:
        """The live child, started anew if there is none or it has died."""
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        return self._spawn()

    def _replace(self) -> None:
        """Kill the child and start the next one now (not while the server is closing)."""
        self._kill()
        if not self._closing:
            self._spawn()

    def _spawn(self) -> subprocess.Popen:
        """A new child in place of the current one (killed, if any)."""
        self._kill()
        self._proc = spawn("kvshare.server.body_parser")
        for f in (self._proc.stdin, self._proc.stdout):
            _widen(f)
        return self._proc

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        kill(proc)


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
