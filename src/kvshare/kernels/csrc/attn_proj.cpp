// Attention's input and output projections in one call each (see attn_proj.h). No arithmetic of
// its own: packed_gemm, decode.cpp's rms_norm / rope and fp8.h's FP8 rounding, in the torch
// path's order, so its bits.
#include "attn_proj.h"
#include "decode.h"
#include "packed_gemm.h"

namespace kvshare_kernels {
namespace {

constexpr const char* kIn = "kernels.attn_in";
constexpr const char* kOut = "kernels.attn_out";
constexpr const char* kIdx = "kernels.index_query";

// The set's linears (wq_a, wq_b, wkv, wo_a groups, wo_b), checked, each taking `bf16` activations
// or fp32 ones.
std::vector<PackedLin> linears(const PackSet& set, bool bf16, const char* who, int64_t at_least = 5) {
  const auto& meta = set.meta;
  TORCH_CHECK(meta.scalar_type() == torch::kInt64 && meta.is_contiguous() && meta.dim() == 2 &&
              meta.size(1) == PACKED_META && meta.size(0) >= at_least,
              who, ": meta must be int64 [>= ", at_least, ", ", PACKED_META, "], got ", meta.sizes());
  const int64_t n = meta.size(0);
  TORCH_CHECK(static_cast<int64_t>(set.packs.size()) == 2 * n, who, ": ", set.packs.size(), " pack tensors for ", n,
              " linears (expected ", 2 * n, ")");
  std::vector<PackedLin> lin(n);
  for (int64_t i = 0; i < n; ++i) {
    lin[i] = packed_lin(meta.data_ptr<int64_t>() + i * PACKED_META, set.packs[2 * i], set.packs[2 * i + 1], who, i);
    TORCH_CHECK((lin[i].fmt == FMT_FP32) == !bf16, who, ": linear ", i, " (format ", lin[i].fmt, ") does not take ",
                bf16 ? "bf16" : "fp32", " activations");
  }
  return lin;
}

// RoPE tables c, s [T, rd] fp32 for rows of d values: returns rd.
int64_t rope_dims(const torch::Tensor& c, const torch::Tensor& s, int64_t t, int64_t d, const char* who) {
  TORCH_CHECK(c.scalar_type() == torch::kFloat32 && s.scalar_type() == torch::kFloat32 && c.is_contiguous() &&
              s.is_contiguous() && c.device().is_cpu() && s.device().is_cpu(), who, ": RoPE tables must be contiguous fp32 CPU tensors");
  TORCH_CHECK(c.dim() == 2 && s.sizes() == c.sizes() && c.size(0) == t, who, ": RoPE tables must be [", t,
              ", rd], got ", c.sizes(), " and ", s.sizes());
  const int64_t rd = c.size(1);
  TORCH_CHECK(rd % 2 == 0 && rd >= 2 && rd <= d, who, ": rope dims ", rd, " must be even and in [2, ", d, "]");
  return rd;
}

void check_norm(const torch::Tensor& w, int64_t n, const char* name, const char* who) {
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 && w.is_contiguous() && w.device().is_cpu() && w.numel() == n,
              who, ": ", name, " must be a contiguous fp32 CPU tensor of ", n, " entries, got ", w.scalar_type(), " ",
              w.sizes());
}

void check_block(int64_t block, int64_t width, const char* name, const char* who) {
  TORCH_CHECK(block >= 0 && (block == 0 || width % block == 0), who, ": FP8 block ", block, " of ", name,
              " does not divide its width ", width);
}

// Rows r < T of x (row r's l.k values at x + (r * ld + off) elements) in the GEMM's layout: x itself
// when they already are, else a copy zero-padded to the staged width, kept alive by `holder`.
const void* staged_rows(const PackedLin& l, const void* x, int64_t ld, int64_t off, int64_t t,
                        const torch::TensorOptions& opt, torch::Tensor& holder) {
  const int64_t es = opt.dtype() == torch::kBFloat16 ? 2 : 4, width = staged_width(l);
  const char* src = static_cast<const char*>(x) + off * es;
  if (ld == l.k && width == l.k) return src;
  holder = torch::empty({t, width}, opt);
  char* dst = static_cast<char*>(holder.data_ptr());
  for (int64_t r = 0; r < t; ++r) {
    std::memcpy(dst + r * width * es, src + r * ld * es, l.k * es);
    if (width > l.k) std::memset(dst + (r * width + l.k) * es, 0, (width - l.k) * es);
  }
  return dst;
}

// y [T, l.n] = the rows of `staged_rows` times W^T.
torch::Tensor linear_rows(const PackedLin& l, const void* x, int64_t ld, int64_t off, int64_t t,
                          const torch::TensorOptions& opt, GemmPath path) {
  torch::Tensor holder;
  const void* rows = staged_rows(l, x, ld, off, t, opt, holder);
  auto y = torch::empty({t, l.n}, opt);
  packed_gemm(l, rows, t, y.data_ptr(), path);
  return y;
}

}  // namespace

