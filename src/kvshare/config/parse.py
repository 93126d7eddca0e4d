"""Reading a raw config dict into a ModelConfig: HF V4 / V4.1 names (with or without
`text_config` nesting, legacy and new ratio / rope fields) and DeepSeek's `inference/config.json`
names (`_REFERENCE_ALIASES`). `ModelConfig.from_dict` calls `parse_hf_or_reference`; every missing or
ill-typed field is a ConfigError naming it.
"""

from __future__ import annotations

from typing import Any

from kvshare.config.types import Arch, YarnConfig
from kvshare.errors import ConfigError

_V4_LAYER_TYPE_RATIO = {
    "sliding_attention": 0,
    "compressed_sparse_attention": 4,
    "heavily_compressed_attention": 128,
}

# DeepSeek `inference/config.json` (ModelArgs) name -> HF name.
_REFERENCE_ALIASES = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "moe_inter_dim": "moe_intermediate_size",
    "n_activated_experts": "num_experts_per_tok",
    "score_func": "scoring_func",
    "route_scale": "routed_scaling_factor",
    "rope_head_dim": "qk_rope_head_dim",
    "norm_eps": "rms_norm_eps",
    "window_size": "sliding_window",
    "n_hash_layers": "num_hash_layers",
    "n_mtp_layers": "num_nextn_predict_layers",
    "kv_source_layers": "kv_source_layer_ids",
    "index_source_layers": "index_source_layer_ids",
    "index_k_source_layers": "index_k_source_layer_ids",
    "candidate_source_layer": "candidate_source_layer_id",
    "max_seq_len": "max_position_embeddings",
    "engram_pad_id": "engram_pad_token_id",
    "dspark_n_activated_experts": "dspark_num_experts_per_tok",
}


# ---------------------------------------------------------------------------------


def _int_list(raw: dict[str, Any], name: str) -> tuple[int, ...]:
    v = raw.get(name)
    if v is None:
        return ()
    if isinstance(v, int):
        return (v,)
    if not isinstance(v, (list, tuple)) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise ConfigError(f"expected a list of integers, got {v!r}", field=name)
    return tuple(v)


def _req(raw: dict[str, Any], name: str, typ: type = int) -> Any:
    if name not in raw or raw[name] is None:
        raise ConfigError("is required but missing", field=name, fix=f"add `{name}` to config.json")
    v = raw[name]
    if typ is int and (not isinstance(v, int) or isinstance(v, bool)):
        raise ConfigError(f"expected an integer, got {v!r}", field=name)
    if typ is float and not isinstance(v, (int, float)):
        raise ConfigError(f"expected a number, got {v!r}", field=name)
    return v


def _detect_arch(raw: dict[str, Any]) -> Arch:
    mt = str(raw.get("model_type", "")).lower()
    if mt in ("deepseek_v41", "deepseek_v4_1"):
        return "v41"
    if mt == "deepseek_v4":
        return "v4"
    if "kv_source_layer_ids" in raw or "index_source_layer_ids" in raw:
        return "v41"
    ratios = raw.get("compress_ratios") or []
    if any(r in (1, 2) for r in ratios if isinstance(r, int)):
        return "v41"
    return "v4"


def _parse_rope(raw: dict[str, Any]) -> tuple[float, float, YarnConfig | None]:
    rope_theta = float(raw.get("rope_theta", 10000.0))
    compress_theta = float(raw.get("compress_rope_theta", 160000.0))
    scaling = raw.get("rope_scaling")
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("compress"), dict):
        main = params.get("main") or {}
        rope_theta = float(main.get("rope_theta", rope_theta))
        comp = params["compress"]
        compress_theta = float(comp.get("rope_theta", compress_theta))
        scaling = comp if comp.get("rope_type", comp.get("type")) == "yarn" else None
    yarn = None
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == "yarn":
        orig = scaling.get("original_max_position_embeddings")
        if not orig:
            raise ConfigError("yarn scaling needs original_max_position_embeddings", field="rope_scaling")
        yarn = YarnConfig(
            factor=float(scaling.get("factor", 1.0)),
            original_max_position_embeddings=int(orig),
            beta_fast=float(scaling.get("beta_fast", 32.0)),
            beta_slow=float(scaling.get("beta_slow", 1.0)),
        )
    elif "rope_factor" in raw and raw.get("original_seq_len", 0):
        yarn = YarnConfig(
            factor=float(raw["rope_factor"]),
            original_max_position_embeddings=int(raw["original_seq_len"]),
            beta_fast=float(raw.get("beta_fast", 32.0)),
            beta_slow=float(raw.get("beta_slow", 1.0)),
        )
    return rope_theta, compress_theta, yarn


