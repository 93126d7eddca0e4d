"""Native decode kernels (kvshare/kernels/decode.py, csrc/decode.cpp) against the torch path.

Each kernel is compared with the torch code it replaces in the model (`model/mhc.py` with the
native kernels switched off), which is the reference: the same bits are asserted, because the
kernels do the same operations in the same order (SLEEF's expf for torch's vector sigmoid /
softmax, sequential sums, the fma chain of torch's batched product for expand). Then whole
forwards: a V4 and a V4.1 model, prefill + decode rows at several batch sizes, give bitwise the
same logits with the kernels on and off, in bf16 and fp32. Row invariance: a row of a 33-row call
equals that row alone.

Mutations caught (run while writing the kernels, each failed the bitwise comparison): the gate's
sqrt correctly rounded (``_mm256_sqrt_ps``) instead of MKL's vmsSqrt that torch.sqrt calls (the
tiny-v4 fp32 forward differs at layer 4; 25 of 4,096 scores); the MoE combine
summing every channel in one order (torch uses another for the channels after the last whole
group of 32: the D = 100 combine tests with k = 6 / 20 fail); RMSNorm's sum
of squares taken sequentially instead of in torch's inner-sum order (12 rms tests fail); the compressor
pooling summed sequentially instead of torch's cascade (the 128- to 300-slot pooling tests fail); RoPE with
its first product fused into the add (fmaf: the fp32 rope tests fail); glibc
``expf`` instead of SLEEF's (pre / post / comb 1 ulp off on some rows); the softmax sum as a tree
((a0 + a2) + (a1 + a3)) or a division by the sum instead of the reciprocal product (comb differs;
emulated in torch first: 2,025 / 1,399 of 8,000 values); expand with rounded products instead of
the fma chain (3,598 of 9,216 values differ). Not distinguishable here: collapse from +0 vs from the
first product (they differ only for a product of -0).
"""

from __future__ import annotations

import pytest
import torch

from kvshare.config import load_config
from kvshare.kernels import available
from kvshare.kernels import decode as native
from kvshare.kernels import mhc as fused_mhc
from kvshare.kernels import moe as native_moe
from kvshare.layers import KernelChoice
from kvshare.model import Transformer
from kvshare.layers import mhc_torch as mhc
from kvshare.cache.dense import DenseCache
from kvshare.step import StepBatch

pytestmark = pytest.mark.skipif(not available(), reason="native kernels unavailable on this machine")

ROWS = (1, 2, 7, 8, 33)


#: a model / layer bound to the native kernels in the batch-invariant mode (the exact kernels; the
#: native attention off: its own summation order)
NATIVE = KernelChoice(batch_invariant=True, gemm=True, native=True, fused_mhc=True, fused_attn_proj=True)


