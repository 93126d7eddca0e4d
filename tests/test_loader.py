"""Checkpoint loading and saving: naming, sharding, FP8 / FP4 decoding, error reporting."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvshare.config import ModelConfig, load_config
from kvshare.errors import CheckpointError
from kvshare.weights import weights_quant as wq
from kvshare.weights.hf_naming import kvshare_to_transformers, released_shapes, transformers_to_kvshare
from kvshare.weights.loader import load_checkpoint, load_model
from kvshare.weights.checkpoint_write import hf_style_config, save_checkpoint
from kvshare.quant import fp4_codes, fp4_dequant
from kvshare.step import StepBatch


def random_state(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """A released-naming state dict with random values for `cfg`."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in released_shapes(cfg).items():
        if name.endswith("tid2eid"):
            out[name] = torch.randint(0, cfg.n_routed_experts, shape, generator=g, dtype=torch.int32)
        else:
            out[name] = torch.randn(shape, generator=g) * 0.1
    return out


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k].to(b[k].dtype), b[k]), k


@pytest.fixture(scope="module", params=["tiny-v4", "tiny-v41"])
def cfg(request: pytest.FixtureRequest) -> ModelConfig:
    return load_config(request.param)


@pytest.mark.parametrize("name", ["tiny-v4", "tiny-v41", "tiny-v41-deep", "kvshare-mini-v41"])
def test_released_table_matches_model(name: str) -> None:
    from kvshare.model.deepseek import Transformer

    cfg = load_config(name)
    with torch.device("meta"):
        model = Transformer(cfg, quant=False)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == released_shapes(cfg)


def test_config_json_round_trips(cfg: ModelConfig, tmp_path: Path) -> None:
    d = hf_style_config(cfg)
    assert "kvshare_format" not in d and d["model_type"].startswith("deepseek_v4")
    save_checkpoint(random_state(cfg), cfg, tmp_path)
    assert ModelConfig.from_path(tmp_path) == cfg


@pytest.mark.parametrize("shard_bytes", [None, 20_000])
def test_state_round_trip(cfg: ModelConfig, tmp_path: Path, shard_bytes: int | None) -> None:
    sd = random_state(cfg)
    save_checkpoint(sd, cfg, tmp_path, shard_bytes=shard_bytes)
    if shard_bytes is not None:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
        assert not (tmp_path / "model.safetensors").exists()
    assert_same(load_checkpoint(tmp_path, cfg), sd)


def test_model_round_trip_same_logits(tmp_path: Path) -> None:
    cfg = load_config("tiny-v4")
    model = load_model("tiny-v4", quant=False)
    ids = torch.randint(0, cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(1))
    ref = _logits(model, ids)
    for shard in (None, 30_000):
        out = tmp_path / f"ckpt-{shard}"
        save_checkpoint(model, cfg, out, shard_bytes=shard)
        again = load_model(out, quant=False)
        assert torch.equal(_logits(again, ids), ref)


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    from kvshare.cache.dense import DenseCache

    batch = StepBatch.build([0], [ids.numel()])
    with torch.no_grad():
        return model.forward(ids, batch, DenseCache(model.cfg, model.topo, 1, ids.numel()))


def test_shipped_name_random_init_is_deterministic() -> None:
    a, b = load_model("tiny-v41", quant=False), load_model("tiny-v41", quant=False)
    assert_same(a.state_dict(), b.state_dict())


def test_fp8_block_scaled_weights_dequantise(tmp_path: Path) -> None:
    cfg = load_config("tiny-v4")  # no quantization_config: V4 default block 128 x 128
    sd = random_state(cfg)
    name = "layers.1.attn.wq_b.weight"  # [64, 16]: partial blocks
    q, s = wq.quantize_fp8_weight(sd[name], (128, 128))
    assert s.dtype == torch.float8_e8m0fnu and tuple(s.shape) == (1, 1)
    want = q.float() * s.float()
    # A 2-D block case with several tiles and fp32 (non-power-of-two) scales, built by hand.
    wname = "layers.0.attn.wo_b.weight"  # [32, 32]
    cfg32 = ModelConfig.from_dict({**cfg.to_dict(), "act_quant_block": 8})
    q2, s2 = wq.quantize_fp8_weight(sd[wname], (8, 8), ue8m0=False)
    assert s2.dtype == torch.float32 and tuple(s2.shape) == (4, 4)
    want2 = q2.float() * s2.repeat_interleave(8, 0).repeat_interleave(8, 1)
    ck = dict(sd)
    ck[name], ck[name.replace(".weight", ".scale")] = q, s
    save_file(ck, str(tmp_path / "model.safetensors"))
    got = load_checkpoint(tmp_path, cfg)
    assert torch.equal(got[name], want)
    assert (got[name] - sd[name]).abs().max() <= sd[name].abs().max() / 8
    ck[name.replace(".weight", ".weight_scale_inv")] = ck.pop(name.replace(".weight", ".scale")).float()
    save_file(ck, str(tmp_path / "model.safetensors"))
    assert torch.equal(load_checkpoint(tmp_path, cfg)[name], want)
    ck2 = dict(random_state(cfg32))
    ck2[wname], ck2[wname.replace(".weight", ".scale")] = q2, s2
    save_file(ck2, str(tmp_path / "model.safetensors"))
    assert torch.equal(load_checkpoint(tmp_path, cfg32)[wname], want2)


