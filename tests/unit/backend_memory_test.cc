// The EP layer and the model stack touch the backend's memory only through the
// backend and the data communicator, as a GPU requires: under GuardedBackend,
// whose memory is inaccessible between its own calls, a train job's steps (with
// replicas, shared experts, the balancing terms and a bias update), verify, the
// dump and a checkpoint written and loaded run to the end on one rank, and a
// chunked train job (docs/layer.md#overlap: the transfer thread beside the
// compute) on two. A direct host access would crash the test; host memory given
// to the data communicator (NCCL's role) fails it.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <mutex>
#include <thread>

#include "guarded_backend.h"
#include "moe/kernels/cpu_backend.h"
#include "moe/node/checkpoint.h"
#include "moe/node/dump.h"
#include "moe/node/model_stack.h"
#include "moe/node/verify.h"
#include "moe/spec/checkpoint_manifest.h"
#include "moe/spec/job_spec.h"
#include "moe/transport/inproc_communicator.h"

namespace moe::test {
namespace {

using namespace std::chrono_literals;

TEST(GuardedBackend, TheHostCannotTouchItsMemoryOutsideItsCalls) {
  kernels::ThreadPool pool(1);
  GuardedBackend be(pool);
  auto* p = static_cast<float*>(be.alloc(64));
  const float one = 1.0f;
  be.copy_to_device(p, &one, 4);  // through the backend: fine
  float back = 0;
  be.copy_to_host(&back, p, 4);
  EXPECT_EQ(back, 1.0f);
  EXPECT_DEATH(p[0] = 2.0f, "");  // directly: a fault
  be.free(p);
}

v1::JobSpec train_spec(const std::string& dump_dir, kernels::DType dtype) {
  v1::JobSpec s;
  s.set_experts(4);
  s.set_top_k(2);
  s.set_hidden(16);
  s.set_ffn_hidden(8);
  s.set_layers(2);
  s.set_tokens_per_rank(24);
  s.set_steps(2);
  s.set_mode(v1::JobSpec::train);
  s.set_dtype(dtype == kernels::DType::kF32 ? v1::JobSpec::fp32 : v1::JobSpec::bf16);
  s.set_verify(true);
  s.set_dump_dir(dump_dir);
  s.set_shared_experts(1);
  s.set_shared_ffn_hidden(8);
  s.set_shared_expert_gate(true);
  s.set_aux_loss_coeff(0.01);
  s.set_z_loss_coeff(0.001);
  s.set_bias_update_rate(0.001);
  return spec::with_defaults(s);
}

class BackendMemory : public ::testing::TestWithParam<kernels::DType> {};

TEST_P(BackendMemory, ATrainJobTouchesItOnlyThroughTheBackendAndTheDataCommunicator) {
  const auto dir = std::filesystem::temp_directory_path() / ("moe_guarded_" + std::to_string(::getpid()));
  const v1::JobSpec spec = train_spec(dir.string(), GetParam());
  // Expert 0 twice on the one rank: the replica gradient reduction runs too.
  const moe::ExpertMap map = moe::ExpertMap::make(4, 1, 5, {0, 1, 2, 3, 0});
  transport::InProcGroup host(1), data(1);
  auto host_comm = host.communicator(0), data_comm = data.communicator(0);
  kernels::ThreadPool pool(1);
  GuardedBackend be(pool);
  GuardedDataComm guarded_data(*data_comm, be);
  node::ModelStack stack(spec, {map, map}, 0, 1, *host_comm, be, pool, 30s, &guarded_data);
  for (int step = 0; step < spec.steps(); ++step) {
    node::StepReport report(step, spec.experts());
    const bool capture = step == 0;
    stack.forward(step, report, capture);
    stack.backward(report, capture);
    if (capture) {
      const auto deadline = transport::deadline_in(30s);
      const std::vector<model::LayerWeights> weights = stack.weights_in_use(step, deadline);
      const v1::Verify v = node::verify_step(spec, stack, weights, 0, *host_comm, deadline);
      EXPECT_TRUE(v.passed()) << v.ShortDebugString();
      node::dump_step(spec, stack, weights[0], 0);
      EXPECT_TRUE(std::filesystem::exists(dir / "rank0.safetensors"));
    }
    stack.optimize(step, report);
    stack.update_selection_bias();
    EXPECT_TRUE(std::isfinite(report.stats().loss())) << "step " << step;
  }
  EXPECT_GT(be.calls(), 100);

  // A checkpoint written from the guarded stack and loaded into a fresh one gives
  // the same weights.
  v1::StartJob job;
  job.set_job_id("job-guarded");
  *job.mutable_spec() = spec;
  job.mutable_spec()->set_checkpoint_dir((dir / "ckpt").string());
  job.set_world_size(1);
  job.set_devices_per_node(1);
  const auto deadline = transport::deadline_in(30s);
  node::write_checkpoint(job, stack, spec.steps(), 0, *host_comm, deadline);
  const std::string folder = (dir / "ckpt" / "step-000002").string();
  node::ModelStack loaded(spec, {map, map}, 0, 1, *host_comm, be, pool, 30s, &guarded_data);
  node::load_checkpoint(folder, spec::read_manifest(folder), loaded, 0);
  const std::vector<model::LayerWeights> want = stack.weights_in_use(spec.steps(), deadline);
  const std::vector<model::LayerWeights> got = loaded.weights_in_use(spec.steps(), deadline);
  for (int l = 0; l < spec.layers(); ++l) {
    EXPECT_EQ(got[l].gate, want[l].gate) << "layer " << l;
    EXPECT_EQ(got[l].w13, want[l].w13) << "layer " << l;
    EXPECT_EQ(got[l].shared_w2, want[l].shared_w2) << "layer " << l;
    EXPECT_EQ(got[l].selection_bias, want[l].selection_bias) << "layer " << l;
  }
  std::filesystem::remove_all(dir);
}

// Each rank's loss per step of a two-rank train job, on guarded backends or plain
// CPU ones; and the most chunks a step's pairs ran in.
struct ChunkedRun {
  std::vector<double> losses[2];
  int chunks = 0;
  std::string error;  // the first rank's failure
};

ChunkedRun run_two_rank_train(kernels::DType dtype, int overlap_chunks, bool guarded) {
  v1::JobSpec spec = train_spec("", dtype);
  spec.set_verify(false);
  spec.set_tokens_per_rank(64);
  spec.set_steps(2);
  spec.set_layers(1);
  spec.set_overlap_chunks(overlap_chunks);
  // Experts 0 and 1 on both ranks: the replicas' gradient all-reduce runs too.
  const moe::ExpertMap map = moe::ExpertMap::make(4, 2, 3, {0, 1, 2, 3, 0, 1});
  transport::InProcGroup host(2), data(2);
  ChunkedRun out;
  std::mutex mu;
  std::shared_ptr<transport::Communicator> hosts[2] = {host.communicator(0), host.communicator(1)};
  std::shared_ptr<transport::Communicator> datas[2] = {data.communicator(0), data.communicator(1)};
  auto run_rank = [&](int rank) {
    auto host_comm = hosts[rank], data_comm = datas[rank];
    kernels::ThreadPool pool(1);
    std::unique_ptr<kernels::Backend> plain;
    std::unique_ptr<GuardedBackend> guard;
    std::unique_ptr<GuardedDataComm> guarded_data;
    kernels::Backend* be;
    transport::Communicator* dc = data_comm.get();
    if (guarded) {
      guard = std::make_unique<GuardedBackend>(pool);
      guarded_data = std::make_unique<GuardedDataComm>(*data_comm, *guard);
      be = guard.get();
      dc = guarded_data.get();
    } else {
      plain = kernels::make_cpu_backend(pool);
      be = plain.get();
    }
    node::ModelStack stack(spec, {map}, rank, 2, *host_comm, *be, pool, 30s, dc);
    for (int step = 0; step < spec.steps(); ++step) {
      node::StepReport report(step, spec.experts());
      stack.forward(step, report, false);
      stack.backward(report, false);
      stack.optimize(step, report);
      stack.update_selection_bias();
      std::lock_guard<std::mutex> lock(mu);
      out.losses[rank].push_back(report.stats().loss());
      out.chunks = std::max(out.chunks, report.stats().overlap_chunks());
    }
  };
  auto rank_main = [&](int rank) {  // a failure ends the other rank's waits too
    try {
      run_rank(rank);
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(mu);
      if (out.error.empty()) out.error = "rank " + std::to_string(rank) + ": " + e.what();
      for (auto& c : hosts) c->abort(e.what());
      for (auto& c : datas) c->abort(e.what());
    }
  };
  std::thread other(rank_main, 1);
  rank_main(0);
  other.join();
  return out;
}

TEST_P(BackendMemory, AChunkedTrainJobOnTwoRanksTouchesItOnlyThroughTheBackendAndTheDataCommunicator) {
  const ChunkedRun guarded = run_two_rank_train(GetParam(), 3, true);
  ASSERT_EQ(guarded.error, "");
  EXPECT_EQ(guarded.chunks, 3);
  const ChunkedRun plain = run_two_rank_train(GetParam(), 3, false);
  ASSERT_EQ(plain.error, "");
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(guarded.losses[r].size(), 2u);
    EXPECT_EQ(guarded.losses[r], plain.losses[r]) << "rank " << r;  // the same kernels underneath
    for (double l : guarded.losses[r]) EXPECT_TRUE(std::isfinite(l));
  }
}

// The chunk rule's proposals (overlap_chunks 0) travel on the data communicator too.
TEST(BackendMemory, TheChunkProposalsOfTwoRanksTravelInTheBackendsMemory) {
  const ChunkedRun guarded = run_two_rank_train(kernels::DType::kF32, 0, true);
  ASSERT_EQ(guarded.error, "");
  EXPECT_EQ(guarded.chunks, 1);  // too few rows a chunk at this size: the rule keeps the pairs whole
}

// NCCL reads device memory: the guarded data communicator refuses host memory.
TEST(GuardedDataComm, RefusesMemoryTheBackendDidNotAllocate) {
  transport::InProcGroup data(1);
  auto comm = data.communicator(0);
  kernels::ThreadPool pool(1);
  GuardedBackend be(pool);
  GuardedDataComm guarded(*comm, be);
  std::vector<float> host(4, 1.0f);
  try {
    guarded.all_reduce_sum(host.data(), host.size(), transport::deadline_in(5s));
    ADD_FAILURE() << "host memory was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("all_reduce_sum given 16 bytes the backend did not allocate"), std::string::npos)
        << e.what();
  }
  auto* dev = static_cast<float*>(be.alloc(16));
  be.copy_to_device(dev, host.data(), 16);
  guarded.all_reduce_sum(dev, 4, transport::deadline_in(5s));
  be.free(dev);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, BackendMemory, ::testing::Values(kernels::DType::kF32, kernels::DType::kBF16),
                         [](const ::testing::TestParamInfo<kernels::DType>& i) {
                           return std::string(kernels::dtype_name(i.param));
                         });

}  // namespace
}  // namespace moe::test
