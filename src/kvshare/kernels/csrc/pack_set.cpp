// The registry of pack sets (see pack_set.h): a map from id to set behind a mutex (registration and
// lookup are rare next to the work of the ops that look a set up: one lookup a call).
#include "pack_set.h"
#include <mutex>
#include <unordered_map>

namespace kvshare_kernels {
namespace {

std::mutex& registry_lock() {
  static std::mutex m;
  return m;
}

std::unordered_map<int64_t, std::shared_ptr<const PackSet>>& registry() {
  static std::unordered_map<int64_t, std::shared_ptr<const PackSet>> sets;
  return sets;
}

}  // namespace

Stamp::Stamp(const torch::Tensor& t)
    : data(t.data_ptr()), version(t.is_inference() ? -1 : static_cast<int64_t>(t._version())), dtype(t.scalar_type()) {}

bool PackSet::fresh() const {
  for (size_t i = 0; i < watch.size(); ++i)
    if (!(Stamp(watch[i]) == stamps[i])) return false;
  return true;
}

int64_t pack_set_new(at::TensorList packs, const torch::Tensor& meta, at::TensorList watch) {
  TORCH_CHECK(meta.scalar_type() == torch::kInt64 && meta.is_contiguous() && meta.dim() == 2 &&
              static_cast<int64_t>(packs.size()) == 2 * meta.size(0),
              "kernels.pack_set_new: meta must be int64 [L, fields] with 2 L pack tensors, got ", meta.sizes(), " and ",
              packs.size(), " tensors");
  auto set = std::make_shared<PackSet>();
  set->packs.assign(packs.begin(), packs.end());
  set->meta = meta;
  set->watch.assign(watch.begin(), watch.end());
  for (const auto& t : watch) set->stamps.emplace_back(t);
  static int64_t next_id = 0;
  std::lock_guard<std::mutex> g(registry_lock());
  const int64_t id = ++next_id;
  registry().emplace(id, std::move(set));
  return id;
}

void pack_set_free(int64_t id) {
  std::lock_guard<std::mutex> g(registry_lock());
  registry().erase(id);
}

std::shared_ptr<const PackSet> pack_set_get(int64_t id, const char* who) {
  std::lock_guard<std::mutex> g(registry_lock());
  auto it = registry().find(id);
  TORCH_CHECK(it != registry().end(), who, ": no pack set ", id, " (freed, or never registered)");
  return it->second;
}

}  // namespace kvshare_kernels

TORCH_LIBRARY_FRAGMENT(kvshare, m) {
  m.def("pack_set_new(Tensor[] packs, Tensor meta, Tensor[] watch) -> int");
  m.def("pack_set_free(int id) -> ()", &kvshare_kernels::pack_set_free);
}

TORCH_LIBRARY_IMPL(kvshare, CompositeExplicitAutograd, m) {
  m.impl("pack_set_new", &kvshare_kernels::pack_set_new);
}
