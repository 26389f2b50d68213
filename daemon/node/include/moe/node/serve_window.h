// One rank's serve steps over a reporting window of about a second
// (docs/serving.md#statistics), summed per layer into the StepStats the agent
// takes as a step: `step` numbers the windows, step_seconds is the window's
// length, expert_tokens and layer_pairs carry the real calls' load for the
// placement's load window, and `serve` the rows and the node's calls.
#pragma once

#include <chrono>
#include <cstdint>

#include "moe/node/model_stack.h"
#include "moe/node/step_report.h"
#include "moe/v1/job_run.pb.h"

namespace moe::node {

class ServeWindow {
 public:
  static constexpr std::chrono::milliseconds kPeriod{1000};

  // first: the first window's number (a world that follows another goes on
  // with the job's numbering); at_once: the first window closes after one step
  // (a new world's first step tells the agent that the job recovered).
  ServeWindow(int layers, int experts, int first, bool at_once);
  // A serve step that ran `layer` on `rows` of this rank's rows; `step` holds
  // that layer's figures (its one forward entry).
  void add(int layer, int64_t rows, const StepReport& step);
  // A serve step that ran a lane (every rank counts it, with rows of its own or none).
  void add_step() { stats_.mutable_serve()->set_steps(stats_.serve().steps() + 1); }
  // The window ran its period (this rank's vote to close it).
  bool due() const { return at_once_ || std::chrono::steady_clock::now() - opened_ >= kPeriod; }
  // The window's report (each layer's epoch from the stack), and the next starts.
  v1::StepStats close(const ModelStack& stack, int64_t world_epoch);

 private:
  void open();

  const int layers_, experts_;
  int index_;
  bool at_once_;
  std::chrono::steady_clock::time_point opened_;
  v1::StepStats stats_;
};

}  // namespace moe::node
