"""Config parsing (every shipped config and variant spellings) and the validation rules of model.md §10."""

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from kvshare.config import ModelConfig, load_config
from kvshare.errors import ConfigError
from kvshare.shipped import CONFIG_DIR, shipped_config_names
from kvshare.topology import Topology

FLASH_RATIOS = (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)
V4_TYPES = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}


def raw(name: str) -> dict[str, Any]:
    return json.loads((CONFIG_DIR / f"{name}.json").read_text())


def flat_flash() -> dict[str, Any]:
    r = raw("deepseek-v4.1-flash")
    return {**{k: v for k, v in r.items() if k != "text_config"}, **r["text_config"]}


def build(d: dict[str, Any]) -> Topology:
    return Topology(ModelConfig.from_dict(d))


@pytest.mark.parametrize("name", shipped_config_names())
def test_every_shipped_config_loads_and_round_trips(name: str) -> None:
    cfg = load_config(name)
    assert len(cfg.compress_ratios) == cfg.num_hidden_layers + cfg.num_draft_layers
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert load_config(CONFIG_DIR / f"{name}.json") == cfg == load_config(str(CONFIG_DIR / f"{name}.json"))
    Topology(cfg)


def test_v41_flash_values() -> None:
    cfg = load_config("deepseek-v4.1-flash")
    assert cfg.arch == "v41" and cfg.num_hidden_layers == 40 and cfg.num_draft_layers == 3
    assert cfg.compress_ratios == FLASH_RATIOS
    assert cfg.kv_source_layer_ids == (2, 8, 14, 20)
    assert cfg.index_source_layer_ids == (2, 8, 14, 20, 24, 28, 32, 36)
    assert (cfg.candidate_source_layer_id, cfg.candidate_topk_blocks, cfg.candidate_block_size) == (20, 2048, 8)
    assert cfg.rms_norm_eps == 1e-20 and cfg.act_quant_block == 32
    assert cfg.yarn is not None and (cfg.yarn.factor, cfg.yarn.original_max_position_embeddings) == (16, 65536)


def test_text_config_nesting_equals_flat() -> None:
    assert ModelConfig.from_dict(flat_flash()) == load_config("deepseek-v4.1-flash")


def test_directory_with_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(raw("tiny-v41")))
    assert load_config(tmp_path) == load_config("tiny-v41") == load_config(str(tmp_path))


def test_hf_v4_layer_types_and_compress_rates() -> None:
    base = raw("deepseek-v4-flash")
    n = base["num_hidden_layers"]
    d = {k: v for k, v in base.items() if k != "compress_ratios"}
    d["layer_types"] = [V4_TYPES[r] for r in base["compress_ratios"][:n]]
    d["compress_rates"] = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    assert ModelConfig.from_dict(d).compress_ratios == tuple(base["compress_ratios"])
    del d["compress_rates"]
    assert ModelConfig.from_dict(d).compress_ratios == tuple(base["compress_ratios"])
    d["layer_types"][5] = "mystery_attention"
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(d)
    assert (e.value.field, e.value.layer) == ("layer_types", 5)


def test_hf_v4_rope_parameters_main_and_compress() -> None:
    d = raw("deepseek-v4-flash")
    del d["rope_scaling"], d["rope_theta"], d["compress_rope_theta"]
    d["rope_parameters"] = {
        "main": {"rope_type": "default", "rope_theta": 12345.0},
        "compress": {"rope_type": "yarn", "rope_theta": 99999.0, "factor": 8, "original_max_position_embeddings": 4096,
                     "beta_fast": 16, "beta_slow": 2},
    }
    cfg = ModelConfig.from_dict(d)
    assert (cfg.rope_theta, cfg.compress_rope_theta) == (12345.0, 99999.0)
    assert cfg.yarn is not None
    assert (cfg.yarn.factor, cfg.yarn.original_max_position_embeddings, cfg.yarn.beta_fast, cfg.yarn.beta_slow) == (
        8, 4096, 16, 2)


