// Cache row codecs and the FP4 quantise-dequantise (rows.cpp, which registers them as torch ops).
#pragma once
#include <torch/extension.h>
#include <vector>
#include "row_codec.h"  // RowScheme (plain and fp8_row rows stay torch here), the row decoder

namespace kvshare_kernels {

// quant.fake_quant_fp4(x, block, "ue8m0" if ue8m0 else "e4m3"): same dtype as x (bf16 / fp32).
torch::Tensor fake_quant_fp4(torch::Tensor x, int64_t block, bool ue8m0);
// RowFormat.pack: float rows [..., dim] -> uint8 [..., row_bytes] (data, scales, zero pad).
torch::Tensor pack_rows(torch::Tensor x, int64_t scheme, int64_t block, int64_t rope_dim, int64_t row_bytes);
// RowFormat.unpack: uint8 [..., row_bytes] -> [..., dim] in out_dtype (decoded in fp32, then rounded).
torch::Tensor unpack_rows(torch::Tensor u8, int64_t scheme, int64_t block, int64_t dim, int64_t rope_dim,
                          torch::ScalarType out_dtype);
// Ring.write for plain encodings: the bytes of values[i][tokens[j]] -> rings[i][slot[j], row[j]] for
// every ring i and kept row j (a ring row holds exactly one value row's bytes).
void ring_store(at::TensorList rings, at::TensorList values,
                const torch::Tensor& tokens, const torch::Tensor& slot, const torch::Tensor& row);

}  // namespace kvshare_kernels
