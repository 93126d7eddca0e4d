"""Tensor naming: DeepSeek's released names (kvshare's own), transformers 5.23's DeepSeek-V4 names, shapes.

* `NAMINGS` and `_RULES`: the one table of name rules. Each row is one tensor kind written in every
  naming kvshare reads (``{L}`` = layer, ``{E}`` = routed expert; None: the naming has no such tensor):

  - ``released``: DeepSeek's checkpoints (``layers.3.attn.wkv.weight``, ``head.weight``); kvshare's own.
  - ``transformers``: `DeepseekV4ForCausalLM`'s in-memory `state_dict` (``model.layers.3.self_attn.kv_proj
    .weight``, ``lm_head.weight``); routed experts stacked (below).
  - ``transformers-saved``: what `save_pretrained` writes for a model built from a config or loaded from a
    released or saved checkpoint. transformers reverses its load-time renames (conversion_mapping.py,
    ``deepseek_v4``), so most names come out in the released spelling under ``model.``, except where a
    rename is anchored at the start (``model.embed_tokens``, ``model.hc_head.*``) and where the reversal of
    ``.norm. -> .kv_norm.`` turns ``kv_norm`` into ``norm`` (``model.layers.3.attn.norm.weight``).
  - ``transformers-resaved``: what `save_pretrained` writes for a model loaded from in-memory names (for
    example `export_transformers(..., naming="transformers")`): transformers reverses only the renames that
    fired at load, and ``.norm. -> .kv_norm.`` fires there on ``model.norm.weight``, so the in-memory names
    come back with ``kv_norm`` as ``norm``.

  These four are closed under transformers' load-then-save (checked by tests/test_hf_naming.py with
  transformers' own renaming code). A transformers name without ``{E}`` for a per-expert released name
  stacks the experts on dim 0; the row's `part` (i, n) says its released tensor is slice i of n equal
  slices along dim 1: ``gate_up_proj`` [E, 2I, D] = per expert ``cat(w1, w3)``, ``down_proj`` [E, D, I] = w2.
* `detect_naming(names)`: the first naming whose rules cover every name; otherwise CheckpointError naming
  every naming tried and the names it did not know. `to_released` / `from_released` map a state dict
  between a naming and the released one (values are not copied; stacking makes new tensors).
* `released_shapes(cfg)`: every backbone tensor a checkpoint must hold, in the released naming, with its
  shape (spec/model.md §1.3). Draft (`mtp.*`) tensors are not part of the backbone.
* `transformers_config_dict(cfg)`: kwargs for transformers' `DeepseekV4Config`, quantisation off.
"""

from __future__ import annotations

from typing import Any, Iterable, NamedTuple

import torch

from kvshare.config import ModelConfig
from kvshare.config.engram import engram_param_shapes
from kvshare.errors import CheckpointError, ConfigError
from kvshare.topology import Topology

Shape = tuple[int, ...]

NAMINGS: tuple[str, ...] = ("released", "transformers", "transformers-saved", "transformers-resaved")
TRANSFORMERS_NAMINGS = NAMINGS[1:]


class Rule(NamedTuple):
    """One tensor kind: its name template in each of `NAMINGS` (same order); `part` for stacked experts."""

    names: tuple[str | None, ...]
    part: tuple[int, int] = (0, 1)


def _r(released: str, transformers: str | None, saved: str | None, resaved: str | None,
       part: tuple[int, int] = (0, 1)) -> Rule:
    return Rule((released, transformers, saved, resaved), part)


def _layer(released: str, transformers: str | None, saved: str | None, resaved: str | None,
           part: tuple[int, int] = (0, 1)) -> Rule:
    """A rule for a tensor inside decoder layer {L}: released ``layers.{L}.``, transformers ``model.layers.{L}.``."""
    hf = [None if n is None else "model.layers.{L}." + n for n in (transformers, saved, resaved)]
    return _r("layers.{L}." + released, *hf, part=part)