def _mixes(t: int, hc: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(t, (2 + hc) * hc, generator=g) * 3
    return m, torch.randn((2 + hc) * hc, generator=g), torch.rand(3, generator=g) + 0.5


@pytest.mark.parametrize("hc", [4, 3])
@pytest.mark.parametrize("t", ROWS)
def test_mhc_post_gives_the_bits_of_the_torch_mix(t: int, hc: int) -> None:
    m, base, scale = _mixes(t, hc, 10 * t + hc)
    pre, post, comb = native.mhc_post(m, base, scale, hc, 1e-6, 20)
    want_pre = mhc.hc_pre_of(m, base, scale, hc, 1e-6, True)  # the batch-invariant torch reference
    want_post, want_comb = mhc.hc_post_comb(m, base, scale, hc, 1e-6, 20, True)
    assert torch.equal(pre, want_pre) and torch.equal(post, want_post) and torch.equal(comb, want_comb)
    # not a trivial comb: Sinkhorn ended on a column division by (sum + eps), so columns sum to
    # 1 - O(eps) (observed 1.1e-6 off), and brought the rows near 1 (observed within 0.03 after
    # 20 iterations on these mixes)
    assert (comb.sum(-2) - 1).abs().max() < 3e-6 and (comb.sum(-1) - 1).abs().max() < 0.1


def test_sinkhorn_gives_the_bits_of_the_numpy_loop() -> None:
    m, _, _ = _mixes(33, 4, 5)
    comb = torch.softmax(m[:, 8:].reshape(33, 4, 4), -1) + 1e-6
    want = mhc._sinkhorn_numpy(comb.clone(), 1e-6, 20)
    assert torch.equal(native.sinkhorn_(comb.clone(), 1e-6, 20), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [101, 768, 300])
def test_collapse_and_expand_give_the_bits_of_the_torch_ones(dtype: torch.dtype, d: int) -> None:
    g = torch.Generator().manual_seed(d)
    t, hc = 33, 4
    h = torch.randn(t, hc, d, generator=g).to(dtype)
    y = torch.randn(t, d, generator=g).to(dtype)
    pre, post, comb = native.mhc_post(*_mixes(t, hc, d), hc, 1e-6, 20)
    want_x, want_h = mhc.hc_collapse(h, pre), mhc.hc_expand(h, y, post, comb)
    for n in ROWS:  # every call size gives each row the bits of the torch path's whole call
        assert torch.equal(native.mhc_collapse(h[:n], pre[:n]), want_x[:n]), n
        assert torch.equal(native.mhc_expand(h[:n], y[:n], post[:n], comb[:n]), want_h[:n]), n
    # and the torch path is the formula (fp32 sums of 4 terms; observed max error 0 / 1 bf16 ulp)
    exact_x = (pre.double().unsqueeze(-1) * h.double()).sum(1)
    assert (want_x.double() - exact_x).abs().max() <= (8e-3 if dtype == torch.bfloat16 else 1e-6) * exact_x.abs().max()


def test_bad_inputs_name_the_argument() -> None:
    m, base, scale = _mixes(2, 4, 0)
    with pytest.raises(RuntimeError, match="hc must be in"):
        native.mhc_post(m, base, scale, 17, 1e-6, 20)
    with pytest.raises(RuntimeError, match="kernels.mhc_post: m must be"):
        native.mhc_post(m[:, :10], base, scale, 4, 1e-6, 20)
    h = torch.zeros(2, 4, 8)
    with pytest.raises(RuntimeError, match="mhc_collapse: h .* and pre"):
        native.mhc_collapse(h, torch.zeros(3, 4))
    with pytest.raises(RuntimeError, match="h must be bf16 or fp32"):
        native.mhc_collapse(h.double(), torch.zeros(2, 4))


def _model_and_prompts(name: str, dtype: torch.dtype, n_seq: int) -> tuple[Transformer, list[list[int]]]:
    model = Transformer(_config(name), quant=False).init_weights(7).eval().to(dtype)
    model.batch_invariant = True
    g = torch.Generator().manual_seed(n_seq)
    return model, [torch.randint(0, model.cfg.vocab_size, (int(n),), generator=g).tolist() for n in (21, 9, 14)[:n_seq]]


def _config(name: str):
    """A shipped tiny config; ``NAME/64``: with 64-wide heads and index keys (the compressor pooling
    kernel serves dims that are multiples of 64)."""
    import json

    from kvshare.config import ModelConfig
    from kvshare.shipped import resolve_config_path

    base, _, wide = name.partition("/")
    if not wide:
        return load_config(base)
    raw = json.loads(resolve_config_path(base).read_text())
    raw.update(head_dim=int(wide), index_head_dim=int(wide))
    return ModelConfig.from_dict(raw)


def _logits(model: Transformer, prompts: list[list[int]], decode_steps: int, on: bool, attention: bool = False,
            feed: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Prefill every prompt in one step, then decode `decode_steps` steps of the whole batch (the
    argmax token appended, or the argmax of `feed`'s logits of that step), with the native kernels
    `on` or off (and the native attention as `attention` says); the logits of every step."""
    model.bind(NATIVE.with_(attention=attention) if on else KernelChoice(batch_invariant=True, gemm=True))
    n = len(prompts)
    cache = DenseCache(model.cfg, model.topo, n, max(map(len, prompts)) + decode_steps + 1,
                       dtype=next(model.parameters()).dtype)
    out = []
    seqs = [list(p) for p in prompts]
    starts, lens = [0] * n, [len(p) for p in prompts]
    ids = [t for p in prompts for t in p]
    with torch.inference_mode():
        for _ in range(decode_steps + 1):
            ends = [sum(lens[:i + 1]) - 1 for i in range(n)]
            batch = StepBatch.build(starts, lens, list(range(n)), logit_rows=ends)
            x = model(torch.tensor(ids), batch, cache)
            out.append(x)
            nxt = (x if feed is None else feed[len(out) - 1]).argmax(-1).tolist()
            for i in range(n):
                seqs[i].append(nxt[i])
            starts = [len(s) - 1 for s in seqs]
            lens = [1] * n
            ids = nxt
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", ["tiny-v4", "tiny-v41", "tiny-v4/64", "tiny-v41/64"])
@pytest.mark.parametrize("n_seq", [1, 3])
def test_model_logits_are_bitwise_the_torch_paths(name: str, dtype: torch.dtype, n_seq: int,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Every exact kernel on (the native attention off): the torch path's logits, bit for bit."""
    model, prompts = _model_and_prompts(name, dtype, n_seq)
    ref = _logits(model, prompts, 4, on=False)
    calls, pools, moe, proj = [], [], [], []
    real, real_pool, real_moe, real_proj = native.mhc_expand, native.compress_pool, native_moe.experts, native.project_wide
    real_boundary, real_leave = fused_mhc.boundary, fused_mhc.leave
    monkeypatch.setattr(native, "mhc_expand", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(fused_mhc, "boundary", lambda *a: calls.append(1) or real_boundary(*a))  # expands too
    monkeypatch.setattr(fused_mhc, "leave", lambda *a: calls.append(1) or real_leave(*a))
    monkeypatch.setattr(native, "compress_pool", lambda *a: pools.append(1) or real_pool(*a))
    monkeypatch.setattr(native_moe, "experts", lambda *a: moe.append(1) or real_moe(*a))
    monkeypatch.setattr(native, "project_wide", lambda *a: proj.append(len(a) > 2 and a[2] is not None) or real_proj(*a))
    got = _logits(model, prompts, 4, on=True)
    assert len(calls) == 5 * 2 * model.cfg.num_hidden_layers  # the kernels ran: every sublayer of every step
    assert len(moe) == 5 * model.cfg.num_hidden_layers  # the one-call experts (kernels/moe.py) in every MoE
    # the compressors' fp32 projections (and fp32 gates') in one call each (V4's compressors with their APE)
    assert proj and any(proj) == (model.cfg.arch == "v4")
    assert bool(pools) == name.endswith("/64")  # the compressor pooling where its dims allow
    for step, (a, b) in enumerate(zip(got, ref)):
        assert torch.equal(a, b), step


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 8, 128), (7, 3, 40), (33, 64)])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_gives_the_bits_of_the_torch_rotation(dtype: torch.dtype, shape: tuple[int, ...], inverse: bool) -> None:
    """`layers.rope.RotaryEmbedding` bound native = bound torch, bitwise. Mutation caught (run): the
    native implementation handing the kernel S for -S (the inverse flag ignored)."""
    from kvshare.layers.rope import RotaryEmbedding

    g = torch.Generator().manual_seed(sum(shape))
    rope = RotaryEmbedding(shape[-1] // 2 if shape[-1] != 40 else 16, 160000.0, None)
    x = torch.randn(*shape, generator=g).to(dtype)
    pos = torch.randint(0, 5000, (shape[0],), generator=g)
    want = rope.rotate(x, pos, inverse=inverse)  # a layer is built bound to the torch reference
    rope.bind(KernelChoice(gemm=True, native=True))  # the native kernel in every mode
    assert rope.impl == rope.forward_native
    got = rope.rotate(x, pos, inverse=inverse)
    assert torch.equal(got, want)
    y = x.clone()
    assert rope.rotate(y, pos, inverse=inverse, inplace=True) is y and torch.equal(y, want)
    # the rotation itself: the complex product in float64 at the module's fp32 angles (observed
    # max error / max |output| 2.7e-3 bf16 (the output's rounding), 9.5e-8 fp32)
    rd = rope.rope_dim
    ang = (pos.float()[:, None] * rope.freqs64.float()).double() * (-1 if inverse else 1)
    ang = ang.view(shape[0], *([1] * (len(shape) - 2)), rd // 2)
    a, b = x[..., -rd::2].double(), x[..., -rd + 1::2].double()
    exact = torch.stack([a * ang.cos() - b * ang.sin(), a * ang.sin() + b * ang.cos()], -1).flatten(-2)
    tol = 4e-3 if dtype == torch.bfloat16 else 2e-7
    assert (got[..., -rd:].double() - exact).abs().max() <= tol * exact.abs().max()
    assert torch.equal(got[..., :-rd], x[..., :-rd])


def _torch_pool(hist: torch.Tensor, valid: torch.Tensor | None, d: int, overlap: bool) -> torch.Tensor:
    """`Compressor.forward`'s pooling written as the torch path has it."""
    w = (2 if overlap else 1) * d
    kv, score = hist[..., :w], hist[..., w:]
    if overlap:
        r = hist.shape[1] // 2
        kv = torch.cat([kv[:, :r, :d], kv[:, r:, d:]], dim=1)
        score = torch.cat([score[:, :r, :d], score[:, r:, d:]], dim=1)
    if valid is not None:
        score = score.masked_fill(~valid.unsqueeze(-1), float("-inf"))
        kv = kv.masked_fill(~valid.unsqueeze(-1), 0.0)
    return (torch.softmax(score, dim=1) * kv).sum(dim=1)


@pytest.mark.parametrize("slots,d,overlap", [(8, 128, True), (128, 128, False), (2, 64, False), (256, 64, True),
                                             (37, 192, False), (300, 64, False), (4, 512, False)])
@pytest.mark.parametrize("masked", [False, True])
def test_compress_pool_gives_the_bits_of_the_torch_pooling(slots: int, d: int, overlap: bool, masked: bool) -> None:
    g = torch.Generator().manual_seed(slots + d)
    t = 7
    hist = torch.randn(t, slots, 2 * (2 if overlap else 1) * d, generator=g) * 2
    valid = None
    if masked:  # a prompt's first groups: the slots before position 0 take no weight
        valid = torch.arange(slots).unsqueeze(0) >= torch.randint(0, slots, (t, 1), generator=g)
    want = _torch_pool(hist, valid, d, overlap)
    for n in (1, t):
        got = native.compress_pool(hist[:n], None if valid is None else valid[:n], d, overlap, torch.float32)
        assert torch.equal(got, want[:n]), n
    bf = native.compress_pool(hist, valid, d, overlap, torch.bfloat16)
    assert torch.equal(bf, want.to(torch.bfloat16))
    # and the torch pooling is the formula (float64 softmax-weighted mean; observed max error 6e-7)
    w = (2 if overlap else 1) * d
    h64 = hist.double()
    sel = [torch.arange(d) + (d if overlap and s >= slots // 2 else 0) for s in range(slots)]
    kv = torch.stack([h64[:, s, sel[s]] for s in range(slots)], 1)
    sc = torch.stack([h64[:, s, w + sel[s]] for s in range(slots)], 1)
    if valid is not None:
        sc = sc.masked_fill(~valid.unsqueeze(-1), float("-inf"))
        kv = kv.masked_fill(~valid.unsqueeze(-1), 0.0)
    exact = (torch.softmax(sc, 1) * kv).sum(1)
    assert (want.double() - exact).abs().max() <= 4e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", ["tiny-v4", "tiny-v41", "tiny-v4/64"])
def test_native_attention_stays_near_the_torch_logits_and_keeps_greedy(name: str, dtype: torch.dtype,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Every kernel on, the native attention included (its own summation order): the logits of
    prefill and decode steps stay within a bound of the torch path's, with the same greedy tokens."""
    model, prompts = _model_and_prompts(name, dtype, 3)
    ref = _logits(model, prompts, 6, on=False)
    calls = []
    real = native.sparse_attention
    monkeypatch.setattr(native, "sparse_attention", lambda *a: calls.append(1) or real(*a))
    got = _logits(model, prompts, 6, on=True, attention=True, feed=ref)
    assert len(calls) >= 7 * model.cfg.num_hidden_layers  # every layer of every step (HCA: per bucket)
    worst = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, ref))
    # observed max |native - torch| / max |logit|: fp32 1.3e-6 / 1.5e-6 / 8.6e-7 (tiny-v4, tiny-v41,
    # tiny-v4/64); bf16 0 / 0 / 7.5e-3 (one bf16 rounding of an attention output flipped)
    assert worst <= (2e-2 if dtype == torch.bfloat16 else 4e-6)
    assert all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(got, ref))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,m2", [(64, 40), (5, 0), (16, 300)])
def test_sparse_attention_kernel_against_the_formula(dtype: torch.dtype, m: int, m2: int) -> None:
    """The kernel against the spec's formula in float64 and against the torch op (bounded: the
    summation orders differ); a row with no valid key gives 0; rows do not depend on the call."""
    from kvshare.ops.sparse_attention import sparse_attention

    g = torch.Generator().manual_seed(m + m2)
    t, h, d = 6, 8, 64
    q = torch.randn(t, h, d, generator=g).to(dtype)
    k1, k2 = torch.randn(t, m, d, generator=g).to(dtype), torch.randn(t, m2, d, generator=g).to(dtype)
    v1, v2 = torch.rand(t, m, generator=g) > 0.3, torch.rand(t, m2, generator=g) > 0.5
    v1[0], v2[0] = False, False  # row 0 attends nothing but its sink
    sink = torch.randn(h, generator=g)
    got = native.sparse_attention(q, k1, v1, sink, d**-0.5, k2, v2)
    keys, valid = torch.cat([k1, k2], 1), torch.cat([v1, v2], 1)
    s = torch.einsum("thd,tmd->thm", q.double(), keys.double()) * d**-0.5
    s = s.masked_fill(~valid.unsqueeze(1), float("-inf"))
    mx = torch.maximum(s.amax(-1), sink.double().expand(t, -1))
    p = torch.exp(s - mx.unsqueeze(-1))
    exact = torch.einsum("thm,tmd->thd", p, keys.double()) / (p.sum(-1) + torch.exp(sink.double() - mx)).unsqueeze(-1)
    # observed max error / max |o|: fp32 4.5e-7, bf16 3.2e-3 (the output's rounding)
    tol = 8e-3 if dtype == torch.bfloat16 else 1e-6
    assert (got.double() - exact).abs().max() <= tol * exact.abs().max()
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    ref = sparse_attention(q, keys, valid, sink, d**-0.5)
    assert (got.double() - ref.double()).abs().max() <= tol * exact.abs().max()
    for r in (1, 4):  # the same row alone
        assert torch.equal(native.sparse_attention(q[r:r + 1], k1[r:r + 1], v1[r:r + 1], sink, d**-0.5, k2[r:r + 1],
                                                   v2[r:r + 1]), got[r:r + 1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [768, 3072, 128, 100, 8, 12, 4096])
def test_rms_norm_gives_the_bits_of_the_torch_norm(dtype: torch.dtype, n: int) -> None:
    from kvshare.layers.norm import RMSNorm, rms_normalize, rms_normalize_as

    g = torch.Generator().manual_seed(n)
    x = (torch.randn(33, n, generator=g) * 3).to(dtype)
    norm = RMSNorm(n, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(n, generator=g) + 0.5)
    want_w, want, want_as = norm(x), rms_normalize(x, 1e-6), rms_normalize_as(x, 1e-6)  # built: the reference
    for m in (1, 2, 33):  # every call size gives each row the torch path's bits
        with torch.no_grad():
            assert torch.equal(native.rms_norm(x[:m], norm.weight, 1e-6, dtype), want_w[:m]), m
        assert torch.equal(native.rms_norm(x[:m], None, 1e-6, torch.float32), want[:m]), m
        assert torch.equal(native.rms_norm(x[:m], None, 1e-6, dtype), want_as[:m]), m
    norm.bind(NATIVE)  # and the layer and the functions take it
    with torch.no_grad():
        assert torch.equal(norm(x), want_w) and torch.equal(rms_normalize(x, 1e-6, native=True), want)
    # the torch path is the formula (float64; observed max error / max |out| 1.3e-7, fp32 result)
    x64 = x.double()
    exact = x64 / (x64.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    assert (want.double() - exact).abs().max() <= 4e-7 * exact.abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("limit", [10.0, 0.0, 7.3])
def test_swiglu_gives_the_bits_of_the_torch_one(dtype: torch.dtype, limit: float) -> None:
    from kvshare.model.moe import _swiglu

    g = torch.Generator().manual_seed(int(limit * 10))
    n, inter = 9, 100  # 100: a partial 8-lane group
    gate = (torch.randn(n, inter, generator=g) * 6).to(dtype)
    up = (torch.randn(n, inter, generator=g) * 6).to(dtype)
    w = torch.rand(n, generator=g) * 2
    want = _swiglu(gate.clone(), up.clone(), w, limit)  # the torch reference
    assert torch.equal(native.swiglu(gate, up, w, limit), want)
    assert torch.equal(native.swiglu(gate[3:4], up[3:4], w[3:4], limit), want[3:4])  # a row alone
    # the torch path is the formula (float64; observed max error / max |h| 5.8e-3 bf16, 1.1e-7 fp32)
    gd, ud = gate.double(), up.double()
    if limit > 0:
        gd, ud = gd.clamp(max=limit), ud.clamp(-limit, limit)
    exact = gd * torch.sigmoid(gd) * ud * w.double().unsqueeze(-1)
    tol = 1e-2 if dtype == torch.bfloat16 else 4e-7
    assert (want.double() - exact).abs().max() <= tol * exact.abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [1, 2, 6, 20])
def test_moe_combine_gives_the_bits_of_the_torch_one(dtype: torch.dtype, k: int) -> None:
    g = torch.Generator().manual_seed(k)
    t, d = 5, 100
    out = torch.randn(t * k + t, d, generator=g).to(dtype)
    sel = torch.randperm(t * k, generator=g)
    where = torch.empty_like(sel)
    where[sel] = torch.arange(t * k)
    routed = out[where].float().view(t, k, -1).sum(dim=1)  # model/moe.py's combine, written out
    want = routed.add_(out[t * k:].float()).to(dtype)
    assert torch.equal(native.moe_combine(out, sel, t, k), want)
    exact = out[where].double().view(t, k, -1).sum(1) + out[t * k:].double()
    # observed max error / max |y|: fp32 9.3e-8 (k = 20), bf16 3.0e-3 (the output's rounding)
    assert (want.double() - exact).abs().max() <= (8e-3 if dtype == torch.bfloat16 else 1e-6) * exact.abs().max()
    with pytest.raises(RuntimeError, match="sel holds slot"):
        native.moe_combine(out, torch.full_like(sel, t * k), t, k)


@pytest.mark.parametrize("func", ["sqrtsoftplus", "sigmoid"])
@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (21, 4, 2), (3, 256, 8), (5, 100, 6)])
def test_moe_route_gives_the_scores_and_picks_of_the_torch_gate(func: str, t: int, e: int, k: int) -> None:
    """Against `Gate._route` (the torch code): the same scores (SLEEF softplus / sigmoid, MKL's sqrt
    as torch.sqrt) and the same picks in the same order, ties toward the lower expert id."""
    from kvshare.bench.sizes import FULL, peer_v4_config
    from kvshare.config import ModelConfig
    from kvshare.model.moe import Gate

    raw = peer_v4_config(FULL.replace(experts=e, experts_per_tok=k))
    raw["scoring_func"] = func
    gate = Gate(ModelConfig.from_dict(raw), hash_routed=False)
    g = torch.Generator().manual_seed(t * e + k)
    with torch.no_grad():
        gate.bias.copy_(torch.randn(e, generator=g) * 0.3)
    logits = torch.randn(t, e, generator=g) * 4
    logits[0, 1] = logits[0, 0]  # a tie: the lower id must come first
    with torch.no_grad():
        gate.bias[1] = gate.bias[0]
        want_w, want_ids = gate._route(logits, torch.zeros(t, dtype=torch.long), True)  # batch-invariant torch
        w, ids = native.moe_route(logits, gate.bias.detach(), k, func)
    assert torch.equal(ids, want_ids) and torch.equal(w, want_w)


@pytest.mark.parametrize("arch", ["v4", "v41", "v4-hash"])
@pytest.mark.parametrize("t,e,k", [(1, 8, 1), (5, 8, 2), (33, 64, 6), (3, 100, 8)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moe_gate_gives_the_bits_of_the_torch_gate(arch: str, t: int, e: int, k: int, dtype: torch.dtype) -> None:
    """`native.moe_gate` (the whole gate in one call) = `Gate.forward`'s torch code bit for bit (the
    V4.1 temperature and normalisation included; V4's hash-routed layers: the experts of each token
    id), and near the spec's formula in float64: logits x . W^T (/ temp), sqrt(softplus), top-k of
    scores + bias (or the hash table's experts), weights / sum * routed scale. Mutations caught: the
    torch path's normalising sum in torch's own order (fp32, k = 6: the last bit differs); the hash
    layer's scores taken at the picks' positions instead of their experts (the hash cases with k > 1;
    at k = 1 the normalised weight is 1 whatever the score); `layers.moe_gate.Gate.forward_native` handing
    the kernel a temperature of 1 (the 8 V4.1 cases)."""
    from kvshare.bench.sizes import FULL, peer_v4_config, v41_config
    from kvshare.config import ModelConfig
    from kvshare.model.moe import Gate

    sizes = FULL.replace(experts=e, experts_per_tok=k)
    hashed = arch == "v4-hash"
    raw = {**v41_config(sizes), "gate_temp": 1.7} if arch == "v41" else peer_v4_config(sizes)
    cfg = ModelConfig.from_dict(raw)
    gate = Gate(cfg, hash_routed=hashed)
    g = torch.Generator().manual_seed(t * e + k)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(gate.weight.shape, generator=g) / 20)
        if hashed:  # each token id's k distinct experts
            gate.tid2eid.copy_(torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(cfg.vocab_size)]))
        else:
            gate.bias.copy_(torch.randn(e, generator=g) * 0.3)
    x = torch.randn(t, cfg.hidden_size, generator=g).to(dtype)
    ids_in = torch.randint(0, cfg.vocab_size, (t,), generator=g)
    with torch.no_grad():
        gate.bind(KernelChoice(batch_invariant=True))  # the batch-invariant torch reference
        want_w, want_ids = gate(x, ids_in)
        gate.bind(NATIVE)
        assert gate.impl == gate.forward_native
        calls = []
        real = native.moe_gate
        native.moe_gate = lambda *a: calls.append(1) or real(*a)
        try:
            w, ids = gate(x, ids_in)
        finally:
            native.moe_gate = real
    assert calls and torch.equal(ids, want_ids) and torch.equal(w, want_w)
    assert cfg.scoring_func == "sqrtsoftplus"
    logits = x.double() @ gate.weight.detach().double().T / (cfg.gate_temp if arch == "v41" else 1.0)
    scores = torch.nn.functional.softplus(logits).sqrt()
    picked = scores.gather(1, ids)
    if hashed:
        assert torch.equal(ids, gate.tid2eid[ids_in])
    if arch != "v41" or (cfg.norm_topk_prob and k > 1):
        picked = picked / picked.sum(-1, keepdim=True)
    exact = picked * cfg.routed_scaling_factor
    err = (w.double() - exact).abs().max().item()
    assert err < 5e-7, err  # observed up to 1.5e-7 (fp32 weights of size 0.2-2.5)
    if hashed:
        return
    # the picks are the float64 top-k wherever the k-th and (k+1)-th keys are not within 1e-5
    key = scores + gate.bias.detach().double()
    top = key.topk(min(k + 1, e), dim=-1).values
    clear = (top[:, k - 1] - top[:, k]).abs() > 1e-5 if k < e else torch.ones(t, dtype=torch.bool)
    assert torch.equal(ids.sort(-1).values[clear], key.topk(k, dim=-1).indices.sort(-1).values[clear])
