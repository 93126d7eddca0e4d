"""Engram's compressed token map (spec/engram_dspark.md §1.3): token id -> normalised-token id.

For every token id of the tokenizer (added tokens included) in id order:

* ``text`` = the raw decode of that single id, special tokens kept, no clean-up of spaces;
* if ``text`` contains U+FFFD (a partial UTF-8 byte token) the key is the raw token string
  (``id_to_token``); otherwise the key is ``normalise(text)``, or ``text`` when that is empty;
* the compressed id is the first-seen index of the key.

``normalise`` is exactly `NFKC, NFD, StripAccents, Lowercase, Replace([ \\t\\r\\n]+ -> " "),
Replace(^ $ -> U+E000), Strip, Replace(U+E000 -> " ")` of the `tokenizers` library; the sentinel
lets a token that is exactly one whitespace survive `Strip` as a space. The number of distinct keys
must equal the config's `engram_compressed_vocab_size`, since every hash multiplier derives from
it; the caller checks that (`EngramHasher`).

Tokenizers: a `tokenizers.Tokenizer`, kvshare's `HFTokenizer` (its `tokenizer.json`), or the
byte-level `ByteTokenizer`. For the byte tokenizer (kvshare decision, no release uses it): byte
ids decode as one byte (bytes >= 0x80 alone are partial UTF-8, so their key is ``<0xHH>``), and a
special id i >= 256 decodes to ``<|i|>``.

Building a map costs one decode per token (about 129k for the release), so maps are cached per
tokenizer content (sha256 of its serialised form).
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterator

import torch

_CACHE: dict[str, torch.Tensor] = {}


def _normalizer() -> Any:
    from tokenizers import Regex, normalizers

    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex("[ \t\r\n]+"), " "), normalizers.Replace(Regex("^ $"), "\ue000"),
        normalizers.Strip(), normalizers.Replace("\ue000", " "),
    ])


def _raw_backend(tokenizer: Any) -> Any | None:
    """The `tokenizers.Tokenizer` behind `tokenizer`, or None for the byte tokenizer."""
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    inner = getattr(tokenizer, "_tok", None)
    return inner if isinstance(inner, Tokenizer) else None


def _token_strings(tokenizer: Any) -> tuple[str, Iterator[tuple[str, str | None]]]:
    """(cache key, iterator of (decoded text, raw token) in id order)."""
    raw = _raw_backend(tokenizer)
    if raw is not None:
        n = raw.get_vocab_size(with_added_tokens=True)
        key = "tokenizers:" + hashlib.sha256(raw.to_str().encode()).hexdigest()
        return key, ((raw.decode([i], skip_special_tokens=False), raw.id_to_token(i)) for i in range(n))
    n = getattr(tokenizer, "vocab_size", None)
    if type(tokenizer).__name__ != "ByteTokenizer" or not isinstance(n, int):
        raise TypeError(f"cannot build Engram's compressed token map from {type(tokenizer).__name__}: "
                        "use a tokenizer.json tokenizer or the byte-level tokenizer")
    return f"byte:{n}", _byte_strings(n)


def _byte_strings(n: int) -> Iterator[tuple[str, str | None]]:
    """The byte-level tokenizer's (decoded text, raw token) of ids 0..n-1: bytes, then specials."""
    for i in range(n):
        if i < 256:
            yield bytes([i]).decode("utf-8", errors="replace"), f"<0x{i:02X}>"
        else:
            yield f"<|{i}|>", f"<|{i}|>"


def compressed_token_map(tokenizer: Any) -> torch.Tensor:
    """The map [len(tokenizer)] int64 of §1.3 (cached per tokenizer content)."""
    return _map(*_token_strings(tokenizer))


def byte_token_map(vocab_size: int) -> torch.Tensor:
    """`compressed_token_map` of the byte-level tokenizer of `vocab_size` ids (no tokenizer object
    needed: its token strings follow from the vocabulary size alone)."""
    return _map(f"byte:{vocab_size}", _byte_strings(vocab_size))


def _map(key: str, strings: Iterator[tuple[str, str | None]]) -> torch.Tensor:
    if key in _CACHE:
        return _CACHE[key].clone()
    norm = _normalizer()
    first: dict[str, int] = {}
    out: list[int] = []
    for text, raw_token in strings:
        if "\ufffd" in text:
            k = raw_token if raw_token is not None else text
        else:
            k = norm.normalize_str(text) or text
        out.append(first.setdefault(k, len(first)))
    _CACHE[key] = torch.tensor(out, dtype=torch.int64)
    return _CACHE[key].clone()
