// One packed weight's GEMM exactly as gemm_run.cpp's `gemm` runs it (for kernels that chain GEMMs
// inside one call): the same GemmArgs, ISA rule (AMX where the weight's K and scale blocks fit whole
// tiles, a property of the weight, never of the row count), zero padding of bf16 rows to KP, and
// split of output groups over threads (each output by one thread), so the same bits.
#pragma once
#include <torch/extension.h>
#include <string>
#include "gemm.h"

namespace kvshare_kernels {

// A packed weight (kernels/packed.py `Packed`; layouts in gemm.h).
struct PackedLin {
  int fmt;
  int64_t n, k, kp, bk;
  int group_exps;
  const void* w;
  const uint8_t* exps;
};

// Fields per linear in a `meta` row: fmt, n, k, kp, bk, group_exps (moe.h's MOE_META layout).
constexpr int64_t PACKED_META = 6;

enum class GemmPath { AMX, AVX512, AVX2 };

// "amx" | "avx512" | "avx2" (kernels.build.best_isa); anything else is refused naming `who`.
GemmPath gemm_path(const std::string& isa, const char* who);

// Linear i from meta row i and its tensors (data, exps), after the checks gemm_run.cpp's `gemm`
// makes on them (format, padded K, scale block, byte and exponent counts); errors name `who`.
PackedLin packed_lin(const int64_t* meta_row, const torch::Tensor& data, const torch::Tensor& exps, const char* who,
                     int64_t i);

// Row width of x as the GEMM reads it: KP for bf16 activations (zero-padded), K for fp32.
inline int64_t staged_width(const PackedLin& l) { return l.fmt == FMT_FP32 ? l.k : l.kp; }

// y [m][n] (activation dtype) = x W^T for x [m][staged_width(l)] (bf16 rows zero-padded past K).
void packed_gemm(const PackedLin& l, const void* x, int64_t m, void* y, GemmPath path);

}  // namespace kvshare_kernels