c10::optional<std::vector<torch::Tensor>> attn_in(const torch::Tensor& x_in, const PackSet& set,
                                                  const torch::Tensor& q_norm_w, const torch::Tensor& kv_norm_w,
                                                  double eps, const torch::Tensor& c, const torch::Tensor& s,
                                                  int64_t heads, bool head_norm, int64_t x_block, int64_t qr_block,
                                                  const std::string& isa) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.dim() == 2 &&
              (x_in.scalar_type() == torch::kBFloat16 || x_in.scalar_type() == torch::kFloat32),
              kIn, ": x must be a bf16 / fp32 CPU tensor [T, D], got ", x_in.scalar_type(), " ", x_in.sizes());
  if (!set.fresh()) return c10::nullopt;
  const GemmPath path = gemm_path(isa, kIn);
  const bool bf16 = x_in.scalar_type() == torch::kBFloat16;
  const auto lin = linears(set, bf16, kIn);
  const PackedLin &wq_a = lin[0], &wq_b = lin[1], &wkv = lin[2];
  const auto x = x_in.contiguous();
  const int64_t t = x.size(0), dim = x.size(1), rank = wq_a.n, d = wkv.n;
  TORCH_CHECK(wq_a.k == dim && wkv.k == dim, kIn, ": wq_a / wkv take ", wq_a.k, " / ", wkv.k, " inputs, x has ", dim);
  TORCH_CHECK(heads >= 1 && wq_b.k == rank && wq_b.n == heads * d, kIn, ": wq_b is ", wq_b.n, " x ", wq_b.k,
              ", expected ", heads * d, " x ", rank, " (", heads, " heads of ", d, ")");
  check_norm(q_norm_w, rank, "q_norm weight", kIn);
  check_norm(kv_norm_w, d, "kv_norm weight", kIn);
  const int64_t rd = rope_dims(c, s, t, d, kIn);
  check_block(x_block, dim, "x", kIn);
  check_block(qr_block, rank, "qr", kIn);
  const auto opt = x.options();
  const auto xq = x_block ? fake_quant_fp8(x, x_block) : x;
  // wq_a and wkv read the same (rounded) rows, staged once (a weight's padding is fixed by its K)
  TORCH_CHECK(staged_width(wkv) == staged_width(wq_a), kIn, ": wq_a and wkv are padded differently");
  torch::Tensor holder;
  const void* xs = staged_rows(wq_a, xq.data_ptr(), dim, 0, t, opt, holder);
  auto qr = torch::empty({t, rank}, opt), kv = torch::empty({t, d}, opt);
  packed_gemm(wq_a, xs, t, qr.data_ptr(), path);
  packed_gemm(wkv, xs, t, kv.data_ptr(), path);
  rms_norm(qr.data_ptr(), bf16, q_norm_w.data_ptr<float>(), t, rank, static_cast<float>(eps), bf16, qr.data_ptr());
  const auto qrq = qr_block ? fake_quant_fp8(qr, qr_block) : qr;
  auto q = linear_rows(wq_b, qrq.data_ptr(), rank, 0, t, opt, path);
  if (head_norm) rms_norm(q.data_ptr(), bf16, nullptr, t * heads, d, static_cast<float>(eps), bf16, q.data_ptr());
  rope(q.data_ptr(), bf16, c.data_ptr<float>(), s.data_ptr<float>(), t, heads, d, rd, q.data_ptr());
  rms_norm(kv.data_ptr(), bf16, kv_norm_w.data_ptr<float>(), t, d, static_cast<float>(eps), bf16, kv.data_ptr());
  rope(kv.data_ptr(), bf16, c.data_ptr<float>(), s.data_ptr<float>(), t, 1, d, rd, kv.data_ptr());
  return std::vector<torch::Tensor>{qr, q.view({t, heads, d}), kv};
}

