// AMX path (Sapphire Rapids and later): TDPBF16PS on tiles of 32 rows x 32 outputs (four 16 x 16
// C tiles). Each C element takes the same TDPBF16PS steps (16 pairs of K each, in increasing
// order) whatever the call: the rows of a last partial tile are a zero-padded copy, and where K is
// walked in chunks (calls of more than 32 rows) C is stored and reloaded as fp32 between them,
// which is exact. Each C element depends only on its own A row, so a row's result does not
// depend on M, its position or the other rows. The order inside TDPBF16PS is the hardware's (not
// vdpbf16ps's): this path is its own code path ("amx"), bitwise equal to the others where the
// sums are exact. FP8 / FP4 weights are decoded into bf16 with their scale applied (exact while
// code * 2^e is a normal bf16; AMX reads subnormal bf16 as zero, so a scale below about 2^-117
// flushes where the other paths keep it): 16 pairs at a time as the tile walks K in calls of at
// most 32 rows, else each group's whole K once per pass of rows. Needs K (padded) a multiple of
// 32 and scale blocks a multiple of 32 (bk % 32 == 0); the caller uses the AVX-512 path
// otherwise (a property of the weight).
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

using kvshare_w512::store_bf16;

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

// The scale of one K block of one group, prepared once per block. `fast`: every lane's scale 2^s
// keeps every code's scaled value a normal bf16 (FP8: s in [-117, 119], the codes spanning
// 2^-9 .. 448; FP4: s in [-125, 125], 0.5 .. 6); multiplying by 2^s then only adds s to the
// exponent field, so the decoders below add s << 7 to each nonzero 16-bit value: the same bits as
// `scale_pairs`, without the fp32 round trip. Otherwise `mul` serves `scale_pairs`.
struct BlockScale {
  __m512 mul;     // 2^s per lane
  __m512i shift;  // s << 7 in both 16-bit halves of each lane (the lane's two k of a pair)
  bool fast;
};

static inline BlockScale block_scale(const GemmArgs& a, int64_t nb, int64_t kb) {
  const int64_t e = nb * ((a.KP + a.bk - 1) / a.bk) + kb;
  BlockScale s;
  const __m512i eb = a.group_exps ? _mm512_set1_epi32(a.exps[e])
                                  : _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.exps + e * 16)));
  const __mmask16 zero = _mm512_cmpeq_epi32_mask(eb, _mm512_setzero_si512());
  s.mul = _mm512_castsi512_ps(_mm512_mask_blend_epi32(zero, _mm512_slli_epi32(eb, 23), _mm512_set1_epi32(0x00400000)));
  const int lo = a.fmt == FMT_FP8 ? 127 - 117 : 127 - 125, hi = a.fmt == FMT_FP8 ? 127 + 119 : 127 + 125;
  s.fast = _mm512_cmpge_epi32_mask(eb, _mm512_set1_epi32(lo)) == 0xffff &&
           _mm512_cmple_epi32_mask(eb, _mm512_set1_epi32(hi)) == 0xffff;
  const __m512i sh = _mm512_slli_epi32(_mm512_sub_epi32(eb, _mm512_set1_epi32(127)), 7);
  s.shift = _mm512_or_si512(_mm512_and_si512(sh, _mm512_set1_epi32(0xffff)), _mm512_slli_epi32(sh, 16));
  return s;
}

// Adds the exponent shift to the nonzero (magnitude) 16-bit values of v.
static inline WP shift_nonzero(WP v, __m512i shift) {
  return _mm512_mask_add_epi16(v, _mm512_test_epi16_mask(v, _mm512_set1_epi16(0x7fff)), v, shift);
}

// Pairs [0, n) of 16 lanes decoded and scaled (bf16 pairs, exact; see BlockScale), one format and scale path.
template <int FMT, bool FAST>
static inline void decode_run(const uint8_t* src, int64_t n, const BlockScale& s, WP* dst) {
  for (int64_t p = 0; p < n; ++p) {
    const WP w = FMT == FMT_FP8 ? wp_fp8(src + 32 * p) : wp_fp4(src + 16 * p);
    dst[p] = FAST ? shift_nonzero(w, s.shift) : scale_pairs(w, s.mul);
  }
}

// Pairs [0, n) of one block decoded and scaled into dst (the format and scale branch taken once).
static inline void decode_pairs(const GemmArgs& a, const uint8_t* src, int64_t n, const BlockScale& s, WP* dst) {
  if (a.fmt == FMT_FP8) s.fast ? decode_run<FMT_FP8, true>(src, n, s, dst) : decode_run<FMT_FP8, false>(src, n, s, dst);
  else s.fast ? decode_run<FMT_FP4, true>(src, n, s, dst) : decode_run<FMT_FP4, false>(src, n, s, dst);
}

