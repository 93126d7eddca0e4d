"""Tokenizers: a model directory's `tokenizer.json`, or the built-in byte-level tokenizer.

`load_tokenizer(model_dir_or_name)` returns an object with one interface, whichever kind it is:

* ``encode(text, add_bos=False) -> list[int]`` and ``decode(ids, skip_special_tokens=True) -> str``
* ``apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`` -> ids or text
* ``bos_token_id``, ``eos_token_id`` (either may be None), ``eos_token_ids``, ``vocab_size``
* ``incremental_decoder()`` -> an object whose ``step(new_ids) -> str`` returns only text made of
  complete characters (a multi-byte UTF-8 character split across steps is held back until its
  last byte arrives) and whose ``flush() -> str`` returns whatever is left at the end.

The byte tokenizer maps bytes 0-255 to ids 0-255; a model with a larger vocabulary gets
bos 256, eos 257, pad 258 (or the ids its config names).
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Any, Protocol, Sequence

from kvshare.errors import CheckpointError

Message = dict[str, str]

BYTE_BOS, BYTE_EOS, BYTE_PAD = 256, 257, 258
# names of the byte tokenizer's special ids (DeepSeek's spelling), as in the shipped tokenizer.json
BYTE_SPECIAL_NAMES = {"bos": "<｜begin▁of▁sentence｜>", "eos": "<｜end▁of▁sentence｜>", "pad": "<｜▁pad▁｜>"}

# Built-in chat template of the byte tokenizer: per message a `<|role|>` header line, the content, a newline.
_BYTE_ROLE_HEADER = "<|{role}|>\n"
_BYTE_TURN_END = "\n"


class IncrementalDecoder(Protocol):
    """Turns a stream of token ids into a stream of complete characters."""

    def step(self, new_ids: Sequence[int]) -> str:
        """Feed the next ids; return the newly completed text (possibly empty)."""
        ...

    def flush(self) -> str:
        """Return the text still held back (an incomplete character becomes U+FFFD)."""
        ...


class ToolFormat(Protocol):
    """How a template without tool syntax of its own writes tools (the server's DSML format,
    `server/tool_calls.DSML_FORMAT`): the tokenizer renders no tool syntax itself."""

    def section(self, tools: list[dict]) -> str:
        """The tools section appended to the first system message."""
        ...

    def calls(self, tool_calls: list[dict]) -> str:
        """An assistant turn's `tool_calls`, written after its content."""
        ...


class Tokenizer(Protocol):
    """What every tokenizer kvshare loads offers."""

    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None

    @property
    def eos_token_ids(self) -> list[int]: ...

    def encode(self, text: str, add_bos: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(
        self, messages: list[Message], add_generation_prompt: bool = True, tokenize: bool = True
    ) -> list[int] | str: ...

    def incremental_decoder(self) -> IncrementalDecoder: ...


# ---- byte-level tokenizer ------------------------------------------------------------------------


class _ByteIncrementalDecoder:
    """UTF-8 incremental decoding of byte ids; special ids (>= 256) are skipped."""

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, new_ids: Sequence[int]) -> str:
        """Decode the new bytes, keeping an unfinished multi-byte character for the next call."""
        return self._dec.decode(bytes(i for i in new_ids if 0 <= i < 256))

    def flush(self) -> str:
        """End of stream: an unfinished character becomes U+FFFD."""
        return self._dec.decode(b"", final=True)


