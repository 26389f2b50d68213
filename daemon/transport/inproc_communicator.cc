#include "moe/transport/inproc_communicator.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>

namespace moe::transport {

class InProcCommunicator final : public Communicator {
 public:
  InProcCommunicator(InProcGroup& g, int rank) : g_(g), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return g_.size(); }
  std::string name() const override { return "inproc"; }

  using Communicator::all_to_all_v;
  void all_to_all_v(const std::vector<AllToAllBuffer>& buffers, Deadline deadline) override {
    const int R = size();
    for (const AllToAllBuffer& b : buffers) check_segments(b, R);
    {
      std::lock_guard<std::mutex> lock(g_.mu_);
      g_.published_[rank_] = {&buffers, nullptr};
    }
    g_.barrier(rank_, deadline, "all_to_all_v (publish)");
    // A mismatch is reported only after the "done" barrier: until every rank passed
    // it, peers may still be copying from our buffers.
    std::optional<TransportError> error;
    for (int r = 0; r < R && !error; ++r) {
      const auto& theirs = *g_.published_[r].buffers;
      if (theirs.size() != buffers.size()) {
        error.emplace(r, "all_to_all_v: rank " + std::to_string(r) + " passed " + std::to_string(theirs.size()) +
                             " buffers, rank " + std::to_string(rank_) + " passed " + std::to_string(buffers.size()));
        break;
      }
      for (size_t i = 0; i < buffers.size(); ++i) {
        const size_t bytes = theirs[i].send_segs->bytes[rank_];
        if (bytes != buffers[i].recv_segs->bytes[r]) {
          error.emplace(r, "all_to_all_v: rank " + std::to_string(r) + " sends " + std::to_string(bytes) +
                               " bytes to rank " + std::to_string(rank_) + ", which expects " +
                               std::to_string(buffers[i].recv_segs->bytes[r]));
          break;
        }
        if (bytes)
          std::memcpy(static_cast<uint8_t*>(buffers[i].recv) + buffers[i].recv_segs->offset[r],
                      static_cast<const uint8_t*>(theirs[i].send) + theirs[i].send_segs->offset[rank_], bytes);
      }
    }
    g_.barrier(rank_, deadline, "all_to_all_v (done)");  // peers finished reading our buffers
    if (error) {
      g_.abort(error->peer(), error->what());
      throw *error;
    }
  }

  void all_reduce_sum(float* data, size_t count, Deadline deadline) override {
    const int R = size();
    {
      std::lock_guard<std::mutex> lock(g_.mu_);
      g_.published_[rank_] = {nullptr, data};
      if (g_.reduce_buf_.size() < count) g_.reduce_buf_.resize(count);
    }
    g_.barrier(rank_, deadline, "all_reduce (publish)");
    // Rank r sums slice r, in rank order, into the shared buffer.
    const size_t begin = count * rank_ / R, end = count * (rank_ + 1) / R;
    for (size_t i = begin; i < end; ++i) {
      float acc = g_.published_[0].data[i];
      for (int r = 1; r < R; ++r) acc += g_.published_[r].data[i];
      g_.reduce_buf_[i] = acc;
    }
    g_.barrier(rank_, deadline, "all_reduce (sum)");
    std::memcpy(data, g_.reduce_buf_.data(), count * sizeof(float));
    g_.barrier(rank_, deadline, "all_reduce (done)");
  }

  void barrier(Deadline deadline) override { g_.barrier(rank_, deadline, "barrier"); }

  void send(int peer, const void* data, size_t bytes, uint32_t tag, Deadline) override {
    MOE_CHECK(peer >= 0 && peer < size(), "send: peer ", peer, " out of range");
    std::lock_guard<std::mutex> lock(g_.mu_);
    g_.check_failed_locked();
    const auto* p = static_cast<const uint8_t*>(data);
    g_.mailbox_[{rank_, peer, tag}].emplace_back(p, p + bytes);
    g_.cv_.notify_all();
  }

