"""Tensor naming: DeepSeek's released checkpoint names (kvshare's own) and transformers' DeepSeek-V4.

* `released_shapes(cfg)`: every backbone tensor a checkpoint must hold, in the released naming,
  with its shape (spec/model.md §1.3). Draft (`mtp.*`) tensors are not part of the backbone.
* `transformers_to_kvshare` / `kvshare_to_transformers`: map the state dict of transformers 5.23
  `DeepseekV4ForCausalLM` (V4 only) to the released naming and back. All 1:1 tensors keep their
  shape (both sides store linears as [out, in]); routed experts are stacked in transformers:
  ``mlp.experts.gate_up_proj`` [E, 2I, D] = per expert ``cat(w1, w3)`` and ``mlp.experts.down_proj``
  [E, D, I] = per expert ``w2``. ``tid2eid`` is int64 in transformers.
* `transformers_config_dict(cfg)`: kwargs for transformers' `DeepseekV4Config`, quantisation off.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from kvshare.config import ModelConfig
from kvshare.errors import CheckpointError, ConfigError
from kvshare.topology import Topology

Shape = tuple[int, ...]

# (transformers name inside a decoder layer, released name inside a layer)
_LAYER_PAIRS: tuple[tuple[str, str], ...] = (
    ("input_layernorm.weight", "attn_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("attn_hc.fn", "hc_attn_fn"),
    ("attn_hc.base", "hc_attn_base"),
    ("attn_hc.scale", "hc_attn_scale"),
    ("ffn_hc.fn", "hc_ffn_fn"),
    ("ffn_hc.base", "hc_ffn_base"),
    ("ffn_hc.scale", "hc_ffn_scale"),
    ("self_attn.q_a_proj.weight", "attn.wq_a.weight"),
    ("self_attn.q_a_norm.weight", "attn.q_norm.weight"),
    ("self_attn.q_b_proj.weight", "attn.wq_b.weight"),
    ("self_attn.kv_proj.weight", "attn.wkv.weight"),
    ("self_attn.kv_norm.weight", "attn.kv_norm.weight"),
    ("self_attn.o_a_proj.weight", "attn.wo_a.weight"),
    ("self_attn.o_b_proj.weight", "attn.wo_b.weight"),
    ("self_attn.sinks", "attn.attn_sink"),
    ("self_attn.compressor.kv_proj.weight", "attn.compressor.wkv.weight"),
    ("self_attn.compressor.gate_proj.weight", "attn.compressor.wgate.weight"),
    ("self_attn.compressor.kv_norm.weight", "attn.compressor.norm.weight"),
    ("self_attn.compressor.position_bias", "attn.compressor.ape"),
    ("self_attn.compressor.indexer.kv_proj.weight", "attn.indexer.compressor.wkv.weight"),
    ("self_attn.compressor.indexer.gate_proj.weight", "attn.indexer.compressor.wgate.weight"),
    ("self_attn.compressor.indexer.kv_norm.weight", "attn.indexer.compressor.norm.weight"),
    ("self_attn.compressor.indexer.position_bias", "attn.indexer.compressor.ape"),
    ("self_attn.compressor.indexer.q_b_proj.weight", "attn.indexer.wq_b.weight"),
    ("self_attn.compressor.indexer.scorer.weights_proj.weight", "attn.indexer.weights_proj.weight"),
    ("mlp.gate.weight", "ffn.gate.weight"),
    ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
    ("mlp.gate.tid2eid", "ffn.gate.tid2eid"),
    ("mlp.shared_experts.gate_proj.weight", "ffn.shared_experts.w1.weight"),
    ("mlp.shared_experts.up_proj.weight", "ffn.shared_experts.w3.weight"),
    ("mlp.shared_experts.down_proj.weight", "ffn.shared_experts.w2.weight"),
)
_TOP_PAIRS: tuple[tuple[str, str], ...] = (
    ("model.embed_tokens.weight", "embed.weight"),
    ("model.norm.weight", "norm.weight"),
    ("lm_head.weight", "head.weight"),
    ("model.hc_head.hc_fn", "hc_head_fn"),
    ("model.hc_head.hc_base", "hc_head_base"),
    ("model.hc_head.hc_scale", "hc_head_scale"),
)
_HF_TO_REL_LAYER = dict(_LAYER_PAIRS)
_REL_TO_HF_LAYER = {r: h for h, r in _LAYER_PAIRS}
_HF_TO_REL_TOP = dict(_TOP_PAIRS)
_REL_TO_HF_TOP = {r: h for h, r in _TOP_PAIRS}
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_REL_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_EXPERTS = re.compile(r"^mlp\.experts\.(gate_up_proj|down_proj)$")
_REL_EXPERT = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])\.weight$")


def is_transformers_naming(names: list[str] | tuple[str, ...] | Any) -> bool:
    """Whether a checkpoint's tensor names follow transformers (``model.layers...``, ``lm_head``)."""
    return any(n.startswith(("model.", "lm_head.")) for n in names)


