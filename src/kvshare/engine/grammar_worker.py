"""A child process that tries each new grammar first, so that a grammar which crashes llguidance
costs only its own request.

llguidance compiles recursively: a Lark grammar of 3,000 chained rules overflows an 8 MiB thread
stack and the process dies with SIGSEGV (no exception reaches Python). The engine therefore never
compiles a grammar the child has not compiled first, on a thread with the same stack
(`COMPILE_STACK_BYTES`) and the same `limits()`: a grammar that crashes or hangs the child is
refused with a 400, the child is replaced, and the server goes on.

What the child does per grammar (`check`): build the llguidance grammar text from the spec,
`validate_grammar`, build a matcher, compute its first mask, and consume one allowed token (the
lexer limits — "too many expressions constructed" — fire on the first step of a huge regex, not
at compile time). It answers ``("ok", grammar_text)`` or ``("err", one-line reason)``.

Invariants: one grammar in the child at a time (the caller's lock); a child that dies or exceeds
`cpu_limit_s` of CPU on one grammar is killed and the next call starts a new one; the child
exits when its stdin closes, so it never outlives the server.
"""

from __future__ import annotations

import os
import pickle
import re
import signal
import subprocess
import sys
import threading
from typing import Any

from kvshare.engine.json_schema import closed

COMPILE_STACK_BYTES = 64 * 2**20  # 20,000 chained Lark rules compile in this; 100,000 do not (SIGSEGV)
MAX_GRAMMAR_CHARS = 128 * 1024  # a grammar (or JSON schema, as JSON) longer than this is refused unread
_CHILD_NICE = 19  # as the body parser's: the child yields the CPU to the engine
_REASON_CHARS = 140


def limits() -> Any:
    """llguidance's resource limits for every compile here (defaults, without verbose errors: a
    verbose error dumps parser state and grammar text into the reply)."""
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False)


def one_line(message: str) -> str:
    """The first line of an llguidance error, at most _REASON_CHARS characters (never the grammar)."""
    text = message.replace("<non-verbose/>", "").strip()
    line = next((s.strip() for s in text.splitlines() if s.strip()), "unknown error")
    line = re.sub(r"\s+", " ", line)
    # a quoted piece of the grammar (closed, or cut off at the end) is not echoed back when long
    line = re.sub(r'"([^"]*)("|$)', lambda m: m.group(0) if len(m.group(1)) < 24 else '"..."', line)
    return line if len(line) <= _REASON_CHARS else line[: _REASON_CHARS - 3] + "..."


def grammar_text(llg: Any, kind: str, value: Any) -> str:
    """The llguidance grammar (its JSON text) of a StructuredSpec's kind and value; ValueError /
    TypeError / RuntimeError when the value is not valid."""
    m = llg.LLMatcher
    if kind == "json":
        return m.grammar_from_json_schema(closed(value), defaults={"whitespace_flexible": False})
    if kind == "json_object":
        return m.grammar_from_json_schema({"type": "object"}, defaults={"whitespace_flexible": False})
    if kind == "regex":
        return m.grammar_from_regex(value)
    if kind == "choice":
        return m.grammar_from_regex("|".join(f"(?:{re.escape(c)})" for c in value))
    if kind == "grammar":
        text = value
        if "::=" in text:  # GBNF (llama.cpp / vLLM's EBNF): convert to Lark
            from llguidance.gbnf_to_lark import gbnf_to_lark

            text = gbnf_to_lark(text)
        return m.grammar_from_lark(text)
    raise ValueError(f"unknown kind {kind!r}")


