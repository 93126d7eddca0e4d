// mHC as torch ops: the unfused steps of decode.h (`mhc_post`, `sinkhorn_`, `mhc_collapse`, `mhc_expand`)
// and a sublayer's mHC in one call (mhc.h: `mhc_enter`, `mhc_boundary`, `mhc_leave`, `mhc_head`).
// Checks, outputs and scratch here; the work in decode.cpp / mhc.cpp.
#include <torch/extension.h>
#include <tuple>
#include "checks.h"
#include "decode.h"
#include "gemm_run.h"
#include "mhc.h"

namespace kvshare_kernels {
namespace {

using Tensor = torch::Tensor;
using OptTensor = c10::optional<torch::Tensor>;

// (pre [T, hc], post [T, hc], comb [T, hc, hc]) from the mixes m [T, >= (2 + hc) hc] fp32.
std::tuple<Tensor, Tensor, Tensor> mhc_post_op(const Tensor& m, const Tensor& base, const Tensor& scale, int64_t hc,
                                               double eps, int64_t iters) {
  check_rows(m, "mhc_post", "m", torch::kFloat32);
  check_rows(base, "mhc_post", "base", torch::kFloat32);
  check_rows(scale, "mhc_post", "scale", torch::kFloat32);
  TORCH_CHECK(hc >= 1 && hc <= 16, "kernels.mhc_post: hc must be in [1, 16], got ", hc);
  TORCH_CHECK(iters >= 1, "kernels.mhc_post: iters must be >= 1, got ", iters);
  TORCH_CHECK(m.dim() == 2 && m.size(1) >= (2 + hc) * hc, "kernels.mhc_post: m must be [T, ", (2 + hc) * hc, "], got ",
              m.sizes());
  TORCH_CHECK(base.numel() == (2 + hc) * hc && scale.numel() == 3, "kernels.mhc_post: base must have ", (2 + hc) * hc,
              " and scale 3 entries");
  const int64_t t = m.size(0);
  auto opt = m.options();
  auto pre = torch::empty({t, hc}, opt), post = torch::empty({t, hc}, opt), comb = torch::empty({t, hc, hc}, opt);
  mhc_post(m.data_ptr<float>(), t, m.size(1), base.data_ptr<float>(), scale.data_ptr<float>(), static_cast<int>(hc),
           static_cast<float>(eps), static_cast<int>(iters), pre.data_ptr<float>(), post.data_ptr<float>(),
           comb.data_ptr<float>());
  return {pre, post, comb};
}

// Sinkhorn divisions in place on comb [T, hc, hc] fp32.
void sinkhorn_op(const Tensor& comb, double eps, int64_t iters) {
  check_rows(comb, "sinkhorn_", "comb", torch::kFloat32);
  TORCH_CHECK(comb.dim() == 3 && comb.size(1) == comb.size(2) && comb.size(1) <= 16,
              "kernels.sinkhorn_: comb must be [T, hc, hc] with hc <= 16, got ", comb.sizes());
  TORCH_CHECK(iters >= 1, "kernels.sinkhorn_: iters must be >= 1, got ", iters);
  sinkhorn(comb.data_ptr<float>(), comb.size(0), static_cast<int>(comb.size(1)), static_cast<float>(eps),
           static_cast<int>(iters));
}

// x [T, D] in h's dtype = sum_j pre[:, j] h[:, j] for h [T, hc, D].
Tensor mhc_collapse_op(const Tensor& h, const Tensor& pre) {
  check_stream_dtype(h, "mhc_collapse", "h");
  check_rows(pre, "mhc_collapse", "pre", torch::kFloat32);
  TORCH_CHECK(h.dim() == 3 && h.size(1) <= 16 && pre.dim() == 2 && pre.size(0) == h.size(0) && pre.size(1) == h.size(1),
              "kernels.mhc_collapse: h [T, hc, D] and pre [T, hc] do not fit: ", h.sizes(), " and ", pre.sizes());
  auto out = torch::empty({h.size(0), h.size(2)}, h.options());
  mhc_collapse(h.data_ptr(), is_bf16(h), pre.data_ptr<float>(), h.size(0), static_cast<int>(h.size(1)), h.size(2),
               out.data_ptr());
  return out;
}

// h' [T, hc, D] = post_k y + sum_j comb[j, k] h_j, in h's dtype; errors name `op`.
Tensor expand(const Tensor& h, const Tensor& y, const Tensor& post, const Tensor& comb, const char* op) {
  check_stream_dtype(h, op, "h");
  check_rows(y, op, "y", h.scalar_type());
  check_rows(post, op, "post", torch::kFloat32);
  check_rows(comb, op, "comb", torch::kFloat32);
  TORCH_CHECK(h.dim() == 3, "kernels.", op, ": h must be [T, hc, D], got ", h.sizes());
  const int64_t t = h.size(0), hc = h.size(1), d = h.size(2);
  TORCH_CHECK(hc <= 16 && y.dim() == 2 && y.size(0) == t && y.size(1) == d && post.dim() == 2 && post.size(0) == t &&
              post.size(1) == hc && comb.dim() == 3 && comb.size(0) == t && comb.size(1) == hc && comb.size(2) == hc,
              "kernels.", op, ": shapes do not fit: h ", h.sizes(), ", y ", y.sizes(), ", post ", post.sizes(), ", comb ",
              comb.sizes());
  auto out = torch::empty(h.sizes(), h.options());
  mhc_expand(h.data_ptr(), y.data_ptr(), is_bf16(h), post.data_ptr<float>(), comb.data_ptr<float>(), t,
             static_cast<int>(hc), d, out.data_ptr());
  return out;
}

Tensor mhc_expand_op(const Tensor& h, const Tensor& y, const Tensor& post, const Tensor& comb) {
  return expand(h, y, post, comb, "mhc_expand");
}

// Leaving a block's last sublayer: `mhc_expand` of any-strided inputs (copied to contiguous here, not by
// torch calls in Python); y must have h's dtype.
Tensor mhc_leave_op(const Tensor& h, const Tensor& y, const Tensor& post, const Tensor& comb) {
  return expand(h.contiguous(), y.contiguous(), post.contiguous(), comb.contiguous(), "mhc_leave");
}

// The mix parameters as fp32 (bf16 ones widened: exact), checked against hc, D and the mix's n outputs;
// the tensors are kept here while the kernel reads them.
struct MhcArgs {
  Tensor base, scale, norm_w;
  MhcMix mix{};
  MhcNorm norm{};
};

void check_h(const char* op, const Tensor& h) {
  check_stream_dtype(h, op, "h");
  TORCH_CHECK(h.dim() == 3 && h.size(1) >= 1 && h.size(1) <= 16 && h.size(2) >= 8, "kernels.", op,
              ": h must be [T, hc, D] with hc in [1, 16] and D >= 8, got ", h.sizes());
}

void set_mix(MhcArgs& a, const char* op, const Tensor& h, const Tensor& fn, int64_t n, int64_t n_scale,
             const Tensor& base, const Tensor& scale, double rms_eps, double hc_eps, int64_t iters) {
  const int64_t k = h.size(1) * h.size(2);
  TORCH_CHECK(fn.device().is_cpu() && fn.is_contiguous() && fn.scalar_type() == torch::kFloat32 &&
              fn.numel() == (n + 15) / 16 * k * 16, "kernels.", op, ": fn must be the fp32 pack of a [", n, ", ", k,
              "] weight (", (n + 15) / 16 * k * 16, " floats), got ", fn.scalar_type(), " ", fn.sizes());
  TORCH_CHECK(iters >= 1, "kernels.", op, ": iters must be >= 1, got ", iters);
  a.base = base.to(torch::kFloat32).contiguous();
  a.scale = scale.to(torch::kFloat32).contiguous();
  TORCH_CHECK(a.base.device().is_cpu() && a.base.numel() == n, "kernels.", op, ": base must have ", n, " entries, got ",
              a.base.numel());
  TORCH_CHECK(a.scale.device().is_cpu() && a.scale.numel() == n_scale, "kernels.", op, ": scale must have ", n_scale,
              " entries, got ", a.scale.numel());
  a.mix = MhcMix{fn.data_ptr<float>(), n, a.base.data_ptr<float>(), a.scale.data_ptr<float>(), static_cast<float>(rms_eps),
                 static_cast<float>(hc_eps), static_cast<int>(iters)};
}

void set_norm(MhcArgs& a, const char* op, const Tensor& h, const Tensor& norm_w, double norm_eps) {
  a.norm_w = norm_w.to(torch::kFloat32).contiguous();
  TORCH_CHECK(a.norm_w.device().is_cpu() && a.norm_w.numel() == h.size(2), "kernels.", op, ": norm_w must have ",
              h.size(2), " entries, got ", a.norm_w.numel());
  a.norm = MhcNorm{a.norm_w.data_ptr<float>(), static_cast<float>(norm_eps)};
}

MhcArgs mix_args(const char* op, const Tensor& h, const Tensor& fn, const Tensor& base, const Tensor& scale,
                 const Tensor& norm_w, double norm_eps, double rms_eps, double hc_eps, int64_t iters) {
  check_h(op, h);
  MhcArgs a;
  const int64_t hc = h.size(1);
  set_mix(a, op, h, fn, (2 + hc) * hc, 3, base, scale, rms_eps, hc_eps, iters);
  set_norm(a, op, h, norm_w, norm_eps);
  return a;
}

int mhc_isa(c10::string_view isa, const char* op) {
  TORCH_CHECK(isa == "amx" || isa == "avx512" || isa == "avx2", "kernels.", op, ": unknown isa ", isa);
  TORCH_CHECK(cpu_has(isa == "avx2" ? "avx2" : "avx512bf16"), "kernels.", op, ": this CPU lacks ", isa);
  return isa == "avx2" ? MHC_AVX2 : MHC_AVX512;
}

const float* pre_arg(const OptTensor& pre, const Tensor& h, const char* op) {
  if (!pre.has_value()) return nullptr;
  check_rows(*pre, op, "collapse_pre", torch::kFloat32);
  TORCH_CHECK(pre->dim() == 2 && pre->size(0) == h.size(0) && pre->size(1) == h.size(1), "kernels.", op,
              ": collapse_pre must be [", h.size(0), ", ", h.size(1), "], got ", pre->sizes());
  return pre->data_ptr<float>();
}

// (x [T, D] in h's dtype, pre [T, hc], post [T, hc], comb [T, hc, hc]) of the sublayer entered from h [T, hc, D].
std::tuple<Tensor, Tensor, Tensor, Tensor> mhc_enter_op(const Tensor& h_in, const Tensor& fn, const Tensor& base,
                                                        const Tensor& scale, const OptTensor& collapse_pre,
                                                        const Tensor& norm_w, double norm_eps, double rms_eps,
                                                        double hc_eps, int64_t iters, c10::string_view isa) {
  const auto h = h_in.contiguous();
  const auto a = mix_args("mhc_enter", h, fn, base, scale, norm_w, norm_eps, rms_eps, hc_eps, iters);
  const float* cp = pre_arg(collapse_pre, h, "mhc_enter");
  const int path = mhc_isa(isa, "mhc_enter");
  const int64_t t = h.size(0), hc = h.size(1), d = h.size(2);
  auto f32 = h.options().dtype(torch::kFloat32);
  auto x = torch::empty({t, d}, h.options());
  auto pre = torch::empty({t, hc}, f32), post = torch::empty({t, hc}, f32), comb = torch::empty({t, hc, hc}, f32);
  if (t == 0) return {x, pre, post, comb};
  auto scratch = torch::empty({mhc_scratch_floats(t, static_cast<int>(hc), d, a.mix.n)}, f32);
  mhc_enter(h.data_ptr(), is_bf16(h), t, static_cast<int>(hc), d, a.mix, cp, a.norm, path, scratch.data_ptr<float>(),
            pre.data_ptr<float>(), post.data_ptr<float>(), comb.data_ptr<float>(), x.data_ptr());
  return {x, pre, post, comb};
}

// (streams hn [T, hc, D] = expand(h, y, post, comb), then mhc_enter's four outputs on hn).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> mhc_boundary_op(
    const Tensor& h_in, const Tensor& y_in, const Tensor& post_in, const Tensor& comb_in, const Tensor& fn,
    const Tensor& base, const Tensor& scale, const OptTensor& collapse_pre, const Tensor& norm_w, double norm_eps,
    double rms_eps, double hc_eps, int64_t iters, c10::string_view isa) {
  constexpr const char* op = "mhc_boundary";
  const auto h = h_in.contiguous();
  const auto a = mix_args(op, h, fn, base, scale, norm_w, norm_eps, rms_eps, hc_eps, iters);
  const float* cp = pre_arg(collapse_pre, h, op);
  const int path = mhc_isa(isa, op);
  const int64_t t = h.size(0), hc = h.size(1), d = h.size(2);
  const auto y = y_in.contiguous();
  check_rows(y, op, "y", h.scalar_type());
  check_rows(post_in, op, "post", torch::kFloat32);
  check_rows(comb_in, op, "comb", torch::kFloat32);
  TORCH_CHECK(y.dim() == 2 && y.size(0) == t && y.size(1) == d && post_in.dim() == 2 && post_in.size(0) == t &&
              post_in.size(1) == hc && comb_in.dim() == 3 && comb_in.size(0) == t && comb_in.size(1) == hc &&
              comb_in.size(2) == hc, "kernels.mhc_boundary: shapes do not fit: h ", h.sizes(), ", y ", y.sizes(),
              ", post ", post_in.sizes(), ", comb ", comb_in.sizes());
  auto f32 = h.options().dtype(torch::kFloat32);
  auto hn = torch::empty(h.sizes(), h.options());
  auto x = torch::empty({t, d}, h.options());
  auto pre = torch::empty({t, hc}, f32), post = torch::empty({t, hc}, f32), comb = torch::empty({t, hc, hc}, f32);
  if (t == 0) return {hn, x, pre, post, comb};
  auto scratch = torch::empty({mhc_scratch_floats(t, static_cast<int>(hc), d, a.mix.n)}, f32);
  mhc_boundary(h.data_ptr(), y.data_ptr(), post_in.data_ptr<float>(), comb_in.data_ptr<float>(), is_bf16(h), t,
               static_cast<int>(hc), d, a.mix, cp, a.norm, path, scratch.data_ptr<float>(), hn.data_ptr(),
               pre.data_ptr<float>(), post.data_ptr<float>(), comb.data_ptr<float>(), x.data_ptr());
  return {hn, x, pre, post, comb};
}

// The model's tail: x [T, D] = norm(collapse(h, pre)) with pre from V4's head mixes (fn [hc, hc D] packed,
// base [hc], scale [1]) or, without fn, the given pre [T, hc] (V4.1).
Tensor mhc_head_op(const Tensor& h_in, const OptTensor& fn, const OptTensor& base, const OptTensor& scale,
                   const OptTensor& pre_in, const Tensor& norm_w, double norm_eps, double rms_eps, double hc_eps,
                   c10::string_view isa) {
  constexpr const char* op = "mhc_head";
  const auto h = h_in.contiguous();
  TORCH_CHECK(fn.has_value() != pre_in.has_value() && fn.has_value() == base.has_value() &&
              fn.has_value() == scale.has_value(), "kernels.mhc_head: give either fn, base and scale (V4) or pre (V4.1)");
  check_h(op, h);
  const int64_t hc = h.size(1), t = h.size(0), d = h.size(2);
  MhcArgs a;
  if (fn.has_value()) set_mix(a, op, h, *fn, hc, 1, *base, *scale, rms_eps, hc_eps, 1);
  set_norm(a, op, h, norm_w, norm_eps);
  const int path = mhc_isa(isa, op);
  Tensor pre;
  if (pre_in.has_value()) {
    pre_arg(pre_in, h, op);
    pre = *pre_in;
  } else {
    pre = torch::empty({t, hc}, h.options().dtype(torch::kFloat32));
  }
  auto x = torch::empty({t, d}, h.options());
  if (t == 0) return x;
  auto scratch = torch::empty({mhc_scratch_floats(t, static_cast<int>(hc), d, hc)}, h.options().dtype(torch::kFloat32));
  mhc_head(h.data_ptr(), is_bf16(h), t, static_cast<int>(hc), d, fn.has_value() ? &a.mix : nullptr, pre.data_ptr<float>(),
           a.norm, path, scratch.data_ptr<float>(), x.data_ptr());
  return x;
}

}  // namespace
}  // namespace kvshare_kernels

