#include "moe/ep/dispatcher.h"

#include <algorithm>

#include "moe/base/check.h"
#include "moe/base/clock.h"

namespace moe::ep {

using kernels::Buffer;
using transport::AllToAllBuffer;
using transport::Segments;

namespace {

constexpr size_t kSlotBytes = sizeof(int32_t);   // a local expert slot of a pair
constexpr size_t kWeightBytes = sizeof(float);   // a routing weight (or its gradient)

Segments scaled(const std::vector<int64_t>& rows, size_t bytes_per_row) {
  std::vector<size_t> b(rows.size());
  for (size_t r = 0; r < rows.size(); ++r) b[r] = static_cast<size_t>(rows[r]) * bytes_per_row;
  return Segments::packed(std::move(b));
}

}  // namespace

Dispatcher::Dispatcher(const DispatcherConfig& cfg, transport::Communicator& comm, kernels::Backend& be,
                       const DispatcherOptions& options)
    : cfg_(cfg),
      comm_(comm),
      be_(be),
      opts_(options),
      row_bytes_(kernels::dtype_size(cfg.dtype) * cfg.hidden),
      meta_bytes_(cfg.top_k * kSlotBytes) {
  MOE_CHECK(cfg.num_ranks == comm.size(), "dispatcher: ", cfg.num_ranks, " ranks, the communicator has ",
            comm.size());
  const size_t T = cfg.max_tokens, K = cfg.top_k, R = cfg.num_ranks, S = cfg.slots_per_rank;
  const size_t max_send_rows = T * std::min(R, K);  // a token goes to at most min(R, K) ranks
  auto make = [&](size_t bytes) { return Buffer(be_, bytes); };
  num_tokens_per_rank_ = make(4 * R);
  num_tokens_per_slot_ = make(4 * R * S);
  in_rank_ = make(T * R);
  h_.token_send_row_ = make(4 * T * R);
  h_.send_src_token_ = make(4 * max_send_rows);
  send_slot_ = make(kSlotBytes * max_send_rows * K);
  send_weight_ = make(kWeightBytes * max_send_rows * K);
  send_rows_ = make(max_send_rows * row_bytes_);
  back_rows_ = make(max_send_rows * row_bytes_);
  layout_ws_ = make(be_.dispatch_layout_workspace_bytes({cfg.max_tokens, cfg.top_k, cfg.num_ranks, cfg.slots_per_rank}));
  if (cfg.train) back_gw_ = make(kWeightBytes * max_send_rows * K);
  h_.rank_offset_.assign(R + 1, 0);
  h_.send_counts_.assign(R, 0);
  h_.recv_counts_.assign(R, 0);
  reserve(cfg.max_tokens);  // a first guess; grows when a step receives more
}

void Dispatcher::reserve(int64_t n) {
  if (n <= h_.recv_capacity_) return;
  h_.recv_capacity_ = n;
  const size_t N = n, K = cfg_.top_k;
  h_.recv_rows_ = Buffer(be_, N * row_bytes_);
  h_.recv_slot_ = Buffer(be_, kSlotBytes * N * K);
  h_.recv_weight_ = Buffer(be_, kWeightBytes * N * K);
  if (cfg_.train) grad_recv_rows_ = Buffer(be_, N * row_bytes_);
}

void Dispatcher::check(const DispatchHandle& h) const {
  MOE_CHECK(&h == &h_ && h_.topk_slot_, "dispatcher: combine or backward without this dispatcher's dispatch");
}

// Which ranks need which token (DeepEP's get_dispatch_layout), and the send
// buffer: x permuted rank-major by token_send_row, with each row's local slots
// and weights.
void Dispatcher::build_layout(const void* x, int64_t T, const float* topk_weight) {
  const int K = cfg_.top_k, R = cfg_.num_ranks, S = cfg_.slots_per_rank;
  kernels::DispatchLayoutArgs dl{
      .topk_slot = h_.topk_slot_,
      .topk_weight = topk_weight,
      .num_tokens_per_rank = num_tokens_per_rank_.as<int32_t>(),
      .num_tokens_per_slot = num_tokens_per_slot_.as<int32_t>(),
      .rank_offset = h_.rank_offset_.data(),
      .is_token_in_rank = in_rank_.as<uint8_t>(),
      .token_send_row = h_.token_send_row_.as<int32_t>(),
      .send_src_token = h_.send_src_token_.as<int32_t>(),
      .send_slot = send_slot_.as<int32_t>(),
      .send_weight = send_weight_.as<float>(),
      .workspace = layout_ws_.get(),
  };
  be_.dispatch_layout({.num_tokens = T, .top_k = K, .num_ranks = R, .slots_per_rank = S}, dl);
  be_.permute({.num_rows = T, .top_k = R, .num_out_rows = h_.rank_offset_[R], .hidden = cfg_.hidden,
               .in_dtype = cfg_.dtype, .out_dtype = cfg_.dtype},
              {.rows = x, .src_row = h_.send_src_token_.as<int32_t>(), .pair_pos = h_.token_send_row_.as<int32_t>(),
               .out = send_rows_.get()});
}

// Counts, then rows + slots + weights in one all-to-all round.
void Dispatcher::exchange(int64_t T) {
  const int R = cfg_.num_ranks;
  for (int r = 0; r < R; ++r) h_.send_counts_[r] = h_.rank_offset_[r + 1] - h_.rank_offset_[r];
  comm_.exchange_counts(h_.send_counts_.data(), h_.recv_counts_.data(), deadline());
  int64_t N = 0;
  for (int r = 0; r < R; ++r) N += h_.recv_counts_[r];
  reserve(N);
  h_.num_tokens_ = T;
  h_.num_recv_rows_ = N;
  h_.send_rows_ = scaled(h_.send_counts_, row_bytes_);
  h_.recv_rows_segs_ = scaled(h_.recv_counts_, row_bytes_);
  h_.send_meta_ = scaled(h_.send_counts_, meta_bytes_);
  h_.recv_meta_ = scaled(h_.recv_counts_, meta_bytes_);
  be_.synchronize();
  if (opts_.isolate_transport_timing) comm_.barrier(deadline());
  const double t0 = now_seconds();
  comm_.all_to_all_v({AllToAllBuffer{send_rows_.get(), &h_.send_rows_, h_.recv_rows_.get(), &h_.recv_rows_segs_},
                      AllToAllBuffer{send_slot_.get(), &h_.send_meta_, h_.recv_slot_.get(), &h_.recv_meta_},
                      AllToAllBuffer{send_weight_.get(), &h_.send_meta_, h_.recv_weight_.get(), &h_.recv_meta_}},
                     deadline());
  stats_.dispatch_transport = now_seconds() - t0;
}

// The accounting (docs/transport.md#accounting) of the forward pair: rows for ourselves are not
// transport bytes; the naive scheme sends one row per remote (token, expert) pair.
void Dispatcher::count_bytes() {
  const int R = cfg_.num_ranks, S = cfg_.slots_per_rank, me = comm_.rank();
  per_slot_host_.resize(static_cast<size_t>(R) * S);
  be_.copy_to_host(per_slot_host_.data(), num_tokens_per_slot_.get(), 4 * per_slot_host_.size());
  const int64_t dispatched_row = static_cast<int64_t>(row_bytes_ + meta_bytes_ + cfg_.top_k * kWeightBytes);
  const int64_t naive_pair = static_cast<int64_t>(row_bytes_ + kSlotBytes + kWeightBytes);
  const int64_t row = static_cast<int64_t>(row_bytes_);
  for (int r = 0; r < R; ++r) {
    if (r == me) continue;
    stats_.dispatch_bytes += h_.send_counts_[r] * dispatched_row;
    stats_.dispatch_received_bytes += h_.recv_counts_[r] * dispatched_row;
    stats_.combine_bytes += h_.recv_counts_[r] * row;
    stats_.combine_received_bytes += h_.send_counts_[r] * row;
    int64_t pairs = 0;
    for (int s = 0; s < S; ++s) pairs += per_slot_host_[r * S + s];
    stats_.naive_dispatch_bytes += pairs * naive_pair;
    stats_.naive_combine_bytes += pairs * row;
  }
  stats_.received_rows = h_.num_recv_rows_;
}

const DispatchHandle& Dispatcher::dispatch(const void* x, int64_t T, const int32_t* topk_slot,
                                           const float* topk_weight) {
  MOE_CHECK(T >= 0 && T <= cfg_.max_tokens, "dispatch: ", T, " tokens, the layer holds at most ", cfg_.max_tokens);
  stats_ = {};
  h_.topk_slot_ = topk_slot;
  build_layout(x, T, topk_weight);
  exchange(T);
  count_bytes();
  return h_;
}

void Dispatcher::combine(const DispatchHandle& h, const void* y, void* out) {
  check(h);
  if (opts_.isolate_transport_timing) comm_.barrier(deadline());
  const double t0 = now_seconds();
  comm_.all_to_all_v(y, h_.recv_rows_segs_, back_rows_.get(), h_.send_rows_, deadline());
  stats_.combine_transport = now_seconds() - t0;
  // A token's rows from every rank, summed in rank order.
  be_.unpermute({.num_rows = h_.num_tokens_, .top_k = cfg_.num_ranks, .hidden = cfg_.hidden,
                 .out_dtype = cfg_.dtype, .accumulate = false, .in_dtype = cfg_.dtype},
                {.perm = back_rows_.get(), .pair_pos = h_.token_send_row_.as<int32_t>(), .pair_weight = nullptr,
                 .out = out});
}

const void* Dispatcher::combine_backward(const DispatchHandle& h, const void* grad_out) {
  check(h);
  MOE_CHECK(cfg_.train, "combine_backward on a dispatcher built without train = true");
  const int R = cfg_.num_ranks;
  be_.permute({.num_rows = h_.num_tokens_, .top_k = R, .num_out_rows = h_.rank_offset_[R], .hidden = cfg_.hidden,
               .in_dtype = cfg_.dtype, .out_dtype = cfg_.dtype},
              {.rows = grad_out, .src_row = h_.send_src_token_.as<int32_t>(),
               .pair_pos = h_.token_send_row_.as<int32_t>(), .out = send_rows_.get()});
  be_.synchronize();
  const double t0 = now_seconds();
  comm_.all_to_all_v(send_rows_.get(), h_.send_rows_, grad_recv_rows_.get(), h_.recv_rows_segs_, deadline());
  stats_.backward_dispatch_transport = now_seconds() - t0;
  const int64_t row = static_cast<int64_t>(row_bytes_);
  for (int r = 0; r < R; ++r) {
    if (r == comm_.rank()) continue;
    stats_.backward_dispatch_bytes += h_.send_counts_[r] * row;
    stats_.backward_dispatch_received_bytes += h_.recv_counts_[r] * row;
  }
  return grad_recv_rows_.get();
}

void Dispatcher::dispatch_backward(const DispatchHandle& h, const void* grad_rows, const float* grad_pair_weight,
                                   float* grad_x32, float* grad_topk_weight) {
  check(h);
  MOE_CHECK(cfg_.train, "dispatch_backward on a dispatcher built without train = true");
  const int K = cfg_.top_k, R = cfg_.num_ranks;
  be_.synchronize();
  const double t0 = now_seconds();
  const Segments grad_meta_recv = scaled(h_.recv_counts_, K * kWeightBytes);
  const Segments grad_meta_send = scaled(h_.send_counts_, K * kWeightBytes);
  comm_.all_to_all_v({AllToAllBuffer{grad_rows, &h_.recv_rows_segs_, back_rows_.get(), &h_.send_rows_},
                      AllToAllBuffer{grad_pair_weight, &grad_meta_recv, back_gw_.get(), &grad_meta_send}},
                     deadline());
  stats_.backward_combine_transport = now_seconds() - t0;
  be_.unpermute({.num_rows = h_.num_tokens_, .top_k = R, .hidden = cfg_.hidden, .out_dtype = DType::kF32,
                 .accumulate = false, .in_dtype = cfg_.dtype},
                {.perm = back_rows_.get(), .pair_pos = h_.token_send_row_.as<int32_t>(), .pair_weight = nullptr,
                 .out = grad_x32});
  be_.combine_pair_scalars(h_.topk_slot_, h_.token_send_row_.as<int32_t>(), h_.num_tokens_, K, R,
                           cfg_.slots_per_rank, back_gw_.as<float>(), grad_topk_weight);
  const int64_t row_back = static_cast<int64_t>(row_bytes_ + K * kWeightBytes);
  for (int r = 0; r < R; ++r) {
    if (r == comm_.rank()) continue;
    stats_.backward_combine_bytes += h_.recv_counts_[r] * row_back;
    stats_.backward_combine_received_bytes += h_.send_counts_[r] * row_back;
  }
}

}  // namespace moe::ep
