// Paged sparse attention (see attn.h). Compiled like decode.cpp: AVX2 + FMA, floating-point
// contraction off (the only fused multiply-adds are the explicit ones), SLEEF's expf as torch's
// vector kernels. Quantised keys are decoded to q's dtype once per query row (row_codec.h); keys are
// converted to fp32 once per row and used by every head; per (row, head)
// each dot product, the max, the exp, the denominator and the weighted sum run in exactly the
// order of decode.cpp's sparse_attention, so the bits are that kernel's over the gathered keys.
#pragma GCC target("avx2,fma,f16c")
#pragma GCC optimize("fp-contract=off")
#include <immintrin.h>
#include <math.h>
#include <string.h>
#include <vector>
#include "attn.h"
#include "lanes8.h"

extern "C" __m256 Sleef_expf8_u10(__m256);

namespace kvshare_kernels {
namespace {

inline void to_f32(const uint8_t* p, int bf16, int64_t d, float* out) {
  if (!bf16) {
    memcpy(out, p, sizeof(float) * d);
    return;
  }
  const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
  for (int64_t i = 0; i < d; i += 8) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i));
    _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16)));
  }
}

// A stored key row as values of q's dtype: the row itself (ROW_PLAIN), else decoded and rounded into `dst`.
const uint8_t* readable(const uint8_t* src, const RowCodec& c, int bf16, int64_t d, float* tmp, uint8_t* dst) {
  if (c.scheme == ROW_PLAIN) return src;
  decode_row(src, c, tmp);
  if (!bf16) {
    memcpy(dst, tmp, sizeof(float) * d);
    return dst;
  }
  uint16_t* h = reinterpret_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < d; ++i) h[i] = f32_to_bf16(tmp[i]);
  return dst;
}

// The key rows of query row t, in attention order (null = invalid key), each readable as q's dtype:
// quantised rows are decoded into `scratch` (one row of d values per key).
void row_keys(int64_t t, const WindowKeys& w, const PoolKeys* c, int bf16, int64_t d,
              std::vector<const uint8_t*>& keys, std::vector<uint8_t>& scratch, std::vector<float>& tmp) {
  keys.clear();
  const int64_t n = c == nullptr ? 0 : (c->picks ? c->m : c->counts[t]);
  const int64_t esz = bf16 ? 2 : 4;
  scratch.resize(static_cast<size_t>((w.W + n) * d * esz));  // before any pointer into it is taken
  tmp.resize(static_cast<size_t>(d));
  auto spare = [&]() { return scratch.data() + static_cast<int64_t>(keys.size()) * d * esz; };
  const int64_t* m = w.meta + 4 * t;
  const int64_t slot = m[0], pos = m[1], start = m[2], first = m[3];
  for (int64_t i = 0; i < w.W; ++i) {
    const int64_t x = pos - w.W + 1 + i;
    if (x < 0) keys.push_back(nullptr);
    else if (x >= start) keys.push_back(w.step + (first + x - start) * w.step_stride);
    else keys.push_back(readable(w.ring + slot * w.slot_stride + (x % w.ring_rows) * w.row_stride, w.codec, bf16, d,
                                 tmp.data(), spare()));
  }
  if (c == nullptr) return;
  const int64_t* tab = c->tables + c->seq[t] * c->table_cols;
  for (int64_t e = 0; e < n; ++e) {
    const int64_t j = c->picks ? c->picks[t * c->m + e] : e;
    const int64_t p = j * c->ratio;
    const int64_t col = j >= 0 ? p / c->block_size : c->table_cols;
    if (col >= c->table_cols) {
      keys.push_back(nullptr);
      continue;
    }
    const int64_t row = (p % c->block_size) / c->ratio;
    keys.push_back(readable(c->pool + tab[col] * c->block_stride + row * c->row_stride, c->codec, bf16, d, tmp.data(),
                            spare()));
  }
}

}  // namespace

