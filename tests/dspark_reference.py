"""A hand-written DSpark draft block from the formulas of spec engram_dspark.md §2.3-§2.6.

Independent of kvshare's modules: it reads only the raw weights (a released-naming state dict)
and the config numbers, and spells out RMSNorm, RoPE (interleaved pairs, theta 10000, no YaRN),
the V4.1 mHC mixes with the lagged pre-mix, the non-causal block attention with sink over W
context rows plus B block rows, the sqrtsoftplus MoE with one shared expert, the final collapse
and head, and the Markov chain. Quantisation off; everything in float64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * (1.0 if w is None else w)


def rope(x, pos, rd, theta=10000.0, inverse=False):
    """Rotate the last rd dims of x ([..., d]; pos broadcast to x's first dim) in pairs (2i, 2i+1)."""
    i = torch.arange(rd // 2, dtype=torch.float64)
    ang = pos.double()[:, None] * (theta ** (-2.0 * i / rd))[None, :]
    while ang.dim() < x.dim():
        ang = ang.unsqueeze(1)
    c, s = torch.cos(ang), torch.sin(ang) * (-1 if inverse else 1)
    a, b = x[..., -rd::2], x[..., -rd + 1::2]
    out = torch.stack([a * c - b * s, a * s + b * c], -1).flatten(-2)
    return torch.cat([x[..., :-rd], out], -1)


def mhc(h, W, pfx, cfg):
    """(pre, post, comb) of mix `pfx` for streams h [T, hc, D]."""
    hc, t = cfg.hc_mult, h.shape[0]
    m = rms(h.reshape(t, -1), None, cfg.rms_norm_eps) @ W[pfx + "_fn"].t()
    b, s = W[pfx + "_base"], W[pfx + "_scale"]
    pre = torch.sigmoid(m[:, :hc] * s[0] + b[:hc]) + cfg.hc_eps
    post = 2 * torch.sigmoid(m[:, hc:2 * hc] * s[1] + b[hc:2 * hc])
    c = torch.softmax((m[:, 2 * hc:] * s[2] + b[2 * hc:]).view(t, hc, hc), -1) + cfg.hc_eps
    c = c / (c.sum(1, keepdim=True) + cfg.hc_eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        c = c / (c.sum(2, keepdim=True) + cfg.hc_eps)
        c = c / (c.sum(1, keepdim=True) + cfg.hc_eps)
    return pre, post, c


def moe(x, W, p, cfg):
    n_exp = cfg.dspark_n_routed_experts or cfg.n_routed_experts
    k = cfg.dspark_num_experts_per_tok or cfg.num_experts_per_tok
    lim = cfg.swiglu_limit

    def expert(e, v):
        g = (v @ W[f"{e}.w1.weight"].t()).clamp(max=lim)
        u = (v @ W[f"{e}.w3.weight"].t()).clamp(-lim, lim)
        return F.silu(g) * u

    scores = F.softplus(x @ W[p + "gate.weight"].t()).sqrt()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        biased = scores[t] + W[p + "gate.bias"]
        ids = sorted(range(n_exp), key=lambda e: (-float(biased[e]), e))[:k]
        w = torch.stack([scores[t, e] for e in ids])
        w = w / (w.sum() + 1e-20) * cfg.routed_scaling_factor
        for e, we in zip(ids, w):
            out[t] += (we * expert(f"{p}experts.{e}", x[t])) @ W[f"{p}experts.{e}.w2.weight"].t()
        out[t] += expert(f"{p}shared_experts", x[t]) @ W[f"{p}shared_experts.w2.weight"].t()
    return out


def attention(x, ctx_x, ctx_pos, pos, W, p, cfg):
    """Block rows x [B, D] at pos attend to context rows (from main_x rows ctx_x at ctx_pos) + all block rows."""
    h, d, rd = cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim
    eps = cfg.rms_norm_eps
    q = rms(x @ W[p + "attn.wq_a.weight"].t(), W[p + "attn.q_norm.weight"], eps) @ W[p + "attn.wq_b.weight"].t()
    q = rope(q.view(-1, h, d), pos, rd)

    def kv(v, at):
        return rope(rms(v @ W[p + "attn.wkv.weight"].t(), W[p + "attn.kv_norm.weight"], eps), at, rd)

    keys = torch.cat([kv(ctx_x, ctx_pos), kv(x, pos)], 0)  # [W' + B, d]
    s = torch.einsum("thd,md->thm", q, keys) * d**-0.5
    sink = W[p + "attn.attn_sink"][None, :, None]
    mx = torch.maximum(s.amax(-1, keepdim=True), sink)
    e = torch.exp(s - mx)
    o = torch.einsum("thm,md->thd", e, keys) / (e.sum(-1, keepdim=True) + torch.exp(sink - mx))
    o = rope(o, pos, rd, inverse=True)
    g = cfg.o_groups
    wo_a = W[p + "attn.wo_a.weight"].view(g, cfg.o_lora_rank, -1)
    u = torch.einsum("tgi,goi->tgo", o.reshape(o.shape[0], g, -1), wo_a).flatten(1)
    return u @ W[p + "attn.wo_b.weight"].t()


def draft_block(W, cfg, taps, anchor, a):
    """(U [B, V], x_head [B, D]) for anchor token `anchor` at position a, given the taps [a, len(targets), D]
    of the committed positions 0..a-1 (only the last W are used)."""
    hc, b = cfg.hc_mult, cfg.dspark_block_size
    lo = max(0, a - cfg.sliding_window)
    ctx_pos = torch.arange(lo, a)
    main = taps[lo:a].flatten(1) @ W["mtp.0.main_proj.weight"].t()
    main_x = rms(main, W["mtp.0.main_norm.weight"], cfg.rms_norm_eps)
    ids = torch.tensor([anchor] + [cfg.dspark_noise_token_id] * (b - 1))
    pos = torch.arange(a, a + b)
    h = W["embed.weight"][ids][:, None, :].repeat(1, hc, 1)
    pre_prev = torch.zeros(b, hc, dtype=h.dtype)
    pre_prev[:, 0] = 1
    for s in range(cfg.num_draft_layers):
        p = f"mtp.{s}."
        pre, post, comb = mhc(h, W, p + "hc_attn", cfg)
        x = (pre_prev[..., None] * h).sum(1)
        y = attention(rms(x, W[p + "attn_norm.weight"], cfg.rms_norm_eps), main_x, ctx_pos, pos, W, p, cfg)
        h = post[..., None] * y[:, None] + torch.einsum("tjk,tjd->tkd", comb, h)
        pre_f, post_f, comb_f = mhc(h, W, p + "hc_ffn", cfg)
        x = (pre[..., None] * h).sum(1)
        y = moe(rms(x, W[p + "ffn_norm.weight"], cfg.rms_norm_eps), W, p + "ffn.", cfg)
        h = post_f[..., None] * y[:, None] + torch.einsum("tjk,tjd->tkd", comb_f, h)
        pre_prev = pre_f
    x_head = (pre_prev[..., None] * h).sum(1)
    last = f"mtp.{cfg.num_draft_layers - 1}."
    u = rms(x_head, W[last + "norm.weight"], cfg.rms_norm_eps) @ W["head.weight"].t()
    return u, x_head


def markov_greedy(W, cfg, u, anchor):
    """Greedy drafts d_1..d_B: d_{i+1} = argmax(U_i + H @ E[prev])."""
    last = f"mtp.{cfg.num_draft_layers - 1}.markov_head."
    prev, out = anchor, []
    for i in range(u.shape[0]):
        prev = int((u[i] + W[last + "head.weight"] @ W[last + "embed.weight"][prev]).argmax())
        out.append(prev)
    return out


def confidence(W, cfg, x_head, prev):
    """sigmoid(proj [x_head_i ; E[prev_i]]) per block row, prev = [anchor, d_1, ...]."""
    last = f"mtp.{cfg.num_draft_layers - 1}."
    z = torch.cat([x_head, W[last + "markov_head.embed.weight"][prev]], -1)
    z = z @ W[last + "confidence_head.proj.weight"].t()
    return torch.sigmoid(z[:, 0])
