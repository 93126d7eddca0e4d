// Torch binding: argument checks, activation padding, and the split of output groups over threads
// (each output element is computed by exactly one thread, so the thread count changes no bit).
#include <torch/extension.h>
#include <c10/util/Float8_e4m3fn.h>
#include <cmath>
#include <limits>
#include <vector>
#include <ATen/Parallel.h>
#include "gemm.h"
#include "decode.h"
#include "rows.h"

namespace kk = kvshare_kernels;

static bool cpu_has(const char* what) {
  __builtin_cpu_init();
  if (std::string(what) == "avx512bf16")
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512bf16");
  if (std::string(what) == "amx") {
    static const bool ok = cpu_has("avx512bf16") && __builtin_cpu_supports("amx-tile") &&
                           __builtin_cpu_supports("amx-bf16") && kk::amx_enable();
    return ok;
  }
  if (std::string(what) == "avx2")
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return false;
}

// x: [M, K] bf16 (FP32 format: fp32); w / exps: the packed layout of gemm.h; isa: "avx512" | "avx2".
// out_f32: return the fp32 totals instead of bf16 (bf16-activation formats; for tests).
static torch::Tensor gemm(torch::Tensor x, torch::Tensor w, torch::Tensor exps, int64_t fmt, int64_t n,
                          int64_t k, int64_t kp, int64_t bk, const std::string& isa, bool out_f32) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "kernels.gemm: x must be [M, ", k, "], got ", x.sizes());
  TORCH_CHECK(w.is_contiguous() && exps.is_contiguous(), "kernels.gemm: packed weight must be contiguous");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "kernels.gemm: CPU tensors only");
  const bool f32 = fmt == kk::FMT_FP32;
  TORCH_CHECK(x.scalar_type() == (f32 ? torch::kFloat32 : torch::kBFloat16),
              "kernels.gemm: activation dtype ", x.scalar_type(), " does not fit format ", fmt);
  TORCH_CHECK(fmt >= 0 && fmt <= 3, "kernels.gemm: unknown format ", fmt);
  TORCH_CHECK(f32 || (kp % 2 == 0 && kp >= k && kp - k < 2), "kernels.gemm: bad padded K ", kp);
  TORCH_CHECK(fmt == kk::FMT_BF16 || f32 || (bk >= 2 && bk <= 256 && bk % 2 == 0),
              "kernels.gemm: bad scale block ", bk);
  const int64_t n_groups = (n + 15) / 16;
  const int64_t w_bytes = f32 ? n_groups * k * 16 * 4 : n_groups * (kp / 2) * 16 * (fmt == kk::FMT_FP8 ? 2 : 4) / (fmt == kk::FMT_FP4 ? 4 : 1);
  TORCH_CHECK(w.numel() * w.element_size() == w_bytes, "kernels.gemm: packed weight has ", w.numel() * w.element_size(),
              " bytes, expected ", w_bytes);
  const int64_t n_exps = (fmt == kk::FMT_BF16 || f32) ? 0 : n_groups * ((kp + bk - 1) / bk);
  const bool group_exps = fmt == kk::FMT_FP8 && exps.numel() == n_exps;
  TORCH_CHECK(fmt == kk::FMT_BF16 || f32 || group_exps || exps.numel() == n_exps * 16,
              "kernels.gemm: scale exponents have ", exps.numel(), " entries");
  const int64_t m = x.size(0);
  // AMX serves a weight when its K and scale blocks fit whole tiles (a property of the weight,
  // never of the row count); other weights take the AVX-512 path.
  const bool amx = isa == "amx" && !f32 && kp % 32 == 0 && (fmt == kk::FMT_BF16 || bk % 32 == 0);
  torch::Tensor xin;
  if (f32 || kp == k) {  // used in place (gemm_amx pads a last partial row tile itself)
    xin = x.contiguous();
  } else {  // odd K: a copy padded to KP written here, not by torch ops (a decode step makes ~130 of these calls)
    xin = torch::empty({m, kp}, x.options());
    const auto xc = x.contiguous();
    const auto* src = static_cast<const uint16_t*>(xc.data_ptr());
    auto* dst = static_cast<uint16_t*>(xin.data_ptr());
    for (int64_t r = 0; r < m; ++r) {
      memcpy(dst + r * kp, src + r * k, sizeof(uint16_t) * k);
      memset(dst + r * kp + k, 0, sizeof(uint16_t) * (kp - k));
    }
  }
  auto y = torch::empty({m, n}, x.options().dtype(out_f32 ? torch::kFloat32 : x.scalar_type()));
  if (m == 0 || n == 0) return y;
  if (k == 0) return y.zero_();
  const bool wide = isa == "avx512" || isa == "amx";
  TORCH_CHECK(wide || isa == "avx2", "kernels.gemm: unknown isa ", isa);
  TORCH_CHECK(cpu_has(isa == "amx" ? "amx" : (wide ? "avx512bf16" : "avx2")), "kernels.gemm: this CPU lacks ", isa);
  const int64_t nb = (n + 15) / 16;
  kk::GemmArgs base{static_cast<int>(fmt), xin.data_ptr(), w.data_ptr(),
                    exps.numel() ? exps.data_ptr<uint8_t>() : nullptr, y.data_ptr(), m, n, k, kp, bk, 0, nb, group_exps ? 1 : 0, out_f32 && !f32 ? 1 : 0};
  at::parallel_for(0, (nb + 1) / 2, 1, [&](int64_t lo, int64_t hi) {
    kk::GemmArgs a = base;
    a.nb0 = lo * 2;
    a.nb1 = std::min(hi * 2, nb);
    if (amx) kk::gemm_amx(&a);
    else if (wide) kk::gemm_avx512(&a);
    else kk::gemm_avx2(&a);
  });
  return y;
}

// ---- decode-step kernels (decode.h): thin checks, then one call over all rows ----
static void check_rows(const torch::Tensor& t, const char* name, torch::ScalarType want) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "kernels.decode: ", name, " must be a contiguous CPU tensor");
  TORCH_CHECK(t.scalar_type() == want, "kernels.decode: ", name, " has dtype ", t.scalar_type(), ", expected ", want);
}

static void check_stream_dtype(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "kernels.decode: ", name, " must be a contiguous CPU tensor");
  TORCH_CHECK(t.scalar_type() == torch::kBFloat16 || t.scalar_type() == torch::kFloat32,
              "kernels.decode: ", name, " must be bf16 or fp32, got ", t.scalar_type());
}

// (pre [T, hc], post [T, hc], comb [T, hc, hc]) from the mixes m [T, >= (2 + hc) hc] fp32.
static std::vector<torch::Tensor> mhc_post(torch::Tensor m, torch::Tensor base, torch::Tensor scale, int64_t hc,
                                           double eps, int64_t iters) {
  check_rows(m, "m", torch::kFloat32);
  check_rows(base, "base", torch::kFloat32);
  check_rows(scale, "scale", torch::kFloat32);
  TORCH_CHECK(hc >= 1 && hc <= 16, "kernels.mhc_post: hc must be in [1, 16], got ", hc);
  TORCH_CHECK(iters >= 1, "kernels.mhc_post: iters must be >= 1, got ", iters);
  TORCH_CHECK(m.dim() == 2 && m.size(1) >= (2 + hc) * hc, "kernels.mhc_post: m must be [T, ", (2 + hc) * hc, "], got ", m.sizes());
  TORCH_CHECK(base.numel() == (2 + hc) * hc && scale.numel() == 3, "kernels.mhc_post: base must have ",
              (2 + hc) * hc, " and scale 3 entries");
  const int64_t t = m.size(0);
  auto opt = m.options();
  auto pre = torch::empty({t, hc}, opt), post = torch::empty({t, hc}, opt), comb = torch::empty({t, hc, hc}, opt);
  kk::mhc_post(m.data_ptr<float>(), t, m.size(1), base.data_ptr<float>(), scale.data_ptr<float>(), static_cast<int>(hc),
               static_cast<float>(eps), static_cast<int>(iters), pre.data_ptr<float>(), post.data_ptr<float>(),
               comb.data_ptr<float>());
  return {pre, post, comb};
}

