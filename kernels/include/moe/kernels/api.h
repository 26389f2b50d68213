// The kernel API: one config struct per op, plain pointers, and the Backend
// operation table that the CPU and CUDA backends implement.
//
// Conventions
// - Row-major everywhere. T tokens, H hidden, I ffn_hidden, E logical experts,
//   K top-k, L local experts (groups) of one rank, N rows a rank holds after
//   dispatch, M = (row, local expert) pairs after permute.
// - Expert weights use the Hugging Face shapes, fused per expert:
//     w13 [L, 2I, H]: rows [0, I) are gate_proj, rows [I, 2I) are up_proj
//     w2  [L, H, I] : down_proj
//   so h = silu(x gate^T) * (x up^T) and y = h down^T.
// - Weights are fp32 arrays; with bf16 storage (x_dtype bf16) every op computes
//   with bf16 values. The router's gate and a forward config's expert weights
//   must hold bf16 values (the layer keeps them rounded). A train config's expert
//   weights are the fp32 masters: pack_expert_weights rounds them into the copies
//   each engine computes with, and no op reads the masters as weights.
// - "dtype" pointers (void*) hold fp32 or bf16 as the config says; float* are
//   always fp32 (accumulators, scores, workspaces, weights' working copies).
// - Index arrays are int32; -1 marks "no expert" (dropped pair or unused slot).
// - Every config has validate(), which throws moe::Error naming the bad field.
//   Ops never allocate: workspaces are sized by the backend's *_workspace_bytes
//   and passed in.
// - Pointers are in the backend's memory (host for CPU, device for CUDA) except
//   where a field says "host".
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "moe/kernels/types.h"
#include "moe/kernels/wire_format.h"

namespace moe::kernels {

// ---------------------------------------------------------------------------
// Packed weights: a backend's own copy of a layer's weights in the dtype and
// layout its GEMM engine reads (e.g. bf16 in the layout oneDNN prefers, one copy
// per GEMM that reads them), with what it needs to run those GEMMs (primitives).
// make_* builds one per config outside any step (no values yet); pack_* fills it
// from the fp32 weights, at set_weights and again after every optimizer step that
// changes them. Ops read the values from it, never from a stale copy: pack after
// every change. An engine that reads the fp32 weights directly keeps nothing in it.
class PackedWeights {
 public:
  virtual ~PackedWeights() = default;
};

// ---------------------------------------------------------------------------
// Router (docs/layer.md#router)
//
// logits = x W^T (+ logit_bias) in fp32; s = softmax(logits) or sigmoid(logits).
// Selection uses s + selection_bias. Group-limited routing (num_groups > 1): a
// group's score is the sum of its two highest biased scores; the best
// group_top_k groups are kept and top-k is taken inside them. Ties go to the
// lower expert (and group) index. topk_idx is ordered by biased score, best
// first. Weights are the unbiased s of the selected experts, divided by their sum
// when norm_topk_prob, times routed_scaling_factor.
struct RouterConfig : RoutingParams {
  int64_t num_tokens = 0;  // T; may be 0
  int hidden = 0;
  DType x_dtype = DType::kF32;