class ByteTokenizer:
    """Bytes 0-255 are ids 0-255; bos/eos/pad follow when the vocabulary has room for them."""

    def __init__(
        self,
        vocab_size: int = 259,
        bos_token_id: int | None = BYTE_BOS,
        eos_token_id: int | None = BYTE_EOS,
        pad_token_id: int | None = BYTE_PAD,
    ) -> None:
        if vocab_size < 256:
            raise ValueError(f"a byte tokenizer needs vocab_size >= 256, got {vocab_size}")

        def fits(i: int | None) -> int | None:
            # a special id must not collide with a byte and must exist in the vocabulary
            return i if i is not None and 256 <= i < vocab_size else None

        self.vocab_size = vocab_size
        self.bos_token_id = fits(bos_token_id)
        self.eos_token_id = fits(eos_token_id)
        self.pad_token_id = fits(pad_token_id)

    @property
    def eos_token_ids(self) -> list[int]:
        """All ids that end generation."""
        return [self.eos_token_id] if self.eos_token_id is not None else []

    def special_name(self, token_id: int) -> str:
        """The name of a special id (`tokenizer.json` uses the same): bos, eos, pad, else `<|special_N|>`."""
        names = {self.bos_token_id: BYTE_SPECIAL_NAMES["bos"], self.eos_token_id: BYTE_SPECIAL_NAMES["eos"],
                 self.pad_token_id: BYTE_SPECIAL_NAMES["pad"]}
        return names.get(token_id) or f"<|special_{token_id}|>"

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """UTF-8 bytes of `text`, after bos when asked for and the vocabulary has one."""
        ids = list(text.encode("utf-8"))
        if add_bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of the byte ids; invalid UTF-8 becomes U+FFFD, special ids are dropped."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def render_chat(self, messages: list[Message], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, thinking: bool = False,
                    tool_format: ToolFormat | None = None) -> str:
        """The built-in template: `<|role|>` line, the content, a newline, per message (a message's
        `name` has no place in it and is not shown).

        With `tools`, their section (`tool_format.section`) ends the first system message (one is
        added in front when there is none); an assistant turn's `tool_calls` follow its content as
        `tool_format.calls` writes them; either without a `tool_format` is a ValueError. `thinking`:
        the generation prompt ends with `<think>` (DeepSeek-V4's thinking mode), and earlier
        assistant turns' reasoning is not shown, as in V4."""
        msgs = [dict(m) for m in messages]
        if (tools or any(m.get("tool_calls") for m in msgs)) and tool_format is None:
            raise ValueError("the built-in chat template writes tools and tool calls only with a tool format "
                             "(the server's DSML format)")
        if tools:
            section = tool_format.section(tools)  # type: ignore[union-attr]
            first = next((m for m in msgs if m["role"] == "system"), None)
            if first is None:
                msgs.insert(0, {"role": "system", "content": section})
            else:
                first["content"] = (str(first.get("content") or "") + "\n\n" + section).lstrip("\n")
        parts = []
        for m in msgs:
            content = str(m.get("content") or "")
            if m.get("tool_calls"):
                content = (content + "\n" if content else "") + tool_format.calls(m["tool_calls"])  # type: ignore[union-attr, arg-type]
            parts.append(_BYTE_ROLE_HEADER.format(role=m["role"]) + content + _BYTE_TURN_END)
        if add_generation_prompt:
            parts.append(_BYTE_ROLE_HEADER.format(role="assistant") + ("<think>" if thinking else ""))
        return "".join(parts)

    def apply_chat_template(
        self, messages: list[Message], add_generation_prompt: bool = True, tokenize: bool = True,
        tools: list[dict] | None = None, thinking: bool = False, tool_format: ToolFormat | None = None,
    ) -> list[int] | str:
        """Render the conversation; ids start with bos when `tokenize`."""
        text = self.render_chat(messages, add_generation_prompt, tools, thinking, tool_format)
        return self.encode(text, add_bos=True) if tokenize else text

    def incremental_decoder(self) -> IncrementalDecoder:
        """A streaming decoder that only emits complete UTF-8 characters."""
        return _ByteIncrementalDecoder()


# ---- tokenizer.json via the `tokenizers` library -------------------------------------------------


