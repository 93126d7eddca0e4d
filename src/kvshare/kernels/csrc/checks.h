// Argument checks shared by the op units (every op registered in the `kvshare` torch library checks its
// tensors with these before reading a byte): errors are TORCH_CHECK's (RuntimeError in Python) and
// name the op and the argument.
#pragma once
#include <torch/extension.h>

namespace kvshare_kernels {

// t is a contiguous CPU tensor of dtype `want`.
inline void check_rows(const torch::Tensor& t, const char* op, const char* name, torch::ScalarType want) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "kernels.", op, ": ", name, " must be a contiguous CPU tensor");
  TORCH_CHECK(t.scalar_type() == want, "kernels.", op, ": ", name, " has dtype ", t.scalar_type(), ", expected ", want);
}

// t is a contiguous bf16 or fp32 CPU tensor (the activation dtypes the kernels take).
inline void check_stream_dtype(const torch::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "kernels.", op, ": ", name, " must be a contiguous CPU tensor");
  TORCH_CHECK(t.scalar_type() == torch::kBFloat16 || t.scalar_type() == torch::kFloat32,
              "kernels.", op, ": ", name, " must be bf16 or fp32, got ", t.scalar_type());
}

inline bool is_bf16(const torch::Tensor& t) { return t.scalar_type() == torch::kBFloat16; }

}  // namespace kvshare_kernels
