// Cache row codecs (kvshare/cache/formats.py) and the FP4 quantise-dequantise (kvshare/quant.py), one
// call per tensor instead of ~20-60 torch ops. Scalar loops over c10's float8 e4m3 / bfloat16
// conversions and <cmath>'s frexp / ldexp: the same bits as the torch code for finite inputs (NaN
// blocks are not specified). Every block and row is computed from its own values alone.
#include <torch/extension.h>
#include <c10/util/Float8_e4m3fn.h>
#include <cfloat>
#include <cmath>
#include <cstring>
#include "rows.h"

namespace {

constexpr float kGrid[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
constexpr float kMids[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
constexpr float kExactQ[7] = {6.0f, 4.0f, 3.0f, 2.0f, 1.5f, 1.0f, 0.5f};  // formats._EXACT_Q's order

// quant.pow2_ceil: 2^ceil(log2 x) from the exponent bits (frexp), exact for subnormals.
inline float pow2_ceil(float x) {
  int e = 0;
  const float m = std::frexp(x, &e);
  return m == 0.5f ? x : std::ldexp(1.0f, e);
}

inline float e4m3_round(float x) {  // quant.e4m3_round: clamp to +-448, c10's e4m3 conversion
  return static_cast<float>(c10::Float8_e4m3fn(std::min(std::max(x, -448.0f), 448.0f)));
}

inline uint8_t ue8m0_byte(float scale) {  // formats._ue8m0_bytes: frexp exponent + 126, wrapped to a byte
  int e = 0;
  std::frexp(scale, &e);
  return static_cast<uint8_t>(e + 126);
}

inline float amax_of(const float* a, int64_t n) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(a[i]));
  return m;
}

// quant.fp4_codes for one block of n values: codes (sign bit 3, grid index bits 0-2) and the scale.
float fp4_codes(const float* a, int64_t n, bool ue8m0, uint8_t* codes) {
  const float amax = amax_of(a, n);
  const float scale = ue8m0 ? pow2_ceil(std::max(amax, 6.0f * 0x1p-126f) / 6.0f)
                            : e4m3_round(std::max(amax, 6.0f * 0x1p-9f) / 6.0f);
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::min(std::max(a[i] / scale, -6.0f), 6.0f);
    const float mag = std::fabs(v);
    int idx = 0;
    while (idx < 7 && kMids[idx] < mag) ++idx;  // torch.bucketize: midpoints strictly below
    if (mag == 0.75f || mag == 1.75f || mag == 3.5f) ++idx;  // ties to the even code
    codes[i] = static_cast<uint8_t>(idx | ((v < 0.0f && idx > 0) ? 8 : 0));
  }
  return scale;
}

inline float fp4_value(uint8_t c, float scale) {
  const float mag = kGrid[c & 7];
  return ((c & 8) ? -mag : mag) * scale;
}

// formats._exact_fp4_e4m3 for one block: the quantiser's codes, replaced by the first exact
// encoding (scale amax / q, q in kExactQ order, an e4m3 value) when re-quantising changes the block.
float exact_fp4_e4m3(const float* a, int64_t n, uint8_t* codes, uint8_t* tmp) {
  float scale = fp4_codes(a, n, false, codes);
  bool bad = false;
  for (int64_t i = 0; i < n && !bad; ++i) bad = fp4_value(codes[i], scale) != a[i];
  if (!bad) return scale;
  const float amax = amax_of(a, n);
  for (float q : kExactQ) {
    const float s = amax / q;
    if (!(s > 0.0f) || e4m3_round(s) != s) continue;
    const float div = std::max(s, FLT_MIN);
    bool ok = true;
    for (int64_t i = 0; i < n && ok; ++i) {
      const float v = a[i] / div;
      const float mag = std::fabs(v);
      int idx = 0;
      while (idx < 7 && kGrid[idx] < mag) ++idx;  // torch.searchsorted (left), clamped to the last
      ok = kGrid[idx] == mag;
      tmp[i] = static_cast<uint8_t>(idx | ((v < 0.0f && idx > 0) ? 8 : 0));
    }
    if (ok) {
      memcpy(codes, tmp, static_cast<size_t>(n));
      return s;
    }
  }
  return scale;
}

