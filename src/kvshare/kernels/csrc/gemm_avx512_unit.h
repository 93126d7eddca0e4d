// AVX-512 BF16 path: vdpbf16ps accumulates a bf16 pair per lane (odd k, then even k; exact
// products, round-to-nearest-even adds). Included by two translation units, each compiled for its
// ISA by its own pragma: gemm_avx512.cpp (AVX-512 BW decoders) and gemm_avx512_vbmi.cpp (KV_VBMI
// defined: the FP4 decoder spreads bytes with vpermb, the FP8 one shifts bytes with GFNI); both give
// the same bits. No torch or
// standard-library templates (see gemm_body.h).
#pragma once
#include <immintrin.h>
#include "gemm.h"
#include "weights512.h"

namespace kvshare_kernels {
namespace {

constexpr int MR = 8;  // rows per register tile (8 x NR accumulators + NR weights + 1 broadcast <= 32 zmm)
#define KV_TAILS KV_TAIL(1) KV_TAIL(2) KV_TAIL(3) KV_TAIL(4) KV_TAIL(5) KV_TAIL(6) KV_TAIL(7)

typedef __m512 V;
typedef __m512i WP;  // 16 dwords, each a bf16 pair
constexpr bool WP_IS_PACKED_BF16 = true;  // packed bf16 weights are used in place

static inline V vzero() { return _mm512_setzero_ps(); }
static inline V vload(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v); }
static inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
static inline V vbcast(float x) { return _mm512_set1_ps(x); }

static inline V vdot(V acc, uint32_t xp, WP w) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(static_cast<int>(xp)), (__m512bh)w);
}

static inline WP wp_bf16(const int32_t* p) { return _mm512_loadu_si512(p); }

using kvshare_w512::wp_fp8;
#ifdef KV_VBMI
static inline WP wp_fp4(const uint8_t* p) { return kvshare_w512::wp_fp4_vbmi(p); }
#else
using kvshare_w512::wp_fp4;
#endif
using kvshare_w512::vexp2;

static inline void wp_fp8_two(const uint8_t* p, WP& w0, WP& w1) { kvshare_w512::wp_fp8_x2(p, w0, w1); }

// Rows up to which weights are decoded in registers (gemm_body.h few_rows), and the groups kept in
// flight for 1..4 rows (R x G accumulators, G decoded pairs and the decoder's temporaries in 32 zmm).
constexpr int FEW_ROWS = 4;
constexpr int FEW_GROUPS[4] = {8, 6, 4, 4};

using kvshare_w512::store_bf16;

#include "gemm_body.h"

}  // namespace
}  // namespace kvshare_kernels
