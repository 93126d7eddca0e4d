// AVX2 + FMA path: the same per-lane operation sequence as the AVX-512 BF16 path (each bf16
// pair as two fp32 fmas, odd k first; products are exact so fma = vdpbf16ps's add), on two
// 8-lane halves. Compiled for this ISA by the pragma below only (no AVX-512 instruction).
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>
#include "gemm.h"

namespace kvshare_kernels {
namespace {

constexpr int MR = 2;
#define KV_TAILS KV_TAIL(1)

struct V { __m256 lo, hi; };
struct WP { V odd, even; };  // the 16 lanes' weights of k = 2p + 1 and k = 2p, as fp32
constexpr bool WP_IS_PACKED_BF16 = false;

static inline V vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline V vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v.lo); _mm256_storeu_ps(p + 8, v.hi); }
static inline V vfma(V a, V b, V c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
static inline V vbcast(float x) { const __m256 b = _mm256_set1_ps(x); return {b, b}; }

static inline V vdot(V acc, uint32_t xp, const WP& w) {
  const __m256 xo = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(xp & 0xffff0000u)));
  const __m256 xe = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(xp << 16)));
  V r;
  r.lo = _mm256_fmadd_ps(xe, w.even.lo, _mm256_fmadd_ps(xo, w.odd.lo, acc.lo));
  r.hi = _mm256_fmadd_ps(xe, w.even.hi, _mm256_fmadd_ps(xo, w.odd.hi, acc.hi));
  return r;
}

static inline void split_pairs(__m256i d, __m256& odd, __m256& even) {
  odd = _mm256_castsi256_ps(_mm256_and_si256(d, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(d, 16));
}

static inline WP wp_bf16(const int32_t* p) {
  WP w;
  split_pairs(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), w.odd.lo, w.even.lo);
  split_pairs(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 8)), w.odd.hi, w.even.hi);
  return w;
}

// e4m3 code c (one per dword, low byte) -> fp32: bits (c & 0x7f) << 20 read as fp32 are the code's
// value times 2^-120 for normal and subnormal codes alike; the multiply by 2^120 is exact.
static inline __m256 fp8_to_f32(__m256i c) {
  const __m256i mag = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x7f)), 20);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24);
  const __m256 v = _mm256_castsi256_ps(_mm256_or_si256(mag, sign));
  return _mm256_mul_ps(v, _mm256_set1_ps(1.329227995784916e36f));  // 2^120
}

static inline WP wp_fp8(const uint8_t* p) {
  WP w;
  for (int h = 0; h < 2; ++h) {
    const __m256i d = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * h)));
    const __m256 even = fp8_to_f32(d);
    const __m256 odd = fp8_to_f32(_mm256_srli_epi32(d, 8));
    (h ? w.even.hi : w.even.lo) = even;
    (h ? w.odd.hi : w.odd.lo) = odd;
  }
  return w;
}

static inline __m256 fp4_to_f32(__m256i nib) {
  const __m256 table = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
  const __m256 mag = _mm256_permutevar8x32_ps(table, nib);  // uses index bits 0-2
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(nib, _mm256_set1_epi32(8)), 28);
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(mag), sign));
}

static inline WP wp_fp4(const uint8_t* p) {
  WP w;
  for (int h = 0; h < 2; ++h) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * h)));
    const __m256 even = fp4_to_f32(_mm256_and_si256(b, _mm256_set1_epi32(0x0f)));
    const __m256 odd = fp4_to_f32(_mm256_srli_epi32(b, 4));
    (h ? w.even.hi : w.even.lo) = even;
    (h ? w.odd.hi : w.odd.lo) = odd;
  }
  return w;
}

static inline void wp_fp8_two(const uint8_t* p, WP& w0, WP& w1) {
  w0 = wp_fp8(p);
  w1 = wp_fp8(p + 32);
}

// Rows up to which weights are decoded in registers (gemm_body.h few_rows) and the groups kept in
// flight for 1..4 rows (sixteen ymm: R x G accumulators of two, a decoded pair of four).
constexpr int FEW_ROWS = 4;
constexpr int FEW_GROUPS[4] = {4, 2, 1, 1};

static inline __m256 exp2_half(const uint8_t* e) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(e)));
  const __m256i bits = _mm256_slli_epi32(b, 23);
  const __m256i zero = _mm256_cmpeq_epi32(b, _mm256_setzero_si256());
  return _mm256_castsi256_ps(_mm256_blendv_epi8(bits, _mm256_set1_epi32(0x00400000), zero));
}

static inline V vexp2(const uint8_t* e) { return {exp2_half(e), exp2_half(e + 8)}; }

static inline void store_bf16(uint16_t* dst, const float* src, int n) {
  alignas(32) uint32_t tmp[16];
  for (int h = 0; h < 2; ++h) {
    const __m256i u = _mm256_castps_si256(_mm256_loadu_ps(src + 8 * h));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256 f = _mm256_castsi256_ps(u);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
    _mm256_store_si256(reinterpret_cast<__m256i*>(tmp + 8 * h), r);
  }
  for (int i = 0; i < n; ++i) dst[i] = static_cast<uint16_t>(tmp[i]);
}

#include "gemm_body.h"

}  // namespace

void gemm_avx2(const GemmArgs* a) { gemm_dispatch(a); }

}  // namespace kvshare_kernels
