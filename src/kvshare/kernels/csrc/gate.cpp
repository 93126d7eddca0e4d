// The MoE gate as torch ops (model/moe.py `Gate.forward`'s native path): `moe_route` (scores and stable
// top-k from logits, decode.h's arithmetic) and `moe_gate` (the fp32 projection, the temperature, routing,
// normalisation and scaling in one call). fp32 throughout, each op rounded as torch's.
#include <torch/extension.h>
#include <tuple>
#include "checks.h"
#include "decode.h"
#include "gemm_run.h"

namespace kvshare_kernels {
namespace {

int route_func(c10::string_view func, const char* op) {
  TORCH_CHECK(func == "sqrtsoftplus" || func == "sigmoid", "kernels.", op, ": func must be sqrtsoftplus or sigmoid, got ",
              func);
  return func == "sigmoid" ? 1 : 0;
}

// (weights [T, k] fp32, ids [T, k] int64) from logits [T, E] fp32, bias [E] fp32 or None, k <= E.
std::tuple<torch::Tensor, torch::Tensor> moe_route_op(const torch::Tensor& logits, const c10::optional<torch::Tensor>& bias,
                                                      int64_t k, c10::string_view func) {
  check_rows(logits, "moe_route", "logits", torch::kFloat32);
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) >= 1 && logits.size(1) <= (1 << 16),
              "kernels.moe_route: logits must be [T, E], got ", logits.sizes());
  TORCH_CHECK(k >= 1 && k <= logits.size(1), "kernels.moe_route: k = ", k, " must be in [1, ", logits.size(1), "]");
  const int f = route_func(func, "moe_route");
  const float* bp = nullptr;
  if (bias.has_value()) {
    check_rows(*bias, "moe_route", "bias", torch::kFloat32);
    TORCH_CHECK(bias->numel() == logits.size(1), "kernels.moe_route: bias has ", bias->numel(), " entries for ",
                logits.size(1), " experts");
    bp = bias->data_ptr<float>();
  }
  const int64_t t = logits.size(0);
  auto w = torch::empty({t, k}, logits.options());
  auto ids = torch::empty({t, k}, logits.options().dtype(torch::kInt64));
  moe_route(logits.data_ptr<float>(), bp, t, logits.size(1), k, f, w.data_ptr<float>(), ids.data_ptr<int64_t>());
  return {w, ids};
}

// logits = project_wide(x, the fp32 gate pack), divided by `temp` unless it is 1; moe_route's scores
// and stable top-k picks (or, with `given` ids: V4's hash routing, the scores at those experts); with
// `normalize`, each row's k weights divided by (their sum from the first pick to the last + 1e-20);
// then times `factor`.
std::tuple<torch::Tensor, torch::Tensor> moe_gate_op(const torch::Tensor& x, const torch::Tensor& w,
                                                     const torch::Tensor& exps, int64_t n, int64_t kdim,
                                                     c10::string_view isa, const c10::optional<torch::Tensor>& bias,
                                                     int64_t k, c10::string_view func, double temp, bool normalize,
                                                     double factor, const c10::optional<torch::Tensor>& given) {
  auto logits = project_wide(x, w, exps, n, kdim, isa, c10::nullopt, c10::nullopt, 0);
  if (temp != 1.0) logits.div_(temp);  // a tensor by a wrapped scalar: fp32 division by (float)temp
  torch::Tensor wts, ids;
  if (given.has_value()) {  // hash routing: the experts are given (the token's row of tid2eid), no top-k
    const int f = route_func(func, "moe_gate");
    TORCH_CHECK(given->device().is_cpu(), "kernels.moe_gate: given ids must be a CPU tensor");
    ids = given->to(torch::kInt64).contiguous();
    if (ids.is_same(*given)) ids = ids.clone();  // an op's output never aliases its input
    const int64_t t = logits.size(0), e = logits.size(1);
    TORCH_CHECK(ids.dim() == 2 && ids.size(0) == t && ids.size(1) == k, "kernels.moe_gate: given ids must be [", t, ", ",
                k, "], got ", ids.sizes());
    const int64_t* ip = ids.data_ptr<int64_t>();
    for (int64_t i = 0; i < t * k; ++i)
      TORCH_CHECK(ip[i] >= 0 && ip[i] < e, "kernels.moe_gate: given id ", ip[i], " outside [0, ", e, ")");
    wts = torch::empty({t, k}, logits.options());
    moe_scores_at(logits.data_ptr<float>(), t, e, k, f, ip, wts.data_ptr<float>());
  } else {
    std::tie(wts, ids) = moe_route_op(logits, bias, k, func);
  }
  float* wp = wts.data_ptr<float>();
  const int64_t t = logits.size(0);
  const float f = static_cast<float>(factor);
  for (int64_t r = 0; r < t; ++r) {
    float* row = wp + r * k;
    if (normalize) {
      float sum = row[0];
      for (int64_t j = 1; j < k; ++j) sum += row[j];
      const float denom = sum + 1e-20f;
      for (int64_t j = 0; j < k; ++j) row[j] /= denom;
    }
    for (int64_t j = 0; j < k; ++j) row[j] *= f;
  }
  return {wts, ids};
}

}  // namespace
}  // namespace kvshare_kernels

TORCH_LIBRARY_FRAGMENT(kvshare, m) {
  m.def("moe_route(Tensor logits, Tensor? bias, int k, str func) -> (Tensor, Tensor)");
  m.def("moe_gate(Tensor x, Tensor w, Tensor exps, int n, int kdim, str isa, Tensor? bias, int k, str func, "
        "float temp, bool normalize, float factor, Tensor? given) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvshare, CPU, m) {
  m.impl("moe_route", &kvshare_kernels::moe_route_op);
  m.impl("moe_gate", &kvshare_kernels::moe_gate_op);
}