// Sinkhorn divisions in place on comb [T, hc, hc] fp32.
static void sinkhorn_(torch::Tensor comb, double eps, int64_t iters) {
  check_rows(comb, "comb", torch::kFloat32);
  TORCH_CHECK(comb.dim() == 3 && comb.size(1) == comb.size(2) && comb.size(1) <= 16,
              "kernels.sinkhorn_: comb must be [T, hc, hc] with hc <= 16, got ", comb.sizes());
  kk::sinkhorn(comb.data_ptr<float>(), comb.size(0), static_cast<int>(comb.size(1)), static_cast<float>(eps),
               static_cast<int>(iters));
}

// x [T, D] in h's dtype = sum_j pre[:, j] h[:, j] for h [T, hc, D].
static torch::Tensor mhc_collapse(torch::Tensor h, torch::Tensor pre) {
  check_stream_dtype(h, "h");
  check_rows(pre, "pre", torch::kFloat32);
  TORCH_CHECK(h.dim() == 3 && h.size(1) <= 16 && pre.dim() == 2 && pre.size(0) == h.size(0) && pre.size(1) == h.size(1),
              "kernels.mhc_collapse: h [T, hc, D] and pre [T, hc] do not fit: ", h.sizes(), " and ", pre.sizes());
  auto out = torch::empty({h.size(0), h.size(2)}, h.options());
  kk::mhc_collapse(h.data_ptr(), h.scalar_type() == torch::kBFloat16, pre.data_ptr<float>(), h.size(0),
                   static_cast<int>(h.size(1)), h.size(2), out.data_ptr());
  return out;
}

// h' [T, hc, D] = post_k y + sum_j comb[j, k] h_j, in h's dtype.
static torch::Tensor mhc_expand(torch::Tensor h, torch::Tensor y, torch::Tensor post, torch::Tensor comb) {
  check_stream_dtype(h, "h");
  check_rows(y, "y", h.scalar_type());
  check_rows(post, "post", torch::kFloat32);
  check_rows(comb, "comb", torch::kFloat32);
  const int64_t t = h.size(0), hc = h.size(1), d = h.size(2);
  TORCH_CHECK(h.dim() == 3 && hc <= 16 && y.dim() == 2 && y.size(0) == t && y.size(1) == d && post.dim() == 2 &&
              post.size(0) == t && post.size(1) == hc && comb.dim() == 3 && comb.size(0) == t && comb.size(1) == hc &&
              comb.size(2) == hc, "kernels.mhc_expand: shapes do not fit: h ", h.sizes(), ", y ", y.sizes(), ", post ",
              post.sizes(), ", comb ", comb.sizes());
  auto out = torch::empty_like(h);
  kk::mhc_expand(h.data_ptr(), y.data_ptr(), h.scalar_type() == torch::kBFloat16, post.data_ptr<float>(),
                 comb.data_ptr<float>(), t, static_cast<int>(hc), d, out.data_ptr());
  return out;
}

// RoPE on the last rd dims of x [P, ..., D] with tables c, s [P, rd] fp32 (decode.h); in place when asked.
static torch::Tensor rope(torch::Tensor x, torch::Tensor c, torch::Tensor s, bool inplace) {
  check_stream_dtype(x, "x");
  check_rows(c, "c", torch::kFloat32);
  check_rows(s, "s", torch::kFloat32);
  TORCH_CHECK(x.dim() >= 1 && c.dim() == 2 && s.sizes() == c.sizes(), "kernels.rope: c and s must be [P, rd], got ",
              c.sizes(), " and ", s.sizes());
  const int64_t d = x.size(-1), p = c.size(0), rd = c.size(1);
  TORCH_CHECK(rd % 2 == 0 && rd <= d, "kernels.rope: rope dims ", rd, " must be even and <= the last dim ", d);
  TORCH_CHECK(p > 0 ? x.numel() % (p * d) == 0 && x.size(0) == p : x.numel() == 0,
              "kernels.rope: x ", x.sizes(), " does not start with the ", p, " positions of the tables");
  auto out = inplace ? x : torch::empty_like(x);
  if (x.numel() == 0) return out;
  kk::rope(x.data_ptr(), x.scalar_type() == torch::kBFloat16, c.data_ptr<float>(), s.data_ptr<float>(), p,
           x.numel() / (p * d), d, rd, out.data_ptr());
  return out;
}

// Compressor pooling (decode.h) of hist [T, S, 2W] fp32 with an optional valid mask [T, S] (bool).
static torch::Tensor compress_pool(torch::Tensor hist, c10::optional<torch::Tensor> valid, int64_t d, bool overlap,
                                   torch::ScalarType out_dtype) {
  check_rows(hist, "hist", torch::kFloat32);
  const int64_t w = (overlap ? 2 : 1) * d;
  TORCH_CHECK(hist.dim() == 3 && hist.size(2) == 2 * w && d > 0, "kernels.compress_pool: hist must be [T, S, ", 2 * w,
              "], got ", hist.sizes());
  const int64_t t = hist.size(0), s = hist.size(1);
  TORCH_CHECK(s >= 1 && s <= 1024 && (!overlap || s % 2 == 0), "kernels.compress_pool: slots ", s,
              " must be in [1, 1024] (even with overlap)");
  TORCH_CHECK(out_dtype == torch::kBFloat16 || out_dtype == torch::kFloat32, "kernels.compress_pool: out dtype must be bf16 or fp32");
  const uint8_t* vp = nullptr;
  if (valid.has_value()) {
    check_rows(*valid, "valid", torch::kBool);
    TORCH_CHECK(valid->dim() == 2 && valid->size(0) == t && valid->size(1) == s, "kernels.compress_pool: valid must be [",
                t, ", ", s, "], got ", valid->sizes());
    vp = reinterpret_cast<const uint8_t*>(valid->data_ptr<bool>());
  }
  auto out = torch::empty({t, d}, hist.options().dtype(out_dtype));
  kk::compress_pool(hist.data_ptr<float>(), vp, t, s, d, overlap ? 1 : 0, out_dtype == torch::kBFloat16, out.data_ptr());
  return out;
}

