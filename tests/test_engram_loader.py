"""Engram checkpoints in the released naming (spec/engram_dspark.md §1.2).

A checkpoint written the way the release stores Engram (FP8 table rows with per-row e8m0 scales,
FP8 `wkv` with 32x32 block scales, bf16 `q_weight` / `k_weight`, tables in their own shard) loads,
memory-mapped or into RAM, and gives the logits of the model it was written from. A missing,
mis-shaped or mis-typed Engram tensor is named in the error; a tokenizer whose compressed
vocabulary differs from the config is refused; a config whose tables are too large to invent
refuses to run without weights. The slow test measures resident memory of a multi-GB mmap table.
"""

from __future__ import annotations

import json
import os
import resource
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models

from kvshare.config import load_config
from kvshare.errors import CheckpointError, ConfigError
from kvshare.cache.dense import DenseCache
from kvshare.model import Transformer
from kvshare.model.engram_table import EngramTable, open_tables
from kvshare.weights.loader import load_checkpoint, load_model
from kvshare.weights.checkpoint_write import hf_style_config
from kvshare.weights.weights_quant import dequant_fp8_weight, quantize_fp8_weight
from kvshare.step import StepBatch

NAME = "tiny-v41-engram"


def released_tensors(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's tensors as the release stores them (Engram part in its released dtypes)."""
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for lid, table in model.engram_tables().items():
        p = f"layers.{lid}.engram."
        sd[p + "wkv.weight"], sd[p + "wkv.scale"] = quantize_fp8_weight(sd[p + "wkv.weight"], (32, 32))
        sd[p + "q_weight"] = sd[p + "q_weight"].bfloat16()
        sd[p + "k_weight"] = sd[p + "k_weight"].bfloat16()
        sd[p + "embed.weight"], sd[p + "embed.scale"] = table.to_tensors()
    return sd


def write_checkpoint(d: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """config.json plus two shards (Engram tables in the second, like the release's shards 47-48)."""
    cfg = load_config(NAME)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(hf_style_config(cfg)))
    tables = {k: v for k, v in tensors.items() if ".engram.embed." in k}
    rest = {k: v for k, v in tensors.items() if k not in tables}
    save_file(rest, str(d / "model-00001-of-00002.safetensors"))
    save_file(tables, str(d / "model-00002-of-00002.safetensors"))
    weight_map = {k: "model-00001-of-00002.safetensors" for k in rest}
    weight_map.update({k: "model-00002-of-00002.safetensors" for k in tables})
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return d


def logits(model: Transformer) -> torch.Tensor:
    ids = torch.arange(5, 40, 3)
    cache = DenseCache(model.cfg, model.topo, 1, 32)
    with torch.no_grad():
        return model(ids, StepBatch.build([0], [ids.numel()]), cache)


@pytest.fixture(scope="module")
def source() -> Transformer:
    return Transformer(load_config(NAME), quant=True).init_weights(3).eval()


@pytest.mark.parametrize("mode", ["mmap", "memory"])
def test_released_naming_checkpoint_loads(tmp_path: Path, source: Transformer, mode: str) -> None:
    tensors = released_tensors(source)
    d = write_checkpoint(tmp_path / "ckpt", tensors)
    model = load_model(d, engram_table=mode)
    table = model.layers[4].engram.table
    assert table.mode == mode and isinstance(table.codes, np.memmap) == (mode == "mmap")
    # The expected model: the source with wkv, q and k as the checkpoint rounded them.
    with torch.no_grad():
        for lid in source.cfg.engram_layer_ids:
            p, eng = f"layers.{lid}.engram.", source.layers[lid].engram
            eng.wkv.weight.copy_(dequant_fp8_weight(tensors[p + "wkv.weight"], tensors[p + "wkv.scale"], (32, 32)))
            eng.q_weight.copy_(tensors[p + "q_weight"].float())
            eng.k_weight.copy_(tensors[p + "k_weight"].float())
    assert torch.equal(logits(model), logits(source))
    model.to(torch.float64)  # a dtype / device move leaves the host table as it is
    assert model.layers[4].engram.table is table and table.codes.dtype == np.uint8


@pytest.mark.parametrize("name,change,message", [
    ("layers.4.engram.embed.scale", "drop", r"missing tensor `layers.4.engram.embed.scale`.*\[410, 2\]"),
    ("layers.1.engram.embed.weight", "rows", r"`layers.1.engram.embed.weight` has shape \[251, 64\], expected \[252, 64\]"),
    ("layers.1.engram.embed.scale", "dtype", r"`layers.1.engram.embed.scale` has dtype F32, expected F8_E8M0"),
    ("layers.4.engram.wkv.weight", "drop", r"missing tensor `layers.4.engram.wkv.weight`"),
    ("layers.1.engram.q_weight", "rows", r"`layers.1.engram.q_weight` has shape \[3, 32\], expected \[4, 32\]"),
])
def test_bad_engram_tensor_is_named(tmp_path: Path, source: Transformer, name: str, change: str,
                                    message: str) -> None:
    tensors = released_tensors(source)
    if change == "drop":
        del tensors[name]
        if name.endswith("wkv.weight"):
            del tensors[name.replace(".weight", ".scale")]
    elif change == "rows":
        tensors[name] = tensors[name][:-1].contiguous()
    else:
        tensors[name] = tensors[name].view(torch.uint8).float()
    d = write_checkpoint(tmp_path / "bad", tensors)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(d, load_config(NAME))


def test_table_in_a_config_without_engram_is_unexpected(tmp_path: Path) -> None:
    cfg = load_config("tiny-v41")
    sd = Transformer(cfg).init_weights(0).state_dict()
    sd["layers.1.engram.embed.weight"] = torch.zeros(4, 32, dtype=torch.uint8).view(torch.float8_e4m3fn)
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="unexpected tensor `layers.1.engram.embed.weight`"):
        load_checkpoint(tmp_path, cfg)