// quant.fp8_codes (ue8m0) for one block: e4m3 bytes and the power-of-two scale.
float fp8_codes(const float* a, int64_t n, uint8_t* q) {
  const float scale = pow2_ceil(std::max(amax_of(a, n), 1e-4f) / 448.0f);
  for (int64_t i = 0; i < n; ++i) q[i] = c10::Float8_e4m3fn(std::min(std::max(a[i] / scale, -448.0f), 448.0f)).x;
  return scale;
}

void load_row(const torch::Tensor& x, int64_t r, int64_t d, float* out) {
  if (x.scalar_type() == torch::kBFloat16) {
    const auto* p = reinterpret_cast<const c10::BFloat16*>(x.data_ptr()) + r * d;
    for (int64_t i = 0; i < d; ++i) out[i] = static_cast<float>(p[i]);
  } else {
    memcpy(out, x.data_ptr<float>() + r * d, sizeof(float) * static_cast<size_t>(d));
  }
}

void store_row(torch::Tensor& y, int64_t r, int64_t d, const float* v) {
  if (y.scalar_type() == torch::kBFloat16) {
    auto* p = reinterpret_cast<c10::BFloat16*>(y.data_ptr()) + r * d;
    for (int64_t i = 0; i < d; ++i) p[i] = c10::BFloat16(v[i]);
  } else {
    memcpy(y.data_ptr<float>() + r * d, v, sizeof(float) * static_cast<size_t>(d));
  }
}

void check_floats(const torch::Tensor& x, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat32),
              what, ": x must be a bf16 / fp32 CPU tensor, got ", x.scalar_type(), " on ", x.device());
}

}  // namespace

