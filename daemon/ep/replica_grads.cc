#include "moe/ep/replica_grads.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "moe/base/check.h"
#include "moe/ep/ep_rebalance.h"

namespace moe::ep {

namespace {

// A tag's phase within one expert's reduction.
enum Phase : uint32_t { kCount = 0, kPairs = 1, kSum = 2, kPhases = 3 };

// The layer's config for the primary's own stage: one expert, one pair a row.
MoeLayerConfig merge_config(MoeLayerConfig cfg) {
  cfg.top_k = 1;
  return cfg;
}

}  // namespace

ReplicaGradReduction::ReplicaGradReduction(const MoeLayerConfig& cfg, transport::Communicator& comm,
                                           kernels::Backend& be, uint32_t tag_base, std::chrono::milliseconds timeout,
                                           bool exact)
    : cfg_(cfg),
      n13_(2 * static_cast<size_t>(cfg.ffn_hidden) * cfg.hidden),
      n2_(static_cast<size_t>(cfg.hidden) * cfg.ffn_hidden),
      row_bytes_(kernels::dtype_size(cfg.dtype) * cfg.hidden),
      comm_(comm),
      be_(be),
      tag_base_(tag_base),
      timeout_(timeout),
      exact_(exact) {}

ReplicaGradReduction::~ReplicaGradReduction() = default;

void ReplicaGradReduction::run(const ExpertMap& map, ExpertStage& experts, StagedExperts* staged,
                               const ReceivedRows& rows) {
  rows_ = rows;
  host_.valid = false;  // read at the first expert that needs this rank's pairs
  acc_.resize(n13_ + n2_);
  msg_.resize(n13_ + n2_);
  for (int e = 0; e < map.num_experts; ++e) {
    const bool shadows = staged && !staged->shadows_of(e).empty();
    if (map.logcnt[e] >= 2 || shadows) reduce_expert(e, map, experts, staged);
  }
}

// This rank's pairs of `expert` (every slot of it here), in received-row order.
ReplicaGradReduction::Pairs ReplicaGradReduction::local_pairs(int expert, const ExpertMap& map) {
  const int me = comm_.rank(), S = map.slots_per_rank, K = cfg_.top_k;
  const int64_t N = rows_.num_rows;
  if (!host_.valid) {  // once a step: the slots, weights and rows to the host
    host_.slot.resize(N * K);
    host_.weight.resize(N * K);
    host_.x.resize(N * row_bytes_);
    host_.grad.resize(N * row_bytes_);
    be_.copy_to_host(host_.slot.data(), rows_.slot, 4 * N * K);
    be_.copy_to_host(host_.weight.data(), rows_.weight, 4 * N * K);
    be_.copy_to_host(host_.x.data(), rows_.x, N * row_bytes_);
    be_.copy_to_host(host_.grad.data(), rows_.grad, N * row_bytes_);
    host_.valid = true;
  }
  Pairs p;
  for (int64_t n = 0; n < N; ++n)
    for (int k = 0; k < K; ++k) {
      const int32_t s = host_.slot[n * K + k];
      if (s < 0 || s >= S || map.expert_at(me, s) != expert) continue;
      p.key.push_back(rows_.source_key[n]);
      p.weight.push_back(host_.weight[n * K + k]);
      for (auto [from, to] : {std::pair{&host_.x, &p.x}, std::pair{&host_.grad, &p.grad}})
        to->insert(to->end(), from->begin() + n * row_bytes_, from->begin() + (n + 1) * row_bytes_);
    }
  return p;
}

// [count], then [keys | weights | x rows | grad rows].
void ReplicaGradReduction::send_pairs(int to, const Pairs& p, uint32_t count_tag, uint32_t pairs_tag) {
  const int64_t count = static_cast<int64_t>(p.key.size());
  comm_.send(to, &count, sizeof(count), count_tag, transport::deadline_in(timeout_));
  if (count == 0) return;
  std::vector<uint8_t> wire(count * (sizeof(int64_t) + sizeof(float)) + p.x.size() + p.grad.size());
  uint8_t* at = wire.data();
  for (auto [data, bytes] : {std::pair{static_cast<const void*>(p.key.data()), 8 * count},
                             std::pair{static_cast<const void*>(p.weight.data()), 4 * count},
                             std::pair{static_cast<const void*>(p.x.data()), static_cast<int64_t>(p.x.size())},
                             std::pair{static_cast<const void*>(p.grad.data()), static_cast<int64_t>(p.grad.size())}}) {
    std::memcpy(at, data, bytes);
    at += bytes;
  }
  comm_.send(to, wire.data(), wire.size(), pairs_tag, transport::deadline_in(timeout_));
}

void ReplicaGradReduction::receive_pairs(int from, Pairs& into, uint32_t count_tag, uint32_t pairs_tag) {
  int64_t count = 0;
  comm_.recv(from, &count, sizeof(count), count_tag, transport::deadline_in(timeout_));
  // A token pairs with an expert once: at most every token of every rank.
  MOE_CHECK(count >= 0 && count <= static_cast<int64_t>(comm_.size()) * cfg_.max_tokens,
            "replica gradients: rank ", from, " announced ", count, " pairs of an expert");
  if (count == 0) return;
  const size_t rows = count * row_bytes_;
  std::vector<uint8_t> wire(count * (sizeof(int64_t) + sizeof(float)) + 2 * rows);
  comm_.recv(from, wire.data(), wire.size(), pairs_tag, transport::deadline_in(timeout_));
  const uint8_t* at = wire.data();
  auto take = [&]<typename T>(std::vector<T>& v, size_t bytes) {
    const size_t old = v.size();
    v.resize(old + bytes / sizeof(T));
    std::memcpy(v.data() + old, at, bytes);
    at += bytes;
  };
  take(into.key, 8 * count);
  take(into.weight, 4 * count);
  take(into.x, rows);
  take(into.grad, rows);
}

// The expert's weight gradient over `p`'s pairs in source order, [w13 | w2]
// into acc: the expert (as `experts` computes with it in local_slot) run over
// them on the merge stage, forward then backward, as a rank holding them all would.
void ReplicaGradReduction::gradient_of(Pairs& p, const ExpertStage& experts, int local_slot, float* acc) {
  const int64_t M = static_cast<int64_t>(p.key.size());
  if (M == 0) {
    std::fill(acc, acc + n13_ + n2_, 0.0f);
    return;
  }
  std::vector<int64_t> order(M);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return p.key[a] < p.key[b]; });
  std::vector<uint8_t> x(M * row_bytes_), grad(M * row_bytes_);
  std::vector<float> weight(M);
  for (int64_t i = 0; i < M; ++i) {
    std::memcpy(x.data() + i * row_bytes_, p.x.data() + order[i] * row_bytes_, row_bytes_);
    std::memcpy(grad.data() + i * row_bytes_, p.grad.data() + order[i] * row_bytes_, row_bytes_);
    weight[i] = p.weight[order[i]];
  }
  if (!merge_.stage) merge_.stage = std::make_unique<ExpertStage>(merge_config(cfg_), 1, be_);
  if (M > merge_.capacity) {
    merge_.capacity = M;
    for (kernels::Buffer* b : {&merge_.x, &merge_.grad, &merge_.out, &merge_.gx}) *b = kernels::Buffer(be_, M * row_bytes_);
    merge_.expert = kernels::Buffer(be_, 4 * M);
    be_.fill_zero(merge_.expert.get(), 4 * M);  // every row's one pair: expert 0
    merge_.weight = kernels::Buffer(be_, 4 * M);
    merge_.gw = kernels::Buffer(be_, 4 * M);
  }
  be_.copy_to_device(merge_.x.get(), x.data(), x.size());
  be_.copy_to_device(merge_.grad.get(), grad.data(), grad.size());
  be_.copy_to_device(merge_.weight.get(), weight.data(), 4 * M);
  merge_.stage->copy_compute_weights(experts, local_slot, 0);
  merge_.stage->forward(merge_.x.get(), M, merge_.expert.as<int32_t>(), merge_.weight.as<float>(), merge_.out.get());
  merge_.stage->backward(merge_.grad.get(), merge_.gx.get(), cfg_.dtype, merge_.gw.as<float>());
  be_.copy_to_host(acc, merge_.stage->grad_w13(), 4 * n13_);
  be_.copy_to_host(acc + n13_, merge_.stage->grad_w2(), 4 * n2_);
}

