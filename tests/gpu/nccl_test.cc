// The NCCL Communicator on one GPU as a one-rank group: the self paths of every
// operation, background transfers to self, and the failure paths (an injected
// NCCL error, a stalled operation past its deadline, an abort from another thread,
// an init whose peer never joins). Every test skips without a CUDA device.
//
// Two ranks cannot share one GPU, so traffic between ranks (peer segments,
// rank-order sums of several ranks, a peer that dies) is not tested here; it needs
// a machine with two or more GPUs and one process per GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

#include "moe/transport/nccl_communicator.h"

namespace moe::test {
namespace {

using namespace moe::transport;
using namespace std::chrono_literals;

bool has_device() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the error for later CUDA calls
    return false;
  }
  return n > 0;
}

#define SKIP_WITHOUT_DEVICE() \
  if (!has_device()) GTEST_SKIP() << "no CUDA device"

// Deterministic, never all-zero bytes: a splitmix64 step of (seed, i).
uint8_t stamp(uint64_t seed, size_t i) {
  uint64_t z = seed * 0x9e3779b97f4a7c15ull + i + 1;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return static_cast<uint8_t>(z ^ (z >> 31));
}

std::vector<uint8_t> stamped(uint64_t seed, size_t n) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = stamp(seed, i);
  return v;
}

// A device allocation that frees itself; a shared_ptr so it can be a `keep`.
std::shared_ptr<void> device_alloc(size_t bytes, uint8_t fill = 0) {
  void* p = nullptr;
  if (cudaMalloc(&p, bytes) != cudaSuccess) throw std::runtime_error("cudaMalloc failed");
  cudaMemset(p, fill, bytes);
  return std::shared_ptr<void>(p, [](void* q) { cudaFree(q); });
}

void upload(void* dst, const std::vector<uint8_t>& src) {
  ASSERT_EQ(cudaMemcpy(dst, src.data(), src.size(), cudaMemcpyHostToDevice), cudaSuccess);
}

