"""OpenAI response bodies and stream chunks, built from kvshare's `RequestOutput`s.

One `ResponseBuilder` per HTTP request; it may hold several choices (``n`` > 1, a batch of
prompts: choice ``index = prompt_index * n + i``, as vLLM numbers them). Per choice it tracks what
a stream has sent (text, logprob entries, the echoed prompt).

Log-probabilities (`ReplyOptions.logprobs` = k, None for none) in OpenAI's shapes:

* completions: ``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``; each
  ``top_logprobs`` entry is a dict of the k most likely tokens plus the chosen one (so up to
  k + 1 entries, and ``{chosen: logprob}`` for k = 0), never null. With ``echo`` the prompt's
  tokens come first, the first of them with null logprob and null top entry.
* chat: ``content`` entries ``{token, logprob, bytes, top_logprobs}`` with exactly the top k.

A token's string is its text when it decodes to whole characters on its own; a lone byte of a
multi-byte character is ``bytes:\\xNN`` (OpenAI's form), so distinct tokens never share a key;
``return_tokens_as_token_ids`` gives ``token_id:N`` instead. ``text_offset`` is the number of
characters the tokens before it decode to completely.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from kvshare.server.protocol import now
from kvshare.server.replies import Usage
from kvshare.server.reasoning import ReasoningSplitter, split_reasoning
from kvshare.server.tool_calls import ToolCallStream, parse_tool_calls
from kvshare.server.stop_match import StopPrefixes, Tail

Kind = Literal["completion", "chat"]


@dataclass
class ReplyOptions:
    """What one request asked the reply to carry."""

    logprobs: int | None = None
    echo: bool = False
    prompt_logprobs: int | None = None  # vLLM's top-level `prompt_logprobs`
    return_token_ids: bool = False
    tokens_as_ids: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    tools: bool = False  # parse DSML tool calls from chat output (tool_calls.py)
    thinking: bool = False  # split reasoning_content off chat output (reasoning.py)
    single_tool_call: bool = False  # parallel_tool_calls: false keeps the first call only


@dataclass
class ChoiceSpec:
    """One choice: its index, and its prompt's ids and text (the text is echoed with `echo`)."""

    index: int
    prompt_ids: list[int]
    prompt_text: str
    leader: bool = True  # the first choice of its prompt (its prompt tokens count in usage)


def finish_reason_of(out: Any) -> str | None:
    """OpenAI's finish_reason: "stop" or "length" (an abort reports "abort")."""
    return out.finish_reason if out.finished else None


class TokenText:
    """Token strings, byte lists and text offsets for one tokenizer."""

    def __init__(self, tokenizer: Any, as_ids: bool = False) -> None:
        self.tok = tokenizer
        self.as_ids = as_ids

    def string(self, t: int) -> str:
        if self.as_ids:
            return f"token_id:{t}"
        from kvshare.tokenizer import ByteTokenizer

        if isinstance(self.tok, ByteTokenizer):
            if 0 <= t < 128:
                return chr(t)
            if 128 <= t < 256:
                return f"bytes:\\x{t:02x}"
            return self.tok.special_name(t)
        piece = self.tok.decode([t], skip_special_tokens=False)
        return f"token_id:{t}" if "\ufffd" in piece else piece

    def bytes_of(self, t: int) -> list[int]:
        from kvshare.tokenizer import ByteTokenizer

        if isinstance(self.tok, ByteTokenizer) and 0 <= t < 256:
            return [t]
        return list(self.tok.decode([t], skip_special_tokens=False).encode("utf-8"))

    def offsets(self, ids: list[int], start: int = 0, decoder: Any = None) -> tuple[list[int], Any, int]:
        """(text offsets of `ids`, the decoder to continue with, the offset after them)."""
        dec = decoder or self.tok.incremental_decoder()
        out, pos = [], start
        for t in ids:
            out.append(pos)
            pos += len(dec.step([t]))
        return out, dec, pos


@dataclass
class _ChoiceState:
    """What a stream has sent for one choice."""

    lp_sent: int = 0
    echoed: bool = False
    decoder: Any = None
    offset: int = 0
    text_sent: str = ""
    last: Any = None
    deltas: Any = None
    reasoning: Any = None  # ReasoningSplitter of a thinking-mode stream
    calls: Any = None  # ToolCallStream of a stream with tools


