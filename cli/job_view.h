// How moectl shows a job to people (docs/cli.md#output): the record of
// `job status` / `job wait` (progress while it runs, the result once it ended),
// the line per step of `job status --watch`, and the rows of `job list`.
#pragma once

#include <ostream>
#include <string>
#include <vector>

#include "moe/v1/job.pb.h"

namespace moe::ctl {

void print_job(std::ostream& out, const v1::JobResult& j);
// "job-3 step 12/100  loss 0.4061  tokens/s 1.23e+05  step 0.012s  eta 1m05s  epoch 2  balancedness 0.87"
std::string progress_line(const v1::JobResult& j);
// "job-3 world 1 at step 40: lost node1 (node node1 (ranks 2-3) stopped
// responding); 4 -> 2 ranks, 6 experts from replicas": an elastic job's change
// of world as an event line (docs/jobs.md#elastic-jobs).
std::string world_change_line(const v1::JobResult& j, const v1::WorldChange& w);
// One table of jobs, each row within `width` columns (the reason is cut).
void print_job_list(std::ostream& out, const std::vector<v1::JobResult>& jobs, int width);

}  // namespace moe::ctl
