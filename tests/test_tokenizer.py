"""Tokenizers: byte-level round trips, streaming decode at UTF-8 boundaries, tokenizer.json + chat templates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvshare.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

TEXTS = ["", "def f(x):\n    return x", "héllo wörld", "日本語のテキスト", "emoji 🎉🚀 mixed ✓"]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_round_trip(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    with_bos = tok.encode(text, add_bos=True)
    assert with_bos[0] == 256 and tok.decode(with_bos) == text


def test_byte_specials_and_vocab() -> None:
    tok = load_tokenizer("kvshare-mini-v41")
    assert isinstance(tok, ByteTokenizer)
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (259, 256, 257, 258)
    assert tok.eos_token_ids == [257]
    assert tok.decode([104, 105, 257, 258]) == "hi"


def test_byte_tokenizer_without_specials() -> None:
    tok = load_tokenizer("tiny-v41")  # vocab 256, no bos / eos
    assert tok.vocab_size == 256 and tok.bos_token_id is None and tok.eos_token_id is None
    assert tok.encode("ab", add_bos=True) == [97, 98]
    assert tok.eos_token_ids == []


def test_unknown_name_falls_back_to_bytes() -> None:
    tok = load_tokenizer("no-such-model-anywhere")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 259


@pytest.mark.parametrize("text", TEXTS)
def test_byte_incremental_decoder_one_id_at_a_time(text: str) -> None:
    tok = ByteTokenizer()
    dec = tok.incremental_decoder()
    pieces = [dec.step([i]) for i in tok.encode(text)]
    pieces.append(dec.flush())
    assert "".join(pieces) == text
    # never emits half a character
    assert all("\ufffd" not in p for p in pieces)


def test_byte_incremental_decoder_holds_back_split_character() -> None:
    tok = ByteTokenizer()
    dec = tok.incremental_decoder()
    euro = list("€".encode("utf-8"))  # 3 bytes
    assert dec.step([ord("a"), euro[0]]) == "a"
    assert dec.step([euro[1]]) == ""
    assert dec.step([euro[2], 257]) == "€"
    assert dec.step([0xE2]) == ""
    assert dec.flush() == "\ufffd"  # stream ended inside a character


def test_byte_chat_template() -> None:
    tok = ByteTokenizer()
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"
    ids = tok.apply_chat_template(msgs)
    assert ids[0] == 256 and tok.decode(ids) == text
    assert not tok.apply_chat_template(msgs, add_generation_prompt=False, tokenize=False).endswith("<|assistant|>\n")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory with a small byte-level BPE tokenizer.json and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["hello world, héllo wörld 日本語 🎉 def f(x): return x"] * 20, trainer)
    d = tmp_path_factory.mktemp("hfmodel")
    tok.save(str(d / "tokenizer.json"))
    template = (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    conf = {"bos_token": {"content": "<s>"}, "eos_token": "</s>", "chat_template": template}
    (d / "tokenizer_config.json").write_text(json.dumps(conf))
    (d / "config.json").write_text(json.dumps({"vocab_size": 512}))
    return d


def test_hf_tokenizer_loads_and_round_trips(hf_dir: Path) -> None:
    tok = load_tokenizer(hf_dir)
    assert isinstance(tok, HFTokenizer)
    assert tok.bos_token_id == 0 and tok.eos_token_id == 1 and tok.vocab_size == 512
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("hello", add_bos=True)[0] == 0


def test_hf_chat_template(hf_dir: Path) -> None:
    tok = load_tokenizer(hf_dir)
    msgs = [{"role": "user", "content": "hello"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == "<s>[user]hello</s>[assistant]"
    ids = tok.apply_chat_template(msgs)
    assert ids[0] == 0 and tok.decode(ids, skip_special_tokens=False) == "<s>[user]hello</s>[assistant]"


@pytest.mark.parametrize("text", TEXTS)
def test_hf_incremental_decoder(hf_dir: Path, text: str) -> None:
    tok = load_tokenizer(hf_dir)
    dec = tok.incremental_decoder()
    pieces = [dec.step([i]) for i in tok.encode(text)]
    pieces.append(dec.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