@dataclass
class ResponseBuilder:
    """Builds the bodies of one response: its id, model and creation time are fixed up front."""

    kind: Kind
    response_id: str
    model: str
    tokenizer: Any = None
    choices: list[ChoiceSpec] = field(default_factory=list)
    options: ReplyOptions = field(default_factory=ReplyOptions)
    stop: list[str] | StopPrefixes = field(default_factory=list)  # a StopPrefixes: built once, off the loop
    created: int = 0
    _state: dict[int, _ChoiceState] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.created = self.created or now()
        self.text = TokenText(self.tokenizer, self.options.tokens_as_ids)
        self._spec = {c.index: c for c in self.choices}
        prefixes = self.stop if isinstance(self.stop, StopPrefixes) else StopPrefixes([s for s in self.stop if s])
        for c in self.choices:
            self._state[c.index] = _ChoiceState(
                deltas=TextDeltas(prefixes),
                reasoning=ReasoningSplitter() if self.options.thinking else None,
                calls=ToolCallStream() if self.options.tools else None)

    # ---- logprob objects -------------------------------------------------------------------------

    def _completion_entries(self, ids: list[int], lps: list[float | None], tops: list[dict[int, float] | None],
                            st: _ChoiceState) -> dict[str, Any]:
        lps = [_own(t, lp, top) for t, lp, top in zip(ids, lps, tops)]
        offs, st.decoder, st.offset = self.text.offsets(ids, st.offset, st.decoder)
        top_out: list[dict[str, float] | None] = []
        for t, lp, top in zip(ids, lps, tops):
            if lp is None:
                top_out.append(None)
                continue
            d = {self.text.string(i): v for i, v in (top or {}).items()}
            d[self.text.string(t)] = lp
            top_out.append(d)
        return {"tokens": [self.text.string(t) for t in ids], "token_logprobs": lps, "top_logprobs": top_out,
                "text_offset": offs}

    def _chat_entries(self, ids: list[int], lps: list[float], tops: list[dict[int, float]]) -> list[dict[str, Any]]:
        def entry(t: int, lp: float) -> dict[str, Any]:
            return {"token": self.text.string(t), "logprob": lp, "bytes": self.text.bytes_of(t)}

        return [{**entry(t, _own(t, lp, top)), "top_logprobs": [entry(i, v) for i, v in (top or {}).items()]}
                for t, lp, top in zip(ids, lps, tops)]

    def _logprobs(self, index: int, out: Any, echo_prompt: bool) -> dict[str, Any] | None:
        """The logprobs of `out`'s tokens not sent yet (with the echoed prompt's first)."""
        if self.options.logprobs is None:
            return None
        st = self._state[index]
        ids = list(out.token_ids)
        lps = list(out.logprobs or [])
        tops = list(out.top_logprobs or [{}] * len(lps))
        start, st.lp_sent = st.lp_sent, len(lps)
        ids, lps, tops = ids[start:len(lps)], lps[start:], tops[start:]
        if self.kind == "chat":
            return {"content": self._chat_entries(ids, lps, tops), "refusal": None}
        if echo_prompt:
            p_ids = list(out.prompt_token_ids)
            p_lps = list(out.prompt_logprobs or [None] * len(p_ids))
            p_tops = list(out.prompt_top_logprobs or [None] * len(p_ids))
            ids, lps, tops = p_ids + ids, p_lps + lps, p_tops + tops
        return self._completion_entries(ids, lps, tops, st)

    def _message(self, text: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The chat message of a whole output: reasoning split off, tool calls parsed."""
        reasoning = None
        if self.options.thinking:
            reasoning, text = split_reasoning(text)
        calls: list[dict[str, Any]] = []
        if self.options.tools:
            text, calls = parse_tool_calls(text)
            calls = calls[:1] if self.options.single_tool_call else calls
        message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
        if self.options.thinking:
            message["reasoning_content"] = reasoning
        if self.options.tools:
            message["tool_calls"] = calls
        return message, calls

    def _chat_delta(self, st: _ChoiceState, text: str, final: bool) -> dict[str, Any]:
        """The delta of a chat stream chunk: reasoning, content and tool-call parts of new text."""
        delta: dict[str, Any] = {}
        reasoning, content = text, ""
        if st.reasoning is not None:
            reasoning, content = st.reasoning.feed(text)
            if final:
                r2, c2 = st.reasoning.finish()
                reasoning, content = reasoning + r2, content + c2
            if reasoning:
                delta["reasoning_content"] = reasoning
        else:
            reasoning, content = "", text
        if st.calls is not None:
            content, new = st.calls.feed(content)
            if final:
                content += st.calls.finish()
            if self.options.single_tool_call:
                new = [c for c in new if c["index"] == 0]
            if new:
                delta["tool_calls"] = new
        if content:
            delta["content"] = content
        return delta

    def _prompt_logprobs(self, out: Any) -> list[dict[str, Any] | None] | None:
        """vLLM's `prompt_logprobs`: per prompt token None (the first) or {id: {logprob, rank, decoded_token}}."""
        if self.options.prompt_logprobs is None or out.prompt_logprobs is None:
            return None
        res: list[dict[str, Any] | None] = []
        for t, lp, top in zip(out.prompt_token_ids, out.prompt_logprobs, out.prompt_top_logprobs or []):
            if lp is None:
                res.append(None)
                continue
            ranked = {i: r + 1 for r, i in enumerate(top or {})}
            d = {str(i): {"logprob": v, "rank": ranked[i], "decoded_token": self.text.string(i)}
                 for i, v in (top or {}).items()}
            d.setdefault(str(t), {"logprob": lp, "rank": ranked.get(t), "decoded_token": self.text.string(t)})
            res.append(d)
        return res

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def usage(self, outs: dict[int, Any]) -> Usage:
        """Prompt tokens once per prompt, completion tokens of every choice, cached tokens of the leaders."""
        leaders = [outs[c.index] for c in self.choices if c.leader and c.index in outs]
        prompt = sum(len(c.prompt_ids) for c in self.choices if c.leader)
        completion = sum(len(o.token_ids) for o in outs.values())
        cached = sum(getattr(o, "num_cached_tokens", 0) or 0 for o in leaders)
        return Usage.of(prompt, completion, cached)

    # ---- whole responses ---------------------------------------------------------------------

    def full(self, outs: dict[int, Any]) -> dict[str, Any]:
        """The non-streaming body once every choice finished (`outs`: choice index -> final output)."""
        choices = []
        opts = self.options
        for c in self.choices:
            out = outs[c.index]
            reason = finish_reason_of(out)
            logprobs = self._logprobs(c.index, out, echo_prompt=opts.echo)
            if self.kind == "completion":
                text = (c.prompt_text if opts.echo else "") + out.text
                choice: dict[str, Any] = {"index": c.index, "text": text, "logprobs": logprobs,
                                          "finish_reason": reason, "stop_reason": out.stop_reason}
                if opts.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._prompt_logprobs(out)
                if opts.return_token_ids:
                    choice["prompt_token_ids"] = list(out.prompt_token_ids)
                    choice["token_ids"] = list(out.token_ids)
            else:
                message, calls = self._message(out.text)
                if calls and reason == "stop":
                    reason = "tool_calls"
                choice = {"index": c.index, "message": message,
                          "logprobs": logprobs, "finish_reason": reason, "stop_reason": out.stop_reason}
                if opts.return_token_ids:
                    choice["token_ids"] = list(out.token_ids)
            choices.append(choice)
        body = self._envelope("text_completion" if self.kind == "completion" else "chat.completion", choices)
        if self.kind == "chat":
            first = outs[self.choices[0].index]
            if opts.prompt_logprobs is not None:
                body["prompt_logprobs"] = self._prompt_logprobs(first)
            if opts.return_token_ids:
                body["prompt_token_ids"] = list(first.prompt_token_ids)
        body["usage"] = self.usage(outs).model_dump()
        return body

    # ---- stream chunks -----------------------------------------------------------------------

    def _obj(self) -> str:
        return "text_completion" if self.kind == "completion" else "chat.completion.chunk"

    def role_chunks(self) -> list[str]:
        """Chat streams open with the assistant role and empty content, per choice (with continuous
        usage: the prompt tokens, 0 completion tokens, as vLLM's first chunk)."""
        chunks = []
        for c in self.choices:
            choice = {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}
            body = self._envelope(self._obj(), [choice])
            if self.options.continuous_usage:
                body["usage"] = self.usage({}).model_dump()
            chunks.append(sse(body))
        return chunks

    def stream_update(self, index: int, out: Any, outs: dict[int, Any]) -> list[str]:
        """The chunks for a new output of choice `index` (text delta and/or the finish); `outs` holds
        the latest output of every choice (for continuous usage)."""
        st = self._state[index]
        spec = self._spec[index]
        opts = self.options
        chunks: list[dict[str, Any]] = []
        echo_now = opts.echo and self.kind == "completion" and not st.echoed
        text = st.deltas.next(out)
        have_new_lps = opts.logprobs is not None and len(out.logprobs or []) > st.lp_sent
        if text or echo_now or have_new_lps or out.finished:
            logprobs = self._logprobs(index, out, echo_prompt=echo_now)
            reason = finish_reason_of(out)
            if self.kind == "completion":
                prefix = spec.prompt_text if echo_now else ""
                choice: dict[str, Any] = {"index": index, "text": prefix + text, "logprobs": logprobs,
                                          "finish_reason": reason, "stop_reason": out.stop_reason if reason else None}
                if opts.return_token_ids:
                    if echo_now or not st.echoed:
                        choice["prompt_token_ids"] = list(out.prompt_token_ids)
                    choice["token_ids"] = list(out.token_ids[st.last or 0:])
                if echo_now and opts.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._prompt_logprobs(out)
            else:
                if opts.thinking or opts.tools:
                    delta = self._chat_delta(st, text, final=bool(reason))
                    if reason == "stop" and st.calls is not None and st.calls.calls:
                        reason = "tool_calls"
                else:
                    delta = {"content": text} if text or not reason else {}
                choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason,
                          "stop_reason": out.stop_reason if reason else None}
                if opts.return_token_ids:
                    choice["token_ids"] = list(out.token_ids[st.last or 0:])
            st.echoed = True
            st.last = len(out.token_ids)
            body = self._envelope(self._obj(), [choice])
            if opts.continuous_usage:
                body["usage"] = self.usage(outs).model_dump()
            chunks.append(body)
        return [sse(c) for c in chunks]

    def usage_chunk(self, outs: dict[int, Any]) -> str:
        """`stream_options.include_usage`: a last chunk with no choices and the usage counts."""
        body = self._envelope(self._obj(), [])
        body["usage"] = self.usage(outs).model_dump()
        return sse(body)


