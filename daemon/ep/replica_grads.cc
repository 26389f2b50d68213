#include "moe/ep/replica_grads.h"

#include "moe/ep/ep_rebalance.h"

namespace moe::ep {

ReplicaGradReduction::ReplicaGradReduction(const MoeLayerConfig& cfg, transport::Communicator& comm,
                                           kernels::Backend& be, uint32_t tag_base, std::chrono::milliseconds timeout)
    : n13_(2 * static_cast<size_t>(cfg.ffn_hidden) * cfg.hidden),
      n2_(static_cast<size_t>(cfg.hidden) * cfg.ffn_hidden),
      comm_(comm),
      be_(be),
      tag_base_(tag_base),
      timeout_(timeout) {}

void ReplicaGradReduction::run(const ExpertMap& map, ExpertStage& experts, StagedExperts* staged) {
  const size_t n = n13_ + n2_;
  scratch_.resize(2 * n);
  for (int e = 0; e < map.num_experts; ++e) {
    const bool shadows = staged && !staged->shadows_of(e).empty();
    if (map.logcnt[e] >= 2 || shadows) reduce_expert(e, map, experts, staged, scratch_.data(), scratch_.data() + n);
  }
}

// Recipient k of the expert (tags): replicas 0 .. X-1, then its shadows.
void ReplicaGradReduction::reduce_expert(int e, const ExpertMap& map, ExpertStage& experts, StagedExperts* staged,
                                         float* acc, float* msg) {
  const size_t n13 = n13_, n2 = n2_, n = n13 + n2;
  const int me = comm_.rank(), S = map.slots_per_rank;
  const int recipients = map.max_replicas + (staged ? staged->max_shadows() : 0);
  auto deadline = [&] { return transport::deadline_in(timeout_); };
  auto load = [&](int32_t slot, float* dst) {  // backend -> host
    be_.copy_to_host(dst, experts.grad_w13() + static_cast<size_t>(slot % S) * n13, 4 * n13);
    be_.copy_to_host(dst + n13, experts.grad_w2() + static_cast<size_t>(slot % S) * n2, 4 * n2);
  };
  auto store = [&](const float* src, int32_t slot) {  // host -> backend
    be_.copy_to_device(experts.grad_w13() + static_cast<size_t>(slot % S) * n13, src, 4 * n13);
    be_.copy_to_device(experts.grad_w2() + static_cast<size_t>(slot % S) * n2, src + n13, 4 * n2);
  };
  auto tag = [&](size_t k, int phase) {
    return tag_base_ + static_cast<uint32_t>(((static_cast<uint64_t>(e) * recipients + k) * 2 + phase) & 0xffffff);
  };
  const std::vector<int32_t> reps = map.replicas(e);
  const std::vector<int> no_shadows;
  const std::vector<int>& shadows = staged ? staged->shadows_of(e) : no_shadows;
  const int primary = map.rank_of_slot(reps[0]);
  if (me == primary) {
    load(reps[0], acc);
    for (size_t i = 1; i < reps.size(); ++i) {
      const int owner = map.rank_of_slot(reps[i]);
      if (owner == me) load(reps[i], msg);
      else comm_.recv(owner, msg, 4 * n, tag(i, 0), deadline());
      for (size_t j = 0; j < n; ++j) acc[j] += msg[j];
    }
    for (size_t i = 0; i < reps.size(); ++i) {
      const int owner = map.rank_of_slot(reps[i]);
      if (owner == me) store(acc, reps[i]);
      else comm_.send(owner, acc, 4 * n, tag(i, 1), deadline());
    }
    for (size_t j = 0; j < shadows.size(); ++j) {  // a shadow never sits on a rank that hosts its expert
      const int to = staged->copies()[shadows[j]].to_rank;
      comm_.send(to, acc, 4 * n, tag(map.max_replicas + j, 1), deadline());
    }
    return;
  }
  for (size_t i = 1; i < reps.size(); ++i) {
    if (map.rank_of_slot(reps[i]) != me) continue;
    load(reps[i], msg);
    comm_.send(primary, msg, 4 * n, tag(i, 0), deadline());
  }
  for (size_t i = 1; i < reps.size(); ++i) {
    if (map.rank_of_slot(reps[i]) != me) continue;
    comm_.recv(primary, msg, 4 * n, tag(i, 1), deadline());
    store(msg, reps[i]);
  }
  for (size_t j = 0; j < shadows.size(); ++j)
    if (staged->gains(shadows[j]))
      comm_.recv(primary, staged->shadow_gradient(shadows[j]), 4 * n, tag(map.max_replicas + j, 1), deadline());
}

}  // namespace moe::ep
