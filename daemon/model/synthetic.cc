#include "moe/model/synthetic.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>

#include "moe/model/counter_rng.h"
#include "moe/base/check.h"

namespace moe::model {
namespace {

// Tensor ids of the weight key.
enum Tensor : uint64_t { kGate = 1, kGateProj = 2, kUpProj = 3, kDownProj = 4, kSkew = 5, kSharedGate = 6 };
// The shared experts draw as expert number -1 (key 2^64 - 1) with the experts' tensor ids.
constexpr int kSharedExpert = -1;
constexpr uint64_t kInputTag = 0x1e9u;

// out[i] = scale x value i of the draws keyed by key.hash(0), key.hash(1), ...
// (values 2j and 2j + 1: draw j's two); n may be odd. Bits do not depend on how a
// tensor is split into calls: the hashes are scalar, then the Box-Muller loop
// runs over blocks of them, the same float operations in every lane.
void fill_normal_pairs(const KeyPrefix& key, int64_t n, float scale, float* out) {
  constexpr int64_t kBlock = 256;  // pairs
  uint32_t hi[kBlock], lo[kBlock];
  float a[kBlock], b[kBlock];
  for (int64_t p0 = 0; p0 < (n + 1) / 2; p0 += kBlock) {
    const int64_t np = std::min(kBlock, (n + 1) / 2 - p0);
    for (int64_t j = 0; j < np; ++j) {
      const uint64_t h = key.hash(static_cast<uint64_t>(p0 + j));
      hi[j] = static_cast<uint32_t>(h >> 32);
      lo[j] = static_cast<uint32_t>(h);
    }
    for (int64_t j = 0; j < np; ++j) box_muller_f32(hi[j], lo[j], &a[j], &b[j]);
    float* o = out + 2 * p0;
    const int64_t whole = std::min(np, (n - 2 * p0) / 2);  // the last draw of an odd n gives one value
    for (int64_t j = 0; j < whole; ++j) {
      o[2 * j] = scale * a[j];
      o[2 * j + 1] = scale * b[j];
    }
    if (whole < np) o[2 * whole] = scale * a[whole];
  }
}

// Tensor t of (layer, expert), n values ~ N(0, stddev^2): pairs keyed by (seed, layer, expert, t, pair).
void fill_tensor(uint64_t seed, int layer, int expert, Tensor tensor, int64_t n, double stddev, float* out) {
  const KeyPrefix key({seed, static_cast<uint64_t>(layer), static_cast<uint64_t>(expert), tensor});
  fill_normal_pairs(key, n, static_cast<float>(stddev), out);
}

}  // namespace

void fill_inputs(uint64_t seed, int64_t step, int64_t token_begin, int64_t T, int H, float* x) {
  for (int64_t t = 0; t < T; ++t) {
    const KeyPrefix key({kInputTag, seed, static_cast<uint64_t>(step), static_cast<uint64_t>(token_begin + t)});
    fill_normal_pairs(key, H, 1.0f, x + t * H);
  }
}

void fill_expert_weights(uint64_t seed, int layer, const LayerShape& s, int expert, float* w13, float* w2) {
  const int64_t H = s.hidden, I = s.ffn_hidden;
  const double in_std = 1.0 / std::sqrt(static_cast<double>(H));
  fill_tensor(seed, layer, expert, kGateProj, I * H, in_std, w13);
  fill_tensor(seed, layer, expert, kUpProj, I * H, in_std, w13 + I * H);
  fill_tensor(seed, layer, expert, kDownProj, H * I, 1.0 / std::sqrt(static_cast<double>(I)), w2);
}

namespace {

// Shared experts: gate_proj and up_proj ~ N(0, 1/H), down_proj ~ N(0, 1/Is), the gate ~ N(0, 1/H).
void add_shared_weights(uint64_t seed, int layer, const LayerShape& s, LayerWeights& w) {
  const int64_t H = s.hidden, Is = s.shared_ffn_hidden;
  if (Is == 0) return;
  const double in_std = 1.0 / std::sqrt(static_cast<double>(H));
  const double down_std = 1.0 / std::sqrt(static_cast<double>(Is));
  w.shared_w13.resize(2 * Is * H);
  w.shared_w2.resize(H * Is);
  fill_tensor(seed, layer, kSharedExpert, kGateProj, Is * H, in_std, w.shared_w13.data());
  fill_tensor(seed, layer, kSharedExpert, kUpProj, Is * H, in_std, w.shared_w13.data() + Is * H);
  fill_tensor(seed, layer, kSharedExpert, kDownProj, H * Is, down_std, w.shared_w2.data());
  if (!s.shared_gate) return;
  w.shared_gate.resize(H);
  fill_tensor(seed, layer, kSharedExpert, kSharedGate, H, in_std, w.shared_gate.data());
}

}  // namespace

LayerWeights make_layer_weights(uint64_t seed, int layer, const LayerShape& s) {
  return make_layer_weights(seed, layer, s, std::vector<bool>(s.num_experts, true));
}

LayerWeights make_layer_weights(uint64_t seed, int layer, const LayerShape& s, const std::vector<bool>& needed,
                                const ForEach& for_each) {
  const int64_t H = s.hidden, I = s.ffn_hidden, E = s.num_experts;
  MOE_CHECK(static_cast<int64_t>(needed.size()) == E, "make_layer_weights: needed has ", needed.size(),
            " entries for ", E, " experts");
  LayerWeights w;
  w.gate.resize(E * H);
  w.w13.resize(E * 2 * I * H);
  w.w2.resize(E * H * I);
  const double in_std = 1.0 / std::sqrt(static_cast<double>(H));
  const auto expert = [&](int64_t e) {
    fill_tensor(seed, layer, static_cast<int>(e), kGate, H, in_std, &w.gate[e * H]);
    if (needed[e]) fill_expert_weights(seed, layer, s, static_cast<int>(e), &w.w13[e * 2 * I * H], &w.w2[e * H * I]);
  };
  if (for_each)
    for_each(E, expert);
  else
    for (int64_t e = 0; e < E; ++e) expert(e);
  add_shared_weights(seed, layer, s, w);
  return w;
}

std::vector<float> skew_logit_bias(const std::string& skew, uint64_t seed, int E) {
  if (skew.empty() || skew == "uniform") return {};
  const std::string prefix = "zipf:";
  MOE_CHECK(skew.rfind(prefix, 0) == 0, "skew: unknown value '", skew,
            "' (expected uniform or zipf:ALPHA)");
  char* end = nullptr;
  const std::string num = skew.substr(prefix.size());
  const double alpha = std::strtod(num.c_str(), &end);
  MOE_CHECK(!num.empty() && end && *end == '\0' && std::isfinite(alpha) && alpha >= 0,
            "skew: ALPHA in '", skew, "' must be a finite number >= 0");
  // p: a seed-derived permutation (sort experts by a keyed hash).
  std::vector<int> order(E);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) {
    const uint64_t ha = key_hash({seed, kSkew, static_cast<uint64_t>(a)});
    const uint64_t hb = key_hash({seed, kSkew, static_cast<uint64_t>(b)});
    return ha != hb ? ha < hb : a < b;
  });
  std::vector<float> bias(E);
  for (int rank = 0; rank < E; ++rank)
    bias[order[rank]] = static_cast<float>(-alpha * std::log1p(static_cast<double>(rank)));
  return bias;
}

void round_to_bf16(std::vector<float>& v) {
  for (float& f : v) f = kernels::round_to_bf16(f);
}

std::vector<uint8_t> to_storage(const std::vector<float>& v, kernels::DType dtype) {
  std::vector<uint8_t> out(v.size() * kernels::dtype_size(dtype) + 1);
  if (dtype == kernels::DType::kF32) {
    if (!v.empty()) std::memcpy(out.data(), v.data(), 4 * v.size());
  } else {
    auto* p = reinterpret_cast<kernels::bf16_t*>(out.data());
    for (size_t i = 0; i < v.size(); ++i) p[i] = kernels::f32_to_bf16(v[i]);
  }
  return out;
}

std::vector<float> from_storage(const void* data, size_t count, kernels::DType dtype) {
  std::vector<float> v(count);
  for (size_t i = 0; i < count; ++i)
    v[i] = dtype == kernels::DType::kF32 ? static_cast<const float*>(data)[i]
                                        : kernels::bf16_to_f32(static_cast<const kernels::bf16_t*>(data)[i]);
  return v;
}

}  // namespace moe::model
