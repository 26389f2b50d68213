// Where a step's tokens and, in train mode, its targets come from
// (docs/jobs.md#teacher-and-loss). ModelStack's step asks only this.
// SyntheticSource draws seeded tokens and takes a teacher model's outputs as the
// targets; RecordedSource reads the tokens from a serving job's routing trace and
// keeps the teacher.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include "moe/ep/ep_layer.h"
#include "moe/kernels/buffer.h"
#include "moe/kernels/thread_pool.h"
#include "moe/layer_spec/job_layers.h"
#include "moe/node/step_report.h"

namespace moe::node {

class StepSource {
 public:
  virtual ~StepSource() = default;
  // This rank's tokens of `step`: x [T, H] in the job dtype, into backend memory.
  virtual void inputs(int step, kernels::Buffer& x, StepReport& report) = 0;
  // Train: the targets y [T, H] (job dtype, backend memory) of the step's tokens x.
  virtual void targets(const kernels::Buffer& x, kernels::Buffer& y, StepReport& report) = 0;
  // A live rebalance moves the experts (ModelStack's stage / switch / drop): a
  // source that runs layers of its own on the job's maps follows them.
  virtual void stage(const std::vector<ExpertMap>& next) { (void)next; }
  virtual void switch_to_staged() {}
  virtual void drop_staged() {}
};

// The job's layers' options (ModelStack's): the source's layers talk as they do.
using LayerOptions = std::function<ep::EpOptions(int layer)>;

// Tokens x[t, h] ~ N(0, 1) from (seed, step, global token) (layer_spec::step_inputs);
// targets: the teacher, the job's architecture built from seed + 1, on the job's
// maps (a train job's only).
class SyntheticSource : public StepSource {
 public:
  SyntheticSource(const layer_spec::JobView& job, const std::vector<ExpertMap>& maps, int rank,
                  transport::Communicator& comm, kernels::Backend& be, kernels::ThreadPool& pool,
                  LayerOptions options);
  void inputs(int step, kernels::Buffer& x, StepReport& report) override;
  void targets(const kernels::Buffer& x, kernels::Buffer& y, StepReport& report) override;
  void stage(const std::vector<ExpertMap>& next) override;
  void switch_to_staged() override;
  void drop_staged() override;

 protected:  // a source of other tokens (RecordedSource) reads the job, rank, world and backend
  const layer_spec::JobView& job_;
  const int rank_;
  transport::Communicator& comm_;
  kernels::Backend& be_;

 private:
  std::vector<std::unique_ptr<ep::EpLayer>> teacher_on(const std::vector<ExpertMap>& maps) const;
  int64_t token_begin() const { return static_cast<int64_t>(rank_) * job_.tokens_per_rank; }

  const v1::JobSpec teacher_spec_;
  kernels::ThreadPool& pool_;
  const LayerOptions options_;
  std::vector<std::unique_ptr<ep::EpLayer>> teacher_, staged_teacher_;  // staged: on a rebalance's maps
  kernels::Buffer out_;  // a teacher layer's output
};

// A job's tokens from a serving job's routing trace (JobSpec.inputs,
// docs/example-lm.md#routing-traces): layer 0's recorded rows, global token g of
// step s (g = (s x ranks + rank) x T + t) being row g mod n; the targets are the
// teacher's, as SyntheticSource's. Throws moe::Error naming the file: missing,
// no recorded rows, another hidden size, a value that is not finite.
class RecordedSource : public SyntheticSource {
 public:
  RecordedSource(const layer_spec::JobView& job, const std::vector<ExpertMap>& maps, int rank,
                 transport::Communicator& comm, kernels::Backend& be, kernels::ThreadPool& pool,
                 LayerOptions options);
  void inputs(int step, kernels::Buffer& x, StepReport& report) override;

 private:
  std::vector<float> rows_;  // [n, H]
};

}  // namespace moe::node