  void validate() const;
};

struct RouterForwardArgs {
  const void* x = nullptr;                // [T, H] x_dtype
  const float* weight = nullptr;          // [E, H]; bf16 values when x_dtype is bf16
  const PackedWeights* packed_weight = nullptr;  // weight, by make/pack_router_weights (required)
  const float* selection_bias = nullptr;  // [E] or null (e_score_correction_bias)
  const float* logit_bias = nullptr;      // [E] or null (added to the logits; skew)
  float* logits = nullptr;                // [T, E] out
  float* scores = nullptr;                // [T, E] out
  int32_t* topk_idx = nullptr;            // [T, K] out
  float* topk_weight = nullptr;           // [T, K] out
  void* workspace = nullptr;              // router_workspace_bytes
};

// Gradient of the routing weights back to the logits, then to x and W.
// grad_topk_weight[t,k] = <grad_out[t], y_k(t)> (0 for a dropped pair); topk_idx
// and topk_weight are the selection before capacity dropping. The four cases of
// docs/layer.md#router-gradient (softmax/sigmoid x norm/no norm) are implemented exactly.
struct RouterBackwardArgs {
  const float* scores = nullptr;            // [T, E] from forward
  const int32_t* topk_idx = nullptr;        // [T, K]
  const float* topk_weight = nullptr;       // [T, K]
  const float* grad_topk_weight = nullptr;  // [T, K]
  const void* x = nullptr;                  // [T, H] x_dtype
  const float* weight = nullptr;            // [E, H]
  float* grad_logits = nullptr;             // [T, E] out
  float* grad_weight = nullptr;             // [E, H] out (overwritten)
  float* grad_x = nullptr;                  // [T, H] fp32, ACCUMULATED (+=)
  void* workspace = nullptr;                // router_workspace_bytes
  // Balancing losses (docs/layer.md#balancing), their gradients added to grad_logits; off at 0.
  //   aux: L = aux_scale x sum_e c_e sum_t P_te with aux_scale = coeff x E / (K T_g^2),
  //        P = softmax scores, or sigmoid scores normalised per token;
  //   z:   L = z_scale x sum_t logsumexp(logits_t)^2 with z_scale = coeff / T_g.
  float aux_scale = 0.0f;
  const float* balance_counts = nullptr;    // [E] c_e over the global batch (aux)
  float z_scale = 0.0f;
  const float* logits = nullptr;            // [T, E] from forward (z)
};

// ---------------------------------------------------------------------------
// Capacity dropping (docs/layer.md#capacity), per source rank and logical expert.
struct CapacityConfig {
  int64_t num_tokens = 0;
  int num_experts = 0;
  int top_k = 0;
  double capacity_factor = 0.0;  // 0 = dropless
  DropPolicy policy = DropPolicy::kProbs;

  void validate() const;
  // ceil(cf * T * K / E) tokens per expert; a value within 1e-9 above an integer
  // counts as that integer (so cf = 1.1 does not round 11.000000000000002 up).
  int64_t capacity() const;
};

struct CapacityArgs {
  const int32_t* topk_idx = nullptr;     // [T, K]
  const float* topk_weight = nullptr;    // [T, K]
  int32_t* kept_idx = nullptr;           // [T, K] out: topk_idx, or -1 where dropped
  void* workspace = nullptr;             // capacity_workspace_bytes
};

// ---------------------------------------------------------------------------
// Replica choice (docs/layer.md#replica-choice): the (token, logical expert) pair goes to replica
// replica_index(global token, expert, count) of the expert. The hash spreads pairs
// evenly over replicas, and depends on neither the asking rank nor the placement's
// other experts.
MOE_HOST_DEVICE inline uint32_t replica_index(int64_t global_token, int32_t expert, int32_t count) {
  uint64_t z = static_cast<uint64_t>(global_token) * 0x9e3779b97f4a7c15ull ^
               (static_cast<uint64_t>(static_cast<uint32_t>(expert)) << 32 | 0x5bd1e995u);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<uint32_t>(z % static_cast<uint64_t>(count));
}

struct ReplicaArgs {
  const int32_t* topk_idx = nullptr;  // [T, K] logical expert or -1 (dropped)
  int64_t token_begin = 0;            // global index of token 0
  const int32_t* log2phy = nullptr;   // [E, max_replicas] physical slots, -1 padded
  const int32_t* logcnt = nullptr;    // [E] replica counts (>= 1)
  int max_replicas = 0;
  int32_t* topk_slot = nullptr;       // [T, K] out: physical slot or -1
};

// ---------------------------------------------------------------------------
// Dispatch layout (DeepEP get_dispatch_layout): which ranks need which token.
// A physical slot is rank * slots_per_rank + local slot. A token goes to a rank
// once however many of its pairs live there. The send buffer is rank-major: rank
// r's rows start at rank_offset[r], in increasing token order. token_send_row is
// the (t, r) -> send-row map, so packing the send buffer is a permute with
// pair_pos = token_send_row (top_k = R), and the combine is the matching unpermute.
struct DispatchLayoutConfig {
  int64_t num_tokens = 0;
  int top_k = 0;
  int num_ranks = 0;
  int slots_per_rank = 0;

