// Ranks that are threads of one process. Collectives meet at a generation barrier
// in the shared group; data moves by memcpy straight from the peer's buffer.
#pragma once

#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "moe/transport/communicator.h"

namespace moe::transport {

class InProcGroup {
 public:
  explicit InProcGroup(int size);
  int size() const { return size_; }
  // The communicator of one rank; call once per rank.
  std::unique_ptr<Communicator> communicator(int rank);
  // Marks `rank` failed: every wait of every rank throws TransportError naming it.
  void abort(int rank, const std::string& reason);

 private:
  friend class InProcCommunicator;
  struct Published {
    const std::vector<AllToAllBuffer>* buffers = nullptr;
    float* data = nullptr;
  };
  // Waits until every rank arrived at this generation of the barrier.
  void barrier(int rank, Deadline deadline, const char* what);
  void check_failed_locked() const;

  const int size_;
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t generation_ = 0;
  std::vector<uint64_t> arrived_gen_;  // last generation each rank arrived at
  int arrived_ = 0;
  int failed_rank_ = -1;
  std::string failed_reason_;
  std::vector<Published> published_;
  std::vector<float> reduce_buf_;
  std::map<std::tuple<int, int, uint32_t>, std::deque<std::vector<uint8_t>>> mailbox_;  // (src, dst, tag)
};

}  // namespace moe::transport
