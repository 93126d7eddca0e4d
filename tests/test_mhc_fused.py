"""A sublayer's mHC work in one native call (kernels/mhc.py, csrc/mhc.cpp) against its references.

The fused calls compose the unfused native calls (RMS statistic, fp32 mix GEMM, `mhc_post`,
`mhc_collapse`, the sublayer RMSNorm; `mhc_expand` first at a boundary) in `model/mhc.py`'s order,
so each is compared bitwise with

* the unfused native composition (`layers.mhc.NativeMhc` + an `RMSNorm` bound native), and
* the torch path (`layers.mhc.TorchMhc(invariant=True)`: the batch-invariant reference),

for V4 (collapse with the mix's own pre) and V4.1 (a given, lagged pre), T = 1, 2, 8, 33 (rows of
a smaller call equal those rows of the 33-row call: row invariance), bf16 and fp32 streams, fp32
and bf16 small weights; and with the spec's formulas (spec/model.md §7.1, `model/mhc.py`'s module
doc) written out here in float64, within the observed error. Then whole engines (tiny-v4, tiny-v41;
bf16, fp32): greedy tokens and every sampled logits row bitwise equal with the fused calls on and
off (``kernel_overrides={"fused_mhc": False}``).

Mutations run while writing this (each failed the tests named): the boundary's enter reading the
streams before the expand (`h` for `hn` in mhc.cpp: the 6 boundary tests); the collapse always with
the mix's own pre (the V4.1 cases of the enter / boundary tests, 8, and the two tiny-v41 engine
tests); the sublayer norm without its weight (all 26 enter / boundary / head tests); the head's
bias left out of the sigmoid's argument (the 4 V4 head tests); in the model, the boundary
collapsing with the block's incoming pre instead of the attention mix's (the tiny-v41 engine
tests); the dtype guards before boundary / leave removed (the other-dtype test: a RuntimeError).
Not caught, by design: the mix GEMM forced to the AVX2 code under AVX-512 (fp32 packs sum in the
same order on both paths, so the same bits).
"""

from __future__ import annotations

import math

import pytest
import torch

from kvshare.config import load_config
from kvshare.engine.engine import LLMEngine
from kvshare.kernels import decode as native
from kvshare.kernels import mhc as fused
from kvshare.kernels import available as kernels_available, pack_fp32
from kvshare.layers import KernelChoice
from kvshare.layers.mhc import HcWeights, Mix, NativeMhc, TorchMhc
from kvshare.model import Transformer
from kvshare.layers.norm import RMSNorm
from test_engine_exact import greedy_random_run, spy_logits

pytestmark = pytest.mark.skipif(not kernels_available(), reason="native kernels unavailable on this machine")

ROWS = (1, 2, 8, 33)
HC, D, ITERS, RMS_EPS, HC_EPS, NORM_EPS = 4, 96, 20, 1e-6, 1e-6, 1e-5


def _case(dtype: torch.dtype, seed: int, wdtype: torch.dtype = torch.float32, n_mix: int = (2 + HC) * HC,
          n_scale: int = 3) -> dict:
    """33 rows of streams, a sublayer output, a lagged pre, and one sublayer's mix + norm weights."""
    g = torch.Generator().manual_seed(seed)
    k = HC * D
    return dict(
        h=(torch.randn(33, HC, D, generator=g) * 2).to(dtype),
        y=torch.randn(33, D, generator=g).to(dtype),
        pre_prev=torch.rand(33, HC, generator=g) + 0.1,
        fn=torch.randn(n_mix, k, generator=g) / math.sqrt(k),
        base=(0.5 * torch.randn(n_mix, generator=g)).to(wdtype),
        scale=(1.0 + 0.1 * torch.randn(n_scale, generator=g)).to(wdtype),
        norm_w=(1.0 + 0.1 * torch.randn(D, generator=g)).to(wdtype),
    )


NATIVE = KernelChoice(batch_invariant=True, gemm=True, native=True)


def _norm(w: torch.Tensor, kind: str = "torch") -> RMSNorm:
    n = RMSNorm(D, NORM_EPS)
    n.weight.data = w.clone()
    n.bind(NATIVE if kind == "native" else KernelChoice(batch_invariant=True))
    return n.requires_grad_(False)


def _impl(kind: str) -> TorchMhc:
    """The batch-invariant mHC implementation with the native kernels ("native") or without ("torch")."""
    return NativeMhc() if kind == "native" else TorchMhc(invariant=True)


