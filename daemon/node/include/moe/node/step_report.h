// One rank's figures of one step, in one place: the layers' stats go into the
// StepStats proto the agent aggregates and into the daemon's Prometheus metrics.
#pragma once

#include <algorithm>
#include <vector>

#include "moe/ep/ep_layer.h"
#include "moe/metrics/daemon_metrics.h"
#include "moe/v1/job_run.pb.h"

namespace moe::node {

class StepReport {
 public:
  StepReport(int step, int num_experts);

  // After layer l's forward on T tokens with top-k K.
  void add_forward(int layer, const ep::EpLayer& l, int64_t T, int K);
  // After layer l's backward.
  void add_backward(int layer, const ep::EpLayer& l);
  void set_loss(double loss) { stats_.set_loss(loss); }
  void add_balance_losses(const ep::BalanceLosses& l) {
    stats_.set_aux_loss(stats_.aux_loss() + l.aux);
    stats_.set_z_loss(stats_.z_loss() + l.z);
  }
  void set_backward_seconds(double s) { stats_.mutable_phase_seconds()->set_backward(s); }
  void set_optimizer_seconds(double s) { stats_.mutable_phase_seconds()->set_optimizer(s); }
  void set_teacher_seconds(double s) { stats_.mutable_phase_seconds()->set_teacher(s); }
  // A forward layer that is not the job's own (a train job's teacher): only its chunk count.
  void note_chunks(int chunks) { stats_.set_overlap_chunks(std::max(stats_.overlap_chunks(), chunks)); }
  void set_inputs_seconds(double s) { stats_.mutable_phase_seconds()->set_inputs(s); }
  void set_step_seconds(double s) { stats_.set_step_seconds(s); }
  void set_world_epoch(int64_t e) { stats_.set_world_epoch(e); }
  // The step's losses over every rank (the agreement after the backward).
  void set_job_losses(double loss, double aux, double z) {
    stats_.set_job_loss(loss);
    stats_.set_job_aux_loss(aux);
    stats_.set_job_z_loss(z);
  }

  const v1::StepStats& stats() const { return stats_; }
  // Records the step in the daemon's metrics (m may be null).
  void record(metrics::DaemonMetrics* m, int rank, int device) const;

 private:
  int num_experts_;
  v1::StepStats stats_;
  std::vector<metrics::LayerStep> forward_, backward_;
};

}  // namespace moe::node
