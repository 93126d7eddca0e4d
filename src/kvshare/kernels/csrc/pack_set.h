// Pack sets registered once and named by an id (pack_set.cpp; kernels/pack_sets.py).
//
// The fused ops that multiply by many packed linears (attn_in / attn_out / index_select: a layer's
// projections; moe_experts: a MoE layer's every expert) take their weights as one registered set
// instead of tensor lists: converting a list of ~300 tensors from Python costs the dispatcher tens
// of microseconds per call, an int nothing. A set holds its tensors (so they live while it does)
// until `pack_set_free`. It is stale when a watched tensor's address, in-place version or dtype
// differs from its stamps (taken at registration): the ops then return nothing and the caller
// registers a new set.
#pragma once
#include <torch/extension.h>
#include <memory>
#include <vector>

namespace kvshare_kernels {

// What a watched tensor was at registration: address, in-place version (-1 for an inference
// tensor) and dtype.
struct Stamp {
  const void* data;
  int64_t version;
  at::ScalarType dtype;
  explicit Stamp(const torch::Tensor& t);
  bool operator==(const Stamp& o) const { return data == o.data && version == o.version && dtype == o.dtype; }
};

struct PackSet {
  std::vector<torch::Tensor> packs;  // data, exps of linear l at 2 l, 2 l + 1
  torch::Tensor meta;                // int64 [L, PACKED_META]
  std::vector<torch::Tensor> watch;  // the tensors whose change makes the set stale
  std::vector<Stamp> stamps;         // of `watch`, taken at registration

  // Whether every watched tensor still has its stamp (no allocation).
  bool fresh() const;
};

// Registers a set (the tensors are held, not copied) and returns its id (> 0).
int64_t pack_set_new(at::TensorList packs, const torch::Tensor& meta, at::TensorList watch);

// Drops set `id` (its tensors are released); an unknown id is ignored (freeing twice is harmless).
void pack_set_free(int64_t id);

// The set `id`; an unknown id is an error naming `who`.
std::shared_ptr<const PackSet> pack_set_get(int64_t id, const char* who);

}  // namespace kvshare_kernels
