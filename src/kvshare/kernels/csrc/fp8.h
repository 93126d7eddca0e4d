// FP8 e4m3 quantise-dequantise of GEMM inputs (fp8.cpp): the one copy, used by the `fake_quant_fp8` op and
// inside the fused units (moe.cpp, attn_proj.cpp) before a GEMM.
#pragma once
#include <torch/extension.h>

namespace kvshare_kernels {

// quant.fake_quant_fp8(x, block, ue8m0=True)'s bits for a bf16 / fp32 CPU tensor x whose last dim is a
// multiple of `block`: a new contiguous tensor of x's dtype and shape (see fp8.cpp for the steps).
torch::Tensor fake_quant_fp8(const torch::Tensor& x, int64_t block);

}  // namespace kvshare_kernels