def _parse_ratios(raw: dict[str, Any], n_layers: int, n_draft: int) -> tuple[int, ...]:
    if raw.get("compress_ratios") is not None:
        ratios = list(_int_list(raw, "compress_ratios"))
    elif raw.get("layer_types") is not None:
        rates = dict(raw.get("compress_rates") or {})
        table = {**_V4_LAYER_TYPE_RATIO, **{k: int(v) for k, v in rates.items()}}
        ratios = []
        for i, t in enumerate(raw["layer_types"]):
            if t not in table:
                raise ConfigError(f"unknown layer type {t!r}", field="layer_types", layer=i,
                                  fix=f"use one of {sorted(table)}")
            ratios.append(table[t])
    else:
        raise ConfigError("is required (or `layer_types`)", field="compress_ratios",
                          fix="add one compress ratio per layer")
    if len(ratios) < n_layers:
        raise ConfigError(f"has {len(ratios)} entries but num_hidden_layers is {n_layers}",
                          field="compress_ratios", fix="give one ratio per backbone layer")
    # Normalise to backbone + draft entries; missing draft entries are ratio 0 (SWA-only).
    ratios = ratios + [0] * max(0, n_layers + n_draft - len(ratios))
    return tuple(ratios)


def _eos(raw: dict[str, Any]) -> tuple[int, ...]:
    v = raw.get("eos_token_id", 1)
    if v is None:
        return ()
    return tuple(v) if isinstance(v, (list, tuple)) else (int(v),)


def _engram_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The `engram_*` sizes (spec/engram_dspark.md §1.1); absent fields are 0 / empty."""
    out: dict[str, Any] = {"engram_num_embeddings": _int_list(raw, "engram_num_embeddings")}
    for name in ("engram_max_ngram_size", "engram_vocab_size", "engram_n_heads", "engram_head_dim",
                 "engram_pad_token_id", "engram_compressed_vocab_size"):
        out[name] = _req(raw, name) if raw.get(name) is not None else 0
    return out
def _dspark_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The DSpark fields of a V4.1 config (absent: 0 / empty, i.e. no DSpark)."""
    return {
        "dspark_block_size": int(raw.get("dspark_block_size", 0) or 0),
        "dspark_noise_token_id": int(raw.get("dspark_noise_token_id", 0) or 0),
        "dspark_target_layer_ids": _int_list(raw, "dspark_target_layer_ids"),
        "dspark_markov_rank": int(raw.get("dspark_markov_rank", 0) or 0),
        "dspark_n_routed_experts": int(raw.get("dspark_n_routed_experts", 0) or 0),
        "dspark_num_experts_per_tok": int(raw.get("dspark_num_experts_per_tok", 0) or 0),
    }


