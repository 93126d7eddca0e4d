"""The shipped model's tokenizer.json: `transformers.AutoTokenizer` loads it from the model directory
and it equals the built-in byte tokenizer on every byte string (random bytes, all 256 single bytes,
the special ids), chat template included, except a special token's name typed as text (an id in
HF, bytes in the built-in: `tokenizer_json`'s documented exception); the engine keeps the
built-in tokenizer."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from kvshare.tokenizer import BYTE_SPECIAL_NAMES, ByteTokenizer, load_tokenizer
from kvshare.tokenizer_json import is_byte_level, tokenizer_config, tokenizer_json

MODEL_DIR = Path(__import__("kvshare").__file__).parent / "models" / "kvshare-mini-v41"


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(MODEL_DIR))


@pytest.fixture(scope="module")
def builtin() -> ByteTokenizer:
    tok = load_tokenizer("kvshare-mini-v41")
    assert type(tok) is ByteTokenizer  # the engine keeps the built-in tokenizer
    return tok


def test_shipped_files_are_the_generated_ones(builtin: ByteTokenizer) -> None:
    assert json.loads((MODEL_DIR / "tokenizer.json").read_text()) == tokenizer_json(builtin)
    assert json.loads((MODEL_DIR / "tokenizer_config.json").read_text()) == tokenizer_config(builtin, 4096)
    assert is_byte_level(MODEL_DIR / "tokenizer.json")


def test_every_single_byte_and_the_specials(hf, builtin: ByteTokenizer) -> None:
    for b in range(256):
        assert hf.decode([b]) == builtin.decode([b]), b
        if b < 128:
            assert hf.encode(chr(b), add_special_tokens=False) == [b]
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (256, 257, 258)
    assert hf.convert_ids_to_tokens([256, 257, 258]) == [BYTE_SPECIAL_NAMES[k] for k in ("bos", "eos", "pad")]
    assert [builtin.special_name(i) for i in (256, 257, 258)] == hf.convert_ids_to_tokens([256, 257, 258])
    assert hf.decode([256, 104, 105, 257], skip_special_tokens=True) == builtin.decode([256, 104, 105, 257]) == "hi"
    # the documented exception: a special token's name typed in text is that id in HF, bytes in the built-in
    typed = "a" + BYTE_SPECIAL_NAMES["bos"]
    assert hf.encode(typed, add_special_tokens=False) == [97, 256]
    assert builtin.encode(typed) == [97, *BYTE_SPECIAL_NAMES["bos"].encode()]
    assert hf.encode("hello") == builtin.encode("hello", add_bos=True)


def test_random_byte_strings(hf, builtin: ByteTokenizer) -> None:
    rng = random.Random(0)
    for _ in range(300):
        raw = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))
        ids = list(raw)
        assert hf.decode(ids) == builtin.decode(ids), raw  # invalid UTF-8 -> the same U+FFFD runs
        text = raw.decode("utf-8", errors="replace")
        assert hf.encode(text, add_special_tokens=False) == builtin.encode(text), raw
    text = "".join(chr(rng.randrange(0x20, 0x2FFFF)) for _ in range(500)).encode("utf-8", "ignore").decode()
    assert hf.encode(text, add_special_tokens=False) == builtin.encode(text)


def test_chat_template(hf, builtin: ByteTokenizer) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo"}]
    for gen in (True, False):
        want = builtin.apply_chat_template(msgs, add_generation_prompt=gen)
        assert hf.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=True,
                                      return_dict=False) == want