// Sparse attention (decode.h): q [T, H, d]; keys ka [T, Ma, d] with va [T, Ma] (bool), optionally
// kb [T, Mb, d] with vb [T, Mb]; sink [H] fp32.
static torch::Tensor sparse_attention(torch::Tensor q, torch::Tensor ka, torch::Tensor va, c10::optional<torch::Tensor> kb,
                                      c10::optional<torch::Tensor> vb, torch::Tensor sink, double scale) {
  check_stream_dtype(q, "q");
  check_rows(ka, "ka", q.scalar_type());
  check_rows(va, "va", torch::kBool);
  check_rows(sink, "sink", torch::kFloat32);
  TORCH_CHECK(q.dim() == 3 && q.size(2) % 8 == 0 && q.size(2) <= 1024, "kernels.sparse_attention: q must be [T, H, d] with d a multiple of 8 up to 1024, got ", q.sizes());
  const int64_t t = q.size(0), h = q.size(1), d = q.size(2);
  TORCH_CHECK(ka.dim() == 3 && ka.size(0) == t && ka.size(2) == d && va.dim() == 2 && va.size(0) == t &&
              va.size(1) == ka.size(1), "kernels.sparse_attention: ka ", ka.sizes(), " / va ", va.sizes(), " do not fit q ", q.sizes());
  TORCH_CHECK(sink.numel() == h, "kernels.sparse_attention: sink has ", sink.numel(), " entries for ", h, " heads");
  TORCH_CHECK(kb.has_value() == vb.has_value(), "kernels.sparse_attention: kb and vb go together");
  int64_t mb = 0;
  const void* kbp = nullptr;
  const uint8_t* vbp = nullptr;
  if (kb.has_value()) {
    check_rows(*kb, "kb", q.scalar_type());
    check_rows(*vb, "vb", torch::kBool);
    TORCH_CHECK(kb->dim() == 3 && kb->size(0) == t && kb->size(2) == d && vb->dim() == 2 && vb->size(0) == t &&
                vb->size(1) == kb->size(1), "kernels.sparse_attention: kb ", kb->sizes(), " / vb ", vb->sizes(), " do not fit q ", q.sizes());
    mb = kb->size(1);
    kbp = kb->data_ptr();
    vbp = reinterpret_cast<const uint8_t*>(vb->data_ptr<bool>());
  }
  auto out = torch::empty_like(q);
  if (t == 0 || h == 0) return out;
  kk::sparse_attention(q.data_ptr(), ka.data_ptr(), reinterpret_cast<const uint8_t*>(va.data_ptr<bool>()), ka.size(1),
                       kbp, vbp, mb, sink.data_ptr<float>(), t, h, d, static_cast<float>(scale),
                       q.scalar_type() == torch::kBFloat16, out.data_ptr());
  return out;
}

// FP8 e4m3 quantise-dequantise with ue8m0 (power-of-two) scales per `block` values of the last dim,
// the same bits as kvshare.quant.fake_quant_fp8(x, block, ue8m0=True): amax of the block (fp32),
// clamp_min(1e-4), / 448, scale = 2^ceil(log2) from frexp, x / scale clamped to +-448, rounded to
// e4m3 by c10's conversion (torch's), times scale in fp32, rounded to x's dtype (bf16: RNE, as torch).
// A block holding a NaN gives NaN (as torch's amax would spread it).
static torch::Tensor fake_quant_fp8(torch::Tensor x, int64_t block) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat32),
              "kernels.fake_quant_fp8: x must be a bf16 / fp32 CPU tensor, got ", x.scalar_type(), " on ", x.device());
  TORCH_CHECK(block > 0 && x.dim() >= 1 && x.size(-1) % block == 0,
              "kernels.fake_quant_fp8: last dim ", x.dim() ? x.size(-1) : 0, " is not a multiple of the block ", block);
  auto xc = x.contiguous();
  auto out = torch::empty_like(xc);
  const int64_t nb = xc.numel() / block;
  const bool bf = xc.scalar_type() == torch::kBFloat16;
  const auto* xb = bf ? reinterpret_cast<const c10::BFloat16*>(xc.data_ptr()) : nullptr;
  const float* xf = bf ? nullptr : xc.data_ptr<float>();
  auto* ob = bf ? reinterpret_cast<c10::BFloat16*>(out.data_ptr()) : nullptr;
  float* of = bf ? nullptr : out.data_ptr<float>();
  std::vector<float> v(static_cast<size_t>(block));
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t o = b * block;
    float amax = 0.0f;
    bool nan = false;
    for (int64_t i = 0; i < block; ++i) {
      const float a = bf ? static_cast<float>(xb[o + i]) : xf[o + i];
      v[i] = a;
      nan |= std::isnan(a);
      amax = std::max(amax, std::fabs(a));
    }
    if (nan) amax = std::numeric_limits<float>::quiet_NaN();
    amax = std::isnan(amax) ? amax : std::max(amax, 1e-4f);
    const float s = amax / 448.0f;
    int e = 0;
    const float m = std::frexp(s, &e);
    const float scale = m == 0.5f ? s : std::ldexp(1.0f, e);
    for (int64_t i = 0; i < block; ++i) {
      float q = v[i] / scale;
      if (!std::isnan(q)) q = std::min(std::max(q, -448.0f), 448.0f);
      const float d = static_cast<float>(c10::Float8_e4m3fn(q)) * scale;
      if (bf) ob[o + i] = c10::BFloat16(d); else of[o + i] = d;
    }
  }
  return out;
}

// RMSNorm over the last dim of x (decode.h); weight [n] fp32 or None; out dtype bf16 / fp32.
static torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> weight, double eps, torch::ScalarType out_dtype) {
  check_stream_dtype(x, "x");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0 && x.size(-1) <= (1 << 20), "kernels.rms_norm: x must have a last dim in [1, 2^20], got ", x.sizes());
  TORCH_CHECK(out_dtype == torch::kBFloat16 || out_dtype == torch::kFloat32, "kernels.rms_norm: out dtype must be bf16 or fp32");
  const int64_t n = x.size(-1);
  const float* wp = nullptr;
  if (weight.has_value()) {
    check_rows(*weight, "weight", torch::kFloat32);
    TORCH_CHECK(weight->numel() == n, "kernels.rms_norm: weight has ", weight->numel(), " entries for rows of ", n);
    wp = weight->data_ptr<float>();
  }
  auto out = torch::empty(x.sizes(), x.options().dtype(out_dtype));
  if (x.numel() == 0) return out;
  kk::rms_norm(x.data_ptr(), x.scalar_type() == torch::kBFloat16, wp, x.numel() / n, n, static_cast<float>(eps),
               out_dtype == torch::kBFloat16, out.data_ptr());
  return out;
}

// MoE SwiGLU (decode.h): gate, up [N, I] (bf16 / fp32, same dtype), weight [N] fp32.
static torch::Tensor swiglu(torch::Tensor gate, torch::Tensor up, torch::Tensor weight, double limit) {
  check_stream_dtype(gate, "gate");
  check_rows(up, "up", gate.scalar_type());
  check_rows(weight, "weight", torch::kFloat32);
  TORCH_CHECK(gate.dim() == 2 && up.sizes() == gate.sizes() && weight.numel() == gate.size(0),
              "kernels.swiglu: gate ", gate.sizes(), ", up ", up.sizes(), " and weight ", weight.sizes(), " do not fit");
  auto out = torch::empty_like(gate);
  kk::swiglu(gate.data_ptr(), up.data_ptr(), gate.scalar_type() == torch::kBFloat16, weight.data_ptr<float>(),
             gate.size(0), gate.size(1), static_cast<float>(limit), out.data_ptr());
  return out;
}

