// The collectives of a communicator built on tag-matched point-to-point messages
// (UcxCommunicator, InProcCommunicator), written once so both give the same bits.
// Private to daemon/transport.
//
// Ops is the communicator's state, with:
//   uint64_t seq;  the collective sequence, the same on every rank
//   void post_send(int peer, const void* buf, size_t bytes, uint64_t tag, const char* what);
//   void post_recv(int peer, void* buf, size_t bytes, uint64_t tag, const char* what);
//   void wait_all(Deadline deadline, const char* what);  // every posted op, or throw naming the peer
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "moe/transport/communicator.h"
#include "tags.h"

namespace moe::transport::detail {

// One 1-byte message each way on every pair, under the next sequence number:
// a wire-up round or a barrier.
template <typename Ops>
void token_round(Ops& m, int rank, int size, TagKind kind, Deadline deadline, const char* what) {
  const uint64_t round_seq = m.seq++;
  uint8_t token = 1;
  std::vector<uint8_t> got(size);
  for (int r = 0; r < size; ++r)
    if (r != rank) m.post_recv(r, &got[r], 1, make_tag(kind, round_seq, r), what);
  for (int r = 0; r < size; ++r)
    if (r != rank) m.post_send(r, &token, 1, make_tag(kind, round_seq, rank), what);
  m.wait_all(deadline, what);
}

// One sequence number per buffer, so every message of the call has its own tag;
// receives are posted first, sends go in ring order from the right neighbour (so
// ranks do not all hit rank 0 first), the self segment is a local copy.
template <typename Ops>
void all_to_all_v(Ops& m, int rank, int size, const std::vector<AllToAllBuffer>& buffers, Deadline deadline) {
  for (const AllToAllBuffer& b : buffers) {
    check_segments(b, size);
    MOE_CHECK(b.send_segs->bytes[rank] == b.recv_segs->bytes[rank], "all_to_all_v: self segment sizes differ (",
              b.send_segs->bytes[rank], " vs ", b.recv_segs->bytes[rank], ")");
  }
  const uint64_t seq0 = m.seq;
  m.seq += buffers.size();
  for (size_t i = 0; i < buffers.size(); ++i) {
    const AllToAllBuffer& b = buffers[i];
    auto* out = static_cast<uint8_t*>(b.recv);
    for (int r = 0; r < size; ++r)
      if (r != rank && b.recv_segs->bytes[r])
        m.post_recv(r, out + b.recv_segs->offset[r], b.recv_segs->bytes[r], make_tag(TagKind::kAllToAll, seq0 + i, r),
                    "all_to_all_v");
  }
  for (int step = 1; step < size; ++step) {
    const int r = (rank + step) % size;
    for (size_t i = 0; i < buffers.size(); ++i) {
      const AllToAllBuffer& b = buffers[i];
      if (b.send_segs->bytes[r])
        m.post_send(r, static_cast<const uint8_t*>(b.send) + b.send_segs->offset[r], b.send_segs->bytes[r],
                    make_tag(TagKind::kAllToAll, seq0 + i, rank), "all_to_all_v");
    }
  }
  for (const AllToAllBuffer& b : buffers)
    if (b.send_segs->bytes[rank])
      std::memcpy(static_cast<uint8_t*>(b.recv) + b.recv_segs->offset[rank],
                  static_cast<const uint8_t*>(b.send) + b.send_segs->offset[rank], b.send_segs->bytes[rank]);
  m.wait_all(deadline, "all_to_all_v");
}

// Reduce to rank 0 in rank order, then rank 0 sends the sum to everyone: every
// rank ends with the same bits, summed 0 + 1 + ... + (R-1). parts: rank 0's
// buffer for the other ranks' arrays, kept between calls.
template <typename Ops>
void all_reduce_sum(Ops& m, int rank, int size, float* data, size_t count, Deadline deadline,
                    std::vector<float>& parts) {
  const uint64_t seq = m.seq++;
  const size_t bytes = count * sizeof(float);
  if (size == 1 || count == 0) return;
  if (rank == 0) {
    parts.resize((size - 1) * count);
    for (int r = 1; r < size; ++r)
      m.post_recv(r, parts.data() + (r - 1) * count, bytes, make_tag(TagKind::kReduce, seq, r), "all_reduce");
    m.wait_all(deadline, "all_reduce");
    for (int r = 1; r < size; ++r) {
      const float* p = parts.data() + (r - 1) * count;
      for (size_t i = 0; i < count; ++i) data[i] += p[i];
    }
    for (int r = 1; r < size; ++r) m.post_send(r, data, bytes, make_tag(TagKind::kBroadcast, seq, 0), "all_reduce");
    m.wait_all(deadline, "all_reduce");
  } else {
    m.post_send(0, data, bytes, make_tag(TagKind::kReduce, seq, rank), "all_reduce");
    m.wait_all(deadline, "all_reduce");
    m.post_recv(0, data, bytes, make_tag(TagKind::kBroadcast, seq, 0), "all_reduce");
    m.wait_all(deadline, "all_reduce");
  }
}

}  // namespace moe::transport::detail
