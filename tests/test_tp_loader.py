"""A tensor-parallel rank reads only its slices of a safetensors checkpoint, and gets the right values."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import kvshare.parallel.loader as tp_loader
from kvshare.config import load_config
from kvshare.weights import weights_quant as wq
from kvshare.weights.loader import load_checkpoint, load_model
from kvshare.parallel.shard import ShardPlan
from kvshare.shipped import resolve_config_path


class _Spy:
    """Wraps `safe_open` and counts the elements each tensor's slices return."""

    def __init__(self) -> None:
        self.read: dict[str, int] = {}

    def __call__(self, *a, **kw):
        spy = self
        inner = _real_safe_open(*a, **kw)

        class Handle:
            def keys(self):
                return inner.keys()

            def get_slice(self, name):
                sl = inner.get_slice(name)

                class Slice:
                    def get_shape(self):
                        return sl.get_shape()

                    def get_dtype(self):
                        return sl.get_dtype()

                    def __getitem__(self, idx):
                        t = sl[idx]
                        spy.read[name] = spy.read.get(name, 0) + t.numel()
                        return t

                return Slice()

        return Handle()


_real_safe_open = tp_loader.safe_open


@pytest.fixture
def checkpoint(tmp_path):
    """tiny-v41 with an FP8 wq_b and wo_b (block 32 x 32) and an FP4 expert, as DeepSeek ships them."""
    cfg = load_config("tiny-v41")
    sd = {k: v.clone() for k, v in load_model("tiny-v41", quant=False).state_dict().items()}
    for name in ("layers.1.attn.wq_b.weight", "layers.1.attn.wo_b.weight"):
        sd[name], sd[name.replace(".weight", ".scale")] = wq.quantize_fp8_weight(sd[name], (32, 32))
    e = "layers.2.ffn.experts.3.w2.weight"
    sd[e], sd[e.replace(".weight", ".scale")] = wq.pack_fp4_weight(sd[e])
    (tmp_path / "config.json").write_text(resolve_config_path("tiny-v41").read_text())
    save_file(sd, str(tmp_path / "model.safetensors"))
    return tmp_path, cfg


@pytest.mark.parametrize("rank", [0, 1])
def test_rank_state_equals_narrowed_full_state(checkpoint, rank, monkeypatch) -> None:
    path, cfg = checkpoint
    plan = ShardPlan(cfg, rank, 2)
    want = plan.shard_state(load_checkpoint(path, cfg))
    spy = _Spy()
    monkeypatch.setattr(tp_loader, "safe_open", spy)
    got = tp_loader.read_rank_state(path, cfg, plan)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    # wq_b [64, 16] FP8: 32 of 64 rows and 1 of 2 scale rows read (whole 32-row blocks).
    assert spy.read["layers.1.attn.wq_b.weight"] == 32 * 16
    assert spy.read["layers.1.attn.wq_b.scale"] == 1
    assert spy.read["layers.3.attn.wq_b.weight"] == 32 * 16  # plain: rows of this rank only
    assert spy.read["embed.weight"] == 128 * 32 and spy.read["head.weight"] == 128 * 32
    # wo_b's 16 columns per rank are half a 32-wide scale block: decoded whole, then narrowed.
    assert spy.read["layers.1.attn.wo_b.weight"] == 32 * 32
    lo, hi = plan.experts
    for e in range(4):
        n = spy.read.get(f"layers.2.ffn.experts.{e}.w1.weight", 0)
        assert n == (32 * 32 if lo <= e < hi else 0), e