static inline int64_t pair_bytes(int fmt) { return fmt == FMT_FP8 ? 32 : (fmt == FMT_FP4 ? 16 : 64); }

// The bytes of pair p of group nb in the packed weight (gemm.h layouts).
static inline const uint8_t* group_pairs(const GemmArgs& a, int64_t nb, int64_t p) {
  return static_cast<const uint8_t*>(a.w) + (nb * (a.KP / 2) + p) * pair_bytes(a.fmt);
}

// Group nb's weights as scaled bf16 pairs [P][16] into dst.
static void decode_group(const GemmArgs& a, int64_t nb, WP* dst) {
  const int64_t P = a.KP / 2, pairs_per_block = a.bk / 2, blocks = (a.KP + a.bk - 1) / a.bk;
  const uint8_t* src = group_pairs(a, nb, 0);
  const int64_t step = pair_bytes(a.fmt);
  for (int64_t kb = 0; kb < blocks; ++kb) {
    const BlockScale s = block_scale(a, nb, kb);
    const int64_t p0 = kb * pairs_per_block, p_end = min64(P, p0 + pairs_per_block);
    for (int64_t p = p0; p < p_end; p += 16) {  // 16 pairs (one or two lines per 4 pairs) at a time
      for (int64_t q = p + 128; q < min64(p + 144, P); q += 64 / step) __builtin_prefetch(src + q * step, 0, 3);
      decode_pairs(a, src + step * p, min64(16, p_end - p), s, dst + p);
    }
  }
}

// How far ahead each lane's stream of weight bytes is prefetched when the weights come from
// memory (measured at M = 1: 2 KiB and 8 KiB were slower than 4 KiB).
constexpr int64_t PF_BYTES = 4096;

// Where a tile's B operand comes from.
enum BSource {
  B_PACKED,   // bf16 weights in place (wsrc: the group's first pair)
  B_DECODED,  // FP8 / FP4 decoded for all of K before the call (wsrc: that buffer)
  B_CHUNK,    // FP8 / FP4 decoded here, 16 pairs at a time (calls of one row tile: nothing to reuse)
};

// The rows of one 32-row tile and where its four C tiles live between K chunks.
struct RowTile {
  const uint16_t* x;  // row 0 of the tile (row stride KP; 32 rows readable, or 16 when half)
  int64_t m0;         // its first row in the call
  float* c;           // [32 rows][32 lanes] fp32: C between K chunks, and the final totals
};

