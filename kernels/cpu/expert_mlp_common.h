// What the two expert MLP paths (OpenBLAS in expert_mlp.cc, oneDNN in
// expert_mlp_onednn.cc) share: the tile size, offset checks, phase clocks.
#pragma once

#include <algorithm>
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

// The weight gradients W_g [n, k] (fp32) = A_g^T D_g of every group g, rows of
// group g at offset[g]: tiles split each W_g's n rows over the pool, and each
// tile sums its group's rows in chunks of at most kMlpMaxTileRows, calling
// chunk(tile, first_row, rows, accumulate, out, thread) to store (the first
// chunk) or add (the next ones) the product into out = W_g's rows of the tile.
// So an operand gathered per pair needs only a tile-sized panel of the thread's.
// A group without rows gets a zero gradient.
template <typename Chunk>
void for_each_wgrad_chunk(CpuExec& exec, const int64_t* offset, int num_groups, int64_t n, int64_t k, float* w,
                          const Chunk& chunk) {
  plan_wgrad_tiles(exec, offset, num_groups, n);
  exec.pool.parallel_for(static_cast<int64_t>(exec.tiles.size()), [&](int64_t i, int thread) {
    const GemmTile t = exec.tiles[i];
    float* out = w + (static_cast<int64_t>(t.group) * n + t.begin) * k;
    const int64_t begin = offset[t.group], end = offset[t.group + 1];
    if (begin == end) std::fill(out, out + (t.end - t.begin) * k, 0.0f);
    for (int64_t r0 = begin; r0 < end; r0 += kMlpMaxTileRows)
      chunk(t, r0, std::min(kMlpMaxTileRows, end - r0), r0 != begin, out, thread);
  });
}

}  // namespace moe::kernels::cpu
