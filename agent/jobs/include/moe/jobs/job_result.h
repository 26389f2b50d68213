// A job's result (docs/jobs.md#result) from what its ranks reported: a pure function,
// tested without processes.
#pragma once

#include <map>
#include <set>
#include <vector>

#include "moe/cluster/load_window.h"
#include "moe/v1/job_run.pb.h"
#include "moe/v1/job.pb.h"

namespace moe::agent {

// What the ranks of one job reported.
struct JobReports {
  v1::JobSpec spec;  // defaults filled
  int world = 0;
  std::map<int, std::vector<v1::StepStats>> steps;  // step -> by rank (world entries once all reported)
  std::vector<v1::Verify> verify;                   // by rank
  // Steps an elastic job's world change declared whole though a lost rank's
  // report is missing: they count with the reports present (the loss is whole
  // in each, docs/jobs.md#elastic-jobs). Their ranks are numbered in their world.
  std::set<int> whole;
};

// Fills rec's measured fields: steps_completed, tokens/s, step and phase
// medians, bytes, loss, expert and rank loads, balancedness and verify (ended
// jobs whose ranks ran the check; absent otherwise). A step
// counts once every rank reported it. Per step, a phase takes its slowest
// rank's time; the result takes the median over steps. A rank's load is the
// (token, expert) pairs its experts computed
// (docs/placement.md#load-and-balancedness); balancedness is, per layer, mean
// rank load / max rank load over the job's steps (per world of an elastic job,
// weighted by its steps), and the job's figure is the mean over layers. epochs
// lists each placement epoch the steps ran under (a step's epoch: the newest of
// its layers'), and placement_epoch is the last one. Verify passes only if every rank's did and the job succeeded.
void fill_result(const JobReports& reports, v1::JobState state, v1::JobResult& rec);

// A serving job (docs/serving.md#statistics): the progress of one complete
// window, by rank (calls and clients summed over the nodes' reports, latency
// quantiles from their merged buckets, rows a step over the ranks).
v1::ServeProgress serve_progress(const std::vector<v1::StepStats>& by_rank);
// Serving jobs keep this many recent windows for their result.
constexpr int kServeWindowsKept = 60;

}  // namespace moe::agent
