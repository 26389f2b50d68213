// A live rebalance at the EP layer (docs/placement.md#live-rebalance), ranks as
// threads over every transport: a train layer runs on map A, every rank stages map B at a step
// boundary (copies in the background, shadows following the optimizer), the
// ranks switch once all copies are in, and training goes on. The outputs match
// a run that never rebalanced (placement changes only the summation order), and
// after the switch every replica of an expert is bitwise identical to the others:
// weights, fp32 masters and Adam moments.
#include <gtest/gtest.h>

#include <cmath>
#include <mutex>
#include <set>

#include "moe/ep/ep_layer.h"
#include "moe/kernels/cpu_backend.h"
#include "moe/model/synthetic.h"
#include "rank_threads.h"

namespace moe::test {
namespace {

using kernels::DType;
using namespace std::chrono_literals;

constexpr int kRanks = 4, kE = 8, kH = 32, kI = 16, kK = 2, kT = 24, kSteps = 12;

ep::MoeLayerConfig config(DType dtype, DType moments) {
  return ep::layer_config({.experts = kE,
                           .top_k = kK,
                           .hidden = kH,
                           .ffn_hidden = kI,
                           .dtype = dtype,
                           .tokens_per_rank = kT,
                           .train = true,
                           .moments = moments});
}

// A: contiguous, 2 slots per rank. B: 3 slots per rank, experts 0, 1, 4, 6 twice
// (a new stage at the switch). C: 3 slots again, 2, 3, 5, 7 twice and experts
// moving between a rank's slots (the switch works in place).
moe::ExpertMap map_a() { return moe::ExpertMap::contiguous(kE, kRanks); }
moe::ExpertMap map_b() { return moe::ExpertMap::make(kE, kRanks, 3, {0, 1, 4, 2, 3, 0, 4, 5, 6, 7, 1, 6}, 2); }
moe::ExpertMap map_c() { return moe::ExpertMap::make(kE, kRanks, 3, {2, 0, 1, 3, 5, 7, 4, 2, 6, 7, 3, 5}, 3); }

// A rank gains each expert it did not host, from that expert's first holder.
std::vector<ExpertCopy> copies(const moe::ExpertMap& from, const moe::ExpertMap& to) {
  std::vector<ExpertCopy> out;
  for (int r = 0; r < to.num_ranks; ++r) {
    const std::vector<bool> had = from.hosted(r);
    for (int s = 0; s < to.slots_per_rank; ++s) {
      const int e = to.expert_at(r, s);
      if (!had[e]) out.push_back({e, from.rank_of_slot(from.replicas(e)[0]), r, s});
    }
  }
  return out;
}

std::vector<uint8_t> storage(uint64_t seed, int step, int rank, DType dtype) {
  std::vector<float> x(kT * kH);
  model::fill_inputs(seed + step, step, static_cast<int64_t>(rank) * kT, kT, kH, x.data());
  return model::to_storage(x, dtype);
}

struct TrainRun {
  std::vector<std::vector<std::vector<float>>> out;  // [step][rank] -> [T, H]
  // After the last step: per expert, each hosting rank's [weights | m | v].
  std::vector<std::vector<std::vector<float>>> state;
  std::vector<int> switched_before;
};

// kPlain: A throughout. kRebalance: every rank stages B before step 2, C before
// step 7, and switches at the first boundary where every rank's copies are in.
// kStageAndDrop: B staged before step 2 (its shadow replicas train along), dropped
// before step 6, so the layer stays on A.
enum class Plan { kPlain, kRebalance, kStageAndDrop };

// Trains kSteps steps under `plan`, Adam's moments kept in `moments`.
TrainRun train(Kind kind, DType dtype, Plan plan, DType moments = DType::kF32) {
  const bool rebalance = plan == Plan::kRebalance;
  TrainRun run;
  run.out.assign(kSteps, std::vector<std::vector<float>>(kRanks));
  run.state.assign(kE, {});
  std::mutex mu;
  const model::LayerWeights w = model::make_layer_weights(5, 0, {kH, kI, kE});
  const auto errors = run_ranks(kind, kRanks, [&](transport::Communicator& comm) {
    kernels::ThreadPool pool(1);
    auto be = kernels::make_cpu_backend(pool);
    ep::EpLayer layer(config(dtype, moments), map_a(), comm, *be, {.timeout = 30s});
    layer.set_weights(w);
    kernels::OptimizerConfig opt;
    opt.lr = 0.01f;
    opt.moments = moments;
    const int me = comm.rank();
    std::vector<uint8_t> out(kT * kH * 4 + 1), gx(out.size());
    for (int step = 0; step < kSteps; ++step) {
      if (plan == Plan::kStageAndDrop && step == 2) layer.stage(map_b(), copies(map_a(), map_b()), true);
      if (plan == Plan::kStageAndDrop && step > 2 && step < 6) layer.staged_ready();  // copies progress
      if (plan == Plan::kStageAndDrop && step == 6) layer.drop_staged();
      if (rebalance && step == 2) layer.stage(map_b(), copies(map_a(), map_b()), true);
      if (rebalance && step == 7) layer.stage(map_c(), copies(map_b(), map_c()), true);
      if (rebalance && layer.staging() && step != 2 && step != 7) {
        float ready = layer.staged_ready() ? 1.0f : 0.0f;
        comm.all_reduce_sum(&ready, 1, transport::deadline_in(30s));
        if (ready == kRanks) {
          layer.switch_to_staged();
          std::lock_guard<std::mutex> lock(mu);
          if (me == 0) run.switched_before.push_back(step);
        }
      }
      const auto x = storage(9, step, me, dtype);
      layer.forward(x.data(), kT, static_cast<int64_t>(me) * kT, out.data());
      layer.backward(storage(77, step, me, dtype).data(), gx.data());
      layer.optimizer_step(opt, step + 1);
      std::lock_guard<std::mutex> lock(mu);
      run.out[step][me] = model::from_storage(out.data(), kT * kH, dtype);
    }
    for (int s = 0; s < layer.map().slots_per_rank; ++s) {
      ep::ExpertState st;
      st.resize(kH, kI, true);
      layer.export_slot(s, st);
      std::vector<float> all = st.weights;
      all.insert(all.end(), st.m.begin(), st.m.end());
      all.insert(all.end(), st.v.begin(), st.v.end());
      std::lock_guard<std::mutex> lock(mu);
      run.state[layer.map().expert_at(me, s)].push_back(std::move(all));
    }
    comm.barrier(transport::deadline_in(30s));
  });
  for (int r = 0; r < kRanks; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  return run;
}

class EpRebalance : public ::testing::TestWithParam<std::tuple<Kind, DType>> {};

// Runs plain and rebalanced; the outputs agree to the summation order, and every
// expert's replicas end bitwise identical.
void expect_the_switch_keeps_training(Kind kind, DType dtype, DType moments) {
  const TrainRun plain = train(kind, dtype, Plan::kPlain, moments);
  const TrainRun moved = train(kind, dtype, Plan::kRebalance, moments);
  ASSERT_EQ(moved.switched_before.size(), 2u) << "the ranks did not switch twice";
  // Placement changes only the order of sums: fp32 rtol 1e-5; bf16 outputs are
  // rounded to 2^-9 once more per partial combine row (rtol 2^-7).
  const double rtol = dtype == DType::kF32 ? 1e-5 : 1.0 / 128;
  for (int step = 0; step < kSteps; ++step) {
    double worst = 0, scale = 0;
    for (int r = 0; r < kRanks; ++r)
      for (size_t i = 0; i < plain.out[step][r].size(); ++i) {
        worst = std::max(worst, std::fabs(double(plain.out[step][r][i]) - moved.out[step][r][i]));
        scale = std::max(scale, std::fabs(double(plain.out[step][r][i])));
      }
    ASSERT_GT(scale, 1e-3);
    EXPECT_LE(worst, rtol * scale) << "step " << step;
  }
  for (int e = 0; e < kE; ++e) {
    const auto& copies_of_e = moved.state[e];
    ASSERT_EQ(copies_of_e.size(), static_cast<size_t>(map_c().logcnt[e])) << "expert " << e;
    for (size_t i = 1; i < copies_of_e.size(); ++i)
      EXPECT_EQ(copies_of_e[i], copies_of_e[0]) << "expert " << e << ": replica " << i << " differs";
  }
}

TEST_P(EpRebalance, TrainingGoesOnAcrossTheSwitchAndReplicasAreBitwiseIdentical) {
  const auto [kind, dtype] = GetParam();
  expect_the_switch_keeps_training(kind, dtype, DType::kF32);
}

// bf16 Adam moments: the copies cross as fp32 (widened exactly) and the shadows
// step in bf16 as their holders do, so replicas stay bitwise identical too.
TEST(EpRebalanceBf16Moments, TrainingGoesOnAcrossTheSwitchAndReplicasAreBitwiseIdentical) {
  expect_the_switch_keeps_training(Kind::kInProc, DType::kBF16, DType::kBF16);
}

// A staged epoch that is dropped leaves no trace: its shadow replicas took Adam
// steps on the staged state only, so every output and every expert's state are
// bitwise those of a run that never staged (a shadow's step leaking into a live
// slot, or a stale staged slot taking over, fails here).
TEST_P(EpRebalance, ADroppedStagingLeavesTheLayerBitwiseUntouched) {
  const auto [kind, dtype] = GetParam();
  const TrainRun plain = train(kind, dtype, Plan::kPlain);
  const TrainRun dropped = train(kind, dtype, Plan::kStageAndDrop);
  for (int step = 0; step < kSteps; ++step)
    for (int r = 0; r < kRanks; ++r) EXPECT_EQ(dropped.out[step][r], plain.out[step][r]) << "step " << step;
  for (int e = 0; e < kE; ++e) EXPECT_EQ(dropped.state[e], plain.state[e]) << "expert " << e;
}

std::string name_of(const ::testing::TestParamInfo<std::tuple<Kind, DType>>& info) {
  const Kind k = std::get<0>(info.param);
  return std::string(k == Kind::kInProc ? "inproc" : k == Kind::kUcx ? "ucx" : "hybrid") +
         (std::get<1>(info.param) == DType::kF32 ? "_fp32" : "_bf16");
}

INSTANTIATE_TEST_SUITE_P(All, EpRebalance,
                         ::testing::Combine(::testing::Values(Kind::kInProc, Kind::kUcx, Kind::kHybrid),
                                            ::testing::Values(DType::kF32, DType::kBF16)),
                         name_of);

}  // namespace
}  // namespace moe::test