def _w(c: dict) -> HcWeights:
    return HcWeights(c["fn"], c["base"], c["scale"], RMS_EPS, HC_EPS, ITERS)


def _ref_enter(h: torch.Tensor, c: dict, lagged: bool, kind: str):
    """The unfused sublayer entry (`NativeMhc` / `TorchMhc`)."""
    with torch.no_grad():
        x, mix = _impl(kind).enter(h, _w(c), _norm(c["norm_w"], kind), c["pre_prev"][: h.shape[0]] if lagged else None)
        return x, mix.pre, mix.post, mix.comb


def _ref_expand(h: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, kind: str) -> torch.Tensor:
    with torch.no_grad():
        return _impl(kind).leave(h, y, Mix(post, post, comb))


def _enter(h: torch.Tensor, c: dict, lagged: bool):
    return fused.enter(h, pack_fp32(c["fn"]), c["base"], c["scale"], c["pre_prev"][: h.shape[0]] if lagged else None,
                       c["norm_w"], NORM_EPS, RMS_EPS, HC_EPS, ITERS)


def _spec_mix(h: torch.Tensor, c: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps 1-3 of model/mhc.py's module doc in float64."""
    t = h.shape[0]
    flat = h.double().reshape(t, -1)
    m = (flat / torch.sqrt(flat.pow(2).mean(-1, keepdim=True) + RMS_EPS)) @ c["fn"].double().t()
    b, s = c["base"].double(), c["scale"].double()
    pre = torch.sigmoid(m[:, :HC] * s[0] + b[:HC]) + HC_EPS
    post = 2 * torch.sigmoid(m[:, HC:2 * HC] * s[1] + b[HC:2 * HC])
    comb = torch.softmax((m[:, 2 * HC:] * s[2] + b[2 * HC:]).view(t, HC, HC), -1) + HC_EPS
    comb = comb / (comb.sum(-2, keepdim=True) + HC_EPS)
    for _ in range(ITERS - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + HC_EPS)
        comb = comb / (comb.sum(-2, keepdim=True) + HC_EPS)
    return pre, post, comb


def _spec_x(h: torch.Tensor, pre: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Step 4's collapse, then the sublayer RMSNorm (spec §4.1), in float64."""
    xc = (pre.double().unsqueeze(-1) * h.double()).sum(1)
    return xc / torch.sqrt(xc.pow(2).mean(-1, keepdim=True) + NORM_EPS) * w.double()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).abs().max() / b.abs().max())


#: tolerances against float64 over the observed errors of the tests below: x (the normed sublayer
#: input) relative to its max, observed up to 4.6e-3 in bf16 (about one bf16 ulp: the collapse and the
#: norm each round once) and 2.1e-7 in fp32; the expanded streams (one rounding) 2.2e-3 / 9.2e-8;
#: pre / post / comb absolute (values up to 1.9), observed up to 2.2e-7
X_TOL = {torch.bfloat16: 6e-3, torch.float32: 3e-7}
H_TOL = {torch.bfloat16: 3e-3, torch.float32: 1.5e-7}
MIX_TOL = 3e-7


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lagged", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_enter_gives_the_bits_of_the_unfused_calls_and_the_torch_path(dtype, lagged, wdtype) -> None:
    c = _case(dtype, 1 + 2 * lagged, wdtype)
    want_torch = _ref_enter(c["h"], c, lagged, "torch")
    for t in ROWS:
        got = _enter(c["h"][:t], c, lagged)
        want_native = _ref_enter(c["h"][:t], c, lagged, "native")
        for name, a, b, r in zip(("x", "pre", "post", "comb"), got, want_native, want_torch):
            assert a.dtype == b.dtype and torch.equal(a, b), (t, name)
            assert torch.equal(a, r[:t]), (t, name)  # and the torch path's bits for those rows of a 33-row call


