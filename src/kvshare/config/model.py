"""ModelConfig: one frozen description of a DeepSeek-V4 / V4.1 model, read from any of its config files.

Accepted inputs (a dict, a path to a JSON file, or a directory holding `config.json`):

* HF `config.json` of V4 (`model_type: deepseek_v4`): legacy `compress_ratios` or
  `layer_types` + `compress_rates`, `num_hash_layers` or `mlp_layer_types`, `rope_scaling` or
  `rope_parameters`.
* HF `config.json` of V4.1 (`model_type: deepseek_v41`), with or without `text_config` nesting.
* DeepSeek's `inference/config.json` (`dim`, `n_layers`, `kv_source_layers`, ...).

Invariants after construction (checked here; source-map rules are checked in `topology.py`):
``len(compress_ratios) == num_hidden_layers + num_draft_layers``, draft entries are 0, every
ratio is allowed for the architecture, head counts divide the groups, rope dims are even and fit.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from kvshare.config.parse import parse_hf_or_reference
from kvshare.config.rules import validate_config
from kvshare.config.types import Arch, YarnConfig
from kvshare.errors import ConfigError

@dataclass(frozen=True)
class ModelConfig:
    """The model's shape. `compress_ratios` has one entry per backbone layer plus one per draft layer."""

    arch: Arch
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_ratios: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int = 1
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn: YarnConfig | None = None
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-6
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.0
    swiglu_limit: float = 10.0
    norm_topk_prob: bool = True
    gate_temp: float = 1.0
    num_hash_layers: int = 0
    num_nextn_predict_layers: int = 0
    kv_source_layer_ids: tuple[int, ...] = ()
    index_source_layer_ids: tuple[int, ...] = ()
    index_k_source_layer_ids: tuple[int, ...] | None = None
    candidate_source_layer_id: int = -1
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 0
    engram_vocab_size: int = 0
    engram_n_heads: int = 0
    engram_head_dim: int = 0
    engram_pad_token_id: int = 0
    engram_compressed_vocab_size: int = 0
    dspark_block_size: int = 0  # DSpark (spec engram_dspark.md §2.1): query positions per draft block
    dspark_noise_token_id: int = 0
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 0
    dspark_n_routed_experts: int = 0  # 0: the backbone's count
    dspark_num_experts_per_tok: int = 0
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = (1,)
    act_quant_block: int = 32
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        validate_config(self)

    # ---- derived facts -------------------------------------------------------------------
    @property
    def num_draft_layers(self) -> int:
        """Entries of `compress_ratios` past the backbone (MTP / DSpark); always ratio 0."""
        return len(self.compress_ratios) - self.num_hidden_layers

    def ratio(self, layer: int) -> int:
        """Compress ratio of a backbone layer (0 = sliding window only)."""
        return self.compress_ratios[layer]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict that `ModelConfig.from_dict` reads back to an equal config."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("extra", "yarn")}
        d["yarn"] = asdict(self.yarn) if self.yarn else None
        d["kvshare_format"] = 1
        return json.loads(json.dumps(d))

    # ---- constructors -------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Read any supported config dict (see module docstring)."""
        if not isinstance(raw, dict):
            raise ConfigError(f"expected a JSON object, got {type(raw).__name__}", field="<root>")
        if raw.get("kvshare_format") == 1:
            d = {k: v for k, v in raw.items() if k != "kvshare_format"}
            d["yarn"] = YarnConfig(**d["yarn"]) if d.get("yarn") else None
            for k in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids",
                      "engram_layer_ids", "engram_num_embeddings", "eos_token_ids"):
                d[k] = tuple(d[k])
            d["dspark_target_layer_ids"] = tuple(d.get("dspark_target_layer_ids", ()))
            if d.get("index_k_source_layer_ids") is not None:
                d["index_k_source_layer_ids"] = tuple(d["index_k_source_layer_ids"])
            return cls(**d)
        return cls(**parse_hf_or_reference(raw))

    @classmethod
    def from_path(cls, path: str | Path) -> "ModelConfig":
        """Read `path` (a JSON file or a directory holding `config.json`)."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise ConfigError(f"no config file at {p}", field="<path>", fix="pass a config.json or its directory")
        try:
            raw = json.loads(p.read_text())
            return cls.from_dict(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{p} is not valid JSON: {e}", field="<root>") from e
        except RecursionError:  # json (or the parser after it) recursing into absurd nesting
            raise ConfigError(f"{p} is nested too deeply to be a model config", field="<root>") from None
