"""Attention's input and output projections in one native call each (kernels/attn_proj.py,
csrc/attn_proj.cpp, the bound layers `layers.attn_proj.AttnIn` / `AttnOut`).

1. Bitwise the torch composition of the batch-invariant mode (`AttnIn.forward_torch`'s q / kv lines
   as written out here, `AttnOut.forward_invariant`): tiny-v4 (per-head q norm) and
   tiny-v41, bf16 (fp32 norms as `cast_model` keeps them, and bf16 norms as ``.to(bf16)`` makes
   them) and fp32, FP8 input rounding on and off, T = 1, 2, 8, 33, every layer (both RoPE tables);
   odd shapes (K odd: zero-padded staging; outputs not a multiple of 16); the bench's peer V4
   model; the release's FP8 / FP4 weights kept packed.
2. Row invariance: a row alone = the same row among 33.
3. An independent oracle: fp32 against spec/model.md §4.3, §4.4 and §4.7 (inverse RoPE, grouped
   wo_a, wo_b) written out in float64.
4. Edited or replaced weights are noticed; a forward hook (tensor parallelism's reduce on wo_b)
   keeps the torch path; bad arguments are refused naming the field.
5. Engine: every sampled logits row of tiny-v4 / tiny-v41 bitwise with the fused calls on and off
   (``EngineArgs.kernel_overrides={"fused_attn_proj": False}``, what ``KVSHARE_NATIVE_ATTN_PROJ=off`` asks).
6. Binding: which implementation each choice binds.

Mutations caught (each run against a mutated copy, see the report of issue 26 part 2): V4's per-head
norm skipped in C++; the forward (S) table instead of -S in `project_out`; the x / qr / u FP8
rounding skipped; group g read at offset 0; the stamp check dropped; the generation key dropped;
the hook check dropped; bf16 norm weights passed through without their fp32 copy (refused).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from kvshare.config import ModelConfig, load_config
from kvshare.engine.engine import LLMEngine
from kvshare.kernels import attn_proj
from kvshare.kernels.pack_sets import RegisteredSet
from kvshare.kernels import decode as native
from kvshare.kernels.build import library
from kvshare.layers import attn_proj as layer
from kvshare.model import Transformer
from kvshare.model.attention import Attention
from kvshare.model.dtypes import cast_model
from kvshare.weights.loader import load_model
from test_engine_exact import greedy_random_run, spy_logits
from test_kernels_model import _quantised_checkpoint

pytestmark = pytest.mark.skipif(not native.enabled(), reason="native kernels unavailable (torch path only)")

ROWS = (1, 2, 8, 33)


def _model(name: str, dtype: torch.dtype, act: bool = False, norms32: bool = True, **cfg) -> Transformer:
    c = load_config(name)
    if cfg:
        c = ModelConfig.from_dict({**c.to_dict(), **cfg})
    m = Transformer(c, quant=act).init_weights(3).eval()
    m = cast_model(m, dtype) if norms32 else m.to(dtype)
    m.batch_invariant = True  # the linears bound row-invariant, as the fused projections are
    return m


def _rope(model: Transformer, attn: Attention):
    return model.rope_main if attn.ratio == 0 else model.rope_compress


def _torch_in(attn: Attention, x: torch.Tensor, pos: torch.Tensor, rope) -> tuple[torch.Tensor, ...]:
    """The layer's torch composition for qr, q and kv (before the window quantiser)."""
    return attn.project_in.forward_torch(x, pos, rope)


def _torch_out(attn: Attention, o: torch.Tensor, pos: torch.Tensor, rope) -> torch.Tensor:
    """The batch-invariant torch composition of the output projection."""
    return attn.project_out.forward_invariant(o.clone(), pos, rope)


