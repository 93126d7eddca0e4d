// Paged attention and the lightning indexer's top-k as torch ops (attn.h, index.h: keys read in place from
// the cache), and `index_select`, the indexer's query side (attn_proj.h `index_query`) and top-k in one
// call. Every address a row can reach is checked here, so the kernels never read outside the tensors.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "attn.h"
#include "attn_proj.h"
#include "checks.h"
#include "index.h"

namespace kvshare_kernels {
namespace {

using Tensor = torch::Tensor;
using OptTensor = c10::optional<torch::Tensor>;

// ---- paged attention (attn.h): keys read in place from the window ring, the step's rows and the pool ----
// q [T, H, d]; ring uint8 [slots, rows, bytes]; step [S, d] (the step's rows) in q's dtype; meta int64 [T, 4]
// (slot, pos, chunk start, first step row); optional pool uint8 [blocks, rows, bytes] with
// tables int64 [N, C], seq int64 [T] and picks int64 [T, m] or counts int64 [T]. codecs = (scheme, block,
// rope_dim) of the ring's rows, then of the pool's (row_codec.h; scheme -1: values of q's dtype). Every
// address a row can reach and every row's length are checked here, so the kernel never reads outside the tensors.

// The layout of rows of d values given as (scheme, block, rope_dim), and the bytes a row needs.
RowCodec codec_of(at::IntArrayRef codecs, int64_t at, int64_t d, const char* what) {
  const RowCodec c{static_cast<int>(codecs[at]), codecs[at + 1], d, codecs[at + 2]};
  TORCH_CHECK(c.scheme == ROW_PLAIN || codec_valid(c), "kernels.paged_attention: the ", what, "'s row layout (scheme ",
              c.scheme, ", block ", c.block, ", rope dims ", c.rope_dim, ") does not fit rows of ", d, " values");
  return c;
}

int64_t row_bytes(const RowCodec& c, int64_t d, int64_t esz) { return c.scheme == ROW_PLAIN ? d * esz : codec_row_bytes(c); }
Tensor paged_attention_op(const Tensor& q, const Tensor& ring, const Tensor& step, const Tensor& meta, int64_t w,
                          const OptTensor& pool, const OptTensor& tables, const OptTensor& seq, const OptTensor& picks,
                          const OptTensor& counts, int64_t ratio, int64_t block_size, const Tensor& sink, double scale,
                          at::IntArrayRef codecs) {
  constexpr const char* op = "paged_attention";
  check_stream_dtype(q, op, "q");
  check_rows(step, op, "step", q.scalar_type());
  check_rows(meta, op, "meta", torch::kInt64);
  check_rows(sink, op, "sink", torch::kFloat32);
  TORCH_CHECK(q.dim() == 3 && q.size(2) % 8 == 0 && q.size(2) <= 1024, "kernels.paged_attention: q must be [T, H, d] with d a multiple of 8 up to 1024, got ", q.sizes());
  const int64_t t = q.size(0), h = q.size(1), d = q.size(2), esz = q.element_size();
  TORCH_CHECK(codecs.size() == 6, "kernels.paged_attention: codecs must be 6 ints (ring, then pool: scheme, block, rope dims)");
  const RowCodec ring_codec = codec_of(codecs, 0, d, "ring"), pool_codec = codec_of(codecs, 3, d, "pool");
  const int64_t ring_bytes = row_bytes(ring_codec, d, esz), pool_bytes = row_bytes(pool_codec, d, esz);
  TORCH_CHECK(sink.numel() == h, "kernels.paged_attention: sink has ", sink.numel(), " entries for ", h, " heads");
  TORCH_CHECK(step.dim() == 2 && step.size(1) == d, "kernels.paged_attention: step ", step.sizes(), " does not fit q ", q.sizes());
  TORCH_CHECK(meta.dim() == 2 && meta.size(0) == t && meta.size(1) == 4, "kernels.paged_attention: meta must be [T, 4], got ", meta.sizes());
  TORCH_CHECK(ring.device().is_cpu() && ring.scalar_type() == torch::kUInt8 && ring.dim() == 3 && ring.stride(2) == 1 &&
              ring.size(2) >= ring_bytes && ring.size(1) >= 1, "kernels.paged_attention: ring must be uint8 [slots, rows, >= ", ring_bytes, "] with unit byte stride, got ", ring.sizes());
  TORCH_CHECK(w >= 0 && w <= ring.size(1), "kernels.paged_attention: window ", w, " is deeper than the ring's ", ring.size(1), " rows");
  const int64_t* mp = meta.data_ptr<int64_t>();
  for (int64_t r = 0; r < t; ++r) {  // slot in range; step rows of the window inside [0, T)
    const int64_t slot = mp[4 * r], pos = mp[4 * r + 1], start = mp[4 * r + 2], first = mp[4 * r + 3];
    TORCH_CHECK(slot >= 0 && slot < ring.size(0) && start <= pos && first >= 0 && first + pos - start < step.size(0),
                "kernels.paged_attention: meta row ", r, " (slot ", slot, ", pos ", pos, ", start ", start, ", first ", first, ") is outside the ring or the step");
  }
  WindowKeys win{ring.data_ptr<uint8_t>(), ring.stride(0), ring.stride(1), ring.size(1), ring_codec,
                     reinterpret_cast<const uint8_t*>(step.data_ptr()), d * esz, mp, w};
  PoolKeys pk{};
  const bool has_pool = pool.has_value();
  if (has_pool) {
    TORCH_CHECK(tables.has_value() && seq.has_value() && (picks.has_value() != counts.has_value()),
                "kernels.paged_attention: a pool needs tables, seq and exactly one of picks / counts");
    TORCH_CHECK(pool->device().is_cpu() && pool->scalar_type() == torch::kUInt8 && pool->dim() == 3 && pool->stride(2) == 1 &&
                pool->size(2) >= pool_bytes, "kernels.paged_attention: pool must be uint8 [blocks, rows, >= ", pool_bytes, "] with unit byte stride, got ", pool->sizes());
    check_rows(*tables, op, "tables", torch::kInt64);
    check_rows(*seq, op, "seq", torch::kInt64);
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
      check_rows(*picks, op, "picks", torch::kInt64);
      TORCH_CHECK(picks->dim() == 2 && picks->size(0) == t, "kernels.paged_attention: picks must be [T, m], got ", picks->sizes());
      m = picks->size(1);
      pp = picks->data_ptr<int64_t>();
    } else {
      check_rows(*counts, op, "counts", torch::kInt64);
      TORCH_CHECK(counts->numel() == t, "kernels.paged_attention: counts must be [T]");
      cp = counts->data_ptr<int64_t>();
      for (int64_t r = 0; r < t; ++r) TORCH_CHECK(cp[r] >= 0 && cp[r] <= tables->size(1) * (block_size / ratio), "kernels.paged_attention: counts[", r, "] = ", cp[r], " is past the block table");
    }
    pk = PoolKeys{pool->data_ptr<uint8_t>(), pool->stride(0), pool->stride(1), pool_codec, tp, tables->size(1), sp, pp, m, cp,
                      ratio, block_size};
  }
  auto out = torch::empty(q.sizes(), q.options());
  if (t == 0 || h == 0) return out;
  const bool bf16 = q.scalar_type() == torch::kBFloat16;
  at::parallel_for(0, t, 4, [&](int64_t b, int64_t e) {
    paged_attention(q.data_ptr(), bf16, h, d, win, has_pool ? &pk : nullptr, sink.data_ptr<float>(),
                        static_cast<float>(scale), b, e, out.data_ptr());
  });
  return out;
}

// ---- indexer scores + top-k (index.h): keys in place from the pool (tables given: keys uint8 [blocks,
// rows, >= d * esz]) or from a gathered tensor keys [N, L, d] (no tables); q [T, H, d], w [T, H] fp32;
// seq, counts int64 [T]; picks int64 [T, k]. Every address a row can reach is checked here.
Tensor index_topk_op(const Tensor& q, const Tensor& w, const Tensor& keys, bool keys_bf16, const OptTensor& tables,
                     const Tensor& seq, const Tensor& counts, int64_t ratio, int64_t block_size, int64_t k) {
  constexpr const char* op = "index_topk";
  check_rows(q, op, "q", torch::kFloat32);
  check_rows(w, op, "w", torch::kFloat32);
  check_rows(seq, op, "seq", torch::kInt64);
  check_rows(counts, op, "counts", torch::kInt64);
  TORCH_CHECK(q.dim() == 3 && q.size(2) % 8 == 0, "kernels.index_topk: q must be [T, H, d] with d a multiple of 8, got ", q.sizes());
  const int64_t t = q.size(0), h = q.size(1), d = q.size(2), esz = keys_bf16 ? 2 : 4;
  TORCH_CHECK(w.dim() == 2 && w.size(0) == t && w.size(1) == h, "kernels.index_topk: w ", w.sizes(), " does not fit q ", q.sizes());
  TORCH_CHECK(seq.numel() == t && counts.numel() == t, "kernels.index_topk: seq and counts must be [T]");
  TORCH_CHECK(k >= 1, "kernels.index_topk: k must be >= 1, got ", k);
  TORCH_CHECK(keys.device().is_cpu() && keys.dim() == 3 && keys.stride(2) == 1, "kernels.index_topk: keys must be a CPU [., ., .] tensor with unit last stride, got ", keys.sizes());
  const int64_t* sp = seq.data_ptr<int64_t>();
  const int64_t* cp = counts.data_ptr<int64_t>();
  IndexKeys ik{};
  ik.keys = reinterpret_cast<const uint8_t*>(keys.data_ptr());
  ik.bf16 = keys_bf16 ? 1 : 0;
  ik.seq = sp;
  if (tables.has_value()) {
    check_rows(*tables, op, "tables", torch::kInt64);
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
    index_topk(q.data_ptr<float>(), w.data_ptr<float>(), h, d, ik, cp, k, b, e, picks.data_ptr<int64_t>());
  });
  return picks;
}

