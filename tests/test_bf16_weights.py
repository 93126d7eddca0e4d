"""bf16 weights: lossless FP8/FP4 -> bf16 conversion, packed linears = F.linear bit for bit, the fp32 set.

The conversion claim is checked exhaustively against the formats' definitions: every e4m3 code
(and every e2m1 code) times every power-of-two scale a checkpoint can hold is a bf16 number
(bf16 keeps 8 mantissa bits and fp32's exponent range; e4m3 has 3, e2m1 1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvshare.engine.engine import LLMEngine
from kvshare.model.dtypes import cast_model, weight_bytes
from kvshare.layers.linear import Linear, pack_linears, packing_available
from kvshare.weights.weights_quant import dequant_fp4_weight, dequant_fp8_weight
from test_model_common import make_model

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the e2m1 magnitude table


def _is_bf16(x: torch.Tensor) -> bool:
    return torch.equal(x.to(torch.bfloat16).to(x.dtype), x)


def test_every_fp8_code_times_every_pow2_scale_is_a_bf16_number() -> None:
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    codes = codes[torch.isfinite(codes)]  # e4m3fn: two NaN codes, no inf
    scales = torch.exp2(torch.arange(-126, 120, dtype=torch.float32))  # ue8m0 scales with finite fp32 products
    values = codes[:, None] * scales[None, :]
    values = values[torch.isfinite(values) & ((values == 0) | (values.abs() >= torch.finfo(torch.float32).tiny))]
    assert values.numel() > 50_000 and _is_bf16(values)


def test_fp8_and_fp4_checkpoint_weights_decode_to_bf16_without_loss() -> None:
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (64, 256), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # drop the NaN codes
    scale = torch.randint(100, 150, (1, 2), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    w = dequant_fp8_weight(codes.view(torch.float8_e4m3fn), scale, (128, 128))
    assert _is_bf16(w) and w.abs().max() > 0
    packed = torch.randint(-128, 128, (32, 64), generator=g, dtype=torch.int8)
    s4 = torch.randint(110, 140, (32, 4), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    w4 = dequant_fp4_weight(packed, s4)
    assert _is_bf16(w4) and w4.abs().max() > 0
    # the decoded magnitudes are the e2m1 table times 2^k (independent of kvshare's decoder tables)
    mags = (w4.abs() / torch.exp2(s4.view(torch.uint8).float() - 127).repeat_interleave(32, dim=1)).unique()
    assert set(mags.tolist()) <= set(E2M1_MAGNITUDES)


def test_packed_linear_equals_f_linear_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(1)
    lin = Linear(96, 80)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(80, 96, generator=g))
    lin.to(torch.bfloat16)
    packed = lin.pack()
    assert packed == packing_available()
    for m in (1, 3, 8, 64):
        x = torch.randn(m, 96, generator=g).bfloat16()
        with torch.inference_mode():
            assert torch.equal(lin(x), F.linear(x, lin.weight))
    with torch.no_grad():  # a changed weight drops the packed copy instead of using stale values
        lin.weight.mul_(2)
    with torch.inference_mode():
        x = torch.randn(4, 96, generator=g).bfloat16()
        assert torch.equal(lin(x), F.linear(x, lin.weight))
    assert lin._packed is None


def test_cast_model_keeps_the_fp32_set_and_packs_the_rest() -> None:
    model = cast_model(make_model("tiny-v41"), torch.bfloat16)
    kept = {n for n, p in model.named_parameters() if p.dtype == torch.float32}
    narrow = {n for n, p in model.named_parameters() if p.dtype == torch.bfloat16}
    assert kept | narrow == {n for n, _ in model.named_parameters()}
    for name in kept:
        leaf = name.rsplit(".", 1)[-1]
        assert ("norm" in name or ".gate." in name or leaf.startswith("hc_") or leaf in ("attn_sink", "ape")
                or ".compressor.w" in name), name
    assert any(n.endswith("hc_attn_fn") for n in kept) and any(n.endswith("ffn.gate.weight") for n in kept)
    assert any(n.endswith("wq_a.weight") for n in narrow) and "head.weight" in narrow
    params = dict(model.named_parameters())
    assert weight_bytes(model) == sum(4 * params[n].numel() for n in kept) + sum(2 * params[n].numel() for n in narrow)
    assert weight_bytes(model) < weight_bytes(make_model("tiny-v41"))
    if packing_available():
        assert pack_linears(model) == sum(1 for m in model.modules() if isinstance(m, Linear)
                                          and m.weight.dtype == torch.bfloat16)


def test_engine_defaults_to_bf16_and_float64_stays_float64() -> None:
    eng = LLMEngine(make_model("tiny-v41"), dtype=None, max_num_seqs=1, num_blocks=8, max_model_len=64)
    assert eng.dtype == torch.float32  # a passed model keeps its own dtype
    eng = LLMEngine("tiny-v41", max_num_seqs=1, num_blocks=8, max_model_len=64)
    assert eng.dtype == torch.bfloat16 and eng.model.embed.weight.dtype == torch.bfloat16
    assert eng.model.layers[0].hc_attn_fn.dtype == torch.float32
    m64 = cast_model(make_model("tiny-v41"), torch.float64)
    assert all(p.dtype == torch.float64 for p in m64.parameters())


def test_cast_model_twice_keeps_every_weight_in_place() -> None:
    """Each engine casts the model it is given: a second cast of a cast model changes no storage
    (the promoted compressor projections, already bf16-rounded fp32, included), so the kernels'
    packs made of the first engine's weights stay valid for the next engine."""
    model = cast_model(make_model("tiny-v41"), torch.bfloat16)
    before = {n: (p.data_ptr(), p.dtype) for n, p in model.named_parameters()}
    promoted = [n for n in before if ".compressor.w" in n and before[n][1] == torch.float32]
    assert promoted  # the case this guards
    cast_model(model, torch.bfloat16)
    assert {n: (p.data_ptr(), p.dtype) for n, p in model.named_parameters()} == before