  void validate() const;
};

struct DispatchLayoutArgs {
  const int32_t* topk_slot = nullptr;      // [T, K] physical slot or -1
  const float* topk_weight = nullptr;      // [T, K]; needed for send_weight
  int32_t* num_tokens_per_rank = nullptr;  // [R] out
  int32_t* num_tokens_per_slot = nullptr;  // [R * S] out: pairs per physical slot
  int64_t* rank_offset = nullptr;          // [R + 1] out, HOST memory: exclusive prefix sums
  uint8_t* is_token_in_rank = nullptr;     // [T, R] out
  int32_t* token_send_row = nullptr;       // [T, R] out: send row of (t, r), or -1
  // Optional outputs of rank_offset[R] <= T * min(R, K) send rows (null: skipped):
  int32_t* send_src_token = nullptr;       // [rows] token of each send row
  int32_t* send_slot = nullptr;            // [rows, K] local slot on the row's rank of pair k, or -1
  float* send_weight = nullptr;            // [rows, K] weight of pair k where send_slot >= 0, else 0
  void* workspace = nullptr;               // dispatch_layout_workspace_bytes
};

// ---------------------------------------------------------------------------
// Permute layout: rows with up to K local expert slots each -> expert-major
// order (counting sort, stable in row order), and the inverse map.
struct PermuteLayoutConfig {
  int64_t num_rows = 0;  // N
  int top_k = 0;         // slots per row
  int num_experts = 0;   // L local experts

  void validate() const;
};

struct PermuteLayoutArgs {
  const int32_t* row_expert = nullptr;  // [N, K] local expert or -1
  const float* row_weight = nullptr;    // [N, K] or null
  int64_t* expert_offset = nullptr;     // [L + 1] out, HOST memory
  int32_t* perm_src_row = nullptr;      // [N * K] out: source row of permuted row m
  float* perm_weight = nullptr;         // [N * K] out, written when row_weight is given
  int32_t* pair_pos = nullptr;          // [N, K] out: permuted row of pair (n, k), or -1
  void* workspace = nullptr;            // permute_layout_workspace_bytes
  // [N] or null: a permutation of the rows. Set, an expert's pairs are ordered by
  // their row's position in row_order instead of by row (a chunked layer's order
  // that does not depend on the chunking, docs/layer.md#overlap).
  const int32_t* row_order = nullptr;
};

// Permute: out[m] = rows[src_row[m]], converting dtype. Both maps come from
// permute_layout; a backend may gather by src_row or scatter by pair_pos (the CPU
// backend scatters: every source row is read once, however many experts need it).
struct PermuteConfig {
  int64_t num_rows = 0;      // N source rows
  int top_k = 0;             // slots per source row in pair_pos
  int64_t num_out_rows = 0;  // M
  int hidden = 0;
  DType in_dtype = DType::kF32;
  DType out_dtype = DType::kF32;

  void validate() const;
};

struct PermuteArgs {
  const void* rows = nullptr;         // [N, H]
  const int32_t* src_row = nullptr;   // [M]
  const int32_t* pair_pos = nullptr;  // [N, K]: the inverse of src_row
  void* out = nullptr;                // [M, H]
};

// Unpermute, the local combine: out[n] = sum_k w[n,k] * perm[pair_pos[n,k]],
// summed in k order in fp32; a row with no pair gets zeros. w null means 1. With
// pair_pos [T, K] the positions of each pair's returned row it is the EP combine
// (a token's K results summed in k order); top_k = 1 gathers rows.
struct UnpermuteConfig {
  int64_t num_rows = 0;  // N
  int top_k = 0;
  int hidden = 0;
  DType out_dtype = DType::kF32;
  bool accumulate = false;  // out += (fp32 out only)
  DType in_dtype = DType::kF32;  // of perm
  // Rows of perm, which pair_pos indexes; -1: num_rows * top_k. A part of a layout
  // (rows [first, first + n) of a chunked layer) reads the whole layout's perm.
  int64_t num_perm_rows = -1;

