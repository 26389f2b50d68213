#include "moe/cluster/bootstrap_relay.h"

namespace moe::agent {

void BootstrapRelay::begin(const std::string& job_id, int world, int64_t epoch) {
  job_id_ = job_id;
  epoch_ = epoch;
  blobs_.assign(world, "");
  published_.assign(world, false);
  published_count_ = 0;
}

void BootstrapRelay::publish(int rank, std::string blob) {
  if (!published_[rank]) ++published_count_;
  published_[rank] = true;
  blobs_[rank] = std::move(blob);
}

int BootstrapRelay::first_missing() const {
  for (size_t r = 0; r < published_.size(); ++r)
    if (!published_[r]) return static_cast<int>(r);
  return -1;
}

}  // namespace moe::agent
