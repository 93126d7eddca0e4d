// A sublayer's mHC work in one call (see mhc.h). Apart from the V4 head's sigmoid (the arithmetic of
// decode.cpp's mhc_post for `pre`), no arithmetic of its own: the steps are decode.cpp's and the
// GEMM kernels' functions, called in model/mhc.py's order on the same buffers.
//
// The mix GEMM runs its output groups on the calling thread: gemm_run.cpp's `gemm` splits groups
// over threads, but each output is computed by exactly one thread whatever the split, so the bits
// are the same (and at hc 4 the 24 outputs are two groups: one unit of that split anyway).
#pragma GCC target("avx2,fma,f16c")
#pragma GCC optimize("fp-contract=off")
#include "mhc.h"
#include <immintrin.h>
#include "decode.h"
#include "gemm.h"

extern "C" __m256 Sleef_expf8_u10(__m256);

namespace kvshare_kernels {
namespace {

// m [T][mix.n] = normed [T][K] fn^T (FMT_FP32, as gemm_run.cpp's `gemm` with kp = K, no scale block).
void mix_gemm(const MhcMix& mix, const float* normed, int64_t T, int64_t K, float* m, int isa) {
  const int64_t nb = (mix.n + 15) / 16;
  GemmArgs a{FMT_FP32, normed, mix.fn, nullptr, m, T, mix.n, K, K, 0, 0, nb, 0, 0};
  if (isa == MHC_AVX2) gemm_avx2(&a);
  else gemm_avx512(&a);
}

// pre[i] = sigmoid(m[i] s0 + b[i]) + eps for i < hc, as decode.cpp's mhc_post computes `pre`
// (torch's vector sigmoid 1 / (1 + exp(0 - z)), SLEEF's expf on lanes of 8; each op rounded).
void head_pre_row(const float* m, int hc, const float* base, float s0, float eps, float* pre) {
  for (int i0 = 0; i0 < hc; i0 += 8) {
    alignas(32) float z[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    const int c = hc - i0 < 8 ? hc - i0 : 8;
    for (int l = 0; l < c; ++l) {
      const float v = m[i0 + l] * s0 + base[i0 + l];
      z[l] = 0.0f - v;
    }
    _mm256_store_ps(z, Sleef_expf8_u10(_mm256_load_ps(z)));
    for (int l = 0; l < c; ++l) pre[i0 + l] = 1.0f / (z[l] + 1.0f) + eps;
  }
}

}  // namespace

void mhc_enter(const void* h, int bf16, int64_t T, int hc, int64_t D, const MhcMix& mix, const float* collapse_pre,
               const MhcNorm& norm, int isa, float* scratch, float* pre, float* post, float* comb, void* x) {
  const int64_t K = hc * D;
  float* normed = scratch;
  float* m = normed + T * K;
  void* xc = m + T * mix.n;
  rms_norm(h, bf16, nullptr, T, K, mix.rms_eps, 0, normed);
  mix_gemm(mix, normed, T, K, m, isa);
  mhc_post(m, T, mix.n, mix.base, mix.scale, hc, mix.hc_eps, mix.iters, pre, post, comb);
  mhc_collapse(h, bf16, collapse_pre ? collapse_pre : pre, T, hc, D, xc);
  rms_norm(xc, bf16, norm.w, T, D, norm.eps, bf16, x);
}

void mhc_boundary(const void* h, const void* y, const float* post_in, const float* comb_in, int bf16, int64_t T,
                  int hc, int64_t D, const MhcMix& mix, const float* collapse_pre, const MhcNorm& norm, int isa,
                  float* scratch, void* hn, float* pre, float* post, float* comb, void* x) {
  mhc_expand(h, y, bf16, post_in, comb_in, T, hc, D, hn);
  mhc_enter(hn, bf16, T, hc, D, mix, collapse_pre, norm, isa, scratch, pre, post, comb, x);
}

void mhc_head(const void* h, int bf16, int64_t T, int hc, int64_t D, const MhcMix* mix, float* pre,
              const MhcNorm& norm, int isa, float* scratch, void* x) {
  const int64_t K = hc * D;
  if (mix) {
    float* normed = scratch;
    float* m = normed + T * K;
    rms_norm(h, bf16, nullptr, T, K, mix->rms_eps, 0, normed);
    mix_gemm(*mix, normed, T, K, m, isa);
    for (int64_t t = 0; t < T; ++t) head_pre_row(m + t * mix->n, hc, mix->base, mix->scale[0], mix->hc_eps, pre + t * hc);
  }
  void* xc = scratch + T * (K + (mix ? mix->n : 0));
  mhc_collapse(h, bf16, pre, T, hc, D, xc);
  rms_norm(xc, bf16, norm.w, T, D, norm.eps, bf16, x);
}

}  // namespace kvshare_kernels
