// See gemm_run.h. The GEMM kernels themselves are gemm_avx512.cpp, gemm_avx2.cpp and gemm_amx.cpp.
#include "gemm_run.h"
#include <ATen/Parallel.h>
#include <cstring>
#include "checks.h"
#include "gemm.h"

namespace kvshare_kernels {

bool cpu_has(c10::string_view what) {
  __builtin_cpu_init();
  if (what == "avx512bf16")
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512bf16");
  if (what == "avx512vbmi")  // with GFNI: gemm_avx512_vbmi.cpp uses both
    return cpu_has("avx512bf16") && __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("gfni");
  if (what == "amx") {
    static const bool ok = cpu_has("avx512bf16") && __builtin_cpu_supports("amx-tile") &&
                           __builtin_cpu_supports("amx-bf16") && amx_enable();
    return ok;
  }
  if (what == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return false;
}

// The AVX-512 unit for this CPU (decided once): both give the same bits.
void gemm_avx512(const GemmArgs* a) {
  static const bool vbmi = cpu_has("avx512vbmi");
  if (vbmi) gemm_avx512_vbmi(a);
  else gemm_avx512_bw(a);
}

torch::Tensor gemm(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& exps, int64_t fmt, int64_t n,
                   int64_t k, int64_t kp, int64_t bk, c10::string_view isa, bool out_f32) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "kernels.gemm: x must be [M, ", k, "], got ", x.sizes());
  TORCH_CHECK(w.is_contiguous() && exps.is_contiguous(), "kernels.gemm: packed weight must be contiguous");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && exps.device().is_cpu(), "kernels.gemm: CPU tensors only");
  const bool f32 = fmt == FMT_FP32;
  TORCH_CHECK(x.scalar_type() == (f32 ? torch::kFloat32 : torch::kBFloat16),
              "kernels.gemm: activation dtype ", x.scalar_type(), " does not fit format ", fmt);
  TORCH_CHECK(fmt >= 0 && fmt <= 3, "kernels.gemm: unknown format ", fmt);
  TORCH_CHECK(n >= 0 && k >= 0, "kernels.gemm: the weight is ", n, " x ", k);
  TORCH_CHECK(f32 || (kp % 2 == 0 && kp >= k && kp - k < 2), "kernels.gemm: bad padded K ", kp);
  TORCH_CHECK(fmt == FMT_BF16 || f32 || (bk >= 2 && bk <= 256 && bk % 2 == 0), "kernels.gemm: bad scale block ", bk);
  const int64_t n_groups = (n + 15) / 16;
  const int64_t w_bytes = f32 ? n_groups * k * 16 * 4
                              : n_groups * (kp / 2) * 16 * (fmt == FMT_FP8 ? 2 : 4) / (fmt == FMT_FP4 ? 4 : 1);
  TORCH_CHECK(w.numel() * w.element_size() == w_bytes, "kernels.gemm: packed weight has ",
              w.numel() * w.element_size(), " bytes, expected ", w_bytes);
  const int64_t n_exps = (fmt == FMT_BF16 || f32) ? 0 : n_groups * ((kp + bk - 1) / bk);
  const bool group_exps = fmt == FMT_FP8 && exps.numel() == n_exps;
  TORCH_CHECK(fmt == FMT_BF16 || f32 || group_exps || exps.numel() == n_exps * 16,
              "kernels.gemm: scale exponents have ", exps.numel(), " entries");
  TORCH_CHECK(exps.numel() == 0 || exps.scalar_type() == torch::kUInt8, "kernels.gemm: scale exponents must be uint8");
  // "avx512-bw": the AVX-512 path with its BW decoders even where VBMI would serve (tests: the same bits)
  const bool bw_only = isa == "avx512-bw";
  const bool wide = isa == "avx512" || isa == "amx" || bw_only;
  TORCH_CHECK(wide || isa == "avx2", "kernels.gemm: unknown isa ", isa);
  const int64_t m = x.size(0);
  // AMX serves a weight when its K and scale blocks fit whole tiles (a property of the weight,
  // never of the row count); other weights take the AVX-512 path.
  const bool amx = isa == "amx" && !f32 && kp % 32 == 0 && (fmt == FMT_BF16 || bk % 32 == 0);
  torch::Tensor xin;
  if (f32 || kp == k) {  // used in place (gemm_amx pads a last partial row tile itself)
    xin = x.contiguous();
  } else {  // odd K: a copy padded to KP written here, not by torch ops (a decode step makes ~130 of these calls)
    xin = torch::empty({m, kp}, x.options());
    const auto xc = x.contiguous();
    const auto* src = static_cast<const uint16_t*>(xc.data_ptr());
    auto* dst = static_cast<uint16_t*>(xin.data_ptr());
    for (int64_t r = 0; r < m; ++r) {
      std::memcpy(dst + r * kp, src + r * k, sizeof(uint16_t) * k);
      std::memset(dst + r * kp + k, 0, sizeof(uint16_t) * (kp - k));
    }
  }
  auto y = torch::empty({m, n}, x.options().dtype(out_f32 ? torch::kFloat32 : x.scalar_type()));
  if (m == 0 || n == 0) return y;
  if (k == 0) return y.zero_();
  TORCH_CHECK(cpu_has(isa == "amx" ? "amx" : (wide ? "avx512bf16" : "avx2")), "kernels.gemm: this CPU lacks ", isa);
  const int64_t nb = n_groups;
  GemmArgs base{static_cast<int>(fmt), xin.data_ptr(), w.data_ptr(), exps.numel() ? exps.data_ptr<uint8_t>() : nullptr,
                y.data_ptr(), m, n, k, kp, bk, 0, nb, group_exps ? 1 : 0, out_f32 && !f32 ? 1 : 0};
  at::parallel_for(0, (nb + 1) / 2, 1, [&](int64_t lo, int64_t hi) {
    GemmArgs a = base;
    a.nb0 = lo * 2;
    a.nb1 = std::min(hi * 2, nb);
    if (amx) gemm_amx(&a);
    else if (bw_only) gemm_avx512_bw(&a);
    else if (wide) gemm_avx512(&a);
    else gemm_avx2(&a);
  });
  return y;
}

