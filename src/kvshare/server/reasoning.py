"""Thinking-mode reasoning: the text before ``</think>`` goes to ``reasoning_content``.

DeepSeek-V4 in thinking mode gets a generation prompt ending with ``<think>``, so its output
starts inside the reasoning and closes it with ``</think>``; everything after is the answer. A
leading ``<think>`` the model writes itself is dropped. Output that never closes the block is all
reasoning (the answer is empty).

`ReasoningSplitter` works incrementally on text deltas, holding back a trailing piece that could
be the start of ``</think>``, so a stream never shows part of the tag.
"""

from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"


def split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, content) of a whole thinking-mode output."""
    s = ReasoningSplitter()
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    return r1 + r2, c1 + c2


class ReasoningSplitter:
    """Splits a stream of text deltas into reasoning and content deltas."""

    def __init__(self) -> None:
        self._buf = ""
        self._in_reasoning = True
        self._started = False

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning delta, content delta) for the next text delta."""
        if not self._in_reasoning:
            return "", delta
        self._buf += delta
        if not self._started:
            if len(self._buf) < len(THINK_START) and THINK_START.startswith(self._buf):
                return "", ""  # may still be a leading <think>
            self._started = True
            if self._buf.startswith(THINK_START):
                self._buf = self._buf[len(THINK_START):]
        end = self._buf.find(THINK_END)
        if end >= 0:
            reasoning, content = self._buf[:end], self._buf[end + len(THINK_END):]
            self._buf, self._in_reasoning = "", False
            return reasoning, content
        hold = next((k for k in range(min(len(THINK_END) - 1, len(self._buf)), 0, -1)
                     if self._buf.endswith(THINK_END[:k])), 0)
        out, self._buf = self._buf[:len(self._buf) - hold], self._buf[len(self._buf) - hold:]
        return out, ""

    def finish(self) -> tuple[str, str]:
        """The held-back rest at the end of the output."""
        rest, self._buf = self._buf, ""
        return (rest, "") if self._in_reasoning else ("", rest)