// MoE combine (decode.h): out [n_sel + T, D] expert outputs (routed rows, then the shared expert's),
// sel [n_sel] int64 the slot (t * k + j) of each routed row (n_sel == T * k).
static torch::Tensor moe_combine(torch::Tensor out, torch::Tensor sel, int64_t t, int64_t k) {
  check_stream_dtype(out, "out");
  check_rows(sel, "sel", torch::kInt64);
  TORCH_CHECK(k >= 1 && t >= 0 && sel.numel() == t * k && out.dim() == 2 && out.size(0) == t * k + t,
              "kernels.moe_combine: out ", out.sizes(), " / sel ", sel.sizes(), " do not fit T = ", t, ", k = ", k);
  auto sp = sel.data_ptr<int64_t>();
  for (int64_t i = 0; i < t * k; ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < t * k, "kernels.moe_combine: sel holds slot ", sp[i], " outside [0, ", t * k, ")");
  auto y = torch::empty({t, out.size(1)}, out.options());
  kk::moe_combine(out.data_ptr(), out.scalar_type() == torch::kBFloat16, sp, t, k, out.size(1), t * k, y.data_ptr());
  return y;
}

// MoE routing (decode.h): logits [T, E] fp32, bias [E] fp32 or None, k <= E, func "sqrtsoftplus" | "sigmoid".
static std::vector<torch::Tensor> moe_route(torch::Tensor logits, c10::optional<torch::Tensor> bias, int64_t k,
                                            const std::string& func) {
  check_rows(logits, "logits", torch::kFloat32);
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) >= 1 && logits.size(1) <= (1 << 16), "kernels.moe_route: logits must be [T, E], got ", logits.sizes());
  TORCH_CHECK(k >= 1 && k <= logits.size(1), "kernels.moe_route: k = ", k, " must be in [1, ", logits.size(1), "]");
  TORCH_CHECK(func == "sqrtsoftplus" || func == "sigmoid", "kernels.moe_route: func must be sqrtsoftplus or sigmoid, got ", func);
  const float* bp = nullptr;
  if (bias.has_value()) {
    check_rows(*bias, "bias", torch::kFloat32);
    TORCH_CHECK(bias->numel() == logits.size(1), "kernels.moe_route: bias has ", bias->numel(), " entries for ", logits.size(1), " experts");
    bp = bias->data_ptr<float>();
  }
  const int64_t t = logits.size(0);
  auto w = torch::empty({t, k}, logits.options());
  auto ids = torch::empty({t, k}, logits.options().dtype(torch::kInt64));
  kk::moe_route(logits.data_ptr<float>(), bp, t, logits.size(1), k, func == "sigmoid" ? 1 : 0, w.data_ptr<float>(),
                ids.data_ptr<int64_t>());
  return {w, ids};
}

// ---- MoE experts in one call (moe.h): the FP8 rounding is this file's `fake_quant_fp8` ----
#include "moe.h"

static c10::optional<torch::Tensor> moe_experts(torch::Tensor x, torch::Tensor ids, torch::Tensor weights,
                                                std::vector<torch::Tensor> packs, torch::Tensor meta,
                                                std::vector<torch::Tensor> watch, torch::Tensor stamps, double limit,
                                                int64_t x_block, int64_t h_block, const std::string& isa) {
  return kk::moe_experts(x, ids, weights, packs, meta, watch, stamps, limit, x_block, h_block, isa, &fake_quant_fp8);
}

#include "attn.h"

// ---- paged attention (attn.h): keys read in place from the window ring, the step's rows and the pool ----
// q [T, H, d]; ring uint8 [slots, rows, >= d * esz] and step [S, d] (the step's rows) in q's dtype; meta int64 [T, 4]
// (slot, pos, chunk start, first step row); optional pool uint8 [blocks, rows, >= d * esz] with
// tables int64 [N, C], seq int64 [T] and picks int64 [T, m] or counts int64 [T]. Every address a row
// can reach is checked here, so the kernel never reads outside the tensors.
static torch::Tensor paged_attention(torch::Tensor q, torch::Tensor ring, torch::Tensor step, torch::Tensor meta,
                                     int64_t w, c10::optional<torch::Tensor> pool, c10::optional<torch::Tensor> tables,
                                     c10::optional<torch::Tensor> seq, c10::optional<torch::Tensor> picks,
                                     c10::optional<torch::Tensor> counts, int64_t ratio, int64_t block_size,
                                     torch::Tensor sink, double scale) {
  check_stream_dtype(q, "q");
  check_rows(step, "step", q.scalar_type());
  check_rows(meta, "meta", torch::kInt64);
  check_rows(sink, "sink", torch::kFloat32);
  TORCH_CHECK(q.dim() == 3 && q.size(2) % 8 == 0 && q.size(2) <= 1024, "kernels.paged_attention: q must be [T, H, d] with d a multiple of 8 up to 1024, got ", q.sizes());
  const int64_t t = q.size(0), h = q.size(1), d = q.size(2), esz = q.element_size();
  TORCH_CHECK(sink.numel() == h, "kernels.paged_attention: sink has ", sink.numel(), " entries for ", h, " heads");
  TORCH_CHECK(step.dim() == 2 && step.size(1) == d, "kernels.paged_attention: step ", step.sizes(), " does not fit q ", q.sizes());
  TORCH_CHECK(meta.dim() == 2 && meta.size(0) == t && meta.size(1) == 4, "kernels.paged_attention: meta must be [T, 4], got ", meta.sizes());
  TORCH_CHECK(ring.device().is_cpu() && ring.scalar_type() == torch::kUInt8 && ring.dim() == 3 && ring.stride(2) == 1 &&
              ring.size(2) >= d * esz && ring.size(1) >= 1, "kernels.paged_attention: ring must be uint8 [slots, rows, >= ", d * esz, "] with unit byte stride, got ", ring.sizes());
  TORCH_CHECK(w >= 0 && w <= ring.size(1), "kernels.paged_attention: window ", w, " is deeper than the ring's ", ring.size(1), " rows");
  const int64_t* mp = meta.data_ptr<int64_t>();
  for (int64_t r = 0; r < t; ++r) {  // slot in range; step rows of the window inside [0, T)
    const int64_t slot = mp[4 * r], pos = mp[4 * r + 1], start = mp[4 * r + 2], first = mp[4 * r + 3];
    TORCH_CHECK(slot >= 0 && slot < ring.size(0) && start <= pos && first >= 0 && first + pos - start < step.size(0),
                "kernels.paged_attention: meta row ", r, " (slot ", slot, ", pos ", pos, ", start ", start, ", first ", first, ") is outside the ring or the step");
  }
  kk::WindowKeys win{ring.data_ptr<uint8_t>(), ring.stride(0), ring.stride(1), ring.size(1),
                     reinterpret_cast<const uint8_t*>(step.data_ptr()), d * esz, mp, w};
  kk::PoolKeys pk{};
  const bool has_pool = pool.has_value();
  if (has_pool) {
    TORCH_CHECK(tables.has_value() && seq.has_value() && (picks.has_value() != counts.has_value()),
                "kernels.paged_attention: a pool needs tables, seq and exactly one of picks / counts");
    TORCH_CHECK(pool->device().is_cpu() && pool->scalar_type() == torch::kUInt8 && pool->dim() == 3 && pool->stride(2) == 1 &&
                pool->size(2) >= d * esz, "kernels.paged_attention: pool must be uint8 [blocks, rows, >= ", d * esz, "] with unit byte stride, got ", pool->sizes());
    check_rows(*tables, "tables", torch::kInt64);
    check_rows(*seq, "seq", torch::kInt64);
    TORCH_CHECK(tables->dim() == 2 && seq->numel() == t, "kernels.paged_attention: tables must be [N, C] and seq [T]");
    TORCH_CHECK(ratio >= 1 && block_size >= ratio && block_size % ratio == 0 && block_size / ratio <= pool->size(1),
                "kernels.paged_attention: ratio ", ratio, " / block size ", block_size, " do not fit the pool's ", pool->size(1), " rows per block");
    const int64_t* tp = tables->data_ptr<int64_t>();
    for (int64_t i = 0; i < tables->numel(); ++i)
      TORCH_CHECK(tp[i] >= 0 && tp[i] < pool->size(0), "kernels.paged_attention: block table entry ", tp[i], " is outside the pool");
    const int64_t* sp = seq->data_ptr<int64_t>();
    for (int64_t r = 0; r < t; ++r)
      TORCH_CHECK(sp[r] >= 0 && sp[r] < tables->size(0), "kernels.paged_attention: seq[", r, "] = ", sp[r], " has no block table row");
    int64_t m = 0;
    const int64_t* pp = nullptr;
    const int64_t* cp = nullptr;
    if (picks.has_value()) {
      check_rows(*picks, "picks", torch::kInt64);
      TORCH_CHECK(picks->dim() == 2 && picks->size(0) == t, "kernels.paged_attention: picks must be [T, m], got ", picks->sizes());
      m = picks->size(1);
      pp = picks->data_ptr<int64_t>();
    } else {
      check_rows(*counts, "counts", torch::kInt64);
      TORCH_CHECK(counts->numel() == t, "kernels.paged_attention: counts must be [T]");
      cp = counts->data_ptr<int64_t>();
      for (int64_t r = 0; r < t; ++r) TORCH_CHECK(cp[r] >= 0 && cp[r] <= tables->size(1) * (block_size / ratio), "kernels.paged_attention: counts[", r, "] = ", cp[r], " is past the block table");
    }
    pk = kk::PoolKeys{pool->data_ptr<uint8_t>(), pool->stride(0), pool->stride(1), tp, tables->size(1), sp, pp, m, cp,
                      ratio, block_size};
  }
  auto out = torch::empty_like(q);
  if (t == 0 || h == 0) return out;
  const bool bf16 = q.scalar_type() == torch::kBFloat16;
  at::parallel_for(0, t, 4, [&](int64_t b, int64_t e) {
    kk::paged_attention(q.data_ptr(), bf16, h, d, win, has_pool ? &pk : nullptr, sink.data_ptr<float>(),
                        static_cast<float>(scale), b, e, out.data_ptr());
  });
  return out;
}