  void validate() const;
};

struct UnpermuteArgs {
  const void* perm = nullptr;          // [M, H] in_dtype
  const int32_t* pair_pos = nullptr;   // [N, K]
  const float* pair_weight = nullptr;  // [N, K] or null
  void* out = nullptr;                 // [N, H] out_dtype
};

// ---------------------------------------------------------------------------
// SwiGLU on rows of gu = [g | u] ([M, 2I]): h[r] = scale[r] * silu(g) * u.
struct SwigluConfig {
  int64_t num_rows = 0;
  int ffn_hidden = 0;  // I

  void validate() const;
};

struct SwigluForwardArgs {
  const float* gu = nullptr;         // [M, 2I]
  const float* row_scale = nullptr;  // [M] or null (1)
  float* h = nullptr;                // [M, I] out
};

struct SwigluBackwardArgs {
  const float* gu = nullptr;          // [M, 2I]
  const float* grad_h = nullptr;      // [M, I]
  const float* row_scale = nullptr;   // [M] or null (1)
  float* grad_gu = nullptr;           // [M, 2I] out
  float* grad_row_scale = nullptr;    // [M] out or null: <grad_h[r], silu(g) * u>
  float* h = nullptr;                 // [M, I] out or null: the forward h, recomputed
};

// ---------------------------------------------------------------------------
// Grouped GEMM over variable groups (zero-size groups allowed). Group g owns rows
// [offset[g], offset[g+1]) of the row-indexed operands; W is [G, n, k].
//   kForward: C[M, n] = A[M, k] W_g^T     (A rows of group g times W_g transposed)
//   kDgrad:   C[M, k] = A[M, n] W_g
//   kWgrad:   W_g[n, k] (C) = A_g^T D_g with A [M, n], D [M, k]
enum class GemmKind : uint8_t { kForward, kDgrad, kWgrad };

struct GroupedGemmConfig {
  GemmKind kind = GemmKind::kForward;
  int num_groups = 0;
  int64_t n = 0;
  int64_t k = 0;
  bool accumulate = false;  // C += instead of C =

  void validate() const;
};

struct GroupedGemmArgs {
  const int64_t* group_offset = nullptr;  // [G + 1], HOST memory
  const float* a = nullptr;
  const float* b = nullptr;  // W for kForward/kDgrad, D for kWgrad
  float* c = nullptr;
};

// ---------------------------------------------------------------------------
// Expert MLP, fused: for every permuted row m (expert e, source row src_row[m])
//   gu[m] = rows[src] w13_e^T;  h[m] = perm_weight[m] * silu(g) * u;  y[m] = h[m] w2_e^T
// y is thus already weighted; the local combine is a plain sum. The routing weight
// is applied once, before that reduction (docs/layer.md#experts).
struct ExpertMlpConfig {
  int num_experts = 0;  // L local experts
  int hidden = 0;
  int ffn_hidden = 0;
  int64_t max_rows = 0;  // most permuted rows M a call may pass (sizes workspaces)
  int64_t max_src_rows = 0;  // most source rows N
  DType x_dtype = DType::kF32;
  bool train = false;  // size the workspace for expert_mlp_backward too