def test_hf_v4_mlp_layer_types_count_hash_layers() -> None:
    d = raw("deepseek-v4-flash")
    del d["num_hash_layers"]
    d["mlp_layer_types"] = ["hash_moe"] * 2 + ["moe"] * (d["num_hidden_layers"] - 2)
    assert ModelConfig.from_dict(d).num_hash_layers == 2


def test_deepseek_inference_config_names() -> None:
    f = flat_flash()
    ref = {
        "vocab_size": f["vocab_size"], "dim": f["hidden_size"], "moe_inter_dim": f["moe_intermediate_size"],
        "n_layers": 40, "n_heads": 64, "head_dim": 512, "rope_head_dim": 64, "q_lora_rank": 1280,
        "o_lora_rank": 1024, "o_groups": 8, "n_routed_experts": 384, "n_activated_experts": 6,
        "score_func": "sqrtsoftplus", "route_scale": 1.5, "norm_eps": 1e-20, "window_size": 128,
        "compress_ratios": list(FLASH_RATIOS), "compress_rope_theta": 160000, "rope_theta": 10000,
        "rope_factor": 16, "original_seq_len": 65536, "beta_fast": 32, "beta_slow": 1,
        "kv_source_layers": [2, 8, 14, 20], "index_source_layers": [2, 8, 14, 20, 24, 28, 32, 36],
        "candidate_source_layer": 20, "candidate_topk_blocks": 2048, "candidate_block_size": 8,
        "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512, "n_mtp_layers": 3, "dtype": "fp8",
    }
    cfg = ModelConfig.from_dict(ref)
    want = load_config("deepseek-v4.1-flash")
    assert cfg.arch == "v41"
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "qk_rope_head_dim", "rms_norm_eps",
                 "sliding_window", "compress_ratios", "kv_source_layer_ids", "index_source_layer_ids",
                 "candidate_source_layer_id", "yarn", "num_experts_per_tok", "routed_scaling_factor",
                 "moe_intermediate_size", "num_draft_layers"):
        assert getattr(cfg, name) == getattr(want, name), name
    ref["original_seq_len"] = 0  # REF41 default: no YaRN
    assert ModelConfig.from_dict(ref).yarn is None


def test_mtp_entries_normalised() -> None:
    d = flat_flash()
    d["compress_ratios"] = list(FLASH_RATIOS[:40])  # draft entries missing -> filled with 0
    assert ModelConfig.from_dict(d).compress_ratios == FLASH_RATIOS
    d["compress_ratios"] = list(FLASH_RATIOS) + [0]  # one more entry than MTP layers
    cfg = ModelConfig.from_dict(d)
    assert cfg.num_draft_layers == 4 and cfg.num_nextn_predict_layers == 3
    assert [p.is_draft for p in Topology(cfg).layers[39:]] == [False, True, True, True, True]


# ---- validation rules (spec/model.md §10), each naming field and layer ---------------------------------


def _edit(**kv: Any) -> dict[str, Any]:
    d = copy.deepcopy(flat_flash())
    d.update(kv)
    return d


def _ratios(**at: int) -> list[int]:
    r = list(FLASH_RATIOS)
    for k, v in at.items():
        r[int(k[1:])] = v
    return r


