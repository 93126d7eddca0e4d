"""The name table (`hf_naming`): each naming is what transformers 5.23 reads and writes, detection, errors.

transformers itself is the oracle: a checkpoint written in each naming must load into
`DeepseekV4ForCausalLM.from_pretrained` with every tensor equal, and whatever `save_pretrained` then
writes must again be one of kvshare's namings (the set is closed under transformers' load-then-save)
and map back to the same released tensors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvshare.config import load_config
from kvshare.errors import CheckpointError
from kvshare.weights import hf_naming
from kvshare.weights.hf_naming import NAMINGS, detect_naming, from_released, released_shapes, to_released
from kvshare.weights.loader import load_checkpoint

transformers = pytest.importorskip("transformers", reason="transformers is not installed: no oracle")
from test_hf_save_pretrained import hf_config, randomize  # noqa: E402

# What transformers' save_pretrained writes after from_pretrained of a checkpoint in each naming.
RESAVED_AS = {"released": "transformers-saved", "transformers": "transformers-resaved",
              "transformers-saved": "transformers-saved", "transformers-resaved": "transformers-resaved"}


def _keys(path: Path) -> list[str]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return list(f.keys())


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory):
    torch.manual_seed(0)
    hf = transformers.DeepseekV4ForCausalLM(hf_config()).float().eval()
    randomize(hf, 3)
    out = tmp_path_factory.mktemp("hf") / "saved"
    hf.save_pretrained(out)
    return hf, out


@pytest.mark.parametrize("naming", NAMINGS)
def test_each_naming_loads_in_transformers_and_resaves_as_a_known_naming(hf_model, naming: str,
                                                                       tmp_path: Path) -> None:
    hf, saved = hf_model
    released = to_released(hf.state_dict())
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text((saved / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in from_released(released, naming).items()}, str(src / "model.safetensors"),
              metadata={"format": "pt"})
    assert detect_naming(_keys(src)) == naming
    got, info = transformers.DeepseekV4ForCausalLM.from_pretrained(src, output_loading_info=True)
    assert not any(info.values()), info
    want = hf.state_dict()
    assert [k for k, v in got.state_dict().items() if not torch.equal(v, want[k])] == []
    got.save_pretrained(tmp_path / "out")
    keys = _keys(tmp_path / "out")
    assert detect_naming(keys) == RESAVED_AS[naming]
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        back = to_released({k: f.get_tensor(k) for k in keys})
    assert back.keys() == released.keys() and all(torch.equal(back[k], released[k]) for k in back)


def test_save_pretrained_from_a_config_writes_the_saved_naming(hf_model) -> None:
    _, saved = hf_model
    keys = _keys(saved)
    assert detect_naming(keys) == "transformers-saved"
    assert {"head.weight", "model.layers.1.attn.norm.weight", "model.layers.1.ffn.experts.3.w2.weight"} <= set(keys)


def test_namings_agree_where_they_share_a_name() -> None:
    """A name spelled the same in two namings means the same released tensor in both; released names are unique."""
    assert all(len(rules) == 1 for rules in hf_naming._LOOKUP["released"].values())
    for tpl in set().union(*(hf_naming._LOOKUP[n] for n in NAMINGS)):
        meanings = {tuple(r.names[0] for r in hf_naming._LOOKUP[n][tpl]) for n in NAMINGS if tpl in hf_naming._LOOKUP[n]}
        assert len(meanings) == 1, (tpl, meanings)


@pytest.mark.parametrize("config", ["tiny-v4", "tiny-v41", "tiny-v41-deep", "deepseek-v4-flash",
                                    "deepseek-v4.1-flash"])
def test_released_naming_covers_every_backbone_tensor(config: str) -> None:
    names = released_shapes(load_config(config))
    assert detect_naming(names) == "released"


def test_unknown_name_error_lists_the_namings_tried(hf_model, tmp_path: Path) -> None:
    hf, saved = hf_model
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    sd["model.layers.1.self_attn.wkv.weight"] = sd.pop("model.layers.1.self_attn.kv_proj.weight")  # a mixture
    (tmp_path / "config.json").write_text((saved / "config.json").read_text())
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path, load_config(tmp_path))
    msg = str(e.value)
    assert "unknown tensor `model.layers.1.self_attn.wkv.weight`" in msg
    for naming in NAMINGS:
        assert f"{naming} (" in msg, msg


def test_stacked_experts_must_be_complete() -> None:
    cfg = load_config("tiny-v4")
    sd = {k: torch.zeros(s) for k, s in released_shapes(cfg).items() if k != "layers.2.ffn.experts.1.w3.weight"}
    with pytest.raises(CheckpointError, match=r"`model\.layers\.2\.mlp\.experts\.gate_up_proj`.*expert 1 has 1"):
        from_released(sd, "transformers", cfg.n_routed_experts)
    with pytest.raises(CheckpointError, match="shape"):
        to_released({"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(4, 63, 32)}, "transformers")


def test_export_refuses_v41(tmp_path: Path) -> None:
    from kvshare.errors import ConfigError
    from kvshare.weights.checkpoint_write import export_transformers

    cfg = load_config("tiny-v41")
    with pytest.raises(ConfigError, match="V4.1"):
        export_transformers({}, cfg, tmp_path)