c10::optional<torch::Tensor> attn_out(const torch::Tensor& o, const PackSet& set, const torch::Tensor& c,
                                      const torch::Tensor& s, int64_t u_block, const std::string& isa) {
  TORCH_CHECK(o.device().is_cpu() && o.dim() == 3 && o.is_contiguous() &&
              (o.scalar_type() == torch::kBFloat16 || o.scalar_type() == torch::kFloat32),
              kOut, ": o must be a contiguous bf16 / fp32 CPU tensor [T, H, d], got ", o.scalar_type(), " ", o.sizes());
  if (!set.fresh()) return c10::nullopt;
  const GemmPath path = gemm_path(isa, kOut);
  const bool bf16 = o.scalar_type() == torch::kBFloat16;
  const auto lin = linears(set, bf16, kOut);
  const int64_t groups = static_cast<int64_t>(lin.size()) - 4;
  const PackedLin& wo_b = lin[3 + groups];
  const int64_t t = o.size(0), heads = o.size(1), d = o.size(2), width = heads * d;
  TORCH_CHECK(width % groups == 0, kOut, ": ", heads, " heads of ", d, " do not split into ", groups, " groups");
  const int64_t per_group = width / groups, rank = lin[3].n;
  for (int64_t g = 0; g < groups; ++g)
    TORCH_CHECK(lin[3 + g].k == per_group && lin[3 + g].n == rank, kOut, ": wo_a group ", g, " is ", lin[3 + g].n,
                " x ", lin[3 + g].k, ", expected ", rank, " x ", per_group);
  TORCH_CHECK(wo_b.k == groups * rank, kOut, ": wo_b takes ", wo_b.k, " inputs, the groups give ", groups * rank);
  const int64_t rd = rope_dims(c, s, t, d, kOut);
  check_block(u_block, groups * rank, "u", kOut);
  const auto opt = o.options();
  auto ro = torch::empty({t, heads, d}, opt);  // o rotated back (into a new tensor: the op mutates nothing)
  rope(o.data_ptr(), bf16, c.data_ptr<float>(), s.data_ptr<float>(), t, heads, d, rd, ro.data_ptr());
  auto u = torch::empty({t, groups * rank}, opt);
  const int64_t es = bf16 ? 2 : 4;
  for (int64_t g = 0; g < groups; ++g) {
    const auto part = linear_rows(lin[3 + g], ro.data_ptr(), width, g * per_group, t, opt, path);
    const char* src = static_cast<const char*>(part.data_ptr());
    char* dst = static_cast<char*>(u.data_ptr()) + g * rank * es;
    for (int64_t r = 0; r < t; ++r) std::memcpy(dst + r * groups * rank * es, src + r * rank * es, rank * es);
  }
  const auto uq = u_block ? fake_quant_fp8(u, u_block) : u;
  return linear_rows(wo_b, uq.data_ptr(), groups * rank, 0, t, opt, path);
}