// Recipient k of the expert: the replicas' ranks other than the primary's (in
// replica order), then its shadows.
uint32_t ReplicaGradReduction::tag(int e, size_t k, uint32_t phase) const {
  return tag_base_ + static_cast<uint32_t>(((static_cast<uint64_t>(e) * recipients_ + k) * kPhases + phase) & 0xffffff);
}

void ReplicaGradReduction::reduce_expert(int e, const ExpertMap& map, ExpertStage& experts, StagedExperts* staged) {
  const size_t n13 = n13_, n2 = n2_, n = n13 + n2;
  const int me = comm_.rank(), S = map.slots_per_rank;
  recipients_ = map.max_replicas + (staged ? staged->max_shadows() : 0);
  auto deadline = [&] { return transport::deadline_in(timeout_); };
  auto store = [&](const float* src) {  // host -> every slot of the expert here
    for (int32_t slot : map.replicas(e)) {
      if (map.rank_of_slot(slot) != me) continue;
      be_.copy_to_device(experts.grad_w13() + static_cast<size_t>(slot % S) * n13, src, 4 * n13);
      be_.copy_to_device(experts.grad_w2() + static_cast<size_t>(slot % S) * n2, src + n13, 4 * n2);
    }
  };
  const std::vector<int32_t> reps = map.replicas(e);
  const int primary = map.rank_of_slot(reps[0]);
  std::vector<int> holders;  // ranks other than the primary's with a replica
  for (size_t i = 1; i < reps.size(); ++i) {
    const int r = map.rank_of_slot(reps[i]);
    if (r != primary && std::find(holders.begin(), holders.end(), r) == holders.end()) holders.push_back(r);
  }
  const std::vector<int> no_shadows;
  const std::vector<int>& shadows = staged ? staged->shadows_of(e) : no_shadows;
  if (me == primary) {
    take_gradient(e, map, experts, holders);
    store(acc_.data());
    for (size_t j = 0; j < holders.size(); ++j) comm_.send(holders[j], acc_.data(), 4 * n, tag(e, j, kSum), deadline());
    for (size_t j = 0; j < shadows.size(); ++j) {  // a shadow never sits on a rank that hosts its expert
      const int to = staged->copies()[shadows[j]].to_rank;
      comm_.send(to, acc_.data(), 4 * n, tag(e, map.max_replicas + j, kSum), deadline());
    }
    return;
  }
  const auto holder = std::find(holders.begin(), holders.end(), me);
  if (holder != holders.end()) {
    const size_t j = holder - holders.begin();
    give_share(e, map, experts, primary, j);
    comm_.recv(primary, msg_.data(), 4 * n, tag(e, j, kSum), deadline());
    store(msg_.data());
  }
  for (size_t j = 0; j < shadows.size(); ++j)
    if (staged->gains(shadows[j]))
      comm_.recv(primary, staged->shadow_gradient(shadows[j]), 4 * n, tag(e, map.max_replicas + j, kSum),
                 deadline());
}

