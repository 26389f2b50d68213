// The Prometheus file_sd file the agent keeps (docs/metrics.md#service-discovery):
// one target group per process, labelled role (agent | moed) and node (the node
// name).
#pragma once

#include <string>
#include <vector>

namespace moe::agent {

struct ScrapeTarget {
  std::string address;  // HOST:PORT of /metrics
  std::string role;     // "agent" or "moed"
  std::string node;
};

// The file_sd JSON of the targets (those with an empty address are left out).
std::string file_sd_json(const std::vector<ScrapeTarget>& targets);

}  // namespace moe::agent