#include "index.h"

// ---- indexer scores + top-k (index.h): keys in place from the pool (tables given: keys uint8 [blocks,
// rows, >= d * esz]) or from a gathered tensor keys [N, L, d] (no tables); q [T, H, d], w [T, H] fp32;
// seq, counts int64 [T]; picks int64 [T, k]. Every address a row can reach is checked here.
static torch::Tensor index_topk(torch::Tensor q, torch::Tensor w, torch::Tensor keys, bool keys_bf16,
                                c10::optional<torch::Tensor> tables, torch::Tensor seq, torch::Tensor counts,
                                int64_t ratio, int64_t block_size, int64_t k) {
  check_rows(q, "q", torch::kFloat32);
  check_rows(w, "w", torch::kFloat32);
  check_rows(seq, "seq", torch::kInt64);
  check_rows(counts, "counts", torch::kInt64);
  TORCH_CHECK(q.dim() == 3 && q.size(2) % 8 == 0, "kernels.index_topk: q must be [T, H, d] with d a multiple of 8, got ", q.sizes());
  const int64_t t = q.size(0), h = q.size(1), d = q.size(2), esz = keys_bf16 ? 2 : 4;
  TORCH_CHECK(w.dim() == 2 && w.size(0) == t && w.size(1) == h, "kernels.index_topk: w ", w.sizes(), " does not fit q ", q.sizes());
  TORCH_CHECK(seq.numel() == t && counts.numel() == t, "kernels.index_topk: seq and counts must be [T]");
  TORCH_CHECK(k >= 1, "kernels.index_topk: k must be >= 1, got ", k);
  TORCH_CHECK(keys.device().is_cpu() && keys.dim() == 3 && keys.stride(2) == 1, "kernels.index_topk: keys must be a CPU [., ., .] tensor with unit last stride, got ", keys.sizes());
  const int64_t* sp = seq.data_ptr<int64_t>();
  const int64_t* cp = counts.data_ptr<int64_t>();
  kk::IndexKeys ik{};
  ik.keys = reinterpret_cast<const uint8_t*>(keys.data_ptr());
  ik.bf16 = keys_bf16 ? 1 : 0;
  ik.seq = sp;
  if (tables.has_value()) {
    check_rows(*tables, "tables", torch::kInt64);
    TORCH_CHECK(keys.scalar_type() == torch::kUInt8 && keys.size(2) >= d * esz, "kernels.index_topk: pool keys must be uint8 [blocks, rows, >= ", d * esz, "], got ", keys.sizes());
    TORCH_CHECK(tables->dim() == 2 && ratio >= 1 && block_size >= ratio && block_size % ratio == 0 && block_size / ratio <= keys.size(1),
                "kernels.index_topk: ratio ", ratio, " / block size ", block_size, " do not fit the pool's ", keys.size(1), " rows per block");
    const int64_t* tp = tables->data_ptr<int64_t>();
    for (int64_t i = 0; i < tables->numel(); ++i)
      TORCH_CHECK(tp[i] >= 0 && tp[i] < keys.size(0), "kernels.index_topk: block table entry ", tp[i], " is outside the pool");
    ik.block_stride = keys.stride(0);
    ik.row_stride = keys.stride(1);
    ik.tables = tp;
    ik.table_cols = tables->size(1);
    ik.ratio = ratio;
    ik.block_size = block_size;
    for (int64_t r = 0; r < t; ++r)
      TORCH_CHECK(sp[r] >= 0 && sp[r] < tables->size(0) && cp[r] >= 0 && cp[r] <= tables->size(1) * (block_size / ratio),
                  "kernels.index_topk: row ", r, " (seq ", sp[r], ", count ", cp[r], ") is outside the block table");
  } else {
    TORCH_CHECK(keys.scalar_type() == (keys_bf16 ? torch::kBFloat16 : torch::kFloat32) && keys.size(2) == d,
                "kernels.index_topk: gathered keys must be [N, L, ", d, "] of the stated dtype, got ", keys.scalar_type(), " ", keys.sizes());
    ik.block_stride = keys.stride(0) * esz;
    ik.row_stride = keys.stride(1) * esz;
    ik.dense_rows = keys.size(1);
    for (int64_t r = 0; r < t; ++r)
      TORCH_CHECK(sp[r] >= 0 && sp[r] < keys.size(0) && cp[r] >= 0 && cp[r] <= keys.size(1),
                  "kernels.index_topk: row ", r, " (seq ", sp[r], ", count ", cp[r], ") is outside the keys");
  }
  auto picks = torch::empty({t, k}, seq.options());
  if (t == 0) return picks;
  at::parallel_for(0, t, 4, [&](int64_t b, int64_t e) {
    kk::index_topk(q.data_ptr<float>(), w.data_ptr<float>(), h, d, ik, cp, k, b, e, picks.data_ptr<int64_t>());
  });
  return picks;
}

