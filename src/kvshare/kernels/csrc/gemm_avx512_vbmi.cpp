// The AVX-512 BF16 GEMM with the VBMI FP4 decoder and GFNI byte shifts in the FP8 one (CPUs with AVX-512
// VBMI and GFNI: Ice Lake, Sapphire Rapids, Zen 4 and later); the same bits as gemm_avx512.cpp. See
// gemm_avx512_unit.h.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi,gfni,fma,avx2,f16c")
#define KV_VBMI 1
#include "gemm_avx512_unit.h"

namespace kvshare_kernels {
void gemm_avx512_vbmi(const GemmArgs* a) { gemm_dispatch(a); }
}  // namespace kvshare_kernels
