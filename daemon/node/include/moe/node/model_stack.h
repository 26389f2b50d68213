// The model a job runs on one rank (docs/jobs.md#teacher-and-loss): a stack of MoE layers,
// x_{l+1} = x_l + moe_l(x_l); in train mode also the teacher (the same
// architecture built from seed + 1), the loss L = sum ||y - y_teacher||^2 /
// (T_global x H) and the backward through the residual stack,
// dL/dx_l = g + moe_l^T(g) with g = dL/dx_{l+1}, then the optimizer step.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "moe/ep/ep_layer.h"
#include "moe/kernels/buffer.h"
#include "moe/kernels/thread_pool.h"
#include "moe/layer_spec/job_layers.h"
#include "moe/node/step_report.h"
#include "moe/node/step_source.h"
#include "moe/v1/job.pb.h"

namespace moe::node {

// What one layer saw at the step verify and the dump cover.
struct LayerSnapshot {
  std::vector<uint8_t> x, out;  // [T, H] dtype; out before the residual add
  std::vector<int32_t> topk_idx, kept_idx;
  std::vector<float> topk_weight;
  std::vector<uint8_t> grad_out, grad_x;  // train: the gradient reaching out, and the MoE path's grad_x
  ep::EpGrads grads;                      // train: the weight gradients after the step's reductions
};

class ModelStack {
 public:
  // spec: defaults filled. maps: one per layer. The stack builds its layers' and
  // the teacher's weights for the experts this rank hosts.
  // comm carries host memory; data_comm (null: comm) the backend's, as EpOptions says.
  // The steps' tokens and targets come from `source` (null: a SyntheticSource).
  ModelStack(const v1::JobSpec& spec, const std::vector<moe::ExpertMap>& maps, int rank, int world,
             transport::Communicator& comm, kernels::Backend& be, kernels::ThreadPool& pool,
             std::chrono::milliseconds timeout, transport::Communicator* data_comm = nullptr,
             std::unique_ptr<StepSource> source = nullptr);

  // The forward of `step` on this rank's tokens; with capture, every layer's
  // snapshot is kept.
  void forward(int step, StepReport& report, bool capture);
  // A serving job's step (docs/serving.md): layer `layer` alone (no residual) on
  // x [T, H] in the job dtype, host memory, T <= tokens_per_rank (0: this rank
  // joins the step's collectives with no rows). Returns y [T, H] likewise; the
  // layer's figures go into `report`.
  std::vector<uint8_t> serve_forward(int layer, const std::vector<uint8_t>& x, int64_t T, StepReport& report);
  // A serving job's backward step (docs/serving.md#training): the layer's forward
  // again on x (the rows its forward calls kept), then its backward for grad_y;
  // the weight gradients add to the layer's sums. Returns grad_x [T, H].
  std::vector<uint8_t> serve_backward(int layer, const std::vector<uint8_t>& x, const std::vector<uint8_t>& grad_y,
                                      int64_t T, StepReport& report);
  // One optimizer step on each layer's summed gradients; a layer without a
  // backward since the last step is left alone (as torch skips a parameter
  // without .grad), and counts its own steps for Adam. False, nothing applied,
  // when no layer had one.
  bool serve_optimizer_step();
  // Backward steps summed and not yet applied, over the layers.
  int64_t serve_grads_pending() const;
  // Per layer, the optimizer steps serve_optimizer_step applied (a checkpoint's
  // layer_steps); a resumed serving job starts from them.
  std::vector<int64_t> served_steps() const;
  void resume_served_steps(std::vector<int64_t> steps) { served_steps_ = std::move(steps); }
  // Train mode, after forward: the source's targets, the loss (this rank's
  // share) and the backward through the stack.
  void backward(StepReport& report, bool capture);
  // One optimizer step (1-based: step + 1) on every layer.
  void optimize(int step, StepReport& report);
  // After a step (train or forward): the aux-loss-free bias update of every layer
  // from the step's global counts, when bias_update_rate > 0.
  void update_selection_bias();
  // Takes the last update_selection_bias back (an elastic forward job's world
  // change resumes at a step this rank finished and another did not).
  void undo_selection_bias();