def test_tokenizer_with_another_compressed_vocab_is_refused(tmp_path: Path, source: Transformer) -> None:
    d = write_checkpoint(tmp_path / "ckpt", released_tensors(source))
    vocab = {f"t{i}": i for i in range(256)}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(d / "tokenizer.json"))
    with pytest.raises(ConfigError, match="gives 256 compressed token ids") as e:
        load_model(d)
    assert e.value.field == "engram_compressed_vocab_size"


def test_v41_flash_without_weights_refuses(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"202,758,032,400 B.*too large") as e:
        load_model("deepseek-v4.1-flash")
    assert e.value.field == "engram_num_embeddings"


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
def test_mmap_table_resident_memory_stays_small(tmp_path: Path) -> None:
    """A 6 GiB table (sparse file, real rows written where they are read) opens and serves lookups
    with resident memory far below its size. Measured: table 5.90 GiB; RSS 282.2 MiB before,
    316.5 MiB after opening it and looking up 4,096 random rows (+34.3 MiB; +34.6 MiB in a second run: one 4 KiB page per row
    of codes and of scales, 8,192 pages = 32 MiB)."""
    rows, dim = 24_000_000, 256
    header = {"layers.1.engram.embed.weight": {"dtype": "F8_E4M3", "shape": [rows, dim], "data_offsets": [0, rows * dim]},
              "layers.1.engram.embed.scale": {"dtype": "F8_E8M0", "shape": [rows, dim // 32],
                                              "data_offsets": [rows * dim, rows * dim + rows * dim // 32]}}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    start = 8 + len(raw)
    path = tmp_path / "table.safetensors"
    g = torch.Generator().manual_seed(0)
    ids = torch.unique(torch.randint(0, rows, (4096,), generator=g))  # sorted, distinct
    vals = torch.randn(ids.numel(), dim, generator=g)
    want = EngramTable.quantize(vals)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(start + rows * dim + rows * dim // 32)
        for i, r in enumerate(ids.tolist()):  # only the rows looked up hold data
            f.seek(start + r * dim)
            f.write(want.codes[i].tobytes())
            f.seek(start + rows * dim + r * dim // 32)
            f.write(want.scales[i].tobytes())
    size = path.stat().st_size
    before = _rss_bytes()
    table = open_tables([path], (1,), (rows,), dim, "mmap")[1]
    got = table.lookup(ids)
    after = _rss_bytes()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"\ntable {size / 2**30:.2f} GiB; RSS before {before / 2**20:.1f} MiB, after open + lookup "
          f"{after / 2**20:.1f} MiB (+{(after - before) / 2**20:.1f} MiB); peak RSS {peak / 2**20:.1f} MiB")
    assert torch.equal(got, want.lookup(torch.arange(ids.numel())))
    assert after - before < 64 * 2**20 < size // 64


def test_generate_cli_refuses_v41_flash_without_weights(capsys: pytest.CaptureFixture[str]) -> None:
    from kvshare.cli import main

    for extra in ([], ["--random-weights"]):
        assert main(["generate", "hello", "--model", "deepseek-v4.1-flash", "--max-tokens", "1", *extra]) == 2
        assert "deepseek-v4.1-flash" in capsys.readouterr().err