namespace kvshare_kernels {

torch::Tensor fake_quant_fp4(torch::Tensor x, int64_t block, bool ue8m0) {
  check_floats(x, "kernels.fake_quant_fp4");
  TORCH_CHECK(block > 0 && x.dim() >= 1 && x.size(-1) % block == 0, "kernels.fake_quant_fp4: last dim ",
              x.dim() ? x.size(-1) : 0, " is not a multiple of the block ", block);
  auto xc = x.contiguous();
  auto out = torch::empty_like(xc);
  const int64_t d = xc.dim() ? xc.size(-1) : 1, rows = d ? xc.numel() / d : 0;
  std::vector<float> v(static_cast<size_t>(d));
  std::vector<uint8_t> c(static_cast<size_t>(block));
  for (int64_t r = 0; r < rows; ++r) {
    load_row(xc, r, d, v.data());
    for (int64_t b = 0; b < d; b += block) {
      const float s = fp4_codes(v.data() + b, block, ue8m0, c.data());
      for (int64_t i = 0; i < block; ++i) v[b + i] = fp4_value(c[i], s);
    }
    store_row(out, r, d, v.data());
  }
  return out;
}

torch::Tensor pack_rows(torch::Tensor x, int64_t scheme, int64_t block, int64_t rope_dim, int64_t row_bytes) {
  check_floats(x, "kernels.pack_rows");
  TORCH_CHECK(scheme >= ROW_FP4_E4M3 && scheme <= ROW_FP8_V4, "kernels.pack_rows: unknown scheme ", scheme);
  TORCH_CHECK(x.dim() >= 1, "kernels.pack_rows: x must have a row dim");
  const int64_t d = x.size(-1), n = scheme == ROW_FP8_V4 ? d - rope_dim : d;
  TORCH_CHECK(block > 0 && n > 0 && n % block == 0 && rope_dim >= 0 && (scheme == ROW_FP8_V4 || rope_dim == 0),
              "kernels.pack_rows: ", n, " quantised values do not fit blocks of ", block);
  const bool fp4 = scheme == ROW_FP4_E4M3 || scheme == ROW_FP4_UE8M0;
  TORCH_CHECK(!fp4 || block % 2 == 0, "kernels.pack_rows: fp4 blocks must be even, got ", block);
  const int64_t data = fp4 ? n / 2 : n + 2 * rope_dim, scales = n / block;
  TORCH_CHECK(row_bytes >= data + scales, "kernels.pack_rows: ", row_bytes, " bytes cannot hold ", data + scales);
  auto xc = x.contiguous();
  auto sizes = xc.sizes().vec();
  sizes.back() = row_bytes;
  auto out = torch::zeros(sizes, xc.options().dtype(torch::kUInt8));
  const int64_t rows = xc.numel() / d;
  std::vector<float> v(static_cast<size_t>(d));
  std::vector<uint8_t> c(static_cast<size_t>(block)), tmp(static_cast<size_t>(block));
  auto* o = out.data_ptr<uint8_t>();
  for (int64_t r = 0; r < rows; ++r) {
    load_row(xc, r, d, v.data());
    uint8_t* row = o + r * row_bytes;
    for (int64_t b = 0; b < n; b += block) {
      float s;
      uint8_t sb;
      if (fp4) {
        s = scheme == ROW_FP4_E4M3 ? exact_fp4_e4m3(v.data() + b, block, c.data(), tmp.data())
                                   : fp4_codes(v.data() + b, block, true, c.data());
        for (int64_t i = 0; i < block; i += 2) row[(b + i) / 2] = static_cast<uint8_t>(c[i] | (c[i + 1] << 4));
        sb = scheme == ROW_FP4_E4M3 ? c10::Float8_e4m3fn(s).x : ue8m0_byte(s);
      } else {
        s = fp8_codes(v.data() + b, block, row + b);
        sb = ue8m0_byte(s);
      }
      row[data + b / block] = sb;
    }
    if (scheme == ROW_FP8_V4)
      for (int64_t i = 0; i < rope_dim; ++i) {
        const uint16_t bits = c10::BFloat16(v[n + i]).x;
        memcpy(row + n + 2 * i, &bits, 2);
      }
  }
  return out;
}

torch::Tensor unpack_rows(torch::Tensor u8, int64_t scheme, int64_t block, int64_t dim, int64_t rope_dim,
                          torch::ScalarType out_dtype) {
  TORCH_CHECK(u8.device().is_cpu() && u8.scalar_type() == torch::kUInt8 && u8.dim() >= 1,
              "kernels.unpack_rows: rows must be a uint8 CPU tensor");
  TORCH_CHECK(scheme >= ROW_FP4_E4M3 && scheme <= ROW_FP8_V4, "kernels.unpack_rows: unknown scheme ", scheme);
  TORCH_CHECK(out_dtype == torch::kBFloat16 || out_dtype == torch::kFloat32, "kernels.unpack_rows: out dtype must be bf16 or fp32");
  const RowCodec codec{static_cast<int>(scheme), block, dim, rope_dim};
  TORCH_CHECK(codec_valid(codec), "kernels.unpack_rows: ", codec_quant_dims(codec),
              " values do not fit blocks of ", block);
  const int64_t rb = u8.size(-1);
  TORCH_CHECK(rb >= codec_row_bytes(codec), "kernels.unpack_rows: rows of ", rb, " bytes are too short");
  auto uc = u8.contiguous();
  auto sizes = uc.sizes().vec();
  sizes.back() = dim;
  auto out = torch::empty(sizes, uc.options().dtype(out_dtype));
  const int64_t rows = rb ? uc.numel() / rb : 0;
  std::vector<float> v(static_cast<size_t>(dim));
  const auto* in = uc.data_ptr<uint8_t>();
  for (int64_t r = 0; r < rows; ++r) {
    decode_row(in + r * rb, codec, v.data());
    store_row(out, r, dim, v.data());
  }
  return out;
}

// Ring rows stored as their values' bytes: for each ring i and kept row j, the bytes of
// values[i][tokens[j]] become row row[j] of slot slot[j] of rings[i] (what `Ring.write` stores for a
// plain encoding, `pack` being a byte copy there). Every index is checked before anything is written.
void ring_store(at::TensorList rings, at::TensorList values,
                const torch::Tensor& tokens, const torch::Tensor& slot, const torch::Tensor& row) {
  TORCH_CHECK(rings.size() == values.size(), "kernels.ring_store: ", rings.size(), " rings for ", values.size(),
              " value tensors");
  for (const auto* t : {&tokens, &slot, &row})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == torch::kInt64 && t->dim() == 1 && t->is_contiguous() &&
                    t->numel() == tokens.numel(),
                "kernels.ring_store: tokens, slot and row must be contiguous int64 [K] CPU tensors of one length");
  const int64_t n = tokens.numel();
  const int64_t* tp = tokens.data_ptr<int64_t>();
  const int64_t* sp = slot.data_ptr<int64_t>();
  const int64_t* rp = row.data_ptr<int64_t>();
  for (size_t i = 0; i < rings.size(); ++i) {
    const auto& ring = rings[i];
    const auto& v = values[i];
    TORCH_CHECK(ring.device().is_cpu() && ring.dim() == 3 && ring.stride(2) == 1, "kernels.ring_store: ring ", i,
                " must be a CPU [slots, rows, cols] tensor with unit column stride");
    TORCH_CHECK(v.device().is_cpu() && v.dim() == 2 && v.is_contiguous(), "kernels.ring_store: values ", i,
                " must be a contiguous CPU [T, width] tensor");
    const int64_t bytes = v.size(1) * static_cast<int64_t>(v.element_size());
    TORCH_CHECK(ring.size(2) * static_cast<int64_t>(ring.element_size()) == bytes, "kernels.ring_store: ring ", i,
                " rows hold ", ring.size(2) * ring.element_size(), " bytes, its values ", bytes);
    for (int64_t j = 0; j < n; ++j)
      TORCH_CHECK(tp[j] >= 0 && tp[j] < v.size(0) && sp[j] >= 0 && sp[j] < ring.size(0) && rp[j] >= 0 &&
                      rp[j] < ring.size(1),
                  "kernels.ring_store: kept row ", j, " (token ", tp[j], ", slot ", sp[j], ", row ", rp[j],
                  ") is outside ring ", i, " ", ring.sizes(), " or its values ", v.sizes());
  }
  for (size_t i = 0; i < rings.size(); ++i) {
    const auto& ring = rings[i];
    const auto& v = values[i];
    const int64_t es = ring.element_size(), bytes = v.size(1) * static_cast<int64_t>(v.element_size());
    char* base = static_cast<char*>(ring.data_ptr());
    const char* src = static_cast<const char*>(v.data_ptr());
    for (int64_t j = 0; j < n; ++j)
      memcpy(base + (sp[j] * ring.stride(0) + rp[j] * ring.stride(1)) * es, src + tp[j] * bytes, bytes);
  }
}

}  // namespace kvshare_kernels

TORCH_LIBRARY_FRAGMENT(kvshare, m) {
  m.def("fake_quant_fp4(Tensor x, int block, bool ue8m0) -> Tensor");
  m.def("pack_rows(Tensor x, int scheme, int block, int rope_dim, int row_bytes) -> Tensor");
  m.def("unpack_rows(Tensor u8, int scheme, int block, int dim, int rope_dim, ScalarType out_dtype) -> Tensor");
  m.def("ring_store(Tensor(a!)[] rings, Tensor[] values, Tensor tokens, Tensor slot, Tensor row) -> ()");
}

TORCH_LIBRARY_IMPL(kvshare, CPU, m) {
  m.impl("fake_quant_fp4", &kvshare_kernels::fake_quant_fp4);
  m.impl("pack_rows", &kvshare_kernels::pack_rows);
  m.impl("unpack_rows", &kvshare_kernels::unpack_rows);
  m.impl("ring_store", &kvshare_kernels::ring_store);
}
