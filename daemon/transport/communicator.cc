#include "moe/transport/communicator.h"

#include <numeric>

namespace moe::transport {

Segments Segments::packed(std::vector<size_t> bytes) {
  Segments s;
  s.offset.resize(bytes.size());
  size_t off = 0;
  for (size_t r = 0; r < bytes.size(); ++r) {
    s.offset[r] = off;
    off += bytes[r];
  }
  s.bytes = std::move(bytes);
  return s;
}

size_t Segments::total() const { return std::accumulate(bytes.begin(), bytes.end(), size_t{0}); }

void check_segments(const AllToAllBuffer& b, int ranks) {
  MOE_CHECK(static_cast<int>(b.send_segs->bytes.size()) == ranks && static_cast<int>(b.recv_segs->bytes.size()) == ranks,
            "all_to_all_v: segment lists must have one entry per rank (", ranks, ")");
}

void Communicator::exchange_counts(const int64_t* send, int64_t* recv, Deadline deadline) {
  const size_t R = static_cast<size_t>(size());
  const Segments segs = Segments::packed(std::vector<size_t>(R, sizeof(int64_t)));
  all_to_all_v(send, segs, recv, segs, deadline);
}

}  // namespace moe::transport
