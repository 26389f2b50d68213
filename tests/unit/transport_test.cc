// The Communicator contract, one test body for every implementation: in-process
// ranks, and UCX ranks (each with its own context and worker) as threads. Real
// processes: tests/integration/transport_fault_test.cc.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <thread>

#include "moe/model/counter_rng.h"
#include "moe/transport/bootstrap.h"
#include "moe/transport/inproc_communicator.h"
#include "moe/transport/ucx_communicator.h"
#include "rank_threads.h"

namespace moe::test {
namespace {

using namespace moe::transport;
using namespace std::chrono_literals;

struct Param {
  Kind kind;
  int ranks;
};

std::string name_of(const ::testing::TestParamInfo<Param>& info) {
  const char* kind = info.param.kind == Kind::kInProc ? "inproc" : info.param.kind == Kind::kUcx ? "ucx" : "hybrid";
  return std::string(kind) + "_R" + std::to_string(info.param.ranks);
}

class CommunicatorTest : public ::testing::TestWithParam<Param> {};

// Bytes rank src sends to rank dst in round `round`: uneven, some zero.
size_t seg_bytes(int src, int dst, int round) { return (src * 7 + dst * 3 + round * 5) % 11 == 0 ? 0 : 1 + (src * 131 + dst * 17 + round * 1000) % 5000; }

uint8_t stamp(int src, int dst, int round, size_t i) {
  return static_cast<uint8_t>(model::mix64((uint64_t(src) << 40) ^ (uint64_t(dst) << 20) ^ (uint64_t(round) << 10) ^ i));
}

TEST_P(CommunicatorTest, AllToAllVDeliversRankStampedSegments) {
  const Param p = GetParam();
  size_t hub_pending = 0;
  const auto errors = run_ranks(p.kind, p.ranks, [&](Communicator& c) {
    const int R = c.size(), me = c.rank();
    for (int round = 0; round < 3; ++round) {
      std::vector<int64_t> send_counts(R), recv_counts(R);
      for (int r = 0; r < R; ++r) send_counts[r] = static_cast<int64_t>(seg_bytes(me, r, round));
      c.exchange_counts(send_counts.data(), recv_counts.data(), deadline_in(10s));
      std::vector<size_t> sb(R), rb(R);
      for (int r = 0; r < R; ++r) {
        sb[r] = static_cast<size_t>(send_counts[r]);
        rb[r] = static_cast<size_t>(recv_counts[r]);
        ASSERT_EQ(rb[r], seg_bytes(r, me, round)) << "count from rank " << r;
      }
      const Segments ss = Segments::packed(sb), rs = Segments::packed(rb);
      std::vector<uint8_t> send(ss.total()), recv(rs.total() + 1, 0xee);
      for (int r = 0; r < R; ++r)
        for (size_t i = 0; i < sb[r]; ++i) send[ss.offset[r] + i] = stamp(me, r, round, i);
      c.all_to_all_v(send.data(), ss, recv.data(), rs, deadline_in(10s));
      for (int r = 0; r < R; ++r)
        for (size_t i = 0; i < rb[r]; ++i)
          ASSERT_EQ(recv[rs.offset[r] + i], stamp(r, me, round, i)) << "from rank " << r << " byte " << i;
      ASSERT_EQ(recv.back(), 0xee) << "wrote past the receive buffer";
    }
  }, &hub_pending);
  for (int r = 0; r < p.ranks; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  EXPECT_EQ(hub_pending, 0u) << "the local hub keeps empty queues of finished messages";
}

TEST_P(CommunicatorTest, SeveralBuffersInOneCall) {
  const Param p = GetParam();
  const auto errors = run_ranks(p.kind, p.ranks, [&](Communicator& c) {
    const int R = c.size(), me = c.rank();
    // Buffer 0: 4 ints per peer; buffer 1: (peer + 1) doubles per peer.
    std::vector<int32_t> a_send(4 * R), a_recv(4 * R);
    std::vector<double> b_send, b_recv;
    std::vector<size_t> b_bytes_send(R), b_bytes_recv(R);
    for (int r = 0; r < R; ++r) {
      for (int i = 0; i < 4; ++i) a_send[4 * r + i] = me * 1000 + r * 10 + i;
      for (int i = 0; i <= r; ++i) b_send.push_back(me + 0.5 * r + i);
      b_bytes_send[r] = 8 * (r + 1);
      b_bytes_recv[r] = 8 * (me + 1);
    }
    b_recv.resize(R * (me + 1));
    const Segments as = Segments::packed(std::vector<size_t>(R, 16));
    const Segments bs = Segments::packed(b_bytes_send), br = Segments::packed(b_bytes_recv);
    c.all_to_all_v({{a_send.data(), &as, a_recv.data(), &as}, {b_send.data(), &bs, b_recv.data(), &br}},
                   deadline_in(10s));
    for (int r = 0; r < R; ++r) {
      for (int i = 0; i < 4; ++i) ASSERT_EQ(a_recv[4 * r + i], r * 1000 + me * 10 + i);
      for (int i = 0; i <= me; ++i) ASSERT_EQ(b_recv[r * (me + 1) + i], r + 0.5 * me + i);
    }
  });
  for (int r = 0; r < p.ranks; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

TEST_P(CommunicatorTest, AllReduceIsRankOrderedAndIdentical) {
  const Param p = GetParam();
  std::vector<std::vector<float>> results(p.ranks);
  const size_t n = 1001;
  auto value = [](int r, size_t i) { return static_cast<float>(model::normal(model::key_hash({uint64_t(r), i})) * 1e3); };
  const auto errors = run_ranks(p.kind, p.ranks, [&](Communicator& c) {
    std::vector<float> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = value(c.rank(), i);
    c.all_reduce_sum(v.data(), n, deadline_in(10s));
    results[c.rank()] = v;
  });
  for (int r = 0; r < p.ranks; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
  for (size_t i = 0; i < n; ++i) {
    float want = value(0, i);
    for (int r = 1; r < p.ranks; ++r) want += value(r, i);
    for (int r = 0; r < p.ranks; ++r) ASSERT_EQ(results[r][i], want) << "rank " << r << " element " << i;
  }
}

// Cases that need a peer: two ranks or more.
class CommunicatorPeersTest : public CommunicatorTest {};

TEST_P(CommunicatorPeersTest, PointToPointMatchesByTag) {
  const Param p = GetParam();
  const auto errors = run_ranks(p.kind, p.ranks, [&](Communicator& c) {
    // Rank 0 sends tags 7 then 3 to rank 1; rank 1 receives 3 first.
    if (c.rank() == 0) {
      const std::vector<int> a(100, 7), b(50, 3);
      c.send(1, a.data(), a.size() * 4, 7, deadline_in(10s));
      c.send(1, b.data(), b.size() * 4, 3, deadline_in(10s));
    } else if (c.rank() == 1) {
      std::vector<int> a(100), b(50);
      c.recv(0, b.data(), b.size() * 4, 3, deadline_in(10s));
      c.recv(0, a.data(), a.size() * 4, 7, deadline_in(10s));
      ASSERT_EQ(a, std::vector<int>(100, 7));
      ASSERT_EQ(b, std::vector<int>(50, 3));
    }
    c.barrier(deadline_in(10s));
  });
  for (int r = 0; r < p.ranks; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// Background transfers move while the ranks run collectives (how expert copies
// ride along with steps): every rank sends a rank-stamped 1 MiB block to its right
// neighbour, does all-reduces until the receive completes, and checks the bytes.
TEST_P(CommunicatorPeersTest, BackgroundTransfersCompleteAlongsideCollectives) {
  const Param p = GetParam();
  const size_t n = 1 << 18;
  const auto errors = run_ranks(p.kind, p.ranks, [&](Communicator& c) {
    const int right = (c.rank() + 1) % c.size(), left = (c.rank() + c.size() - 1) % c.size();
    std::vector<float> out(n), in(n, -1.0f);
    for (size_t i = 0; i < n; ++i) out[i] = static_cast<float>(c.rank() * 1000003 + i);
    const auto recv = c.irecv(left, in.data(), n * 4, 42);
    const auto send = c.isend(right, out.data(), n * 4, 42);
    // A blocking message of the same tag is a different message (its own tag space).
    int token = c.rank();
    c.send(right, &token, sizeof token, 42, deadline_in(10s));
    int got = -1;
    c.recv(left, &got, sizeof got, 42, deadline_in(10s));
    ASSERT_EQ(got, left);
    bool recv_done = false, send_done = false;
    for (int round = 0; round < 100000; ++round) {
      float x = 1.0f;
      c.all_reduce_sum(&x, 1, deadline_in(10s));  // progresses the transfers
      if (!recv_done) recv_done = c.test(recv);
      if (!send_done) send_done = c.test(send);
      // Every rank keeps calling collectives until all are done.
      float all = recv_done && send_done ? 0.0f : 1.0f;
      c.all_reduce_sum(&all, 1, deadline_in(10s));
      if (all == 0.0f) break;
    }
    ASSERT_TRUE(recv_done && send_done);
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(in[i], static_cast<float>(left * 1000003 + i)) << "element " << i;
    c.barrier(deadline_in(10s));  // nobody tears down endpoints a peer still uses
  });
  for (int r = 0; r < p.ranks; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

TEST_P(CommunicatorPeersTest, AMissingRankTimesOutNamingIt) {
  const Param p = GetParam();
  const int absent = p.ranks - 1;
  std::atomic<int> done{0};
  const auto errors = run_ranks(p.kind, p.ranks, [&](Communicator& c) {
    if (c.rank() == absent) {
      // Stays out of the barrier until the others gave up (no sleep: wait for them).
      while (done.load() < p.ranks - 1) std::this_thread::yield();
      return;
    }
    try {
      c.barrier(deadline_in(300ms));
    } catch (const TransportError& e) {
      EXPECT_NE(std::string(e.what()).find("timed out"), std::string::npos) << e.what();
      ++done;
      throw;
    }
    ++done;
  });
  for (int r = 0; r < p.ranks - 1; ++r)
    EXPECT_NE(errors[r].find("rank " + std::to_string(absent)), std::string::npos) << "rank " << r << ": " << errors[r];
}

INSTANTIATE_TEST_SUITE_P(All, CommunicatorTest,
                         ::testing::Values(Param{Kind::kInProc, 1}, Param{Kind::kInProc, 2}, Param{Kind::kInProc, 3},
                                           Param{Kind::kInProc, 4}, Param{Kind::kUcx, 1}, Param{Kind::kUcx, 2},
                                           Param{Kind::kUcx, 3}, Param{Kind::kUcx, 4}, Param{Kind::kHybrid, 2},
                                           Param{Kind::kHybrid, 3}, Param{Kind::kHybrid, 4}),
                         name_of);
INSTANTIATE_TEST_SUITE_P(All, CommunicatorPeersTest,
                         ::testing::Values(Param{Kind::kInProc, 2}, Param{Kind::kInProc, 3}, Param{Kind::kInProc, 4},
                                           Param{Kind::kUcx, 2}, Param{Kind::kUcx, 3}, Param{Kind::kUcx, 4},
                                           Param{Kind::kHybrid, 2}, Param{Kind::kHybrid, 3}, Param{Kind::kHybrid, 4}),
                         name_of);

}  // namespace
}  // namespace moe::test

namespace moe::test {
namespace {

// Rank 0's extra blob (a CUDA job's NCCL id) rides in the same rendezvous as
// every rank's own bytes, which come back unchanged; then UCX connects over them.
TEST(RootBlobBootstrap, CarriesRankZerosBlobBesideEveryRanksBytes) {
  const int R = 3;
  transport::TcpRendezvousServer server(R);
  std::vector<std::vector<std::string>> got(R);
  std::vector<std::string> root(R), errors(R);
  std::vector<std::thread> threads;
  for (int r = 0; r < R; ++r)
    threads.emplace_back([&, r] {
      try {
        transport::TcpBootstrap tcp("127.0.0.1", server.port(), r, R);
        transport::RootBlobBootstrap boot(tcp, r, r == 0 ? std::string("id\0bytes", 8) : "ignored");
        EXPECT_THROW(boot.root_blob(), Error);  // not before the round
        got[r] = boot.all_gather(std::string(r + 1, static_cast<char>('a' + r)));
        root[r] = boot.root_blob();
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  server.wait();
  for (int r = 0; r < R; ++r) {
    EXPECT_EQ(errors[r], "");
    EXPECT_EQ(got[r], (std::vector<std::string>{"a", "bb", "ccc"})) << "rank " << r;
    EXPECT_EQ(root[r], std::string("id\0bytes", 8)) << "rank " << r;
  }
}

}  // namespace
}  // namespace moe::test
