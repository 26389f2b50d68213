// What the two expert MLP paths (OpenBLAS in expert_mlp.cc, oneDNN in
// expert_mlp_onednn.cc) share: the tile size, offset checks, phase clocks.
#pragma once

#include <atomic>
#include <chrono>

#include "cpu_ops.h"
#include "moe/base/check.h"

namespace moe::kernels::cpu {

// Rows per fused tile: one expert's rows, split so a tile's panels stay in L2.
constexpr int64_t kMlpMaxTileRows = 512;

// Rows src[0..count) of `rows` ([num_src_rows, H] of dtype) as fp32 rows of out,
// densely; throws on a source row out of range.
void gather_rows(const void* rows, DType dtype, int H, const int32_t* src, int64_t count, int64_t num_src_rows,
                 float* out);

// Thread-seconds per phase, summed over tiles; flushed into ExpertMlpStats.
class PhaseClock {
 public:
  using Clock = std::chrono::steady_clock;
  void start() { t_ = Clock::now(); }
  // Adds the time since the last start()/lap() to `slot` and restarts.
  void lap(std::atomic<double>& slot) {
    const auto now = Clock::now();
    slot.fetch_add(std::chrono::duration<double>(now - t_).count(), std::memory_order_relaxed);
    t_ = now;
  }

 private:
  Clock::time_point t_;
};

struct PhaseTotals {
  std::atomic<double> gather{0}, gemm{0}, swiglu{0};
  void flush(ExpertMlpStats* stats) const {
    if (!stats) return;
    stats->gather_seconds += gather.load();
    stats->gemm_seconds += gemm.load();
    stats->swiglu_seconds += swiglu.load();
  }
};

// Runs body(tile, rows, thread, clock) on every row tile (at most kMlpMaxTileRows
// rows of one expert) of the part's pairs on the pool, the clock started for each tile.
template <typename Body>
void for_each_row_tile(CpuExec& exec, const int64_t* expert_offset, const ExpertMlpPart& part, int num_experts,
                       const Body& body) {
  if (part.whole())
    plan_row_tiles(exec, expert_offset, num_experts, kMlpMaxTileRows);
  else
    plan_row_tiles(exec, part.pair_begin, part.pair_end, num_experts, kMlpMaxTileRows);
  exec.pool.parallel_for(static_cast<int64_t>(exec.tiles.size()), [&](int64_t i, int thread) {
    PhaseClock clock;
    clock.start();
    const GemmTile t = exec.tiles[i];
    body(t, t.end - t.begin, thread, clock);
  });
}

}  // namespace moe::kernels::cpu