_RULES: tuple[Rule, ...] = (
    # released        transformers (in memory)        save_pretrained                 re-saved after loading in-memory names
    _r("embed.weight",  "model.embed_tokens.weight",    "model.embed_tokens.weight",    "model.embed_tokens.weight"),
    _r("norm.weight",   "model.norm.weight",            "model.norm.weight",            "model.norm.weight"),
    _r("head.weight",   "lm_head.weight",               "head.weight",                  "lm_head.weight"),
    _r("hc_head_fn",    "model.hc_head.hc_fn",          "model.hc_head.hc_fn",          "model.hc_head.hc_fn"),
    _r("hc_head_base",  "model.hc_head.hc_base",        "model.hc_head.hc_base",        "model.hc_head.hc_base"),
    _r("hc_head_scale", "model.hc_head.hc_scale",       "model.hc_head.hc_scale",       "model.hc_head.hc_scale"),
    # inside layer {L}                  transformers (in memory)                 save_pretrained                 re-saved
    _layer("attn_norm.weight",          "input_layernorm.weight",                "attn_norm.weight",             "input_layernorm.weight"),
    _layer("ffn_norm.weight",           "post_attention_layernorm.weight",       "ffn_norm.weight",              "post_attention_layernorm.weight"),
    _layer("hc_attn_fn",                "attn_hc.fn",                            "hc_attn_fn",                   "attn_hc.fn"),
    _layer("hc_attn_base",              "attn_hc.base",                          "hc_attn_base",                 "attn_hc.base"),
    _layer("hc_attn_scale",             "attn_hc.scale",                         "hc_attn_scale",                "attn_hc.scale"),
    _layer("hc_ffn_fn",                 "ffn_hc.fn",                             "hc_ffn_fn",                    "ffn_hc.fn"),
    _layer("hc_ffn_base",               "ffn_hc.base",                           "hc_ffn_base",                  "ffn_hc.base"),
    _layer("hc_ffn_scale",              "ffn_hc.scale",                          "hc_ffn_scale",                 "ffn_hc.scale"),
    _layer("attn.wq_a.weight",          "self_attn.q_a_proj.weight",             "attn.wq_a.weight",             "self_attn.q_a_proj.weight"),
    _layer("attn.q_norm.weight",        "self_attn.q_a_norm.weight",             "attn.q_norm.weight",           "self_attn.q_a_norm.weight"),
    _layer("attn.wq_b.weight",          "self_attn.q_b_proj.weight",             "attn.wq_b.weight",             "self_attn.q_b_proj.weight"),
    _layer("attn.wkv.weight",           "self_attn.kv_proj.weight",              "attn.wkv.weight",              "self_attn.kv_proj.weight"),
    _layer("attn.kv_norm.weight",       "self_attn.kv_norm.weight",              "attn.norm.weight",             "self_attn.norm.weight"),
    _layer("attn.wo_a.weight",          "self_attn.o_a_proj.weight",             "attn.wo_a.weight",             "self_attn.o_a_proj.weight"),
    _layer("attn.wo_b.weight",          "self_attn.o_b_proj.weight",             "attn.wo_b.weight",             "self_attn.o_b_proj.weight"),
    _layer("attn.attn_sink",            "self_attn.sinks",                       "attn.attn_sink",               "self_attn.sinks"),
    _layer("attn.compressor.wkv.weight",   "self_attn.compressor.kv_proj.weight",   "attn.compressor.wkv.weight",
           "self_attn.compressor.kv_proj.weight"),
    _layer("attn.compressor.wgate.weight", "self_attn.compressor.gate_proj.weight", "attn.compressor.wgate.weight",
           "self_attn.compressor.gate_proj.weight"),
    _layer("attn.compressor.norm.weight",  "self_attn.compressor.kv_norm.weight",   "attn.compressor.norm.weight",
           "self_attn.compressor.norm.weight"),
    _layer("attn.compressor.ape",          "self_attn.compressor.position_bias",    "attn.compressor.ape",
           "self_attn.compressor.position_bias"),
    _layer("attn.indexer.compressor.wkv.weight",   "self_attn.compressor.indexer.kv_proj.weight",
           "attn.indexer.compressor.wkv.weight",   "self_attn.compressor.indexer.kv_proj.weight"),
    _layer("attn.indexer.compressor.wgate.weight", "self_attn.compressor.indexer.gate_proj.weight",
           "attn.indexer.compressor.wgate.weight", "self_attn.compressor.indexer.gate_proj.weight"),
    _layer("attn.indexer.compressor.norm.weight",  "self_attn.compressor.indexer.kv_norm.weight",
           "attn.indexer.compressor.norm.weight",  "self_attn.compressor.indexer.norm.weight"),
    _layer("attn.indexer.compressor.ape",          "self_attn.compressor.indexer.position_bias",
           "attn.indexer.compressor.ape",          "self_attn.compressor.indexer.position_bias"),
    _layer("attn.indexer.wq_b.weight",             "self_attn.compressor.indexer.q_b_proj.weight",
           "attn.indexer.wq_b.weight",             "self_attn.compressor.indexer.q_b_proj.weight"),
    _layer("attn.indexer.weights_proj.weight",     "self_attn.compressor.indexer.scorer.weights_proj.weight",
           "attn.indexer.weights_proj.weight",     "self_attn.compressor.indexer.scorer.weights_proj.weight"),
    _layer("attn.indexer.wk.weight",    None, None, None),  # V4.1 only: transformers 5.23 has no V4.1 model
    _layer("attn.indexer.k_norm.weight", None, None, None),  # V4.1 only
    _layer("engram.wkv.weight",         None, None, None),  # V4.1 Engram (its tables are read by engram_table.py)
    _layer("engram.q_weight",           None, None, None),  # V4.1 Engram
    _layer("engram.k_weight",           None, None, None),  # V4.1 Engram
    _layer("ffn.gate.weight",           "mlp.gate.weight",                       "ffn.gate.weight",              "mlp.gate.weight"),
    _layer("ffn.gate.bias",             "mlp.gate.e_score_correction_bias",      "ffn.gate.bias",                "mlp.gate.e_score_correction_bias"),
    _layer("ffn.gate.tid2eid",          "mlp.gate.tid2eid",                      "ffn.gate.tid2eid",             "mlp.gate.tid2eid"),
    _layer("ffn.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight", "ffn.shared_experts.w1.weight",
           "mlp.shared_experts.gate_proj.weight"),
    _layer("ffn.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight",   "ffn.shared_experts.w3.weight",
           "mlp.shared_experts.up_proj.weight"),
    _layer("ffn.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight", "ffn.shared_experts.w2.weight",
           "mlp.shared_experts.down_proj.weight"),
    _layer("ffn.experts.{E}.w1.weight", "mlp.experts.gate_up_proj",  "ffn.experts.{E}.w1.weight",  "mlp.experts.gate_up_proj", (0, 2)),
    _layer("ffn.experts.{E}.w3.weight", "mlp.experts.gate_up_proj",  "ffn.experts.{E}.w3.weight",  "mlp.experts.gate_up_proj", (1, 2)),
    _layer("ffn.experts.{E}.w2.weight", "mlp.experts.down_proj",     "ffn.experts.{E}.w2.weight",  "mlp.experts.down_proj"),
)

