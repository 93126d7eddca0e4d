// The GEMM runner of the `gemm` and `project_wide` ops (gemm_run.cpp): argument checks, the zero padding of
// odd-K bf16 rows, the ISA rule and the split of output groups over threads (each output element is
// computed by exactly one thread, so the thread count changes no bit). Also `cpu_has`, the CPU test every
// ISA choice makes.
#pragma once
#include <torch/extension.h>
#include <string>

namespace kvshare_kernels {

// Whether this CPU (and OS) runs a code path: "avx512bf16", "amx" or "avx2".
bool cpu_has(c10::string_view what);

// y = x W^T for x [M, K] bf16 (FMT_FP32: fp32) and w / exps in the packed layout of gemm.h; isa "amx" |
// "avx512" | "avx2", or "avx512-bw" (the AVX-512 path without its VBMI decoder, for tests); out_f32: the fp32 totals instead of bf16 (bf16-activation formats; for tests).
torch::Tensor gemm(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& exps, int64_t fmt, int64_t n,
                   int64_t k, int64_t kp, int64_t bk, c10::string_view isa, bool out_f32);

// [M, N] fp32 = widen(x) W^T for x [M, K] bf16 / fp32 and an fp32 pack (gemm's bits on the exact widening);
// with `table` [R, C] fp32 and `positions` [M] int64, row m then gets table[positions[m] mod R] added to its
// columns [offset, offset + C) (one correctly rounded fp32 add each: ``y[:, offset:offset + C] +=
// table[positions % R]``'s bits).
torch::Tensor project_wide(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& exps, int64_t n,
                           int64_t k, c10::string_view isa, const c10::optional<torch::Tensor>& table,
                           const c10::optional<torch::Tensor>& positions, int64_t offset);

}  // namespace kvshare_kernels
