// See packed_gemm.h. The checks and the thread split are gemm_run.cpp `gemm`'s.
#include "packed_gemm.h"
#include <ATen/Parallel.h>

namespace kvshare_kernels {

GemmPath gemm_path(const std::string& isa, const char* who) {
  if (isa == "amx") return GemmPath::AMX;
  if (isa == "avx512") return GemmPath::AVX512;
  TORCH_CHECK(isa == "avx2", who, ": unknown isa ", isa);
  return GemmPath::AVX2;
}

PackedLin packed_lin(const int64_t* r, const torch::Tensor& data, const torch::Tensor& exps, const char* who,
                     int64_t i) {
  PackedLin l{static_cast<int>(r[0]), r[1], r[2], r[3], r[4], static_cast<int>(r[5]), data.data_ptr(),
              exps.numel() ? static_cast<const uint8_t*>(exps.data_ptr()) : nullptr};
  const bool f32 = l.fmt == FMT_FP32;
  TORCH_CHECK(l.fmt >= 0 && l.fmt <= 3, who, ": linear ", i, " has unknown format ", l.fmt);
  TORCH_CHECK(data.is_contiguous() && exps.is_contiguous() && data.device().is_cpu() && exps.device().is_cpu(),
              who, ": packed weight ", i, " must be contiguous CPU tensors");
  TORCH_CHECK(l.n >= 1 && l.k >= 1, who, ": linear ", i, " is ", l.n, " x ", l.k);
  TORCH_CHECK(f32 ? l.kp == l.k : (l.kp % 2 == 0 && l.kp >= l.k && l.kp - l.k < 2), who, ": linear ", i,
              " has bad padded K ", l.kp);
  TORCH_CHECK(l.fmt == FMT_BF16 || f32 || (l.bk >= 2 && l.bk <= 256 && l.bk % 2 == 0), who, ": linear ", i,
              " has bad scale block ", l.bk);
  const int64_t groups = (l.n + 15) / 16;
  const int64_t bytes = f32 ? groups * l.k * 64
                            : groups * (l.kp / 2) * 16 * (l.fmt == FMT_FP8 ? 2 : 4) / (l.fmt == FMT_FP4 ? 4 : 1);
  TORCH_CHECK(data.numel() * data.element_size() == bytes, who, ": packed weight ", i, " has ",
              data.numel() * data.element_size(), " bytes, expected ", bytes);
  const int64_t n_exps = (l.fmt == FMT_BF16 || f32) ? 0 : groups * ((l.kp + l.bk - 1) / l.bk);
  TORCH_CHECK(l.fmt == FMT_BF16 || f32 || exps.numel() == (l.group_exps ? n_exps : n_exps * 16), who, ": linear ",
              i, " has ", exps.numel(), " scale exponents");
  TORCH_CHECK(!l.group_exps || l.fmt == FMT_FP8, who, ": linear ", i, " has group exponents but is not FP8");
  return l;
}

void packed_gemm(const PackedLin& l, const void* x, int64_t m, void* y, GemmPath path) {
  if (m == 0) return;
  const int64_t nb = (l.n + 15) / 16;
  const bool amx = path == GemmPath::AMX && l.fmt != FMT_FP32 && l.kp % 32 == 0 && (l.fmt == FMT_BF16 || l.bk % 32 == 0);
  const GemmArgs base{l.fmt, x, l.w, l.exps, y, m, l.n, l.k, l.kp, l.bk, 0, nb, l.group_exps, 0};
  at::parallel_for(0, (nb + 1) / 2, 1, [&](int64_t lo, int64_t hi) {
    GemmArgs a = base;
    a.nb0 = lo * 2;
    a.nb1 = std::min(hi * 2, nb);
    if (amx) gemm_amx(&a);
    else if (path != GemmPath::AVX2) gemm_avx512(&a);
    else gemm_avx2(&a);
  });
}

}  // namespace kvshare_kernels