def _check_layers(model: Transformer, rows=ROWS, seed: int = 0) -> None:
    """Both fused calls against the torch composition on every layer of `model`, bitwise."""
    model.batch_invariant = True  # the linears bound row-invariant, as the fused projections are
    g = torch.Generator().manual_seed(seed)
    dtype = model.embed.weight.dtype
    with torch.inference_mode():
        for i, block in enumerate(model.layers):
            attn, rope = block.attn, _rope(model, block.attn)
            for t in rows:
                x = torch.randn(t, model.cfg.hidden_size, generator=g).to(dtype)
                pos = torch.randint(0, 3000, (t,), generator=g)
                got = attn.project_in.fused(x, pos, rope)
                assert got is not None, (i, t)
                for name, a, b in zip(("qr", "q", "kv"), got, _torch_in(attn, x, pos, rope)):
                    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (
                        i, t, name, (a.float() - b.float()).abs().max())
                o = torch.randn(t, attn.n_heads, attn.head_dim, generator=g).to(dtype)
                y = attn.project_out.fused(o.clone(), pos, rope)
                want = _torch_out(attn, o, pos, rope)
                assert y is not None and y.dtype == dtype and torch.equal(y, want), (
                    i, t, (y.float() - want.float()).abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("act", [False, True], ids=["plain", "fp8"])
@pytest.mark.parametrize("name", ["tiny-v4", "tiny-v41"])
def test_fused_projections_are_bitwise_the_torch_composition(name: str, dtype: torch.dtype, act: bool) -> None:
    _check_layers(_model(name, dtype, act))


@pytest.mark.parametrize("name", ["tiny-v4", "tiny-v41"])
def test_bf16_norm_weights(name: str) -> None:
    """A model cast whole to bf16 (norm weights bf16 too): the torch path multiplies by the widened
    weight, the fused call by its fp32 copy: the same bits."""
    model = _model(name, torch.bfloat16, act=True, norms32=False)
    assert model.layers[0].attn.q_norm.weight.dtype == torch.bfloat16
    _check_layers(model, rows=(1, 8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_odd_shapes(dtype: torch.dtype) -> None:
    """K odd for wq_a / wkv (37), wq_b (21) and wo_b (39): bf16 rows zero-padded when staged; wo_a
    groups of 13 outputs (not a multiple of 16) over 3 groups."""
    _check_layers(_model("tiny-v4", dtype, hidden_size=37, q_lora_rank=21, head_dim=24, o_lora_rank=13,
                         num_attention_heads=3, o_groups=3), rows=(1, 2, 33))


def test_the_bench_model() -> None:
    """The bench's peer V4 model (bf16, hidden 768, 8 heads of 128, 2 groups): AMX-sized weights."""
    from kvshare.bench.kv_runner import DTYPES, build_model
    from kvshare.bench.sizes import BenchSizes, peer_v4_config

    s = BenchSizes()
    model = build_model(ModelConfig.from_dict(peer_v4_config(s)), s.seed, DTYPES["bfloat16"], "cpu")
    _check_layers(model, rows=(1, 8))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _quantised_checkpoint(tmp_path_factory.mktemp("qckpt"))


@pytest.mark.parametrize("act", [False, True], ids=["plain", "fp8"])
def test_packed_fp8_fp4_weights(checkpoint: Path, act: bool) -> None:
    """wq_a / wq_b / wkv / wo_b FP8 as the release stores them (their own packs), wo_a bf16."""
    model = load_model(checkpoint, dtype=torch.bfloat16, quant=act)
    attn = model.layers[0].attn
    assert attn.wq_a.qweight is not None and attn.wq_a.qweight.fmt == "fp8" and attn.wo_a.qweight is None
    _check_layers(model)


def test_rows_do_not_depend_on_the_other_rows() -> None:
    model = _model("tiny-v4", torch.bfloat16, act=True)
    attn, rope = model.layers[1].attn, model.rope_compress
    g = torch.Generator().manual_seed(4)
    x = torch.randn(33, model.cfg.hidden_size, generator=g).bfloat16()
    o = torch.randn(33, attn.n_heads, attn.head_dim, generator=g).bfloat16()
    pos = torch.arange(100, 133)
    with torch.inference_mode():
        whole = attn.project_in.fused(x, pos, rope)
        whole_y = attn.project_out.fused(o.clone(), pos, rope)
        for r in (0, 5, 32):
            one = attn.project_in.fused(x[r:r + 1], pos[r:r + 1], rope)
            assert all(torch.equal(a, b[r:r + 1]) for a, b in zip(one, whole)), r
            y = attn.project_out.fused(o[r:r + 1].clone(), pos[r:r + 1], rope)
            assert torch.equal(y, whole_y[r:r + 1]), r


def _rot64(v: torch.Tensor, pos: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """spec §4.2: the trailing 2 len(freqs) dims as complex pairs (2i, 2i + 1) times exp(i pos f_i),
    the angle pos f_i in fp32 as the spec's reference builds it (cos, sin and the products float64)."""
    rd = 2 * freqs.numel()
    ang = (pos.float().unsqueeze(-1) * freqs.float()).double() * (-1 if inverse else 1)
    ang = ang.view(pos.shape[0], *([1] * (v.dim() - 2)), -1)
    tail = torch.view_as_complex(v[..., -rd:].reshape(*v.shape[:-1], rd // 2, 2).contiguous())
    rot = torch.view_as_real(tail * torch.polar(torch.ones_like(ang), ang)).flatten(-2)
    return torch.cat([v[..., :-rd], rot], dim=-1)


def _rms64(v: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    out = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    return out if w is None else out * w.double()


@pytest.mark.parametrize("name", ["tiny-v4", "tiny-v41"])
def test_fp32_matches_the_spec_formulas(name: str) -> None:
    """fp32 fused calls against §4.3 (qr, V4's per-head norm, RoPE), §4.4 (kv) and §4.7 (inverse
    RoPE, u_g = W_a[g] o_g, y = wo_b(u)) in float64 from the same weights (RoPE angles in fp32, as
    the spec's reference). Observed max |diff| 5.2-7.2e-7 on values up to 2.9 (qr), 4.0 (q), 3.4
    (kv), 4.6 (y): 1-2 fp32 ulps."""
    model = _model(name, torch.float32)
    g = torch.Generator().manual_seed(9)
    eps = model.cfg.rms_norm_eps
    worst = {"qr": 0.0, "q": 0.0, "kv": 0.0, "y": 0.0}
    with torch.inference_mode():
        for block in model.layers:
            a, rope = block.attn, _rope(model, block.attn)
            x = torch.randn(8, model.cfg.hidden_size, generator=g)
            o = torch.randn(8, a.n_heads, a.head_dim, generator=g)
            pos = torch.randint(0, 3000, (8,), generator=g)
            qr, q, kv = a.project_in.fused(x, pos, rope)
            y = a.project_out.fused(o.clone(), pos, rope)
            x64, f = x.double(), rope.freqs64
            qr64 = _rms64(x64 @ a.wq_a.weight.double().T, a.q_norm.weight, eps)
            q64 = (qr64 @ a.wq_b.weight.double().T).view(8, a.n_heads, a.head_dim)
            if name == "tiny-v4":
                q64 = _rms64(q64, None, eps)
            q64 = _rot64(q64, pos, f)
            kv64 = _rot64(_rms64(x64 @ a.wkv.weight.double().T, a.kv_norm.weight, eps), pos, f)
            og = _rot64(o.double(), pos, f, inverse=True).reshape(8, a.n_groups, -1)
            wa = a.wo_a.weight.double().view(a.n_groups, model.cfg.o_lora_rank, -1)
            u = torch.einsum("tgi,goi->tgo", og, wa).flatten(1)
            y64 = u @ a.wo_b.weight.double().T
            for k, got, want in (("qr", qr, qr64), ("q", q, q64), ("kv", kv, kv64), ("y", y, y64)):
                worst[k] = max(worst[k], (got.double() - want).abs().max().item())
    assert max(worst.values()) < 1e-6, worst


def test_edited_and_replaced_weights_are_noticed() -> None:
    model = _model("tiny-v41", torch.bfloat16)
    attn, rope = model.layers[1].attn, model.rope_compress
    x = torch.randn(2, model.cfg.hidden_size, generator=torch.Generator().manual_seed(1)).bfloat16()
    o = torch.randn(2, attn.n_heads, attn.head_dim, generator=torch.Generator().manual_seed(2)).bfloat16()
    pos = torch.tensor([7, 8])

    def same() -> None:
        got = attn.project_in.fused(x, pos, rope)
        assert all(torch.equal(a, b) for a, b in zip(got, _torch_in(attn, x, pos, rope)))
        assert torch.equal(attn.project_out.fused(o.clone(), pos, rope), _torch_out(attn, o, pos, rope))

    with torch.no_grad():
        same()
        attn.wq_b.weight.mul_(2)  # in place: a new version of a watched weight
        attn.wo_a.weight.neg_()
        attn.kv_norm.weight.mul_(3)
        same()
        attn.wq_a.weight = nn.Parameter(attn.wq_a.weight * 0.5)  # replaced: a registration
        attn.wo_b.weight = nn.Parameter(attn.wo_b.weight * -1)
        same()


def test_a_forward_hook_keeps_the_torch_path() -> None:
    """Tensor parallelism sums wo_b's output over ranks in a forward hook: the fused call must not
    skip it (nor any other hook on the modules it stands for)."""
    model = _model("tiny-v41", torch.float32)
    model.batch_invariant = True  # binds the fused calls (this machine has the native kernels)
    attn, rope = model.layers[0].attn, model.rope_main
    o = torch.randn(1, attn.n_heads, attn.head_dim)
    pos = torch.tensor([3])
    with torch.inference_mode():
        before = attn.project_out.fused(o.clone(), pos, rope)
        assert before is not None
        handle = attn.wo_b.register_forward_hook(lambda _m, _i, out: out * 2)
        assert attn.project_out.fused(o.clone(), pos, rope) is None
        assert torch.equal(attn.project_out(o.clone(), pos, rope), 2 * before)  # the hook ran
        handle.remove()
        pre = attn.wq_a.register_forward_pre_hook(lambda _m, _i: None)
        assert attn.project_in.fused(torch.randn(1, model.cfg.hidden_size), pos, rope) is None
        pre.remove()
        assert attn.project_in.fused(torch.randn(1, model.cfg.hidden_size), pos, rope) is not None


def test_the_choice_binds_the_implementation() -> None:
    """The batched mode binds the torch composition (oneDNN's products: other bits); a batch-invariant
    model the fused calls, or with ``fused_attn_proj`` off the row-invariant torch composition.
    Mutation caught: `AttnIn.select` binding the fused call in the batched mode."""
    model = _model("tiny-v41", torch.float32)
    model.batch_invariant = False
    attn = model.layers[0].attn
    assert model.kernels.fused_attn_proj and not model.batch_invariant
    assert attn.project_in.impl == attn.project_in.forward_torch
    assert attn.project_out.impl == attn.project_out.forward_torch
    model.batch_invariant = True
    assert attn.project_in.impl == attn.project_in.forward_native
    assert attn.project_out.impl == attn.project_out.forward_native
    model.bind(model.kernels.with_(fused_attn_proj=False))
    assert attn.project_in.impl == attn.project_in.forward_torch
    assert attn.project_out.impl == attn.project_out.forward_invariant


def test_the_calls_that_keep_the_torch_path() -> None:
    """Per-call facts the fused calls fall back on (the same bits): an activation dtype the packs do
    not take (float64), autograd recording."""
    model = _model("tiny-v41", torch.float32)
    attn, rope = model.layers[0].attn, model.rope_main
    x, pos = torch.randn(1, model.cfg.hidden_size), torch.tensor([3])
    model.batch_invariant = True
    with torch.enable_grad():  # autograd recording: the torch composition
        assert attn.project_in.fused(x, pos, rope) is None
        got = attn.project_in(x, pos, rope)  # (training binds the torch reference: `train.build_model`)
        assert all(torch.equal(a, b) for a, b in zip(got, attn.project_in.forward_torch(x, pos, rope)))
    with torch.no_grad():
        assert attn.project_in.fused(x, pos, rope) is not None
        assert attn.project_in.fused(x.double(), pos, rope) is None


def test_bad_arguments_are_refused_naming_the_field() -> None:
    model = _model("tiny-v41", torch.float32)
    attn, rope = model.layers[0].attn, model.rope_main
    with torch.inference_mode():
        f = layer.fused_of(attn)
        x, pos = torch.randn(2, model.cfg.hidden_size), torch.tensor([3, 4])
        c, s, s_neg = rope.native_tables(pos)
        args = (f.packs, f.norms[0], f.norms[1], 1e-6)
        with pytest.raises(RuntimeError, match="RoPE tables must be \\[2, rd\\]"):
            attn_proj.attn_in(x, *args, c[:1], s[:1], attn.n_heads, False, 0, 0)
        with pytest.raises(RuntimeError, match="wq_b is"):
            attn_proj.attn_in(x, *args, c, s, attn.n_heads + 1, False, 0, 0)
        with pytest.raises(RuntimeError, match="q_norm weight"):
            attn_proj.attn_in(x, f.packs, torch.ones(3), f.norms[1], 1e-6, c, s, attn.n_heads, False, 0, 0)
        with pytest.raises(RuntimeError, match="FP8 block 5 of x"):
            attn_proj.attn_in(x, *args, c, s, attn.n_heads, False, 5, 0)
        with pytest.raises(RuntimeError, match="wq_a / wkv take"):
            attn_proj.attn_in(x[:, :-1].contiguous(), *args, c, s, attn.n_heads, False, 0, 0)
        with pytest.raises(RuntimeError, match="activations"):
            attn_proj.attn_in(x.bfloat16(), *args, c, s, attn.n_heads, False, 0, 0)
        o = torch.randn(2, attn.n_heads, attn.head_dim)
        with pytest.raises(RuntimeError, match="o must be a contiguous"):
            attn_proj.attn_out(o.transpose(0, 1), f.packs, c, s_neg, 0)
        with pytest.raises(RuntimeError, match="do not split into"):
            attn_proj.attn_out(torch.randn(2, 1, attn.head_dim + 1), f.packs, c, s_neg, 0)
        with pytest.raises(RuntimeError, match="with 2 L pack tensors"):  # a set must hold 2 tensors a linear
            RegisteredSet([torch.zeros(1)] * 8, torch.zeros(5, 6, dtype=torch.int64), [])
    assert library() is not None


def _serve(name: str, dtype: torch.dtype, fused: bool, monkeypatch: pytest.MonkeyPatch):
    """Greedy tokens and every sampled logits row of a batch-invariant paged engine (chunked
    prefill, batched decode), with the fused projections on or off; and how many fused calls ran."""
    model = Transformer(load_config(name), quant=True).init_weights(3).eval()
    calls = [0]
    real_in, real_out = attn_proj.attn_in, attn_proj.attn_out

    def count(real):
        def call(*a):
            out = real(*a)
            calls[0] += out is not None
            return out
        return call

    monkeypatch.setattr(attn_proj, "attn_in", count(real_in))
    monkeypatch.setattr(attn_proj, "attn_out", count(real_out))
    v4 = name == "tiny-v4"  # its ratio-128 layer needs blocks of 128
    eng = LLMEngine(model, batch_invariant=True, dtype=str(dtype).split(".")[1], block_size=128 if v4 else 16,
                    num_blocks=12 if v4 else 40, max_num_seqs=4, max_num_batched_tokens=19,
                    kernel_overrides=None if fused else {"fused_attn_proj": False})
    rows = spy_logits(eng)
    done = greedy_random_run(eng, model.cfg.vocab_size, (37, 5, 23, 140), seed=4)
    monkeypatch.undo()
    return done, rows, calls[0], model.cfg.num_hidden_layers


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", ["tiny-v4", "tiny-v41"])
def test_engine_logits_are_bitwise_with_the_fused_calls_on_and_off(name: str, dtype: torch.dtype,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    ref_tokens, ref_rows, ref_calls, _ = _serve(name, dtype, False, monkeypatch)
    tokens, rows, calls, layers = _serve(name, dtype, True, monkeypatch)
    assert ref_calls == 0 and calls >= 2 * layers * 10  # both calls in every layer of every step
    assert tokens == ref_tokens and rows.keys() == ref_rows.keys()
    for k in rows:
        assert torch.equal(rows[k], ref_rows[k]), k