  void recv(int peer, void* data, size_t bytes, uint32_t tag, Deadline deadline) override {
    MOE_CHECK(peer >= 0 && peer < size(), "recv: peer ", peer, " out of range");
    std::unique_lock<std::mutex> lock(g_.mu_);
    auto& box = g_.mailbox_[{peer, rank_, tag}];
    while (box.empty()) {
      g_.check_failed_locked();
      if (g_.cv_.wait_until(lock, deadline) == std::cv_status::timeout && box.empty())
        throw TransportError(peer, "recv: timed out waiting for rank " + std::to_string(peer) + " (tag " +
                                       std::to_string(tag) + ")");
    }
    std::vector<uint8_t> msg = std::move(box.front());
    box.pop_front();
    if (msg.size() != bytes)
      throw TransportError(peer, "recv: rank " + std::to_string(peer) + " sent " + std::to_string(msg.size()) +
                                     " bytes, expected " + std::to_string(bytes));
    if (bytes) std::memcpy(data, msg.data(), bytes);
  }

  // Background transfers go through the mailbox too, with the top tag bit set
  // (their own tag space); a send is a copy at once, a receive completes in test().
  TransferId isend(int peer, const void* data, size_t bytes, uint32_t tag, std::shared_ptr<const void>) override {
    MOE_CHECK(tag < kBackgroundTag, "isend: tag ", tag, " out of range");
    send(peer, data, bytes, tag | kBackgroundTag, {});
    pending_[next_] = {true, peer, nullptr, bytes, tag};
    return next_++;
  }
  // Copies happen inside test(), on this thread: a dropped receive writes nothing.
  TransferId irecv(int peer, void* data, size_t bytes, uint32_t tag, std::shared_ptr<const void>) override {
    MOE_CHECK(peer >= 0 && peer < size() && tag < kBackgroundTag, "irecv: peer ", peer, " or tag ", tag, " out of range");
    pending_[next_] = {false, peer, data, bytes, tag};
    return next_++;
  }
  bool test(TransferId id) override {
    const auto it = pending_.find(id);
    MOE_CHECK(it != pending_.end(), "test: no transfer ", id);
    const Pending p = it->second;
    if (!p.is_send) {
      std::lock_guard<std::mutex> lock(g_.mu_);
      g_.check_failed_locked();
      auto& box = g_.mailbox_[{p.peer, rank_, p.tag | kBackgroundTag}];
      if (box.empty()) return false;
      if (box.front().size() != p.bytes)
        throw TransportError(p.peer, "irecv: rank " + std::to_string(p.peer) + " sent " +
                                         std::to_string(box.front().size()) + " bytes, expected " +
                                         std::to_string(p.bytes));
      if (p.bytes) std::memcpy(p.data, box.front().data(), p.bytes);
      box.pop_front();
    }
    pending_.erase(it);
    return true;
  }

 private:
  static constexpr uint32_t kBackgroundTag = 1u << 31;
  struct Pending {
    bool is_send;
    int peer;
    void* data;
    size_t bytes;
    uint32_t tag;
  };
  InProcGroup& g_;
  const int rank_;
  std::map<TransferId, Pending> pending_;
  TransferId next_ = 1;
};

InProcGroup::InProcGroup(int size) : size_(size), arrived_gen_(size, 0), published_(size) {
  MOE_CHECK(size >= 1, "in-process group size must be >= 1, got ", size);
}

std::unique_ptr<Communicator> InProcGroup::communicator(int rank) {
  MOE_CHECK(rank >= 0 && rank < size_, "rank ", rank, " out of range [0, ", size_, ")");
  return std::make_unique<InProcCommunicator>(*this, rank);
}

void InProcGroup::abort(int rank, const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_rank_ < 0) {
    failed_rank_ = rank;
    failed_reason_ = reason;
  }
  cv_.notify_all();
}

void InProcGroup::check_failed_locked() const {
  if (failed_rank_ >= 0)
    throw TransportError(failed_rank_, "rank " + std::to_string(failed_rank_) + " failed: " + failed_reason_);
}

void InProcGroup::barrier(int rank, Deadline deadline, const char* what) {
  std::unique_lock<std::mutex> lock(mu_);
  check_failed_locked();
  const uint64_t gen = generation_;
  arrived_gen_[rank] = gen + 1;
  if (++arrived_ == size_) {
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
    return;
  }
  while (generation_ == gen) {
    check_failed_locked();
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && generation_ == gen) {
      int late = 0;
      while (late < size_ && arrived_gen_[late] == gen + 1) ++late;
      // The group cannot recover from a half-finished barrier: fail everyone.
      if (failed_rank_ < 0) {
        failed_rank_ = late;
        failed_reason_ = std::string("did not reach ") + what + " in time";
      }
      cv_.notify_all();
      throw TransportError(late, std::string(what) + ": timed out waiting for rank " + std::to_string(late));
    }
  }
}

}  // namespace moe::transport
