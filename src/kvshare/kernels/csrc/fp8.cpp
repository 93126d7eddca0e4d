// FP8 e4m3 quantise-dequantise with ue8m0 (power-of-two) scales per `block` values of the last dim,
// the same bits as kvshare.quant.fake_quant_fp8(x, block, ue8m0=True): amax of the block (fp32),
// clamp_min(1e-4), / 448, scale = 2^ceil(log2) from frexp, x / scale clamped to +-448, rounded to
// e4m3 by c10's conversion (torch's), times scale in fp32, rounded to x's dtype (bf16: RNE, as torch).
// A block holding a NaN gives NaN (as torch's amax would spread it).
#include "fp8.h"
#include <c10/util/Float8_e4m3fn.h>
#include <cmath>
#include <limits>
#include <vector>

namespace kvshare_kernels {

torch::Tensor fake_quant_fp8(const torch::Tensor& x, int64_t block) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat32),
              "kernels.fake_quant_fp8: x must be a bf16 / fp32 CPU tensor, got ", x.scalar_type(), " on ", x.device());
  TORCH_CHECK(block > 0 && x.dim() >= 1 && x.size(-1) % block == 0,
              "kernels.fake_quant_fp8: last dim ", x.dim() ? x.size(-1) : 0, " is not a multiple of the block ", block);
  auto xc = x.contiguous();
  auto out = torch::empty(xc.sizes(), xc.options());
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

}  // namespace kvshare_kernels

TORCH_LIBRARY_FRAGMENT(kvshare, m) {
  m.def("fake_quant_fp8(Tensor x, int block) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvshare, CPU, m) {
  m.impl("fake_quant_fp8", &kvshare_kernels::fake_quant_fp8);
}