  void validate() const;
  // Throws unless expert_offset [L + 1] (HOST) starts at 0, never decreases and
  // stays within max_rows.
  void check_offsets(const int64_t* expert_offset) const;
  // Throws unless every part range [pair_begin[e], pair_end[e]) lies in expert e's
  // range of expert_offset.
  void check_part(const int64_t* expert_offset, const int64_t* pair_begin, const int64_t* pair_end) const;
};

// A part of a layout (docs/layer.md#overlap): pairs [pair_begin[e], pair_end[e])
// of each expert e, HOST memory [L] each. A call given a part computes those pairs
// only and leaves every other pair's outputs as they are.
struct ExpertMlpPart {
  const int64_t* pair_begin = nullptr;  // null: every pair of expert_offset
  const int64_t* pair_end = nullptr;
  bool whole() const { return pair_begin == nullptr; }
};

// What an expert_mlp_backward call computes: everything, or, to overlap the
// backward's transfers, the dgrad chain of a part (per pair: grad_perm_x,
// grad_perm_weight) and, after dgrad calls that covered every pair with the same
// layout and workspace, the weight gradients alone (given the same rows and
// grad_rows: the CPU backend gathers them again rather than keep [M, H] copies).
enum class MlpBackwardPhase : uint8_t { kAll, kDgrad, kWgrad };

// Where a fused call spent its time, in thread-seconds summed over the pool's
// threads (divide by the thread count for a wall-clock share).
struct ExpertMlpStats {
  double gather_seconds = 0;
  double gemm_seconds = 0;
  double swiglu_seconds = 0;
};

struct ExpertMlpForwardArgs {
  const void* rows = nullptr;            // [N, H] x_dtype
  const int64_t* expert_offset = nullptr;  // [L + 1], HOST memory; M = expert_offset[L]
  const int32_t* perm_src_row = nullptr;  // [M]
  const float* perm_weight = nullptr;     // [M] or null (1)
  const float* w13 = nullptr;             // [L, 2I, H]
  const float* w2 = nullptr;              // [L, H, I]
  const PackedWeights* packed = nullptr;  // w13 and w2, by make/pack_expert_weights (required)
  float* y = nullptr;                     // [M, H] out, weighted
  float* saved_gu = nullptr;              // [M, 2I] out for backward, or null
  void* workspace = nullptr;              // expert_mlp_workspace_bytes
  ExpertMlpStats* stats = nullptr;        // HOST, accumulated into when not null
  ExpertMlpPart part;                     // the pairs to compute (default: all)
};

// Backward of the above given grad_rows (the gradient reaching each source row's
// combined output). Produces per-pair input gradients (to be summed per row with
// unpermute), the routing-weight gradient per pair, and the weight gradients.
struct ExpertMlpBackwardArgs {
  const void* grad_rows = nullptr;        // [N, H] x_dtype
  const void* rows = nullptr;             // [N, H] x_dtype (forward input)
  const int64_t* expert_offset = nullptr;  // [L + 1], HOST memory
  const int32_t* perm_src_row = nullptr;
  const float* perm_weight = nullptr;     // [M] or null
  const float* w13 = nullptr;
  const float* w2 = nullptr;
  const PackedWeights* packed = nullptr;  // as in forward; made with train = true
  // [M, 2I] from forward, consumed: a backend may overwrite a pair's row once its
  // dgrad ran (the CPU backend keeps an fp32 layer's dgu there), so a second
  // backward needs a new forward.
  float* saved_gu = nullptr;
  float* grad_perm_x = nullptr;           // [M, H] out
  float* grad_perm_weight = nullptr;      // [M] out: <grad_rows[src], y_unweighted[m]>
  float* grad_w13 = nullptr;              // [L, 2I, H] out (overwritten)
  float* grad_w2 = nullptr;               // [L, H, I] out (overwritten)
  void* workspace = nullptr;              // expert_mlp_workspace_bytes
  ExpertMlpStats* stats = nullptr;        // HOST, accumulated into when not null
  MlpBackwardPhase phase = MlpBackwardPhase::kAll;
  ExpertMlpPart part;                     // kDgrad only: the pairs to compute
  // [M] or null (the layout's order): the order in which the weight gradients sum
  // each expert's pairs, a permutation of each [expert_offset[e], expert_offset[e+1]).
  // So an expert's gradient can keep its bits when a layout orders its pairs
  // otherwise (docs/layer.md#determinism). The CUDA backend ignores it: cuBLAS
  // picks its own summation order by shape.
  const int32_t* wgrad_order = nullptr;
};

// ---------------------------------------------------------------------------
// Optimizer step on one parameter tensor, fp32 master values (docs/jobs.md#spec: adam or
// sgd, learning rate lr). Adam (bias-corrected, step >= 1):
//   m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;
//   w -= lr * (m / (1-b1^step)) / (sqrt(v / (1-b2^step)) + eps)
// SGD: w -= lr g. Element-wise and deterministic, so replicas fed identical
// gradients and states stay bitwise identical. If rounded is not null it receives
// w rounded to bf16 (the copy a bf16 layer computes with).
enum class OptimizerKind : uint8_t { kAdam, kSgd };

struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::kAdam;
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  // Adam's m and v as stored: fp32, or bf16 (Megatron's precision-aware optimizer;
  // half the moments' bytes): each step widens them, computes in fp32, moves the
  // weight by the unrounded values and stores them rounded to nearest even.
  DType moments = DType::kF32;