def _own(t: int, lp: float | None, top: dict[int, float] | None) -> float | None:
    """A chosen token's logprob as its own top entry shows it, when it has one (the two are computed
    apart and may differ by an ulp; a client comparing them must see one number)."""
    return top[t] if top and t in top else lp


def sse(obj: dict[str, Any]) -> str:
    """One server-sent event carrying `obj` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"


class TextDeltas:
    """Turns the cumulative `RequestOutput.text` into new-text deltas.

    While the request runs, text that may still change is held back: a trailing U+FFFD (half of
    a multi-byte character) and a trailing piece that could be the start of a stop string (the
    engine cuts the text before a stop string once it completes; `stop_match` finds that piece
    in amortised O(1) per new character). The final output releases the rest.
    """

    def __init__(self, stop: list[str] | StopPrefixes | None = None) -> None:
        self.sent = ""
        prefixes = stop if isinstance(stop, StopPrefixes) else StopPrefixes([s for s in (stop or []) if s])
        self._tail = Tail(prefixes) if len(prefixes.depth) > 1 else None

    def next(self, out: Any) -> str:
        """The text of `out` not sent yet."""
        text: str = out.text or ""
        if not out.finished:
            text = text.rstrip("\ufffd")
            hold = self._tail.held(text) if self._tail is not None else 0
            if hold:
                text = text[:-hold]
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""
        delta = text[len(self.sent):]
        self.sent = text
        return delta