c10::optional<std::vector<torch::Tensor>> index_query(const torch::Tensor& qr_in, const torch::Tensor& x_in,
                                                      const PackSet& set, const torch::Tensor& c, const torch::Tensor& s,
                                                      int64_t heads, double scale, int64_t qr_block, const std::string& isa) {
  for (const auto* t : {&qr_in, &x_in})
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 2 &&
                (t->scalar_type() == torch::kBFloat16 || t->scalar_type() == torch::kFloat32) &&
                t->scalar_type() == qr_in.scalar_type() && t->size(0) == qr_in.size(0),
                kIdx, ": qr and x must be bf16 / fp32 CPU tensors [T, .] of one dtype and T, got ", qr_in.sizes(), " ",
                qr_in.scalar_type(), " and ", x_in.sizes(), " ", x_in.scalar_type());
  if (!set.fresh()) return c10::nullopt;
  const GemmPath path = gemm_path(isa, kIdx);
  const bool bf16 = qr_in.scalar_type() == torch::kBFloat16;
  const auto lin = linears(set, bf16, kIdx, 2);
  TORCH_CHECK(lin.size() == 2, kIdx, ": the set must hold wq_b and weights_proj, got ", lin.size(), " linears");
  const PackedLin &wq_b = lin[0], &wp = lin[1];
  const auto qr = qr_in.contiguous(), x = x_in.contiguous();
  const int64_t t = qr.size(0), rank = qr.size(1), dim = x.size(1);
  TORCH_CHECK(heads >= 1 && wq_b.k == rank && wq_b.n % heads == 0, kIdx, ": wq_b is ", wq_b.n, " x ", wq_b.k,
              ", expected (", heads, " heads x d) x ", rank);
  TORCH_CHECK(wp.k == dim && wp.n == heads, kIdx, ": weights_proj is ", wp.n, " x ", wp.k, ", expected ", heads,
              " x ", dim);
  const int64_t d = wq_b.n / heads, rd = rope_dims(c, s, t, d, kIdx);
  check_block(qr_block, rank, "qr", kIdx);
  const auto opt = qr.options();
  const auto qrq = qr_block ? fake_quant_fp8(qr, qr_block) : qr;
  auto q = linear_rows(wq_b, qrq.data_ptr(), rank, 0, t, opt, path);
  rope(q.data_ptr(), bf16, c.data_ptr<float>(), s.data_ptr<float>(), t, heads, d, rd, q.data_ptr());
  // the torch path's wide(weights_proj(x)) * scale: the same conversion and scalar product
  auto w = linear_rows(wp, x.data_ptr(), dim, 0, t, opt, path).to(torch::kFloat32).mul_(scale);
  return std::vector<torch::Tensor>{q.view({t, heads, d}).to(torch::kFloat32), w};
}

}  // namespace kvshare_kernels

namespace kvshare_kernels {
namespace {

// The ops: `attn_in` / `attn_out` of a registered pack set (pack_set.h); an empty list when stale.
std::vector<torch::Tensor> attn_in_op(const torch::Tensor& x, int64_t set, const torch::Tensor& q_norm_w,
                                      const torch::Tensor& kv_norm_w, double eps, const torch::Tensor& c,
                                      const torch::Tensor& s, int64_t heads, bool head_norm, int64_t x_block,
                                      int64_t qr_block, c10::string_view isa) {
  const auto ps = pack_set_get(set, kIn);
  auto out = attn_in(x, *ps, q_norm_w, kv_norm_w, eps, c, s, heads, head_norm, x_block,
                     qr_block, std::string(isa));
  return out.has_value() ? *out : std::vector<torch::Tensor>{};
}

std::vector<torch::Tensor> attn_out_op(const torch::Tensor& o, int64_t set, const torch::Tensor& c, const torch::Tensor& s,
                                       int64_t u_block, int64_t out_dim, c10::string_view isa) {
  const auto ps = pack_set_get(set, kOut);
  auto y = attn_out(o, *ps, c, s, u_block, std::string(isa));
  if (!y.has_value()) return {};
  TORCH_CHECK(y->size(1) == out_dim, "kernels.attn_out: wo_b has ", y->size(1), " outputs, the call states ", out_dim);
  return {*y};
}

}  // namespace
}  // namespace kvshare_kernels

TORCH_LIBRARY_FRAGMENT(kvshare, m) {
  // set: a pack set (pack_set.h) of wq_a, wq_b, wkv, the wo_a groups and wo_b
  m.def("attn_in(Tensor x, int set, Tensor q_norm_w, Tensor kv_norm_w, float eps, Tensor c, Tensor s, int heads, "
        "bool head_norm, int x_block, int qr_block, str isa) -> Tensor[]");
  // out_dim (wo_b's outputs, checked) gives the result's width without reading `meta`
  m.def("attn_out(Tensor o, int set, Tensor c, Tensor s, int u_block, int out_dim, str isa) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(kvshare, CPU, m) {
  m.impl("attn_in", &kvshare_kernels::attn_in_op);
  m.impl("attn_out", &kvshare_kernels::attn_out_op);
}
