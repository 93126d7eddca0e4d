"""A hand-written DeepSeek-V4.1 forward in float64, from spec/model.md alone (no kvshare maths).

`reference_forward(cfg, weights, ids, quant)` evaluates one sequence prefilled from position 0
and returns the float64 logits of every position plus the intermediates the unit tests check
(`Trace`). Only the config object and the state-dict tensors come from kvshare; every formula is
written out here: RMSNorm (§4.1), interleaved partial RoPE with YaRN (§4.2), query (§4.3), window
KV (§4.4), the ratio-1 / ratio-2 compressors (§4.5.1-2), index keys ``k_norm(wk(latent))``,
queries, head weights and scores (§4.6), candidate blocks (§4.6.1), sink attention, inverse RoPE
and the grouped output projection (§4.7), FP8 / FP4 fake-quant (§6), the lagged single-pass mHC
(§7.1) and the MoE with ``gate_temp`` and the routing weight before ``w2`` (§7.2); ties in every
top-k go to the lower index (§13). Deliberately loop-based and slow: it is a reading of the spec.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

F64 = torch.float64
NEG = float("-inf")


# ---- §6 quantisers -------------------------------------------------------------------------------


def _fit(width: int, block: int) -> int:
    """Quant block for a width (kvshare decision for tiny models: the power of two dividing it)."""
    return block if width % block == 0 else math.gcd(width, block)


def _pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    m, e = torch.frexp(v)
    return torch.where(m == 0.5, v, torch.ldexp(torch.ones_like(v), e))


def fp8(x: torch.Tensor, block: int) -> torch.Tensor:
    """FP8 e4m3 act_quant: amax >= 1e-4, scale 2^ceil(log2(amax / 448)), x ~ e4m3(clamp(x / s)) * s."""
    b = x.reshape(*x.shape[:-1], -1, block)
    s = _pow2_ceil(b.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448)
    q = (b / s).clamp(-448, 448).to(torch.float8_e4m3fn).to(F64)
    return (q * s).reshape(x.shape)


_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=F64)


def fp4(x: torch.Tensor, block: int, scale_fmt: str) -> torch.Tensor:
    """FP4 e2m1 with ue8m0 (amax >= 6*2^-126, s = 2^ceil(log2(amax/6))) or e4m3 scales
    (amax >= 6*2^-9, s = e4m3(amax/6)); nearest grid magnitude, ties to the even code."""
    b = x.reshape(*x.shape[:-1], -1, block)
    amax = b.abs().amax(-1, keepdim=True)
    if scale_fmt == "ue8m0":
        s = _pow2_ceil(amax.clamp_min(6 * 2.0**-126) / 6)
    else:
        s = (amax.clamp_min(6 * 2.0**-9) / 6).to(torch.float8_e4m3fn).to(F64)
    v = (b / s).clamp(-6, 6)
    dist = (v.abs().unsqueeze(-1) - _E2M1).abs()
    best = dist == dist.amin(-1, keepdim=True)
    even = best & (torch.arange(8) % 2 == 0)
    code = torch.where(even.any(-1), even.to(torch.int8).argmax(-1), best.to(torch.int8).argmax(-1))
    return (torch.sign(v) * _E2M1[code] * s).reshape(x.shape)


# ---- §4.1, §4.2 -----------------------------------------------------------------------------------


def rms(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def freqs(cfg, compressed: bool) -> torch.Tensor:
    rd = cfg.qk_rope_head_dim
    base = cfg.compress_rope_theta if compressed else cfg.rope_theta
    i = torch.arange(rd // 2, dtype=F64)
    f = base ** (-2 * i / rd)
    y = cfg.yarn
    if compressed and y is not None:
        def c(rot: float) -> float:
            return rd * math.log(y.original_max_position_embeddings / (2 * math.pi * rot)) / (2 * math.log(base))
        low, high = max(math.floor(c(y.beta_fast)), 0), min(math.ceil(c(y.beta_slow)), rd - 1)
        ramp = ((i - low) / max(high - low, 1e-3)).clamp(0, 1)
        f = f * (1 - ramp) + f / y.factor * ramp
    return f


def rope(x: torch.Tensor, pos: torch.Tensor, f: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing pairs (2i, 2i+1) of x [N, ..., d] by angle pos[n] * f_i (interleaved)."""
    rd = 2 * f.numel()
    ang = pos.to(F64).view(-1, *([1] * (x.dim() - 2)), 1) * f
    ang = -ang if inverse else ang
    t = x[..., -rd:].reshape(*x.shape[:-1], rd // 2, 2)
    z = torch.complex(t[..., 0], t[..., 1]) * torch.polar(torch.ones_like(ang), ang)
    return torch.cat([x[..., :-rd], torch.stack([z.real, z.imag], -1).flatten(-2)], -1)


# ---- the forward ----------------------------------------------------------------------------------


@dataclass
class Trace:
    """Intermediates of one reference forward (keys: layer ids)."""

    latents: dict[int, torch.Tensor] = field(default_factory=dict)  # pre-RoPE compressed latents [E, d]
    kv_rows: dict[int, torch.Tensor] = field(default_factory=dict)  # stored compressed rows [E, d]
    index_keys: dict[int, torch.Tensor] = field(default_factory=dict)  # stored index keys [E, d_I]
    scores: dict[int, torch.Tensor] = field(default_factory=dict)  # causal index scores [S, E]
    candidates: dict[int, torch.Tensor] = field(default_factory=dict)  # candidate mask [S, E]
    topk: dict[int, list[list[int]]] = field(default_factory=dict)  # ascending picks per row
    attn_in: dict[int, torch.Tensor] = field(default_factory=dict)  # attn_norm inputs (collapsed x)
    ffn_in: dict[int, torch.Tensor] = field(default_factory=dict)  # ffn_norm inputs
    moe_out: dict[int, torch.Tensor] = field(default_factory=dict)


def _topk_low(scores: list[float], k: int) -> list[int]:
    """Indices of the k largest finite scores, ties to the lower index, returned ascending."""
    order = sorted((i for i, s in enumerate(scores) if s > NEG), key=lambda i: (-scores[i], i))
    return sorted(order[:k])


def _mix(h: torch.Tensor, w: dict, p: str, cfg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hc = cfg.hc_mult
    flat = h.reshape(h.shape[0], -1)
    m = rms(flat, None, cfg.rms_norm_eps) @ w[p + "_fn"].T
    s, b, e = w[p + "_scale"], w[p + "_base"], cfg.hc_eps
    pre = torch.sigmoid(m[:, :hc] * s[0] + b[:hc]) + e
    post = 2 * torch.sigmoid(m[:, hc:2 * hc] * s[1] + b[hc:2 * hc])
    comb = torch.softmax((m[:, 2 * hc:] * s[2] + b[2 * hc:]).view(-1, hc, hc), -1) + e
    comb = comb / (comb.sum(1, keepdim=True) + e)  # column = sum over the first index
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(2, keepdim=True) + e)
        comb = comb / (comb.sum(1, keepdim=True) + e)
    return pre, post, comb


def _collapse(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    return torch.einsum("tj,tjd->td", pre, h)


def _expand(h, y, post, comb) -> torch.Tensor:
    return post.unsqueeze(-1) * y.unsqueeze(1) + torch.einsum("tjk,tjd->tkd", comb, h)


def _moe(x: torch.Tensor, w: dict, p: str, cfg, aq) -> torch.Tensor:
    logits = x @ w[p + "gate.weight"].T / cfg.gate_temp
    assert cfg.scoring_func == "sqrtsoftplus"
    scores = torch.nn.functional.softplus(logits).sqrt()
    biased = scores + w[p + "gate.bias"]
    lim = cfg.swiglu_limit
    out = torch.zeros_like(x)

    def expert(e: str, xt: torch.Tensor, weight: float | None) -> torch.Tensor:
        g, u = aq(xt) @ w[e + "w1.weight"].T, aq(xt) @ w[e + "w3.weight"].T
        if lim > 0:
            g, u = g.clamp(max=lim), u.clamp(-lim, lim)
        hid = torch.nn.functional.silu(g) * u
        if weight is not None:
            hid = weight * hid  # routing weight BEFORE w2 (§7.2)
        return aq(hid) @ w[e + "w2.weight"].T

    k = cfg.num_experts_per_tok
    for t in range(x.shape[0]):
        row = biased[t].tolist()
        picks = sorted(range(len(row)), key=lambda i: (-row[i], i))[:k]
        wts = scores[t, picks]
        if cfg.norm_topk_prob and k > 1:
            wts = wts / (wts.sum() + 1e-20)
        wts = wts * cfg.routed_scaling_factor
        for slot, e in enumerate(picks):
            out[t] += expert(f"{p}experts.{e}.", x[t:t + 1], wts[slot])[0]
        out[t] += expert(f"{p}shared_experts.", x[t:t + 1], None)[0]
    return out


def reference_forward(cfg, weights: dict[str, torch.Tensor], ids: list[int], quant: bool) -> tuple[torch.Tensor, Trace]:
    """Float64 logits [S, V] of every position of `ids` (prefill from 0), and the Trace."""
    assert cfg.arch == "v41" and not cfg.engram_layer_ids
    w = {k: v.to(F64) for k, v in weights.items()}
    n, S, H, d = cfg.num_hidden_layers, len(ids), cfg.num_attention_heads, cfg.head_dim
    HI, dI, W = cfg.index_n_heads, cfg.index_head_dim, cfg.sliding_window
    ratios = cfg.compress_ratios
    kv_src, idx_src = sorted(cfg.kv_source_layer_ids), sorted(cfg.index_source_layer_ids)
    ik_src = sorted(cfg.index_k_source_layer_ids) if cfg.index_k_source_layer_ids is not None else kv_src
    cand = cfg.candidate_source_layer_id

    def aq(x: torch.Tensor) -> torch.Tensor:
        return fp8(x, _fit(x.shape[-1], cfg.act_quant_block)) if quant else x

    def latest(srcs: list[int], layer: int) -> int:
        return max(s for s in srcs if s <= layer)

    tr = Trace()
    pos = torch.arange(S)
    f_main, f_comp = freqs(cfg, False), freqs(cfg, True)
    h = w["embed.weight"][torch.tensor(ids)].unsqueeze(1).repeat(1, cfg.hc_mult, 1)
    pre_prev = torch.zeros(S, cfg.hc_mult, dtype=F64)
    pre_prev[:, 0] = 1.0  # layer 0's attention collapses with the one-hot pre
    for L in range(n):
        p = f"layers.{L}."
        r = ratios[L]
        f = f_comp if r > 0 else f_main
        # -- attention sublayer, collapsed with the previous sublayer's pre (single-pass mHC)
        pre, post, comb = _mix(h, w, p + "hc_attn", cfg)
        x_in = _collapse(h, pre_prev)
        tr.attn_in[L] = x_in
        x = rms(x_in, w[p + "attn_norm.weight"], cfg.rms_norm_eps)
        a = p + "attn."
        qr = rms(aq(x) @ w[a + "wq_a.weight"].T, w[a + "q_norm.weight"], cfg.rms_norm_eps)
        q = rope((aq(qr) @ w[a + "wq_b.weight"].T).view(S, H, d), pos, f)
        kv = rope(rms(aq(x) @ w[a + "wkv.weight"].T, w[a + "kv_norm.weight"], cfg.rms_norm_eps), pos, f)
        if quant:
            kv = fp8(kv, _fit(d, 32))
        entries = [[kv[u] for u in range(max(0, t - W + 1), t + 1)] for t in range(S)]
        if r > 0:
            if L in kv_src:  # compressor (§4.5): groups of r tokens -> one pre-RoPE latent
                c = a + "compressor."
                if r == 1:
                    lat = rms(x @ w[c + "wkv.weight"].T, w[c + "norm.weight"], cfg.rms_norm_eps)
                else:
                    av, zv = x @ w[c + "wkv.weight"].T, x @ w[c + "wgate.weight"].T
                    ng = S // r
                    av, zv = av[:ng * r].view(ng, r, d), zv[:ng * r].view(ng, r, d)
                    lat = rms((torch.softmax(zv, 1) * av).sum(1), w[c + "norm.weight"], cfg.rms_norm_eps)
                tr.latents[L] = lat
                epos = torch.arange(lat.shape[0]) * r  # an entry's RoPE position: its first token
                rows = rope(lat, epos, f_comp)
                tr.kv_rows[L] = fp4(rows, _fit(d, 16), "e4m3") if quant else rows
                if L in ik_src:
                    ik = rope(rms(lat @ w[a + "indexer.wk.weight"].T, w[a + "indexer.k_norm.weight"],
                                  cfg.rms_norm_eps), epos, f_comp)
                    tr.index_keys[L] = fp4(ik, _fit(dI, 32), "ue8m0") if quant else ik
            if L in idx_src:  # lightning indexer (§4.6)
                ix = a + "indexer."
                qi = rope((aq(qr) @ w[ix + "wq_b.weight"].T).view(S, HI, dI), pos, f_comp)
                if quant:
                    qi = fp4(qi, _fit(dI, 32), "ue8m0")
                hw = x @ w[ix + "weights_proj.weight"].T * dI**-0.5 * HI**-0.5
                keys = tr.index_keys[latest(ik_src, L)]
                sc = (hw.unsqueeze(-1) * torch.relu(torch.einsum("thd,jd->thj", qi, keys))).sum(1)
                clen = (pos + 1) // r
                sc = sc.masked_fill(torch.arange(keys.shape[0])[None] >= clen[:, None], NEG)
                tr.scores[L] = sc
                if L == cand:
                    tr.candidates[L] = _candidate_mask(sc, clen, cfg.candidate_block_size, cfg.candidate_topk_blocks)
                use = sc
                if 0 <= cand < L and ratios[cand] == r:
                    use = sc.masked_fill(~tr.candidates[cand], NEG)
                tr.topk[L] = [_topk_low(use[t].tolist(), cfg.index_topk) for t in range(S)]
            rows = tr.kv_rows[latest(kv_src, L)]
            for t, picks in enumerate(tr.topk[latest(idx_src, L)]):
                entries[t] += [rows[j] for j in picks]
        sink = w[a + "attn_sink"]
        o = torch.zeros(S, H, d, dtype=F64)
        for t in range(S):
            kvt = torch.stack(entries[t])  # [M, d], K = V
            s = q[t] @ kvt.T * d**-0.5  # [H, M]
            m = torch.maximum(s.amax(-1), sink)
            e = torch.exp(s - m[:, None])
            o[t] = (e @ kvt) / (e.sum(-1) + torch.exp(sink - m))[:, None]
        o = rope(o, pos, f, inverse=True)
        g = cfg.o_groups
        u = torch.einsum("tgi,goi->tgo", o.reshape(S, g, -1), w[a + "wo_a.weight"].view(g, cfg.o_lora_rank, -1))
        y = aq(u.reshape(S, -1)) @ w[a + "wo_b.weight"].T
        h = _expand(h, y, post, comb)
        pre_attn = pre
        # -- MoE sublayer, collapsed with this layer's attention pre
        pre, post, comb = _mix(h, w, p + "hc_ffn", cfg)
        x_in = _collapse(h, pre_attn)
        tr.ffn_in[L] = x_in
        y = _moe(rms(x_in, w[p + "ffn_norm.weight"], cfg.rms_norm_eps), w, p + "ffn.", cfg, aq)
        tr.moe_out[L] = y
        h = _expand(h, y, post, comb)
        pre_prev = pre
    x = rms(_collapse(h, pre_prev), w["norm.weight"], cfg.rms_norm_eps)
    return x @ w["head.weight"].T, tr


def _candidate_mask(sc: torch.Tensor, clen: torch.Tensor, b: int, kb: int) -> torch.Tensor:
    """§4.6.1: block max, pin the newest block, top blocks (ties low) above -inf, expand to positions."""
    S, E = sc.shape
    nb = -(-E // b)
    mask = torch.zeros(S, E, dtype=torch.bool)
    for t in range(S):
        blocks = [max(sc[t, j].item() for j in range(bb * b, min(E, bb * b + b))) for bb in range(nb)]
        newest = (int(clen[t]) - 1) // b
        if newest >= 0:
            blocks[newest] = float("inf")
        for bb in _topk_low(blocks, kb):
            mask[t, bb * b:min(E, bb * b + b)] = True
    return mask
