// The transport bootstrap relay of the running job (docs/transport.md#bootstrap): every rank
// publishes its bytes (a UCX worker address, an NCCL unique id) and receives
// every rank's once all have published. The agent never interprets them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moe::agent {

class BootstrapRelay {
 public:
  // Starts collecting for world `epoch` (an elastic job's worlds after its
  // first; 0 otherwise) of a job of `world` ranks; forgets the previous one's.
  void begin(const std::string& job_id, int world, int64_t epoch = 0);
  void clear() { begin("", 0); }
  const std::string& job_id() const { return job_id_; }
  int64_t epoch() const { return epoch_; }

  // Records rank's bytes (a repeated publish replaces them). rank in [0, world).
  void publish(int rank, std::string blob);
  bool complete() const { return published_count_ == static_cast<int>(blobs_.size()); }
  // The lowest rank that has not published; -1 when complete.
  int first_missing() const;
  const std::vector<std::string>& blobs() const { return blobs_; }

 private:
  std::string job_id_;
  int64_t epoch_ = 0;
  std::vector<std::string> blobs_;
  std::vector<bool> published_;
  int published_count_ = 0;
};

}  // namespace moe::agent