  void validate() const;
};

// Adam's constants of one step, every backend's: the bias corrections folded in
// once (as PyTorch's Adam does), step_size = lr / (1 - b1^t) and inv_sqrt_c2 =
// 1 / sqrt(1 - b2^t), each computed in double and rounded once. A backend steps
// an element with these operations, each rounded once, so all give the same bits:
//   m = fma(b1, m, one_b1 g);  v = fma(b2, v, (one_b2 g) g)
//   w -= (step_size m) / fma(sqrt(v), inv_sqrt_c2, eps)
// (SGD: w = fma(-lr, g, w).) One square root and one division an element.
struct AdamConstants {
  float b1, one_b1, b2, one_b2, step_size, inv_sqrt_c2, eps;
};
AdamConstants adam_constants(const OptimizerConfig& cfg, int64_t step);

struct OptimizerArgs {
  int64_t count = 0;
  int64_t step = 1;            // 1-based (Adam's bias correction)
  float* weight = nullptr;     // [count] master, updated in place
  const float* grad = nullptr;  // [count]
  void* m = nullptr;           // [count] Adam first moment in cfg.moments (unused by SGD)
  void* v = nullptr;           // [count] Adam second moment in cfg.moments
  float* rounded = nullptr;    // [count] or null: weight rounded to bf16 values
};