torch::Tensor project_wide(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& exps, int64_t n,
                           int64_t k, c10::string_view isa, const c10::optional<torch::Tensor>& table,
                           const c10::optional<torch::Tensor>& positions, int64_t offset) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat32,
              "kernels.project_wide: x must be bf16 or fp32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2, "kernels.project_wide: x must be [M, K], got ", x.sizes());
  auto y = gemm(x.scalar_type() == torch::kFloat32 ? x : x.to(torch::kFloat32), w, exps, FMT_FP32, n, k, k, 0, isa, false);
  if (!table.has_value()) return y;
  TORCH_CHECK(positions.has_value(), "kernels.project_wide: a table needs positions");
  const auto& tb = *table;
  const auto& ps = *positions;
  check_rows(tb, "project_wide", "table", torch::kFloat32);
  TORCH_CHECK(tb.dim() == 2 && tb.size(0) >= 1 && offset >= 0 && offset + tb.size(1) <= n,
              "kernels.project_wide: table ", tb.sizes(), " at column ", offset, " does not fit ", n, " outputs");
  TORCH_CHECK(ps.device().is_cpu() && ps.scalar_type() == torch::kInt64 && ps.dim() == 1 && ps.size(0) == x.size(0) &&
              ps.is_contiguous(), "kernels.project_wide: positions must be [M] int64");
  const int64_t m = x.size(0), rows = tb.size(0), c = tb.size(1);
  const int64_t* pp = ps.data_ptr<int64_t>();
  const float* tp = tb.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t r = 0; r < m; ++r) {
    TORCH_CHECK(pp[r] >= 0, "kernels.project_wide: row ", r, " has position ", pp[r]);
    const float* add = tp + (pp[r] % rows) * c;
    float* out = yp + r * n + offset;
    for (int64_t j = 0; j < c; ++j) out[j] += add[j];
  }
  return y;
}

}  // namespace kvshare_kernels

TORCH_LIBRARY_FRAGMENT(kvshare, m) {
  m.def("cpu_has(str what) -> bool", &kvshare_kernels::cpu_has);
  m.def("gemm(Tensor x, Tensor w, Tensor exps, int fmt, int n, int k, int kp, int bk, str isa, bool out_f32) -> Tensor");
  m.def("project_wide(Tensor x, Tensor w, Tensor exps, int n, int k, str isa, Tensor? table, Tensor? positions, "
        "int offset) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvshare, CPU, m) {
  m.impl("gemm", &kvshare_kernels::gemm);
  m.impl("project_wide", &kvshare_kernels::project_wide);
}
