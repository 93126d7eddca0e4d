// Decode-step kernels outside the GEMMs (decode.cpp): mHC mixes, collapse and expand for whole
// rows, one call per sublayer piece. fp32 arithmetic in the order torch's ops use for these
// shapes (no torch headers); each row is computed from its own inputs only, so a row's bits
// never depend on the other rows of the call.
#pragma once
#include <stdint.h>

namespace kvshare_kernels {

// mHC step 2-3 from the mixes m [T][ld] (fp32): pre [T][hc], post [T][hc], comb [T][hc][hc].
// pre = sigmoid(m[:hc] s0 + b[:hc]) + eps; post = 2 sigmoid(m[hc:2hc] s1 + b[hc:2hc]);
// comb = softmax over k of (m[2hc:] s2 + b[2hc:]) as [j][k] (exp(z - max) * (1 / sum)), + eps,
// then column-normalised and (iters - 1) x (row, column) Sinkhorn divisions, each sum in
// increasing index order from 0; sigmoid(z) = 1 / (1 + exp(0 - z)); exp: SLEEF's expf (u10).
void mhc_post(const float* m, int64_t T, int64_t ld, const float* base, const float* scale, int hc,
              float eps, int iters, float* pre, float* post, float* comb);

// Only the Sinkhorn divisions (in place on comb [T][hc][hc]): (iters - 1) x (rows, columns).
void sinkhorn(float* comb, int64_t T, int hc, float eps, int iters);

// Collapse x[t][d] = sum_j pre[t][j] * h[t][j][d]: each product rounded to fp32, summed from +0
// in increasing j, then stored as bf16 (round to nearest even) or fp32. h: bf16 or fp32.
void mhc_collapse(const void* h, int h_bf16, const float* pre, int64_t T, int hc, int64_t D, void* out);

// Expand out[t][k][d] = (fma chain over j = 0.. of comb[t][j][k] * h[t][j][d] from +0)
// + round(post[t][k] * y[t][d]), stored in h's dtype. h, y: bf16 (h_bf16) or fp32.
void mhc_expand(const void* h, const void* y, int h_bf16, const float* post, const float* comb, int64_t T,
                int hc, int64_t D, void* out);

}  // namespace kvshare_kernels

namespace kvshare_kernels {

// Interleaved RoPE on the last rd dims of x [P][inner][D] (bf16 or fp32), in place or into out
// (out may equal x; dims before the tail are copied when it does not): per pair (a, b) at
// 2i, 2i + 1 of the tail, with the per-position tables c, s [P][rd] (fp32):
// out[2i] = round(a c[2i] + round(b s[2i])), out[2i + 1] = round(b c[2i + 1] + round(a s[2i + 1])),
// each product rounded to fp32 first, the sum rounded to fp32, then stored in x's dtype.
void rope(const void* x, int bf16, const float* c, const float* s, int64_t P, int64_t inner, int64_t D,
          int64_t rd, void* out);

}  // namespace kvshare_kernels

namespace kvshare_kernels {

// Compressor pooling (model/compressor.py): for each row t and channel c < d, over the S slots of
// the row's history hist [T][S][2W] (W = coff * d: kv in [0, W), score in [W, 2W)): slot s reads
// channel off(s) + c with off(s) = (overlap && s >= S / 2) ? d : 0; an invalid slot (valid[t][s] == 0,
// valid may be null) has score -inf and kv 0. out[t][c] = sum_s softmax_s(score)[s] * kv[s], with
// torch's orders: softmax over s = exp(z - max) / (sequential sum from 0); the weighted sum is
// torch's cascade over s (blocks of 2^max(4, ceil(log2 S) / 4) summed from 0, block sums added
// in order); stored in bf16 (out_bf16) or fp32.
void compress_pool(const float* hist, const uint8_t* valid, int64_t T, int64_t S, int64_t d, int overlap,
                   int out_bf16, void* out);

}  // namespace kvshare_kernels

namespace kvshare_kernels {

// Sparse attention with a per-head sink (ops/sparse_attention.py) for rows t < T, heads h < H, over
// the keys of two sources read in place (a = the window [T][Ma][d], b = gathered rows [T][Mb][d],
// each with a valid mask [T][M]; b may be empty): s_i = (q . k_i) * scale (fp32: fma chains over 8
// lanes of d, lanes added pairwise), masked -> -inf; m = max(max s, sink_h); p_i = exp(s_i - m);
// o = (sum_i p_i k_i) / (sum_i p_i + exp(sink_h - m)), sums in key order; stored in q's dtype.
// q, k: bf16 (bf16 != 0) or fp32, all the same dtype; d % 8 == 0.
void sparse_attention(const void* q, const void* ka, const uint8_t* va, int64_t ma, const void* kb,
                      const uint8_t* vb, int64_t mb, const float* sink, int64_t T, int64_t H, int64_t d,
                      float scale, int bf16, void* out);

}  // namespace kvshare_kernels

namespace kvshare_kernels {

// RMSNorm rows (model/norm.py) of x [R][n] (bf16 or fp32): r = 1 / sqrt(sum(x^2) / n + eps) with
// torch's inner sum (8-lane vectors in 4 interleaved streams, cascaded, then the scalar tail and the
// lanes in order: the AVX2 kernel torch runs under every capability), then out = (x * r) [* w],
// each product rounded to fp32, stored in bf16 (out_bf16) or fp32. w (fp32 [n]) may be null.
void rms_norm(const void* x, int x_bf16, const float* w, int64_t R, int64_t n, float eps, int out_bf16, void* out);

}  // namespace kvshare_kernels

namespace kvshare_kernels {

// SwiGLU of the MoE experts (model/moe.py `_swiglu`) for rows [N][I] of gate / up (bf16 or fp32):
// g = min(gate, limit), u = clamp(up, -limit, limit) (no clamp when limit <= 0); h = silu(g) =
// g / (1 + exp(0 - g)) rounded to the dtype; h = h * u rounded to the dtype; out = (h * weight[r])
// in fp32, stored in the dtype.
void swiglu(const void* gate, const void* up, int bf16, const float* weight, int64_t N, int64_t I, float limit,
            void* out);

// MoE combine (model/moe.py): y[t] = (sum over j < k of out[row(t k + j)] in torch's order: the
// cascade for channels in whole groups of 32, its 4-stream row sum after them) + out[shared0 + t],
// in fp32, stored in out's dtype; row(s) = i with sel[i] = s.
void moe_combine(const void* out, int bf16, const int64_t* sel, int64_t T, int64_t k, int64_t D, int64_t shared0,
                 void* y);

}  // namespace kvshare_kernels

namespace kvshare_kernels {

// MoE routing (model/moe.py `Gate`) of logits [T][E] fp32: scores = sqrt(softplus(logits)) (func 0;
// softplus = log1p(exp(x)), x itself above 20; sqrt: MKL's vmsSqrt as torch.sqrt) or sigmoid(logits)
// (func 1), SLEEF as torch's vector kernels; ids [T][k] = the k largest of (scores + bias) in descending order, ties toward the lower
// expert id (a stable descending sort); weights [T][k] = scores at ids. bias may be null.
void moe_route(const float* logits, const float* bias, int64_t T, int64_t E, int64_t k, int func, float* weights,
               int64_t* ids);
// The scores of given picks ids [T][k] (each in [0, E): the caller checks): moe_route's scores, no top-k
// (V4's hash-routed layers, whose experts come from the token id).
void moe_scores_at(const float* logits, int64_t T, int64_t E, int64_t k, int func, const int64_t* ids, float* weights);

}  // namespace kvshare_kernels
