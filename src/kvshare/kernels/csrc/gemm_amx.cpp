// AMX path (Sapphire Rapids and later): TDPBF16PS on tiles of 32 rows x 32 outputs (four 16 x 16
// C tiles). Every call, whatever its row count, runs the same tiles (x is zero-padded to a
// multiple of 32 rows), and each C element depends only on its own A row, so a row's result does
// not depend on M, its position or the other rows. The order inside TDPBF16PS is the hardware's
// (not vdpbf16ps's): this path is its own code path ("amx"), bitwise equal to the others where
// the sums are exact. FP8 / FP4 weights are decoded once per 32 outputs into bf16 with their
// scale applied (exact while code * 2^e is a normal bf16; AMX reads subnormal bf16 as zero, so a
// scale below about 2^-117 flushes where the other paths keep it), then summed over all of K
// like bf16 weights. Needs K (padded) a multiple of 32 and scale blocks a multiple of 32 pairs'
// tiles (bk % 32 == 0); the caller uses the AVX-512 path otherwise (a property of the weight).
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,avx2,f16c,amx-tile,amx-bf16")
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include "gemm.h"
#include "weights512.h"

namespace kvshare_kernels {
namespace {

typedef __m512i WP;

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

using kvshare_w512::wp_fp8;  // e4m3 -> bf16 pairs, e2m1 -> bf16 pairs (weights512.h)
using kvshare_w512::wp_fp4;

// bf16 pairs times a per-lane fp32 power of two, back to bf16 (exact for normal results).
static inline WP scale_pairs(WP w, __m512 s) {
  const __m512 even = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), s);
  const __m512 odd = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xffff0000u)))), s);
  return _mm512_or_si512(_mm512_and_si512(_mm512_castps_si512(odd), _mm512_set1_epi32(static_cast<int>(0xffff0000u))),
                         _mm512_srli_epi32(_mm512_castps_si512(even), 16));
}

static inline __m512 exp2_one(uint8_t e) {
  return _mm512_castsi512_ps(_mm512_set1_epi32(e ? static_cast<int>(static_cast<uint32_t>(e) << 23) : 0x00400000));
}

static inline void store_bf16(uint16_t* dst, const float* src, int n) {
  const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(src));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(_mm512_castsi512_ps(u), _mm512_castsi512_ps(u), _CMP_UNORD_Q);
  r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7fc0));
  _mm256_mask_storeu_epi16(dst, static_cast<__mmask16>((1u << n) - 1u), _mm512_cvtepi32_epi16(r));
}

struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

