"""The MoE layer's experts in one native call (kernels/moe.py, csrc/moe.cpp).

1. Bitwise the torch reference (`MoE.forward_torch`, bound batch-invariant) against `forward_native`:
   bf16 and fp32 weights, with and without FP8 input rounding, T = 1, 2, 7, 33, 300 rows, k = 1
   and k = 2, experts that get no rows; the release's FP8 / FP4 formats kept packed (hash-routed
   and scored layers of tiny-v4, fake quantisation on and off).
2. Row invariance: a row's bits are the same alone and among 33 rows.
3. An independent oracle: fp32 against spec/model.md §7.2 written out in float64 per token.
4. Replaced or edited weights are noticed (the pack set is rebuilt), and bad ids are refused.

Mutations caught (each run against a mutated copy): AVX-512 instead of AMX for every weight (the
bf16 k = 2 T = 300 case differs by 1e-3); no FP8 rounding of the SwiGLU output before w2 (7 tests);
the C++ stamp check dropped (`in_place` edit); either global registration hook dropped
(`new_parameter` / `new_expert`); `MoeExperts._native_experts` passing block 0 for the input's
FP8 rounding (9 tests). Not distinguishable: an unstable grouping inside an expert (every
row is computed alone and the combine reads rows by slot, so the order inside a group changes no bit).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from kvshare.kernels import decode as native
from kvshare.kernels import moe as native_moe
from kvshare.layers.linear import QLinear
from kvshare.weights.loader import load_model
from kvshare.model.moe import MoE
from kvshare.model.quantize import QuantMode
from kvshare.layers import KernelChoice, bind_model
from test_kernels_model import _quantised_checkpoint
from test_model_common import get_config
import test_moe_batched

pytestmark = pytest.mark.skipif(not native.enabled(), reason="native kernels unavailable (torch path only)")

ROWS = (1, 2, 7, 33, 300)


_moe = test_moe_batched._moe


class _Spy:
    """Counts the native calls that returned a result (so a test knows the native path ran)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = native_moe.experts

        def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            y = real(*args, **kwargs)
            self.calls += y is not None
            return y

        monkeypatch.setattr(native_moe, "experts", spy)


NATIVE = KernelChoice(batch_invariant=True, gemm=True, native=True)


