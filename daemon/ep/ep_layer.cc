#include "moe/ep/ep_layer.h"

#include <algorithm>
#include <cstring>

#include "moe/base/check.h"

namespace moe::ep {

using kernels::Buffer;
using transport::AllToAllBuffer;
using transport::Segments;

namespace {

Segments scaled(const std::vector<int64_t>& rows, size_t bytes_per_row) {
  std::vector<size_t> b(rows.size());
  for (size_t r = 0; r < rows.size(); ++r) b[r] = static_cast<size_t>(rows[r]) * bytes_per_row;
  return Segments::packed(std::move(b));
}

}  // namespace

EpLayer::EpLayer(const MoeLayerConfig& cfg, const ExpertMap& map, transport::Communicator& comm,
                 kernels::Backend& be, const EpOptions& options)
    : cfg_(cfg),
      map_(map),
      comm_(comm),
      be_(be),
      opts_(options),
      router_(cfg, be),
      experts_(cfg, map.slots_per_rank, be),
      row_bytes_(kernels::dtype_size(cfg.dtype) * cfg.hidden) {
  MOE_CHECK(map.num_experts == cfg.num_experts, "ep layer: the map places ", map.num_experts,
            " experts, the layer has ", cfg.num_experts);
  MOE_CHECK(map.num_ranks == comm.size(), "ep layer: the map has ", map.num_ranks, " ranks, the communicator ",
            comm.size());
  const size_t T = cfg.max_tokens, K = cfg.top_k, R = map.num_ranks, S = map.slots_per_rank, H = cfg.hidden;
  const size_t max_send_rows = T * std::min(R, K);  // a token goes to at most min(R, K) ranks
  auto make = [&](size_t bytes) { return Buffer(be_, bytes); };
  log2phy_ = make(4 * map.log2phy.size());
  logcnt_ = make(4 * map.logcnt.size());
  be_.copy_to_device(log2phy_.get(), map.log2phy.data(), 4 * map.log2phy.size());
  be_.copy_to_device(logcnt_.get(), map.logcnt.data(), 4 * map.logcnt.size());
  topk_slot_ = make(4 * T * K);
  num_tokens_per_rank_ = make(4 * R);
  num_tokens_per_slot_ = make(4 * R * S);
  in_rank_ = make(T * R);
  token_send_row_ = make(4 * T * R);
  send_src_token_ = make(4 * max_send_rows);
  send_slot_ = make(4 * max_send_rows * K);
  send_weight_ = make(4 * max_send_rows * K);
  send_rows_ = make(max_send_rows * row_bytes_);
  back_rows_ = make(max_send_rows * row_bytes_);
  layout_ws_ = make(be_.dispatch_layout_workspace_bytes({cfg.max_tokens, cfg.top_k, map.num_ranks, map.slots_per_rank}));
  if (cfg.train) {
    back_gw_ = make(4 * max_send_rows * K);
    grad_topk_weight_ = make(4 * T * K);
    grad_x32_ = make(4 * T * H);
  }
  rank_offset_.assign(R + 1, 0);
  send_counts_.assign(R, 0);
  recv_counts_.assign(R, 0);
  reserve_rows(T);  // a first guess; grows when a step receives more
}

void EpLayer::reserve_rows(int64_t n) {
  if (n <= recv_capacity_) return;
  recv_capacity_ = n;
  const size_t N = n, K = cfg_.top_k;
  recv_rows_ = Buffer(be_, N * row_bytes_);
  recv_slot_ = Buffer(be_, 4 * N * K);
  recv_weight_ = Buffer(be_, 4 * N * K);
  combined_ = Buffer(be_, N * row_bytes_);
  if (cfg_.train) {
    grad_recv_rows_ = Buffer(be_, N * row_bytes_);
    grad_pair_weight_ = Buffer(be_, 4 * N * K);
  }
  experts_.reserve(n);
}

void EpLayer::set_weights(const model::LayerWeights& w) {
  check_expert_weights(cfg_, w);
  const size_t H = cfg_.hidden, I = cfg_.ffn_hidden, S = map_.slots_per_rank;
  // The router and this rank's slots only (empty slots stay zero), rounded once.
  model::LayerWeights local;
  local.gate = w.gate;
  local.selection_bias = w.selection_bias;
  local.logit_bias = w.logit_bias;
  local.w13.assign(S * 2 * I * H, 0.0f);
  local.w2.assign(S * H * I, 0.0f);
  for (size_t s = 0; s < S; ++s) {
    const int32_t e = map_.expert_at(comm_.rank(), static_cast<int>(s));
    if (e < 0) continue;
    std::copy_n(w.w13.begin() + e * 2 * I * H, 2 * I * H, local.w13.begin() + s * 2 * I * H);
    std::copy_n(w.w2.begin() + e * H * I, H * I, local.w2.begin() + s * H * I);
  }
  local = weights_as_used(std::move(local), cfg_.dtype);
  router_.set_weights(local);
  experts_.set_weights(local.w13.data(), local.w2.data());
}

void EpLayer::forward(const void* x, int64_t T, int64_t token_begin, void* out) {
  const int K = cfg_.top_k, H = cfg_.hidden, R = map_.num_ranks, S = map_.slots_per_rank, me = comm_.rank();
  x_ = x;
  has_forward_ = true;
  stats_ = {};

  double t0 = now_seconds();
  router_.forward(x, T);
  be_.synchronize();
  double t1 = now_seconds();
  stats_.router = t1 - t0;

  // Replica choice, layout, and the send buffer (a permute of x by token_send_row).
  kernels::ReplicaArgs ra{router_.kept_idx(), token_begin, log2phy_.as<int32_t>(), logcnt_.as<int32_t>(),
                          map_.max_replicas, topk_slot_.as<int32_t>()};
  be_.select_replicas(T, K, cfg_.num_experts, ra);
  kernels::DispatchLayoutArgs dl;
  dl.topk_slot = topk_slot_.as<int32_t>();
  dl.topk_weight = router_.topk_weight();
  dl.num_tokens_per_rank = num_tokens_per_rank_.as<int32_t>();
  dl.num_tokens_per_slot = num_tokens_per_slot_.as<int32_t>();
  dl.rank_offset = rank_offset_.data();
  dl.is_token_in_rank = in_rank_.as<uint8_t>();
  dl.token_send_row = token_send_row_.as<int32_t>();
  dl.send_src_token = send_src_token_.as<int32_t>();
  dl.send_slot = send_slot_.as<int32_t>();
  dl.send_weight = send_weight_.as<float>();
  dl.workspace = layout_ws_.get();
  be_.dispatch_layout({T, K, R, S}, dl);
  const int64_t send_total = rank_offset_[R];
  be_.permute({T, R, send_total, H, cfg_.dtype, cfg_.dtype},
              {x, send_src_token_.as<int32_t>(), token_send_row_.as<int32_t>(), send_rows_.get()});

  // Counts, then rows + metadata in one all-to-all round.
  for (int r = 0; r < R; ++r) send_counts_[r] = rank_offset_[r + 1] - rank_offset_[r];
  comm_.exchange_counts(send_counts_.data(), recv_counts_.data(), deadline());
  int64_t N = 0;
  for (int r = 0; r < R; ++r) N += recv_counts_[r];
  reserve_rows(N);
  send_rows_segs_ = scaled(send_counts_, row_bytes_);
  recv_rows_segs_ = scaled(recv_counts_, row_bytes_);
  send_meta_segs_ = scaled(send_counts_, 4 * static_cast<size_t>(K));
  recv_meta_segs_ = scaled(recv_counts_, 4 * static_cast<size_t>(K));
  be_.synchronize();
  if (opts_.isolate_transport_timing) comm_.barrier(deadline());
  t0 = now_seconds();
  comm_.all_to_all_v({AllToAllBuffer{send_rows_.get(), &send_rows_segs_, recv_rows_.get(), &recv_rows_segs_},
                      AllToAllBuffer{send_slot_.get(), &send_meta_segs_, recv_slot_.get(), &recv_meta_segs_},
                      AllToAllBuffer{send_weight_.get(), &send_meta_segs_, recv_weight_.get(), &recv_meta_segs_}},
                     deadline());
  stats_.dispatch_transport = now_seconds() - t0;
  t0 = now_seconds();
  stats_.dispatch = t0 - t1;

  // Accounting: rows for ourselves are not transport bytes.
  per_slot_host_.resize(static_cast<size_t>(R) * S);
  be_.copy_to_host(per_slot_host_.data(), num_tokens_per_slot_.get(), 4 * per_slot_host_.size());
  const std::vector<int32_t>& per_slot = per_slot_host_;
  for (int r = 0; r < R; ++r) {
    if (r == me) continue;
    stats_.dispatch_bytes += send_counts_[r] * static_cast<int64_t>(row_bytes_ + 8 * K);
    stats_.combine_bytes += recv_counts_[r] * static_cast<int64_t>(row_bytes_);
    for (int s = 0; s < S; ++s)
      stats_.naive_dispatch_bytes += per_slot[r * S + s] * static_cast<int64_t>(row_bytes_ + 8);
  }
  stats_.received_rows = N;

  experts_.forward(recv_rows_.get(), N, recv_slot_.as<int32_t>(), recv_weight_.as<float>(), combined_.get());
  t1 = now_seconds();
  stats_.expert = t1 - t0;

  // Combine: one row per (source rank, token) goes back; the source sums its rows
  // in rank order.
  if (opts_.isolate_transport_timing) comm_.barrier(deadline());
  const double tc = now_seconds();
  comm_.all_to_all_v(combined_.get(), recv_rows_segs_, back_rows_.get(), send_rows_segs_, deadline());
  stats_.combine_transport = now_seconds() - tc;
  be_.unpermute({T, R, H, cfg_.dtype, false, cfg_.dtype},
                {back_rows_.get(), token_send_row_.as<int32_t>(), nullptr, out});
  be_.synchronize();
  stats_.combine = now_seconds() - t1;
}

void EpLayer::backward(const void* grad_out, void* grad_x) {
  MOE_CHECK(cfg_.train, "backward on a layer built without train = true");
  MOE_CHECK(has_forward_, "backward called before forward");
  const int K = cfg_.top_k, H = cfg_.hidden, R = map_.num_ranks, S = map_.slots_per_rank;
  const int64_t T = router_.num_tokens();
  const double t0 = now_seconds();

  // combine^T = dispatch: grad_out rows go where x rows went.
  be_.permute({T, R, rank_offset_[R], H, cfg_.dtype, cfg_.dtype},
              {grad_out, send_src_token_.as<int32_t>(), token_send_row_.as<int32_t>(), send_rows_.get()});
  be_.synchronize();
  double t = now_seconds();
  comm_.all_to_all_v(send_rows_.get(), send_rows_segs_, grad_recv_rows_.get(), recv_rows_segs_, deadline());
  stats_.backward_dispatch = now_seconds() - t;

  experts_.backward(grad_recv_rows_.get(), combined_.get(), cfg_.dtype, grad_pair_weight_.as<float>());

  // dispatch^T = combine: grad rows and per-pair weight gradients come back.
  be_.synchronize();
  t = now_seconds();
  comm_.all_to_all_v({AllToAllBuffer{combined_.get(), &recv_rows_segs_, back_rows_.get(), &send_rows_segs_},
                      AllToAllBuffer{grad_pair_weight_.get(), &recv_meta_segs_, back_gw_.get(), &send_meta_segs_}},
                     deadline());
  stats_.backward_combine = now_seconds() - t;
  be_.unpermute({T, R, H, DType::kF32, false, cfg_.dtype},
                {back_rows_.get(), token_send_row_.as<int32_t>(), nullptr, grad_x32_.get()});
  be_.combine_pair_scalars(topk_slot_.as<int32_t>(), token_send_row_.as<int32_t>(), T, K, R, S,
                           back_gw_.as<float>(), grad_topk_weight_.as<float>());

  router_.backward(x_, grad_topk_weight_.as<float>(), grad_x32_.as<float>());
  be_.synchronize();
  comm_.all_reduce_sum(router_.grad_gate(), static_cast<size_t>(cfg_.num_experts) * H, deadline());
  reduce_replica_grads();
  be_.convert(grad_x32_.get(), DType::kF32, grad_x, cfg_.dtype, T * H);
  be_.synchronize();
  stats_.backward = now_seconds() - t0;
  for (int r = 0; r < R; ++r) {
    if (r == comm_.rank()) continue;
    stats_.backward_dispatch_bytes += send_counts_[r] * static_cast<int64_t>(row_bytes_);
    stats_.backward_combine_bytes += recv_counts_[r] * static_cast<int64_t>(row_bytes_ + 4 * K);
  }
}

// Replicas of one expert end with the same gradient bits: the primary (first
// replica) sums g_0 + g_1 + ... in replica order and sends the sum back. Experts
// are handled in increasing id on every rank, and within an expert all traffic is
// between the primary and its replicas, so the blocking sends and receives cannot
// wait on each other in a cycle.
void EpLayer::reduce_replica_grads() {
  const size_t H = cfg_.hidden, I = cfg_.ffn_hidden;
  const size_t n13 = 2 * I * H, n2 = H * I, n = n13 + n2;
  const int me = comm_.rank(), S = map_.slots_per_rank;
  reduce_tmp_.resize(2 * n);
  float* acc = reduce_tmp_.data();
  float* msg = acc + n;
  auto g13 = [&](int32_t slot) { return experts_.grad_w13() + static_cast<size_t>(slot % S) * n13; };
  auto g2 = [&](int32_t slot) { return experts_.grad_w2() + static_cast<size_t>(slot % S) * n2; };
  auto tag = [&](int e, size_t i, int phase) {
    return opts_.tag_base + static_cast<uint32_t>(((static_cast<uint64_t>(e) * map_.max_replicas + i) * 2 + phase) &
                                                  0xffffff);
  };
  for (int e = 0; e < cfg_.num_experts; ++e) {
    if (map_.logcnt[e] < 2) continue;
    const std::vector<int32_t> reps = map_.replicas(e);
    const int primary = map_.rank_of_slot(reps[0]);
    if (me == primary) {
      std::copy_n(g13(reps[0]), n13, acc);
      std::copy_n(g2(reps[0]), n2, acc + n13);
      for (size_t i = 1; i < reps.size(); ++i) {
        const int owner = map_.rank_of_slot(reps[i]);
        if (owner == me) {
          std::copy_n(g13(reps[i]), n13, msg);
          std::copy_n(g2(reps[i]), n2, msg + n13);
        } else {
          comm_.recv(owner, msg, 4 * n, tag(e, i, 0), deadline());
        }
        for (size_t j = 0; j < n; ++j) acc[j] += msg[j];
      }
      for (size_t i = 0; i < reps.size(); ++i) {
        const int owner = map_.rank_of_slot(reps[i]);
        if (owner == me) {
          std::copy_n(acc, n13, g13(reps[i]));
          std::copy_n(acc + n13, n2, g2(reps[i]));
        } else {
          comm_.send(owner, acc, 4 * n, tag(e, i, 1), deadline());
        }
      }
    } else {
      for (size_t i = 1; i < reps.size(); ++i) {
        if (map_.rank_of_slot(reps[i]) != me) continue;
        std::copy_n(g13(reps[i]), n13, msg);
        std::copy_n(g2(reps[i]), n2, msg + n13);
        comm_.send(primary, msg, 4 * n, tag(e, i, 0), deadline());
      }
      for (size_t i = 1; i < reps.size(); ++i) {
        if (map_.rank_of_slot(reps[i]) != me) continue;
        comm_.recv(primary, msg, 4 * n, tag(e, i, 1), deadline());
        std::copy_n(msg, n13, g13(reps[i]));
        std::copy_n(msg + n13, n2, g2(reps[i]));
      }
    }
  }
}

void EpLayer::optimizer_step(const kernels::OptimizerConfig& cfg, int64_t step) {
  router_.apply_update(cfg, step);
  experts_.apply_update(cfg, step);
  be_.synchronize();
}

const float* EpLayer::grad_w13(int local_slot) const {
  return experts_.grad_w13() + static_cast<size_t>(local_slot) * 2 * cfg_.ffn_hidden * cfg_.hidden;
}

const float* EpLayer::grad_w2(int local_slot) const {
  return experts_.grad_w2() + static_cast<size_t>(local_slot) * cfg_.hidden * cfg_.ffn_hidden;
}

}  // namespace moe::ep
