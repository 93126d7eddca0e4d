"""Shape rules every ModelConfig must satisfy (spec/model.md §10; source-map rules live in topology.py).

Checked at construction: positive sizes, even rope dims that fit the head, heads divisible by
o_groups, one shared expert, ratios allowed for the architecture, draft entries 0.
"""

from __future__ import annotations

import math
from typing import Any

from kvshare.config.engram import validate_engram
from kvshare.config.limits import check_sizes
from kvshare.errors import ConfigError

#: `config.model.ModelConfig`, which imports this module: named, not imported (no import cycle, even type-only)
ModelConfig = Any

V4_RATIOS = frozenset({0, 4, 128})
V41_RATIOS = frozenset({0, 1, 2})

def _positive(cfg: ModelConfig, *names: str) -> None:
    for n in names:
        v = getattr(cfg, n)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"must be a positive integer, got {v!r}", field=n)


def validate_config(cfg: ModelConfig) -> None:
    """Raise ConfigError naming the field (and layer) of the first rule `cfg` breaks."""
    if cfg.arch not in ("v4", "v41"):
        raise ConfigError(f"unknown architecture {cfg.arch!r}", field="model_type",
                          fix="use deepseek_v4 or deepseek_v41")
    check_sizes(cfg)  # absurd sizes first: later rules (and any allocation) assume sane ones
    _positive(cfg, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
              "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window",
              "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "hc_mult")
    if cfg.qk_rope_head_dim % 2 or cfg.qk_rope_head_dim > cfg.head_dim:
        raise ConfigError(f"{cfg.qk_rope_head_dim} must be even and at most head_dim {cfg.head_dim}",
                          field="qk_rope_head_dim")
    if cfg.num_attention_heads % cfg.o_groups:
        raise ConfigError(f"num_attention_heads {cfg.num_attention_heads} is not divisible by o_groups "
                          f"{cfg.o_groups}", field="o_groups", fix="choose o_groups dividing the head count")
    if cfg.n_shared_experts != 1:
        raise ConfigError(f"exactly one shared expert is supported, got {cfg.n_shared_experts}",
                          field="n_shared_experts")
    if cfg.num_experts_per_tok > cfg.n_routed_experts:
        raise ConfigError(f"{cfg.num_experts_per_tok} exceeds n_routed_experts {cfg.n_routed_experts}",
                          field="num_experts_per_tok")
    if cfg.scoring_func not in ("sqrtsoftplus", "softmax", "sigmoid"):
        raise ConfigError(f"unknown scoring function {cfg.scoring_func!r}", field="scoring_func",
                          fix="use sqrtsoftplus, softmax or sigmoid")
    if not 0 <= cfg.num_hash_layers <= cfg.num_hidden_layers:
        raise ConfigError(f"{cfg.num_hash_layers} is outside [0, num_hidden_layers]", field="num_hash_layers")
    if cfg.rms_norm_eps < 0 or cfg.hc_eps < 0:
        raise ConfigError("eps values must be non-negative", field="rms_norm_eps")
    n = cfg.num_hidden_layers
    if len(cfg.compress_ratios) < n:
        raise ConfigError(f"has {len(cfg.compress_ratios)} entries but num_hidden_layers is {n}",
                          field="compress_ratios", fix="give one ratio per backbone layer")
    allowed = V41_RATIOS if cfg.arch == "v41" else V4_RATIOS
    for i, r in enumerate(cfg.compress_ratios):
        if i >= n:
            if r != 0:
                raise ConfigError(f"draft (MTP/DSpark) entry has ratio {r}; draft layers are sliding-window only",
                                  field="compress_ratios", layer=i, fix="set draft entries to 0")
            continue
        if r not in allowed:
            raise ConfigError(f"ratio {r} is not valid for {cfg.arch} (allowed: {sorted(allowed)})",
                              field="compress_ratios", layer=i,
                              fix="V4 uses 0/4/128, V4.1 uses 0/1/2")
    if any(r > 0 for r in cfg.compress_ratios[:n]):
        _positive(cfg, "index_head_dim")
        if any(r != 128 for r in cfg.compress_ratios[:n] if r > 0):
            _positive(cfg, "index_n_heads", "index_topk")
        if cfg.index_head_dim < cfg.qk_rope_head_dim:
            raise ConfigError(f"{cfg.index_head_dim} is smaller than qk_rope_head_dim {cfg.qk_rope_head_dim}",
                              field="index_head_dim")
    if cfg.act_quant_block <= 0 or cfg.act_quant_block & (cfg.act_quant_block - 1):
        raise ConfigError(f"{cfg.act_quant_block} must be a power of two", field="quantization_config.weight_block_size")
    if cfg.yarn is not None and (cfg.yarn.factor <= 0 or math.isnan(cfg.yarn.factor)):
        raise ConfigError("yarn factor must be positive", field="rope_scaling")
    validate_engram(cfg)
    validate_dspark(cfg)


def validate_dspark(cfg: ModelConfig) -> None:
    """DSpark fields (spec engram_dspark.md §2.1), checked when the config has draft stages and a block size."""
    if cfg.num_nextn_predict_layers <= 0 or cfg.dspark_block_size <= 0:
        return
    if cfg.arch != "v41":
        raise ConfigError("DSpark draft stages are a V4.1 feature", field="dspark_block_size")
    _positive(cfg, "dspark_markov_rank")
    targets = cfg.dspark_target_layer_ids
    if not targets:
        raise ConfigError("is empty; DSpark taps at least one backbone layer", field="dspark_target_layer_ids")
    for t in targets:
        if not 0 <= t < cfg.num_hidden_layers:
            raise ConfigError(f"layer {t} is not a backbone layer (0..{cfg.num_hidden_layers - 1})",
                              field="dspark_target_layer_ids", layer=t)
    if not 0 <= cfg.dspark_noise_token_id < cfg.vocab_size:
        raise ConfigError(f"{cfg.dspark_noise_token_id} is not a token id in [0, {cfg.vocab_size})",
                          field="dspark_noise_token_id")
    n_exp = cfg.dspark_n_routed_experts or cfg.n_routed_experts
    k = cfg.dspark_num_experts_per_tok or cfg.num_experts_per_tok
    if not 1 <= k <= n_exp:
        raise ConfigError(f"{k} is not in [1, {n_exp}] (the stage's routed experts)",
                          field="dspark_num_experts_per_tok")