def _both(moe: MoE, x: torch.Tensor, ids_in: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(native result, torch reference result) of the layer bound batch-invariant native (the
    `layers.moe_experts` equivalence test: `forward_native` against `forward_torch`)."""
    bind_model(moe, NATIVE)
    assert moe.impl == moe.forward_native
    spy = _Spy(monkeypatch)
    with torch.inference_mode():
        got = moe(x, ids_in)
        assert spy.calls == 1
        want = moe.forward_torch(x, ids_in)
    return got, want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("act", [False, True], ids=["plain", "fp8"])
@pytest.mark.parametrize("k", [1, 2])
def test_native_experts_are_bitwise_the_torch_path(dtype: torch.dtype, act: bool, k: int,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    moe = _moe(dtype, act, k)
    g = torch.Generator().manual_seed(7)
    for t in ROWS:
        x = torch.randn(t, moe.gate.cfg.hidden_size, generator=g).to(dtype)
        got, want = _both(moe, x, torch.zeros(t, dtype=torch.long), monkeypatch)
        assert got.dtype == dtype and torch.equal(got, want), (t, (got.float() - want.float()).abs().max())


def test_experts_without_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A gate bias that sends every token to experts 0 and 1: experts 2 and 3 get no rows."""
    moe = _moe(torch.bfloat16, act=True)
    with torch.no_grad():
        moe.gate.bias.copy_(torch.tensor([100.0, 90.0, 0.0, 0.0]))
    x = torch.randn(33, moe.gate.cfg.hidden_size, generator=torch.Generator().manual_seed(2)).bfloat16()
    bind_model(moe, NATIVE)
    with torch.inference_mode():
        assert set(moe.gate(x, torch.zeros(33, dtype=torch.long))[1].flatten().tolist()) == {0, 1}
    got, want = _both(moe, x, torch.zeros(33, dtype=torch.long), monkeypatch)
    assert torch.equal(got, want)


def test_rows_do_not_depend_on_the_other_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    moe = _moe(torch.bfloat16, act=True)
    x = torch.randn(33, moe.gate.cfg.hidden_size, generator=torch.Generator().manual_seed(4)).bfloat16()
    ids = torch.zeros(33, dtype=torch.long)
    spy = _Spy(monkeypatch)
    bind_model(moe, NATIVE)
    with torch.inference_mode():
        whole = moe(x, ids)
        for r in (0, 5, 32):
            assert torch.equal(moe(x[r:r + 1], ids[:1]), whole[r:r + 1]), r
        assert torch.equal(moe(x[3:10], ids[:7]), whole[3:10])
    assert spy.calls == 5


def test_fp32_matches_the_spec_formula(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 native layer against §7.2 per token in float64 (test_moe_batched's `_spec_moe`) on the
    same weights; no FP8 rounding (its rounding points could flip between fp32 and float64).
    Observed max |diff| 1.1e-5 on outputs up to 47 (3 fp32 ulps: the sums' rounding)."""
    moe = _moe(torch.float32, act=False)
    moe64 = _moe(torch.float64, act=False)
    x = torch.randn(13, moe.gate.cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    spy = _Spy(monkeypatch)
    bind_model(moe, NATIVE)
    with torch.inference_mode():
        got = moe(x, torch.zeros(13, dtype=torch.long))
    assert spy.calls == 1
    monkeypatch.setattr(test_moe_batched, "_fp8", lambda v, block: v)  # the formula without FP8 rounding
    with torch.no_grad():
        want = test_moe_batched._spec_moe(moe64, x.double())
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5)


@pytest.fixture(scope="module", params=["tiny-v4", "bench-quant"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-v4, or `kvshare bench quant`'s model at the quick sizes, written as the release stores it."""
    tmp = tmp_path_factory.mktemp("qckpt_moe")
    if request.param == "tiny-v4":
        return _quantised_checkpoint(tmp)
    from kvshare.bench.quantised import quantised_checkpoint
    from kvshare.bench.sizes import QUICK, peer_v4_config
    from kvshare.config import ModelConfig

    quantised_checkpoint(ModelConfig.from_dict(peer_v4_config(QUICK)), 0, str(tmp))
    return tmp


@pytest.mark.parametrize("quant", [True, False], ids=["fp8-act", "raw-act"])
def test_release_formats_are_bitwise_the_torch_path(checkpoint: Path, quant: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The release's formats (FP4 routed experts, FP8 shared expert, kept packed); the first layer
    is hash-routed (the token's ids pick the experts)."""
    model = load_model(checkpoint, dtype=torch.bfloat16, quant=quant)
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    assert layers[0].gate.hash_routed and not layers[-1].gate.hash_routed
    fmts = {lin.qweight.fmt for m in layers for lin in m.modules() if isinstance(lin, QLinear)}
    assert fmts == {"fp4", "fp8"}
    g = torch.Generator().manual_seed(5)
    for moe in layers:
        for t in ROWS:
            x = torch.randn(t, moe.gate.cfg.hidden_size, generator=g).bfloat16()
            tokens = torch.randint(0, moe.gate.cfg.vocab_size, (t,), generator=g)
            got, want = _both(moe, x, tokens, monkeypatch)
            assert torch.equal(got, want), (t, (got.float() - want.float()).abs().max())


def _edits(moe: MoE) -> list:
    """Ways a weight of the layer changes after its pack set was built."""
    w1 = moe.experts[1].w1

    def in_place() -> None:
        w1.weight.mul_(-1.5)

    def new_data() -> None:
        w1.weight.data = w1.weight.data * 2

    def new_parameter() -> None:
        w1.weight = torch.nn.Parameter(w1.weight.detach() * -1, requires_grad=False)

    spare = _moe(torch.bfloat16, act=True, seed=9).experts[2]  # made before any pack set: no registration later

    def new_expert() -> None:
        moe.experts[2] = spare

    return [in_place, new_data, new_parameter, new_expert]


def test_changed_weights_are_noticed(monkeypatch: pytest.MonkeyPatch) -> None:
    moe = _moe(torch.bfloat16, act=True)
    with torch.no_grad():
        moe.gate.bias.copy_(torch.tensor([0.0, 100.0, 100.0, 0.0]))  # every token uses experts 1 and 2
    x = torch.randn(9, moe.gate.cfg.hidden_size, generator=torch.Generator().manual_seed(6)).bfloat16()
    ids = torch.zeros(9, dtype=torch.long)
    for edit in _edits(moe):
        bind_model(moe, NATIVE)
        with torch.no_grad():
            before = moe(x, ids)
            edit()
        got, want = _both(moe, x, ids, monkeypatch)
        assert not torch.equal(want, before), edit.__name__
        assert torch.equal(got, want), edit.__name__


def test_bad_expert_ids_are_refused() -> None:
    moe = _moe(torch.bfloat16, act=False)
    x = torch.randn(3, moe.gate.cfg.hidden_size).bfloat16()
    packs = moe._pack_set()
    assert packs is not None
    ids = torch.tensor([[0, 1], [2, 4], [3, 0]])
    with pytest.raises(RuntimeError, match="ids holds expert 4 outside"):
        native_moe.experts(x, ids, torch.ones(3, 2), packs, 10.0, 0, 0)
    with pytest.raises(RuntimeError, match="weights must be contiguous fp32"):
        native_moe.experts(x, ids.clamp(max=3), torch.ones(3, 2, dtype=torch.float64), packs, 10.0, 0, 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_odd_widths(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """hidden 33 and expert width 35: K padded to even (bf16 pairs), no AMX tiles (K % 32 != 0)."""
    cfg = dataclasses.replace(get_config("tiny-v41"), hidden_size=33, moe_intermediate_size=35)
    moe = MoE(cfg, 0, QuantMode(False, False, False))
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.4)
    moe = moe.to(dtype).eval()
    for t in (1, 33):
        x = torch.randn(t, 33, generator=g).to(dtype)
        got, want = _both(moe, x, torch.zeros(t, dtype=torch.long), monkeypatch)
        assert torch.equal(got, want), t
