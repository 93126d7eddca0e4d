// 8-lane AVX2 helpers shared by the AVX2 translation units (decode.cpp, attn.cpp, index.cpp). Include
// it after the unit's `#pragma GCC target("avx2,fma,f16c")`; everything here is inline and internal
// to the including unit (an unnamed namespace), so no AVX2 code is shared with other units.
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

namespace kvshare_kernels {
namespace {

inline float bf16_to_f32(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even (NaN -> quiet NaN), as c10's float -> bfloat16 conversion.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if (f != f) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// 8 values from element i of a bf16 (`bf16` != 0) or fp32 row, as fp32.
inline __m256 load8(const void* p, int bf16, int64_t i) {
  if (bf16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  return _mm256_loadu_ps(static_cast<const float*>(p) + i);
}

// The lanes' sum in a fixed order: (l0 + l4) + (l2 + l6) + ((l1 + l5) + (l3 + l7)).
inline float hsum8(__m256 v) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  const __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
  return _mm_cvtss_f32(s1);
}

}  // namespace
}  // namespace kvshare_kernels