TORCH_LIBRARY_FRAGMENT(kvshare, m) {
  m.def("mhc_post(Tensor m, Tensor base, Tensor scale, int hc, float eps, int iters) -> (Tensor, Tensor, Tensor)");
  m.def("sinkhorn_(Tensor(a!) comb, float eps, int iters) -> ()");
  m.def("mhc_collapse(Tensor h, Tensor pre) -> Tensor");
  m.def("mhc_expand(Tensor h, Tensor y, Tensor post, Tensor comb) -> Tensor");
  m.def("mhc_leave(Tensor h, Tensor y, Tensor post, Tensor comb) -> Tensor");
  m.def("mhc_enter(Tensor h, Tensor fn, Tensor base, Tensor scale, Tensor? collapse_pre, Tensor norm_w, float norm_eps, "
        "float rms_eps, float hc_eps, int iters, str isa) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("mhc_boundary(Tensor h, Tensor y, Tensor post, Tensor comb, Tensor fn, Tensor base, Tensor scale, "
        "Tensor? collapse_pre, Tensor norm_w, float norm_eps, float rms_eps, float hc_eps, int iters, str isa) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("mhc_head(Tensor h, Tensor? fn, Tensor? base, Tensor? scale, Tensor? pre, Tensor norm_w, float norm_eps, "
        "float rms_eps, float hc_eps, str isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvshare, CPU, m) {
  namespace kk = kvshare_kernels;
  m.impl("mhc_post", &kk::mhc_post_op);
  m.impl("sinkhorn_", &kk::sinkhorn_op);
  m.impl("mhc_collapse", &kk::mhc_collapse_op);
  m.impl("mhc_expand", &kk::mhc_expand_op);
  m.impl("mhc_leave", &kk::mhc_leave_op);
  m.impl("mhc_enter", &kk::mhc_enter_op);
  m.impl("mhc_boundary", &kk::mhc_boundary_op);
  m.impl("mhc_head", &kk::mhc_head_op);
}
