"""Benchmark sizes (one dataclass, two presets) and the model configs built from them.

``BenchSizes`` holds every size knob; each field becomes a ``--flag`` of ``kvshare bench``
(underscores turned into dashes). ``QUICK`` is the smoke preset the tests run (seconds);
``FULL`` is sized so compute dominates Python overhead on a small CPU machine.

``peer_v4_config`` is a DeepSeek-V4 HF ``config.json`` dict (ratios 0 / 4 / 128), readable by
kvshare's ``ModelConfig`` and convertible for transformers' ``DeepseekV4ForCausalLM``.
``v41_config`` is a V4.1-shaped dict: two sliding-window layers, a ratio-2 stretch with a KV
source every third layer, then a ratio-1 stretch whose first layer is the last KV source and
the candidate source, with index sources every second layer after it (V4.1-Flash's pattern,
scaled down).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any


@dataclass
class BenchSizes:
    """Every size the benchmark uses. Lists are comma-separated on the command line."""

    hidden: int = 768
    heads: int = 8
    head_dim: int = 128
    rope_dim: int = 64
    q_lora: int = 256
    o_lora: int = 256
    o_groups: int = 2
    experts: int = 8
    experts_per_tok: int = 2
    moe_inter: int = 512
    vocab: int = 8192
    window: int = 64
    index_heads: int = 8
    index_dim: int = 64
    index_topk: int = 64
    peer_layers: int = 6
    v41_layers: int = 12
    candidate_blocks: int = 64
    candidate_block_size: int = 8
    prompt_len: int = 256
    new_tokens: int = 32
    batches: tuple[int, ...] = (1, 8)
    contexts: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384)
    context_steps: int = 12
    prefill_chunk: int = 256
    context_budget_s: int = 480
    sharing_context: int = 1024
    sharing_batch: int = 4
    pool_mib: int = 32
    block_size: int = 128
    copy_mib: int = 1024
    repeats: int = 2
    seed: int = 0
    prefill_head_dim: int = 512
    prefill_index_dim: int = 128
    prefill_index_topk: int = 512
    prefill_batch: int = 8

    def replace(self, **kw: Any) -> "BenchSizes":
        return dataclasses.replace(self, **kw)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


FULL = BenchSizes()

QUICK = BenchSizes(
    hidden=64, heads=4, head_dim=32, rope_dim=8, q_lora=32, o_lora=32, o_groups=2, experts=4,
    experts_per_tok=2, moe_inter=64, vocab=512, window=16, index_heads=4, index_dim=16, index_topk=8,
    peer_layers=4, v41_layers=8, candidate_blocks=4, candidate_block_size=4, prompt_len=16,
    new_tokens=4, batches=(1, 2), contexts=(64, 128), context_steps=2, prefill_chunk=128, context_budget_s=60,
    sharing_context=64, sharing_batch=2, pool_mib=1, block_size=128, copy_mib=16, repeats=1,
    prefill_head_dim=32, prefill_index_dim=16, prefill_index_topk=8, prefill_batch=2,
)


def peer_ratios(n_layers: int) -> list[int]:
    """V4 ratios: a sliding-window layer, then ratio 4 and 128 alternating (ratio 4 first)."""
    return [0] + [4 if i % 2 == 0 else 128 for i in range(n_layers - 1)]


def _common(s: BenchSizes) -> dict[str, Any]:
    max_pos = 1 << 17
    return {
        "vocab_size": s.vocab, "hidden_size": s.hidden, "moe_intermediate_size": s.moe_inter,
        "num_attention_heads": s.heads, "num_key_value_heads": 1, "head_dim": s.head_dim,
        "qk_rope_head_dim": s.rope_dim, "q_lora_rank": s.q_lora, "o_lora_rank": s.o_lora,
        "o_groups": s.o_groups, "swiglu_limit": 10.0, "rms_norm_eps": 1e-6,
        "rope_theta": 10000, "compress_rope_theta": 160000,
        "rope_scaling": {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": max_pos // 4,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": max_pos, "n_routed_experts": s.experts, "n_shared_experts": 1,
        "num_experts_per_tok": s.experts_per_tok, "scoring_func": "sqrtsoftplus", "norm_topk_prob": True,
        "routed_scaling_factor": 1.5, "sliding_window": s.window, "index_n_heads": s.index_heads,
        "index_head_dim": s.index_dim, "index_topk": s.index_topk, "hc_mult": 4, "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6, "bos_token_id": None, "eos_token_id": None, "tie_word_embeddings": False,
        "num_nextn_predict_layers": 0,
    }


def peer_v4_config(s: BenchSizes) -> dict[str, Any]:
    """A DeepSeek-V4 HF config dict for the peer comparison (no MTP layer, one hash-MoE layer)."""
    d = _common(s)
    d.update({"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
              "num_hidden_layers": s.peer_layers, "compress_ratios": peer_ratios(s.peer_layers),
              "num_hash_layers": 1})
    return d


def released_attention_config(s: BenchSizes) -> dict[str, Any]:
    """The peer V4 config with the released attention sizes (head_dim 512, 128-dim index keys,
    top-512 by default): the model issue 19's prefill targets are stated on."""
    return peer_v4_config(s.replace(head_dim=s.prefill_head_dim, index_dim=s.prefill_index_dim,
                                    index_topk=s.prefill_index_topk))


def v41_layout(n_layers: int) -> dict[str, Any]:
    """Ratios and source ids of a V4.1-shaped stack of `n_layers` (>= 6) layers."""
    if n_layers < 6:
        raise ValueError(f"a V4.1-shaped benchmark config needs at least 6 layers, got {n_layers}")
    m = 2 + (n_layers - 2) // 2  # first ratio-1 layer: last KV source and the candidate source
    ratios = [0, 0] + [2] * (m - 2) + [1] * (n_layers - m)
    kv = list(range(2, m, 3)) + [m]
    index = kv + list(range(m + 2, n_layers, 2))
    return {"compress_ratios": ratios, "kv_source_layer_ids": kv, "index_source_layer_ids": index,
            "candidate_source_layer_id": m}


def v41_config(s: BenchSizes) -> dict[str, Any]:
    """A V4.1-shaped HF config dict (see the module docstring)."""
    d = _common(s)
    d.update({"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
              "num_hidden_layers": s.v41_layers, "candidate_topk_blocks": s.candidate_blocks,
              "candidate_block_size": s.candidate_block_size, **v41_layout(s.v41_layers)})
    return d


def add_size_flags(parser: Any, defaults: BenchSizes = FULL) -> None:
    """Add one ``--flag`` per BenchSizes field (default None: the preset's value applies)."""
    g = parser.add_argument_group("sizes (defaults: the full preset; --quick for the smoke preset)")
    for f in fields(BenchSizes):
        flag = "--" + f.name.replace("_", "-")
        value = getattr(defaults, f.name)
        if isinstance(value, tuple):
            g.add_argument(flag, dest=f.name, default=None, metavar="N,N,..",
                           type=lambda t: tuple(int(x) for x in t.split(",") if x.strip()),
                           help=f"default {','.join(map(str, value))}")
        else:
            g.add_argument(flag, dest=f.name, default=None, type=int, metavar="N", help=f"default {value}")


def sizes_from_args(args: Any) -> BenchSizes:
    """The preset chosen by ``--quick`` with every size flag the user set applied on top."""
    base = QUICK if getattr(args, "quick", False) else FULL
    kw = {f.name: getattr(args, f.name) for f in fields(BenchSizes) if getattr(args, f.name, None) is not None}
    return base.replace(**kw)
