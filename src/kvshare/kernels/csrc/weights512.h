// Weight decoders shared by the AVX-512 and AMX GEMM translation units (all compiled with AVX-512 BW;
// where a unit defines KV_VBMI it targets AVX-512 VBMI and GFNI too, and wp_fp4_vbmi and the GFNI byte
// shifts of wp_fp8_x2 serve there): FP8 e4m3 and FP4 e2m1 codes to bf16 pairs, ue8m0 scale bytes to
// fp32 powers of two, fp32 totals to bf16.
#pragma once
#include <immintrin.h>
#include <stdint.h>

namespace kvshare_w512 {

// e4m3 -> bf16: a normal code (exponent field e > 0) is bits (c & 0x7f) << 4 plus 120 << 7
// (the bias difference 127 - 7); the eight subnormal magnitudes m * 2^-9 come from a table.
static inline __m512i wp_fp8(const uint8_t* p) {
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

// bf16 of the e2m1 codes 0, .5, 1, 1.5, 2, 3, 4, 6 and their negatives, twice: vpermw reads five index
// bits, and the decoders below leave a neighbour's bit in the fifth.
alignas(64) static const uint16_t FP4_BF16[32] = {
    0x0000, 0x3f00, 0x3f80, 0x3fc0, 0x4000, 0x4040, 0x4080, 0x40c0,
    0x8000, 0xbf00, 0xbf80, 0xbfc0, 0xc000, 0xc040, 0xc080, 0xc0c0,
    0x0000, 0x3f00, 0x3f80, 0x3fc0, 0x4000, 0x4040, 0x4080, 0x40c0,
    0x8000, 0xbf00, 0xbf80, 0xbfc0, 0xc000, 0xc040, 0xc080, 0xc0c0};

// e2m1 pair byte -> two bf16 words: low nibble (even k) to the low word, high nibble to the high.
// The dword d = b | b << 12 holds the low nibble in the low bits of its low word and the high nibble in
// the low bits of its high word.
static inline __m512i wp_fp4(const uint8_t* p) {
  const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_permutexvar_epi16(_mm512_or_si512(d, _mm512_slli_epi32(d, 12)), _mm512_load_si512(FP4_BF16));
}

#ifdef KV_VBMI
// wp_fp4 with the byte spread by vpermb (byte i of the pair to dword i) instead of vpmovzxbd, and the
// high word's nibble brought down by a per-word shift (its decode ~20% faster in L1 on Zen 4).
static inline __m512i wp_fp4_vbmi(const uint8_t* p) {
  alignas(64) static const uint8_t spread[64] = {
      0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7,
      8, 8, 8, 8, 9, 9, 9, 9, 10, 10, 10, 10, 11, 11, 11, 11, 12, 12, 12, 12, 13, 13, 13, 13, 14, 14, 14, 14,
      15, 15, 15, 15};
  const __m512i b = _mm512_zextsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i d = _mm512_permutexvar_epi8(_mm512_load_si512(spread), b);  // each word holds b twice
  const __m512i idx = _mm512_srlv_epi16(d, _mm512_set1_epi32(0x00040000));  // high word: b >> 4
  return _mm512_permutexvar_epi16(idx, _mm512_load_si512(FP4_BF16));
}
#endif

// Two consecutive k pairs of e4m3 codes (64 bytes: pair p's 16 lanes, then pair p + 1's) -> their bf16
// pairs, as two wp_fp8 calls give them, with about half the work: for a code whose exponent field is
// nonzero the bf16's low byte is the code's low nibble << 4 and its high byte a function of the high
// nibble (s << 7 | (60 + the exponent's top three bits)), one pshufb. The qword shuffle puts lanes
// 4L..4L+3 of both pairs in 128-bit lane L, so the in-lane byte interleave yields whole pairs in lane
// order. Codes with exponent 0 (zero, the subnormals: rare in real checkpoints, whose block scales
// put the largest weight near 448) take wp_fp8.
static inline void wp_fp8_x2(const uint8_t* p, __m512i& w0, __m512i& w1) {
  const __m512i c = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 4, 1, 5, 2, 6, 3, 7), _mm512_loadu_si512(p));
  if (_mm512_testn_epi8_mask(c, _mm512_set1_epi8(0x78))) {
    w0 = wp_fp8(p);
    w1 = wp_fp8(p + 32);
    return;
  }
#ifdef KV_VBMI  // one GFNI affine op per byte shift (bit i of y = parity(row 7 - i of the matrix & x))
  const __m512i lo = _mm512_gf2p8affine_epi64_epi8(c, _mm512_set1_epi64(0x0000000001020408LL), 0);  // x << 4
  const __m512i nib = _mm512_gf2p8affine_epi64_epi8(c, _mm512_set1_epi64(0x1020408000000000LL), 0);  // x >> 4
#else
  const __m512i lo = _mm512_and_si512(_mm512_slli_epi16(c, 4), _mm512_set1_epi8(static_cast<char>(0xf0)));
  const __m512i nib = _mm512_and_si512(_mm512_srli_epi16(c, 4), _mm512_set1_epi8(0x0f));
#endif
  const __m512i high = _mm512_broadcast_i32x4(_mm_setr_epi8(60, 61, 62, 63, 64, 65, 66, 67, static_cast<char>(188),
                                                            static_cast<char>(189), static_cast<char>(190),
                                                            static_cast<char>(191), static_cast<char>(192),
                                                            static_cast<char>(193), static_cast<char>(194),
                                                            static_cast<char>(195)));
  const __m512i hi = _mm512_shuffle_epi8(high, nib);
  w0 = _mm512_unpacklo_epi8(lo, hi);
  w1 = _mm512_unpackhi_epi8(lo, hi);
}

// The first n (<= 16) of 16 fp32 values to bf16, round to nearest even (NaN -> quiet NaN), as c10's
// conversion does.
static inline void store_bf16(uint16_t* dst, const float* src, int n) {
  const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(src));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(_mm512_castsi512_ps(u), _mm512_castsi512_ps(u), _CMP_UNORD_Q);
  r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7fc0));
  _mm256_mask_storeu_epi16(dst, static_cast<__mmask16>((1u << n) - 1u), _mm512_cvtepi32_epi16(r));
}

// ue8m0 bytes -> 2^(e - 127) as fp32 (e = 0: the subnormal 2^-127).
static inline __m512 vexp2(const uint8_t* e) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(e)));
  const __m512i bits = _mm512_slli_epi32(b, 23);
  const __mmask16 zero = _mm512_cmpeq_epi32_mask(b, _mm512_setzero_si512());
  return _mm512_castsi512_ps(_mm512_mask_blend_epi32(zero, bits, _mm512_set1_epi32(0x00400000)));
}

}  // namespace kvshare_w512
