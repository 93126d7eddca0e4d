// Shared declarations of the ISA translation units (no torch, no std templates: see gemm_body.h).
#pragma once
#include <stdint.h>

namespace kvshare_kernels {

enum Format : int { FMT_BF16 = 0, FMT_FP32 = 1, FMT_FP8 = 2, FMT_FP4 = 3 };

// One call computes y[m, n] for every row m < M and every output n of the 16-wide groups
// [nb0, nb1). Layouts (NB = ceil(N / 16), P = KP / 2 pairs, KB = KP / bk blocks):
//   FMT_BF16: w int32 [NB][P][16]     (a bf16 pair per dword: k = 2p low half, 2p + 1 high half)
//   FMT_FP8:  w uint8 [NB][P][16][2]  (e4m3 codes, k = 2p first), exps uint8 [NB][KB][16], or
//             [NB][KB] when group_exps (one scale for the 16 rows of a group: 128-row blocks)
//   FMT_FP4:  w uint8 [NB][P][16]     (e2m1 pair: k = 2p low nibble), exps uint8 [NB][KB][16]
//   FMT_FP32: w float [NB][K][16]
// x: bf16 [M][KP] (zero-padded) (FP32: float [M][K]); y: bf16 [M][N] (FP32: float [M][N]).
struct GemmArgs {
  int fmt;
  const void* x;
  const void* w;
  const uint8_t* exps;
  void* y;
  int64_t M, N, K, KP, bk;
  int64_t nb0, nb1;
  int group_exps;
  int out_f32;
};

// Software prefetch along the weight stream of a thread's groups [nb, nb1): the tile that walks the
// G groups nb .. nb + G - 1 in lockstep reads each group's pairs in increasing p, and the stream
// of tile lane g continues in group nb + g + G, so `ahead` pairs past pair p of group nb + g lie
// in group nb + g + G * ((p + ahead) / P). Prefetches `lines` cache lines (64 bytes) there.
static inline void prefetch_stream(const GemmArgs& a, int64_t pair_bytes, int64_t group, int G, int64_t p,
                                   int64_t ahead, int64_t lines) {
  const int64_t P = a.KP / 2, q = p + ahead;
  const int64_t g = group + G * (q / P);
  if (g >= a.nb1) return;
  const char* at = static_cast<const char*>(a.w) + (g * P + q % P) * pair_bytes;
  for (int64_t l = 0; l < lines; ++l) __builtin_prefetch(at + 64 * l, 0, 3);
}

void gemm_avx512(const GemmArgs* a);       // the fastest of the two below this CPU runs (gemm_run.cpp)
void gemm_avx512_bw(const GemmArgs* a);    // AVX-512 BW decoders
void gemm_avx512_vbmi(const GemmArgs* a);  // VBMI / GFNI decoders: the same bits
void gemm_avx2(const GemmArgs* a);
// AMX (gemm_amx.cpp): x [M][KP] (rows past M, if any, are not read); needs KP % 32 == 0 and, scaled, bk % 32 == 0.
void gemm_amx(const GemmArgs* a);
bool amx_enable();

}  // namespace kvshare_kernels