// ---------------------------------------------------------------------------
// The operation table. One instance per rank; not thread-safe (a rank issues its
// ops in order, like a CUDA stream).
class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;  // "cpu", "cuda"
  // The GEMM engine per storage dtype, e.g. "fp32=onednn bf16=onednn" (moed's
  // moe_build_info label and registration).
  virtual std::string gemm_engine() const = 0;
  // The GEMM engine this backend runs for one storage dtype (CPU: "openblas" or
  // "onednn", chosen at construction; see cpu_backend.h).
  virtual std::string gemm_engine(DType dtype) const = 0;

  // Memory in the backend's address space.
  virtual void* alloc(size_t bytes) = 0;  // 64-byte aligned; throws on failure
  virtual void free(void* p) = 0;
  virtual void copy_to_device(void* dst, const void* host_src, size_t bytes) = 0;
  virtual void copy_to_host(void* host_dst, const void* src, size_t bytes) = 0;
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  virtual void fill_zero(void* p, size_t bytes) = 0;
  virtual void synchronize() = 0;

  // dst[i] = src[i] converted between dtypes (count elements).
  virtual void convert(const void* src, DType src_dtype, void* dst, DType dst_dtype,
                       int64_t count) = 0;
  // dst[i] += src[i], summed in fp32 and stored in dtype (count elements).
  virtual void add(void* dst, const void* src, DType dtype, int64_t count) = 0;
  // Wire rows (wire_format.h; wire_info(format).row_bytes(hidden) each): rows
  // [num_rows, hidden] in dtype -> the format's wire rows, and back.
  virtual void pack_rows(WireFormat format, const void* rows, DType dtype, int64_t num_rows, int hidden,
                         void* wire) = 0;
  virtual void unpack_rows(WireFormat format, const void* wire, int64_t num_rows, int hidden, void* rows,
                           DType dtype) = 0;

  // Packed weights (see PackedWeights). The router's: gate [E, H] for configs of
  // this hidden, num_experts and x_dtype (num_tokens does not matter). The
  // experts': w13 [L, 2I, H] and w2 [L, H, I] for configs of this num_experts,
  // hidden, ffn_hidden, x_dtype and train (row counts do not matter).
  virtual std::unique_ptr<PackedWeights> make_router_weights(const RouterConfig& cfg) = 0;
  virtual void pack_router_weights(PackedWeights& packed, const float* weight) = 0;
  virtual std::unique_ptr<PackedWeights> make_expert_weights(const ExpertMlpConfig& cfg) = 0;
  // Packs experts [first, first + count) from the full arrays w13 and w2; the
  // others keep what they hold (set_weights packs all, a moved slot only itself).
  virtual void pack_expert_weights(PackedWeights& packed, const float* w13, const float* w2, int first,
                                   int count) = 0;
  // A train layer's optimizer step on its expert masters (w13 and w2, each as
  // optimizer_step takes it, over all num_experts experts of `packed`) and their
  // repack: the bits of optimizer_step on each then pack_expert_weights of all.
  // A backend may fuse the two (the CPU backend packs a block of rows while the
  // update has left it in cache).
  virtual void update_expert_weights(const OptimizerConfig& cfg, const OptimizerArgs& w13, const OptimizerArgs& w2,
                                     PackedWeights& packed, int num_experts) {
    optimizer_step(cfg, w13);
    optimizer_step(cfg, w2);
    pack_expert_weights(packed, w13.weight, w2.weight, 0, num_experts);
  }

  virtual size_t router_workspace_bytes(const RouterConfig& cfg) const = 0;
  virtual void router_forward(const RouterConfig& cfg, const RouterForwardArgs& args) = 0;
  virtual void router_backward(const RouterConfig& cfg, const RouterBackwardArgs& args) = 0;

  virtual size_t capacity_workspace_bytes(const CapacityConfig& cfg) const = 0;
  virtual void capacity_drop(const CapacityConfig& cfg, const CapacityArgs& args) = 0;

  // topk_slot from topk_idx by replica_index(); num_tokens x top_k pairs.
  virtual void select_replicas(int64_t num_tokens, int top_k, int num_experts, const ReplicaArgs& args) = 0;

  virtual size_t dispatch_layout_workspace_bytes(const DispatchLayoutConfig& cfg) const = 0;
  virtual void dispatch_layout(const DispatchLayoutConfig& cfg,
                               const DispatchLayoutArgs& args) = 0;

  virtual size_t permute_layout_workspace_bytes(const PermuteLayoutConfig& cfg) const = 0;
  virtual void permute_layout(const PermuteLayoutConfig& cfg, const PermuteLayoutArgs& args) = 0;
  virtual void permute(const PermuteConfig& cfg, const PermuteArgs& args) = 0;
  virtual void unpermute(const UnpermuteConfig& cfg, const UnpermuteArgs& args) = 0;
  // pair_values[n, k] = pair_pos[n, k] >= 0 ? perm_values[pair_pos[n, k]] : 0, for
  // n < num_rows: a per-pair scalar (e.g. the routing-weight gradient) back in row order.
  virtual void unpermute_scalars(const int32_t* pair_pos, int64_t num_rows, int top_k,
                                 const float* perm_values, float* pair_values) = 0;
  // The per-pair scalars of a combine: pair_values[t, k] = rows[token_send_row[t, r],
  // k] for r = topk_slot[t, k] / slots_per_rank (0 where topk_slot < 0); rows is
  // [send rows, K]. Brings a receiver's per-(row, k) values back to the source pairs.
  virtual void combine_pair_scalars(const int32_t* topk_slot, const int32_t* token_send_row,
                                    int64_t num_tokens, int top_k, int num_ranks,
                                    int slots_per_rank, const float* rows,
                                    float* pair_values) = 0;

  virtual void swiglu_forward(const SwigluConfig& cfg, const SwigluForwardArgs& args) = 0;
  virtual void swiglu_backward(const SwigluConfig& cfg, const SwigluBackwardArgs& args) = 0;

  virtual void grouped_gemm(const GroupedGemmConfig& cfg, const GroupedGemmArgs& args) = 0;

  virtual void optimizer_step(const OptimizerConfig& cfg, const OptimizerArgs& args) = 0;

  virtual size_t expert_mlp_workspace_bytes(const ExpertMlpConfig& cfg) const = 0;
  virtual void expert_mlp_forward(const ExpertMlpConfig& cfg,
                                  const ExpertMlpForwardArgs& args) = 0;
  virtual void expert_mlp_backward(const ExpertMlpConfig& cfg,
                                   const ExpertMlpBackwardArgs& args) = 0;
};

}  // namespace moe::kernels