INVALID = [
    ("short ratios", _edit(compress_ratios=[0] * 39), "compress_ratios", None),
    ("draft entry nonzero", _edit(compress_ratios=_ratios(L41=2)), "compress_ratios", 41),
    ("V4.1 ratio 4", _edit(compress_ratios=_ratios(L5=4)), "compress_ratios", 5),
    ("kv source ratio 0", _edit(compress_ratios=_ratios(L8=0)), "kv_source_layer_ids", 8),
    ("index source ratio 0", _edit(compress_ratios=_ratios(L24=0)), "index_source_layer_ids", 24),
    ("kv source not index source", _edit(index_source_layer_ids=[2, 14, 20, 24]), "kv_source_layer_ids", 8),
    ("compressed layer before any kv source", _edit(kv_source_layer_ids=[8, 14, 20],
                                                    index_source_layer_ids=[8, 14, 20]), "kv_source_layer_ids", 2),
    ("index source with no kv source before it", _edit(kv_source_layer_ids=[8, 14, 20]), "kv_source_layer_ids", 2),
    ("consumer ratio differs from its source", _edit(compress_ratios=_ratios(L21=2)), "compress_ratios", 21),
    ("ratio change without a new kv source", _edit(kv_source_layer_ids=[2, 8, 14],
                                                   index_source_layer_ids=[2, 8, 14], candidate_source_layer_id=-1),
     "compress_ratios", 20),
    ("candidate source not an index source", _edit(candidate_source_layer_id=21), "candidate_source_layer_id", 21),
    ("candidate source is a draft layer", _edit(candidate_source_layer_id=41), "candidate_source_layer_id", 41),
    ("candidate pool too small for top-k", _edit(candidate_topk_blocks=64), "candidate_topk_blocks", 20),
    ("candidate pool disabled by zeros", _edit(candidate_block_size=0), "candidate_topk_blocks", 20),
    ("candidate consumer of another ratio", _edit(candidate_source_layer_id=14), "candidate_source_layer_id", 20),
    ("kv source id out of range", _edit(kv_source_layer_ids=[2, 8, 14, 20, 99]), "kv_source_layer_ids", 99),
    ("negative index source id", _edit(index_source_layer_ids=[-1, 2, 8, 14, 20]), "index_source_layer_ids", -1),
    ("sharing on a draft layer", _edit(kv_source_layer_ids=[2, 8, 14, 20, 41]), "kv_source_layer_ids", 41),
    ("duplicate source id", _edit(kv_source_layer_ids=[2, 8, 8, 14, 20]), "kv_source_layer_ids", 8),
    ("index-K source not a kv source", _edit(index_k_source_layer_ids=[2, 8, 14, 20, 24]),
     "index_k_source_layer_ids", 24),
    ("index-K source not an index source", _edit(index_source_layer_ids=[2, 8, 14, 20, 24],
                                                 kv_source_layer_ids=[2, 8, 14, 20],
                                                 index_k_source_layer_ids=[2, 8, 14, 20, 3]),
     "index_k_source_layer_ids", 3),
    ("heads not divisible by o_groups", _edit(o_groups=7), "o_groups", None),
    ("two shared experts", _edit(n_shared_experts=2), "n_shared_experts", None),
    ("odd rope dim", _edit(qk_rope_head_dim=63), "qk_rope_head_dim", None),
    ("missing field", {k: v for k, v in flat_flash().items() if k != "head_dim"}, "head_dim", None),
    ("non-integer source list", _edit(kv_source_layer_ids=[2, "8"]), "kv_source_layer_ids", None),
    ("unknown scoring", _edit(scoring_func="tanh"), "scoring_func", None),
]


@pytest.mark.parametrize("what,d,field,layer", INVALID, ids=[c[0] for c in INVALID])
def test_validation_rule(what: str, d: dict[str, Any], field: str, layer: int | None) -> None:
    with pytest.raises(ConfigError) as e:
        build(d)
    assert (e.value.field, e.value.layer) == (field, layer), str(e.value)
    assert field in str(e.value)


def test_v4_ratio_rules() -> None:
    d = raw("deepseek-v4-flash")
    d["compress_ratios"][3] = 2
    with pytest.raises(ConfigError) as e:
        build(d)
    assert (e.value.field, e.value.layer) == ("compress_ratios", 3)
    d = raw("deepseek-v4-flash")
    d["compress_ratios"][-1] = 4  # the MTP entry
    with pytest.raises(ConfigError) as e:
        build(d)
    assert (e.value.field, e.value.layer) == ("compress_ratios", 43)


def test_bad_files(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path)
    assert e.value.field == "<root>"
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "nothing-here")
    assert e.value.field == "<path>"
    with pytest.raises(ConfigError):
        ModelConfig.from_dict([1, 2])  # type: ignore[arg-type]
