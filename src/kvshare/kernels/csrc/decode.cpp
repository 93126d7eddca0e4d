// Decode-step kernels outside the GEMMs (see decode.h). Compiled for AVX2 + FMA (the native
// library's floor: `best_isa` serves no native path on a CPU without them), with floating-point
// contraction off, so the only fused multiply-adds are the explicit `fmaf` calls; the same bits
// under every code path ("amx", "avx512", "avx2").
//
// exp is SLEEF's vector expf (1-ulp, "u10"), the one torch's vectorised sigmoid and softmax call:
// libtorch_cpu exports it, and its 8- and 16-lane versions give the same bits, so these kernels
// reproduce torch's element-wise results whichever ATEN_CPU_CAPABILITY torch runs with.
#pragma GCC target("avx2,fma,f16c")
#pragma GCC optimize("fp-contract=off")
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "decode.h"
#include "lanes8.h"

extern "C" __m256 Sleef_expf8_u10(__m256);

namespace kvshare_kernels {
namespace {

// exp of n <= 16 values in place (SLEEF, as torch's vectorised kernels).
inline void exp_n(float* v, int n) {
  for (int i = 0; i < n; i += 8) {
    alignas(32) float buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    const int c = n - i < 8 ? n - i : 8;
    for (int l = 0; l < c; ++l) buf[l] = v[i + l];
    _mm256_store_ps(buf, Sleef_expf8_u10(_mm256_load_ps(buf)));
    for (int l = 0; l < c; ++l) v[i + l] = buf[l];
  }
}

// torch's vectorised sigmoid: 1 / (1 + exp(0 - z)), for n <= 16 values in place.
inline void sigmoid_n(float* v, int n) {
  for (int i = 0; i < n; ++i) v[i] = 0.0f - v[i];
  exp_n(v, n);
  for (int i = 0; i < n; ++i) v[i] = 1.0f / (v[i] + 1.0f);
}


inline float load(const void* p, int bf16, int64_t i) {
  return bf16 ? bf16_to_f32(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

inline void store(void* p, int bf16, int64_t i, float v) {
  if (bf16) static_cast<uint16_t*>(p)[i] = f32_to_bf16(v);
  else static_cast<float*>(p)[i] = v;
}

void sinkhorn_row(float* c, int hc, float eps, int iters) {
  float s[16];
  for (int it = 0; it < iters - 1; ++it) {
    for (int j = 0; j < hc; ++j) {  // rows: over k
      float a = 0.0f;
      for (int k = 0; k < hc; ++k) a += c[j * hc + k];
      a += eps;
      for (int k = 0; k < hc; ++k) c[j * hc + k] /= a;
    }
    for (int k = 0; k < hc; ++k) s[k] = 0.0f;  // columns: over j
    for (int j = 0; j < hc; ++j)
      for (int k = 0; k < hc; ++k) s[k] += c[j * hc + k];
    for (int k = 0; k < hc; ++k) s[k] += eps;
    for (int j = 0; j < hc; ++j)
      for (int k = 0; k < hc; ++k) c[j * hc + k] /= s[k];
  }
}

}  // namespace

void sinkhorn(float* comb, int64_t T, int hc, float eps, int iters) {
  for (int64_t t = 0; t < T; ++t) sinkhorn_row(comb + t * hc * hc, hc, eps, iters);
}

void mhc_post(const float* m, int64_t T, int64_t ld, const float* base, const float* scale, int hc,
              float eps, int iters, float* pre, float* post, float* comb) {
  for (int64_t t = 0; t < T; ++t) {
    const float* mt = m + t * ld;
    float zp[16], zq[16];
    for (int i = 0; i < hc; ++i) {
      zp[i] = mt[i] * scale[0] + base[i];
      zq[i] = mt[hc + i] * scale[1] + base[hc + i];
    }
    sigmoid_n(zp, hc);
    sigmoid_n(zq, hc);
    for (int i = 0; i < hc; ++i) {
      pre[t * hc + i] = zp[i] + eps;
      post[t * hc + i] = 2.0f * zq[i];
    }
    float* c = comb + t * hc * hc;
    for (int j = 0; j < hc; ++j) {
      float* row = c + j * hc;
      const float* mj = mt + 2 * hc + j * hc;
      const float* bj = base + 2 * hc + j * hc;
      float mx = -INFINITY;
      for (int k = 0; k < hc; ++k) {
        row[k] = mj[k] * scale[2] + bj[k];
        mx = row[k] > mx ? row[k] : mx;
      }
      for (int k = 0; k < hc; ++k) row[k] = row[k] - mx;
      exp_n(row, hc);
      float sum = 0.0f;  // torch's softmax over a short last dim: a sequential sum, then x * (1 / sum)
      for (int k = 0; k < hc; ++k) sum += row[k];
      const float inv = 1.0f / sum;
      for (int k = 0; k < hc; ++k) row[k] = row[k] * inv + eps;
    }
    float s[16];
    for (int k = 0; k < hc; ++k) s[k] = 0.0f;
    for (int j = 0; j < hc; ++j)
      for (int k = 0; k < hc; ++k) s[k] += c[j * hc + k];
    for (int k = 0; k < hc; ++k) s[k] += eps;
    for (int j = 0; j < hc; ++j)
      for (int k = 0; k < hc; ++k) c[j * hc + k] /= s[k];
    sinkhorn_row(c, hc, eps, iters);
  }
}

void mhc_collapse(const void* h, int h_bf16, const float* pre, int64_t T, int hc, int64_t D, void* out) {
  float acc[256];
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t d0 = 0; d0 < D; d0 += 256) {
      const int64_t n = D - d0 < 256 ? D - d0 : 256;
      for (int64_t i = 0; i < n; ++i) acc[i] = 0.0f;
      for (int j = 0; j < hc; ++j) {
        const float p = pre[t * hc + j];
        const int64_t base = (t * hc + j) * D + d0;
        if (h_bf16) {
          const uint16_t* hp = static_cast<const uint16_t*>(h) + base;
          for (int64_t i = 0; i < n; ++i) acc[i] += p * bf16_to_f32(hp[i]);
        } else {
          const float* hp = static_cast<const float*>(h) + base;
          for (int64_t i = 0; i < n; ++i) acc[i] += p * hp[i];
        }
      }
      for (int64_t i = 0; i < n; ++i) store(out, h_bf16, t * D + d0 + i, acc[i]);
    }
  }
}

void mhc_expand(const void* h, const void* y, int h_bf16, const float* post, const float* comb, int64_t T,
                int hc, int64_t D, void* out) {
  float hv[16][256];
  float acc[256];
  float yv[256];
  for (int64_t t = 0; t < T; ++t) {
    const float* c = comb + t * hc * hc;
    for (int64_t d0 = 0; d0 < D; d0 += 256) {
      const int64_t n = D - d0 < 256 ? D - d0 : 256;
      for (int j = 0; j < hc; ++j)
        for (int64_t i = 0; i < n; ++i) hv[j][i] = load(h, h_bf16, (t * hc + j) * D + d0 + i);
      for (int64_t i = 0; i < n; ++i) yv[i] = load(y, h_bf16, t * D + d0 + i);
      for (int k = 0; k < hc; ++k) {
        for (int64_t i = 0; i < n; ++i) acc[i] = 0.0f;
        for (int j = 0; j < hc; ++j) {
          const float cj = c[j * hc + k];
          for (int64_t i = 0; i < n; ++i) acc[i] = fmaf(cj, hv[j][i], acc[i]);
        }
        const float pk = post[t * hc + k];
        for (int64_t i = 0; i < n; ++i) {
          const float py = pk * yv[i];
          store(out, h_bf16, (t * hc + k) * D + d0 + i, acc[i] + py);
        }
      }
    }
  }
}

}  // namespace kvshare_kernels

