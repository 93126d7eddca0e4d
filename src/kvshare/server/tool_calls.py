"""DeepSeek-V4 tool calls (DSML) in the model's output -> OpenAI `tool_calls`, and the reverse for prompts.

The model writes (``DSML`` = ``｜DSML｜``, full-width bars)::

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

``string="true"``: the value is raw text; ``string="false"``: a JSON value. Each invoke becomes
``{"id", "type": "function", "function": {"name", "arguments": <JSON object text>}}``; text before
the block is the message content. A stream (`ToolCallStream`) sends content deltas until the
block opens, then one tool-call delta per invoke as soon as it closes (name and whole arguments,
with its index); a block left unfinished at the end is returned as content, unparsed.

The grammar that makes the model's block follow each tool's schema is `tool_grammar.py`'s.

Rendering into the prompt writes nothing raw that could open or close a DSML tag: a history call's
string value holding ``<`` is written as a JSON string (``string="false"``) with ``<`` escaped as
``\u003c``, as are ``<`` in JSON values and in the tools' definitions; names are checked by the
request validation (`tool_grammar.check_tools`, `protocol`).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

DSML = "｜DSML｜"
BLOCK_START = f"<{DSML}tool_calls>"
BLOCK_END = f"</{DSML}tool_calls>"
_INVOKE = re.compile(rf'<{DSML}invoke name="([^"]*)">(.*?)</{DSML}invoke>', re.S)
_PARAM = re.compile(rf'<{DSML}parameter name="([^"]*)" string="(true|false)">(.*?)</{DSML}parameter>', re.S)


class ToolCallError(ValueError):
    """A malformed invoke (bad JSON in a string="false" parameter)."""


def _call(name: str, body: str) -> dict[str, Any]:
    args: dict[str, Any] = {}
    for key, is_string, value in _PARAM.findall(body):
        if is_string == "true":
            args[key] = value
        else:
            try:
                args[key] = json.loads(value)
            except ValueError as e:
                raise ToolCallError(f"parameter {key!r} of {name!r} is not JSON: {e}") from None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """(content, tool calls) of a whole output; malformed blocks stay content."""
    start = text.find(BLOCK_START)
    if start < 0:
        return text, []
    end = text.find(BLOCK_END, start)
    block = text[start + len(BLOCK_START):end if end >= 0 else len(text)]
    if end < 0:
        return text, []
    try:
        calls = [_call(n, b) for n, b in _INVOKE.findall(block)]
    except ToolCallError:
        return text, []
    return text[:start].rstrip("\n"), calls


class ToolCallStream:
    """Incremental parsing of a streamed output: content deltas, then tool-call deltas."""

    def __init__(self) -> None:
        self._buf = ""
        self._in_block = False
        self._sent = 0  # invokes sent
        self.calls: list[dict[str, Any]] = []

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        """(content delta, new tool-call deltas with their `index`)."""
        self._buf += delta
        content = ""
        if not self._in_block:
            k = self._buf.find(BLOCK_START)
            if k < 0:  # hold back a possible start of the block marker, and newlines that may precede it
                hold = next((j for j in range(min(len(BLOCK_START) - 1, len(self._buf)), 0, -1)
                             if self._buf.endswith(BLOCK_START[:j])), 0)
                keep = len(self._buf) - hold
                keep = len(self._buf[:keep].rstrip("\n"))
                content, self._buf = self._buf[:keep], self._buf[keep:]
                return content, []
            content, self._buf, self._in_block = self._buf[:k].rstrip("\n"), self._buf[k + len(BLOCK_START):], True
        new = []
        for m in list(_INVOKE.finditer(self._buf))[self._sent:]:
            try:
                call = _call(m.group(1), m.group(2))
            except ToolCallError:
                continue
            self.calls.append(call)
            new.append({"index": self._sent, **call})
            self._sent += 1
        return content, new

    def finish(self) -> str:
        """Content still held back (an unfinished block is returned as text)."""
        rest, self._buf = self._buf, ""
        if self._in_block and not self.calls:
            return BLOCK_START + rest
        return "" if self._in_block else rest


def _raw(v: Any) -> bool:
    """Whether a value is written as raw text (a string that cannot touch a tag)."""
    return isinstance(v, str) and "<" not in v


def _json(v: Any) -> str:
    """JSON text of `v` with `<` escaped (still the same JSON value)."""
    return json.dumps(v, ensure_ascii=False).replace("<", "\\u003c")


def render_tool_calls(calls: list[dict[str, Any]]) -> str:
    """The DSML block of OpenAI `tool_calls` (an assistant turn in the conversation history)."""
    invokes = []
    for c in calls:
        fn = c.get("function", {})
        args = fn.get("arguments") or "{}"
        args = json.loads(args) if isinstance(args, str) else args
        params = [f'<{DSML}parameter name="{k}" string="{"true" if _raw(v) else "false"}">'
                  f'{v if _raw(v) else _json(v)}</{DSML}parameter>' for k, v in args.items()]
        invokes.append(f'<{DSML}invoke name="{fn.get("name", "")}">\n' + "".join(p + "\n" for p in params)
                       + f"</{DSML}invoke>")
    return BLOCK_START + "\n" + "\n".join(invokes) + "\n" + BLOCK_END


def render_tools(tools: list[dict[str, Any]]) -> str:
    """The tools section of the system prompt: each function's JSON definition and the call format."""
    lines = ["## Tools", "", "You can call these functions. To call them, write a block in this format:",
             BLOCK_START, f'<{DSML}invoke name="FUNCTION">',
             f'<{DSML}parameter name="ARG" string="true|false">VALUE</{DSML}parameter>',
             f"</{DSML}invoke>", BLOCK_END,
             'string="true" for a text value, string="false" for a JSON value.', "", "### Functions"]
    lines += [_json(t.get("function", t)) for t in tools]
    return "\n".join(lines)


class DsmlFormat:
    """How the built-in chat template writes tools and past tool calls (the tokenizer's `ToolFormat`:
    the tokenizer renders no tool syntax of its own)."""

    def section(self, tools: list[dict[str, Any]]) -> str:
        """The tools section that ends the system prompt."""
        return render_tools(tools)

    def calls(self, tool_calls: list[dict[str, Any]]) -> str:
        """The DSML block of an assistant turn's `tool_calls`."""
        return render_tool_calls(tool_calls)


DSML_FORMAT = DsmlFormat()