@pytest.mark.parametrize("lagged", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_enter_follows_the_spec_formulas(dtype, lagged) -> None:
    """Observed (33 rows): pre / post / comb within 2.2e-7 of float64; x within 4.6e-3 (bf16) and
    1.5e-7 (fp32) of float64, relative to its max."""
    c = _case(dtype, 5 + lagged)
    x, pre, post, comb = _enter(c["h"], c, lagged)
    s_pre, s_post, s_comb = _spec_mix(c["h"], c)
    for a, b in ((pre, s_pre), (post, s_post), (comb, s_comb)):
        assert (a.double() - b).abs().max() < MIX_TOL
    want_x = _spec_x(c["h"], c["pre_prev"] if lagged else s_pre, c["norm_w"])
    assert _rel(x, want_x) < X_TOL[dtype]
    # not vacuous: the mixes move the collapse away from a plain stream mean
    assert (comb.sum(-2) - 1).abs().max() < 3e-6 and pre.std() > 0.05


@pytest.mark.parametrize("lagged", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_boundary_gives_the_bits_of_expand_then_enter(dtype, lagged) -> None:
    prev = _case(dtype, 11)  # the finished sublayer's mixes come from another weight set
    c = _case(dtype, 12 + lagged)
    _, pre_a, post_a, comb_a = _ref_enter(prev["h"], prev, False, "native")
    want_h = _ref_expand(c["h"], c["y"], post_a, comb_a, "torch")
    want_torch = _ref_enter(want_h, c, lagged, "torch")
    for t in ROWS:
        got = fused.boundary(c["h"][:t], c["y"][:t], post_a[:t], comb_a[:t], pack_fp32(c["fn"]), c["base"], c["scale"],
                             c["pre_prev"][:t] if lagged else None, c["norm_w"], NORM_EPS, RMS_EPS, HC_EPS, ITERS)
        hn = _ref_expand(c["h"][:t], c["y"][:t], post_a[:t], comb_a[:t], "native")
        want_native = (hn, *_ref_enter(hn, c, lagged, "native"))
        for name, a, b, r in zip(("h", "x", "pre", "post", "comb"), got, want_native, (want_h, *want_torch)):
            assert a.dtype == b.dtype and torch.equal(a, b), (t, name)
            assert torch.equal(a, r[:t]), (t, name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_boundary_follows_the_spec_formulas(dtype) -> None:
    """The expanded streams against step 4 in float64 (observed relative to the max: 2.2e-3 in bf16,
    half an ulp; 9.2e-8 in fp32), and pre and x against the formulas on them (8.7e-8; 3.3e-3 / 8.8e-8)."""
    prev, c = _case(dtype, 21), _case(dtype, 22)
    _, _, post_a, comb_a = _enter(prev["h"], prev, False)
    hn, x, pre, _, _ = fused.boundary(c["h"], c["y"], post_a, comb_a, pack_fp32(c["fn"]), c["base"], c["scale"], None,
                                      c["norm_w"], NORM_EPS, RMS_EPS, HC_EPS, ITERS)
    want_h = (torch.einsum("tjk,tjd->tkd", comb_a.double(), c["h"].double())
              + post_a.double().unsqueeze(-1) * c["y"].double().unsqueeze(1))
    assert _rel(hn, want_h) < H_TOL[dtype]
    s_pre, _, _ = _spec_mix(hn, c)
    assert (pre.double() - s_pre).abs().max() < MIX_TOL
    assert _rel(x, _spec_x(hn, s_pre, c["norm_w"])) < X_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_leave_gives_the_bits_of_the_expand_for_any_strides(dtype) -> None:
    c = _case(dtype, 25)
    _, _, post, comb = _enter(c["h"], c, False)
    want_torch = _ref_expand(c["h"], c["y"], post, comb, "torch")
    y_strided = c["y"].t().contiguous().t()  # the same values, column-major
    h_strided = c["h"].transpose(0, 1).contiguous().transpose(0, 1)
    for t in ROWS:
        got = fused.leave(h_strided[:t], y_strided[:t], post[:t], comb[:t])
        assert got.is_contiguous() and torch.equal(got, native.mhc_expand(c["h"][:t], c["y"][:t], post[:t], comb[:t])), t
        assert torch.equal(got, want_torch[:t]), t
    with pytest.raises(RuntimeError, match="y has dtype"):
        fused.leave(c["h"], c["y"].double(), post, comb)


def _ref_head(h: torch.Tensor, c: dict, v4: bool, kind: str) -> torch.Tensor:
    """The unfused tail (`NativeMhc.head` / `TorchMhc.head`)."""
    with torch.no_grad():
        pre = None if v4 else c["pre_prev"][: h.shape[0]]
        return _impl(kind).head(h, pre, _norm(c["norm_w"], kind), _w(c) if v4 else None, RMS_EPS, HC_EPS)


def _head(h: torch.Tensor, c: dict, v4: bool) -> torch.Tensor:
    if v4:
        return fused.head(h, None, c["norm_w"], NORM_EPS, RMS_EPS, HC_EPS, pack_fp32(c["fn"]), c["base"], c["scale"])
    return fused.head(h, c["pre_prev"][: h.shape[0]], c["norm_w"], NORM_EPS, RMS_EPS, HC_EPS)


@pytest.mark.parametrize("v4", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_head_gives_the_bits_of_the_unfused_tail_and_the_torch_path(dtype, v4) -> None:
    c = _case(dtype, 31 + v4, n_mix=HC, n_scale=1)
    want_torch = _ref_head(c["h"], c, v4, "torch")
    for t in ROWS:
        got = _head(c["h"][:t], c, v4)
        assert torch.equal(got, _ref_head(c["h"][:t], c, v4, "native")), t
        assert torch.equal(got, want_torch[:t]), t


@pytest.mark.parametrize("v4", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_head_follows_the_spec_formulas(dtype, v4) -> None:
    """V4's head pre = sigmoid(fn . rms(flat h) * scale + base) + hc_eps, then collapse and norm, in
    float64 (observed relative to the max: 4.1e-3 in bf16, 2.1e-7 in fp32)."""
    c = _case(dtype, 41 + v4, n_mix=HC, n_scale=1)
    if v4:
        flat = c["h"].double().reshape(33, -1)
        m = (flat / torch.sqrt(flat.pow(2).mean(-1, keepdim=True) + RMS_EPS)) @ c["fn"].double().t()
        pre = torch.sigmoid(m * c["scale"].double() + c["base"].double()) + HC_EPS
    else:
        pre = c["pre_prev"]
    assert _rel(_head(c["h"], c, v4), _spec_x(c["h"], pre, c["norm_w"])) < X_TOL[dtype]


def test_bad_inputs_name_the_argument() -> None:
    c = _case(torch.float32, 51)
    p = pack_fp32(c["fn"])
    args = (c["base"], c["scale"], None, c["norm_w"], NORM_EPS, RMS_EPS, HC_EPS, ITERS)
    with pytest.raises(RuntimeError, match=r"mhc_enter: fn must be the fp32 pack of a \[24, 384\]"):
        fused.enter(c["h"], pack_fp32(c["fn"][:, :200]), *args)
    with pytest.raises(RuntimeError, match="mhc_enter: h must be .* D >= 8"):
        fused.enter(c["h"][:, :, :4], p, *args)
    with pytest.raises(RuntimeError, match="mhc_enter: base must have 24 entries"):
        fused.enter(c["h"], p, c["base"][:5], *args[1:])
    with pytest.raises(RuntimeError, match="mhc_enter: norm_w must have 96 entries"):
        fused.enter(c["h"], p, c["base"], c["scale"], None, c["norm_w"][:3], *args[4:])
    with pytest.raises(RuntimeError, match=r"mhc_enter: collapse_pre must be \[33, 4\]"):
        fused.enter(c["h"], p, c["base"], c["scale"], c["pre_prev"][:3], *args[3:])
    _, _, post, comb = _enter(c["h"], c, False)
    with pytest.raises(RuntimeError, match="y has dtype"):
        fused.boundary(c["h"], c["y"].bfloat16(), post, comb, p, *args)
    with pytest.raises(RuntimeError, match="mhc_boundary: shapes do not fit"):
        fused.boundary(c["h"], c["y"], post[:2], comb, p, *args)
    with pytest.raises(RuntimeError, match="mhc_head: give either fn, base and scale"):
        fused.head(c["h"], None, c["norm_w"], NORM_EPS, RMS_EPS, HC_EPS)
    with pytest.raises(ValueError, match="fn must be packed as fp32"):
        fused.enter(c["h"], _bf16_pack(c["fn"]), *args)


def _bf16_pack(w: torch.Tensor):
    from kvshare.kernels import pack_bf16

    return pack_bf16(w.bfloat16())


_REAL = {fn: getattr(fused, fn) for fn in ("enter", "boundary", "leave", "head")}  # before any test wraps them


def _serve(name: str, dtype: torch.dtype, on: bool, monkeypatch: pytest.MonkeyPatch):
    """Greedy tokens and every sampled logits row of a paged engine (chunked prefill, batched decode),
    with the fused mHC calls on or off (the engine's kernel override); and the fused calls made."""
    calls = {"enter": 0, "boundary": 0, "leave": 0, "head": 0}
    for fn in calls:
        real = _REAL[fn]

        def counted(*a, _real=real, _fn=fn, **kw):
            calls[_fn] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(fused, fn, counted)
    model = Transformer(load_config(name), quant=False).init_weights(3).eval()
    eng = LLMEngine(model, batch_invariant=True, quantize=False, dtype=str(dtype).split(".")[1], max_num_seqs=4,
                    max_num_batched_tokens=19, kernel_overrides={"fused_mhc": on})
    rows = spy_logits(eng)
    return greedy_random_run(eng, model.cfg.vocab_size, (37, 5, 23, 11), seed=6), rows, calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", ["tiny-v4", "tiny-v41"])
def test_engine_tokens_and_logits_are_bitwise_the_unfused_ones(name: str, dtype: torch.dtype,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    ref_tokens, ref_rows, ref_calls = _serve(name, dtype, False, monkeypatch)
    tokens, rows, calls = _serve(name, dtype, True, monkeypatch)
    assert sum(ref_calls.values()) == 0
    layers = load_config(name).num_hidden_layers
    assert calls["enter"] == calls["boundary"] == calls["leave"] == layers * calls["head"]  # every block ...
    assert calls["head"] >= 10  # ... of every forward
    assert tokens == ref_tokens and len(tokens) == 4
    assert rows.keys() == ref_rows.keys()
    for k in rows:
        assert torch.equal(rows[k], ref_rows[k]), k


def _forward_logits(model: Transformer, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    """Logits of a prefill of every prompt in one step, then `steps` greedy decode steps of the batch."""
    from kvshare.cache.dense import DenseCache
    from kvshare.step import StepBatch

    n = len(prompts)
    cache = DenseCache(model.cfg, model.topo, n, max(map(len, prompts)) + steps + 1, dtype=torch.bfloat16)
    seqs, out = [list(p) for p in prompts], []
    starts, lens, ids = [0] * n, [len(p) for p in prompts], [t for p in prompts for t in p]
    with torch.inference_mode():
        for _ in range(steps + 1):
            batch = StepBatch.build(starts, lens, list(range(n)), logit_rows=[sum(lens[:i + 1]) - 1 for i in range(n)])
            out.append(model(torch.tensor(ids), batch, cache))
            ids = out[-1].argmax(-1).tolist()
            for s, t in zip(seqs, ids):
                s.append(t)
            starts, lens = [len(s) - 1 for s in seqs], [1] * n
    return out


def test_a_sublayer_output_in_another_dtype_takes_the_unfused_expand(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sublayer output whose dtype is not the streams' (here: attention and MoE returning fp32 values
    off the bf16 grid in a bf16 model) is expanded as the unfused path expands it (torch's expand of the
    fp32 values), so the fused forward keeps the unfused forward's bits; rounding that output to bf16
    first (what the boundary / leave calls would need) changes the logits, so the case is not vacuous."""
    from kvshare.model.attention import Attention
    from kvshare.model.moe import MoE

    model = Transformer(load_config("tiny-v41"), quant=False).init_weights(9).eval().to(torch.bfloat16)
    model.batch_invariant = True
    prompts = [[5, 9, 13, 2, 7, 11, 30], [3, 1, 4]]
    real, real_moe = Attention.forward, MoE.forward
    monkeypatch.setattr(Attention, "forward", lambda self, *a: real(self, *a).float() * (1 + 2 ** -12))
    monkeypatch.setattr(MoE, "forward", lambda self, *a: real_moe(self, *a).float() * (1 + 2 ** -12))
    fused_choice = model.kernels
    assert fused_choice.fused_mhc
    model.bind(fused_choice.with_(fused_mhc=False))
    want = _forward_logits(model, prompts, 3)
    model.bind(fused_choice)
    got = _forward_logits(model, prompts, 3)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    monkeypatch.setattr(Attention, "forward", lambda self, *a: (real(self, *a).float() * (1 + 2 ** -12)).bfloat16())
    monkeypatch.setattr(MoE, "forward", lambda self, *a: (real_moe(self, *a).float() * (1 + 2 ** -12)).bfloat16())
    assert not all(torch.equal(a, b) for a, b in zip(_forward_logits(model, prompts, 3), want))
