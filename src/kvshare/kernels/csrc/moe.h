// A MoE layer's experts in one call (moe.cpp, model/moe.py): rows grouped per expert, each group's
// w1 / w3 GEMMs, SwiGLU with the routing weight, w2 GEMM, then the per-token combine, with the same
// GEMM functions, padding and ISA rule as `kernels.linear` (gemm_run.cpp `gemm`), the same SwiGLU
// and combine as `swiglu` / `moe_combine` (decode.h), so the result has the bits of the torch +
// per-expert-kernel path. Every row is computed from its own inputs: row-invariant.
#pragma once
#include <torch/extension.h>
#include <string>
#include <vector>
#include "fp8.h"
#include "pack_set.h"  // the registered sets the op takes
#include "packed_gemm.h"

namespace kvshare_kernels {

// Number of int64 fields per linear in `meta`: fmt, n, k, kp, bk, group_exps (packed_gemm.h's layout).
constexpr int64_t MOE_META = PACKED_META;

// The experts of one MoE layer for tokens x [T, D] (bf16 or fp32, contiguous): ids [T, k] int64 in
// [0, E), weights [T, k] fp32. Linear l = 3 e + (0: w1, 1: w3, 2: w2) for e < E routed experts and
// e = E the shared expert; the set's packs[2 l], packs[2 l + 1] its packed data and exponents, its meta
// [3 (E + 1), MOE_META]. x_block / h_block > 0: FP8-round x (before w1 / w3) and the SwiGLU output
// (before w2) in blocks of that many values; 0: no rounding. Returns [T, D] in x's dtype, or None when
// the set is stale (a weight was replaced or edited: the caller registers a new set).
c10::optional<torch::Tensor> moe_experts(const torch::Tensor& x, const torch::Tensor& ids, const torch::Tensor& weights,
                                         const PackSet& set, double limit, int64_t x_block, int64_t h_block,
                                         const std::string& isa);

}  // namespace kvshare_kernels
