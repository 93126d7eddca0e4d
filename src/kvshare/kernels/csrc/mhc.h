// A sublayer's mHC work in one call (mhc.cpp, kernels/mhc.py): the calls model/mhc.py makes one by
// one in a batch-invariant native forward, composed in the same order with the same functions:
// decode.h's rms_norm / mhc_post / mhc_collapse / mhc_expand and the fp32 mix GEMM of gemm.h as
// `kernels.linear` runs it (gemm_run.cpp `gemm`: FMT_FP32 activations used in place; gemm_avx512
// for "amx" / "avx512", gemm_avx2 for "avx2"). So every output has the bits of those calls, and each
// row depends on its own inputs only (row-invariant). No torch here: mhc_ops.cpp allocates.
#pragma once
#include <stdint.h>

namespace kvshare_kernels {

// One sublayer's mix parameters: fn packed as FMT_FP32 ([NB][K][16], gemm.h) with n outputs over
// K = hc D inputs (n = (2 + hc) hc; the V4 head: hc); base [n] and scale ([3]; the head: [1]) fp32.
struct MhcMix {
  const float* fn;
  int64_t n;
  const float* base;
  const float* scale;
  float rms_eps;  // the RMS statistic of the flattened streams
  float hc_eps;
  int iters;      // Sinkhorn iterations (unused by the head)
};

// The sublayer's RMSNorm on the collapsed row: weight [D] fp32, eps.
struct MhcNorm {
  const float* w;
  float eps;
};

// GEMM code path of the mix (FMT_FP32 never takes the AMX tiles).
enum MhcIsa : int { MHC_AVX512 = 0, MHC_AVX2 = 1 };

// Floats of scratch a call over T rows needs: normed [T][hc D], m [T][n], the collapsed row [T][D].
inline int64_t mhc_scratch_floats(int64_t T, int hc, int64_t D, int64_t n) { return T * (hc * D + n + D); }

// Enter a sublayer from streams h [T][hc][D] (bf16 when `bf16`, else fp32):
//   normed = rms_norm(flat h, no weight, rms_eps) in fp32; m = normed fn^T (the GEMM);
//   (pre, post, comb) = mhc_post(m) (pre, post [T][hc], comb [T][hc][hc] fp32);
//   xc = mhc_collapse(h, collapse_pre, or pre when null) in h's dtype;
//   x [T][D] = rms_norm(xc, norm.w, norm.eps) in h's dtype.
// Needs hc D >= 8 and D >= 8 (the rows torch's RMSNorm sums in its vector order).
void mhc_enter(const void* h, int bf16, int64_t T, int hc, int64_t D, const MhcMix& mix, const float* collapse_pre,
               const MhcNorm& norm, int isa, float* scratch, float* pre, float* post, float* comb, void* x);

// The boundary between two sublayers: hn [T][hc][D] = mhc_expand(h, y, post_in, comb_in) (y [T][D]
// in h's dtype), then `mhc_enter` of the next sublayer on hn. hn is the block's residual.
void mhc_boundary(const void* h, const void* y, const float* post_in, const float* comb_in, int bf16, int64_t T,
                  int hc, int64_t D, const MhcMix& mix, const float* collapse_pre, const MhcNorm& norm, int isa,
                  float* scratch, void* hn, float* pre, float* post, float* comb, void* x);

// The model's tail: with `mix` (V4's hc_head), pre [T][hc] = sigmoid(m s0 + b) + hc_eps from
// m = rms_norm(flat h) fn^T (torch's vector sigmoid: 1 / (1 + exp(0 - z)), SLEEF's expf), written
// to `pre`; without (V4.1), `pre` is read (the last sublayer's). Then x [T][D] = rms_norm(
// mhc_collapse(h, pre), norm) in h's dtype.
void mhc_head(const void* h, int bf16, int64_t T, int hc, int64_t D, const MhcMix* mix, float* pre,
              const MhcNorm& norm, int isa, float* scratch, void* x);

}  // namespace kvshare_kernels
