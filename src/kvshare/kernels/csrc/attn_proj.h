// Attention's input and output projections in one call each (attn_proj.cpp, model/attention.py),
// composed of the existing kernels in the torch path's order, so the torch path's bits:
//   attn_in:  x -> [FP8] -> wq_a -> q_norm = qr;  qr -> [FP8] -> wq_b -> (V4: per-head RMSNorm) -> RoPE = q;
//             x -> [FP8] -> wkv -> kv_norm -> RoPE = kv
//   attn_out: o -> inverse RoPE (into a new tensor) -> per group g: o[:, g] wo_a[g]^T -> u -> [FP8] -> wo_b
// GEMMs: packed_gemm (gemm_run.cpp `gemm`'s arithmetic); RMSNorm / RoPE: decode.h's `rms_norm` /
// `rope`; [FP8]: fp8.h's `fake_quant_fp8` (when the block is > 0). Every row is computed
// from its own inputs alone (row-invariant).
#pragma once
#include <torch/extension.h>
#include <string>
#include <vector>
#include "fp8.h"
#include "pack_set.h"

namespace kvshare_kernels {

// The pack set (kernels/attn_proj.py `ProjPacks`, registered once: pack_set.h): linear l has meta row l
// (packed_gemm.h's PACKED_META fields) and tensors packs[2 l] (data), packs[2 l + 1] (exps), in the order
// wq_a, wq_b, wkv, wo_a group 0 .. G-1, wo_b. A watched tensor that changed since registration makes
// the calls return nothing.

// (qr [T, q_lora], q [T, H, d], kv [T, d]) in x's dtype for x [T, D] (bf16 / fp32): q_norm_w
// [q_lora] and kv_norm_w [d] fp32 RMSNorm weights, eps; c, s [T, rd] fp32 RoPE tables (the
// positions' (C, S), model/rope.py); head_norm: V4's weightless per-head RMSNorm of q; x_block /
// qr_block: FP8 blocks of the wq_a / wkv and the wq_b inputs (0: none). nullopt when stale.
c10::optional<std::vector<torch::Tensor>> attn_in(const torch::Tensor& x, const PackSet& set, const torch::Tensor& q_norm_w,
                                   const torch::Tensor& kv_norm_w, double eps, const torch::Tensor& c,
                                   const torch::Tensor& s, int64_t heads, bool head_norm, int64_t x_block,
                                   int64_t qr_block, const std::string& isa);

// [T, D] in o's dtype for the attention output o [T, H, d] (contiguous, left as it is; rotated by the
// tables c, s [T, rd] fp32 — the inverse rotation's (C, -S)); u_block: FP8 block of wo_b's input
// (0: none). nullopt when stale.
c10::optional<torch::Tensor> attn_out(const torch::Tensor& o, const PackSet& set, const torch::Tensor& c,
                                      const torch::Tensor& s, int64_t u_block, const std::string& isa);

// The lightning indexer's query side (model/indexer.py `Indexer.select`), the torch path's bits:
// q = RoPE(wq_b([FP8] qr)) in qr's dtype, returned in fp32 [T, H, d]; w = fp32(weights_proj(x)) * scale
// [T, H]. The set holds wq_b then weights_proj; qr_block: FP8 block of wq_b's input (0: none); c, s:
// the positions' RoPE tables. nullopt when stale.
c10::optional<std::vector<torch::Tensor>> index_query(const torch::Tensor& qr, const torch::Tensor& x,
                                                      const PackSet& set, const torch::Tensor& c, const torch::Tensor& s,
                                                      int64_t heads, double scale, int64_t qr_block, const std::string& isa);

}  // namespace kvshare_kernels
