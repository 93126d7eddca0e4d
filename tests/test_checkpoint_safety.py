"""Loading refuses what it cannot trust (issue 16): pickle-only directories, configs without
weights on the CLI, absurd config sizes, configs that do not match the weights (found from the
headers, before any allocation), corrupt files (named), shard paths outside the model directory."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from kvshare.cli import main
from kvshare.config import load_config
from kvshare.errors import CheckpointError, ConfigError
from kvshare.model import deepseek
from kvshare.weights.loader import load_model
from kvshare.weights.checkpoint_write import save_checkpoint
from kvshare.shipped import resolve_config_path


def raw(name: str) -> dict:
    return json.loads(resolve_config_path(name).read_text())


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ckpt")
    model = load_model("tiny-v41", quant=False)
    save_checkpoint(model, model.cfg, out)
    return out


def copy_with_config(ckpt: Path, dst: Path, **changes: object) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "model.safetensors").write_bytes((ckpt / "model.safetensors").read_bytes())
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_pickle_only_directory_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "config.json").write_text(json.dumps(raw("tiny-v41")))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(CheckpointError, match="pickle"):
        load_model(tmp_path)
    assert main(["generate", "x", "--model", str(tmp_path), "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "pytorch_model.bin" in err and "\n" not in err


def test_config_without_weights_needs_random_weights(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    t0 = time.perf_counter()
    assert main(["generate", "x", "--model", "deepseek-v4-flash"]) == 2
    assert time.perf_counter() - t0 < 5  # refused before building a multi-GB model
    assert "--random-weights" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps(raw("tiny-v41")))
    assert main(["generate", "x", "--model", str(tmp_path)]) == 2
    assert "no weights" in capsys.readouterr().err
    assert main(["generate", "x", "--model", str(tmp_path), "--random-weights", "--max-tokens", "2",
                 "--quiet"]) == 0


@pytest.mark.parametrize("field, value", [("vocab_size", 10**12), ("hidden_size", 10**6),
                                          ("num_hidden_layers", 10**4), ("hc_sinkhorn_iters", 10**9),
                                          ("max_position_embeddings", 2**40), ("n_routed_experts", 10**7)])
def test_absurd_sizes_are_refused_by_rule(field: str, value: int) -> None:
    d = raw("tiny-v41")
    d[field] = value
    if field == "num_hidden_layers":
        d["compress_ratios"] = [0] * value
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=field):
        load_config(d)
    assert time.perf_counter() - t0 < 1.0


def test_shapes_checked_from_headers_before_allocation(ckpt: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    def no_alloc(*a: object, **k: object) -> None:
        raise AssertionError("the model was built before the shapes were checked")

    monkeypatch.setattr(deepseek.Transformer, "__init__", no_alloc)
    wrong_vocab = copy_with_config(ckpt, tmp_path / "vocab", vocab_size=300_000)
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor `embed.weight` has shape \[256, 32\]"):
        load_model(wrong_vocab)
    ratios = json.loads((ckpt / "config.json").read_text())["compress_ratios"]
    more_layers = copy_with_config(ckpt, tmp_path / "layers", num_hidden_layers=900,
                                   compress_ratios=ratios[:6] + [0] * 895)
    with pytest.raises(CheckpointError, match="900 layers but the checkpoint has no tensors for layer 6"):
        load_model(more_layers)


def test_corrupt_safetensors_names_the_file(ckpt: Path, tmp_path: Path) -> None:
    d = copy_with_config(ckpt, tmp_path / "corrupt")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_model(d)
    (d / "model.safetensors").write_bytes(b"garbage!" + b"{" * 64)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a safetensors file"):
        load_model(d)


@pytest.mark.parametrize("shard", ["../../../../etc/passwd", "/etc/passwd", "sub/../../outside.safetensors"])
def test_index_shards_must_stay_inside(ckpt: Path, tmp_path: Path, shard: str) -> None:
    d = copy_with_config(ckpt, tmp_path / "idx")
    (d / "model.safetensors").rename(d / "model-00001-of-00001.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"embed.weight": shard}}))
    with pytest.raises(CheckpointError, match="outside the model directory"):
        load_model(d)


def test_symlinked_shard_outside_is_refused(ckpt: Path, tmp_path: Path) -> None:
    d = copy_with_config(ckpt, tmp_path / "link")
    outside = tmp_path / "elsewhere.safetensors"
    (d / "model.safetensors").rename(outside)
    (d / "shard.safetensors").symlink_to(outside)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"embed.weight": "shard.safetensors"}}))
    with pytest.raises(CheckpointError, match="resolves outside"):
        load_model(d)


def test_shipped_default_model_still_loads() -> None:
    model = load_model("kvshare-mini-v41")
    assert model.cfg.num_hidden_layers == 8
