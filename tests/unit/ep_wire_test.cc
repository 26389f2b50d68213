// Wire formats of the forward pair (docs/layer.md#wire-formats): every format
// against the fp64 reference of what the experts see (ref::through_fp8_wire /
// through_bf16_wire), forward and backward, on 1 and several ranks, in-process
// and over UCX, serial and chunked; the bytes each format moves; bad choices.
#include <gtest/gtest.h>

#include "ep_harness.h"
#include "moe/ep/dispatcher.h"
#include "moe/kernels/cpu_backend.h"
#include "moe/transport/inproc_communicator.h"
#include "rank_threads.h"
#include "test_util.h"

namespace moe::test {
namespace {

using kernels::WireFormat;
constexpr kernels::WireChoice kLayer = std::nullopt;  // the layer's own format

// The message of what make() throws ("" if it does not).
template <typename F>
std::string error_of(F&& make) {
  try {
    make();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

EpCase wire_case(const std::string& name, std::vector<int64_t> tokens, MapKind map, kernels::WireChoice dispatch, kernels::WireChoice combine) {
  EpCase c = small_case(name, std::move(tokens), map);
  c.hidden = 160;  // two fp8 groups, the second one short
  c.dispatch_wire = dispatch;
  c.combine_wire = combine;
  return c;
}

std::vector<EpCase> wire_cases() {
  std::vector<EpCase> v;
  v.push_back(wire_case("bf16_dispatch_R1", {37}, MapKind::kContiguous, WireFormat::kBF16, kLayer));
  v.push_back(wire_case("bf16_both_R2", {40, 23}, MapKind::kReplicas, WireFormat::kBF16, WireFormat::kBF16));
  v.push_back(wire_case("fp8_R1", {33}, MapKind::kContiguous, WireFormat::kFP8, kLayer));
  v.push_back(wire_case("fp8_bf16_R3_idle_rank", {31, 0, 44}, MapKind::kReplicas, WireFormat::kFP8, WireFormat::kBF16));
  EpCase c = wire_case("fp8_empty_rank_R3", {25, 30, 18}, MapKind::kEmptyRank, WireFormat::kFP8, kLayer);
  c.skew = "zipf:1.2";
  v.push_back(c);
  c = wire_case("bf16_layer_fp8_R2", {30, 26}, MapKind::kReplicas, WireFormat::kFP8, kLayer);
  c.dtype = kernels::DType::kBF16;
  v.push_back(c);
  c = wire_case("forward_fp8_bf16_chunked_R2", {150, 97}, MapKind::kContiguous, WireFormat::kFP8, WireFormat::kBF16);
  c.train = false;
  c.overlap_chunks = 3;
  v.push_back(c);
  return v;
}

class WireFormats : public ::testing::TestWithParam<EpCase> {};

TEST_P(WireFormats, MatchTheReferenceOfWhatTheExpertsSee) {
  const EpCase& c = GetParam();
  const std::vector<RankResult> got = run_inproc(c);
  check_against_reference(c, got);
  if (c.overlap_chunks > 1)
    for (const RankResult& r : got) EXPECT_EQ(r.chunks, c.overlap_chunks) << "rank " << r.rank;
}

INSTANTIATE_TEST_SUITE_P(Cases, WireFormats, ::testing::ValuesIn(wire_cases()),
                         [](const ::testing::TestParamInfo<EpCase>& i) { return i.param.name; });

TEST(WireFormatsUcx, Fp8AndBf16OverUcxMatchTheReference) {
  const EpCase c = wire_case("hybrid_fp8_bf16_R4", {22, 31, 0, 17}, MapKind::kReplicas, WireFormat::kFP8, WireFormat::kBF16);
  check_against_reference(c, run_hybrid(c));
}

// The same routing moves wire-row bytes: bf16 is 2H + 8K a row against 4H + 8K,
// fp8 H + 4 ceil(H / 128) + 8K; a combined row 2H against 4H.
TEST(WireFormats, MoveTheBytesOfTheirRows) {
  EpCase c = wire_case("bytes", {300, 300, 300, 300}, MapKind::kContiguous, kLayer, kLayer);
  c.top_k = 8;
  c.experts = 64;
  c.train = false;
  const auto fp32 = run_inproc(c);
  c.dispatch_wire = WireFormat::kBF16;
  c.combine_wire = WireFormat::kBF16;
  const auto bf16 = run_inproc(c);
  c.dispatch_wire = WireFormat::kFP8;
  const auto fp8 = run_inproc(c);
  const int64_t H = c.hidden, K = c.top_k, meta = 8 * K + 4;  // slots, weights, the source token
  for (int r = 0; r < c.ranks; ++r) {
    ASSERT_EQ(bf16[r].topk_idx, fp32[r].topk_idx);  // the router sees x as it is
    EXPECT_NE(fp8[r].out, fp32[r].out);              // the experts do not
    EXPECT_NE(bf16[r].out, fp32[r].out);
    const int64_t rows = fp32[r].dispatch_bytes / (4 * H + meta);
    ASSERT_GT(rows, 0);
    EXPECT_EQ(fp32[r].dispatch_bytes, rows * (4 * H + meta));
    EXPECT_EQ(bf16[r].dispatch_bytes, rows * (2 * H + meta));
    EXPECT_EQ(fp8[r].dispatch_bytes, rows * (H + 4 * 2 + meta));
    EXPECT_EQ(bf16[r].combine_bytes * 2, fp32[r].combine_bytes);
    EXPECT_EQ(fp8[r].naive_dispatch_bytes * (4 * H + 8), fp32[r].naive_dispatch_bytes * (H + 8 + 8));
  }
}

TEST(WireFormats, AWiderOrUnsupportedWireIsRefused) {
  transport::InProcGroup group(1);
  auto comm = group.communicator(0);
  kernels::ThreadPool pool(1);
  auto be = kernels::make_cpu_backend(pool);
  const ep::DispatcherConfig base{.hidden = 16, .top_k = 2, .max_tokens = 8, .num_ranks = 1, .slots_per_rank = 2};
  ep::DispatcherConfig c = base;
  c.dtype = kernels::DType::kBF16;
  c.dispatch_wire = WireFormat::kF32;
  std::string why = error_of([&] { ep::Dispatcher d(c, *comm, *be); });
  EXPECT_NE(why.find("dispatch wire fp32 is wider than the layer's bf16 rows"), std::string::npos) << why;
  c = base;
  c.combine_wire = WireFormat::kFP8;
  why = error_of([&] { ep::Dispatcher d(c, *comm, *be); });
  EXPECT_NE(why.find("combine wire fp8"), std::string::npos) << why;
}

}  // namespace
}  // namespace moe::test