class _WindowIncrementalDecoder:
    """Streaming decode for subword tokenizers.

    Decodes a short window of ids ending at the newest one and emits the text beyond what the
    window's already-emitted prefix decoded to; text ending in U+FFFD (an incomplete byte
    sequence) is held back until a later id completes it.
    """

    _CONTEXT = 6

    def __init__(self, tok: "HFTokenizer") -> None:
        self._tok = tok
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # ids before this have been emitted

    def step(self, new_ids: Sequence[int]) -> str:
        """Feed ids; return newly completed text."""
        self._ids.extend(int(i) for i in new_ids)
        done = self._tok.decode(self._ids[self._prefix : self._read])
        full = self._tok.decode(self._ids[self._prefix :])
        if len(full) <= len(done) or full.endswith("\ufffd"):
            return ""
        out = full[len(done) :]
        self._read = len(self._ids)
        self._prefix = max(0, self._read - self._CONTEXT)
        return out

    def flush(self) -> str:
        """Emit whatever is left, replacement characters included."""
        done = self._tok.decode(self._ids[self._prefix : self._read])
        full = self._tok.decode(self._ids[self._prefix :])
        self._read = len(self._ids)
        return full[len(done) :] if len(full) > len(done) else ""


def _json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path` ({} when there is no such file); CheckpointError naming the file."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
        raise CheckpointError(f"{path}: not valid JSON: {e}") from None
    except RecursionError:
        raise CheckpointError(f"{path}: nested too deeply to be a tokenizer or model config") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def _token_content(tok: Any) -> str | None:
    """A special token in tokenizer_config.json is a string or a dict with `content`."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok if isinstance(tok, str) else None


class HFTokenizer:
    """A `tokenizer.json` model, with the chat template of `tokenizer_config.json` when present."""

    def __init__(self, model_dir: str | Path) -> None:
        from tokenizers import Tokenizer as _RawTokenizer

        d = Path(model_dir)
        try:
            self._tok = _RawTokenizer.from_file(str(d / "tokenizer.json"))
        except Exception as e:  # the Rust library raises a bare Exception for any bad file
            raise CheckpointError(f"{d / 'tokenizer.json'}: not a valid tokenizer file: "
                                  f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        conf = _json_object(d / "tokenizer_config.json")
        model_conf = _json_object(d / "config.json")
        model_conf = model_conf.get("text_config", model_conf)
        if not isinstance(model_conf, dict):
            raise CheckpointError(f"{d / 'config.json'}: `text_config` must be a JSON object")
        self.bos_token = _token_content(conf.get("bos_token"))
        self.eos_token = _token_content(conf.get("eos_token"))
        self.bos_token_id = self._id_of(self.bos_token, model_conf.get("bos_token_id"))
        eos_cfg = model_conf.get("eos_token_id")
        self._eos_ids = [int(e) for e in eos_cfg] if isinstance(eos_cfg, list) else []
        self.eos_token_id = self._id_of(self.eos_token, eos_cfg if isinstance(eos_cfg, int) else None)
        if self.eos_token_id is not None and self.eos_token_id not in self._eos_ids:
            self._eos_ids.insert(0, self.eos_token_id)
        if self.eos_token_id is None and self._eos_ids:
            self.eos_token_id = self._eos_ids[0]
        self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True), int(model_conf.get("vocab_size", 0)))
        self.chat_template = self._pick_template(conf.get("chat_template"))

    def _id_of(self, token: str | None, fallback: Any) -> int | None:
        if token is not None:
            i = self._tok.token_to_id(token)
            if i is not None:
                return int(i)
        return int(fallback) if isinstance(fallback, int) else None

    @staticmethod
    def _pick_template(raw: Any) -> str | None:
        """`chat_template` is a string, or a list of {name, template} of which `default` is used."""
        if isinstance(raw, list):
            named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
            return named.get("default") or next(iter(named.values()), None)
        return raw if isinstance(raw, str) else None

    @property
    def eos_token_ids(self) -> list[int]:
        """All ids that end generation."""
        return list(self._eos_ids)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of `text` (no special tokens added), after bos when asked for."""
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        if add_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[Message], add_generation_prompt: bool = True, tokenize: bool = True,
        tools: list[dict] | None = None, thinking: bool = False, tool_format: ToolFormat | None = None,
    ) -> list[int] | str:
        """Render with the model's jinja2 template, or the byte tokenizer's format when it has none.

        `tools` and `thinking` reach a jinja template as the variables `tools`, `thinking` and
        `enable_thinking`; a template that never reads them cannot honour them (ValueError).
        `tool_format` serves the built-in format only (a jinja template writes its own tool syntax)."""
        if self.chat_template is None:
            text = ByteTokenizer().render_chat(messages, add_generation_prompt, tools, thinking, tool_format)
            return self.encode(text, add_bos=True) if tokenize else text
        if tools and "tools" not in self.chat_template:
            raise ValueError("this model's chat template does not render tools")
        if thinking and "thinking" not in self.chat_template:
            raise ValueError("this model's chat template has no thinking mode")
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        text = env.from_string(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            thinking=thinking,
            enable_thinking=thinking,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )
        return self.encode(text) if tokenize else text

    def incremental_decoder(self) -> IncrementalDecoder:
        """A streaming decoder that holds back incomplete characters."""
        return _WindowIncrementalDecoder(self)


# ---- loading ---------------------------------------------------------------------------------------


def _model_dir(name: str) -> Path | None:
    """A directory for `name`: the path itself, or a model shipped inside the package."""
    p = Path(name)
    if p.is_dir():
        return p
    if p.is_file():
        return p.parent
    shipped = Path(__file__).parent / "models" / name
    return shipped if shipped.is_dir() else None


def byte_to_char() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what the ByteLevel pre-tokenizer applies)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out



def is_byte_level(path: str | Path) -> bool:
    """Whether the `tokenizer.json` at `path` is this byte tokenizer (id = byte value, no merges)."""
    try:
        doc = json.loads(Path(path).read_text())
        model = doc.get("model") or {}
        chars = byte_to_char()
        return (model.get("type") == "BPE" and not model.get("merges")
                and model.get("vocab") == {chars[b]: b for b in range(256)}
                and (doc.get("pre_tokenizer") or {}).get("type") == "ByteLevel")
    except (OSError, ValueError, AttributeError):
        return False


def load_tokenizer(model_dir_or_name: str | Path) -> Tokenizer:
    """The tokenizer of a model directory, shipped model or shipped config name.

    A directory with `tokenizer.json` gets an `HFTokenizer`, unless the file is the byte tokenizer's
    (`is_byte_level`); anything else a `ByteTokenizer` sized from the model config's JSON
    (its vocab_size, bos and eos ids) when one can be found (`_config_fields`).
    """
    name = str(model_dir_or_name)
    d = _model_dir(name)
    if d is not None and (d / "tokenizer.json").is_file():
        if not is_byte_level(d / "tokenizer.json"):  # the byte tokenizer's own file: keep the built-in one
            return HFTokenizer(d)
    raw = _config_fields(name)
    vocab = raw.get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool):  # no readable config: the default byte vocabulary
        return ByteTokenizer()
    if vocab < 256:
        raise ValueError(
            f"model {name!r} has vocab_size {vocab} and no tokenizer.json; "
            "put a tokenizer.json in the model directory"
        )
    eos = raw.get("eos_token_id", 1)
    eos = eos[0] if isinstance(eos, list) and eos else None if isinstance(eos, list) else eos
    bos = raw.get("bos_token_id", 0)
    return ByteTokenizer(vocab, bos if isinstance(bos, int) else None, eos if isinstance(eos, int) else None,
                         BYTE_PAD if vocab > BYTE_PAD else None)


def _config_fields(name: str) -> dict[str, Any]:
    """The fields of the model config `name` names (a file, a directory, a shipped config), `text_config`
    merged in; {} when there is none or it cannot be read. Read as JSON: the tokenizer needs only the
    vocabulary size and the bos / eos ids, not a validated model config."""
    from kvshare.shipped import resolve_config_path

    try:
        raw = _json_object(resolve_config_path(name))
    except Exception:  # not found (ConfigError) or not valid JSON (CheckpointError)
        return {}
    inner = raw.get("text_config")
    return {**raw, **inner} if isinstance(inner, dict) else raw