def test_fp4_expert_weights_dequantise(tmp_path: Path) -> None:
    cfg = load_config("tiny-v41")
    sd = random_state(cfg)
    name = "layers.2.ffn.experts.3.w2.weight"  # [32, 32]
    packed, scale = wq.pack_fp4_weight(sd[name])
    assert packed.dtype == torch.int8 and tuple(packed.shape) == (32, 16) and tuple(scale.shape) == (32, 1)
    codes, s = fp4_codes(sd[name], 32, "ue8m0")
    # low nibble = even element, high nibble = odd element
    assert torch.equal(packed.view(torch.uint8)[:, 0] & 0xF, codes[:, 0])
    assert torch.equal(packed.view(torch.uint8)[:, 0] >> 4, codes[:, 1])
    want = fp4_dequant(codes, s, 32)
    ck = dict(sd)
    ck[name], ck[name.replace(".weight", ".scale")] = packed, scale
    save_file(ck, str(tmp_path / "model.safetensors"))
    got = load_checkpoint(tmp_path, cfg)
    assert torch.equal(got[name], want)
    ck[name] = packed.view(torch.uint8).view(torch.float4_e2m1fn_x2)
    ck[name.replace(".weight", ".scale")] = scale.float()
    save_file(ck, str(tmp_path / "model.safetensors"))
    assert torch.equal(load_checkpoint(tmp_path, cfg)[name], want)


def _write(tmp_path: Path, sd: dict[str, torch.Tensor]) -> Path:
    save_file(sd, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_missing_tensor_named(cfg: ModelConfig, tmp_path: Path) -> None:
    sd = random_state(cfg)
    del sd["layers.2.attn.compressor.wkv.weight"]
    with pytest.raises(CheckpointError, match=r"missing tensor `layers\.2\.attn\.compressor\.wkv\.weight`.*\[16, 32\]"):
        load_checkpoint(_write(tmp_path, sd), cfg)


def test_unexpected_tensor_named(cfg: ModelConfig, tmp_path: Path) -> None:
    sd = random_state(cfg)
    sd["layers.0.attn.compressor.wkv.weight"] = torch.zeros(16, 32)
    with pytest.raises(CheckpointError, match=r"unexpected tensor `layers\.0\.attn\.compressor\.wkv\.weight`"):
        load_checkpoint(_write(tmp_path, sd), cfg)


def test_misshaped_tensor_named(cfg: ModelConfig, tmp_path: Path) -> None:
    sd = random_state(cfg)
    sd["layers.3.attn.wq_b.weight"] = torch.zeros(60, 16)
    with pytest.raises(CheckpointError, match=r"`layers\.3\.attn\.wq_b\.weight` has shape \[60, 16\], expected \[64, 16\]"):
        load_checkpoint(_write(tmp_path, sd), cfg)


def test_fp8_without_scale_refused(tmp_path: Path) -> None:
    cfg = load_config("tiny-v4")
    sd = random_state(cfg)
    sd["layers.0.attn.wq_a.weight"] = sd["layers.0.attn.wq_a.weight"].to(torch.float8_e4m3fn)
    with pytest.raises(CheckpointError, match=r"`layers\.0\.attn\.wq_a\.weight` is quantised"):
        load_checkpoint(_write(tmp_path, sd), cfg)


def test_draft_and_vision_tensors_skipped_with_one_notice(cfg: ModelConfig, tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    sd = random_state(cfg)
    extra = {"mtp.0.attn.wq_a.weight": torch.zeros(16, 32), "mtp.0.ffn.gate.weight": torch.zeros(4, 32),
             "vision.patch_embed.weight": torch.zeros(4, 4)}
    with caplog.at_level(logging.WARNING, logger="kvshare.weights.loader"):
        got = load_checkpoint(_write(tmp_path, {**sd, **extra}), cfg)
    assert_same(got, sd)
    notes = [r.getMessage() for r in caplog.records if r.name == "kvshare.weights.loader"]
    assert len(notes) == 1 and "2 draft" in notes[0] and "1 vision" in notes[0]


def test_transformers_naming_loads(tmp_path: Path) -> None:
    cfg = load_config("tiny-v4")
    sd = random_state(cfg)
    hf = kvshare_to_transformers(sd, cfg)
    assert "model.layers.1.mlp.experts.gate_up_proj" in hf
    assert tuple(hf["model.layers.1.mlp.experts.gate_up_proj"].shape) == (4, 64, 32)
    assert_same(transformers_to_kvshare(hf, cfg), {k: v.long() if k.endswith("tid2eid") else v
                                                  for k, v in sd.items()})
    save_file({**hf, "mtp.0.norm.weight": torch.ones(32)}, str(tmp_path / "model.safetensors"))
    got = load_checkpoint(tmp_path, cfg)
    assert_same(got, {k: v.long() if k.endswith("tid2eid") else v for k, v in sd.items()})


def test_load_model_from_transformers_named_directory(tmp_path: Path) -> None:
    cfg = load_config("tiny-v4")
    ref = load_model("tiny-v4", quant=False)
    (tmp_path / "config.json").write_text(json.dumps(hf_style_config(cfg)))
    save_file(kvshare_to_transformers(ref.state_dict(), cfg), str(tmp_path / "model.safetensors"))
    got = load_model(tmp_path, quant=False)
    assert_same(got.state_dict(), ref.state_dict())