void paged_attention(const void* q, int bf16, int64_t H, int64_t d, const WindowKeys& win, const PoolKeys* pool,
                     const float* sink, float scale, int64_t t0, int64_t t1, void* out) {
  const int64_t nv = d / 8;
  const int64_t esz = bf16 ? 2 : 4;
  std::vector<const uint8_t*> keys;
  std::vector<uint8_t> scratch;
  std::vector<float> qf(H * d), kf(d), acc(H * d), s, denom(H), mx(H), tmp;
  for (int64_t t = t0; t < t1; ++t) {
    row_keys(t, win, pool, bf16, d, keys, scratch, tmp);
    const int64_t M = static_cast<int64_t>(keys.size());
    s.assign(H * (M + 8), 0.0f);
    to_f32(static_cast<const uint8_t*>(q) + t * H * d * esz, bf16, H * d, qf.data());
    for (int64_t h = 0; h < H; ++h) mx[h] = sink[h];
    for (int64_t i = 0; i < M; ++i) {  // scores: every head against key i
      if (keys[i] == nullptr) {
        for (int64_t h = 0; h < H; ++h) s[h * (M + 8) + i] = -INFINITY;
        continue;
      }
      to_f32(keys[i], bf16, d, kf.data());
      for (int64_t h0 = 0; h0 < H; h0 += 4) {  // 4 heads' chains interleaved (each in its own order)
        const int64_t nh = H - h0 < 4 ? H - h0 : 4;
        __m256 dot[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        const float* q0 = qf.data() + h0 * d;
        if (nh == 4) {
          for (int64_t v = 0; v < nv; ++v) {
            const __m256 k = _mm256_loadu_ps(kf.data() + v * 8);
            dot[0] = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + v * 8), k, dot[0]);
            dot[1] = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + d + v * 8), k, dot[1]);
            dot[2] = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + 2 * d + v * 8), k, dot[2]);
            dot[3] = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + 3 * d + v * 8), k, dot[3]);
          }
        } else {
          for (int64_t hh = 0; hh < nh; ++hh)
            for (int64_t v = 0; v < nv; ++v)
              dot[hh] = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + hh * d + v * 8), _mm256_loadu_ps(kf.data() + v * 8), dot[hh]);
        }
        for (int64_t hh = 0; hh < nh; ++hh) {
          const int64_t h = h0 + hh;
          const float si = hsum8(dot[hh]) * scale;
          s[h * (M + 8) + i] = si;
          mx[h] = si > mx[h] ? si : mx[h];
        }
      }
    }
    for (int64_t h = 0; h < H; ++h) {  // p = exp(s - m) in place, 8 at a time; denominators in key order
      float* sh = s.data() + h * (M + 8);
      float dn = 0.0f;
      for (int64_t i = 0; i < M; i += 8) {
        const int64_t c = M - i < 8 ? M - i : 8;
        alignas(32) float buf[8];
        for (int64_t l = 0; l < 8; ++l) buf[l] = l < c ? sh[i + l] - mx[h] : -INFINITY;
        _mm256_store_ps(buf, Sleef_expf8_u10(_mm256_load_ps(buf)));
        for (int64_t l = 0; l < c; ++l) {
          sh[i + l] = buf[l];
          dn += buf[l];
        }
      }
      alignas(32) float buf[8] = {sink[h] - mx[h], 0, 0, 0, 0, 0, 0, 0};
      _mm256_store_ps(buf, Sleef_expf8_u10(_mm256_load_ps(buf)));
      denom[h] = dn + buf[0];
    }
    // weighted values: per head and block of 64 channels, the accumulators stay in registers while
    // the keys go by in order (each channel's fma chain over the keys is decode.cpp's)
    for (int64_t h = 0; h < H; ++h) {
      const float* sh = s.data() + h * (M + 8);
      for (int64_t v0 = 0; v0 < nv; v0 += 8) {
        const int64_t nb = nv - v0 < 8 ? nv - v0 : 8;
        __m256 a[8];
        for (int u = 0; u < 8; ++u) a[u] = _mm256_setzero_ps();
        for (int64_t i = 0; i < M; ++i) {
          const float p = sh[i];
          if (p == 0.0f || keys[i] == nullptr) continue;  // masked or underflowed: adds nothing (as decode.cpp)
          const __m256 pv = _mm256_set1_ps(p);
          if (nb == 8) {
            for (int u = 0; u < 8; ++u) a[u] = _mm256_fmadd_ps(pv, load8(keys[i], bf16, (v0 + u) * 8), a[u]);
          } else {
            for (int64_t u = 0; u < nb; ++u) a[u] = _mm256_fmadd_ps(pv, load8(keys[i], bf16, (v0 + u) * 8), a[u]);
          }
        }
        for (int64_t u = 0; u < nb; ++u) _mm256_storeu_ps(acc.data() + h * d + (v0 + u) * 8, a[u]);
      }
    }
    for (int64_t h = 0; h < H; ++h) {
      const __m256 dv = _mm256_set1_ps(denom[h]);
      const float* ah = acc.data() + h * d;
      const int64_t o = (t * H + h) * d;
      for (int64_t v = 0; v < nv; ++v) {
        alignas(32) float r[8];
        _mm256_store_ps(r, _mm256_div_ps(_mm256_loadu_ps(ah + v * 8), dv));
        for (int l = 0; l < 8; ++l) {
          if (bf16) static_cast<uint16_t*>(out)[o + v * 8 + l] = f32_to_bf16(r[l]);
          else static_cast<float*>(out)[o + v * 8 + l] = r[l];
        }
      }
    }
  }
}

}  // namespace kvshare_kernels
