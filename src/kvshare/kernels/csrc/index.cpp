// Lightning-indexer scores and top-k (see index.h). Compiled like decode.cpp: AVX2 + FMA,
// floating-point contraction off (the only fused multiply-adds are the explicit ones).
#pragma GCC target("avx2,fma,f16c")
#pragma GCC optimize("fp-contract=off")
#include <immintrin.h>
#include <math.h>
#include <string.h>
#include <algorithm>
#include <vector>
#include "index.h"
#include "lanes8.h"

namespace kvshare_kernels {
namespace {

const uint8_t* key_of(const IndexKeys& c, int64_t t, int64_t j) {
  const int64_t s = c.seq[t];
  if (c.tables == nullptr) return j < c.dense_rows ? c.keys + s * c.block_stride + j * c.row_stride : nullptr;
  const int64_t p = j * c.ratio;
  const int64_t col = p / c.block_size;
  if (col >= c.table_cols) return nullptr;
  return c.keys + c.tables[s * c.table_cols + col] * c.block_stride + ((p % c.block_size) / c.ratio) * c.row_stride;
}

}  // namespace

void index_topk(const float* q, const float* w, int64_t H, int64_t d, const IndexKeys& keys, const int64_t* counts,
                int64_t k, int64_t t0, int64_t t1, int64_t* picks) {
  const int64_t nv = d / 8;
  std::vector<float> score;
  std::vector<int64_t> order;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n = counts[t];
    score.assign(n, -INFINITY);
    const float* qt = q + t * H * d;
    const float* wt = w + t * H;
    for (int64_t j = 0; j < n; ++j) {
      const uint8_t* kp = key_of(keys, t, j);
      if (kp == nullptr) continue;
      float s = 0.0f;
      for (int64_t h = 0; h < H; ++h) {
        __m256 dot = _mm256_setzero_ps();
        for (int64_t v = 0; v < nv; ++v)
          dot = _mm256_fmadd_ps(_mm256_loadu_ps(qt + h * d + v * 8), load8(kp, keys.bf16, v * 8), dot);
        const float r = hsum8(dot);
        s += wt[h] * (r > 0.0f ? r : 0.0f);
      }
      score[j] = s;
    }
    order.clear();
    for (int64_t j = 0; j < n; ++j)
      if (score[j] > -INFINITY) order.push_back(j);  // -inf (and NaN) never picked
    if (static_cast<int64_t>(order.size()) > k) {
      auto better = [&](int64_t a, int64_t b) { return score[a] > score[b] || (score[a] == score[b] && a < b); };
      std::nth_element(order.begin(), order.begin() + k, order.end(), better);
      order.resize(k);
      std::sort(order.begin(), order.end());
    }
    int64_t* out = picks + t * k;
    const int64_t m = static_cast<int64_t>(order.size());
    for (int64_t i = 0; i < k; ++i) out[i] = i < m ? order[i] : -1;
  }
}

}  // namespace kvshare_kernels