def released_shapes(cfg: ModelConfig, topo: Topology | None = None) -> dict[str, Shape]:
    """Every backbone tensor in the released naming with its shape (no `mtp.*`, no Engram)."""
    topo = topo or Topology(cfg)
    d, h, hd, hc = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.hc_mult
    e, inter, di = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.index_head_dim
    mix = (2 + hc) * hc
    out: dict[str, Shape] = {"embed.weight": (cfg.vocab_size, d), "norm.weight": (d,),
                             "head.weight": (cfg.vocab_size, d)}
    if cfg.arch == "v4":
        out.update({"hc_head_fn": (hc, hc * d), "hc_head_base": (hc,), "hc_head_scale": (1,)})
    for layer in range(cfg.num_hidden_layers):
        p, plan = f"layers.{layer}.", topo[layer]
        t: dict[str, Shape] = {
            "attn_norm.weight": (d,), "ffn_norm.weight": (d,),
            "attn.wq_a.weight": (cfg.q_lora_rank, d), "attn.q_norm.weight": (cfg.q_lora_rank,),
            "attn.wq_b.weight": (h * hd, cfg.q_lora_rank), "attn.wkv.weight": (hd, d),
            "attn.kv_norm.weight": (hd,), "attn.attn_sink": (h,),
            "attn.wo_a.weight": (cfg.o_groups * cfg.o_lora_rank, h * hd // cfg.o_groups),
            "attn.wo_b.weight": (d, cfg.o_groups * cfg.o_lora_rank),
            "ffn.gate.weight": (e, d),
        }
        for s in ("attn", "ffn"):
            t.update({f"hc_{s}_fn": (mix, hc * d), f"hc_{s}_base": (mix,), f"hc_{s}_scale": (3,)})
        if layer < cfg.num_hash_layers:
            t["ffn.gate.tid2eid"] = (cfg.vocab_size, cfg.num_experts_per_tok)
        else:
            t["ffn.gate.bias"] = (e,)
        for w, shp in (("w1", (inter, d)), ("w3", (inter, d)), ("w2", (d, inter))):
            t[f"ffn.shared_experts.{w}.weight"] = shp
            for x in range(e):
                t[f"ffn.experts.{x}.{w}.weight"] = shp
        r = plan.ratio
        if cfg.arch == "v4" and r > 0:
            coff = 2 if r == 4 else 1
            t.update(_v4_compressor("attn.compressor.", d, hd, r, coff))
            if plan.is_index_source:
                t.update(_v4_compressor("attn.indexer.compressor.", d, di, r, 2))
        if cfg.arch == "v41" and r > 0 and plan.is_kv_source:
            t.update({"attn.compressor.wkv.weight": (hd, d), "attn.compressor.norm.weight": (hd,)})
            if r > 1:
                t["attn.compressor.wgate.weight"] = (hd, d)
        if plan.is_index_source:
            t.update({"attn.indexer.wq_b.weight": (cfg.index_n_heads * di, cfg.q_lora_rank),
                      "attn.indexer.weights_proj.weight": (cfg.index_n_heads, d)})
        if cfg.arch == "v41" and plan.is_index_k_source:
            t.update({"attn.indexer.wk.weight": (di, hd), "attn.indexer.k_norm.weight": (di,)})
        out.update({p + k: v for k, v in t.items()})
    return out


def _v4_compressor(prefix: str, d: int, width: int, ratio: int, coff: int) -> dict[str, Shape]:
    return {prefix + "wkv.weight": (coff * width, d), prefix + "wgate.weight": (coff * width, d),
            prefix + "norm.weight": (width,), prefix + "ape": (ratio, coff * width)}


def transformers_to_kvshare(hf_state_dict: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Map a transformers `DeepseekV4ForCausalLM` state dict to the released naming.

    Unknown names raise CheckpointError (rotary `inv_freq` buffers are dropped)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in hf_state_dict.items():
        if name.endswith("inv_freq"):
            continue
        if name in _HF_TO_REL_TOP:
            out[_HF_TO_REL_TOP[name]] = t
            continue
        m = _HF_LAYER.match(name)
        if m is None:
            raise CheckpointError(f"unknown transformers tensor `{name}`: no released-name equivalent")
        layer, rest = m.group(1), m.group(2)
        if rest in _HF_TO_REL_LAYER:
            out[f"layers.{layer}.{_HF_TO_REL_LAYER[rest]}"] = t
            continue
        em = _HF_EXPERTS.match(rest)
        if em is None:
            raise CheckpointError(f"unknown transformers tensor `{name}`: no released-name equivalent")
        for x in range(t.shape[0]):
            p = f"layers.{layer}.ffn.experts.{x}."
            if em.group(1) == "down_proj":
                out[p + "w2.weight"] = t[x]
            else:
                if t.shape[1] % 2:
                    raise CheckpointError(f"`{name}` has odd gate_up width {t.shape[1]}; expected 2 * "
                                          f"moe_intermediate_size = {2 * cfg.moe_intermediate_size}")
                w1, w3 = t[x].chunk(2, dim=0)
                out[p + "w1.weight"], out[p + "w3.weight"] = w1, w3
    return out


def kvshare_to_transformers(state_dict: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Map a released-naming state dict to transformers' `DeepseekV4ForCausalLM` names (V4 only).

    `mtp.*` tensors are dropped (transformers has no draft layers); other unknown names raise."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, t in state_dict.items():
        if name.startswith("mtp."):
            continue
        if name in _REL_TO_HF_TOP:
            out[_REL_TO_HF_TOP[name]] = t
            continue
        m = _REL_LAYER.match(name)
        if m is None or int(m.group(1)) >= cfg.num_hidden_layers:
            raise CheckpointError(f"tensor `{name}` has no transformers equivalent")
        layer, rest = int(m.group(1)), m.group(2)
        if rest in _REL_TO_HF_LAYER:
            v = t.long() if rest == "ffn.gate.tid2eid" else t
            out[f"model.layers.{layer}.{_REL_TO_HF_LAYER[rest]}"] = v
            continue
        em = _REL_EXPERT.match(rest)
        if em is None:
            raise CheckpointError(f"tensor `{name}` has no transformers equivalent (transformers 5.23 "
                                  "models DeepSeek-V4 only)")
        experts.setdefault((layer, em.group(2)), {})[int(em.group(1))] = t
    for layer in range(cfg.num_hidden_layers):
        parts = {w: experts.get((layer, w), {}) for w in ("w1", "w2", "w3")}
        if not any(parts.values()):
            continue
        for w, got in parts.items():
            missing = [x for x in range(cfg.n_routed_experts) if x not in got]
            if missing:
                raise CheckpointError(f"missing tensor `layers.{layer}.ffn.experts.{missing[0]}.{w}.weight`")
        p = f"model.layers.{layer}.mlp.experts."
        n = cfg.n_routed_experts
        out[p + "gate_up_proj"] = torch.stack([torch.cat([parts["w1"][x], parts["w3"][x]], 0) for x in range(n)])
        out[p + "down_proj"] = torch.stack([parts["w2"][x] for x in range(n)])
    return out


_V4_LAYER_TYPE = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}


def transformers_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """Kwargs for transformers' `DeepseekV4Config` describing `cfg` (quantisation off, eager attention).

    Notes: the compress rope gets ``attention_factor = 1.0`` explicitly (a nested `rope_parameters`
    without it makes transformers apply YaRN's mscale 0.1 ln(factor) + 1); ``swiglu_limit`` 0 (off)
    becomes +inf. transformers always renormalises the routing weights (``/ (sum + 1e-20)``), so
    ``norm_topk_prob=False`` and ``gate_temp != 1`` cannot be expressed and raise."""
    if cfg.arch != "v4":
        raise ConfigError("transformers 5.23 has no DeepSeek-V4.1 model (spec/model.md §12 item 3)",
                          field="model_type", fix="compare V4 configs only")
    if not cfg.norm_topk_prob or cfg.gate_temp != 1.0:
        raise ConfigError("transformers always renormalises routing weights at temperature 1",
                          field="norm_topk_prob" if not cfg.norm_topk_prob else "gate_temp")
    n = cfg.num_hidden_layers
    prf = cfg.qk_rope_head_dim / cfg.head_dim
    main = {"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": prf}
    comp: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.compress_rope_theta,
                            "partial_rotary_factor": prf}
    if cfg.yarn is not None:
        comp.update(rope_type="yarn", factor=cfg.yarn.factor, attention_factor=1.0,
                    original_max_position_embeddings=cfg.yarn.original_max_position_embeddings,
                    beta_fast=cfg.yarn.beta_fast, beta_slow=cfg.yarn.beta_slow)
    eos = list(cfg.eos_token_ids)
    return dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, moe_intermediate_size=cfg.moe_intermediate_size,
        num_hidden_layers=n, num_attention_heads=cfg.num_attention_heads, num_key_value_heads=1,
        head_dim=cfg.head_dim, q_lora_rank=cfg.q_lora_rank, partial_rotary_factor=prf,
        num_experts_per_tok=cfg.num_experts_per_tok, n_routed_experts=cfg.n_routed_experts,
        n_shared_experts=cfg.n_shared_experts, scoring_func=cfg.scoring_func, norm_topk_prob=True,
        routed_scaling_factor=cfg.routed_scaling_factor, max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta, compress_rope_theta=cfg.compress_rope_theta,
        rope_parameters={"main": main, "compress": comp},
        layer_types=[_V4_LAYER_TYPE[r] for r in cfg.compress_ratios[:n]],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        mlp_layer_types=["hash_moe" if i < cfg.num_hash_layers else "moe" for i in range(n)],
        hc_mult=cfg.hc_mult, hc_sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps,
        swiglu_limit=cfg.swiglu_limit if cfg.swiglu_limit > 0 else float("inf"),
        sliding_window=cfg.sliding_window, o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank,
        index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk,
        num_nextn_predict_layers=cfg.num_draft_layers, rms_norm_eps=cfg.rms_norm_eps,
        bos_token_id=cfg.bos_token_id, eos_token_id=(eos[0] if len(eos) == 1 else (eos or None)),
        pad_token_id=None, tie_word_embeddings=cfg.tie_word_embeddings, hidden_act="silu",
    )
