// A serving job's calls on one node over a reporting window (docs/serving.md#statistics):
// per lane (a layer's forward or backward calls) the calls answered and failed,
// their rows and latencies (receipt to reply, in moe::latency_bucket counts),
// and the distinct callers. The daemon's RPC thread records each call as it
// ends; the node's first rank takes the window into its report. Thread-safe.
#pragma once

#include <cstdint>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "moe/v1/job_run.pb.h"

namespace moe::node {

class ServeStats {
 public:
  static constexpr int kMaxCallers = 256;  // names a window carries

  explicit ServeStats(int lanes) : lanes_(lanes) {}

  void record(int lane, int64_t rows, double seconds, bool ok, const std::string& caller);
  // The window's calls into w (calls, callers), and the next window starts.
  void take(v1::ServeWindow& w);

 private:
  struct Lane {
    int64_t calls = 0, failed = 0, rows = 0;
    std::vector<int64_t> latency;  // by bucket; empty until a call is answered
  };
  std::mutex mu_;
  std::vector<Lane> lanes_;
  std::set<std::string> callers_;
};

}  // namespace moe::node
