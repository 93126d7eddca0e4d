// Paged sparse attention (attn.cpp): the attention of model/attention.py for query rows whose keys
// are read in place, where they are stored, instead of being gathered into new tensors first:
// the window ring of each row's slot and this step's window rows, then compressed rows of the
// paged pool addressed through the block table. Rows of one call are independent (each row's bits
// depend on its own inputs only), so a call may be split over threads.
#pragma once
#include <stdint.h>
#include "row_codec.h"

namespace kvshare_kernels {

// The window keys of query row t: positions p - W + 1 .. p (p = meta[t].pos). Position x < 0 is
// invalid; x >= meta[t].start (the row's chunk start) is this step's row meta[t].first + x - start
// of `step` ([T][d] in the rows' dtype); earlier positions are ring row x mod ring_rows of slot
// meta[t].slot (bytes at ring + slot * slot_stride + row * row_stride), stored as `codec` says (ROW_PLAIN:
// values of q's dtype).
struct WindowKeys {
  const uint8_t* ring;
  int64_t slot_stride, row_stride, ring_rows;
  RowCodec codec;
  const uint8_t* step;
  int64_t step_stride;
  const int64_t* meta;  // [T][4]: slot, pos, start, first
  int64_t W;
};

// The compressed keys of query row t: entries j of its sequence seq[t]: picks[t][0..m) (-1 = none)
// or, with picks null, j = 0 .. counts[t] - 1. Entry j sits at position j * ratio, in block
// tables[seq][pos / block_size] (invalid when that column is past the table), row
// (pos % block_size) / ratio: bytes at pool + block * block_stride + row * row_stride, stored as `codec` says.
struct PoolKeys {
  const uint8_t* pool;
  int64_t block_stride, row_stride;
  RowCodec codec;
  const int64_t* tables;
  int64_t table_cols;
  const int64_t* seq;
  const int64_t* picks;
  int64_t m;
  const int64_t* counts;
  int64_t ratio, block_size;
};

// o[t][h] for rows t in [t0, t1): keys = the row's window keys, then its compressed keys (pool may be
// null), in that order; the same arithmetic as sparse_attention (decode.h), so the same bits as it
// over the same keys gathered: s_i = (q . k_i) * scale (8 fma lanes over d, lanes added pairwise),
// invalid keys -inf; m = max(max s, sink_h); p_i = exp(s_i - m) (SLEEF); o = (sum_i p_i k_i) /
// (sum_i p_i + exp(sink_h - m)), sums in key order; stored in q's dtype. q and the step's rows: bf16
// (bf16 != 0) or fp32; d % 8 == 0, d <= 1024. Quantised ring / pool rows are decoded (decode_row) and
// rounded to q's dtype once per query row and key, so the bits are those of the kernel over the rows
// `RowFormat.unpack(rows, q.dtype)` gives.
void paged_attention(const void* q, int bf16, int64_t H, int64_t d, const WindowKeys& win, const PoolKeys* pool,
                     const float* sink, float scale, int64_t t0, int64_t t1, void* out);

}  // namespace kvshare_kernels
