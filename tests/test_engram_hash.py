"""Engram hashing against published facts (spec/engram_dspark.md §1.1-§1.6, §1.12).

* NeMo's golden fixture, frozen from DeepSeek's inference/engram.py: its 9-token WordLevel
  tokenizer, compressed map, primes, offsets and the full expected hash tensor, bit-exact;
* the released V4.1-Flash row counts (384,006,168 / 384,016,682), primes and multipliers;
* the hash of a chunk at any position (look-back from ``prev_tokens``) equals the full prefill's;
* config parsing (HF and inference names) and every validation rule naming its field.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models

from kvshare.config import ModelConfig, load_config
from kvshare.errors import ConfigError
from kvshare.model.engram import lookback_ids
from kvshare.model.engram_hash import EngramHasher, EngramLayout, engram_multipliers
from kvshare.model.engram_tokens import compressed_token_map
from kvshare.step import StepBatch
from kvshare.shipped import resolve_config_path
from kvshare.tokenizer import ByteTokenizer

NEMO_VOCAB = {"[UNK]": 0, " The": 1, "the": 2, "THE": 3, "é": 4, "E": 5, " ": 6, "x": 7, "\ufffd": 8}
# NeMo-Automodel tests/.../deepseek_v41 engram test, "Frozen from the downloaded DeepSeek-V4.1-Flash
# inference/engram.py": [batch, position, engram layer, column].
NEMO_EXPECTED = [
    [[[10, 13, 39, 43, 71, 100], [3, 34, 100, 141, 191, 245]],
     [[9, 11, 32, 43, 72, 88], [11, 65, 95, 111, 164, 244]],
     [[6, 13, 35, 57, 80, 103], [22, 42, 98, 150, 171, 200]],
     [[6, 13, 35, 57, 80, 103], [22, 42, 98, 150, 171, 200]],
     [[1, 19, 37, 51, 80, 83], [25, 60, 102, 116, 153, 214]],
     [[6, 12, 32, 56, 61, 93], [25, 58, 85, 135, 163, 214]]],
    [[[6, 13, 35, 57, 80, 103], [22, 42, 98, 150, 171, 200]],
     [[6, 13, 35, 57, 80, 103], [22, 42, 98, 150, 171, 200]],
     [[6, 13, 35, 57, 80, 103], [22, 42, 98, 150, 171, 200]],
     [[10, 13, 39, 43, 71, 100], [3, 34, 100, 141, 191, 245]],
     [[3, 22, 34, 48, 78, 97], [28, 64, 84, 121, 184, 200]],
     [[4, 19, 31, 55, 76, 94], [5, 42, 106, 115, 181, 220]]],
]


def nemo_hasher() -> EngramHasher:
    tok = Tokenizer(models.WordLevel(NEMO_VOCAB, unk_token="[UNK]"))
    layout = EngramLayout.build((1, 14), max_ngram=4, n_heads=2, vocab_size=11, compressed_vocab=6)
    return EngramHasher(layout, compressed_token_map(tok), compressed_vocab=6, pad_token_id=2, vocab_size=9)


def test_golden_fixture_bit_exact() -> None:
    h = nemo_hasher()
    assert h.token_map.tolist() == [0, 1, 1, 1, 2, 2, 3, 4, 5]  # cases/accents merge; " " survives
    assert h.pad_id == 1
    assert h.layout.primes.tolist() == [[11, 13, 17, 19, 23, 29], [31, 37, 41, 43, 47, 53]]
    assert h.layout.offsets.tolist() == [[0, 11, 24, 41, 60, 83], [0, 31, 68, 109, 152, 199]]
    ids = torch.tensor([[7, 1, 4, 3, 8, 7], [2, 3, 1, 7, 5, 6]])
    alive = torch.tensor([[True, True, False, False, True, True], [True] * 6])  # False: DEAD (image) token
    pos = torch.arange(6)
    got = []
    for b in range(2):
        # look-back written out independently of kvshare: column s = position p - s
        src = (pos.unsqueeze(1) - torch.arange(4)).clamp_min(0)
        valid = pos.unsqueeze(1) - torch.arange(4) >= 0
        got.append(h(ids[b][src], valid, ~alive[b][src]))
    assert torch.equal(torch.stack(got), torch.tensor(NEMO_EXPECTED))


def test_released_rows_primes_and_multipliers() -> None:
    cfg = load_config("deepseek-v4.1-flash")
    lay = EngramLayout.build(cfg.engram_layer_ids, cfg.engram_max_ngram_size, cfg.engram_n_heads,
                             cfg.engram_vocab_size, cfg.engram_compressed_vocab_size)
    assert lay.rows == (384_006_168, 384_016_682) == cfg.engram_num_embeddings
    assert lay.primes[0, :8].tolist() == [16000057, 16000079, 16000081, 16000097, 16000121, 16000129,
                                         16000133, 16000183]
    assert lay.primes[1, 0].item() == 16000477 and lay.primes[1, -1].item() == 16000889
    assert lay.multipliers.tolist() == [
        [76632096046245, 4839876093313, 35959672319349, 73987337458391],
        [67716810739261, 51510806800915, 30921347202721, 82619226485591]]
    assert lay.cols == 24
    # the formula itself (numpy's generator) reproduces the constants kvshare also ships
    assert engram_multipliers(cfg.engram_layer_ids, 4, cfg.engram_compressed_vocab_size).tolist() == \
        lay.multipliers.tolist()


def test_released_multipliers_win_over_a_drifted_generator(monkeypatch, caplog) -> None:
    import kvshare.model.engram_hash as eh

    monkeypatch.setattr(eh, "engram_multipliers", lambda ids, n, c: np.ones((len(ids), n), dtype=np.int64))
    with caplog.at_level("WARNING", logger="kvshare.model.engram_hash"):
        lay = EngramLayout.build((1, 14), 4, 8, 16_000_000, 99_092)
    assert lay.multipliers[1, 0].item() == 67716810739261 and "released constants" in caplog.text


def test_byte_tokenizer_map_matches_tiny_config() -> None:
    cfg = load_config("tiny-v41-engram")
    m = compressed_token_map(ByteTokenizer(256, None, None, None))
    assert int(m.max()) + 1 == cfg.engram_compressed_vocab_size == 227  # 26 case merges, 3 whitespace merges
    assert m[ord("A")] == m[ord("a")] and m[ord("\t")] == m[ord(" ")] == m[ord("\n")]
    assert len(set(m[128:].tolist())) == 128  # lone UTF-8 bytes keep distinct raw-token keys


def test_compressed_vocab_mismatch_is_a_clear_error() -> None:
    tok = Tokenizer(models.WordLevel(NEMO_VOCAB, unk_token="[UNK]"))
    layout = EngramLayout.build((1, 14), 4, 2, 11, 7)
    with pytest.raises(ValueError, match="6 compressed token ids but engram_compressed_vocab_size is 7"):
        EngramHasher(layout, compressed_token_map(tok), 7, 2, 9)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chunks_and_decode_hash_like_one_prefill(seed: int) -> None:
    """Hash ids are a function of (ids at p-3..p, p >= s): any chunking of any batch gives the same rows."""
    h = nemo_hasher()
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, 9, (n,), generator=g) for n in (23, 9)]
    full = [h(*lookback_ids(s, StepBatch.build([0], [len(s)]), 4)) for s in seqs]
    # Both sequences chunked differently and batched together, each chunk with its previous 3 ids.
    starts = [0, 0]
    while any(st < len(s) for st, s in zip(starts, seqs)):
        live = [i for i in range(2) if starts[i] < len(seqs[i])]
        lens = [min(int(torch.randint(1, 6, (1,), generator=g)), len(seqs[i]) - starts[i]) for i in live]
        st = [starts[i] for i in live]
        prev = [seqs[i][max(0, starts[i] - 3):starts[i]].tolist() for i in live]
        ids = torch.cat([seqs[i][s:s + n] for i, s, n in zip(live, st, lens)])
        got = h(*lookback_ids(ids, StepBatch.build(st, lens, prev_tokens=prev), 4))
        row = 0
        for i, s, n in zip(live, st, lens):
            assert torch.equal(got[row:row + n], full[i][s:s + n]), f"sequence {i} chunk at {s}"
            row += n
            starts[i] += n


def test_chunk_without_prev_tokens_is_refused() -> None:
    with pytest.raises(RuntimeError, match="prev_tokens"):
        lookback_ids(torch.tensor([5, 6]), StepBatch.build([4], [2]), 4)
    # a chunk at position 2 needs only 2 earlier ids
    raw, valid = lookback_ids(torch.tensor([5]), StepBatch.build([2], [1], prev_tokens=[[7, 8]]), 4)
    assert raw.tolist() == [[5, 8, 7, 0]] and valid.tolist() == [[True, True, True, False]]


def test_hf_and_inference_config_names() -> None:
    hf = load_config("deepseek-v4.1-flash")
    assert (hf.engram_layer_ids, hf.engram_max_ngram_size, hf.engram_vocab_size, hf.engram_n_heads,
            hf.engram_head_dim, hf.engram_pad_token_id, hf.engram_compressed_vocab_size) == (
        (1, 14), 4, 16_000_000, 8, 256, 2, 99_092)
    raw = json.loads(open(resolve_config_path("tiny-v41-engram")).read())
    inf = {k: v for k, v in raw.items() if k != "engram_pad_token_id"}
    inf.update({"engram_pad_id": raw["engram_pad_token_id"], "dim": inf.pop("hidden_size"),
                "n_layers": inf.pop("num_hidden_layers"), "kv_source_layers": inf.pop("kv_source_layer_ids")})
    assert ModelConfig.from_dict(inf) == load_config("tiny-v41-engram")
    cfg = load_config("tiny-v41-engram")
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("change,field", [
    ({"engram_num_embeddings": (252,)}, "engram_num_embeddings"),
    ({"engram_num_embeddings": (253, 410)}, "engram_num_embeddings"),
    ({"engram_layer_ids": (1, 1)}, "engram_layer_ids"),
    ({"engram_layer_ids": (1, 6)}, "engram_layer_ids"),
    ({"engram_max_ngram_size": 1}, "engram_max_ngram_size"),
    ({"engram_n_heads": 0}, "engram_n_heads"),
    ({"engram_head_dim": 48}, "engram_head_dim"),
    ({"engram_compressed_vocab_size": 0}, "engram_compressed_vocab_size"),
    ({"engram_pad_token_id": 256}, "engram_pad_token_id"),
    ({"engram_n_heads": 10**6}, "engram_n_heads"),  # refused before a long prime search
])
def test_validation_names_the_field(change: dict, field: str) -> None:
    with pytest.raises(ConfigError) as e:
        dataclasses.replace(load_config("tiny-v41-engram"), **change)
    assert e.value.field == field and "fix" in str(e.value)


def test_engram_layer_table_size_error_names_layer_and_sum() -> None:
    with pytest.raises(ConfigError, match=r"layer 4.*410"):
        dataclasses.replace(load_config("tiny-v41-engram"), engram_num_embeddings=(252, 411))
