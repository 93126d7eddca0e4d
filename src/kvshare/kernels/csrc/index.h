// Lightning-indexer scores and top-k (index.cpp) for query rows whose index keys are read in place:
// from the paged pool through the block table, or from a gathered [N][L][d] tensor. Each row is
// computed from its own inputs only (its bits never depend on the other rows of the call).
#pragma once
#include <stdint.h>

namespace kvshare_kernels {

// Where row t's index key j lives: pool (tables != null): entry j of sequence seq[t] at position
// j * ratio, block tables[seq][pos / block_size] (invalid past the table), row (pos % block_size) /
// ratio, bytes at keys + block * block_stride + row * row_stride; dense (tables null): bytes at
// keys + seq[t] * block_stride + j * row_stride (j < dense_rows).
struct IndexKeys {
  const uint8_t* keys;
  int bf16;  // the keys' dtype: bf16 or fp32
  int64_t block_stride, row_stride;
  const int64_t* tables;
  int64_t table_cols, ratio, block_size, dense_rows;
  const int64_t* seq;
};

// For rows t in [t0, t1): score_j = sum over h (in order, from +0) of w[t][h] * relu(q[t][h] . k_j)
// for j < counts[t] (each dot product: 8 fma lanes over d, lanes added pairwise; every product and
// sum rounded to fp32; an invalid key scores -inf), then picks[t] = the k highest scores, ties to
// the lower j (a stable descending sort), -inf never picked, listed in ascending j, -1 padded.
// q [T][H][d] and w [T][H] fp32; d % 8 == 0.
void index_topk(const float* q, const float* w, int64_t H, int64_t d, const IndexKeys& keys, const int64_t* counts,
                int64_t k, int64_t t0, int64_t t1, int64_t* picks);

}  // namespace kvshare_kernels
