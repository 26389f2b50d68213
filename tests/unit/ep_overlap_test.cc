// Chunked dispatch/combine pipelined with the experts (docs/layer.md#overlap):
// the forward, and a train layer's backward, give the same bits for every chunk
// count, over in-process ranks and over UCX; the ranks agree on the count; a rank lost mid-pipeline fails its peers
// with an error instead of a hang; the chunk rule.
#include <gtest/gtest.h>

#include <random>

#include "ep_harness.h"
#include "moe/ep/dispatcher.h"
#include "moe/kernels/cpu_backend.h"
#include "rank_threads.h"
#include "test_util.h"

namespace moe::test {
namespace {

EpCase forward_case(const std::string& name, std::vector<int64_t> tokens, MapKind map) {
  EpCase c = small_case(name, std::move(tokens), map);
  c.train = false;
  return c;
}

std::vector<EpCase> overlap_cases() {
  std::vector<EpCase> v;
  v.push_back(forward_case("plain_R2", {150, 97}, MapKind::kContiguous));
  v.push_back(forward_case("replicas_R3_idle_rank", {120, 0, 88}, MapKind::kReplicas));
  v.push_back(forward_case("empty_rank_R3", {70, 64, 5}, MapKind::kEmptyRank));
  EpCase c = forward_case("skewed_R4", {90, 90, 90, 90}, MapKind::kReplicas);
  c.skew = "zipf:1.5";
  v.push_back(c);
  c = forward_case("bf16_capacity_R2", {130, 111}, MapKind::kReplicas);
  c.dtype = kernels::DType::kBF16;
  c.capacity_factor = 0.9;
  v.push_back(c);
  c = forward_case("shared_gate_R3", {60, 75, 33}, MapKind::kReplicas);
  c.shared = 24;
  c.shared_gate = true;
  v.push_back(c);
  return v;
}

// chunks = 1 is the serial path; every other count must give its bits exactly
// (every GEMM a row goes through computes it alike in a call of any rows: the
// row-invariant GEMM, docs/backends.md#row-invariant-gemm), 8 included (more chunks than some
// ranks have rows): the output, and in a train layer every gradient (the weight
// gradients sum rows in the handle's row order, which no chunking changes); and
// every count matches the reference.
void expect_every_chunk_count_gives_the_serial_bits(EpCase serial) {
  serial.overlap_chunks = 1;
  const std::vector<RankResult> want = run_inproc(serial);
  check_against_reference(serial, want);
  for (int chunks : {2, 3, 8}) {
    EpCase c = serial;
    c.overlap_chunks = chunks;
    const std::vector<RankResult> got = run_inproc(c, 2);
    check_against_reference(c, got);
    for (int r = 0; r < c.ranks; ++r) {
      SCOPED_TRACE(c.name + " chunks " + std::to_string(chunks) + " rank " + std::to_string(r));
      EXPECT_EQ(got[r].chunks, chunks);
      EXPECT_EQ(got[r].topk_idx, want[r].topk_idx);
      EXPECT_EQ(got[r].dispatch_bytes, want[r].dispatch_bytes);
      EXPECT_EQ(got[r].combine_bytes, want[r].combine_bytes);
      EXPECT_EQ(got[r].out, want[r].out) << "out";
      EXPECT_EQ(got[r].grad_x, want[r].grad_x) << "grad_x";
      EXPECT_EQ(got[r].grad_gate, want[r].grad_gate) << "grad_gate";
      EXPECT_EQ(got[r].grad_w13, want[r].grad_w13) << "grad_w13";
      EXPECT_EQ(got[r].grad_w2, want[r].grad_w2) << "grad_w2";
      EXPECT_EQ(got[r].grad_shared_w13, want[r].grad_shared_w13) << "grad_shared_w13";
    }
  }
}

class Overlap : public ::testing::TestWithParam<EpCase> {};

TEST_P(Overlap, EveryChunkCountGivesTheSerialBits) { expect_every_chunk_count_gives_the_serial_bits(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Cases, Overlap, ::testing::ValuesIn(overlap_cases()),
                         [](const ::testing::TestParamInfo<EpCase>& i) { return i.param.name; });

std::vector<EpCase> train_overlap_cases() {
  std::vector<EpCase> v;
  for (EpCase c : overlap_cases()) {
    c.train = true;
    v.push_back(c);
  }
  EpCase c = small_case("fp8_wire_aux_R2", {140, 120}, MapKind::kReplicas);
  c.dispatch_wire = kernels::WireFormat::kFP8;
  c.combine_wire = kernels::WireFormat::kBF16;
  c.aux = 0.01;
  v.push_back(c);
  return v;
}

class TrainOverlap : public ::testing::TestWithParam<EpCase> {};

// A train layer chunks both pairs (forward and backward).
TEST_P(TrainOverlap, EveryChunkCountGivesTheSerialGradients) {
  expect_every_chunk_count_gives_the_serial_bits(GetParam());
}

INSTANTIATE_TEST_SUITE_P(Cases, TrainOverlap, ::testing::ValuesIn(train_overlap_cases()),
                         [](const ::testing::TestParamInfo<EpCase>& i) { return i.param.name; });

// Over UCX between two "daemons" of two ranks each: a forward and a train layer in 3 chunks.
TEST(OverlapUcx, ChunksOverUcxGiveTheSerialBits) {
  for (bool train : {false, true}) {
    EpCase c = small_case(train ? "hybrid_train_R4" : "hybrid_R4", {82, 61, 0, 47}, MapKind::kReplicas);
    c.train = train;
    c.overlap_chunks = 1;
    const std::vector<RankResult> want = run_inproc(c);
    c.overlap_chunks = 3;
    const std::vector<RankResult> got = run_hybrid(c);
    check_against_reference(c, got);
    for (int r = 0; r < c.ranks; ++r) {
      SCOPED_TRACE(c.name + " rank " + std::to_string(r));
      EXPECT_EQ(got[r].chunks, 3);
      EXPECT_EQ(got[r].out, want[r].out) << "out";
      EXPECT_EQ(got[r].grad_x, want[r].grad_x) << "grad_x";
      EXPECT_EQ(got[r].grad_w13, want[r].grad_w13) << "grad_w13";
      EXPECT_EQ(got[r].grad_w2, want[r].grad_w2) << "grad_w2";
    }
  }
}

// A dispatcher alone, with experts that return their row for each of its pairs:
// combine then gives each token x times the number of its routed pairs; the
// backward pair, with "experts" that return their grad row for each pair and a
// weight gradient of 1 a pair, gives grad_out times that number, and 1 for every
// routed pair.
struct IdentityRun {
  int chunks = 0;
  std::vector<int64_t> chunk_rows;  // received rows per chunk, forward
  std::vector<float> out, want, grad_x, grad_topk_weight, want_grad_topk_weight;
};

enum class Die { kNever, kAfterDispatch, kMidBackward };

IdentityRun identity_pair(transport::Communicator& comm, int asked_chunks, int64_t T, Die die) {
  const int R = comm.size(), K = 3, H = 16, S = 2;
  kernels::ThreadPool pool(1);
  auto be = kernels::make_cpu_backend(pool);
  ep::Dispatcher d({.hidden = H, .top_k = K, .max_tokens = T, .num_ranks = R, .slots_per_rank = S, .train = true},
                   comm, *be, {.timeout = std::chrono::seconds(20), .overlap_chunks = asked_chunks});
  std::mt19937 rng(17 + comm.rank());
  std::vector<float> x(T * H), weight(T * K, 1.0f);
  std::vector<int32_t> slot(T * K);
  for (float& v : x) v = std::uniform_real_distribution<float>(-1, 1)(rng);
  for (int64_t t = 0; t < T; ++t)  // a token's slots are distinct (its experts are), or -1
    for (int k = 0; k < K; ++k) {
      int32_t& s = slot[t * K + k];
      do s = std::uniform_int_distribution<int32_t>(-1, R * S - 1)(rng);
      while (s >= 0 && std::find(&slot[t * K], &slot[t * K + k], s) != &slot[t * K + k]);
    }
  const ep::DispatchHandle& h = d.dispatch(x.data(), T, slot.data(), weight.data());
  if (die == Die::kAfterDispatch) throw std::runtime_error("rank gone");
  const int64_t N = h.num_recv_rows();
  std::vector<float> y;
  // Each received row's pair rows (h.recv_pair_offset()) hold a copy of `rows`' row.
  auto per_pair = [&](const float* rows, int64_t first, int64_t n, std::vector<float>& out) {
    out.resize(h.num_recv_pairs() * H);
    for (int64_t i = first; i < first + n; ++i)
      for (int64_t p = h.recv_pair_offset()[i]; p < h.recv_pair_offset()[i + 1]; ++p)
        std::copy_n(rows + i * H, H, out.data() + p * H);
  };
  IdentityRun run;
  for (int c = 0; c < d.chunks(); ++c) {
    const ep::ChunkRows ch = d.next_chunk();
    per_pair(static_cast<const float*>(h.recv_rows()), ch.first_row, ch.num_rows, y);
    d.chunk_done(y.data());
    run.chunk_rows.push_back(ch.num_rows);
  }
  run.chunks = d.chunks();
  run.out.resize(T * H);
  if (d.chunks() == 1) per_pair(static_cast<const float*>(h.recv_rows()), 0, N, y);
  d.combine(h, y.data(), run.out.data());

  // Backward with grad_out = x: the grad rows come back as they went out.
  const auto* g = static_cast<const float*>(d.combine_backward(h, x.data()));
  if (die == Die::kMidBackward) throw std::runtime_error("rank gone");
  std::vector<float> grad_rows, grad_pair_weight(N * K);
  auto compute = [&](int64_t first, int64_t n) {
    per_pair(g, first, n, grad_rows);
    for (int64_t i = first * K; i < (first + n) * K; ++i) grad_pair_weight[i] = h.recv_slot()[i] >= 0 ? 1.0f : 0.0f;
  };
  if (d.chunks() == 1) compute(0, N);
  for (int c = 0; d.chunks() > 1 && c < d.chunks(); ++c) {
    const ep::ChunkRows ch = d.next_backward_chunk();
    compute(ch.first_row, ch.num_rows);
    d.backward_chunk_done(grad_rows.data(), grad_pair_weight.data());
  }
  run.grad_x.resize(T * H);
  run.grad_topk_weight.resize(T * K);
  d.dispatch_backward(h, grad_rows.data(), grad_pair_weight.data(), run.grad_x.data(), run.grad_topk_weight.data());

  run.want.assign(T * H, 0.0f);
  run.want_grad_topk_weight.assign(T * K, 0.0f);
  for (int64_t t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k)
      if (slot[t * K + k] >= 0) {
        run.want_grad_topk_weight[t * K + k] = 1.0f;
        for (int i = 0; i < H; ++i) run.want[t * H + i] += x[t * H + i];
      }
  return run;
}

TEST(OverlapDispatcher, RanksAgreeOnTheLargestProposalForBothPairs) {
  const std::vector<int> asked = {2, 1, 5};
  std::vector<IdentityRun> runs(3);
  const auto errors = run_ranks(Kind::kInProc, 3, [&](transport::Communicator& comm) {
    runs[comm.rank()] = identity_pair(comm, asked[comm.rank()], 200, Die::kNever);
  });
  for (int r = 0; r < 3; ++r) {
    ASSERT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(runs[r].chunks, 5) << "rank " << r;
    EXPECT_EQ(runs[r].out, runs[r].want) << "rank " << r;
    EXPECT_EQ(runs[r].grad_x, runs[r].want) << "rank " << r;  // grad_out = x
    EXPECT_EQ(runs[r].grad_topk_weight, runs[r].want_grad_topk_weight) << "rank " << r;
  }
}

// docs/layer.md#overlap: the first and last chunks carry half the rows of the
// others (each peer's share rounded down, so within a row per peer).
TEST(OverlapDispatcher, EndChunksCarryHalfTheRowsOfTheOthers) {
  for (int C : {3, 4, 8}) {
    std::vector<IdentityRun> runs(2);
    const auto errors = run_ranks(Kind::kInProc, 2, [&](transport::Communicator& comm) {
      runs[comm.rank()] = identity_pair(comm, C, 840, Die::kNever);
    });
    for (int r = 0; r < 2; ++r) {
      ASSERT_EQ(errors[r], "") << "rank " << r;
      ASSERT_EQ(runs[r].chunk_rows.size(), static_cast<size_t>(C));
      EXPECT_EQ(runs[r].out, runs[r].want) << "rank " << r;
      const std::vector<int64_t>& n = runs[r].chunk_rows;
      for (int c = 1; c + 1 < C; ++c) {
        EXPECT_NEAR(n[c], n[1], 2) << "C " << C << " chunk " << c;
        EXPECT_NEAR(2 * n[0], n[c], 4) << "C " << C << " chunk " << c;
        EXPECT_NEAR(2 * n[C - 1], n[c], 4) << "C " << C << " chunk " << c;
      }
    }
  }
}

// A rank lost while chunks are in flight, forward or backward, fails its peers
// with an error naming it instead of a hang.
TEST(OverlapDispatcher, ARankLostMidPipelineFailsItsPeers) {
  for (Die die : {Die::kAfterDispatch, Die::kMidBackward}) {
    const auto errors = run_ranks(Kind::kInProc, 3, [&](transport::Communicator& comm) {
      identity_pair(comm, 4, 300, comm.rank() == 1 ? die : Die::kNever);
    });
    EXPECT_NE(errors[1].find("rank gone"), std::string::npos) << errors[1];
    for (int r : {0, 2}) EXPECT_NE(errors[r].find("rank 1"), std::string::npos) << "rank " << r << ": " << errors[r];
  }
}

// A peer's counts are checked before anything is sized from them (issue 44): a
// forged row count or chunk proposal fails the step naming the peer, and the
// honest rank allocates nothing for it.
TEST(OverlapDispatcher, AForgedCountFailsTheStepNamingThePeer) {
  // The word a rank sends each peer: its row count << 8 | the chunks it proposes.
  struct Forgery {
    int64_t word;  // what the hostile rank 1 sends rank 0
    std::string named;
  };
  const int64_t T = 100;
  for (const Forgery& f : {Forgery{(int64_t{1} << 40) << 8 | 1, "rank 1 announced 1099511627776 rows; a rank sends 0 to 100"},
                           Forgery{-5 * 256 + 1, "rank 1 announced -5 rows"},
                           Forgery{(int64_t{3} << 8) | 200, "rank 1 proposed 200 chunks; 1 to 8 are valid"},
                           Forgery{int64_t{3} << 8, "rank 1 proposed 0 chunks"}}) {
    const auto errors = run_ranks(Kind::kInProc, 2, [&](transport::Communicator& comm) {
      if (comm.rank() == 0) {
        identity_pair(comm, 1, T, Die::kNever);  // 1: no link measurement before the counts
        return;
      }
      const std::vector<int64_t> send = {f.word, 0};
      std::vector<int64_t> recv(2);
      comm.exchange_counts(send.data(), recv.data(), transport::deadline_in(std::chrono::seconds(20)));
    });
    EXPECT_NE(errors[0].find("dispatch: " + f.named), std::string::npos) << errors[0];
  }
}

TEST(ChunkRule, HidesTheShorterSideAndKeepsChunksWorthComputing) {
  EXPECT_EQ(ep::chunk_rule(0, 0.5, 4096), 1);        // nothing measured yet
  EXPECT_EQ(ep::chunk_rule(0.07, 0.4, 4096), 1);     // transfer under a fifth of compute: not worth it
  EXPECT_EQ(ep::chunk_rule(0.1, 0.4, 4096), 3);      // ceil(0.1 / 0.04)
  EXPECT_EQ(ep::chunk_rule(0.78, 0.37, 4096), 5);    // link-bound: hide the compute
  EXPECT_EQ(ep::chunk_rule(10, 10, 1e6), ep::kMaxChunks);
  EXPECT_EQ(ep::chunk_rule(10, 10, 3 * ep::kMinExpertRows), 3);  // each chunk >= kMinExpertRows rows an expert
  EXPECT_EQ(ep::chunk_rule(10, 10, 100), 1);
}

}  // namespace
}  // namespace moe::test