def parse_hf_or_reference(raw: dict[str, Any]) -> dict[str, Any]:
    """`ModelConfig` keyword arguments from an HF or reference config dict (module doc)."""
    top = raw
    if isinstance(raw.get("text_config"), dict):
        raw = {**{k: v for k, v in top.items() if k != "text_config"}, **raw["text_config"]}
    raw = dict(raw)
    for old, new in _REFERENCE_ALIASES.items():
        if old in raw and new not in raw:
            raw[new] = raw[old]
    arch = _detect_arch(raw)

    n_layers = _req(raw, "num_hidden_layers")
    heads = _req(raw, "num_attention_heads")
    if "qk_rope_head_dim" not in raw and raw.get("partial_rotary_factor"):
        raw["qk_rope_head_dim"] = int(round(raw["partial_rotary_factor"] * raw.get("head_dim", 512)))
    n_draft_field = int(raw.get("num_nextn_predict_layers", 0) or 0)
    ratios_raw = raw.get("compress_ratios")
    n_draft = n_draft_field
    if isinstance(ratios_raw, list) and len(ratios_raw) > n_layers:
        n_draft = len(ratios_raw) - n_layers
    ratios = _parse_ratios(raw, n_layers, n_draft)

    num_hash = raw.get("num_hash_layers")
    if num_hash is None and isinstance(raw.get("mlp_layer_types"), list):
        num_hash = sum(1 for t in raw["mlp_layer_types"] if t == "hash_moe")
    if num_hash is None:
        num_hash = 3 if arch == "v4" and raw.get("model_type") == "deepseek_v4" else 0

    rope_theta, compress_theta, yarn = _parse_rope(raw)
    q_cfg = raw.get("quantization_config") or {}
    wbs = q_cfg.get("weight_block_size") if isinstance(q_cfg, dict) else None
    act_block = int(wbs[0]) if isinstance(wbs, list) and wbs else (32 if arch == "v41" else 128)

    engram = _int_list(raw, "engram_layer_ids")
    if not engram and raw.get("engram_layers") is not None:
        engram = _int_list(raw, "engram_layers")
    cand = raw.get("candidate_source_layer_id")
    extra = {k: v for k, v in top.items() if k in ("architectures", "model_type", "quantization_config")}
    return dict(
        arch=arch,
        vocab_size=_req(raw, "vocab_size"),
        hidden_size=_req(raw, "hidden_size"),
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        head_dim=_req(raw, "head_dim"),
        qk_rope_head_dim=_req(raw, "qk_rope_head_dim"),
        q_lora_rank=_req(raw, "q_lora_rank"),
        o_groups=_req(raw, "o_groups"),
        o_lora_rank=_req(raw, "o_lora_rank"),
        sliding_window=_req(raw, "sliding_window"),
        compress_ratios=ratios,
        index_n_heads=int(raw.get("index_n_heads", 0)),
        index_head_dim=int(raw.get("index_head_dim", 0)),
        index_topk=int(raw.get("index_topk", 0)),
        moe_intermediate_size=_req(raw, "moe_intermediate_size"),
        n_routed_experts=_req(raw, "n_routed_experts"),
        num_experts_per_tok=_req(raw, "num_experts_per_tok"),
        n_shared_experts=int(raw.get("n_shared_experts", 1)),
        rope_theta=rope_theta,
        compress_rope_theta=compress_theta,
        yarn=yarn,
        max_position_embeddings=int(raw.get("max_position_embeddings", 1048576)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        hc_mult=int(raw.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(raw.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(raw.get("hc_eps", 1e-6)),
        scoring_func=str(raw.get("scoring_func", "sqrtsoftplus")),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        swiglu_limit=float(raw.get("swiglu_limit", 0.0) or 0.0),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        gate_temp=float(raw.get("gate_temp", 1.0)),
        num_hash_layers=int(num_hash),
        num_nextn_predict_layers=n_draft_field,
        kv_source_layer_ids=_int_list(raw, "kv_source_layer_ids"),
        index_source_layer_ids=_int_list(raw, "index_source_layer_ids"),
        index_k_source_layer_ids=(_int_list(raw, "index_k_source_layer_ids")
                                  if raw.get("index_k_source_layer_ids") is not None else None),
        candidate_source_layer_id=int(cand) if cand is not None else -1,
        candidate_topk_blocks=int(raw.get("candidate_topk_blocks", 0) or 0),
        candidate_block_size=int(raw.get("candidate_block_size", 0) or 0),
        engram_layer_ids=engram,
        **_engram_fields(raw),
        **_dspark_fields(raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id", 0),
        eos_token_ids=_eos(raw),
        act_quant_block=act_block,
        extra=extra,
    )