// ---- fp32 projections of bf16 / fp32 rows (compressors, the MoE gate): `gemm` on an fp32 pack ----
// x [M, K] bf16 or fp32 is widened to fp32 (exact) and multiplied by the fp32 pack exactly as `gemm`
// does; with `table` [R, C] fp32 and `positions` [M] int64, row m then gets table[positions[m] mod R]
// added to its columns [offset, offset + C) (one correctly rounded fp32 add per element: the bits of
// ``y[:, offset:offset + C] += table[positions % R]``).
static torch::Tensor project_wide(torch::Tensor x, torch::Tensor w, torch::Tensor exps, int64_t n, int64_t k,
                                  const std::string& isa, c10::optional<torch::Tensor> table,
                                  c10::optional<torch::Tensor> positions, int64_t offset) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat32,
              "kernels.project_wide: x must be bf16 or fp32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2, "kernels.project_wide: x must be [M, K], got ", x.sizes());
  auto y = gemm(x.scalar_type() == torch::kFloat32 ? x : x.to(torch::kFloat32), w, exps, kk::FMT_FP32, n, k, k, 0,
                isa, false);
  if (!table.has_value()) return y;
  TORCH_CHECK(positions.has_value(), "kernels.project_wide: a table needs positions");
  const auto& tb = *table;
  const auto& ps = *positions;
  check_rows(tb, "table", torch::kFloat32);
  TORCH_CHECK(tb.dim() == 2 && tb.size(0) >= 1 && offset >= 0 && offset + tb.size(1) <= n,
              "kernels.project_wide: table ", tb.sizes(), " at column ", offset, " does not fit ", n, " outputs");
  TORCH_CHECK(ps.scalar_type() == torch::kInt64 && ps.dim() == 1 && ps.size(0) == x.size(0) && ps.is_contiguous(),
              "kernels.project_wide: positions must be [M] int64");
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

// ---- the MoE gate in one call (model/moe.py `Gate.forward`'s native path) ----
// logits = project_wide(x, the fp32 gate pack), divided by `temp` unless it is 1; moe_route's scores
// and stable top-k picks; with `normalize`, each row's k weights divided by (their sum from the first
// pick to the last + 1e-20); then times `factor`. fp32 throughout, each op rounded as torch's.
static std::vector<torch::Tensor> moe_gate(torch::Tensor x, torch::Tensor w, torch::Tensor exps, int64_t n, int64_t kdim,
                                           const std::string& isa, c10::optional<torch::Tensor> bias, int64_t k,
                                           const std::string& func, double temp, bool normalize, double factor,
                                           c10::optional<torch::Tensor> given) {
  auto logits = project_wide(x, w, exps, n, kdim, isa, c10::nullopt, c10::nullopt, 0);
  if (temp != 1.0) logits.div_(temp);  // a tensor by a wrapped scalar: fp32 division by (float)temp
  std::vector<torch::Tensor> routed;
  if (given.has_value()) {  // hash routing: the experts are given (the token's row of tid2eid), no top-k
    TORCH_CHECK(func == "sqrtsoftplus" || func == "sigmoid", "kernels.moe_gate: func must be sqrtsoftplus or sigmoid, got ", func);
    const auto ids = given->to(torch::kInt64).contiguous();
    const int64_t t = logits.size(0), e = logits.size(1);
    TORCH_CHECK(ids.dim() == 2 && ids.size(0) == t && ids.size(1) == k, "kernels.moe_gate: given ids must be [",
                t, ", ", k, "], got ", ids.sizes());
    const int64_t* ip = ids.data_ptr<int64_t>();
    for (int64_t i = 0; i < t * k; ++i)
      TORCH_CHECK(ip[i] >= 0 && ip[i] < e, "kernels.moe_gate: given id ", ip[i], " outside [0, ", e, ")");
    auto wts = torch::empty({t, k}, logits.options());
    kk::moe_scores_at(logits.data_ptr<float>(), t, e, k, func == "sigmoid" ? 1 : 0, ip, wts.data_ptr<float>());
    routed = {wts, ids};
  } else {
    routed = moe_route(logits, bias, k, func);
  }
  float* wp = routed[0].data_ptr<float>();
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
  return routed;
}

#include "mhc.h"

// ---- a sublayer's mHC in one call (mhc.h): checks, outputs and scratch here, the work in mhc.cpp ----
// The mix parameters as fp32 (bf16 ones widened: exact), checked against hc, D and the mix's n outputs;
// the tensors are kept here while the kernel reads them.
struct MhcArgs {
  torch::Tensor base, scale, norm_w;
  kk::MhcMix mix{};
  kk::MhcNorm norm{};
};

static void mhc_check_h(const char* who, const torch::Tensor& h) {
  check_stream_dtype(h, "h");
  TORCH_CHECK(h.dim() == 3 && h.size(1) >= 1 && h.size(1) <= 16 && h.size(2) >= 8, "kernels.", who,
              ": h must be [T, hc, D] with hc in [1, 16] and D >= 8, got ", h.sizes());
}

static void mhc_set_mix(MhcArgs& a, const char* who, const torch::Tensor& h, const torch::Tensor& fn, int64_t n,
                        int64_t n_scale, const torch::Tensor& base, const torch::Tensor& scale, double rms_eps,
                        double hc_eps, int64_t iters) {
  const int64_t k = h.size(1) * h.size(2);
  TORCH_CHECK(fn.device().is_cpu() && fn.is_contiguous() && fn.scalar_type() == torch::kFloat32 &&
              fn.numel() == (n + 15) / 16 * k * 16, "kernels.", who, ": fn must be the fp32 pack of a [", n, ", ", k,
              "] weight (", (n + 15) / 16 * k * 16, " floats), got ", fn.scalar_type(), " ", fn.sizes());
  TORCH_CHECK(iters >= 1, "kernels.", who, ": iters must be >= 1, got ", iters);
  a.base = base.to(torch::kFloat32).contiguous();
  a.scale = scale.to(torch::kFloat32).contiguous();
  TORCH_CHECK(a.base.device().is_cpu() && a.base.numel() == n, "kernels.", who, ": base must have ", n, " entries, got ", a.base.numel());
  TORCH_CHECK(a.scale.device().is_cpu() && a.scale.numel() == n_scale, "kernels.", who, ": scale must have ", n_scale,
              " entries, got ", a.scale.numel());
  a.mix = kk::MhcMix{fn.data_ptr<float>(), n, a.base.data_ptr<float>(), a.scale.data_ptr<float>(),
                     static_cast<float>(rms_eps), static_cast<float>(hc_eps), static_cast<int>(iters)};
}

static void mhc_set_norm(MhcArgs& a, const char* who, const torch::Tensor& h, const torch::Tensor& norm_w, double norm_eps) {
  a.norm_w = norm_w.to(torch::kFloat32).contiguous();
  TORCH_CHECK(a.norm_w.device().is_cpu() && a.norm_w.numel() == h.size(2), "kernels.", who, ": norm_w must have ",
              h.size(2), " entries, got ", a.norm_w.numel());
  a.norm = kk::MhcNorm{a.norm_w.data_ptr<float>(), static_cast<float>(norm_eps)};
}