_SLOTS = ("L", "E")


def _template(name: str) -> str:
    """`name` with its numeric components replaced, in order, by ``{L}`` then ``{E}`` (three or more: kept)."""
    parts = name.split(".")
    slot = 0
    for i, p in enumerate(parts):
        if p.isdigit() and slot < len(_SLOTS):
            parts[i] = "{" + _SLOTS[slot] + "}"
            slot += 1
    return ".".join(parts)


def _numbers(name: str) -> dict[str, int]:
    return dict(zip(_SLOTS, (int(p) for p in name.split(".") if p.isdigit())))


def _build_lookup() -> dict[str, dict[str, list[Rule]]]:
    """naming -> template -> the rules it holds (several only for stacked experts)."""
    out: dict[str, dict[str, list[Rule]]] = {n: {} for n in NAMINGS}
    for rule in _RULES:
        for naming, tpl in zip(NAMINGS, rule.names):
            if tpl is not None:
                out[naming].setdefault(tpl, []).append(rule)
    return out


_LOOKUP = _build_lookup()


def _stacks(rule: Rule, k: int) -> bool:
    """Whether naming index `k` stores this per-expert tensor stacked over experts."""
    return "{E}" in rule.names[0] and "{E}" not in (rule.names[k] or "{E}")


def detect_naming(names: Iterable[str], namings: tuple[str, ...] = NAMINGS) -> str:
    """The first of `namings` whose rules cover every name; CheckpointError listing each naming tried."""
    names = list(names)
    templates = [_template(n) for n in names]
    unknown: dict[str, list[str]] = {}
    for naming in namings:
        known = _LOOKUP[naming]
        unknown[naming] = [n for n, t in zip(names, templates) if t not in known]
        if not unknown[naming]:
            return naming
    best = min(namings, key=lambda n: len(unknown[n]))
    tried = "; ".join(f"{n} ({len(unknown[n])} of {len(names)} names unknown, e.g. `{unknown[n][0]}`)"
                      for n in namings)
    raise CheckpointError(f"unknown tensor `{unknown[best][0]}`: the tensor names follow none of the "
                          f"namings tried: {tried}")