static void configure() {
  alignas(64) TileConfig cfg;
  memset(&cfg, 0, sizeof(cfg));
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {  // 0-3: C (16 x 16 fp32); 4, 5: A (16 rows x 16 pairs); 6, 7: B (16 pairs x 16 lanes)
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// The bytes of pair p of group nb in the packed weight (gemm.h layouts).
static inline const uint8_t* group_pairs(const GemmArgs& a, int64_t nb, int64_t p) {
  const int64_t pb = a.fmt == FMT_FP8 ? 32 : (a.fmt == FMT_FP4 ? 16 : 64);
  return static_cast<const uint8_t*>(a.w) + (nb * (a.KP / 2) + p) * pb;
}

// Group nb's weights as scaled bf16 pairs [P][16] into dst.
static void decode_group(const GemmArgs& a, int64_t nb, WP* dst) {
  const int64_t P = a.KP / 2, pairs_per_block = a.bk / 2, blocks = (a.KP + a.bk - 1) / a.bk;
  const uint8_t* src = group_pairs(a, nb, 0);
  const int64_t step = a.fmt == FMT_FP8 ? 32 : 16;
  for (int64_t kb = 0; kb < blocks; ++kb) {
    const int64_t e = nb * blocks + kb;
    const __m512 s = a.group_exps ? exp2_one(a.exps[e]) : kvshare_w512::vexp2(a.exps + e * 16);
    const int64_t p_end = min64(P, (kb + 1) * pairs_per_block);
    for (int64_t p = kb * pairs_per_block; p < p_end; ++p) {
      if ((p & 3) == 0 && p + 128 < P) __builtin_prefetch(src + (p + 128) * step, 0, 3);
      dst[p] = scale_pairs(a.fmt == FMT_FP8 ? wp_fp8(src + step * p) : wp_fp4(src + step * p), s);
    }
  }
}

// Rows [m0, m0 + 32) x the G groups of wsrc: four C tiles over all of K.
// H: the row tiles computed (2, or 1 when rows m0 + 16.. are all padding: C tiles 2 and 3 depend
// only on them, so skipping them changes no bit of the rows kept).
template <int G, int H>
static void tile_rows(const GemmArgs& a, int64_t m0, const uint8_t* const* wsrc, int64_t nb, bool stream, float* out) {
  const int64_t P = a.KP / 2;
  const uint16_t* x0 = static_cast<const uint16_t*>(a.x) + m0 * a.KP;
  const uint16_t* x1 = x0 + 16 * a.KP;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t p0 = 0; p0 < P; p0 += 16) {
    if (stream && p0 + 64 < P)  // weights streamed from memory (bf16, first row tile): 4 KiB ahead
      for (int g = 0; g < G; ++g)
        for (int l = 0; l < 16; ++l) __builtin_prefetch(wsrc[g] + (p0 + 64) * 64 + l * 64, 0, 3);
    _tile_loadd(4, x0 + 2 * p0, a.KP * 2);
    if (H == 2) _tile_loadd(5, x1 + 2 * p0, a.KP * 2);
    _tile_loadd(6, wsrc[0] + p0 * 64, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (H == 2) _tile_dpbf16ps(2, 5, 6);
    if (G == 2) {
      _tile_loadd(7, wsrc[1] + p0 * 64, 64);
      _tile_dpbf16ps(1, 4, 7);
      if (H == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, out, 128);  // out [32 rows][2 groups][16]
  if (H == 2) _tile_stored(2, out + 16 * 32, 128);
  if (G == 2) {
    _tile_stored(1, out + 16, 128);
    if (H == 2) _tile_stored(3, out + 16 * 32 + 16, 128);
  }
  const int64_t rows = min64(32, a.M - m0);
  for (int64_t r = 0; r < rows; ++r)
    for (int g = 0; g < G; ++g) {
      const int64_t n0 = (nb + g) * 16;
      const int n = static_cast<int>(min64(16, a.N - n0));
      const float* t = out + r * 32 + g * 16;
      if (a.out_f32) {
        float* y = static_cast<float*>(a.y) + (m0 + r) * a.N + n0;
        for (int i = 0; i < n; ++i) y[i] = t[i];
      } else {
        store_bf16(static_cast<uint16_t*>(a.y) + (m0 + r) * a.N + n0, t, n);
      }
    }
}

}  // namespace

bool amx_enable() {
  // Linux: a process must ask for the AMX tile data state before its first tile instruction.
  const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

void gemm_amx(const GemmArgs* ap) {
  const GemmArgs& a = *ap;
  const int64_t P = a.KP / 2;
  const bool scaled = a.fmt != FMT_BF16;
  WP* buf = scaled ? static_cast<WP*>(aligned_alloc(64, sizeof(WP) * 2 * P)) : nullptr;
  alignas(64) float out[32 * 32];
  configure();
  // Row super-blocks keep their activations in L2 while every output group passes over them
  // (a group's FP8 / FP4 weights are decoded once per super-block).
  constexpr int64_t ROWS_PER_PASS = 512;
  for (int64_t ms = 0; ms < a.M; ms += ROWS_PER_PASS) {
    const int64_t me = min64(a.M, ms + ROWS_PER_PASS);
    for (int64_t nb = a.nb0; nb < a.nb1; nb += 2) {
      const int g_count = static_cast<int>(min64(2, a.nb1 - nb));
      const uint8_t* wsrc[2] = {nullptr, nullptr};
      for (int g = 0; g < g_count; ++g) {
        if (scaled) {  // the group's whole K decoded once, reused by every row tile of the pass
          decode_group(a, nb + g, buf + g * P);
          wsrc[g] = reinterpret_cast<const uint8_t*>(buf + g * P);
        } else {
          wsrc[g] = group_pairs(a, nb + g, 0);
        }
      }
      for (int64_t m0 = ms; m0 < me; m0 += 32) {
        const bool stream = !scaled && m0 == ms;
        const bool half = a.M - m0 <= 16;
        if (g_count == 2) half ? tile_rows<2, 1>(a, m0, wsrc, nb, stream, out) : tile_rows<2, 2>(a, m0, wsrc, nb, stream, out);
        else half ? tile_rows<1, 1>(a, m0, wsrc, nb, stream, out) : tile_rows<1, 2>(a, m0, wsrc, nb, stream, out);
      }
    }
  }
  _tile_release();
  free(buf);
}

}  // namespace kvshare_kernels