// The indexer's query side and its top-k in one call (`kernels.attn_proj.index_select`): index_query,
// then `index_topk` over the keys (in place with `tables`, else gathered rows). No tensor when stale.
std::vector<Tensor> index_select_op(const Tensor& qr, const Tensor& x, int64_t set, const Tensor& c, const Tensor& s,
                                    int64_t heads, double scale, int64_t qr_block, c10::string_view isa,
                                    const Tensor& keys, bool keys_bf16, const OptTensor& tables, const Tensor& seq,
                                    const Tensor& counts, int64_t ratio, int64_t block_size, int64_t k) {
  const auto ps = pack_set_get(set, "kernels.index_select");
  auto qw = index_query(qr, x, *ps, c, s, heads, scale, qr_block, std::string(isa));
  if (!qw.has_value()) return {};
  return {index_topk_op((*qw)[0], (*qw)[1], keys, keys_bf16, tables, seq.contiguous(), counts.contiguous(), ratio,
                        block_size, k)};
}

}  // namespace
}  // namespace kvshare_kernels

TORCH_LIBRARY_FRAGMENT(kvshare, m) {
  m.def("paged_attention(Tensor q, Tensor ring, Tensor step, Tensor meta, int w, Tensor? pool, Tensor? tables, "
        "Tensor? seq, Tensor? picks, Tensor? counts, int ratio, int block_size, Tensor sink, float scale, "
        "int[] codecs) -> Tensor");
  m.def("index_topk(Tensor q, Tensor w, Tensor keys, bool keys_bf16, Tensor? tables, Tensor seq, Tensor counts, "
        "int ratio, int block_size, int k) -> Tensor");
  // set: a pack set (pack_set.h) of wq_b and weights_proj
  m.def("index_select(Tensor qr, Tensor x, int set, Tensor c, Tensor s, int heads, float scale, int qr_block, "
        "str isa, Tensor keys, bool keys_bf16, Tensor? tables, Tensor seq, Tensor counts, int ratio, int block_size, "
        "int k) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(kvshare, CPU, m) {
  namespace kk = kvshare_kernels;
  m.impl("paged_attention", &kk::paged_attention_op);
  m.impl("index_topk", &kk::index_topk_op);
  m.impl("index_select", &kk::index_select_op);
}