def on_big_stack(fn: Any, *args: Any) -> Any:
    """`fn(*args)` on a fresh thread with a COMPILE_STACK_BYTES stack; re-raises its exception."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # handed to the caller
            box["error"] = e

    with _STACK_LOCK:  # threading.stack_size is process-wide: set it only around this start
        old = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            t = threading.Thread(target=run, name="kvshare-grammar-compile", daemon=True)
            t.start()
        finally:
            threading.stack_size(old)
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


_STACK_LOCK = threading.Lock()


def check(lt: Any, kind: str, value: Any) -> tuple[str, str]:
    """("ok", grammar text) or ("err", reason) for one spec, as the child answers it."""
    import llguidance
    import llguidance.numpy as lgn

    try:
        g = grammar_text(llguidance, kind, value)
    except (ValueError, TypeError, RuntimeError) as e:
        return "err", one_line(str(e))
    err = llguidance.LLMatcher.validate_grammar(g, lt, limits=limits())
    if err:
        return "err", "the grammar is not valid: " + one_line(err)
    m = llguidance.LLMatcher(lt, g, log_level=0, limits=limits())
    bm = lgn.allocate_token_bitmask(1, lt.vocab_size)
    lgn.fill_next_token_bitmask(m, bm, 0)
    if m.is_error():
        return "err", "the grammar is not usable: " + one_line(m.get_error())
    words = [w & 0xFFFFFFFF for w in bm[0].tolist()]
    first = next(((i * 32 + b) for i, w in enumerate(words) if w for b in range(32) if (w >> b) & 1), None)
    if first is not None and first != lt.eos_token and not m.is_stopped():
        m.consume_token(first)  # one step: the lexer's limits fire here for a huge regex
        if m.is_error():
            return "err", "the grammar is too complex: " + one_line(m.get_error())
    return "ok", g


class Vocab:
    """What llguidance's TokenizerWrapper reads: token bytes, eos, bos, special ids, and encode."""

    def __init__(self, tokens: list[bytes], eos: int, bos: int | None, special: list[int], encode: Any) -> None:
        self.tokens, self.eos_token_id, self.bos_token_id, self.special_token_ids = tokens, eos, bos, special
        self._encode = encode

    def __call__(self, s: bytes | str) -> list[int]:
        return list(self._encode(s.decode("utf-8", "replace") if isinstance(s, bytes) else s))


class GrammarChild:
    """The parent's handle on the child (a lock orders the calls; one grammar at a time)."""

    def __init__(self, setup: tuple[list[bytes], int, int | None, list[int], Any]) -> None:
        self._setup = pickle.dumps(setup, protocol=pickle.HIGHEST_PROTOCOL)
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def check(self, kind: str, value: Any, cpu_limit_s: float) -> tuple[str, str]:
        """The child's answer for one spec; ("err", reason) when it crashed or ran out of time."""
        from kvshare.engine.child_pipe import _CpuTimeout, _exchange

        payload = pickle.dumps((kind, value), protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            proc = self._running()
            try:
                return _exchange(proc, payload, cpu_limit_s, 6 * cpu_limit_s)
            except _CpuTimeout:
                self._kill()
                return "err", f"the grammar took over {cpu_limit_s:g} s of CPU to compile"
            except TimeoutError:
                self._kill()
                return "err", f"the grammar compiler did not answer within {6 * cpu_limit_s:g} s"
            except (OSError, EOFError):
                self._kill()
                return "err", "the grammar is too complex: compiling it crashed the grammar compiler"

    def start(self) -> None:
        """Start the child now, unless it runs."""
        with self._lock:
            self._running()

    def close(self) -> None:
        with self._lock:
            self._kill()

    def _running(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        from kvshare.engine.child_pipe import _send, spawn

        self._proc = spawn("kvshare.engine.grammar_worker")
        _send(self._proc.stdin, self._setup)  # type: ignore[arg-type]
        return self._proc

    def _kill(self) -> None:
        from kvshare.engine.child_pipe import kill

        proc, self._proc = self._proc, None
        kill(proc)


def _serve() -> None:
    """The child: read the vocabulary, then answer one spec per message until stdin closes."""
    import llguidance

    from kvshare.engine.child_pipe import _HEADER, _read_exact, _send

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    head = stdin.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return
    table, eos, bos, special, tokenizer = pickle.loads(_read_exact(stdin, _HEADER.unpack(head)[0]))
    lt = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocab(table, eos, bos, special, tokenizer.encode)))
    while True:
        head = stdin.read(_HEADER.size)
        if len(head) < _HEADER.size:
            return
        kind, value = pickle.loads(_read_exact(stdin, _HEADER.unpack(head)[0]))
        try:
            reply = on_big_stack(check, lt, kind, value)
        except Exception as e:
            reply = ("err", f"the grammar could not be compiled: {type(e).__name__}")
        _send(stdout, pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's; stdin EOF ends the child
    try:
        os.nice(_CHILD_NICE)
    except OSError:
        pass
    _serve()