std::vector<uint8_t> download(const void* src, size_t bytes) {
  std::vector<uint8_t> v(bytes);
  EXPECT_EQ(cudaMemcpy(v.data(), src, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  return v;
}

std::unique_ptr<NcclCommunicator> one_rank() {
  return std::make_unique<NcclCommunicator>(0, 1, 0, NcclCommunicator::make_unique_id(), deadline_in(60s));
}

// Polls test() until the transfer completes; false if it did not within `limit`.
bool completes(NcclCommunicator& c, Communicator::TransferId id, std::chrono::seconds limit = 30s) {
  const auto until = Clock::now() + limit;
  while (Clock::now() < until) {
    if (c.test(id)) return true;
    std::this_thread::yield();
  }
  return false;
}

// Runs `call`, which must throw TransportError; returns its message.
template <typename Call>
std::string transport_error_of(Call call) {
  try {
    call();
  } catch (const TransportError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no TransportError";
  return "";
}

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

TEST(NcclOneRank, AllToAllVCopiesTheSelfSegmentOfEveryBuffer) {
  SKIP_WITHOUT_DEVICE();
  const auto c = one_rank();
  EXPECT_EQ(c->name(), "nccl");
  EXPECT_EQ(c->rank(), 0);
  EXPECT_EQ(c->size(), 1);
  // Buffer 0 lands at offset 16 of its receive buffer, buffer 1 at 0; the bytes
  // around them must stay as they were (0xee).
  const size_t n0 = 1000, n1 = 24;
  const Segments send0 = Segments::packed({n0}), send1 = Segments::packed({n1});
  Segments recv0 = Segments::packed({n0});
  recv0.offset[0] = 16;
  const auto s0 = device_alloc(n0), s1 = device_alloc(n1);
  const auto r0 = device_alloc(n0 + 32, 0xee), r1 = device_alloc(n1 + 8, 0xee);
  upload(s0.get(), stamped(1, n0));
  upload(s1.get(), stamped(2, n1));
  c->all_to_all_v({AllToAllBuffer{s0.get(), &send0, r0.get(), &recv0}, AllToAllBuffer{s1.get(), &send1, r1.get(), &send1}},
                  deadline_in(30s));
  const std::vector<uint8_t> got0 = download(r0.get(), n0 + 32), got1 = download(r1.get(), n1 + 8);
  for (size_t i = 0; i < n0 + 32; ++i)
    ASSERT_EQ(got0[i], i >= 16 && i < 16 + n0 ? stamp(1, i - 16) : 0xee) << "buffer 0 byte " << i;
  for (size_t i = 0; i < n1 + 8; ++i) ASSERT_EQ(got1[i], i < n1 ? stamp(2, i) : 0xee) << "buffer 1 byte " << i;
}

TEST(NcclOneRank, ZeroByteAllToAllVMovesNothing) {
  SKIP_WITHOUT_DEVICE();
  const auto c = one_rank();
  const Segments none = Segments::packed({0});
  const auto r = device_alloc(8, 0xee);
  c->all_to_all_v(nullptr, none, r.get(), none, deadline_in(30s));
  EXPECT_EQ(download(r.get(), 8), std::vector<uint8_t>(8, 0xee));
}

TEST(NcclOneRank, ExchangeCountsTakesHostArrays) {
  SKIP_WITHOUT_DEVICE();
  const auto c = one_rank();
  for (const int64_t count : {int64_t{0}, int64_t{7}, int64_t{12345678901}}) {
    const int64_t send = count;
    int64_t recv = -1;
    c->exchange_counts(&send, &recv, deadline_in(30s));
    EXPECT_EQ(recv, count);
  }
}

TEST(NcclOneRank, AllReduceSumOfOneRankLeavesTheBitsAsTheyWere) {
  SKIP_WITHOUT_DEVICE();
  const auto c = one_rank();
  const size_t n = 4097;
  std::vector<float> host(n);
  for (size_t i = 0; i < n; ++i) host[i] = 0.001f * static_cast<float>(stamp(3, i)) - 0.1f;
  const auto d = device_alloc(n * sizeof(float));
  ASSERT_EQ(cudaMemcpy(d.get(), host.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  c->all_reduce_sum(static_cast<float*>(d.get()), n, deadline_in(30s));
  c->all_reduce_sum(static_cast<float*>(d.get()), 0, deadline_in(30s));
  std::vector<float> got(n);
  ASSERT_EQ(cudaMemcpy(got.data(), d.get(), n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(std::memcmp(got.data(), host.data(), n * sizeof(float)), 0);
}

TEST(NcclOneRank, BarrierCompletes) {
  SKIP_WITHOUT_DEVICE();
  const auto c = one_rank();
  for (int i = 0; i < 3; ++i) c->barrier(deadline_in(30s));
  EXPECT_FALSE(c->aborted());
}

// NCCL pairs a send to self only with a receive posted in the same group, and a
// blocking send() returns only once its data left: send/recv to self cannot
// work and are refused up front. isend/irecv to self share one group (below).
TEST(NcclOneRank, BlockingSendToSelfIsRefused) {
  SKIP_WITHOUT_DEVICE();
  const auto c = one_rank();
  const auto d = device_alloc(16);
  EXPECT_THROW(c->send(0, d.get(), 16, 1, deadline_in(30s)), moe::Error);
  EXPECT_THROW(c->recv(0, d.get(), 16, 1, deadline_in(30s)), moe::Error);
  EXPECT_FALSE(c->aborted()) << "a refused call is the caller's error, not the group's";
  c->barrier(deadline_in(30s));
}

TEST(NcclOneRank, BackgroundTransferToSelf) {
  SKIP_WITHOUT_DEVICE();
  const auto c = one_rank();
  const size_t n = 1 << 20;
  auto src = device_alloc(n), dst = device_alloc(n);
  upload(src.get(), stamped(4, n));
  const auto sent = c->isend(0, src.get(), n, 9, src);
  const auto got = c->irecv(0, dst.get(), n, 9, dst);
  const auto empty = c->isend(0, nullptr, 0, 10);
  EXPECT_TRUE(c->test(empty)) << "a zero-byte transfer completes at once";
  ASSERT_TRUE(completes(*c, got));
  ASSERT_TRUE(completes(*c, sent));
  EXPECT_EQ(download(dst.get(), n), stamped(4, n));
  EXPECT_EQ(src.use_count(), 1) << "the communicator let go of the buffer once test() said done";
  EXPECT_EQ(dst.use_count(), 1);
  EXPECT_THROW(c->test(got), moe::Error) << "a completed id is forgotten";
  c->barrier(deadline_in(30s));  // the communicator goes on after background traffic
}

TEST(NcclOneRank, InjectedErrorAbortsAndLaterCallsFailAtOnce) {
  SKIP_WITHOUT_DEVICE();
  const auto c = one_rank();
  c->inject_fault(NcclFault::kError, 1);
  c->barrier(deadline_in(30s));  // the fault hits the call after this one
  const auto d = device_alloc(64);
  const auto pending = c->isend(0, d.get(), 64, 1, d);  // queued, never issued
  const Segments segs = Segments::packed({64});
  const std::string first =
      transport_error_of([&] { c->all_to_all_v(d.get(), segs, d.get(), segs, deadline_in(30s)); });
  EXPECT_NE(first.find("all_to_all_v: NCCL error"), std::string::npos) << first;
  EXPECT_NE(first.find("injected"), std::string::npos) << first;
  EXPECT_TRUE(c->aborted());

  const auto start = Clock::now();
  const int64_t count = 1;
  int64_t out = 0;
  for (const std::string& msg :
       {transport_error_of([&] { c->barrier(deadline_in(60s)); }),
        transport_error_of([&] { c->exchange_counts(&count, &out, deadline_in(60s)); }),
        transport_error_of([&] { c->all_reduce_sum(static_cast<float*>(d.get()), 16, deadline_in(60s)); }),
        transport_error_of([&] { c->isend(0, d.get(), 64, 2); }), transport_error_of([&] { c->test(pending); })})
    EXPECT_NE(msg.find("communicator was aborted: all_to_all_v: NCCL error"), std::string::npos) << msg;
  EXPECT_LT(seconds_since(start), 2.0) << "calls after an abort must fail at once, not wait for their deadline";
}

TEST(NcclOneRank, StalledOperationTimesOutAtItsDeadline) {
  SKIP_WITHOUT_DEVICE();
  const auto c = one_rank();
  c->inject_fault(NcclFault::kStall);
  const auto start = Clock::now();
  const std::string msg = transport_error_of([&] { c->barrier(deadline_in(300ms)); });
  const double waited = seconds_since(start);
  EXPECT_NE(msg.find("barrier: timed out after"), std::string::npos) << msg;
  EXPECT_NE(msg.find("waiting for NCCL (peer unknown to NCCL)"), std::string::npos) << msg;
  EXPECT_GE(waited, 0.3);
  EXPECT_LT(waited, 10.0);
  EXPECT_TRUE(c->aborted());

  const auto later = Clock::now();
  const std::string next = transport_error_of([&] { c->barrier(deadline_in(60s)); });
  EXPECT_NE(next.find("communicator was aborted: barrier: timed out"), std::string::npos) << next;
  EXPECT_LT(seconds_since(later), 1.0);
}

// The agent says a peer died while the rank's thread waits: abort() from another
// thread ends the wait. Whether the abort lands before or during the barrier,
// the barrier throws the same error; the pause only makes "during" the usual case.
TEST(NcclOneRank, AbortFromAnotherThreadEndsAWait) {
  SKIP_WITHOUT_DEVICE();
  const auto c = one_rank();
  c->inject_fault(NcclFault::kStall);
  std::thread agent([&] {
    std::this_thread::sleep_for(200ms);
    c->abort("agent: rank 1 died");
  });
  const auto start = Clock::now();
  const std::string msg = transport_error_of([&] { c->barrier(deadline_in(60s)); });
  agent.join();
  EXPECT_NE(msg.find("communicator was aborted: agent: rank 1 died"), std::string::npos) << msg;
  EXPECT_LT(seconds_since(start), 30.0) << "the abort, not the deadline, ended the wait";
}

TEST(NcclInit, TimesOutWhenAPeerNeverJoins) {
  SKIP_WITHOUT_DEVICE();
  const auto start = Clock::now();
  const std::string msg = transport_error_of(
      [&] { NcclCommunicator c(0, 2, 0, NcclCommunicator::make_unique_id(), deadline_in(500ms)); });
  EXPECT_NE(msg.find("nccl init: rank 0 of 2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("timed out"), std::string::npos) << msg;
  EXPECT_LT(seconds_since(start), 30.0);
}

TEST(NcclInit, RejectsAUniqueIdOfTheWrongSize) {
  SKIP_WITHOUT_DEVICE();
  EXPECT_THROW(NcclCommunicator(0, 1, 0, "too short", deadline_in(5s)), moe::Error);
}

}  // namespace
}  // namespace moe::test
