// The decode-step row kernels of decode.h as torch ops: RoPE, compressor pooling, sparse attention,
// RMSNorm, the MoE SwiGLU and combine. Each op checks its arguments, allocates its output and makes one
// call over all rows (decode.cpp's arithmetic; see decode.h for the orders).
#include <torch/extension.h>
#include "checks.h"
#include "decode.h"

namespace kvshare_kernels {
namespace {

void rope_into(const torch::Tensor& x, const torch::Tensor& c, const torch::Tensor& s, const torch::Tensor& out,
               const char* op) {
  check_stream_dtype(x, op, "x");
  check_rows(c, op, "c", torch::kFloat32);
  check_rows(s, op, "s", torch::kFloat32);
  TORCH_CHECK(x.dim() >= 1 && c.dim() == 2 && s.sizes() == c.sizes(), "kernels.", op, ": c and s must be [P, rd], got ",
              c.sizes(), " and ", s.sizes());
  const int64_t d = x.size(-1), p = c.size(0), rd = c.size(1);
  TORCH_CHECK(rd % 2 == 0 && rd <= d, "kernels.", op, ": rope dims ", rd, " must be even and <= the last dim ", d);
  TORCH_CHECK(p > 0 ? x.numel() % (p * d) == 0 && x.size(0) == p : x.numel() == 0,
              "kernels.", op, ": x ", x.sizes(), " does not start with the ", p, " positions of the tables");
  if (x.numel() == 0) return;
  rope(x.data_ptr(), is_bf16(x), c.data_ptr<float>(), s.data_ptr<float>(), p, x.numel() / (p * d), d, rd, out.data_ptr());
}

// RoPE on the last rd dims of x [P, ..., D] with tables c, s [P, rd] fp32 (decode.h).
torch::Tensor rope_op(const torch::Tensor& x, const torch::Tensor& c, const torch::Tensor& s) {
  auto out = torch::empty(x.sizes(), x.options());
  rope_into(x, c, s, out, "rope");
  return out;
}

// `rope` written over x.
void rope_inplace(const torch::Tensor& x, const torch::Tensor& c, const torch::Tensor& s) { rope_into(x, c, s, x, "rope_"); }

// Compressor pooling (decode.h) of hist [T, S, 2W] fp32 with an optional valid mask [T, S] (bool).
torch::Tensor compress_pool_op(const torch::Tensor& hist, const c10::optional<torch::Tensor>& valid, int64_t d,
                               bool overlap, at::ScalarType out_dtype) {
  check_rows(hist, "compress_pool", "hist", torch::kFloat32);
  const int64_t w = (overlap ? 2 : 1) * d;
  TORCH_CHECK(hist.dim() == 3 && hist.size(2) == 2 * w && d > 0, "kernels.compress_pool: hist must be [T, S, ", 2 * w,
              "], got ", hist.sizes());
  const int64_t t = hist.size(0), s = hist.size(1);
  TORCH_CHECK(s >= 1 && s <= 1024 && (!overlap || s % 2 == 0), "kernels.compress_pool: slots ", s,
              " must be in [1, 1024] (even with overlap)");
  TORCH_CHECK(out_dtype == torch::kBFloat16 || out_dtype == torch::kFloat32,
              "kernels.compress_pool: out dtype must be bf16 or fp32");
  const uint8_t* vp = nullptr;
  if (valid.has_value()) {
    check_rows(*valid, "compress_pool", "valid", torch::kBool);
    TORCH_CHECK(valid->dim() == 2 && valid->size(0) == t && valid->size(1) == s, "kernels.compress_pool: valid must be [",
                t, ", ", s, "], got ", valid->sizes());
    vp = reinterpret_cast<const uint8_t*>(valid->data_ptr<bool>());
  }
  auto out = torch::empty({t, d}, hist.options().dtype(out_dtype));
  compress_pool(hist.data_ptr<float>(), vp, t, s, d, overlap ? 1 : 0, out_dtype == torch::kBFloat16, out.data_ptr());
  return out;
}

// Sparse attention (decode.h): q [T, H, d]; keys ka [T, Ma, d] with va [T, Ma] (bool), optionally
// kb [T, Mb, d] with vb [T, Mb]; sink [H] fp32.
torch::Tensor sparse_attention_op(const torch::Tensor& q, const torch::Tensor& ka, const torch::Tensor& va,
                                  const c10::optional<torch::Tensor>& kb, const c10::optional<torch::Tensor>& vb,
                                  const torch::Tensor& sink, double scale) {
  constexpr const char* op = "sparse_attention";
  check_stream_dtype(q, op, "q");
  check_rows(ka, op, "ka", q.scalar_type());
  check_rows(va, op, "va", torch::kBool);
  check_rows(sink, op, "sink", torch::kFloat32);
  TORCH_CHECK(q.dim() == 3 && q.size(2) % 8 == 0 && q.size(2) <= 1024,
              "kernels.sparse_attention: q must be [T, H, d] with d a multiple of 8 up to 1024, got ", q.sizes());
  const int64_t t = q.size(0), h = q.size(1), d = q.size(2);
  TORCH_CHECK(ka.dim() == 3 && ka.size(0) == t && ka.size(2) == d && va.dim() == 2 && va.size(0) == t &&
              va.size(1) == ka.size(1), "kernels.sparse_attention: ka ", ka.sizes(), " / va ", va.sizes(),
              " do not fit q ", q.sizes());
  TORCH_CHECK(sink.numel() == h, "kernels.sparse_attention: sink has ", sink.numel(), " entries for ", h, " heads");
  TORCH_CHECK(kb.has_value() == vb.has_value(), "kernels.sparse_attention: kb and vb go together");
  int64_t mb = 0;
  const void* kbp = nullptr;
  const uint8_t* vbp = nullptr;
  if (kb.has_value()) {
    check_rows(*kb, op, "kb", q.scalar_type());
    check_rows(*vb, op, "vb", torch::kBool);
    TORCH_CHECK(kb->dim() == 3 && kb->size(0) == t && kb->size(2) == d && vb->dim() == 2 && vb->size(0) == t &&
                vb->size(1) == kb->size(1), "kernels.sparse_attention: kb ", kb->sizes(), " / vb ", vb->sizes(),
                " do not fit q ", q.sizes());
    mb = kb->size(1);
    kbp = kb->data_ptr();
    vbp = reinterpret_cast<const uint8_t*>(vb->data_ptr<bool>());
  }
  auto out = torch::empty(q.sizes(), q.options());
  if (t == 0 || h == 0) return out;
  sparse_attention(q.data_ptr(), ka.data_ptr(), reinterpret_cast<const uint8_t*>(va.data_ptr<bool>()), ka.size(1), kbp,
                   vbp, mb, sink.data_ptr<float>(), t, h, d, static_cast<float>(scale), is_bf16(q), out.data_ptr());
  return out;
}

// RMSNorm over the last dim of x (decode.h); weight [n] fp32 or None; out dtype bf16 / fp32.
torch::Tensor rms_norm_op(const torch::Tensor& x, const c10::optional<torch::Tensor>& weight, double eps,
                          at::ScalarType out_dtype) {
  check_stream_dtype(x, "rms_norm", "x");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0 && x.size(-1) <= (1 << 20),
              "kernels.rms_norm: x must have a last dim in [1, 2^20], got ", x.sizes());
  TORCH_CHECK(out_dtype == torch::kBFloat16 || out_dtype == torch::kFloat32,
              "kernels.rms_norm: out dtype must be bf16 or fp32");
  const int64_t n = x.size(-1);
  const float* wp = nullptr;
  if (weight.has_value()) {
    check_rows(*weight, "rms_norm", "weight", torch::kFloat32);
    TORCH_CHECK(weight->numel() == n, "kernels.rms_norm: weight has ", weight->numel(), " entries for rows of ", n);
    wp = weight->data_ptr<float>();
  }
  auto out = torch::empty(x.sizes(), x.options().dtype(out_dtype));
  if (x.numel() == 0) return out;
  rms_norm(x.data_ptr(), is_bf16(x), wp, x.numel() / n, n, static_cast<float>(eps), out_dtype == torch::kBFloat16,
           out.data_ptr());
  return out;
}

// MoE SwiGLU (decode.h): gate, up [N, I] (bf16 / fp32, same dtype), weight [N] fp32.
torch::Tensor swiglu_op(const torch::Tensor& gate, const torch::Tensor& up, const torch::Tensor& weight, double limit) {
  check_stream_dtype(gate, "swiglu", "gate");
  check_rows(up, "swiglu", "up", gate.scalar_type());
  check_rows(weight, "swiglu", "weight", torch::kFloat32);
  TORCH_CHECK(gate.dim() == 2 && up.sizes() == gate.sizes() && weight.numel() == gate.size(0),
              "kernels.swiglu: gate ", gate.sizes(), ", up ", up.sizes(), " and weight ", weight.sizes(), " do not fit");
  auto out = torch::empty(gate.sizes(), gate.options());
  swiglu(gate.data_ptr(), up.data_ptr(), is_bf16(gate), weight.data_ptr<float>(), gate.size(0), gate.size(1),
         static_cast<float>(limit), out.data_ptr());
  return out;
}

// MoE combine (decode.h): out [n_sel + T, D] expert outputs (routed rows, then the shared expert's),
// sel [n_sel] int64 the slot (t * k + j) of each routed row (n_sel == T * k).
torch::Tensor moe_combine_op(const torch::Tensor& out, const torch::Tensor& sel, int64_t t, int64_t k) {
  check_stream_dtype(out, "moe_combine", "out");
  check_rows(sel, "moe_combine", "sel", torch::kInt64);
  TORCH_CHECK(k >= 1 && t >= 0 && sel.numel() == t * k && out.dim() == 2 && out.size(0) == t * k + t,
              "kernels.moe_combine: out ", out.sizes(), " / sel ", sel.sizes(), " do not fit T = ", t, ", k = ", k);
  auto sp = sel.data_ptr<int64_t>();
  for (int64_t i = 0; i < t * k; ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < t * k, "kernels.moe_combine: sel holds slot ", sp[i], " outside [0, ", t * k, ")");
  auto y = torch::empty({t, out.size(1)}, out.options());
  moe_combine(out.data_ptr(), is_bf16(out), sp, t, k, out.size(1), t * k, y.data_ptr());
  return y;
}

}  // namespace
}  // namespace kvshare_kernels

TORCH_LIBRARY_FRAGMENT(kvshare, m) {
  m.def("rope(Tensor x, Tensor c, Tensor s) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor c, Tensor s) -> ()");
  m.def("compress_pool(Tensor hist, Tensor? valid, int d, bool overlap, ScalarType out_dtype) -> Tensor");
  m.def("sparse_attention(Tensor q, Tensor ka, Tensor va, Tensor? kb, Tensor? vb, Tensor sink, float scale) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor? weight, float eps, ScalarType out_dtype) -> Tensor");
  m.def("swiglu(Tensor gate, Tensor up, Tensor weight, float limit) -> Tensor");
  m.def("moe_combine(Tensor out, Tensor sel, int t, int k) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvshare, CPU, m) {
  namespace kk = kvshare_kernels;
  m.impl("rope", &kk::rope_op);
  m.impl("rope_", &kk::rope_inplace);
  m.impl("compress_pool", &kk::compress_pool_op);
  m.impl("sparse_attention", &kk::sparse_attention_op);
  m.impl("rms_norm", &kk::rms_norm_op);
  m.impl("swiglu", &kk::swiglu_op);
  m.impl("moe_combine", &kk::moe_combine_op);
}