namespace kvshare_kernels {

void rope(const void* x, int bf16, const float* c, const float* s, int64_t P, int64_t inner, int64_t D,
          int64_t rd, void* out) {
  const int64_t lead = D - rd;
  for (int64_t p = 0; p < P; ++p) {
    const float* cp = c + p * rd;
    const float* sp = s + p * rd;
    for (int64_t h = 0; h < inner; ++h) {
      const int64_t row = (p * inner + h) * D;
      if (out != x)
        for (int64_t i = 0; i < lead; ++i) store(out, bf16, row + i, load(x, bf16, row + i));
      for (int64_t i = 0; i < rd; i += 2) {
        const float a = load(x, bf16, row + lead + i), b = load(x, bf16, row + lead + i + 1);
        const float ac = a * cp[i], bs = b * sp[i];
        const float bc = b * cp[i + 1], as = a * sp[i + 1];
        store(out, bf16, row + lead + i, ac + bs);
        store(out, bf16, row + lead + i + 1, bc + as);
      }
    }
  }
}

}  // namespace kvshare_kernels

namespace kvshare_kernels {

namespace {

constexpr int64_t POOL_MAX_SLOTS = 1024;

// torch's cascade sum over n values (SumKernel's multi_row_sum, 4 levels): level 0 sums blocks of
// 2^p values from 0 (p = max(4, ceil(log2 n) / 4)); a full block is carried up while the index is
// a multiple of the next level's span; the rest sums into level 0; levels are added in order.
inline __m256 cascade_sum8(const __m256* v, int64_t n) {
  int ceil_log2 = 0;
  while ((int64_t(1) << ceil_log2) < n) ++ceil_log2;
  const int p = ceil_log2 / 4 > 4 ? ceil_log2 / 4 : 4;
  const int64_t step = int64_t(1) << p, mask = step - 1;
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t i = 0;
  while (i + step <= n) {
    for (int64_t j = 0; j < step; ++j, ++i) acc[0] = _mm256_add_ps(acc[0], v[i]);
    for (int j = 1; j < 4; ++j) {
      acc[j] = _mm256_add_ps(acc[j], acc[j - 1]);
      acc[j - 1] = _mm256_setzero_ps();
      if (i & (mask << (j * p))) break;
    }
  }
  for (; i < n; ++i) acc[0] = _mm256_add_ps(acc[0], v[i]);
  for (int j = 1; j < 4; ++j) acc[0] = _mm256_add_ps(acc[0], acc[j]);
  return acc[0];
}

}  // namespace

void compress_pool(const float* hist, const uint8_t* valid, int64_t T, int64_t S, int64_t d, int overlap,
                   int out_bf16, void* out) {
  const int64_t W = (overlap ? 2 : 1) * d;
  __m256 e[POOL_MAX_SLOTS];
  alignas(32) float buf[8];
  for (int64_t t = 0; t < T; ++t) {
    const float* ht = hist + t * S * 2 * W;
    const uint8_t* vt = valid ? valid + t * S : nullptr;
    for (int64_t c0 = 0; c0 < d; c0 += 8) {
      const int64_t nc = d - c0 < 8 ? d - c0 : 8;
      const __m256i lane_ok = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(nc)),
                                                 _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      auto at = [&](int64_t s, int64_t base) {
        const float* src = ht + s * 2 * W + base + ((overlap && s >= S / 2) ? d : 0) + c0;
        return _mm256_maskload_ps(src, lane_ok);
      };
      const __m256 ninf = _mm256_set1_ps(-INFINITY);
      __m256 mx = ninf;
      for (int64_t s = 0; s < S; ++s) {
        const __m256 z = (vt && !vt[s]) ? ninf : at(s, W);
        e[s] = z;
        mx = _mm256_max_ps(mx, z);
      }
      __m256 sum = _mm256_setzero_ps();
      for (int64_t s = 0; s < S; ++s) {
        e[s] = Sleef_expf8_u10(_mm256_sub_ps(e[s], mx));
        sum = _mm256_add_ps(sum, e[s]);
      }
      for (int64_t s = 0; s < S; ++s) {
        const __m256 kv = (vt && !vt[s]) ? _mm256_setzero_ps() : at(s, 0);
        e[s] = _mm256_mul_ps(_mm256_div_ps(e[s], sum), kv);
      }
      _mm256_store_ps(buf, cascade_sum8(e, S));
      for (int64_t i = 0; i < nc; ++i) store(out, out_bf16, t * d + c0 + i, buf[i]);
    }
  }
}

}  // namespace kvshare_kernels