static MhcArgs mhc_args(const char* who, const torch::Tensor& h, const torch::Tensor& fn, const torch::Tensor& base,
                        const torch::Tensor& scale, const torch::Tensor& norm_w, double norm_eps, double rms_eps,
                        double hc_eps, int64_t iters) {
  mhc_check_h(who, h);
  MhcArgs a;
  const int64_t hc = h.size(1);
  mhc_set_mix(a, who, h, fn, (2 + hc) * hc, 3, base, scale, rms_eps, hc_eps, iters);
  mhc_set_norm(a, who, h, norm_w, norm_eps);
  return a;
}

static int mhc_isa(const std::string& isa) {
  TORCH_CHECK(isa == "amx" || isa == "avx512" || isa == "avx2", "kernels.mhc: unknown isa ", isa);
  TORCH_CHECK(cpu_has(isa == "avx2" ? "avx2" : "avx512bf16"), "kernels.mhc: this CPU lacks ", isa);
  return isa == "avx2" ? kk::MHC_AVX2 : kk::MHC_AVX512;
}

static const float* mhc_pre_arg(const c10::optional<torch::Tensor>& pre, const torch::Tensor& h, const char* who) {
  if (!pre.has_value()) return nullptr;
  check_rows(*pre, "collapse_pre", torch::kFloat32);
  TORCH_CHECK(pre->dim() == 2 && pre->size(0) == h.size(0) && pre->size(1) == h.size(1), "kernels.", who,
              ": collapse_pre must be [", h.size(0), ", ", h.size(1), "], got ", pre->sizes());
  return pre->data_ptr<float>();
}

// (x [T, D] in h's dtype, pre [T, hc], post [T, hc], comb [T, hc, hc]) of the sublayer entered from h [T, hc, D].
static std::vector<torch::Tensor> mhc_enter(torch::Tensor h, torch::Tensor fn, torch::Tensor base, torch::Tensor scale,
                                            c10::optional<torch::Tensor> collapse_pre, torch::Tensor norm_w, double norm_eps,
                                            double rms_eps, double hc_eps, int64_t iters, const std::string& isa) {
  h = h.contiguous();
  const int64_t hc = h.dim() == 3 ? h.size(1) : 0;
  const auto a = mhc_args("mhc_enter", h, fn, base, scale, norm_w, norm_eps, rms_eps, hc_eps, iters);
  const float* cp = mhc_pre_arg(collapse_pre, h, "mhc_enter");
  const int64_t t = h.size(0), d = h.size(2);
  auto f32 = h.options().dtype(torch::kFloat32);
  auto x = torch::empty({t, d}, h.options());
  auto pre = torch::empty({t, hc}, f32), post = torch::empty({t, hc}, f32), comb = torch::empty({t, hc, hc}, f32);
  if (t == 0) return {x, pre, post, comb};
  auto scratch = torch::empty({kk::mhc_scratch_floats(t, static_cast<int>(hc), d, a.mix.n)}, f32);
  kk::mhc_enter(h.data_ptr(), h.scalar_type() == torch::kBFloat16, t, static_cast<int>(hc), d, a.mix, cp, a.norm,
                mhc_isa(isa), scratch.data_ptr<float>(), pre.data_ptr<float>(), post.data_ptr<float>(),
                comb.data_ptr<float>(), x.data_ptr());
  return {x, pre, post, comb};
}

// (streams hn [T, hc, D] = expand(h, y, post, comb), then mhc_enter's four outputs on hn).
static std::vector<torch::Tensor> mhc_boundary(torch::Tensor h, torch::Tensor y, torch::Tensor post_in, torch::Tensor comb_in,
                                               torch::Tensor fn, torch::Tensor base, torch::Tensor scale,
                                               c10::optional<torch::Tensor> collapse_pre, torch::Tensor norm_w,
                                               double norm_eps, double rms_eps, double hc_eps, int64_t iters,
                                               const std::string& isa) {
  h = h.contiguous();
  const int64_t hc = h.dim() == 3 ? h.size(1) : 0;
  const auto a = mhc_args("mhc_boundary", h, fn, base, scale, norm_w, norm_eps, rms_eps, hc_eps, iters);
  const float* cp = mhc_pre_arg(collapse_pre, h, "mhc_boundary");
  const int64_t t = h.size(0), d = h.size(2);
  y = y.contiguous();
  check_rows(y, "y", h.scalar_type());
  check_rows(post_in, "post", torch::kFloat32);
  check_rows(comb_in, "comb", torch::kFloat32);
  TORCH_CHECK(y.dim() == 2 && y.size(0) == t && y.size(1) == d && post_in.dim() == 2 && post_in.size(0) == t &&
              post_in.size(1) == hc && comb_in.dim() == 3 && comb_in.size(0) == t && comb_in.size(1) == hc &&
              comb_in.size(2) == hc, "kernels.mhc_boundary: shapes do not fit: h ", h.sizes(), ", y ", y.sizes(),
              ", post ", post_in.sizes(), ", comb ", comb_in.sizes());
  auto f32 = h.options().dtype(torch::kFloat32);
  auto hn = torch::empty_like(h);
  auto x = torch::empty({t, d}, h.options());
  auto pre = torch::empty({t, hc}, f32), post = torch::empty({t, hc}, f32), comb = torch::empty({t, hc, hc}, f32);
  if (t == 0) return {hn, x, pre, post, comb};
  auto scratch = torch::empty({kk::mhc_scratch_floats(t, static_cast<int>(hc), d, a.mix.n)}, f32);
  kk::mhc_boundary(h.data_ptr(), y.data_ptr(), post_in.data_ptr<float>(), comb_in.data_ptr<float>(),
                   h.scalar_type() == torch::kBFloat16, t, static_cast<int>(hc), d, a.mix, cp, a.norm, mhc_isa(isa),
                   scratch.data_ptr<float>(), hn.data_ptr(), pre.data_ptr<float>(), post.data_ptr<float>(),
                   comb.data_ptr<float>(), x.data_ptr());
  return {hn, x, pre, post, comb};
}

// Leaving a block's last sublayer: `mhc_expand` of any-strided inputs (copied to contiguous here, not by torch
// calls in Python); y must have h's dtype.
static torch::Tensor mhc_leave(torch::Tensor h, torch::Tensor y, torch::Tensor post, torch::Tensor comb) {
  return mhc_expand(h.contiguous(), y.contiguous(), post.contiguous(), comb.contiguous());
}

// The model's tail: x [T, D] = norm(collapse(h, pre)) with pre from V4's head mixes (fn [hc, hc D] packed,
// base [hc], scale [1]) or, without fn, the given pre [T, hc] (V4.1).
static torch::Tensor mhc_head(torch::Tensor h, c10::optional<torch::Tensor> fn, c10::optional<torch::Tensor> base,
                              c10::optional<torch::Tensor> scale, c10::optional<torch::Tensor> pre_in, torch::Tensor norm_w,
                              double norm_eps, double rms_eps, double hc_eps, const std::string& isa) {
  h = h.contiguous();
  const int64_t hc = h.dim() == 3 ? h.size(1) : 0;
  TORCH_CHECK(fn.has_value() != pre_in.has_value() && fn.has_value() == base.has_value() && fn.has_value() == scale.has_value(),
              "kernels.mhc_head: give either fn, base and scale (V4) or pre (V4.1)");
  mhc_check_h("mhc_head", h);
  MhcArgs a;
  if (fn.has_value()) mhc_set_mix(a, "mhc_head", h, *fn, hc, 1, *base, *scale, rms_eps, hc_eps, 1);
  mhc_set_norm(a, "mhc_head", h, norm_w, norm_eps);
  const int64_t t = h.size(0), d = h.size(2);
  torch::Tensor pre;
  if (pre_in.has_value()) {
    mhc_pre_arg(pre_in, h, "mhc_head");
    pre = *pre_in;
  } else {
    pre = torch::empty({t, hc}, h.options().dtype(torch::kFloat32));
  }
  auto x = torch::empty({t, d}, h.options());
  if (t == 0) return x;
  auto scratch = torch::empty({kk::mhc_scratch_floats(t, static_cast<int>(hc), d, hc)}, h.options().dtype(torch::kFloat32));
  kk::mhc_head(h.data_ptr(), h.scalar_type() == torch::kBFloat16, t, static_cast<int>(hc), d,
               fn.has_value() ? &a.mix : nullptr, pre.data_ptr<float>(), a.norm, mhc_isa(isa), scratch.data_ptr<float>(),
               x.data_ptr());
  return x;
}

