"""Structured output: a grammar (JSON schema, any JSON object, regex, choice, Lark / GBNF) the output must follow.

Backend: llguidance (``pip install kvshare[structured]``), picked over xgrammar by measurement on
the shipped byte vocabulary (259 ids): on one 64-token JSON document (best of 20, this machine)
xgrammar computes mask + accept in 1.2 us per token, llguidance in 23.3 us (compile 2.5 ms vs
1.0 ms), but xgrammar's JSON strings admit raw control characters (its string rule excludes only
``"``, ``\\``, CR and LF), so greedy generations from a random-weight model parsed with
``json.loads`` for 9 of 100 schema requests; llguidance's for 100 of 100. Correctness decides;
23 us per constrained row per step is small next to a model step, and llguidance needs no
other package (xgrammar pulls triton and apache-tvm-ffi).

Compiling (issue 36): a grammar is first tried in a child process (`grammar_worker`: a grammar
that crashes llguidance — 3,000 chained Lark rules overflow an 8 MiB stack — costs only its
request), then compiled here on a thread with a 64 MiB stack, with llguidance's limits, at most
MAX_GRAMMAR_CHARS long; the result (errors too) is cached by grammar. The server compiles before
admission on this object's compile thread (`submit`) and hands the `Compiled` to every choice in
``spec.compiled``; `add` then only copies its start-state matcher, so the engine thread never
waits for a compile. A bad grammar is a one-line RequestError naming the request field.

Per request (a `StructuredSpec` in ``SamplingParams.structured``), each step:

* ``masks(request_ids)``: per sampled row the bool [V] of allowed ids (None for other rows); the
  sampler's processors set every other logit to -inf (`logits_processors.py`), greedy and random
  rows alike;
* ``accept(request_id, token)`` after each appended token; returns True when the output is
  complete: the matcher stopped, or no id but a stop id may follow (a vocabulary without an eos
  id ends there: llguidance gets a stand-in eos id past the vocabulary, never sampled);
* under speculative verification ``draft_masks``: the mask of row j follows drafts ``d_1..d_j``
  (consumed, then rolled back; a draft the grammar refuses leaves the later rows unmasked, which
  is harmless because acceptance stops at it).

JSON is compact (no free whitespace), so a document takes few tokens.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from kvshare.engine.grammar_worker import MAX_GRAMMAR_CHARS, GrammarChild, Vocab, limits, on_big_stack, one_line
from kvshare.engine.structured_spec import StructuredSpec
from kvshare.errors import RequestError

_CACHE_SIZE = 16  # a compiled grammar can hold ~100 MB of lexer states ((a{1000}){10}: 139 MB)


def _key(spec: StructuredSpec) -> tuple[str, str]:
    """The cache key of a spec: its kind and its value as canonical JSON text."""
    value = spec.value if isinstance(spec.value, str) else json.dumps(spec.value, sort_keys=True)
    return spec.kind, value


def _bad(spec: StructuredSpec, reason: str) -> RequestError:
    return RequestError(f"invalid sampling params: {spec.field}: {reason}")


def token_table(tokenizer: Any, vocab_size: int) -> tuple[list[bytes], list[int]]:
    """(bytes of every id, special ids) for `tokenizer` over `vocab_size` logits."""
    from kvshare.tokenizer import ByteTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        return [bytes([i]) if i < 256 else b"" for i in range(vocab_size)], list(range(256, vocab_size))
    raw = getattr(tokenizer, "_tok", None)
    if raw is None:
        raise RequestError("structured output needs the model's tokenizer")
    table, special = [], []
    for i in range(vocab_size):
        piece = raw.decode([i], skip_special_tokens=False) if raw.id_to_token(i) is not None else ""
        if not piece or raw.decode([i], skip_special_tokens=True) == "":
            special.append(i)
            table.append(b"")
        else:
            table.append(piece.encode("utf-8"))
    return table, special


@dataclass
class Compiled:
    """One compiled grammar: a matcher in its start state (never advanced: each request gets a
    `deep_copy`) and its first mask (bool [V]); shared by every request with the same grammar."""

    grammar: str
    matcher: Any
    mask: torch.Tensor
    accepting: bool  # the empty output is complete (only a stop id may come first)

    def first_ids_fit(self, allowed: Any) -> bool:
        """Whether some id of `allowed` may start the output (or the grammar accepts no output)."""
        return self.accepting or any(0 <= i < len(self.mask) and bool(self.mask[i]) for i in allowed)


class StructuredOutputs:
    """The engine's grammar matchers, by request id, and the compiled grammars they start from.

    Compiling (`compile`, `submit`) is thread-safe and runs off the engine thread when the server
    calls `submit` before admission (the spec then carries its `Compiled`, and `add` only copies
    the matcher). Every grammar goes through the child process first (`grammar_worker`), then is
    compiled here on a COMPILE_STACK_BYTES thread with the same limits; results — errors too — are
    cached by grammar (`_CACHE_SIZE` entries, least recently used dropped).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: frozenset[int]) -> None:
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        self._lt: Any = None
        self._setup: tuple | None = None
        self._child: GrammarChild | None = None
        self._matchers: dict[str, Any] = {}
        self._masks: dict[str, torch.Tensor] = {}  # next-step mask of each request (computed after accept)
        self._bits = torch.arange(32, dtype=torch.int32)
        self._lock = threading.Lock()  # the tokenizer, the child handle and the cache
        self._cache: OrderedDict[tuple[str, str], Compiled | str] = OrderedDict()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.compile_cpu_s = 10.0

    # ---- compile ---------------------------------------------------------------------------------
    def _llg(self) -> Any:
        try:
            import llguidance
            import llguidance.torch  # noqa: F401
        except ImportError as e:
            raise RequestError("structured output needs llguidance: pip install 'kvshare[structured]'") from e
        with self._lock:
            if self._lt is None:
                if self.tokenizer is None:
                    raise RequestError("structured output needs the model's tokenizer")
                table, special = token_table(self.tokenizer, self.vocab_size)
                eos = self.eos_ids[0] if self.eos_ids else len(table)
                if not self.eos_ids:  # a stand-in eos past the vocabulary (masked off: never sampled)
                    table, special = table + [b""], special + [eos]
                bos = getattr(self.tokenizer, "bos_token_id", None)
                vocab = Vocab(table, eos, bos, special, self.tokenizer.encode)
                self._setup = (table, eos, bos, special, self.tokenizer)
                self._lt = llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocab))
        return llguidance

    def start(self) -> None:
        """Build the token table and start the compile child now (the server's start-up, on a worker
        thread), so the first grammar does not pay for them; a no-op without llguidance."""
        try:
            self._llg()
        except RequestError:
            return
        with self._lock:
            if self._child is None:
                assert self._setup is not None
                self._child = GrammarChild(self._setup)
            child = self._child
        child.start()

    def submit(self, spec: StructuredSpec) -> concurrent.futures.Future:
        """`compile(spec)` on this object's compile thread; the future holds the Compiled (or the
        RequestError)."""
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvshare-grammar")
        return self._pool.submit(self.compile, spec)

    def compile(self, spec: StructuredSpec) -> Compiled:
        """The compiled grammar of `spec` (from the cache when seen before); RequestError naming its
        field, in one line, when it is too large, not valid, or too complex for llguidance."""
        if isinstance(spec.compiled, Compiled):
            return spec.compiled
        key = _key(spec)
        if len(key[1]) > MAX_GRAMMAR_CHARS:
            raise _bad(spec, f"the grammar has {len(key[1])} characters (at most {MAX_GRAMMAR_CHARS})")
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if hit is None:
            hit = self._compile(spec)
            with self._lock:
                self._cache[key] = hit
                while len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
        if isinstance(hit, str):
            raise _bad(spec, hit)
        return hit

    def _compile(self, spec: StructuredSpec) -> Compiled | str:
        """A new Compiled, or the one-line reason the grammar is refused."""
        llg = self._llg()
        with self._lock:
            if self._child is None:
                assert self._setup is not None
                self._child = GrammarChild(self._setup)
            child = self._child
        status, text = child.check(spec.kind, spec.value, self.compile_cpu_s)
        if status != "ok":
            return "the grammar admits no text" if "NoExtensionBias" in text else text

        def build() -> Compiled | str:
            m = llg.LLMatcher(self._lt, text, log_level=0, limits=limits())
            if m.is_error():
                return "the grammar is not valid: " + one_line(m.get_error())
            mask = self._mask(m)
            if m.is_error():
                return "the grammar is not usable: " + one_line(m.get_error())
            allowed = mask.clone()
            allowed[self.eos_ids] = False
            accepting = bool(m.is_accepting())
            if not accepting and not bool(allowed.any()):
                return "no token of this model's vocabulary can start text the grammar accepts"
            return Compiled(text, m, mask, accepting)

        return on_big_stack(build)

    def close(self) -> None:
        """Stop the compile child and thread (a later grammar starts them again)."""
        with self._lock:
            child, self._child = self._child, None
            pool, self._pool = self._pool, None
        if child is not None:
            child.close()
        if pool is not None:
            pool.shutdown(wait=False)

    def grammar(self, spec: StructuredSpec) -> str:
        """The llguidance grammar of `spec`; RequestError naming its field when it is not valid."""
        return self.compile(spec).grammar

    # ---- per request -----------------------------------------------------------------------------
    def add(self, request_id: str, spec: StructuredSpec) -> None:
        """Start the matcher of a new request from the compiled grammar (compiled now if it was not)."""
        compiled = self.compile(spec)
        self._matchers[request_id] = compiled.matcher.deep_copy()
        self._masks[request_id] = compiled.mask

    def forget(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._masks.pop(request_id, None)

    def _mask(self, m: Any) -> torch.Tensor:
        """The bool [V] of ids `m` allows next (the stand-in eos, if any, cut off)."""
        import llguidance.torch as lgt

        bm = lgt.allocate_token_bitmask(1, self._lt.vocab_size)
        lgt.fill_next_token_bitmask(m, bm, 0)
        bits = (bm[0, :, None] >> self._bits) & 1
        return bits.flatten()[: self.vocab_size].bool()

    def masks(self, request_ids: list[str]) -> list[torch.Tensor | None]:
        """Per row the mask of its request, None for unconstrained rows."""
        return [self._masks.get(r) for r in request_ids]

    def accept(self, request_id: str, token: int) -> bool:
        """Consume `token`; True when the output is complete (see the module doc)."""
        m = self._matchers.get(request_id)
        if m is None:
            return False
        if not m.consume_token(token):
            raise RuntimeError(f"structured output: token {token} is not allowed by the grammar "
                               f"({one_line(m.get_error())})")
        if m.is_stopped():
            return True
        mask = self._mask(m)
        if m.is_error():  # a lexer limit reached mid-output: this request fails, with one line
            raise RuntimeError(f"structured output: the grammar is too complex ({one_line(m.get_error())})")
        self._masks[request_id] = mask
        allowed = mask.clone()
        allowed[self.eos_ids] = False
        return not bool(allowed.any())

    def draft_masks(self, request_ids: list[str], drafts: list[list[int]],
                    rows: int) -> list[list[torch.Tensor | None]] | None:
        """Per request the masks of its verification rows 0..rows-1 (row j after drafts[:j]); None when
        no request is constrained."""
        if not any(r in self._matchers for r in request_ids):
            return None
        out: list[list[torch.Tensor | None]] = []
        for rid, d in zip(request_ids, drafts):
            m = self._matchers.get(rid)
            if m is None:
                out.append([None] * rows)
                continue
            row_masks: list[torch.Tensor | None] = [self._masks[rid]]
            taken = 0
            for t in d[: rows - 1]:
                allowed = row_masks[-1]
                if m.is_stopped() or allowed is None or not bool(allowed[t]):  # refused: never consumed
                    break
                if not m.consume_token(t):
                    raise RuntimeError(f"structured output: draft {t} passed the mask but not the matcher")
                taken += 1
                row_masks.append(self._mask(m))
            if taken:
                m.rollback(taken)
            out.append(row_masks + [None] * (rows - len(row_masks)))
        return out