namespace kvshare_kernels {

namespace {

constexpr int64_t ATTN_MAX_D = 1024;

}  // namespace

void sparse_attention(const void* q, const void* ka, const uint8_t* va, int64_t ma, const void* kb,
                      const uint8_t* vb, int64_t mb, const float* sink, int64_t T, int64_t H, int64_t d,
                      float scale, int bf16, void* out) {
  const int64_t m_all = ma + mb;
  float* s = static_cast<float*>(__builtin_alloca(sizeof(float) * (m_all + 8)));
  __m256 qv[ATTN_MAX_D / 8];
  __m256 acc[ATTN_MAX_D / 8];
  const int64_t nv = d / 8;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t v = 0; v < nv; ++v) qv[v] = load8(q, bf16, (t * H + h) * d + v * 8);
      float mx = sink[h];
      for (int64_t i = 0; i < m_all; ++i) {
        const bool in_a = i < ma;
        const int64_t j = in_a ? i : i - ma;
        const uint8_t ok = in_a ? va[t * ma + j] : vb[t * mb + j];
        if (!ok) {
          s[i] = -INFINITY;
          continue;
        }
        const void* k = in_a ? ka : kb;
        const int64_t base = (t * (in_a ? ma : mb) + j) * d;
        __m256 dot = _mm256_setzero_ps();
        for (int64_t v = 0; v < nv; ++v) dot = _mm256_fmadd_ps(qv[v], load8(k, bf16, base + v * 8), dot);
        s[i] = hsum8(dot) * scale;
        mx = s[i] > mx ? s[i] : mx;
      }
      float denom = 0.0f;
      for (int64_t i = 0; i < m_all; i += 8) {  // p_i = exp(s_i - m) in place, 8 at a time
        const int64_t c = m_all - i < 8 ? m_all - i : 8;
        alignas(32) float buf[8];
        for (int64_t l = 0; l < 8; ++l) buf[l] = l < c ? s[i + l] - mx : -INFINITY;
        _mm256_store_ps(buf, Sleef_expf8_u10(_mm256_load_ps(buf)));
        for (int64_t l = 0; l < c; ++l) {
          s[i + l] = buf[l];
          denom += buf[l];
        }
      }
      {
        alignas(32) float buf[8] = {sink[h] - mx, 0, 0, 0, 0, 0, 0, 0};
        _mm256_store_ps(buf, Sleef_expf8_u10(_mm256_load_ps(buf)));
        denom += buf[0];
      }
      for (int64_t v = 0; v < nv; ++v) acc[v] = _mm256_setzero_ps();
      for (int64_t i = 0; i < m_all; ++i) {
        if (s[i] == 0.0f) continue;  // masked (exp(-inf) = 0) or underflowed: adds nothing
        const bool in_a = i < ma;
        const int64_t j = in_a ? i : i - ma;
        const void* k = in_a ? ka : kb;
        const int64_t base = (t * (in_a ? ma : mb) + j) * d;
        const __m256 p = _mm256_set1_ps(s[i]);
        for (int64_t v = 0; v < nv; ++v) acc[v] = _mm256_fmadd_ps(p, load8(k, bf16, base + v * 8), acc[v]);
      }
      const __m256 dv = _mm256_set1_ps(denom);
      alignas(32) float o[8];
      for (int64_t v = 0; v < nv; ++v) {
        _mm256_store_ps(o, _mm256_div_ps(acc[v], dv));
        for (int l = 0; l < 8; ++l) store(out, bf16, (t * H + h) * d + v * 8 + l, o[l]);
      }
    }
  }
}

}  // namespace kvshare_kernels