#include "attn_proj.h"

// ---- attention's input and output projections in one call each (attn_proj.h); the FP8 rounding is
// this file's `fake_quant_fp8` ----
static c10::optional<std::vector<torch::Tensor>> attn_in(torch::Tensor x, std::vector<torch::Tensor> packs,
                                                         torch::Tensor meta, std::vector<torch::Tensor> watch,
                                                         torch::Tensor stamps, torch::Tensor q_norm_w,
                                                         torch::Tensor kv_norm_w, double eps, torch::Tensor c,
                                                         torch::Tensor s, int64_t heads, bool head_norm,
                                                         int64_t x_block, int64_t qr_block, const std::string& isa) {
  return kk::attn_in(x, kk::ProjSet{packs, meta, watch, stamps}, q_norm_w, kv_norm_w, eps, c, s, heads, head_norm,
                     x_block, qr_block, isa, &fake_quant_fp8);
}

static c10::optional<torch::Tensor> attn_out(torch::Tensor o, std::vector<torch::Tensor> packs, torch::Tensor meta,
                                             std::vector<torch::Tensor> watch, torch::Tensor stamps, torch::Tensor c,
                                             torch::Tensor s, int64_t u_block, const std::string& isa) {
  return kk::attn_out(o, kk::ProjSet{packs, meta, watch, stamps}, c, s, u_block, isa, &fake_quant_fp8);
}

// The indexer's query side and its top-k in one call (`kernels.attn_proj.index_select`): index_query,
// then `index_topk` over the keys (in place with `tables`, else gathered rows). nullopt when stale.
static c10::optional<torch::Tensor> index_select(torch::Tensor qr, torch::Tensor x, std::vector<torch::Tensor> packs,
                                                 torch::Tensor meta, std::vector<torch::Tensor> watch,
                                                 torch::Tensor stamps, torch::Tensor c, torch::Tensor s, int64_t heads,
                                                 double scale, int64_t qr_block, const std::string& isa,
                                                 torch::Tensor keys, bool keys_bf16, c10::optional<torch::Tensor> tables,
                                                 torch::Tensor seq, torch::Tensor counts, int64_t ratio,
                                                 int64_t block_size, int64_t k) {
  auto qw = kk::index_query(qr, x, kk::ProjSet{packs, meta, watch, stamps}, c, s, heads, scale, qr_block, isa,
                            &fake_quant_fp8);
  if (!qw.has_value()) return c10::nullopt;
  return index_topk((*qw)[0], (*qw)[1], keys, keys_bf16, tables, seq.contiguous(), counts.contiguous(), ratio,
                    block_size, k);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("gemm", &gemm, "y = x W^T in the fixed reduction order (see gemm_body.h)");
  mod.def("mhc_post", &mhc_post, "mHC pre, post and Sinkhorn-normalised comb of decode rows (decode.h)");
  mod.def("sinkhorn_", &sinkhorn_, "mHC Sinkhorn divisions in place (decode.h)");
  mod.def("mhc_collapse", &mhc_collapse, "mHC collapse of the streams (decode.h)");
  mod.def("mhc_expand", &mhc_expand, "mHC expand of a sublayer output into the streams (decode.h)");
  mod.def("rope", &rope, "interleaved RoPE on the trailing dims with per-position tables (decode.h)");
  mod.def("compress_pool", &compress_pool, "compressor softmax pooling over a group's slots (decode.h)");
  mod.def("sparse_attention", &sparse_attention, "sparse attention with a sink over two key sources (decode.h)");
  mod.def("fake_quant_fp8", &fake_quant_fp8, "FP8 e4m3 quantise-dequantise with ue8m0 block scales (quant.fake_quant_fp8's bits)");
  mod.def("rms_norm", &rms_norm, "RMSNorm rows with torch's summation order (decode.h)");
  mod.def("swiglu", &swiglu, "MoE SwiGLU with the routing weight (decode.h)");
  mod.def("moe_combine", &moe_combine, "MoE combine of routed slots and the shared expert (decode.h)");
  mod.def("moe_route", &moe_route, "MoE gate scores and stable top-k (decode.h)");
  mod.def("fake_quant_fp4", &kk::fake_quant_fp4, "FP4 e2m1 quantise-dequantise (quant.fake_quant_fp4's bits, rows.cpp)");
  mod.def("pack_rows", &kk::pack_rows, "cache row pack of the fp4 / fp8 schemes (cache/formats.py's bytes, rows.cpp)");
  mod.def("unpack_rows", &kk::unpack_rows, "cache row unpack of the fp4 / fp8 schemes (rows.cpp)");
  mod.def("ring_store", &kk::ring_store, "the end-of-step ring update of plain rows, every ring of a step at once (rows.cpp)");
  mod.def("cpu_has", &cpu_has, "whether the CPU runs a code path ('avx512bf16' or 'avx2')");
  mod.def("moe_experts", &moe_experts, "a MoE layer's routed and shared experts and their combine in one call (moe.h)");
  mod.def("moe_stamps", &kk::moe_stamps, "(data_ptr, version, dtype) of tensors: a MoE pack set's key (moe.h)");
  mod.def("paged_attention", &paged_attention, "sparse attention with a sink over keys read in place (attn.h)");
  mod.def("index_topk", &index_topk, "lightning-indexer scores and stable top-k over keys read in place (index.h)");
  mod.def("index_select", &index_select, "the indexer's query projections, RoPE, head weights and top-k in one call");
  mod.def("project_wide", &project_wide, "fp32 projection of bf16 / fp32 rows with an optional per-position row added");
  mod.def("moe_gate", &moe_gate, "a MoE layer's gate: fp32 logits, scores, stable top-k, normalised and scaled weights");
  mod.def("mhc_enter", &mhc_enter, "a sublayer's mHC mixes, collapse and norm in one call (mhc.h)");
  mod.def("mhc_boundary", &mhc_boundary, "expand into the streams, then mhc_enter of the next sublayer (mhc.h)");
  mod.def("mhc_leave", &mhc_leave, "mhc_expand of inputs of any strides (mhc.h)");
  mod.def("mhc_head", &mhc_head, "the model's final mHC collapse (V4: with the head's pre) and norm (mhc.h)");
  mod.def("attn_in", &attn_in, "attention's qr, normed and rotated q and kv from x in one call (attn_proj.h)");
  mod.def("attn_out", &attn_out, "attention's inverse RoPE, grouped wo_a and wo_b in one call (attn_proj.h)");
}
