"""Loading at file size (issue 37 item 1): a released-layout checkpoint (FP4 routed experts, FP8 linears
with 128 x 128 ue8m0 blocks, bf16 / fp32 rest) streams into a bf16 model without whole-model copies.

The checkpoint (`SIZES`: 3 layers with ratios 0 / 4 / 128, one hash-routed, 24 routed experts of
1024 x 1024; 174 MB, 65% of it FP4) is loaded in a fresh process (`bench.load_memory`), which reports
its peak resident-set growth and 8 greedy tokens.

* Peak growth <= 1.2 x the checkpoint + 0.6 GB (the issue's bound) and <= 1.0 x + 96 MB (near what
  was observed: 194 MB = 1.11 x, the file + 20 MB of per-tensor transients and small fp32 tensors; the
  loader before this change, which read the whole file, built an fp32 model and dequantised, peaked at
  1.39 GB = 8.0 x).
* The tokens are those the loader before the change (main b15e4e1, the same checkpoint, the same
  process-level measurement, the default batch-invariant engine) produced: `MAIN_TOKENS`, computed
  on the AVX-512 BF16 path. They hold by construction where the kernels give those bits (AVX-512 BF16
  and AVX2 give the same bits on normal-range data, `docs/architecture.md`); AMX sums inside its
  tiles in the hardware's order, so there the list is not checked (the weights still are, below).
* Independently of the tokens, every parameter and every packed weight the streamed model holds is
  bitwise what the whole-read path (`load_checkpoint`, which decodes from safetensors' own reader)
  gives after the model's casts.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvshare.bench.load_memory import measure_load
from kvshare.bench.real_checkpoint import write_released_checkpoint
from kvshare.bench.sizes import BenchSizes, peer_v4_config
from kvshare.config import ModelConfig

SIZES = BenchSizes(hidden=1024, heads=8, head_dim=128, q_lora=256, o_lora=256, o_groups=2, experts=24,
                   experts_per_tok=4, moe_inter=1024, vocab=8192, index_heads=8, index_dim=64, peer_layers=3)
# greedy tokens of prompt 1..8 loaded by main b15e4e1's loader (load_model, bf16, quant off, 1 thread)
MAIN_TOKENS = [3841, 3422, 1646, 2965, 7942, 3331, 1591, 4562]
GB = 1e9


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ModelConfig]:
    cfg = ModelConfig.from_dict(peer_v4_config(SIZES))
    d = tmp_path_factory.mktemp("real_layout")
    write_released_checkpoint(cfg, d, seed=0)
    return d, cfg


def test_streamed_load_peak_is_near_file_size_and_tokens_are_unchanged(checkpoint) -> None:
    path, _ = checkpoint
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[1] / "src"),
                                                                       os.environ.get("PYTHONPATH")]))}
    r = measure_load(path, new_tokens=8, threads=1, env=env, timeout=600)
    size, growth = r["checkpoint_bytes"], r["peak_growth_bytes"]
    assert 165e6 < size < 185e6
    assert growth <= 1.2 * size + 0.6 * GB, r
    assert growth <= size + 96e6, r
    from kvshare.kernels.build import best_isa

    if best_isa() in ("avx512", "avx2"):
        assert r["tokens"] == MAIN_TOKENS


def test_streamed_values_equal_the_whole_read_path(checkpoint) -> None:
    from kvshare.kernels import Packed
    from kvshare.layers.linear import Linear
    from kvshare.weights.loader import _packable_names, load_checkpoint, load_model

    path, cfg = checkpoint
    model = load_model(path, dtype=torch.bfloat16, quant=False)
    ref = load_checkpoint(path, cfg, keep_packed=_packable_names(model, torch.bfloat16))
    own = dict(model.named_parameters())
    packed = {f"{n}.weight": m.qweight for n, m in model.named_modules() if isinstance(m, Linear) and m.qweight is not None}
    assert len(packed) == sum(isinstance(v, Packed) for v in ref.values()) > 3 * 24 * 3
    for name, want in ref.items():
        if isinstance(want, Packed):
            got = packed[name]
            assert (got.fmt, got.n, got.k, got.block) == (want.fmt, want.n, want.k, want.block), name
            assert torch.equal(got.data, want.data) and torch.equal(got.exps, want.exps), name
        elif name in own:
            got_t = own[name]
            # the model's casts: fp32 set kept, compressor weights rounded to bf16 held in fp32, rest bf16
            promoted = name.endswith(("compressor.wkv.weight", "compressor.wgate.weight"))  # ratios 4 / 128
            expect = want.bfloat16().float() if promoted else want.float().to(got_t.dtype)
            assert torch.equal(got_t.detach(), expect), name
        else:
            assert torch.equal(dict(model.named_buffers())[name], want.to(torch.int64)), name


def test_mapped_weights_are_private_copies(checkpoint) -> None:
    """A weight served from the file's pages can be changed in the model without touching the file."""
    from kvshare.weights.loader import load_model

    path, _ = checkpoint
    a = load_model(path, dtype=torch.bfloat16, quant=False)
    before = a.embed.weight[:4].clone()
    with torch.no_grad():
        a.embed.weight.mul_(2)
    b = load_model(path, dtype=torch.bfloat16, quant=False)
    assert torch.equal(b.embed.weight[:4], before) and torch.equal(a.embed.weight[:4], 2 * before)
