// The expert-parallel layer with every rank a separate process over UCX on
// loopback: the same cases and reference check as the in-process ep_test.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include "ep_harness.h"
#include "process.h"
#include "moe/transport/bootstrap.h"

#ifndef MOE_WORKER_BIN
#error "MOE_WORKER_BIN must name moe-test-worker"
#endif

namespace moe::test {
namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;

std::vector<RankResult> run_processes(const EpCase& c) {
  const fs::path dir = fs::temp_directory_path() / ("moe_ep_" + std::to_string(::getpid()) + "_" + c.name);
  fs::create_directories(dir);
  transport::TcpRendezvousServer server(c.ranks, 60s);
  std::vector<Process> ps;
  for (int r = 0; r < c.ranks; ++r)
    ps.push_back(Process::spawn({MOE_WORKER_BIN, "ep", "--case", c.encode(), "--rank", std::to_string(r), "--port",
                                 std::to_string(server.port()), "--out", (dir / ("rank" + std::to_string(r))).string()}));
  std::vector<RankResult> results;
  for (int r = 0; r < c.ranks; ++r) {
    const int rc = ps[r].wait(120s);
    EXPECT_EQ(rc, 0) << "rank " << r << ": " << ps[r].output();
    if (rc == 0) results.push_back(RankResult::load((dir / ("rank" + std::to_string(r))).string()));
  }
  server.wait();
  fs::remove_all(dir);
  return results;
}

std::vector<EpCase> cases() {
  std::vector<EpCase> v = plain_and_replica_cases();
  v.push_back(small_case("empty_rank_R3", {25, 30, 18}, MapKind::kEmptyRank));
  EpCase c = small_case("bf16_capacity_R2", {30, 41}, MapKind::kReplicas);
  c.dtype = kernels::DType::kBF16;
  c.capacity_factor = 0.9;
  v.push_back(c);
  return v;
}

class EpUcx : public ::testing::TestWithParam<EpCase> {};

TEST_P(EpUcx, ProcessesMatchReference) {
  const EpCase& c = GetParam();
  const std::vector<RankResult> results = run_processes(c);
  ASSERT_EQ(static_cast<int>(results.size()), c.ranks);
  check_against_reference(c, results);
  for (const RankResult& r : results) EXPECT_EQ(r.dispatch_bytes, analytic_dispatch_bytes(c, r)) << "rank " << r.rank;
}

INSTANTIATE_TEST_SUITE_P(Cases, EpUcx, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<EpCase>& i) { return i.param.name; });

}  // namespace
}  // namespace moe::test
