// One EP test case, run the same way by in-process ranks (threads) and by UCX
// ranks (moe-test-worker processes): build the map, the inputs of the rank's
// global tokens, run forward and backward, collect what the rank produced; then
// check all ranks together against the fp64 reference of the union of their tokens.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "moe/ep/ep_layer.h"
#include "moe/kernels/api.h"

namespace moe::test {

enum class MapKind { kContiguous, kReplicas, kEmptyRank, kReversed, kTwoReplicasOnARank };

struct EpCase {
  std::string name;
  int ranks = 2;
  std::vector<int64_t> tokens;  // per rank (uneven allowed, 0 allowed)
  int hidden = 32, ffn = 16, experts = 8, top_k = 2;
  kernels::ScoreFunc score = kernels::ScoreFunc::kSoftmax;
  double capacity_factor = 0.0;
  kernels::DType dtype = kernels::DType::kF32;
  MapKind map = MapKind::kContiguous;
  uint64_t seed = 1;
  std::string skew = "uniform";
  double aux = 0, z = 0;     // balancing loss coefficients (global counts when either is on)
  int shared = 0;            // shared experts' width (0: none)
  bool shared_gate = false;
  bool train = true;        // false: a forward-only layer (forward checked, no backward)
  int overlap_chunks = 0;   // EpOptions::overlap_chunks
  bool exact_replica_grads = false;  // EpOptions::exact_replica_grads
  kernels::WireChoice dispatch_wire, combine_wire;  // EpOptions (nullopt: the layer's own)

  int64_t token_begin(int rank) const;
  int64_t total_tokens() const;
  ep::MoeLayerConfig layer_config() const;
  moe::ExpertMap expert_map() const;
  // A compact command-line form ("R=3 T=5,0,9 H=32 ...") and its parser, so a
  // worker process runs exactly the case the test describes.
  std::string encode() const;
  static EpCase decode(const std::string& s);
};

inline void PrintTo(const EpCase& c, std::ostream* os) { *os << c.name; }

// The small case of the EP tests: H=32, I=16, E=24 (divides over 1, 2, 3, 4 and 8
// ranks), K=4, one rank per entry of tokens.
EpCase small_case(const std::string& name, std::vector<int64_t> tokens, MapKind map);
// plain_R* and replicas_R* for R = 1, 2, 3, 4, 8 with uneven and empty ranks: the
// equivalence cases of both the in-process and the UCX-process tests.
std::vector<EpCase> plain_and_replica_cases();

// What one rank produced (host copies, fp32).
struct RankResult {
  int rank = 0;
  std::vector<float> out, grad_x;         // [T, H]
  std::vector<int32_t> topk_idx;          // [T, K] selection
  std::vector<int32_t> kept_idx;          // [T, K]
  std::vector<float> grad_gate;           // [E, H]
  std::vector<float> grad_w13, grad_w2;   // per local slot: [S, 2I, H], [S, H, I]
  int64_t dispatch_bytes = 0, combine_bytes = 0, naive_dispatch_bytes = 0;
  int chunks = 0;                         // of the forward's dispatch/combine
  std::vector<float> losses;              // this rank's shares {aux, z}
  std::vector<float> grad_shared_w13, grad_shared_w2, grad_shared_gate;  // summed over ranks

  void save(const std::string& path) const;
  static RankResult load(const std::string& path);
};

// data_comm: the layer's communicator for backend memory (EpOptions); null: comm.
RankResult run_rank(const EpCase& c, transport::Communicator& comm, kernels::Backend& be,
                    transport::Communicator* data_comm = nullptr);

// Runs every rank of c as a thread over the in-process transport.
std::vector<RankResult> run_inproc(const EpCase& c, int threads_per_rank = 1);
// The same with a second in-process group as the layers' data communicator (as a
// CUDA job runs: NCCL for the backend's memory beside the host transport).
std::vector<RankResult> run_inproc_with_data_comm(const EpCase& c);
// Every rank a thread too, but as two "daemons" of this process: UCX between the
// halves, each half's ranks in-process through a LocalHub.
std::vector<RankResult> run_hybrid(const EpCase& c);

// The rows the routed experts see after c's dispatch wire (x: the layer dtype's
// values); empty when the wire carries them as they are.
std::vector<double> expert_input(const EpCase& c, const std::vector<float>& x);

// Compares the ranks' results with the reference; ADD_FAILURE()s with the case name.
void check_against_reference(const EpCase& c, const std::vector<RankResult>& results);

// Analytic dispatch bytes of rank r: distinct remote ranks per token x (row + metadata).
int64_t analytic_dispatch_bytes(const EpCase& c, const RankResult& r);

}  // namespace moe::test
