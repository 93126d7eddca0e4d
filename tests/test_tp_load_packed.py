"""A tensor-parallel rank of a bf16 model keeps its FP8 / FP4 slices packed, as TP=1 does (issue 37):
each packed slice stands for exactly the narrowed decoded weight, and slices the kernels cannot hold
(an FP8 column slice of half a scale block) are decoded as before."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import kvshare.parallel.loader as tp_loader
from kvshare.config import load_config
from kvshare.kernels import Packed, dequantize
from kvshare.weights import weights_quant as wq
from kvshare.weights.loader import load_checkpoint, load_model
from kvshare.parallel.shard import ShardPlan
from kvshare.shipped import resolve_config_path

WQ_B, WO_B = "layers.1.attn.wq_b.weight", "layers.1.attn.wo_b.weight"
EXPERT = "layers.2.ffn.experts.3.w2.weight"


@pytest.fixture
def checkpoint(tmp_path):
    """tiny-v41 with an FP8 wq_b and wo_b (block 32 x 32) and an FP4 expert, as DeepSeek ships them."""
    cfg = load_config("tiny-v41")
    sd = {k: v.clone() for k, v in load_model("tiny-v41", quant=False).state_dict().items()}
    sd[WQ_B][32:] *= 4  # the two 32-row blocks get different scales (a wrong scale slice shows)
    for name in (WQ_B, WO_B):
        sd[name], sd[name.replace(".weight", ".scale")] = wq.quantize_fp8_weight(sd[name], (32, 32))
    sd[EXPERT], sd[EXPERT.replace(".weight", ".scale")] = wq.pack_fp4_weight(sd[EXPERT])
    (tmp_path / "config.json").write_text(resolve_config_path("tiny-v41").read_text())
    save_file(sd, str(tmp_path / "model.safetensors"))
    return tmp_path, cfg


@pytest.mark.parametrize("rank", [0, 1])
def test_rank_slices_stay_packed_and_stand_for_the_narrowed_weight(checkpoint, rank) -> None:
    path, cfg = checkpoint
    plan = ShardPlan(cfg, rank, 2)
    want = plan.shard_state(load_checkpoint(path, cfg))
    lo, hi = plan.experts
    local_expert = f"layers.2.ffn.experts.{3 - lo}.w2.weight" if lo <= 3 < hi else None
    keep = frozenset(n for n in (WQ_B, WO_B, local_expert) if n)
    got = tp_loader.read_rank_state(path, cfg, plan, keep)
    assert got.keys() == want.keys()
    for name in want:
        if name in (WQ_B, local_expert):
            assert isinstance(got[name], Packed), name
            # dequantize gives bf16; the decoded value has at most 4 significant bits: exact in bf16
            assert torch.equal(dequantize(got[name]), want[name].bfloat16()), name
        else:  # wo_b's 16 columns per rank are half a 32-wide scale block: decoded, as before
            assert isinstance(got[name], torch.Tensor) and torch.equal(got[name], want[name]), name