  // Live rebalance (docs/placement.md#live-rebalance), at step boundaries every rank agreed on: stage()
  // starts filling the slots the new maps give this rank (and the step source's
  // layers, if it has any, follow);
  // staged_ready() progresses the copies; switch_to_staged() moves every layer
  // onto its new map; drop_staged() abandons the rebalance.
  // next: one map per layer; copies: per layer, in the same order on every rank.
  void stage(const std::vector<ExpertMap>& next, const std::vector<std::vector<ExpertCopy>>& copies);
  bool staged_ready();
  void switch_to_staged();
  void drop_staged();
  int64_t staged_bytes_received() const;

  // Every layer's weights as the current step uses them (docs/jobs.md#verify: verify and the
  // dump use "the weights that step used"). Before any optimizer step of a run
  // that did not resume they are rebuilt from the spec; else the ranks assemble them from each expert's
  // primary replica with an all-reduce (collective: every rank calls it).
  std::vector<model::LayerWeights> weights_in_use(int step, transport::Deadline deadline) const;

  // Train, after backward: the first layer whose router gradient (summed over
  // every rank) holds a non-finite value, or -1.
  int first_nonfinite_router_gradient() const;

  // The job as this stack runs it (its world's spec).
  const layer_spec::JobView& job() const { return job_; }
  int num_layers() const { return static_cast<int>(layers_.size()); }
  // After a serve_forward of T rows: its top-k expert ids and weights [T, K], on the host.
  void serve_routing(int layer, int64_t T, std::vector<int32_t>& ids, std::vector<float>& weights);
  const ep::EpLayer& layer(int l) const { return *layers_[l]; }
  ep::EpLayer& layer(int l) { return *layers_[l]; }
  // Per layer, this rank's kept pairs per logical expert over every step it ran.
  const std::vector<std::vector<float>>& expert_loads() const { return loads_; }
  const moe::ExpertMap& map(int l) const { return layers_[l]->map(); }
  const LayerSnapshot& snapshot(int l) const { return snaps_[l]; }

 private:
  int64_t token_begin() const { return static_cast<int64_t>(rank_) * T_; }

  ep::EpOptions layer_options(int l) const;
  // A serve step's T rows into xs_[0] (checked against the step), returning their
  // bytes; and `bytes` of a result back to host memory.
  size_t serve_rows_in(const std::vector<uint8_t>& x, int64_t T);
  std::vector<uint8_t> serve_rows_out(const kernels::Buffer& rows, size_t bytes);
  // An activation [T, H] of the job dtype, to host memory.
  std::vector<uint8_t> host_bytes(const kernels::Buffer& b) const;
  void capture_forward(int l);

  const layer_spec::JobView job_;
  transport::Communicator& comm_;
  transport::Communicator* data_comm_;
  kernels::Backend& be_;
  kernels::ThreadPool& pool_;  // the rank's: the backend's threads, also for the inputs
  const std::chrono::milliseconds timeout_;
  const int rank_, world_;
  const int64_t T_;
  const int H_;
  const kernels::DType dt_;
  std::vector<std::unique_ptr<ep::EpLayer>> layers_;
  std::unique_ptr<StepSource> source_;
  // Activations in the backend's memory, [T, H] in the job dtype.
  std::vector<kernels::Buffer> xs_;  // xs_[l]: input of layer l; xs_[L]: the stack's output
  kernels::Buffer out_, grad_, grad_x_, targets_;
  std::vector<LayerSnapshot> snaps_;
  std::vector<std::vector<float>> loads_;
  kernels::OptimizerConfig opt_;
  std::vector<std::vector<float>> bias_before_;  // per layer, before the last bias update
  std::vector<int64_t> served_steps_;            // serving: optimizer steps applied, per layer
};

}  // namespace moe::node
