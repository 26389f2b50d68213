#include "moe/node/routing_trace.h"

#include <algorithm>
#include <filesystem>

#include "moe/base/check.h"
#include "moe/io/safetensors.h"

namespace moe::node {

RoutingTrace::RoutingTrace(int layers, int experts, int top_k, int hidden, int64_t cap, bool keep_hidden)
    : experts_(experts),
      top_k_(top_k),
      hidden_(hidden),
      cap_(cap),
      keep_hidden_(keep_hidden),
      rows_(layers, 0),
      ids_(layers),
      weights_(layers),
      x_(layers) {}

void RoutingTrace::add(int layer, int64_t T, const int32_t* ids, const float* weights, const float* x) {
  const int64_t n = std::min(T, cap_ - rows_[layer]);
  if (n <= 0) return;
  ids_[layer].insert(ids_[layer].end(), ids, ids + n * top_k_);
  weights_[layer].insert(weights_[layer].end(), weights, weights + n * top_k_);
  if (keep_hidden_) x_[layer].insert(x_[layer].end(), x, x + n * hidden_);
  rows_[layer] += n;
}

std::string RoutingTrace::write(const std::string& dir, const std::string& job_id, int rank) const {
  std::filesystem::create_directories(dir);
  io::SafetensorsWriter w;
  static const int32_t no_id = 0;  // a layer without rows: an empty tensor (its data is never read)
  static const float no_value = 0;
  for (size_t l = 0; l < rows_.size(); ++l) {
    const std::string name = "layer" + std::to_string(l);
    w.add_i32(name + ".topk_ids", {rows_[l], top_k_}, rows_[l] ? ids_[l].data() : &no_id);
    w.add_f32(name + ".topk_weights", {rows_[l], top_k_}, rows_[l] ? weights_[l].data() : &no_value);
    if (keep_hidden_) w.add_f32(name + ".hidden", {rows_[l], hidden_}, rows_[l] ? x_[l].data() : &no_value);
  }
  w.set_metadata("job", job_id);
  w.set_metadata("rank", std::to_string(rank));
  w.set_metadata("layers", std::to_string(rows_.size()));
  w.set_metadata("experts", std::to_string(experts_));
  w.set_metadata("top_k", std::to_string(top_k_));
  w.set_metadata("hidden", std::to_string(hidden_));
  const std::string path = (std::filesystem::path(dir) / ("routing-rank" + std::to_string(rank) + ".safetensors")).string();
  w.write(path);
  return path;
}

}  // namespace moe::node