namespace kvshare_kernels {

namespace {

inline int ceil_log2(int64_t n) {
  int c = 0;
  while ((int64_t(1) << c) < n) ++c;
  return c;
}

// torch's row_sum over n vectors (SumKernel): four interleaved streams (vector i goes to stream
// i % 4) cascaded over n / 4 steps, the leftover vectors added to stream 0, then streams 1-3 added
// to stream 0 in order. (cascade_sum8 is its multi_row_sum with one stream.) `load(c)` gives vector c.
template <class Load>
inline __m256 row_sum8_of(Load load, int64_t n) {
  const int64_t size_ilp = n / 4;
  __m256 ps[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  if (size_ilp > 0) {
    const int p = ceil_log2(size_ilp) / 4 > 4 ? ceil_log2(size_ilp) / 4 : 4;
    const int64_t step = int64_t(1) << p, mask = step - 1;
    __m256 acc[4][4];
    for (int j = 0; j < 4; ++j)
      for (int k = 0; k < 4; ++k) acc[j][k] = _mm256_setzero_ps();
    int64_t i = 0;
    while (i + step <= size_ilp) {
      for (int64_t j = 0; j < step; ++j, ++i)
        for (int k = 0; k < 4; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], load(i * 4 + k));
      for (int j = 1; j < 4; ++j) {
        for (int k = 0; k < 4; ++k) {
          acc[j][k] = _mm256_add_ps(acc[j][k], acc[j - 1][k]);
          acc[j - 1][k] = _mm256_setzero_ps();
        }
        if (i & (mask << (j * p))) break;
      }
    }
    for (; i < size_ilp; ++i)
      for (int k = 0; k < 4; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], load(i * 4 + k));
    for (int j = 1; j < 4; ++j)
      for (int k = 0; k < 4; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], acc[j][k]);
    for (int k = 0; k < 4; ++k) ps[k] = acc[0][k];
  }
  for (int64_t c = size_ilp * 4; c < n; ++c) ps[0] = _mm256_add_ps(ps[0], load(c));
  for (int k = 1; k < 4; ++k) ps[0] = _mm256_add_ps(ps[0], ps[k]);
  return ps[0];
}