// Pairs [p_begin, p_end) of the tile's rows x the G groups nb.. (wsrc): C tiles 0-3 continue
// from t.c (zero when p_begin == 0) and go back there. Splitting K into chunks changes no bit: C
// is stored and reloaded as fp32, and every C element still takes the same TDPBF16PS steps in the
// same order. H: the row tiles computed (2, or 1 when rows 16.. are all padding: C tiles 2 and 3
// depend only on them, so skipping them changes no bit of the rows kept). `stream`: prefetch the
// weights ahead (read from memory: the first row tile of a pass).
template <int G, int H, BSource SRC>
static void tile_chunk(const GemmArgs& a, const RowTile& t, int64_t p_begin, int64_t p_end, const uint8_t* const* wsrc,
                       int64_t nb, bool stream) {
  const int64_t pb = pair_bytes(a.fmt), ahead = PF_BYTES / pb, lines = 16 * pb / 64;
  const uint16_t* x0 = t.x;
  const uint16_t* x1 = x0 + 16 * a.KP;
  alignas(64) WP chunk[2][G][16];  // B_CHUNK: step i's pairs in chunk[i & 1], decoded one step ahead
  BlockScale scale[G];
  // Decodes the pairs of step p0 (B_CHUNK) into chunk[slot]. A tile load that reads vector stores
  // made just before it waits for them; decoding a step ahead leaves a whole step in between.
  auto decode_step = [&](int64_t p0, int slot) {
    for (int g = 0; g < G; ++g) {
      if ((2 * p0) % a.bk == 0 || p0 == p_begin) scale[g] = block_scale(a, nb + g, 2 * p0 / a.bk);
      decode_pairs(a, group_pairs(a, nb + g, p0), 16, scale[g], chunk[slot][g]);
    }
  };
  if (SRC == B_CHUNK) decode_step(p_begin, 0);
  if (p_begin == 0) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  } else {
    _tile_loadd(0, t.c, 128);
    if (G == 2) _tile_loadd(1, t.c + 16, 128);
    if (H == 2) _tile_loadd(2, t.c + 16 * 32, 128);
    if (G == 2 && H == 2) _tile_loadd(3, t.c + 16 * 32 + 16, 128);
  }
  if (SRC != B_DECODED && stream && nb == a.nb0 && p_begin == 0)  // the call's first tile: its own first pairs too
    for (int g = 0; g < G; ++g)
      for (int64_t q = 0; q < ahead; q += 16) prefetch_stream(a, pb, nb + g, G, 0, q, lines);
  for (int64_t p0 = p_begin; p0 < p_end; p0 += 16) {
    if (SRC != B_DECODED && stream)
      for (int g = 0; g < G; ++g) prefetch_stream(a, pb, nb + g, G, p0, ahead, lines);
    const uint8_t* b[G];
    const int slot = static_cast<int>(((p0 - p_begin) >> 4) & 1);
    if (SRC == B_CHUNK && p0 + 16 < p_end) decode_step(p0 + 16, slot ^ 1);
    for (int g = 0; g < G; ++g)
      b[g] = SRC == B_CHUNK ? reinterpret_cast<const uint8_t*>(chunk[slot][g]) : wsrc[g] + p0 * 64;
    _tile_loadd(4, x0 + 2 * p0, a.KP * 2);
    if (H == 2) _tile_loadd(5, x1 + 2 * p0, a.KP * 2);
    _tile_loadd(6, b[0], 64);
    _tile_dpbf16ps(0, 4, 6);
    if (H == 2) _tile_dpbf16ps(2, 5, 6);
    if (G == 2) {
      _tile_loadd(7, b[1], 64);
      _tile_dpbf16ps(1, 4, 7);
      if (H == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, t.c, 128);
  if (G == 2) _tile_stored(1, t.c + 16, 128);
  if (H == 2) _tile_stored(2, t.c + 16 * 32, 128);
  if (G == 2 && H == 2) _tile_stored(3, t.c + 16 * 32 + 16, 128);
}

// 32 totals -> bf16 with VCVTNE2PS2BF16 (round to nearest even, as store_bf16) unless one is a
// NaN, a subnormal or -0 (the instruction quiets NaNs its own way and flushes subnormals):
// false then, and the caller rounds them with store_bf16. `nt`: a non-temporal store (outputs
// larger than L2: no read for ownership of a line written whole; measured 1.1-1.4x at M = 2048).
static inline bool store_bf16_32(uint16_t* dst, const float* src, bool nt) {
  const __m512 lo = _mm512_loadu_ps(src), hi = _mm512_loadu_ps(src + 16);
  const int special = 0x01 | 0x80 | 0x20 | 0x04;  // fpclass: QNaN, SNaN, denormal, -0
  if (_mm512_fpclass_ps_mask(lo, special) | _mm512_fpclass_ps_mask(hi, special)) return false;
  if (nt && (reinterpret_cast<uintptr_t>(dst) & 63) == 0) _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  else _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  return true;
}

// The finished totals of a row tile (t.c) into y, rounded to bf16 unless out_f32.
static void store_tile(const GemmArgs& a, const RowTile& t, int64_t nb, int G, bool nt) {
  const int64_t rows = min64(32, a.M - t.m0);
  const bool whole = !a.out_f32 && G == 2 && (nb + 2) * 16 <= a.N;  // two full 16-lane groups per row
  for (int64_t r = 0; r < rows; ++r) {
    if (whole && store_bf16_32(static_cast<uint16_t*>(a.y) + (t.m0 + r) * a.N + nb * 16, t.c + r * 32, nt)) continue;
    for (int g = 0; g < G; ++g) {
      const int64_t n0 = (nb + g) * 16;
      const int n = static_cast<int>(min64(16, a.N - n0));
      const float* c = t.c + r * 32 + g * 16;
      if (a.out_f32) {
        float* y = static_cast<float*>(a.y) + (t.m0 + r) * a.N + n0;
        for (int i = 0; i < n; ++i) y[i] = c[i];
      } else {
        store_bf16(static_cast<uint16_t*>(a.y) + (t.m0 + r) * a.N + n0, c, n);
      }
    }
  }
}

template <BSource SRC>
static void tile_any(int G, bool half, const GemmArgs& a, const RowTile& t, int64_t p_begin, int64_t p_end,
                     const uint8_t* const* wsrc, int64_t nb, bool stream) {
  if (G == 2) {
    if (half) tile_chunk<2, 1, SRC>(a, t, p_begin, p_end, wsrc, nb, stream);
    else tile_chunk<2, 2, SRC>(a, t, p_begin, p_end, wsrc, nb, stream);
  } else {
    if (half) tile_chunk<1, 1, SRC>(a, t, p_begin, p_end, wsrc, nb, stream);
    else tile_chunk<1, 2, SRC>(a, t, p_begin, p_end, wsrc, nb, stream);
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
  // One row tile: FP8 / FP4 decoded as the tile walks K (the decoded 16 pairs stay in L1);
  // more: each group decoded for all of K once and reused by every row tile of the pass.
  const bool chunked = scaled && a.M <= 32;
  // Row super-blocks keep their activations in L2 while every output group passes over them
  // (a group's FP8 / FP4 weights are decoded once per super-block); K is walked in chunks of
  // K_CHUNK pairs so that a group pair's chunk stays in L1 while the pass's row tiles reuse it.
  // (Measured at M = 2048: 128-pair chunks 10-25% faster than none, 64 or 256; passes of 512
  // rows faster than 256 or 1024 at hidden sizes <= 1024.)
  constexpr int64_t ROWS_PER_PASS = 512;
  const int64_t K_CHUNK = a.M <= 32 ? P : 128;
  const int64_t tiles = (min64(a.M, ROWS_PER_PASS) + 31) / 32;
  WP* buf = scaled && !chunked ? static_cast<WP*>(aligned_alloc(64, sizeof(WP) * 2 * P)) : nullptr;
  float* cbuf = static_cast<float*>(aligned_alloc(64, sizeof(float) * 32 * 32 * tiles));
  // The last row tile of a call whose M is not a multiple of 32 reads a zero-padded copy of its
  // rows (x itself holds M rows, or more).
  const int64_t tail = a.M % 32;
  uint16_t* xtail = tail ? static_cast<uint16_t*>(aligned_alloc(64, sizeof(uint16_t) * 32 * a.KP)) : nullptr;
  if (tail) {
    memcpy(xtail, static_cast<const uint16_t*>(a.x) + (a.M - tail) * a.KP, sizeof(uint16_t) * tail * a.KP);
    memset(xtail + tail * a.KP, 0, sizeof(uint16_t) * ((tail <= 16 ? 16 : 32) - tail) * a.KP);
  }
  constexpr int64_t L2_BYTES = 2 << 20;
  const bool nt = a.M * a.N * 2 >= L2_BYTES;
  configure();
  for (int64_t ms = 0; ms < a.M; ms += ROWS_PER_PASS) {
    const int64_t me = min64(a.M, ms + ROWS_PER_PASS);
    for (int64_t nb = a.nb0; nb < a.nb1; nb += 2) {
      const int g_count = static_cast<int>(min64(2, a.nb1 - nb));
      const uint8_t* wsrc[2] = {nullptr, nullptr};
      for (int g = 0; g < g_count && !chunked; ++g) {
        if (scaled) {
          decode_group(a, nb + g, buf + g * P);
          wsrc[g] = reinterpret_cast<const uint8_t*>(buf + g * P);
        } else {
          wsrc[g] = group_pairs(a, nb + g, 0);
        }
      }
      for (int64_t p0 = 0; p0 < P; p0 += K_CHUNK) {
        const int64_t p1 = min64(P, p0 + K_CHUNK);
        for (int64_t m0 = ms; m0 < me; m0 += 32) {
          const bool last_rows = m0 + 32 > a.M;
          const RowTile t{last_rows && tail ? xtail : static_cast<const uint16_t*>(a.x) + m0 * a.KP, m0,
                          cbuf + (m0 - ms) / 32 * 32 * 32};
          const bool half = a.M - m0 <= 16;
          if (chunked) tile_any<B_CHUNK>(g_count, half, a, t, p0, p1, wsrc, nb, true);
          else if (scaled) tile_any<B_DECODED>(g_count, half, a, t, p0, p1, wsrc, nb, false);
          else tile_any<B_PACKED>(g_count, half, a, t, p0, p1, wsrc, nb, m0 == ms);
          if (p1 == P) store_tile(a, t, nb, g_count, nt);
        }
      }
    }
  }
  _tile_release();
  if (nt) _mm_sfence();  // the non-temporal stores ordered before whatever reads y
  free(buf);
  free(cbuf);
  free(xtail);
}

}  // namespace kvshare_kernels
