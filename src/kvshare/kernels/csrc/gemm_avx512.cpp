// The AVX-512 BF16 GEMM with AVX-512 BW weight decoders (any AVX-512 BF16 CPU); see gemm_avx512_unit.h.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,avx2,f16c")
#include "gemm_avx512_unit.h"

namespace kvshare_kernels {
void gemm_avx512_bw(const GemmArgs* a) { gemm_dispatch(a); }
}  // namespace kvshare_kernels