// torch's sum of a contiguous fp32 row (SumKernel: vectorized_inner_sum -> row_sum -> multi_row_sum):
// row_sum over the row's whole vectors, then the scalar tail, then the 8 lanes in order.
inline float torch_inner_sum(const float* v, int64_t n) {
  const int64_t vec_size = n / 8;
  const __m256 total = row_sum8_of([v](int64_t c) { return _mm256_loadu_ps(v + c * 8); }, vec_size);
  float fin = 0.0f;
  for (int64_t k = vec_size * 8; k < n; ++k) fin += v[k];
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, total);
  for (int l = 0; l < 8; ++l) fin += lanes[l];
  return fin;
}

}  // namespace

void rms_norm(const void* x, int x_bf16, const float* w, int64_t R, int64_t n, float eps, int out_bf16, void* out) {
  float* row = static_cast<float*>(__builtin_alloca(sizeof(float) * (2 * n + 8)));
  float* sq = row + n;
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t i = 0; i < n; ++i) {
      row[i] = load(x, x_bf16, r * n + i);
      sq[i] = row[i] * row[i];
    }
    const float mean = torch_inner_sum(sq, n) / static_cast<float>(n);
    const float inv = 1.0f / sqrtf(mean + eps);
    for (int64_t i = 0; i < n; ++i) {
      float v = row[i] * inv;
      if (w) v = v * w[i];
      store(out, out_bf16, r * n + i, v);
    }
  }
}

}  // namespace kvshare_kernels

namespace kvshare_kernels {

namespace {

inline float round_to(float v, int bf16) { return bf16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

}  // namespace

void swiglu(const void* gate, const void* up, int bf16, const float* weight, int64_t N, int64_t I, float limit,
            void* out) {
  const float lim_g = limit > 0 ? round_to(limit, bf16) : 0.0f;
  const float lim_u = limit > 0 ? round_to(-limit, bf16) : 0.0f;
  alignas(32) float g[8], u[8];
  for (int64_t r = 0; r < N; ++r) {
    const float w = weight[r];
    for (int64_t i0 = 0; i0 < I; i0 += 8) {
      const int64_t c = I - i0 < 8 ? I - i0 : 8;
      for (int64_t l = 0; l < 8; ++l) {
        g[l] = l < c ? load(gate, bf16, r * I + i0 + l) : 0.0f;
        u[l] = l < c ? load(up, bf16, r * I + i0 + l) : 0.0f;
        if (limit > 0) {
          g[l] = g[l] > lim_g ? lim_g : g[l];
          u[l] = u[l] > lim_g ? lim_g : (u[l] < lim_u ? lim_u : u[l]);
        }
      }
      const __m256 gv = _mm256_load_ps(g);
      const __m256 sv = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f),
                                                          Sleef_expf8_u10(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
      _mm256_store_ps(g, sv);
      for (int64_t l = 0; l < c; ++l) {
        const float h = round_to(round_to(g[l], bf16) * u[l], bf16);
        store(out, bf16, r * I + i0 + l, h * w);
      }
    }
  }
}

namespace {

inline __m256 row_sum8(const __m256* v, int64_t n) {
  return row_sum8_of([v](int64_t c) { return v[c]; }, n);
}

}  // namespace

void moe_combine(const void* out, int bf16, const int64_t* sel, int64_t T, int64_t k, int64_t D, int64_t shared0,
                 void* y) {
  // torch sums the k slots per channel with multi_row_sum for channels in whole groups of 32 (four
  // vectors) and with row_sum for the channels after the last such group
  const int64_t d_multi = D / 32 * 32;
  // heap, not stack: T * k grows with a prefill's tokens (a 64K-token step would be 3 MiB at k = 6)
  int64_t* row = static_cast<int64_t*>(malloc(sizeof(int64_t) * (T * k + 1)));
  if (row == nullptr) {  // out of memory: NaN rows (visible downstream), never stale values
    for (int64_t i = 0; i < T * D; ++i) store(y, bf16, i, __builtin_nanf(""));
    return;
  }
  for (int64_t i = 0; i < T * k; ++i) row[sel[i]] = i;
  __m256* v = static_cast<__m256*>(__builtin_alloca(sizeof(__m256) * (k + 1)));
  alignas(32) float buf[8];
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t d0 = 0; d0 < D; d0 += 8) {
      const int64_t c = D - d0 < 8 ? D - d0 : 8;
      for (int64_t j = 0; j < k; ++j) {
        for (int64_t l = 0; l < 8; ++l) buf[l] = l < c ? load(out, bf16, row[t * k + j] * D + d0 + l) : 0.0f;
        v[j] = _mm256_load_ps(buf);
      }
      for (int64_t l = 0; l < 8; ++l) buf[l] = l < c ? load(out, bf16, (shared0 + t) * D + d0 + l) : 0.0f;
      const __m256 routed = d0 + 8 <= d_multi ? cascade_sum8(v, k) : row_sum8(v, k);
      const __m256 total = _mm256_add_ps(routed, _mm256_load_ps(buf));
      _mm256_store_ps(buf, total);
      for (int64_t l = 0; l < c; ++l) store(y, bf16, t * D + d0 + l, buf[l]);
    }
  }
  free(row);
}

}  // namespace kvshare_kernels