def to_released(state: dict[str, torch.Tensor], naming: str | None = None) -> dict[str, torch.Tensor]:
    """`state` (in `naming`, detected when None) renamed to the released naming; stacked experts split."""
    naming = naming or detect_naming(state)
    k = NAMINGS.index(naming)
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        rules = _LOOKUP[naming].get(_template(name))
        if rules is None:
            raise CheckpointError(f"unknown tensor `{name}`: not a {naming} name")
        slots = _numbers(name)
        for rule in rules:
            released = rule.names[0]
            if not _stacks(rule, k):
                out[released.format(**slots)] = t
                continue
            i, n = rule.part
            if t.dim() != 3 or t.shape[1] % n:
                raise CheckpointError(f"tensor `{name}` has shape {list(t.shape)}: expected [experts, {n} x rows, "
                                      "cols] (stacked routed experts)")
            rows = t.shape[1] // n
            for x in range(t.shape[0]):
                out[released.format(**slots, E=x)] = t[x, i * rows:(i + 1) * rows]
    return out


def from_released(state: dict[str, torch.Tensor], naming: str, n_experts: int | None = None) -> dict[str, torch.Tensor]:
    """A released-naming state dict renamed to `naming`; per-expert tensors stacked where it stacks them.

    `n_experts` (default: highest expert id + 1) is checked: every expert of a stacked tensor must be present."""
    k = NAMINGS.index(naming)
    out: dict[str, torch.Tensor] = {}
    stacked: dict[str, tuple[Rule, dict[int, dict[int, torch.Tensor]]]] = {}
    for name, t in state.items():
        rules = _LOOKUP["released"].get(_template(name))
        if rules is None:
            raise CheckpointError(f"unknown tensor `{name}`: not a released name")
        rule = rules[0]
        target = rule.names[k]
        if target is None:
            raise CheckpointError(f"tensor `{name}` has no {naming} name (transformers 5.23 models DeepSeek-V4 only)")
        slots = _numbers(name)
        if _stacks(rule, k):
            _, experts = stacked.setdefault(target.format(**slots), (rule, {}))
            experts.setdefault(slots["E"], {})[rule.part[0]] = t
        else:
            out[target.format(**slots)] = t
    for target, (rule, experts) in stacked.items():
        n = n_experts if n_experts is not None else max(experts) + 1
        parts = rule.part[1]
        if max(experts) >= n:
            raise CheckpointError(f"`{target}`: expert {max(experts)} is past the {n} routed experts")
        for x in range(n):
            if len(experts.get(x, {})) != parts:
                raise CheckpointError(f"`{target}` needs all {n} experts with {parts} part(s) each; expert {x} has "
                                      f"{len(experts.get(x, {}))}")
        out[target] = torch.stack([torch.cat([experts[x][i] for i in range(parts)], 0) for x in range(n)])
    return out


def is_transformers_naming(names: Iterable[str]) -> bool:
    """Whether the names follow one of transformers' namings (`TRANSFORMERS_NAMINGS`) entirely."""
    try:
        detect_naming(names, TRANSFORMERS_NAMINGS)
    except CheckpointError:
        return False
    return True


def transformers_to_kvshare(hf_state_dict: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A state dict in any of transformers' namings mapped to the released naming (`cfg` is unused)."""
    return to_released(hf_state_dict, detect_naming(hf_state_dict, TRANSFORMERS_NAMINGS))


def kvshare_to_transformers(state_dict: dict[str, torch.Tensor], cfg: ModelConfig,
                            naming: str = "transformers") -> dict[str, torch.Tensor]:
    """A released-naming state dict mapped to `naming` (default: `DeepseekV4ForCausalLM`'s in-memory names).

    Draft (`mtp.*`) tensors are dropped: transformers has no draft layers."""
    body = {n: t for n, t in state_dict.items() if not n.startswith("mtp.")}
    return from_released(body, naming, cfg.n_routed_experts)


def released_shapes(cfg: ModelConfig, topo: Topology | None = None) -> dict[str, Shape]:
    """Every backbone tensor in the released naming with its shape (no `mtp.*`; Engram's `wkv`, `q_weight`
    and `k_weight` but not its tables, which `engram_table.open_tables` checks)."""
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
    out.update(engram_param_shapes(cfg))
    return out


def _v4_compressor(prefix: str, d: int, width: int, ratio: int, coff: int) -> dict[str, Shape]:
    return {prefix + "wkv.weight": (coff * width, d), prefix + "wgate.weight": (coff * width, d),
            prefix + "norm.weight": (width,), prefix + "ape": (ratio, coff * width)}


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
