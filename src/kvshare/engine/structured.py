"""Structured output: a grammar (JSON schema, any JSON object, regex, choice, Lark / GBNF) the output must follow.

Backend: llguidance (``pip install kvshare[structured]``), picked over xgrammar by measurement on
the shipped byte vocabulary (259 ids): on one 64-token JSON document (best of 20, this machine)
xgrammar computes mask + accept in 1.2 us per token, llguidance in 23.3 us (compile 2.5 ms vs
1.0 ms), but xgrammar's JSON strings admit raw control characters (its string rule excludes only
``"``, ``\\``, CR and LF), so greedy generations from a random-weight model parsed with
``json.loads`` for 9 of 100 schema requests; llguidance's for 100 of 100. Correctness decides;
23 us per constrained row per step is small next to a model step, and llguidance needs no
other package (xgrammar pulls triton and apache-tvm-ffi).

Per request (a `StructuredSpec` in ``SamplingParams.structured``): an `LLMatcher` built at
admission (a bad grammar is a RequestError naming the request field). Each step:

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

import re
from typing import Any

import torch

from kvshare.engine.json_schema import closed
from kvshare.engine.structured_spec import StructuredSpec
from kvshare.errors import RequestError



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


class _Vocab:
    """What llguidance's TokenizerWrapper reads: token bytes, eos, bos, special ids, and encode."""

    def __init__(self, tokens: list[bytes], eos: int, bos: int | None, special: list[int], encode: Any) -> None:
        self.tokens, self.eos_token_id, self.bos_token_id, self.special_token_ids = tokens, eos, bos, special
        self._encode = encode

    def __call__(self, s: bytes | str) -> list[int]:
        return list(self._encode(s.decode("utf-8", "replace") if isinstance(s, bytes) else s))


class StructuredOutputs:
    """The engine's grammar matchers, by request id."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: frozenset[int]) -> None:
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        self._lt: Any = None
        self._matchers: dict[str, Any] = {}
        self._masks: dict[str, torch.Tensor] = {}  # next-step mask of each request (computed after accept)
        self._bits = torch.arange(32, dtype=torch.int32)

    # ---- compile ---------------------------------------------------------------------------------
    def _llg(self) -> Any:
        try:
            import llguidance
            import llguidance.torch  # noqa: F401
        except ImportError as e:
            raise RequestError("structured output needs llguidance: pip install 'kvshare[structured]'") from e
        if self._lt is None:
            if self.tokenizer is None:
                raise RequestError("structured output needs the model's tokenizer")
            table, special = token_table(self.tokenizer, self.vocab_size)
            eos = self.eos_ids[0] if self.eos_ids else len(table)
            if not self.eos_ids:  # a stand-in eos past the vocabulary (masked off: never sampled)
                table, special = table + [b""], special + [eos]
            vocab = _Vocab(table, eos, getattr(self.tokenizer, "bos_token_id", None), special,
                           self.tokenizer.encode)
            self._lt = llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocab))
        return llguidance

    def grammar(self, spec: StructuredSpec) -> str:
        """The llguidance grammar of `spec`; RequestError naming its field when it is not valid."""
        llg = self._llg()
        m = llg.LLMatcher
        try:
            if spec.kind == "json":
                g = m.grammar_from_json_schema(closed(spec.value), defaults={"whitespace_flexible": False})
            elif spec.kind == "json_object":
                g = m.grammar_from_json_schema({"type": "object"}, defaults={"whitespace_flexible": False})
            elif spec.kind == "regex":
                g = m.grammar_from_regex(spec.value)
            elif spec.kind == "choice":
                g = m.grammar_from_regex("|".join(f"(?:{re.escape(c)})" for c in spec.value))
            elif spec.kind == "grammar":
                text = spec.value
                if "::=" in text:  # GBNF (llama.cpp / vLLM's EBNF): convert to Lark
                    from llguidance.gbnf_to_lark import gbnf_to_lark

                    text = gbnf_to_lark(text)
                g = m.grammar_from_lark(text)
            else:
                raise RequestError(f"invalid sampling params: {spec.field}: unknown kind {spec.kind!r}")
        except (ValueError, TypeError, RuntimeError) as e:
            raise RequestError(f"invalid sampling params: {spec.field}: {e}") from None
        err = m.validate_grammar(g, self._lt)
        if err:
            raise RequestError(f"invalid sampling params: {spec.field}: the grammar is not valid: {err.strip()}")
        return g

    # ---- per request -----------------------------------------------------------------------------
    def add(self, request_id: str, spec: StructuredSpec) -> None:
        """Build the matcher of a new request."""
        llg = self._llg()
        m = llg.LLMatcher(self._lt, self.grammar(spec))
        if m.is_error():
            raise RequestError(f"invalid sampling params: {spec.field}: {m.get_error()}")
        self._matchers[request_id] = m
        self._masks[request_id] = self._mask(m)

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
            raise RuntimeError(f"structured output: token {token} is not allowed by the grammar: {m.get_error()}")
        if m.is_stopped():
            return True
        mask = self._mask(m)
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