extern "C" __m256 Sleef_log1pf8_u10(__m256);
// MKL's vector sqrt, which torch.sqrt calls for fp32 (ATen/cpu/vml.h: high accuracy, not always
// correctly rounded); libtorch_cpu exports it. Mode: VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE.
extern "C" void vmsSqrt(const int n, const float* a, float* r, const long long mode);
constexpr long long TORCH_VML_MODE = 0x2 | 0x140000 | 0x100;

namespace kvshare_kernels {


// One row's gate scores (moe_route's and moe_scores' arithmetic): `scores` holds E + 8 floats.
static void row_scores(const float* lt, int64_t E, int func, float* scores) {
  alignas(32) float buf[8];
  for (int64_t e0 = 0; e0 < E; e0 += 8) {
    const int64_t c = E - e0 < 8 ? E - e0 : 8;
    for (int64_t l = 0; l < 8; ++l) buf[l] = l < c ? lt[e0 + l] : 0.0f;
    const __m256 x = _mm256_load_ps(buf);
    __m256 s;
    if (func == 0) {  // torch's softplus (beta 1, threshold 20), then sqrt
      const __m256 sp = Sleef_log1pf8_u10(Sleef_expf8_u10(x));
      s = _mm256_blendv_ps(sp, x, _mm256_cmp_ps(x, _mm256_set1_ps(20.0f), _CMP_GT_OQ));
    } else {  // torch's sigmoid
      s = _mm256_div_ps(_mm256_set1_ps(1.0f),
                        _mm256_add_ps(Sleef_expf8_u10(_mm256_sub_ps(_mm256_setzero_ps(), x)), _mm256_set1_ps(1.0f)));
    }
    _mm256_store_ps(buf, s);
    for (int64_t l = 0; l < c; ++l) scores[e0 + l] = buf[l];
  }
  if (func == 0) vmsSqrt(static_cast<int>(E), scores, scores, TORCH_VML_MODE);  // torch's .sqrt()
}

void moe_route(const float* logits, const float* bias, int64_t T, int64_t E, int64_t k, int func, float* weights,
               int64_t* ids) {
  float* scores = static_cast<float*>(__builtin_alloca(sizeof(float) * (E + 8)));
  float* key = static_cast<float*>(__builtin_alloca(sizeof(float) * (E + 8)));
  uint8_t* taken = static_cast<uint8_t*>(__builtin_alloca(E + 8));
  for (int64_t t = 0; t < T; ++t) {
    row_scores(logits + t * E, E, func, scores);
    for (int64_t e = 0; e < E; ++e) {
      key[e] = bias ? scores[e] + bias[e] : scores[e];
      taken[e] = 0;
    }
    for (int64_t j = 0; j < k; ++j) {  // k passes: the largest untaken key, the lowest id on ties
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e)
        if (!taken[e] && (best < 0 || key[e] > key[best])) best = e;
      taken[best] = 1;
      ids[t * k + j] = best;
      weights[t * k + j] = scores[best];
    }
  }
}

void moe_scores_at(const float* logits, int64_t T, int64_t E, int64_t k, int func, const int64_t* ids, float* weights) {
  float* scores = static_cast<float*>(__builtin_alloca(sizeof(float) * (E + 8)));
  for (int64_t t = 0; t < T; ++t) {
    row_scores(logits + t * E, E, func, scores);
    for (int64_t j = 0; j < k; ++j) weights[t * k + j] = scores[ids[t * k + j]];
  }
}

}  // namespace kvshare_kernels
