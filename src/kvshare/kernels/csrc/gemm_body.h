// The ISA-independent loop nest, included once by each ISA translation unit after it defined,
// inside an anonymous namespace, the vector type V (16 fp32 lanes), the decoded-weight type WP
// (16 lanes of one k pair) and their operations (wp_fp8_two: two consecutive pairs), MR, FEW_ROWS
// and FEW_GROUPS. Everything here has internal linkage, so no
// function compiled for one ISA can be picked by the linker for the other.
//
// Reduction order (the contract): each output lane accumulates its k pairs in increasing p, the
// odd k before the even k of a pair, one rounded fp32 add per product (products of bf16 values
// are exact in fp32). Scaled formats sum each block of bk inputs from +0 that way, then add
// block_sum * 2^e (exact product) to the running total with one rounding, blocks in increasing
// order. FP32 weights: per block of 32 inputs one fma per k from zero, then total += block sum.
// None of it depends on M, on the row's
// position, on the tile shapes below or on the thread that computes the group.

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// ue8m0 byte -> 2^(e - 127) (e = 0: the subnormal 2^-127), as vexp2 does per lane.
static inline float exp2_byte(uint8_t e) {
  const uint32_t bits = e ? static_cast<uint32_t>(e) << 23 : 0x00400000u;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

constexpr int NR = 2;     // 16-lane output groups per tile
constexpr int MS = 64;           // rows whose totals are kept while a weight block is decoded once
constexpr int MAX_BLOCK = 256;  // largest scale block along K

constexpr int64_t PREFETCH_BYTES = 4096;  // how far ahead each lane stream of weight bytes is prefetched

// Bytes of one k pair of one 16-lane group in the packed weight.
static inline int64_t pair_bytes(int fmt) { return fmt == FMT_FP8 ? 32 : (fmt == FMT_FP4 ? 16 : 64); }

static inline const uint8_t* group_pairs(const GemmArgs& a, int64_t nb, int64_t p) {
  return static_cast<const uint8_t*>(a.w) + (nb * (a.KP / 2) + p) * pair_bytes(a.fmt);
}

// The weights of pairs [p0, p0 + pb) of group nb (lane g of a tile of G groups) as WP: bf16 is
// used in place; FP8 / FP4 are decoded into dst (bf16 too where WP is not the packed pair layout,
// WP_IS_PACKED_BF16 false). The lane's weight stream is prefetched PREFETCH_BYTES ahead, across
// group boundaries (gemm.h prefetch_stream), and the call's first block also its own bytes.
static inline const WP* block_weights(const GemmArgs& a, int64_t nb, int G, int64_t p0, int64_t pb, WP* dst) {
  const int64_t bytes = pb * pair_bytes(a.fmt), lines = (bytes + 63) / 64;
  const int64_t ahead = PREFETCH_BYTES / pair_bytes(a.fmt);
  if (p0 == 0 && nb < a.nb0 + G)
    for (int64_t q = 0; q < ahead; q += pb) prefetch_stream(a, pair_bytes(a.fmt), nb, G, 0, q, lines);
  prefetch_stream(a, pair_bytes(a.fmt), nb, G, p0, ahead, lines);
  const uint8_t* src = group_pairs(a, nb, p0);
  if (a.fmt == FMT_BF16) {
    if (WP_IS_PACKED_BF16) return reinterpret_cast<const WP*>(src);
    for (int64_t p = 0; p < pb; ++p) dst[p] = wp_bf16(reinterpret_cast<const int32_t*>(src) + 16 * p);
    return dst;
  }
  if (a.fmt == FMT_FP8) {
    int64_t p = 0;
    for (; p + 2 <= pb; p += 2) wp_fp8_two(src + 32 * p, dst[p], dst[p + 1]);
    if (p < pb) dst[p] = wp_fp8(src + 32 * p);
  } else {
    for (int64_t p = 0; p < pb; ++p) dst[p] = wp_fp4(src + 16 * p);
  }
  return dst;
}

// Rows [0, R) of one tile: totals tot[r][g] (16 floats each) updated with one block.
template <int R, int G, bool SCALED>
static inline void micro(const uint32_t* const* xr, int64_t p0, int64_t pb, const WP* const* wb,
                         const V* scale, float* tot) {
  V acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = SCALED ? vzero() : vload(tot + (r * NR + g) * 16);
  for (int64_t p = 0; p < pb; ++p) {
    for (int r = 0; r < R; ++r) {
      const uint32_t xp = xr[r][p0 + p];
      for (int g = 0; g < G; ++g) acc[r][g] = vdot(acc[r][g], xp, wb[g][p]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) {
      float* t = tot + (r * NR + g) * 16;
      vstore(t, SCALED ? vfma(acc[r][g], scale[g], vload(t)) : acc[r][g]);
    }
}

template <int G, bool SCALED>
static void rows_tile(int64_t rows, const uint32_t* const* xr, int64_t p0, int64_t pb, const WP* const* wb,
                      const V* scale, float* tot) {
  int64_t r = 0;
  for (; r + MR <= rows; r += MR) micro<MR, G, SCALED>(xr + r, p0, pb, wb, scale, tot + r * NR * 16);
  switch (rows - r) {  // the same per-lane operations as a full tile: only fewer rows
#define KV_TAIL(n) case n: micro<n, G, SCALED>(xr + r, p0, pb, wb, scale, tot + r * NR * 16); break;
    KV_TAILS
#undef KV_TAIL
    default: break;
  }
}

// Rows [m0, m0 + ms) of groups [nb, nb + g_count) from tot (16 floats of row r, group g at (r * stride + g) * 16).
static void store_rows(const GemmArgs& a, int64_t m0, int64_t ms, int64_t nb, int g_count, int stride,
                       const float* tot) {
  for (int64_t r = 0; r < ms; ++r)
    for (int g = 0; g < g_count; ++g) {
      const int64_t n0 = (nb + g) * 16;
      const int n = static_cast<int>(min64(16, a.N - n0));
      const float* t = tot + (r * stride + g) * 16;
      if (a.out_f32) {
        float* y = static_cast<float*>(a.y) + (m0 + r) * a.N + n0;
        for (int i = 0; i < n; ++i) y[i] = t[i];
      } else {
        store_bf16(static_cast<uint16_t*>(a.y) + (m0 + r) * a.N + n0, t, n);
      }
    }
}

static void gemm_pairs(const GemmArgs& a) {
  const bool scaled = a.fmt != FMT_BF16;
  const int64_t P = a.KP / 2;
  const int64_t pb = scaled ? a.bk / 2 : 16;  // pairs per block (bf16: a chunk, no scale)
  alignas(64) float tot[MS * NR * 16];
  WP buf[NR][MAX_BLOCK / 2];  // the decoded block of each group (bk <= MAX_BLOCK, checked by the caller)
  const WP* wb[NR];
  const uint32_t* xr[MS];
  V scale[NR];
  for (int64_t nb = a.nb0; nb < a.nb1; nb += NR) {
    const int g_count = static_cast<int>(min64(NR, a.nb1 - nb));
    for (int64_t m0 = 0; m0 < a.M; m0 += MS) {
      const int64_t ms = min64(MS, a.M - m0);
      for (int64_t r = 0; r < ms; ++r) xr[r] = static_cast<const uint32_t*>(a.x) + (m0 + r) * P;
      for (int64_t i = 0; i < ms * NR * 16; ++i) tot[i] = 0.0f;
      for (int64_t p0 = 0, kb = 0; p0 < P; p0 += pb, ++kb) {
        const int64_t n_p = min64(pb, P - p0);
        for (int g = 0; g < g_count; ++g) {
          wb[g] = block_weights(a, nb + g, g_count, p0, n_p, buf[g]);
          if (scaled) {
            const int64_t blocks = (a.KP + a.bk - 1) / a.bk;
            scale[g] = a.group_exps ? vbcast(exp2_byte(a.exps[(nb + g) * blocks + kb]))
                                    : vexp2(a.exps + ((nb + g) * blocks + kb) * 16);
          }
        }
        if (g_count == NR) {
          if (scaled) rows_tile<NR, true>(ms, xr, p0, n_p, wb, scale, tot);
          else rows_tile<NR, false>(ms, xr, p0, n_p, wb, scale, tot);
        } else {
          if (scaled) rows_tile<1, true>(ms, xr, p0, n_p, wb, scale, tot);
          else rows_tile<1, false>(ms, xr, p0, n_p, wb, scale, tot);
        }
      }
      store_rows(a, m0, ms, nb, g_count, NR, tot);
    }
  }
}

// Few rows (M <= 4: decode steps). The decode-once buffer of gemm_pairs saves little there, and the
// dot products of one output lane form one dependent chain (the reduction order above), so two
// groups leave the core waiting on those chains. Here the weights are decoded in registers, each
// pair once for the R rows, and R x G chains are kept in flight; every lane adds in the order above,
// so the bits are gemm_pairs' bits. No software prefetch: the G streams are consecutive groups, which
// the hardware prefetchers follow (measured faster than prefetching 4 KB ahead).
template <int FMT>
static inline WP wp_at(const uint8_t* src) {
  if (FMT == FMT_BF16) return wp_bf16(reinterpret_cast<const int32_t*>(src));
  if (FMT == FMT_FP8) return wp_fp8(src);
  return wp_fp4(src);
}

template <int FMT, int R, int G>
static void few_rows_tile(const GemmArgs& a, int64_t m0, int64_t nb) {
  constexpr bool SCALED = FMT != FMT_BF16;
  constexpr int64_t PB = FMT == FMT_FP8 ? 32 : (FMT == FMT_FP4 ? 16 : 64);  // bytes of one pair of a group
  const int64_t P = a.KP / 2;
  const int64_t pb = SCALED ? a.bk / 2 : P;  // pairs per scale block (bf16: one chain over K)
  const int64_t blocks = SCALED ? (a.KP + a.bk - 1) / a.bk : 1;
  const uint32_t* x[R];
  for (int r = 0; r < R; ++r) x[r] = static_cast<const uint32_t*>(a.x) + (m0 + r) * P;
  const uint8_t* w[G];
  for (int g = 0; g < G; ++g) w[g] = static_cast<const uint8_t*>(a.w) + (nb + g) * P * PB;
  alignas(64) float tot[R * G * 16];
  for (int i = 0; i < R * G * 16; ++i) tot[i] = 0.0f;
  for (int64_t p0 = 0, kb = 0; p0 < P; p0 += pb, ++kb) {
    const int64_t p1 = min64(P, p0 + pb);
    V acc[R][G];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) acc[r][g] = SCALED ? vzero() : vload(tot + (r * G + g) * 16);
    int64_t p = p0;
    for (; p + 2 <= p1; p += 2)
      for (int g = 0; g < G; ++g) {
        WP w0, w1;
        if (FMT == FMT_FP8) {
          wp_fp8_two(w[g] + p * PB, w0, w1);
        } else {
          w0 = wp_at<FMT>(w[g] + p * PB);
          w1 = wp_at<FMT>(w[g] + (p + 1) * PB);
        }
        for (int r = 0; r < R; ++r) acc[r][g] = vdot(vdot(acc[r][g], x[r][p], w0), x[r][p + 1], w1);
      }
    for (; p < p1; ++p)
      for (int g = 0; g < G; ++g) {
        const WP w0 = wp_at<FMT>(w[g] + p * PB);
        for (int r = 0; r < R; ++r) acc[r][g] = vdot(acc[r][g], x[r][p], w0);
      }
    for (int g = 0; g < G; ++g) {
      V scale = vzero();
      if (SCALED)
        scale = a.group_exps ? vbcast(exp2_byte(a.exps[(nb + g) * blocks + kb]))
                             : vexp2(a.exps + ((nb + g) * blocks + kb) * 16);
      for (int r = 0; r < R; ++r) {
        float* t = tot + (r * G + g) * 16;
        vstore(t, SCALED ? vfma(acc[r][g], scale, vload(t)) : acc[r][g]);
      }
    }
  }
  store_rows(a, m0, R, nb, G, G, tot);
}

// Groups [nb, nb1) of R rows from m0: tiles of G groups while they fit, then of G / 2, ... 1.
template <int FMT, int R, int G>
static void few_rows(const GemmArgs& a, int64_t m0, int64_t nb) {
  for (; nb + G <= a.nb1; nb += G) few_rows_tile<FMT, R, G>(a, m0, nb);
  if constexpr (G > 1) few_rows<FMT, R, G / 2>(a, m0, nb);
}

template <int FMT>
static void gemm_few_rows(const GemmArgs& a) {
  switch (a.M) {
    case 1: few_rows<FMT, 1, FEW_GROUPS[0]>(a, 0, a.nb0); break;
    case 2: few_rows<FMT, 2, FEW_GROUPS[1]>(a, 0, a.nb0); break;
    case 3: few_rows<FMT, 3, FEW_GROUPS[2]>(a, 0, a.nb0); break;
    default: few_rows<FMT, 4, FEW_GROUPS[3]>(a, 0, a.nb0); break;
  }
}

// FP32 weights, fp32 activations: per block of F32_BLOCK inputs an fma chain from zero in
// increasing k, then total += block sum (two levels keep the rounding error near that of a
// blocked GEMM instead of growing with K).
constexpr int64_t F32_BLOCK = 32;

template <int R, int G>
static inline void micro_f32(const float* const* xr, int64_t K, const float* w, int64_t wstride, float* y,
                             int64_t ldy, int64_t n0, int64_t N, const float* wend) {
  V acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = vzero();
  for (int64_t k0 = 0; k0 < K; k0 += F32_BLOCK) {
    const int64_t k1 = min64(K, k0 + F32_BLOCK);
    // each group's weights PREFETCH_BYTES ahead (k's of 64 bytes), continuing in group g + G
    for (int g = 0; g < G; ++g) {
      const int64_t q = k0 + PREFETCH_BYTES / 64;
      const float* at = q < K ? w + g * wstride + q * 16 : w + (g + G) * wstride + (q - K) * 16;
      for (int64_t l = 0; l < F32_BLOCK && at + l * 16 < wend; ++l) __builtin_prefetch(at + l * 16, 0, 3);
    }
    V blk[R][G];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) blk[r][g] = vzero();
    for (int64_t k = k0; k < k1; ++k) {
      V wv[G];
      for (int g = 0; g < G; ++g) wv[g] = vload(w + g * wstride + k * 16);
      for (int r = 0; r < R; ++r) {
        const V xb = vbcast(xr[r][k]);
        for (int g = 0; g < G; ++g) blk[r][g] = vfma(xb, wv[g], blk[r][g]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) acc[r][g] = vfma(vbcast(1.0f), blk[r][g], acc[r][g]);  // exact: one add
  }
  alignas(64) float buf[16];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) {
      const int64_t start = n0 + g * 16;
      const int64_t n = min64(16, N - start);
      vstore(buf, acc[r][g]);
      for (int64_t i = 0; i < n; ++i) y[r * ldy + start + i] = buf[i];
    }
}

template <int G>
static void rows_f32(const GemmArgs& a, int64_t nb) {
  const float* x = static_cast<const float*>(a.x);
  const float* w = static_cast<const float*>(a.w) + nb * a.K * 16;
  const float* wend = static_cast<const float*>(a.w) + a.nb1 * a.K * 16;  // this call's last weight byte + 1
  float* y = static_cast<float*>(a.y);
  const float* xr[MR];
  int64_t m = 0;
  for (; m < a.M; m += MR) {
    const int64_t rows = min64(MR, a.M - m);
    for (int64_t r = 0; r < rows; ++r) xr[r] = x + (m + r) * a.K;
    float* ym = y + m * a.N;
    switch (rows) {
#define KV_TAIL(n) case n: micro_f32<n, G>(xr, a.K, w, a.K * 16, ym, a.N, nb * 16, a.N, wend); break;
      KV_TAILS
#undef KV_TAIL
      default: micro_f32<MR, G>(xr, a.K, w, a.K * 16, ym, a.N, nb * 16, a.N, wend); break;
    }
  }
}

static void gemm_f32(const GemmArgs& a) {
  for (int64_t nb = a.nb0; nb < a.nb1; nb += NR) {
    if (a.nb1 - nb >= NR) rows_f32<NR>(a, nb);
    else rows_f32<1>(a, nb);
  }
}

// The path depends on M (few rows or the decode-once buffer), never the bits: both keep the order above.
static void gemm_dispatch(const GemmArgs* a) {
  if (a->fmt == FMT_FP32) gemm_f32(*a);
  else if (a->M > FEW_ROWS) gemm_pairs(*a);
  else if (a->fmt == FMT_FP8) gemm_few_rows<FMT_FP8>(*a);
  else if (a->fmt == FMT_FP4) gemm_few_rows<FMT_FP4>(*a);
  else gemm_few_rows<FMT_BF16>(*a);
}
