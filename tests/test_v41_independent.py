"""V4.1 maths against formulas written out by hand from spec/model.md (tests/v41_reference.py).

The `cand` model (every role, a candidate level that really excludes entries at 40 tokens, 16
index heads) runs in float64; each test compares one part of kvshare's dense path with the hand
formula: the ratio-1 and ratio-2 compressors, index keys ``k_norm(wk(latent))``, the candidate
block mask and the consumer's top-k, the lagged single-pass mHC collapse, ``gate_temp``, the
routed-expert order with FP8 input quantisation, and finally the logits of the whole layer stack
(one-shot and chunked + decode). Quantisation off and on.
"""

from __future__ import annotations

import pytest
import torch

from kvshare.cache.dense import DenseCache
from kvshare.step import StepBatch, StepState
from test_model_common import cand_config, make_model, token_ids
from v41_reference import _fit, _moe, fp4, fp8, freqs, reference_forward, rms, rope

pytestmark = pytest.mark.usefixtures("small_prefill_paths")  # prefill runs its fast paths

SEQ = 40
F64 = torch.float64


def _run(quant: bool, chunks: list[int] | None = None, **cfg_overrides):
    """Model (float64), ids, float64 head outputs [SEQ, V], last StepState, cache, captured inputs."""
    if cfg_overrides:
        from kvshare.model import Transformer

        model = Transformer(cand_config(**cfg_overrides), quant=quant).init_weights(0).eval().double()
    else:
        model = make_model("cand", quant=quant).double()
    ids = token_ids(model.cfg, SEQ)
    cache = DenseCache(model.cfg, model.topo, 1, 64, dtype=F64)
    cap: dict[str, list[torch.Tensor]] = {"head": []}
    hooks = [model.head.register_forward_hook(lambda m, i, o: cap["head"].append(o))]
    for L, blk in enumerate(model.layers):
        for name in ("attn_norm", "ffn_norm", "attn"):
            key = f"{name}{L}"
            cap[key] = []
            hooks.append(getattr(blk, name).register_forward_pre_hook(
                lambda m, args, key=key: cap[key].append(args[0])))
    model.record_ties(True)
    state, s = StepState(), 0
    with torch.no_grad():
        for n in chunks or [SEQ]:
            state = StepState()
            model(ids[s:s + n], StepBatch.build([s], [n]), cache, state)
            s += n
    for hk in hooks:
        hk.remove()
    assert not model.tie_log, f"exact top-k ties make the selection ambiguous: {model.tie_log}"
    cat = {k: torch.cat(v) for k, v in cap.items()}
    return model, ids, cat, state, cache


_REF: dict[bool, tuple] = {}


def _ref(quant: bool):
    if quant not in _REF:
        model, ids, cap, state, cache = _run(quant)
        logits, tr = reference_forward(model.cfg, model.state_dict(), ids.tolist(), quant)
        _REF[quant] = (model, ids, cap, state, cache, logits, tr)
    return _REF[quant]


def _w(model, name: str) -> torch.Tensor:
    return model.state_dict()[name].to(F64)


@pytest.mark.parametrize("quant", [False, True])
def test_ratio1_compressor_latent_and_stored_row(quant: bool) -> None:
    """§4.5.1: row j = fp4(rope(norm(wkv(x_j)), j)) for the ratio-1 kv source (layer 4)."""
    model, _, cap, _, cache, _, _ = _ref(quant)
    cfg, x = model.cfg, cap["attn4"]
    c = "layers.4.attn.compressor."
    lat = rms(x @ _w(model, c + "wkv.weight").T, _w(model, c + "norm.weight"), cfg.rms_norm_eps)
    rows = rope(lat, torch.arange(SEQ), freqs(cfg, True))
    if quant:
        rows = fp4(rows, _fit(cfg.head_dim, 16), "e4m3")
    err = (cache.rows[("kv", 4)][0, :SEQ] - rows).abs().max().item()
    assert err < 1e-13, err  # observed 3.5e-15 (quant off) / 0 (quant on)


