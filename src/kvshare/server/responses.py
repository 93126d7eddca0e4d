"""OpenAI response bodies and stream chunks, built from kvshare's `RequestOutput`s."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from kvshare.server.protocol import Usage, now

Kind = Literal["completion", "chat"]


def usage_of(out: Any) -> Usage:
    """Prompt / completion token counts of a (final) `RequestOutput`."""
    return Usage.of(len(out.prompt_token_ids), len(out.token_ids), getattr(out, "num_cached_tokens", 0) or 0)


def finish_reason_of(out: Any) -> str | None:
    """OpenAI's finish_reason: "stop" or "length" (an abort reports "abort")."""
    return out.finish_reason if out.finished else None


@dataclass
class ResponseBuilder:
    """Builds the bodies of one response: its id, model and creation time are fixed up front.

    With `tokenizer` set, choices carry the chosen tokens' log-probabilities in OpenAI's shape
    (completions: tokens / token_logprobs / text_offset; chat: content entries); a stream sends
    each token's entry once, on the next chunk after the token arrives.
    """

    kind: Kind
    response_id: str
    model: str
    created: int = 0
    tokenizer: Any = None
    _lp_sent: int = 0
    _text_offset: int = 0

    def __post_init__(self) -> None:
        self.created = self.created or now()

    def _logprobs(self, ids: list[int], lps: list[float] | None) -> dict[str, Any] | None:
        """The logprobs object for tokens `ids` (None when not asked for)."""
        if self.tokenizer is None:
            return None
        lps = list(lps or [])[: len(ids)]
        pieces = [self.tokenizer.decode([t]) for t in ids[: len(lps)]]
        if self.kind == "chat":
            content = [{"token": p, "logprob": lp, "bytes": list(token_bytes(self.tokenizer, t, p)),
                        "top_logprobs": []} for t, p, lp in zip(ids, pieces, lps)]
            return {"content": content, "refusal": None}
        offsets = []
        for p in pieces:
            offsets.append(self._text_offset)
            self._text_offset += len(p)
        return {"tokens": pieces, "token_logprobs": lps, "top_logprobs": None, "text_offset": offsets}

    def _new_logprobs(self, out: Any) -> dict[str, Any] | None:
        """Logprobs of the tokens of `out` not yet sent on this stream."""
        if self.tokenizer is None or out is None:
            return None
        ids, lps = list(out.token_ids), list(out.logprobs or [])
        start, self._lp_sent = self._lp_sent, len(lps)
        return self._logprobs(ids[start:len(lps)], lps[start:])

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    # ---- whole responses ---------------------------------------------------------------------

    def full(self, out: Any) -> dict[str, Any]:
        """The non-streaming body for a finished request."""
        reason = finish_reason_of(out)
        logprobs = self._logprobs(list(out.token_ids), out.logprobs)
        if self.kind == "completion":
            choice = {"index": 0, "text": out.text, "logprobs": logprobs, "finish_reason": reason}
            body = self._envelope("text_completion", [choice])
        else:
            choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
                      "logprobs": logprobs, "finish_reason": reason}
            body = self._envelope("chat.completion", [choice])
        body["usage"] = usage_of(out).model_dump()
        return body

    # ---- stream chunks -----------------------------------------------------------------------

    def _chunk(self, delta_text: str | None, reason: str | None, first: bool = False,
               out: Any = None) -> dict[str, Any]:
        logprobs = self._new_logprobs(out)
        if self.kind == "completion":
            choice = {"index": 0, "text": delta_text or "", "logprobs": logprobs, "finish_reason": reason}
            return self._envelope("text_completion", [choice])
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if delta_text is not None:
            delta["content"] = delta_text
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return self._envelope("chat.completion.chunk", [choice])

    def role_chunk(self) -> str:
        """Chat streams open with the assistant role and empty content."""
        return sse(self._chunk("", None, first=True))

    def delta_chunk(self, text: str, out: Any = None) -> str:
        """New text (and the logprobs of `out`'s tokens not sent yet)."""
        return sse(self._chunk(text, None, out=out))

    def finish_chunk(self, reason: str | None, out: Any = None) -> str:
        """The chunk that carries finish_reason (no new text; any logprobs still unsent)."""
        return sse(self._chunk(None if self.kind == "chat" else "", reason, out=out))

    def usage_chunk(self, out: Any) -> str:
        """`stream_options.include_usage`: a last chunk with no choices and the usage counts."""
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        body = self._envelope(obj, [])
        body["usage"] = usage_of(out).model_dump()
        return sse(body)


def token_bytes(tokenizer: Any, token_id: int, piece: str) -> bytes:
    """The bytes a token stands for: the byte itself for byte-level ids, else its text in UTF-8."""
    from kvshare.tokenizer import ByteTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        return bytes([token_id]) if 0 <= token_id < 256 else b""
    return piece.encode("utf-8")


def sse(obj: dict[str, Any]) -> str:
    """One server-sent event carrying `obj` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"


class TextDeltas:
    """Turns the cumulative `RequestOutput.text` into new-text deltas.

    While the request runs, text that may still change is held back: a trailing U+FFFD (half of
    a multi-byte character) and a trailing piece that could be the start of a stop string (the
    engine cuts the text before a stop string once it completes). The final output releases
    the rest.
    """

    def __init__(self, stop: list[str] | None = None) -> None:
        self.sent = ""
        self.stop = [s for s in (stop or []) if s]

    def _held_back(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest

    def next(self, out: Any) -> str:
        """The text of `out` not sent yet."""
        text: str = out.text or ""
        if not out.finished:
            text = text.rstrip("\ufffd")
            hold = self._held_back(text)
            if hold:
                text = text[:-hold]
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""
        delta = text[len(self.sent):]
        self.sent = text
        return delta
