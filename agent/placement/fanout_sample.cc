// The sample objective of fanout_objective.h.
#include <algorithm>

#include "fanout_objective.h"

namespace moe::placement::detail {

namespace {

class SampleObjective final : public FanoutObjective {
 public:
  SampleObjective(const Packing& packing, std::span<const int> replicas, const Trace& sample)
      : packing_(packing),
        replicas_(replicas),
        sample_(sample),
        num_nodes_(packing.num_nodes()),
        num_tokens_(sample.num_tokens()),
        top_k_(sample.top_k) {
    const int num_experts = static_cast<int>(replicas.size());
    count_.assign(static_cast<size_t>(num_experts) * num_nodes_, 0);
    for (int slot = 0; slot < packing.num_ranks() * packing.slots_per_rank(); ++slot)
      ++count_[idx(packing.expert_at(slot), node_of_slot(slot))];
    tokens_of_.resize(num_experts);
    for (int64_t t = 0; t < num_tokens_; ++t)
      for (int i = 0; i < top_k_; ++i) tokens_of_[expert(t, i)].push_back(static_cast<int32_t>(t));
    miss_.resize(static_cast<size_t>(num_tokens_) * num_nodes_);
    for (int64_t t = 0; t < num_tokens_; ++t)
      for (int n = 0; n < num_nodes_; ++n) miss_[t * num_nodes_ + n] = miss(t, n, {});
  }

  double fanout() const override {
    double sum = 0.0;
    for (double m : miss_) sum += 1.0 - m;
    return num_tokens_ > 0 ? sum / num_tokens_ : 0.0;
  }

  void move_deltas(int e, int from, std::span<double> delta) const override {
    std::fill(delta.begin(), delta.end(), 0.0);
    const double c = replicas_[e];
    // Factor of e at node n grows from 1 - k/c to 1 - (k - 1)/c at `from`
    // and shrinks to 1 - (k + 1)/c elsewhere (k < c there, so no zero divisor).
    std::vector<double> keep(num_nodes_);
    for (int n = 0; n < num_nodes_; ++n) {
      const int k = count_[idx(e, n)];
      keep[n] = n == from ? 0.0 : 1.0 - (1.0 - (k + 1) / c) / (1.0 - k / c);
    }
    double d_from = 0.0;
    for (int32_t t : tokens_of_[e]) {
      d_from += miss_[t * num_nodes_ + from] - miss_after(t, from, e, -1);
      for (int n = 0; n < num_nodes_; ++n) delta[n] += miss_[t * num_nodes_ + n] * keep[n];
    }
    for (int n = 0; n < num_nodes_; ++n)
      delta[n] = n == from ? 0.0 : (delta[n] + d_from) / num_tokens_;
  }

  double move_delta(int e, int from, int to) const override {
    if (from == to) return 0.0;
    double d = 0.0;
    for (int32_t t : tokens_of_[e]) {
      d += miss_[t * num_nodes_ + from] - miss_after(t, from, e, -1);
      d += miss_[t * num_nodes_ + to] - miss_after(t, to, e, +1);
    }
    return d / num_tokens_;
  }

  double move_bound(int e) const override {
    return 2.0 * tokens_of_[e].size() / replicas_[e] / std::max<int64_t>(num_tokens_, 1);
  }

  double joint_delta(int a, int b) const override {
    const int e = packing_.expert_at(a), f = packing_.expert_at(b);
    const int n1 = node_of_slot(a), n2 = node_of_slot(b);
    const Change changes = {{e, n1, -1}, {e, n2, +1}, {f, n2, -1}, {f, n1, +1}};
    const bool e_fewer = tokens_of_[e].size() <= tokens_of_[f].size();
    const int scan = e_fewer ? e : f, other = e_fewer ? f : e;
    double d = 0.0;
    for (int32_t t : tokens_of_[scan]) {
      bool both = false;
      for (int i = 0; i < top_k_ && !both; ++i) both = expert(t, i) == other;
      if (!both) continue;
      const double m1 = miss_[t * num_nodes_ + n1], m2 = miss_[t * num_nodes_ + n2];
      const double exact = (m1 - miss(t, n1, changes)) + (m2 - miss(t, n2, changes));
      const double separate = (m1 - miss_after(t, n1, e, -1)) + (m2 - miss_after(t, n2, e, +1)) +
                              (m1 - miss_after(t, n1, f, +1)) + (m2 - miss_after(t, n2, f, -1));
      d += exact - separate;
    }
    return d / num_tokens_;
  }

  void apply_swap(int a, int b) override {
    const int e = packing_.expert_at(a), f = packing_.expert_at(b);
    const int n1 = node_of_slot(a), n2 = node_of_slot(b);
    --count_[idx(e, n1)];
    ++count_[idx(e, n2)];
    --count_[idx(f, n2)];
    ++count_[idx(f, n1)];
    for (int x : {e, f}) {
      for (int32_t t : tokens_of_[x]) {
        miss_[t * num_nodes_ + n1] = miss(t, n1, {});
        miss_[t * num_nodes_ + n2] = miss(t, n2, {});
      }
    }
  }

 private:
  struct Adjust {
    int expert = -1, node = -1, delta = 0;
  };
  using Change = std::initializer_list<Adjust>;

  size_t idx(int e, int n) const { return static_cast<size_t>(e) * num_nodes_ + n; }
  int expert(int64_t t, int i) const { return sample_.topk_idx[t * top_k_ + i]; }
  int node_of_slot(int slot) const { return packing_.node_of_rank(packing_.rank_of_slot(slot)); }

  // M(t, n) after the count of e on n changes by delta (t picked e).
  double miss_after(int64_t t, int n, int e, int delta) const {
    const double c = replicas_[e];
    const int k = count_[idx(e, n)];
    const double before = 1.0 - k / c;
    if (before > 1e-9) return miss_[t * num_nodes_ + n] * ((1.0 - (k + delta) / c) / before);
    return miss(t, n, {{e, n, delta}});
  }

  // Probability that token t misses node n, replica counts adjusted by changes.
  double miss(int64_t t, int n, Change changes) const {
    double m = 1.0;
    for (int i = 0; i < top_k_; ++i) {
      const int e = expert(t, i);
      int k = count_[idx(e, n)];
      for (const Adjust& c : changes)
        if (c.expert == e && c.node == n) k += c.delta;
      m *= 1.0 - static_cast<double>(k) / replicas_[e];
    }
    return m;
  }

  const Packing& packing_;
  std::span<const int> replicas_;
  const Trace& sample_;
  int num_nodes_;
  int64_t num_tokens_;
  int top_k_;
  std::vector<int> count_;                       // [E, N] replicas of e on node n
  std::vector<std::vector<int32_t>> tokens_of_;  // [E] sample tokens that picked e
  std::vector<double> miss_;                     // [T, N] M(t, n)
};

}  // namespace

std::unique_ptr<FanoutObjective> make_sample_objective(const Packing& packing,
                                                       std::span<const int> replicas,
                                                       const Trace& sample) {
  return std::make_unique<SampleObjective>(packing, replicas, sample);
}

}  // namespace moe::placement::detail