@pytest.mark.parametrize("quant", [False, True])
def test_ratio2_compressor_pools_each_pair_per_channel(quant: bool) -> None:
    """§4.5.2: entry j = norm(sum_i softmax_i(z)[c] a_i[c]) over tokens (2j, 2j+1), RoPE at 2j."""
    model, _, cap, _, cache, _, _ = _ref(quant)
    cfg, x, d = model.cfg, cap["attn1"], model.cfg.head_dim
    c = "layers.1.attn.compressor."
    a = (x @ _w(model, c + "wkv.weight").T).view(SEQ // 2, 2, d)
    z = (x @ _w(model, c + "wgate.weight").T).view(SEQ // 2, 2, d)
    pooled = (torch.exp(z) / torch.exp(z).sum(1, keepdim=True) * a).sum(1)
    lat = rms(pooled, _w(model, c + "norm.weight"), cfg.rms_norm_eps)
    rows = rope(lat, 2 * torch.arange(SEQ // 2), freqs(cfg, True))
    if quant:
        rows = fp4(rows, _fit(d, 16), "e4m3")
    err = (cache.rows[("kv", 1)][0, :SEQ // 2] - rows).abs().max().item()
    assert err < 1e-13, err  # observed 1e-15 / 0


@pytest.mark.parametrize("quant", [False, True])
def test_index_keys_are_k_norm_of_wk_of_the_pre_rope_latent(quant: bool) -> None:
    """§4.6: kI_j = fp4(rope(k_norm(wk(latent_j)), r j)) for both index-K owners (1: ratio 2, 4: ratio 1)."""
    model, _, _, _, cache, _, tr = _ref(quant)
    cfg = model.cfg
    for owner, r in ((1, 2), (4, 1)):
        ix = f"layers.{owner}.attn.indexer."
        lat = tr.latents[owner]
        keys = rms(lat @ _w(model, ix + "wk.weight").T, _w(model, ix + "k_norm.weight"), cfg.rms_norm_eps)
        keys = rope(keys, r * torch.arange(lat.shape[0]), freqs(cfg, True))
        if quant:
            keys = fp4(keys, _fit(cfg.index_head_dim, 32), "ue8m0")
        err = (cache.rows[("index_k", owner)][0, :lat.shape[0]] - keys).abs().max().item()
        assert err < 1e-13, (owner, err)  # observed 5e-15 / 0


@pytest.mark.parametrize("quant", [False, True])
def test_candidate_mask_and_consumer_topk(quant: bool) -> None:
    """§4.6.1: candidate source 4 publishes the block mask; consumer 6 picks inside it only."""
    model, _, _, state, _, _, tr = _ref(quant)
    assert torch.equal(state.candidates, tr.candidates[4])
    for layer in (1, 2, 4, 6):
        want = torch.tensor([p + [-1] * (model.cfg.index_topk - len(p)) for p in tr.topk[layer]])
        assert torch.equal(state.topk[layer], want), layer
    # The candidate level really excludes reachable entries: layer 6's unrestricted top-k differs.
    free = tr.scores[6]
    unrestricted = [sorted(sorted(range(free.shape[1]), key=lambda j: (-free[t, j].item(), j))[:5])
                    for t in range(SEQ)]
    assert sum(u != p for u, p in zip(unrestricted, tr.topk[6])) >= 5
    assert not bool(tr.candidates[4][-1, :SEQ].all())


@pytest.mark.parametrize("quant", [False, True])
def test_lagged_single_pass_mhc_collapse(quant: bool) -> None:
    """§7.1: attention of L collapses with L-1's FFN pre (layer 0: one-hot), FFN with L's attention pre."""
    model, _, cap, _, _, _, tr = _ref(quant)
    for L in range(model.cfg.num_hidden_layers):
        for got, want in ((cap[f"attn_norm{L}"], tr.attn_in[L]), (cap[f"ffn_norm{L}"], tr.ffn_in[L])):
            err = (got - want).abs().max().item()
            assert err < 2e-13, (L, err)  # observed 3.7e-14 / 0


def test_gate_temp_divides_the_router_logits() -> None:
    """§7.2: scores = sqrt(softplus(x W^T / gate_temp)); top-k of scores + bias; weights renormalised."""
    model = make_model("cand").double()
    cfg = cand_config(gate_temp=2.5)
    gate = model.layers[3].ffn.gate
    gate.cfg = cfg
    x = torch.randn(64, cfg.hidden_size, generator=torch.Generator().manual_seed(1), dtype=F64)
    wts, ids = gate(x, torch.zeros(64, dtype=torch.long))
    s = torch.nn.functional.softplus(x @ gate.weight.T / 2.5).sqrt()
    b = s + gate.bias
    want_ids = torch.tensor([sorted(range(cfg.n_routed_experts), key=lambda e: (-b[t, e].item(), e))[:2]
                             for t in range(64)])
    want = s.gather(1, want_ids)
    want = want / (want.sum(1, keepdim=True) + 1e-20) * cfg.routed_scaling_factor
    assert torch.equal(ids, want_ids)
    assert (wts - want).abs().max().item() < 1e-14  # observed 0
    plain = torch.nn.functional.softplus(x @ gate.weight.T).sqrt()
    assert (plain - s).abs().max().item() > 1e-2  # the temperature matters for these inputs


def test_routed_weight_multiplies_the_swiglu_output_before_w2_fp8() -> None:
    """§7.2: w2(fp8(weight * silu(gate) * up)); the other order differs by about one FP8 step."""
    model = make_model("cand", quant=True).double()
    cfg, moe = model.cfg, model.layers[2].ffn
    x = torch.randn(32, cfg.hidden_size, generator=torch.Generator().manual_seed(2), dtype=F64)
    w = {k: v.to(F64) for k, v in model.state_dict().items()}

    def aq(t: torch.Tensor) -> torch.Tensor:
        return fp8(t, _fit(t.shape[-1], cfg.act_quant_block))

    want = _moe(x, w, "layers.2.ffn.", cfg, aq)
    got = moe(x, torch.zeros(32, dtype=torch.long))
    assert (got - want).abs().max().item() < 1e-13  # observed 2e-16
    # Negative control: weighting after w2 is measurably different with FP8 inputs.
    wts, ids = moe.gate(x, None)
    alt = torch.zeros_like(x)
    for t in range(32):
        for k in range(cfg.num_experts_per_tok):
            e = moe.experts[int(ids[t, k])]
            g, u = e.w1(x[t:t + 1]).clamp(max=cfg.swiglu_limit), e.w3(x[t:t + 1]).clamp(-cfg.swiglu_limit, cfg.swiglu_limit)
            alt[t] += wts[t, k] * (aq(torch.nn.functional.silu(g) * u) @ e.w2.weight.T)[0]
        alt[t] += moe.shared_experts(x[t:t + 1])[0]
    assert (alt - want).abs().max().item() > 1e-3


@pytest.mark.parametrize("quant", [False, True])
def test_whole_model_logits_equal_the_hand_reference(quant: bool) -> None:
    """Dense path float64 logits (before the fp32 cast) = hand evaluation of the whole stack."""
    model, ids, cap, _, _, ref, _ = _ref(quant)
    err = (cap["head"] - ref).abs().max().item()
    assert err < 1e-13, err  # observed 7.7e-15 (quant off), 0 (quant on); the issue asks <= 1e-9
    _, _, chunked, _, _ = _run(quant, [13, 1, 7, 19])
    err = (chunked["head"] - ref).abs().max().item()
    assert err < 1e-13, err  # chunked prefill + a decode step: observed 9.5e-15 / 2.2e-15
    if quant:  # the quantised reference is not the unquantised one
        assert (ref - _ref(False)[5]).abs().max().item() > 1e-3
