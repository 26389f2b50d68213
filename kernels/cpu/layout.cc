// Dispatch layout (which ranks need which token) and permute layout (rows to
// expert-major order). Both are two-pass counting sorts over fixed token blocks,
// so the result does not depend on the thread count or scheduling.
#include <algorithm>
#include <cstring>

#include "cpu_ops.h"
#include "moe/base/check.h"

namespace moe::kernels::cpu {
namespace {

// Fixed block partition: at most kMaxBlocks blocks, at least kMinBlockRows rows each.
constexpr int64_t kMaxBlocks = 64;
constexpr int64_t kMinBlockRows = 256;

struct Blocks {
  int64_t size;
  int64_t count;
};

Blocks make_blocks(int64_t n) {
  const int64_t bs = block_size(n, kMinBlockRows, kMaxBlocks);
  return {bs, n == 0 ? 0 : ceil_div(n, bs)};
}

}  // namespace

size_t dispatch_layout_workspace_bytes(const DispatchLayoutConfig& cfg, int) {
  const size_t slots = static_cast<size_t>(cfg.num_ranks) * cfg.slots_per_rank;
  return align64(4 * kMaxBlocks * (static_cast<size_t>(cfg.num_ranks) + slots));
}

void dispatch_layout(ThreadPool& pool, const DispatchLayoutConfig& cfg,
                     const DispatchLayoutArgs& a) {
  cfg.validate();
  const int64_t T = cfg.num_tokens;
  const int K = cfg.top_k, R = cfg.num_ranks, S = cfg.slots_per_rank;
  const int64_t num_slots = static_cast<int64_t>(R) * S;
  const Blocks blocks = make_blocks(T);
  int32_t* rank_count = static_cast<int32_t*>(a.workspace);      // [blocks, R]
  int32_t* slot_count = rank_count + kMaxBlocks * R;             // [blocks, R * S]

  // Pass 1: per block, tokens per rank and pairs per slot.
  pool.parallel_for(blocks.count, [&](int64_t b, int) {
    int32_t* rc = rank_count + b * R;
    int32_t* sc = slot_count + b * num_slots;
    std::memset(rc, 0, sizeof(int32_t) * R);
    std::memset(sc, 0, sizeof(int32_t) * num_slots);
    const int64_t t1 = std::min(T, (b + 1) * blocks.size);
    for (int64_t t = b * blocks.size; t < t1; ++t) {
      uint8_t* in_rank = a.is_token_in_rank + t * R;
      std::memset(in_rank, 0, R);
      for (int k = 0; k < K; ++k) {
        const int32_t slot = a.topk_slot[t * K + k];
        if (slot < 0) continue;
        MOE_CHECK(slot < num_slots, "dispatch layout: topk_slot[", t, ",", k, "] = ", slot,
                  " is out of range [0, ", num_slots, ")");
        ++sc[slot];
        in_rank[slot / S] = 1;
      }
      for (int r = 0; r < R; ++r) rc[r] += in_rank[r];
    }
  });

  // Prefix over blocks: rank_count[b, r] becomes block b's first row in rank r's segment.
  a.rank_offset[0] = 0;
  for (int r = 0; r < R; ++r) {
    int32_t total = 0;
    for (int64_t b = 0; b < blocks.count; ++b) {
      const int32_t c = rank_count[b * R + r];
      rank_count[b * R + r] = total;
      total += c;
    }
    a.num_tokens_per_rank[r] = total;
    a.rank_offset[r + 1] = a.rank_offset[r] + total;
  }
  for (int64_t s = 0; s < num_slots; ++s) {
    int32_t total = 0;
    for (int64_t b = 0; b < blocks.count; ++b) total += slot_count[b * num_slots + s];
    a.num_tokens_per_slot[s] = total;
  }

  // Pass 2: send rows (rank-major, token order inside a rank) and their metadata.
  pool.parallel_for(blocks.count, [&](int64_t b, int) {
    int32_t* next = rank_count + b * R;
    const int64_t t1 = std::min(T, (b + 1) * blocks.size);
    for (int64_t t = b * blocks.size; t < t1; ++t)
      for (int r = 0; r < R; ++r) {
        if (!a.is_token_in_rank[t * R + r]) {
          a.token_send_row[t * R + r] = -1;
          continue;
        }
        const int64_t row = a.rank_offset[r] + next[r]++;
        a.token_send_row[t * R + r] = static_cast<int32_t>(row);
        if (a.send_src_token) a.send_src_token[row] = static_cast<int32_t>(t);
        if (!a.send_slot) continue;
        for (int k = 0; k < K; ++k) {
          const int32_t slot = a.topk_slot[t * K + k];
          const bool here = slot >= 0 && slot / S == r;
          a.send_slot[row * K + k] = here ? slot % S : -1;
          if (a.send_weight) a.send_weight[row * K + k] = here ? a.topk_weight[t * K + k] : 0.0f;
        }
      }
  });
}

size_t permute_layout_workspace_bytes(const PermuteLayoutConfig& cfg, int) {
  return align64(8 * kMaxBlocks * static_cast<size_t>(std::max(cfg.num_experts, 1)));
}

namespace {

// The row visited at position i: row_order[i], or i.
int64_t row_at(const PermuteLayoutArgs& a, int64_t N, int64_t i) {
  if (!a.row_order) return i;
  const int64_t n = a.row_order[i];
  MOE_CHECK(n >= 0 && n < N, "permute layout: row_order[", i, "] = ", n, " is out of range [0, ", N, ")");
  return n;
}

}  // namespace

void permute_layout(ThreadPool& pool, const PermuteLayoutConfig& cfg, const PermuteLayoutArgs& a) {
  cfg.validate();
  const int64_t N = cfg.num_rows;
  const int K = cfg.top_k, L = cfg.num_experts;
  const Blocks blocks = make_blocks(N);
  int64_t* count = static_cast<int64_t*>(a.workspace);  // [blocks, L]

  pool.parallel_for(blocks.count, [&](int64_t b, int) {
    int64_t* c = count + b * L;
    std::fill(c, c + L, 0);
    const int64_t i1 = std::min(N, (b + 1) * blocks.size);
    for (int64_t i = b * blocks.size; i < i1; ++i) {
      const int64_t n = row_at(a, N, i);
      for (int k = 0; k < K; ++k) {
        const int32_t e = a.row_expert[n * K + k];
        MOE_CHECK(e >= -1 && e < L, "permute layout: row_expert[", n, ",", k, "] = ", e, " is out of range [0, ",
                  L, ")");
        if (e >= 0) ++c[e];
      }
    }
  });

  // Expert-major, then block order: block b of expert e starts at count[b, e].
  int64_t total = 0;
  for (int e = 0; e < L; ++e) {
    a.expert_offset[e] = total;
    for (int64_t b = 0; b < blocks.count; ++b) {
      const int64_t c = count[b * L + e];
      count[b * L + e] = total;
      total += c;
    }
  }
  a.expert_offset[L] = total;

  pool.parallel_for(blocks.count, [&](int64_t b, int) {
    int64_t* next = count + b * L;
    const int64_t i1 = std::min(N, (b + 1) * blocks.size);
    for (int64_t i = b * blocks.size; i < i1; ++i) {
      const int64_t n = row_at(a, N, i);
      for (int k = 0; k < K; ++k) {
        const int32_t e = a.row_expert[n * K + k];
        if (e < 0) {
          a.pair_pos[n * K + k] = -1;
          continue;
        }
        const int64_t m = next[e]++;
        a.pair_pos[n * K + k] = static_cast<int32_t>(m);
        a.perm_src_row[m] = static_cast<int32_t>(n);
        if (a.row_weight && a.perm_weight) a.perm_weight[m] = a.row_weight[n * K + k];
      }
    }
  });
}

}  // namespace moe::kernels::cpu
