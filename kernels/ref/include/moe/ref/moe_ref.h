// The fp64 reference of one MoE layer, forward and backward (docs/layer.md), written
// for reading, not speed: plain loops, no threads, no fusion. Every backend and
// transport is checked against it. The router gradient is derived here by the
// chain rule through the full Jacobian (not the closed forms the backends use),
// so the two are independent.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "moe/kernels/types.h"
#include "moe/kernels/wire_format.h"

namespace moe::ref {

using kernels::DropPolicy;
using kernels::ScoreFunc;

// Routing as the backends see it (kernels::RoutingParams), plus the layer's sizes.
struct Config : kernels::RoutingParams {
  int hidden = 0;
  int ffn_hidden = 0;
  double capacity_factor = 0.0;
  // Load balancing (docs/layer.md#balancing): L_aux = aux x E / (K T_g^2) x sum_e c_e sum_t P_te
  // and L_z = z x mean_t logsumexp(logits_t)^2, over the global batch.
  double aux_loss_coeff = 0.0;
  double z_loss_coeff = 0.0;
  // Shared experts: one SwiGLU of width shared_ffn_hidden (0: none) on every
  // token, gated by sigmoid(x . w_g) with shared_gate.
  int shared_ffn_hidden = 0;
  bool shared_gate = false;
  DropPolicy drop_policy = DropPolicy::kProbs;
};

struct Weights {
  std::vector<double> gate;            // [E, H]
  std::vector<double> selection_bias;  // [E] or empty
  std::vector<double> logit_bias;      // [E] or empty
  std::vector<double> w13;             // [E, 2I, H]: gate_proj rows, then up_proj rows
  std::vector<double> w2;              // [E, H, I]
  std::vector<double> shared_w13;      // [2Is, H]
  std::vector<double> shared_w2;       // [H, Is]
  std::vector<double> shared_gate;     // [H] or empty
};

struct ForwardOptions {
  // Use this selection [T, K] instead of computing one (tests use it to step
  // around near-ties that fp32 and fp64 may break differently).
  const int32_t* forced_topk_idx = nullptr;
  // Token counts of the source ranks, in order; capacity applies within each.
  // Empty: one source of all T tokens.
  std::vector<int64_t> capacity_segments;
  // The global batch this one is part of, for the balancing losses: c_e, the
  // pairs top-k selected per expert over all ranks before capacity (empty: this
  // batch's own), and T_g, its tokens (0: T).
  std::vector<double> global_counts;
  int64_t global_tokens = 0;
  // The rows the routed experts see, when a lossy wire carried them there
  // (docs/layer.md#wire-formats); null: x. The router and the shared experts see x;
  // the backward passes the experts' input gradient straight through to x.
  const std::vector<double>* expert_x = nullptr;
};

// Options with a forced selection (and the source ranks' token counts), or with
// the source ranks' token counts only.
inline ForwardOptions forced(const int32_t* topk_idx, std::vector<int64_t> segments = {}) {
  ForwardOptions o;
  o.forced_topk_idx = topk_idx;
  o.capacity_segments = std::move(segments);
  return o;
}
inline ForwardOptions segmented(std::vector<int64_t> segments) { return forced(nullptr, std::move(segments)); }

struct Forward {
  int64_t num_tokens = 0;
  std::vector<double> logits;       // [T, E] (logit_bias included)
  std::vector<double> scores;       // [T, E]
  std::vector<int32_t> topk_idx;    // [T, K] selection, best first
  std::vector<int32_t> kept_idx;    // [T, K] topk_idx or -1 where dropped by capacity
  std::vector<double> topk_weight;  // [T, K]
  std::vector<double> gu;           // [T, K, 2I] expert pre-activations (0 if dropped)
  std::vector<double> expert_out;   // [T, K, H] unweighted y_k(t) (0 if dropped)
  std::vector<double> out;          // [T, H], the shared path included
  std::vector<double> counts;       // [E] pairs top-k selected per expert, before capacity
  std::vector<double> balance_counts;  // [E] the c_e the losses use (global)
  int64_t balance_tokens = 0;          // T_g
  double aux_loss = 0.0, z_loss = 0.0;  // this batch's shares
  std::vector<double> shared_gu;    // [T, 2Is]
  std::vector<double> shared_out;   // [T, H] unweighted shared(x)
  std::vector<double> shared_scale; // [T]: sigmoid(x . w_g), or 1
  // Margin between the K-th and (K+1)-th biased score per token (inf if K = E);
  // tests treat a smaller margin than fp32 can resolve as a near-tie.
  std::vector<double> selection_margin;  // [T]
  std::vector<double> expert_x;          // [T, H] ForwardOptions::expert_x; empty: x
};

struct Grads {
  std::vector<double> grad_x;            // [T, H], router path included
  std::vector<double> grad_gate;         // [E, H]
  std::vector<double> grad_w13;          // [E, 2I, H]
  std::vector<double> grad_w2;           // [E, H, I]
  std::vector<double> grad_topk_weight;  // [T, K]: <grad_out[t], y_k(t)>, 0 if dropped
  std::vector<double> grad_logits;       // [T, E], balancing terms included
  std::vector<double> grad_gu;           // [T, K, 2I] gradient reaching gu (0 if dropped)
  std::vector<double> grad_shared_w13;   // [2Is, H]
  std::vector<double> grad_shared_w2;    // [H, Is]
  std::vector<double> grad_shared_gate;  // [H]
};

// x is [T, H].
Forward forward(const Config& cfg, const Weights& w, const std::vector<double>& x, int64_t T,
                const ForwardOptions& opts = {});

Grads backward(const Config& cfg, const Weights& w, const std::vector<double>& x,
               const Forward& fwd, const std::vector<double>& grad_out);

// The wire formats (docs/layer.md#wire-formats), plainly in fp64: OCP e4m3 rounding
// (to nearest even, saturating at 448), and the values rows [n, H] of fp32 take
// through the FP8 wire (a scale of amax / 448 per group of 128, all in fp32
// arithmetic) or the bf16 wire.
double round_e4m3(double v);
std::vector<double> through_fp8_wire(const std::vector<float>& rows, int64_t n, int H);
std::vector<double> through_bf16_wire(const std::vector<float>& rows);
// The values rows [n, H] of fp32 take through wire format f (one case per format).
std::vector<double> through_wire(kernels::WireFormat f, const std::vector<float>& rows, int64_t n, int H);
// What the routed experts compute with after the dispatch wire f: x (rows [n, H]
// of the layer dtype's values) through f, then stored in the layer dtype; empty
// when f is the layer's own format (x as it is).
std::vector<double> expert_rows_through(kernels::WireFormat f, kernels::DType layer, const std::vector<float>& x,
                                        int H);

// Capacity of one source of T tokens: ceil(cf * T * K / E), cf = 0 meaning none.
int64_t capacity(double capacity_factor, int64_t T, int top_k, int num_experts);

// Dispatch layout of DeepEP's get_dispatch_layout, plainly: rank-major send rows,
// token order inside a rank.
struct DispatchLayout {
  std::vector<int32_t> num_tokens_per_rank;  // [R]
  std::vector<int32_t> num_tokens_per_slot;  // [R * S]
  std::vector<uint8_t> is_token_in_rank;     // [T, R]
  std::vector<int32_t> token_send_row;       // [T, R]: send row, or -1
  std::vector<int32_t> send_src_token;       // [rows]
  std::vector<int32_t> send_slot;            // [rows, K]: local slot of pair k on the row's rank, or -1
  std::vector<float> send_weight;            // [rows, K]
};
DispatchLayout dispatch_layout(const std::vector<int32_t>& topk_slot, const std::vector<float>& topk_weight,
                               int64_t T, int K, int R, int S);

}  // namespace moe::ref