// The expert's gradient into acc_: one copy's, the replica sum, or (exact) the
// expert over every replica's pairs.
void ReplicaGradReduction::take_gradient(int e, const ExpertMap& map, ExpertStage& experts,
                                         const std::vector<int>& holders) {
  const int S = map.slots_per_rank, me = comm_.rank();
  const std::vector<int32_t> reps = map.replicas(e);
  if (exact_ && reps.size() > 1) {
    Pairs all = local_pairs(e, map);
    for (size_t j = 0; j < holders.size(); ++j) receive_pairs(holders[j], all, tag(e, j, kCount), tag(e, j, kPairs));
    gradient_of(all, experts, reps[0] % S, acc_.data());
    return;
  }
  // Replica order; replica i's partial travels under its own tag.
  auto load = [&](int32_t slot, float* dst) {  // backend -> host
    be_.copy_to_host(dst, experts.grad_w13() + static_cast<size_t>(slot % S) * n13_, 4 * n13_);
    be_.copy_to_host(dst + n13_, experts.grad_w2() + static_cast<size_t>(slot % S) * n2_, 4 * n2_);
  };
  load(reps[0], acc_.data());
  for (size_t i = 1; i < reps.size(); ++i) {
    const int owner = map.rank_of_slot(reps[i]);
    if (owner == me) {
      load(reps[i], msg_.data());
    } else {
      comm_.recv(owner, msg_.data(), 4 * (n13_ + n2_), tag(e, i, kPairs), transport::deadline_in(timeout_));
    }
    for (size_t k = 0; k < n13_ + n2_; ++k) acc_[k] += msg_[k];
  }
}

// A holder's share: its pairs (exact) or its slots' partial gradients in replica order.
void ReplicaGradReduction::give_share(int e, const ExpertMap& map, ExpertStage& experts, int primary, size_t j) {
  const int S = map.slots_per_rank, me = comm_.rank();
  if (exact_) {
    send_pairs(primary, local_pairs(e, map), tag(e, j, kCount), tag(e, j, kPairs));
    return;
  }
  const std::vector<int32_t> reps = map.replicas(e);
  for (size_t i = 1; i < reps.size(); ++i) {
    if (map.rank_of_slot(reps[i]) != me) continue;
    be_.copy_to_host(msg_.data(), experts.grad_w13() + static_cast<size_t>(reps[i] % S) * n13_, 4 * n13_);
    be_.copy_to_host(msg_.data() + n13_, experts.grad_w2() + static_cast<size_t>(reps[i] % S) * n2_, 4 * n2_);
    comm_.send(primary, msg_.data(), 4 * (n13_ + n2_), tag(e, i, kPairs), transport::deadline_in(timeout_));
  }
}

}  // namespace moe::ep
