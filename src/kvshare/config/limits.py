"""Size limits with no sane meaning beyond them, refused before anything is allocated.

A config may be well-formed and still absurd (``vocab_size`` 1e12, ``hidden_size`` 1e6,
``num_hidden_layers`` 1e4, ``hc_sinkhorn_iters`` 1e9): building its model would allocate
terabytes or loop for hours before the checkpoint's shapes are even compared. Each bound is
far above every released model (DeepSeek-V4-Pro: vocab 129,280, hidden 7,168, 61 layers,
128 heads, 384 experts, 20 Sinkhorn iterations, 1M positions), so only broken configs meet it.
"""

from __future__ import annotations

from typing import Any

from kvshare.errors import ConfigError

#: `config.model.ModelConfig`, which imports this module: named, not imported (no import cycle, even type-only)
ModelConfig = Any

# field -> largest accepted value
SIZE_LIMITS: dict[str, int] = {
    "vocab_size": 2**22,  # 4.2M ids; the largest released vocabularies are ~256K
    "hidden_size": 2**16,
    "num_hidden_layers": 1024,
    "num_attention_heads": 4096,
    "head_dim": 4096,
    "qk_rope_head_dim": 4096,
    "q_lora_rank": 2**16,
    "o_lora_rank": 2**16,
    "o_groups": 4096,
    "sliding_window": 2**20,
    "index_n_heads": 4096,
    "index_head_dim": 4096,
    "index_topk": 2**20,
    "moe_intermediate_size": 2**18,
    "n_routed_experts": 2**14,
    "num_experts_per_tok": 2**14,
    "max_position_embeddings": 2**24,
    "hc_mult": 64,
    "hc_sinkhorn_iters": 10_000,
    "num_nextn_predict_layers": 64,
    "candidate_topk_blocks": 2**20,
    "candidate_block_size": 2**20,
}


def check_sizes(cfg: ModelConfig) -> None:
    """Raise ConfigError for the first size field above its limit (or not a number)."""
    for name, limit in SIZE_LIMITS.items():
        v = getattr(cfg, name, None)
        if v is None:
            continue
        if not isinstance(v, int) or isinstance(v, bool):
            raise ConfigError(f"must be an integer, got {v!r}", field=name)
        if v > limit:
            raise ConfigError(f"{v:,} is far beyond any real model (limit {limit:,}); the config is broken",
                              field=name, fix="check the value")
    if len(cfg.compress_ratios) > SIZE_LIMITS["num_hidden_layers"] + SIZE_LIMITS["num_nextn_predict_layers"]:
        raise ConfigError(f"has {len(cfg.compress_ratios):,} entries", field="compress_ratios",
                          fix="give one ratio per layer")
