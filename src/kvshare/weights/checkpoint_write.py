"""Writing checkpoints: kvshare's own (released naming) and transformers' (for `from_pretrained`).

* `save_checkpoint(model_or_state_dict, cfg, out_dir, shard_bytes=None)`: ``config.json`` (HF style,
  read back by `ModelConfig.from_dict` to an equal config) + safetensors in the released naming
  (`kvshare.weights.loader.load_model` reads it back).
* `export_transformers(model_or_state_dict, cfg, out_dir, ...)`: a V4 checkpoint for transformers 5.23
  (its config.json, the names its `save_pretrained` writes); `kvshare convert --to transformers`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvshare.config import ModelConfig
from kvshare.errors import ConfigError
from kvshare.weights.checkpoint_files import INDEX_FILE, SINGLE_FILE
from kvshare.weights.hf_naming import (TRANSFORMERS_NAMINGS, is_transformers_naming, kvshare_to_transformers,
                                     transformers_config_dict, transformers_to_kvshare)

#: the activation block each architecture assumes when ``quantization_config`` is absent
DEFAULT_BLOCK = {"v4": 128, "v41": 32}

def hf_style_config(cfg: ModelConfig) -> dict:
    """An HF-style config dict (model_type, rope_scaling, eos_token_id, ...) that
    `ModelConfig.from_dict` reads back to `cfg`; falls back to `cfg.to_dict()` where it would not."""
    d = {k: v for k, v in cfg.to_dict().items()
         if k not in ("arch", "yarn", "eos_token_ids", "act_quant_block", "kvshare_format")}
    v41 = cfg.arch == "v41"
    d["architectures"] = ["DeepseekV41ForCausalLM" if v41 else "DeepseekV4ForCausalLM"]
    d["model_type"] = "deepseek_v41" if v41 else "deepseek_v4"
    d["num_key_value_heads"] = 1
    d["eos_token_id"] = list(cfg.eos_token_ids) if cfg.eos_token_ids else None
    if cfg.yarn is not None:
        d["rope_scaling"] = {"rope_type": "yarn", "factor": cfg.yarn.factor, "beta_fast": cfg.yarn.beta_fast,
                             "beta_slow": cfg.yarn.beta_slow,
                             "original_max_position_embeddings": cfg.yarn.original_max_position_embeddings}
    if cfg.act_quant_block != DEFAULT_BLOCK[cfg.arch]:
        d["quantization_config"] = {"weight_block_size": [cfg.act_quant_block, cfg.act_quant_block]}
    try:
        if ModelConfig.from_dict(json.loads(json.dumps(d))) == cfg:
            return d
    except ConfigError:
        pass
    return cfg.to_dict()


def _released_state(model_or_state_dict: torch.nn.Module | dict[str, torch.Tensor],
                    cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The state dict of a model, or a state dict, in the released naming (transformers' names mapped)."""
    sd = model_or_state_dict.state_dict() if isinstance(model_or_state_dict, torch.nn.Module) \
        else dict(model_or_state_dict)
    return transformers_to_kvshare(sd, cfg) if is_transformers_naming(sd) else sd


def save_checkpoint(model_or_state_dict: torch.nn.Module | dict[str, torch.Tensor], cfg: ModelConfig,
                    out_dir: str | Path, shard_bytes: int | None = None) -> Path:
    """Write ``config.json`` and the weights (released naming) to `out_dir`; returns `out_dir`.

    `shard_bytes` None writes one ``model.safetensors``; otherwise shards of at most that many bytes
    (a larger single tensor gets its own shard) plus ``model.safetensors.index.json``."""
    sd = _released_state(model_or_state_dict, cfg)
    for layer, table in getattr(model_or_state_dict, "engram_tables", dict)().items():
        sd[f"layers.{layer}.engram.embed.weight"], sd[f"layers.{layer}.engram.embed.scale"] = table.to_tensors()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_style_config(cfg), indent=2) + "\n")
    return _write_weights(sd, out, shard_bytes)


def _write_weights(sd: dict[str, torch.Tensor], out: Path, shard_bytes: int | None) -> Path:
    """`sd` as ``model.safetensors``, or as shards of at most `shard_bytes` plus the index file."""
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in sd.items()}
    if shard_bytes is None:
        save_file(tensors, str(out / SINGLE_FILE), metadata={"format": "pt"})
        return out
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in tensors.items():
        nb = v.numel() * v.element_size()
        if shards[-1] and size + nb > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nb
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                             indent=2) + "\n")
    return out


def export_transformers(model_or_state_dict: torch.nn.Module | dict[str, torch.Tensor], cfg: ModelConfig,
                        out_dir: str | Path, shard_bytes: int | None = None,
                        naming: str = "transformers-saved") -> Path:
    """Write a checkpoint that transformers 5.23 `DeepseekV4ForCausalLM.from_pretrained` loads; returns `out_dir`.

    ``config.json`` is `transformers_config_dict(cfg)` plus ``architectures``, ``model_type`` and ``dtype``
    (that of the floating weights); ConfigError where transformers cannot express `cfg` (V4.1, unnormalised
    routing). Weights are written in `naming` (default: the names `save_pretrained` writes, so loading and
    re-saving with transformers reproduces the same files), draft tensors dropped, integer tensors
    (``tid2eid``) as int64 like transformers' buffers. Input in any naming `load_checkpoint` reads."""
    if naming not in TRANSFORMERS_NAMINGS:
        raise ValueError(f"naming must be one of {list(TRANSFORMERS_NAMINGS)}, got {naming!r}")
    hf_config = transformers_config_dict(cfg)
    sd = _released_state(model_or_state_dict, cfg)
    sd = {k: v if v.is_floating_point() else v.long() for k, v in kvshare_to_transformers(sd, cfg, naming).items()}
    dtype = next((v.dtype for v in sd.values() if v.is_floating_point()), torch.float32)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
              "dtype": str(dtype).removeprefix("torch."), **hf_config}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return _write_weights(sd, out, shard_bytes)
