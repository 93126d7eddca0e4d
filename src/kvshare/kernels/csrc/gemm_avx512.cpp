// AVX-512 BF16 path: vdpbf16ps accumulates a bf16 pair per lane (odd k, then even k; exact
// products, round-to-nearest-even adds). Compiled for this ISA by the pragma below only; the
// translation unit includes no torch or standard-library templates (see gemm_body.h).
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,avx2,f16c")
#include <immintrin.h>
#include "gemm.h"

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

// e4m3 -> bf16: a normal code (exponent field e > 0) is bits (c & 0x7f) << 4 plus 120 << 7
// (the bias difference 127 - 7); the eight subnormal magnitudes m * 2^-9 come from a table.
static inline WP wp_fp8(const uint8_t* p) {
  const __m512i c = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i mag = _mm512_and_si512(c, _mm512_set1_epi16(0x7f));
  const __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(120 << 7));
  alignas(64) static const uint16_t sub_table[32] = {
      0, 118 << 7, 119 << 7, (119 << 7) | 0x40, 120 << 7, (120 << 7) | 0x20, (120 << 7) | 0x40, (120 << 7) | 0x60};
  const __m512i sub = _mm512_permutexvar_epi16(mag, _mm512_load_si512(sub_table));
  const __mmask32 is_normal = _mm512_cmpge_epu16_mask(mag, _mm512_set1_epi16(8));
  const __m512i v = _mm512_mask_blend_epi16(is_normal, sub, normal);
  return _mm512_or_si512(v, _mm512_slli_epi16(_mm512_and_si512(c, _mm512_set1_epi16(0x80)), 8));
}

// e2m1 pair byte -> two bf16 words: low nibble (even k) to the low word, high nibble to the high.
static inline WP wp_fp4(const uint8_t* p) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i idx = _mm512_or_si512(_mm512_and_si512(b, _mm512_set1_epi32(0x0f)),
                                      _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0xf0)), 12));
  alignas(64) static const uint16_t table[32] = {  // bf16 of 0, .5, 1, 1.5, 2, 3, 4, 6 and negatives
      0x0000, 0x3f00, 0x3f80, 0x3fc0, 0x4000, 0x4040, 0x4080, 0x40c0,
      0x8000, 0xbf00, 0xbf80, 0xbfc0, 0xc000, 0xc040, 0xc080, 0xc0c0};
  return _mm512_permutexvar_epi16(idx, _mm512_load_si512(table));
}

// ue8m0 bytes -> 2^(e - 127) as fp32 (e = 0: the subnormal 2^-127).
static inline V vexp2(const uint8_t* e) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(e)));
  const __m512i bits = _mm512_slli_epi32(b, 23);
  const __mmask16 zero = _mm512_cmpeq_epi32_mask(b, _mm512_setzero_si512());
  return _mm512_castsi512_ps(_mm512_mask_blend_epi32(zero, bits, _mm512_set1_epi32(0x00400000)));
}

// fp32 -> bf16, round to nearest even (NaN -> quiet NaN), as c10's conversion does.
static inline void store_bf16(uint16_t* dst, const float* src, int n) {
  const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(src));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(_mm512_castsi512_ps(u), _mm512_castsi512_ps(u), _CMP_UNORD_Q);
  r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7fc0));
  _mm256_mask_storeu_epi16(dst, static_cast<__mmask16>((1u << n) - 1u), _mm512_cvtepi32_epi16(r));
}

#include "gemm_body.h"

}  // namespace

void gemm_avx512(const GemmArgs* a) { gemm_dispatch(a); }

}  // namespace kvshare_kernels
