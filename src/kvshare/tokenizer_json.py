"""The byte tokenizer as Hugging Face files: `tokenizer.json` and `tokenizer_config.json`.

Client tools (lm-eval, guidellm, aiperf, `transformers.AutoTokenizer`) load a tokenizer from the
model directory; these files make them see exactly kvshare's built-in byte tokenizer:

* ``tokenizer.json``: a BPE model with no merges whose 256 tokens are the bytes 0-255 in GPT-2's
  byte-to-character spelling (the ``ByteLevel`` pre-tokenizer and decoder map text to bytes and
  back, invalid UTF-8 decoding to U+FFFD), so id = byte value; the special ids (bos 256, eos 257,
  pad 258 when the vocabulary holds them) are added tokens named as ``BYTE_SPECIAL_NAMES``; the
  post-processor puts bos in front (``encode(text, add_bos=True)``, what the server does to a text
  prompt).
* ``tokenizer_config.json``: the special tokens and the built-in chat template (bos first).

Equal to the built-in tokenizer on every byte string, with one exception every Hugging Face
tokenizer shares: a special token's exact name typed in the text (``<｜begin▁of▁sentence｜>``)
encodes as that special id there, as its UTF-8 bytes in the built-in tokenizer (which has no
textual form for special ids). The chat template relies on it to put bos first.

`load_tokenizer` recognises such a `tokenizer.json` (`is_byte_level`) and keeps using the built-in
`ByteTokenizer` with the same ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvshare.tokenizer import BYTE_SPECIAL_NAMES, ByteTokenizer, byte_to_char, is_byte_level  # noqa: F401 (re-exported)

# The built-in chat template (`ByteTokenizer.render_chat`) in jinja, with bos first.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def _specials(tok: ByteTokenizer) -> list[tuple[int, str]]:
    ids = {"bos": tok.bos_token_id, "eos": tok.eos_token_id, "pad": tok.pad_token_id}
    return sorted((i, BYTE_SPECIAL_NAMES[k]) for k, i in ids.items() if i is not None)


def tokenizer_json(tok: ByteTokenizer) -> dict[str, Any]:
    """The `tokenizer.json` document of `tok`."""
    chars = byte_to_char()
    added = [{"id": i, "content": name, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, name in _specials(tok)]
    post = None
    if tok.bos_token_id is not None:
        bos = BYTE_SPECIAL_NAMES["bos"]
        post = {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {bos: {"id": bos, "ids": [tok.bos_token_id], "tokens": [bos]}}}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": byte_level, "post_processor": post, "decoder": dict(byte_level),
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {chars[b]: b for b in range(256)}, "merges": []},
    }


def tokenizer_config(tok: ByteTokenizer, model_max_length: int) -> dict[str, Any]:
    """The `tokenizer_config.json` document of `tok`."""
    names = dict((i, n) for i, n in _specials(tok))
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": names.get(tok.bos_token_id), "eos_token": names.get(tok.eos_token_id),
        "pad_token": names.get(tok.pad_token_id), "add_bos_token": tok.bos_token_id is not None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length, "chat_template": CHAT_TEMPLATE,
    }


def write(tok: ByteTokenizer, model_dir: str | Path, model_max_length: int) -> None:
    """Write both files into `model_dir`."""
    d = Path(model_dir)
    (d / "tokenizer.json").write_text(json.dumps(tokenizer_json(tok), ensure_ascii=False, indent=2) + "\n")
    (d / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tok, model_max_length),
                                                        ensure_ascii=False, indent=2) + "\n")
