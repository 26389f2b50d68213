// The EP layer and the model stack touch the backend's memory only through the
// backend and the data communicator, as a GPU requires: under GuardedBackend,
// whose memory is inaccessible between its own calls, a train job's steps (with
// replicas, shared experts, the balancing terms and a bias update), verify, the
// dump and a checkpoint written and loaded run to the end on one rank. A direct
// host access would crash the test.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>

#include "guarded_backend.h"
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

INSTANTIATE_TEST_SUITE_P(Dtypes, BackendMemory, ::testing::Values(kernels::DType::kF32, kernels::DType::kBF16),
                         [](const ::testing::TestParamInfo<kernels::DType>& i) {
                           return std::string(kernels::dtype_name(i.param));
                         });

}  // namespace
}  // namespace moe::test
