// Load balancing of one MoE layer (docs/layer.md#balancing), over the GLOBAL batch of a step:
// c_e = (token, e) pairs top-k selected before capacity on every rank, T_g = the
// step's tokens on every rank (sum_e c_e / K).
//   aux loss (Switch/Megatron): L_aux = coeff x E / (K T_g^2) x sum_e c_e sum_t P_te,
//     P = softmax scores, or sigmoid scores normalised per token;
//   z-loss: L_z = coeff / T_g x sum_t logsumexp(logits_t)^2;
//   aux-loss-free (DeepSeek-V3): b_e += rate x sign(mean c - c_e) after each step.
#pragma once

#include <cstdint>
#include <vector>

#include "moe/kernels/types.h"

namespace moe::ep {

struct BalanceLosses {
  double aux = 0.0, z = 0.0;
};

// Scales of the two losses as the router's backward takes them (0 when off or T_g = 0).
double aux_loss_scale(double coeff, int num_experts, int top_k, double global_tokens);
double z_loss_scale(double coeff, double global_tokens);

// This rank's shares of both losses: its T tokens' logits and scores [T, E]
// (host), the global counts [E] and T_g. Summed in token order, in fp64.
BalanceLosses balance_losses(const kernels::RoutingParams& routing, double aux_coeff, double z_coeff,
                             const std::vector<float>& logits, const std::vector<float>& scores, int64_t T,
                             const std::vector<float>& counts, double global_tokens);

// The aux-loss-free update of the selection bias from the step's global counts.
void update_selection_bias(std::vector<float>& bias, const std::vector<float>& counts, double rate);

}  // namespace moe::ep
