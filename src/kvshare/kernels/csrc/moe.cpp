// One MoE layer's experts in one call (see moe.h). The order of work is that of model/moe.py:
// slots grouped per expert by a stable counting sort of the flat ids (= the stable argsort: a
// group's rows in slot order), the routed groups in increasing expert id, then the shared expert
// on every token; each group runs its GEMMs right after gathering its rows (its activations stay
// in cache). No arithmetic of its own: the GEMMs are gemm_amx / gemm_avx512 / gemm_avx2, the
// SwiGLU and combine decode.cpp's, the FP8 rounding fp8.cpp's, so every bit matches the torch
// path's per-expert calls, and each row's result depends on that row alone.
#include "moe.h"
#include <ATen/Parallel.h>
#include <cstring>
#include "decode.h"
#include "gemm.h"
#include "packed_gemm.h"

namespace kvshare_kernels {
namespace {

// Copies rows src[row(i)] (i < m, each k values of `es` bytes) into stage [.][kp], zeroing the
// padding columns and the rows [m, rows).
template <typename RowOf>
void stage_rows(const char* src, int64_t k, int64_t kp, int64_t es, int64_t m, int64_t rows, RowOf row_of, char* stage) {
  for (int64_t i = 0; i < m; ++i) {
    memcpy(stage + i * kp * es, src + row_of(i) * k * es, k * es);
    if (kp > k) memset(stage + (i * kp + k) * es, 0, (kp - k) * es);
  }
  if (rows > m) memset(stage + m * kp * es, 0, (rows - m) * kp * es);
}

}  // namespace

c10::optional<torch::Tensor> moe_experts(const torch::Tensor& x, const torch::Tensor& ids, const torch::Tensor& weights,
                                         const PackSet& set, double limit, int64_t x_block, int64_t h_block,
                                         const std::string& isa) {
  // ---- the pack set is still the layer's weights ----
  if (!set.fresh()) return c10::nullopt;
  const auto& packs = set.packs;
  const auto& meta = set.meta;
  // ---- arguments ----
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && x.dim() == 2 &&
              (x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat32),
              "kernels.moe_experts: x must be a contiguous bf16 / fp32 CPU tensor [T, D], got ", x.scalar_type(), " ", x.sizes());
  const int64_t T = x.size(0), D = x.size(1);
  TORCH_CHECK(ids.scalar_type() == torch::kInt64 && ids.is_contiguous() && ids.dim() == 2 && ids.size(0) == T,
              "kernels.moe_experts: ids must be contiguous int64 [", T, ", k], got ", ids.scalar_type(), " ", ids.sizes());
  const int64_t K = ids.size(1);
  TORCH_CHECK(K >= 1, "kernels.moe_experts: ids must have k >= 1 columns");
  TORCH_CHECK(weights.scalar_type() == torch::kFloat32 && weights.is_contiguous() && weights.sizes() == ids.sizes(),
              "kernels.moe_experts: weights must be contiguous fp32 ", ids.sizes(), ", got ", weights.scalar_type(), " ",
              weights.sizes());
  TORCH_CHECK(meta.scalar_type() == torch::kInt64 && meta.is_contiguous() && meta.dim() == 2 &&
              meta.size(1) == MOE_META && meta.size(0) % 3 == 0 && meta.size(0) >= 6,
              "kernels.moe_experts: meta must be int64 [3 (E + 1), ", MOE_META, "], got ", meta.sizes());
  const int64_t E = meta.size(0) / 3 - 1, L = meta.size(0);
  TORCH_CHECK(static_cast<int64_t>(packs.size()) == 2 * L, "kernels.moe_experts: ", packs.size(),
              " pack tensors for ", L, " linears (expected ", 2 * L, ")");
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  const int64_t es = bf16 ? 2 : 4;
  const GemmPath path = gemm_path(isa, "kernels.moe_experts");
  std::vector<PackedLin> lin(L);
  const auto* mp = meta.data_ptr<int64_t>();
  for (int64_t i = 0; i < L; ++i) {
    lin[i] = packed_lin(mp + i * MOE_META, packs[2 * i], packs[2 * i + 1], "kernels.moe_experts", i);
    TORCH_CHECK((lin[i].fmt == FMT_FP32) == !bf16, "kernels.moe_experts: linear ", i, " (format ", lin[i].fmt,
                ") does not take ", x.scalar_type(), " activations");
    const PackedLin& w1 = lin[i - i % 3];
    const bool down = i % 3 == 2;
    TORCH_CHECK(lin[i].k == (down ? w1.n : D) && lin[i].n == (down ? D : w1.n),
                "kernels.moe_experts: linear ", i, " is ", lin[i].n, " x ", lin[i].k, ", expected ",
                (down ? D : w1.n), " x ", (down ? w1.n : D));
  }
  TORCH_CHECK(x_block >= 0 && h_block >= 0 && (x_block == 0) == (h_block == 0) && (!x_block || D % x_block == 0),
              "kernels.moe_experts: FP8 blocks ", x_block, " / ", h_block, " do not fit D = ", D);
  // ---- slots grouped per expert (stable counting sort) ----
  const int64_t S = T * K;
  const auto* idp = ids.data_ptr<int64_t>();
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(idp[s] >= 0 && idp[s] < E, "kernels.moe_experts: ids holds expert ", idp[s], " outside [0, ", E, ")");
    ++start[idp[s] + 1];
  }
  int64_t m_max = T;  // rows of the largest group (a hash table may repeat an expert in a row)
  for (int64_t e = 0; e < E; ++e) {
    m_max = std::max(m_max, start[e + 1]);
    start[e + 1] += start[e];
  }
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  auto sel = torch::empty({S}, torch::kInt64);
  auto* sp = sel.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s) sp[fill[idp[s]]++] = s;
  // ---- per group: gather, w1 / w3, SwiGLU x weight, (FP8), w2 into its rows of `out` ----
  torch::Tensor xq = x_block ? fake_quant_fp8(x, x_block) : x;
  const char* xs = static_cast<const char*>(xq.data_ptr());
  const auto* wp = weights.data_ptr<float>();
  auto out = torch::empty({S + T, D}, x.options());
  char* op = static_cast<char*>(out.data_ptr());
  int64_t max_i = 0;
  for (int64_t e = 0; e <= E; ++e) max_i = std::max(max_i, lin[3 * e].n);
  const int64_t rows_max = m_max;
  auto xstage = torch::empty({rows_max * (bf16 ? D + D % 2 : D)}, x.options());
  auto hstage = torch::empty({rows_max * (bf16 ? max_i + max_i % 2 : max_i)}, x.options());
  auto gate = torch::empty({m_max * max_i}, x.options());
  auto up = torch::empty({m_max * max_i}, x.options());
  std::vector<float> gw(m_max);
  for (int64_t e = 0; e <= E; ++e) {
    const bool shared = e == E;
    const int64_t a = shared ? S : start[e], m = shared ? T : start[e + 1] - start[e];
    if (m == 0) continue;
    const PackedLin& w1 = lin[3 * e];
    const PackedLin& w3 = lin[3 * e + 1];
    const PackedLin& w2 = lin[3 * e + 2];
    const int64_t I = w1.n;
    const int64_t rows_x = m;  // gemm_amx pads a last partial row tile itself (gemm.h)
    const int64_t kpx = bf16 ? w1.kp : D;
    char* xst = static_cast<char*>(xstage.data_ptr());
    if (shared) stage_rows(xs, D, kpx, es, m, rows_x, [](int64_t i) { return i; }, xst);
    else stage_rows(xs, D, kpx, es, m, rows_x, [sp, a, K](int64_t i) { return sp[a + i] / K; }, xst);
    packed_gemm(w1, xst, m, gate.data_ptr(), path);
    packed_gemm(w3, xst, m, up.data_ptr(), path);
    for (int64_t i = 0; i < m; ++i) gw[i] = shared ? 1.0f : wp[sp[a + i]];
    auto hidden = torch::empty({m, I}, x.options());
    swiglu(gate.data_ptr(), up.data_ptr(), bf16 ? 1 : 0, gw.data(), m, I, static_cast<float>(limit), hidden.data_ptr());
    if (h_block) {
      TORCH_CHECK(I % h_block == 0, "kernels.moe_experts: FP8 block ", h_block, " does not divide the expert width ", I);
      hidden = fake_quant_fp8(hidden, h_block);
    }
    const int64_t kph = bf16 ? w2.kp : I;
    const int64_t rows_h = m;
    const void* h2 = hidden.data_ptr();
    if (kph != I || rows_h != m) {
      char* hst = static_cast<char*>(hstage.data_ptr());
      stage_rows(static_cast<const char*>(h2), I, kph, es, m, rows_h, [](int64_t i) { return i; }, hst);
      h2 = hst;
    }
    packed_gemm(w2, h2, m, op + a * D * es, path);
  }
  // ---- per token: its k slots in slot order (torch's cascade), then the shared expert ----
  auto y = torch::empty({T, D}, x.options());
  if (T) moe_combine(op, bf16 ? 1 : 0, sp, T, K, D, S, y.data_ptr());
  return y;
}

}  // namespace kvshare_kernels

namespace kvshare_kernels {
namespace {

// The op: `moe_experts`' result as a list, empty when the pack set is stale.
std::vector<torch::Tensor> moe_experts_op(const torch::Tensor& x, const torch::Tensor& ids, const torch::Tensor& weights,
                                          int64_t set, double limit, int64_t x_block, int64_t h_block, c10::string_view isa) {
  const auto ps = pack_set_get(set, "kernels.moe_experts");
  auto y = moe_experts(x, ids, weights, *ps, limit, x_block, h_block, std::string(isa));
  if (!y.has_value()) return {};
  return {*y};
}

}  // namespace
}  // namespace kvshare_kernels

TORCH_LIBRARY_FRAGMENT(kvshare, m) {
  // set: a pack set (pack_set.h) of the layer's expert linears
  m.def("moe_experts(Tensor x, Tensor ids, Tensor weights, int set, float limit, int x_block, int h_block, str isa) "
        "-> Tensor[]");
}

TORCH_LIBRARY_IMPL(kvshare, CPU, m) {
  m.impl("moe_experts", &kvshare_kernels::moe_experts_op);
}
