#include "moe/ep/dispatcher.h"

#include <algorithm>
#include <cmath>

#include "moe/base/check.h"
#include "moe/base/clock.h"

namespace moe::ep {

using kernels::Buffer;
using transport::AllToAllBuffer;
using transport::Segments;

namespace {

constexpr size_t kSlotBytes = sizeof(int32_t);   // a local expert slot of a pair
constexpr size_t kWeightBytes = sizeof(float);   // a routing weight (or its gradient)
constexpr size_t kTokenBytes = sizeof(int32_t);   // a row's token index at its source

Segments scaled(const std::vector<int64_t>& rows, size_t bytes_per_row) {
  std::vector<size_t> b(rows.size());
  for (size_t r = 0; r < rows.size(); ++r) b[r] = static_cast<size_t>(rows[r]) * bytes_per_row;
  return Segments::packed(std::move(b));
}

// Segments of `rows[r]` rows from row `first[r]`, `unit` bytes a row.
Segments segs(const std::vector<size_t>& rows, const std::vector<size_t>& first, size_t unit) {
  Segments s;
  for (size_t r = 0; r < rows.size(); ++r) {
    s.bytes.push_back(rows[r] * unit);
    s.offset.push_back(first[r] * unit);
  }
  return s;
}

Segments segs(const PairRanges& p, size_t unit) { return segs(p.count, p.first, unit); }

// A row's source (DispatchHandle::source_key): its rank and its token index there.
int64_t source_key(int rank, int32_t token) { return (static_cast<int64_t>(rank) << 32) | static_cast<uint32_t>(token); }

// The pair rows of row ranges: rows [first, first + count) hold pair rows
// [offset[first], offset[first + count]).
PairRanges pairs_of(const PairRanges& rows, const std::vector<int64_t>& offset) {
  PairRanges p;
  for (size_t r = 0; r < rows.first.size(); ++r) {
    p.first.push_back(offset[rows.first[r]]);
    p.count.push_back(offset[rows.first[r] + rows.count[r]] - offset[rows.first[r]]);
  }
  return p;
}

// Per-peer ranges of `counts` rows laid out back to back from `first`.
PairRanges packed_ranges(const std::vector<int64_t>& counts, const std::vector<int64_t>& first) {
  PairRanges p;
  for (size_t r = 0; r < counts.size(); ++r) {
    p.first.push_back(first[r]);
    p.count.push_back(counts[r]);
  }
  return p;
}

// The pieces of the row order (build_row_order): chunk boundaries are piece
// boundaries for every chunk count up to kMaxChunks (chunk_piece).
constexpr int kOrderPieces = 840;
constexpr bool every_chunk_count_fits() {  // chunk_piece's unit, P / (2 (C - 1)), is whole
  for (int C = 2; C <= kMaxChunks; ++C)
    if (kOrderPieces % (2 * (C - 1)) != 0) return false;
  return true;
}
static_assert(every_chunk_count_fits());

// The piece where chunk c of C begins: the first and last chunks are half the
// others (shares 1, 2, ..., 2, 1 of 2 (C - 1)), so the pipeline fills on a short
// first transfer and drains on a short last one (docs/layer.md#overlap).
int chunk_piece(int c, int C) {
  if (c == 0) return 0;
  if (C == 1) return kOrderPieces;
  const int share = std::min(2 * c - 1, 2 * (C - 1));
  return kOrderPieces / (2 * (C - 1)) * share;
}

// Rows [n p_c / P, n p_(c+1) / P) of n, p_c = chunk_piece(c, C): chunk c of a
// peer's rows, on both sides.
int64_t chunk_begin(int64_t n, int c, int C) { return n * chunk_piece(c, C) / kOrderPieces; }
int64_t chunk_rows(int64_t n, int c, int C) { return chunk_begin(n, c + 1, C) - chunk_begin(n, c, C); }

// A count and a chunk proposal in one int64 of the count exchange.
constexpr int kChunkBits = 8;
static_assert(kMaxChunks < (1 << kChunkBits));

}  // namespace

int chunk_rule(double transfer_seconds, double compute_seconds, double rows_per_expert) {
  if (transfer_seconds <= 0 || compute_seconds <= 0) return 1;
  constexpr double kUnhiddenShare = 0.1, kWorthChunking = 0.2;
  const double lo = std::min(transfer_seconds, compute_seconds), hi = std::max(transfer_seconds, compute_seconds);
  if (lo < kWorthChunking * hi) return 1;  // the smaller chunks' GEMMs and messages would cost more than they hide
  const int wanted = static_cast<int>(std::ceil(lo / (kUnhiddenShare * hi)));
  const int room = static_cast<int>(rows_per_expert / kMinExpertRows);
  return std::clamp(std::min(wanted, room), 1, kMaxChunks);
}

Dispatcher::Dispatcher(const DispatcherConfig& cfg, transport::Communicator& comm, kernels::Backend& be,
                       const DispatcherOptions& options)
    : cfg_(cfg),
      comm_(comm),
      be_(be),
      opts_(options),
      row_bytes_(kernels::dtype_size(cfg.dtype) * cfg.hidden),
      meta_bytes_(cfg.top_k * kSlotBytes),
      dispatch_(kernels::resolve_wire(cfg.dispatch_wire, cfg.dtype, kernels::WireRole::kDispatch)),
      combine_(kernels::resolve_wire(cfg.combine_wire, cfg.dtype, kernels::WireRole::kCombine)),
      wire_bytes_(dispatch_.row_bytes(cfg.hidden)),
      combine_bytes_(combine_.row_bytes(cfg.hidden)) {
  MOE_CHECK(cfg.num_ranks == comm.size(), "dispatcher: ", cfg.num_ranks, " ranks, the communicator has ",
            comm.size());
  const size_t T = cfg.max_tokens, K = cfg.top_k, R = cfg.num_ranks, S = cfg.slots_per_rank;
  const size_t max_send_rows = T * std::min(R, K);  // a token goes to at most min(R, K) ranks
  const size_t max_pairs = T * K;  // the pair rows coming back
  auto make = [&](size_t bytes) { return Buffer(be_, bytes); };
  layout_.tokens_per_rank = make(4 * R);
  layout_.tokens_per_slot = make(4 * R * S);
  layout_.in_rank = make(T * R);
  h_.token_send_row_ = make(4 * T * R);
  h_.send_src_token_ = make(4 * max_send_rows);
  bufs_.send_slot = make(kSlotBytes * max_send_rows * K);
  bufs_.send_weight = make(kWeightBytes * max_send_rows * K);
  bufs_.send_rows = make(max_send_rows * row_bytes_);
  bufs_.back_rows = make(max_pairs * row_bytes_);  // >= combine_bytes_ a row
  h_.pair_back_pos_ = make(4 * max_pairs);
  if (encoded_dispatch()) bufs_.send_wire = make(max_send_rows * wire_bytes_);
  layout_.ws = make(be_.dispatch_layout_workspace_bytes({cfg.max_tokens, cfg.top_k, cfg.num_ranks, cfg.slots_per_rank}));
  if (cfg.train) bufs_.back_gw = make(kWeightBytes * max_send_rows * K);
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
  h_.recv_token_ = Buffer(be_, kTokenBytes * N);
  if (cfg_.train) bufs_.grad_recv_rows = Buffer(be_, N * row_bytes_);
  if (cfg_.train && can_chunk()) h_.row_order_ = Buffer(be_, 4 * N);
  if (encoded_dispatch()) bufs_.recv_wire = Buffer(be_, N * wire_bytes_);
  // A received row carries at most min(K, S) of this rank's pairs.
  if (encoded_combine()) bufs_.y_wire = Buffer(be_, N * std::min(K, size_t(cfg_.slots_per_rank)) * combine_bytes_);
}

// The send rows in the dispatch wire's format: x permuted rank-major into
// bufs_.send_rows (the layer dtype, or a bf16 wire's rows directly), then, for fp8,
// quantized.
void Dispatcher::encode_send_rows(const void* x, int64_t T) {
  const int R = cfg_.num_ranks;
  const int64_t rows = h_.rank_offset_[R];
  const bool direct = encoded_dispatch() && dispatch_.plain;  // a plain wire: permute converts
  be_.permute({.num_rows = T, .top_k = R, .num_out_rows = rows, .hidden = cfg_.hidden, .in_dtype = cfg_.dtype,
               .out_dtype = direct ? dispatch_.dtype : cfg_.dtype},
              {.rows = x, .src_row = h_.send_src_token_.as<int32_t>(), .pair_pos = h_.token_send_row_.as<int32_t>(),
               .out = direct ? bufs_.send_wire.get() : bufs_.send_rows.get()});
  if (encoded_dispatch() && !direct)
    be_.pack_rows(dispatch_.format, bufs_.send_rows.get(), cfg_.dtype, rows, cfg_.hidden, bufs_.send_wire.get());
}

// Received rows [first, first + n) from the dispatch wire into the handle's rows.
void Dispatcher::decode_rows(int64_t first, int64_t n) {
  if (!encoded_dispatch() || n == 0) return;
  const void* in = bufs_.recv_wire.as<uint8_t>() + first * wire_bytes_;
  void* out = h_.recv_rows_.as<uint8_t>() + first * row_bytes_;
  be_.unpack_rows(dispatch_.format, in, n, cfg_.hidden, out, cfg_.dtype);
}

// Pair rows [first, first + n) of y in the combine wire's format: y itself, or bufs_.y_wire.
const void* Dispatcher::encode_results(const void* y, int64_t first, int64_t n) {
  if (!encoded_combine()) return y;
  if (n > 0)
    be_.pack_rows(combine_.format, static_cast<const uint8_t*>(y) + first * row_bytes_, cfg_.dtype, n, cfg_.hidden,
                  bufs_.y_wire.as<uint8_t>() + first * combine_bytes_);
  return bufs_.y_wire.get();
}

// Where each pair's result travels back (docs/layer.md#dispatch-and-combine).
// The receiver sends a received row's results as one row per pair it carried
// (its local slots in k order), and the source lays them out per send row in k
// order: pair_back_pos [T, K] finds pair (t, k) among them, so the combine sums
// a token's K results in k order, wherever its experts live. Host math over
// copies of the slots, then the map to the backend. Runs once the slots are in.
void Dispatcher::lay_out_returns() {
  count_received_pairs();
  place_returned_pairs();
  const int R = cfg_.num_ranks;
  std::vector<PairRanges> arrived;  // where each peer's rows landed: per chunk, or rank-major
  if (h_.chunks_ > 1) {
    for (const ChunkPlan& p : chunking_.plan) arrived.push_back(p.recv_row_ranges);
    plan_returns();
  } else {
    std::vector<int64_t> recv_first(R, 0);
    for (int r = 1; r < R; ++r) recv_first[r] = recv_first[r - 1] + h_.recv_counts_[r - 1];
    arrived.push_back(packed_ranges(h_.recv_counts_, recv_first));
    h_.recv_pairs_ = pairs_of(arrived[0], h_.recv_pair_offset_);
    h_.send_pairs_ = pairs_of(packed_ranges(h_.send_counts_, h_.rank_offset_), h_.send_pair_offset_);
    count_return_bytes(h_.recv_pairs_.count, h_.send_pairs_.count);
  }
  if (cfg_.train) key_sources(arrived);
}

// Each received row's source key, from where each peer's rows landed: a train
// layer's weight-gradient order and replica reduction read them.
void Dispatcher::key_sources(const std::vector<PairRanges>& arrived) {
  const int64_t N = h_.num_recv_rows_;
  host_.token.resize(N);
  be_.copy_to_host(host_.token.data(), h_.recv_token_.get(), kTokenBytes * N);
  h_.source_key_.resize(N);
  for (const PairRanges& a : arrived)
    for (size_t r = 0; r < a.first.size(); ++r)
      for (size_t i = a.first[r]; i < a.first[r] + a.count[r]; ++i)
        h_.source_key_[i] = source_key(static_cast<int>(r), host_.token[i]);
}

// The receiver: each received row's pairs (its local slots), as offsets.
void Dispatcher::count_received_pairs() {
  const int K = cfg_.top_k;
  const int64_t N = h_.num_recv_rows_;
  std::vector<int64_t>& recv = h_.recv_pair_offset_;
  host_.slots.resize(static_cast<size_t>(N) * K);
  be_.copy_to_host(host_.slots.data(), h_.recv_slot_.get(), 4 * N * K);
  recv.assign(N + 1, 0);
  const int32_t S = cfg_.slots_per_rank;
  for (int64_t n = 0; n < N; ++n) {
    int64_t local = 0;
    for (int k = 0; k < K; ++k) {
      const int32_t slot = host_.slots[n * K + k];
      // The experts index their buffers with it: a peer's slot must be one of this rank's, or -1.
      MOE_CHECK(slot >= -1 && slot < S, "dispatch: received row ", n, " names slot ", slot, "; this rank has slots 0 to ",
                S - 1, " (a forged or corrupt row from a peer)");
      local += slot >= 0;
    }
    // A token's experts are distinct, so a row carries at most min(K, S) of this
    // rank's pairs: the pair buffers (y_wire, the expert stage's) hold that many.
    MOE_CHECK(local <= std::min<int64_t>(K, S), "dispatch: received row ", n, " carries ", local, " pairs; a row carries ",
              "at most ", std::min<int64_t>(K, S), " (a forged or corrupt row from a peer)");
    recv[n + 1] = recv[n] + local;
  }
}

// The source: pairs per send row (offsets), then each pair's place among its
// row's in k order (pair_back_pos, to the backend).
void Dispatcher::place_returned_pairs() {
  const int K = cfg_.top_k, R = cfg_.num_ranks, S = cfg_.slots_per_rank;
  const int64_t T = h_.num_tokens_, rows = h_.rank_offset_[R];
  host_.slots.resize(static_cast<size_t>(T) * K);
  be_.copy_to_host(host_.slots.data(), h_.topk_slot_, 4 * T * K);
  host_.send_row.resize(static_cast<size_t>(T) * R);
  be_.copy_to_host(host_.send_row.data(), h_.token_send_row_.get(), 4 * T * R);
  std::vector<int64_t>& send = h_.send_pair_offset_;
  send.assign(rows + 1, 0);
  for (int64_t i = 0; i < T * K; ++i)
    if (host_.slots[i] >= 0) ++send[host_.send_row[(i / K) * R + host_.slots[i] / S] + 1];
  for (int64_t j = 0; j < rows; ++j) send[j + 1] += send[j];
  host_.back_pos.assign(static_cast<size_t>(T) * K, -1);
  std::vector<int64_t> next(R);
  for (int64_t t = 0; t < T; ++t) {
    for (int r = 0; r < R; ++r) next[r] = host_.send_row[t * R + r] >= 0 ? send[host_.send_row[t * R + r]] : 0;
    for (int k = 0; k < K; ++k) {
      const int32_t slot = host_.slots[t * K + k];
      if (slot >= 0) host_.back_pos[t * K + k] = static_cast<int32_t>(next[slot / S]++);
    }
  }
  be_.copy_to_device(h_.pair_back_pos_.get(), host_.back_pos.data(), 4 * T * K);
}

// Each chunk's pair rows back, from its row ranges.
void Dispatcher::plan_returns() {
  const size_t R = cfg_.num_ranks;
  std::vector<size_t> out_pairs(R, 0), in_pairs(R, 0);
  for (ChunkPlan& p : chunking_.plan) {
    const PairRanges out = pairs_of(p.recv_row_ranges, h_.recv_pair_offset_);
    const PairRanges in = pairs_of(p.send_row_ranges, h_.send_pair_offset_);
    p.recv_results = segs(out, combine_bytes_);
    p.send_results = segs(in, combine_bytes_);
    p.recv_grad_pairs = segs(out, row_bytes_);
    p.send_grad_pairs = segs(in, row_bytes_);
    for (size_t r = 0; r < R; ++r) {
      out_pairs[r] += out.count[r];
      in_pairs[r] += in.count[r];
    }
  }
  count_return_bytes(out_pairs, in_pairs);
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
      .num_tokens_per_rank = layout_.tokens_per_rank.as<int32_t>(),
      .num_tokens_per_slot = layout_.tokens_per_slot.as<int32_t>(),
      .rank_offset = h_.rank_offset_.data(),
      .is_token_in_rank = layout_.in_rank.as<uint8_t>(),
      .token_send_row = h_.token_send_row_.as<int32_t>(),
      .send_src_token = h_.send_src_token_.as<int32_t>(),
      .send_slot = bufs_.send_slot.as<int32_t>(),
      .send_weight = bufs_.send_weight.as<float>(),
      .workspace = layout_.ws.get(),
  };
  be_.dispatch_layout({.num_tokens = T, .top_k = K, .num_ranks = R, .slots_per_rank = S}, dl);
  encode_send_rows(x, T);
}

// Every backend: the worker thread only calls the communicator (NCCL on its own
// stream for device memory), and every post follows a synchronize of the rank's
// stream, so what a chunk sends is written before it leaves.
bool Dispatcher::can_chunk() const { return cfg_.num_ranks > 1; }

// An asked count, or the rule applied to every rank's transfer and expert seconds
// of the last step (an all-gather through an all-reduce, so every rank proposes
// the same): the smallest transfer, the mean expert seconds and rows. The
// smallest because an all-to-all's time on one rank also holds its waits for a
// peer that posted late (its compute was slower); the slowest rank waits for no
// one, so its time is the link's. The numbers travel in the backend's memory
// (the communicator may be NCCL).
int Dispatcher::propose_chunks() {
  if (opts_.overlap_chunks > 0) return std::min(opts_.overlap_chunks, kMaxChunks);
  const int R = cfg_.num_ranks, me = comm_.rank();
  std::vector<float> all(3 * R, 0.0f);  // zeros but for this rank's three: the sum gathers
  all[3 * me] = static_cast<float>(chunking_.last_transfer);
  all[3 * me + 1] = static_cast<float>(chunking_.last_compute);
  all[3 * me + 2] = static_cast<float>(chunking_.last_rows_per_expert);
  if (!bufs_.proposals.get()) bufs_.proposals = Buffer(be_, 4 * all.size());
  be_.copy_to_device(bufs_.proposals.get(), all.data(), 4 * all.size());
  comm_.all_reduce_sum(bufs_.proposals.as<float>(), all.size(), deadline());
  be_.copy_to_host(all.data(), bufs_.proposals.get(), 4 * all.size());
  double transfer = all[0], compute = 0, rows = 0;
  for (int r = 0; r < R; ++r) {
    transfer = std::min<double>(transfer, all[3 * r]);
    compute += all[3 * r + 1] / R;
    rows += all[3 * r + 2] / R;
  }
  return chunk_rule(transfer, compute, rows);
}

// Rows per peer both ways; a dispatcher that can chunk sends its chunk
// proposal with every count, and all ranks take the largest.
void Dispatcher::exchange_counts_and_chunks() {
  const int R = cfg_.num_ranks;
  for (int r = 0; r < R; ++r) h_.send_counts_[r] = h_.rank_offset_[r + 1] - h_.rank_offset_[r];
  if (!can_chunk()) {
    h_.chunks_ = 1;
    comm_.exchange_counts(h_.send_counts_.data(), h_.recv_counts_.data(), deadline());
    check_received_counts({});
    return;
  }
  const int64_t mine = propose_chunks();
  std::vector<int64_t> send(R), recv(R);
  for (int r = 0; r < R; ++r) send[r] = (h_.send_counts_[r] << kChunkBits) | mine;
  comm_.exchange_counts(send.data(), recv.data(), deadline());
  int64_t agreed = mine;
  std::vector<int64_t> proposed(R);
  for (int r = 0; r < R; ++r) {
    h_.recv_counts_[r] = recv[r] >> kChunkBits;
    proposed[r] = recv[r] & ((1 << kChunkBits) - 1);
    agreed = std::max(agreed, proposed[r]);
  }
  check_received_counts(proposed);
  h_.chunks_ = static_cast<int>(agreed);
}

// What peers say before anything is sized from it (a peer is not trusted with
// this rank's memory): each sends at most one row per token of its at most
// max_tokens, and proposes 1 to kMaxChunks chunks. A violation fails the step
// naming the peer, before any buffer grows.
void Dispatcher::check_received_counts(const std::vector<int64_t>& proposed_chunks) const {
  for (int r = 0; r < cfg_.num_ranks; ++r) {
    const int64_t n = h_.recv_counts_[r];
    MOE_CHECK(n >= 0 && n <= cfg_.max_tokens, "dispatch: rank ", r, " announced ", n,
              " rows; a rank sends 0 to ", cfg_.max_tokens, " (a forged or corrupt count)");
    if (!proposed_chunks.empty())
      MOE_CHECK(proposed_chunks[r] >= 1 && proposed_chunks[r] <= kMaxChunks, "dispatch: rank ", r, " proposed ",
                proposed_chunks[r], " chunks; 1 to ", kMaxChunks, " are valid (a forged or corrupt count)");
  }
}

// Counts, then rows + slots + weights in one all-to-all round, or chunk 0 of a
// chunked pair.
void Dispatcher::exchange(int64_t T) {
  const int R = cfg_.num_ranks;
  exchange_counts_and_chunks();
  int64_t N = 0;
  for (int r = 0; r < R; ++r) N += h_.recv_counts_[r];
  reserve(N);
  h_.num_tokens_ = T;
  h_.num_recv_rows_ = N;
  h_.segs_.send_rows = scaled(h_.send_counts_, row_bytes_);
  h_.segs_.recv_rows = scaled(h_.recv_counts_, row_bytes_);
  h_.segs_.send_meta = scaled(h_.send_counts_, meta_bytes_);
  h_.segs_.recv_meta = scaled(h_.recv_counts_, meta_bytes_);
  h_.segs_.send_token = scaled(h_.send_counts_, kTokenBytes);
  h_.segs_.recv_token = scaled(h_.recv_counts_, kTokenBytes);
  h_.segs_.send_wire = scaled(h_.send_counts_, wire_bytes_);
  h_.segs_.recv_wire = scaled(h_.recv_counts_, wire_bytes_);
  if (cfg_.train && can_chunk()) build_row_order();
  be_.synchronize();
  if (h_.chunks_ > 1) {
    plan_chunks();
    post_dispatch_chunk(0);
    return;
  }
  if (opts_.isolate_transport_timing) comm_.barrier(deadline());
  const double t0 = now_seconds();
  comm_.all_to_all_v({AllToAllBuffer{wire_send(), &h_.segs_.send_wire, wire_recv(), &h_.segs_.recv_wire},
                      AllToAllBuffer{bufs_.send_slot.get(), &h_.segs_.send_meta, h_.recv_slot_.get(), &h_.segs_.recv_meta},
                      AllToAllBuffer{bufs_.send_weight.get(), &h_.segs_.send_meta, h_.recv_weight_.get(), &h_.segs_.recv_meta},
                      AllToAllBuffer{h_.send_src_token_.get(), &h_.segs_.send_token, h_.recv_token_.get(),
                                     &h_.segs_.recv_token}},
                     deadline());
  stats_.dispatch_transport = now_seconds() - t0;
  decode_rows(0, N);
  lay_out_returns();
}

// The order of the received rows that every chunk count C <= kMaxChunks cuts into
// its chunks: each peer's n rows split into kOrderPieces pieces [m n / P, (m + 1) n / P),
// piece by piece, in rank order within a piece. Chunk c of C is the run of pieces
// [chunk_piece(c, C), chunk_piece(c + 1, C)), laid out chunk-major as plan_chunks receives it.
void Dispatcher::build_row_order() {
  const int R = cfg_.num_ranks, C = h_.chunks_, P = kOrderPieces;
  std::vector<int64_t> chunk_first(static_cast<size_t>(C) * R);  // received row of chunk c's first row from r
  int64_t row = 0;
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) {
      chunk_first[c * R + r] = row;
      row += chunk_rows(h_.recv_counts_[r], c, C);
    }
  std::vector<int32_t> order;
  order.reserve(h_.num_recv_rows_);
  std::vector<int> chunk(R, 0);  // the chunk of peer r's current row
  for (int m = 0; m < P; ++m)
    for (int r = 0; r < R; ++r) {
      const int64_t n = h_.recv_counts_[r];
      for (int64_t j = n * m / P; j < n * (m + 1) / P; ++j) {
        while (j >= chunk_begin(n, chunk[r] + 1, C)) ++chunk[r];
        order.push_back(static_cast<int32_t>(chunk_first[chunk[r] * R + r] + j - chunk_begin(n, chunk[r], C)));
      }
    }
  be_.copy_to_device(h_.row_order_.get(), order.data(), 4 * order.size());
}

// Chunk c takes rows [chunk_begin(n, c, C), chunk_begin(n, c + 1, C)) of every peer's n. Sent from the
// rank-major send buffer; received chunk-major (chunk c's rows from every peer,
// in rank order, after chunk c - 1's), so a chunk is contiguous for the experts.
void Dispatcher::plan_chunks() {
  const int R = cfg_.num_ranks, C = h_.chunks_;
  chunking_.plan.assign(C, {});
  chunking_.next = 0;
  if (!chunking_.worker) chunking_.worker = std::make_unique<transport::TransferWorker>();
  int64_t row = 0;
  for (int c = 0; c < C; ++c) {
    ChunkPlan& p = chunking_.plan[c];
    std::vector<size_t> send_bytes(R), send_off(R), recv_bytes(R), recv_off(R);
    p.first_row = row;
    for (int r = 0; r < R; ++r) {
      const int64_t out = chunk_rows(h_.send_counts_[r], c, C), in = chunk_rows(h_.recv_counts_[r], c, C);
      send_off[r] = h_.rank_offset_[r] + chunk_begin(h_.send_counts_[r], c, C);
      send_bytes[r] = out;
      recv_off[r] = row;
      recv_bytes[r] = in;
      row += in;
    }
    p.num_rows = row - p.first_row;
    p.send_rows = segs(send_bytes, send_off, wire_bytes_);
    p.recv_rows = segs(recv_bytes, recv_off, wire_bytes_);
    p.send_row_ranges = {send_off, send_bytes};
    p.recv_row_ranges = {recv_off, recv_bytes};
    p.send_meta = segs(send_bytes, send_off, meta_bytes_);
    p.recv_meta = segs(recv_bytes, recv_off, meta_bytes_);
    p.send_token = segs(send_bytes, send_off, kTokenBytes);
    p.recv_token = segs(recv_bytes, recv_off, kTokenBytes);
    p.send_grad = segs(send_bytes, send_off, row_bytes_);
    p.recv_grad = segs(recv_bytes, recv_off, row_bytes_);
    p.send_grad_w = segs(send_bytes, send_off, cfg_.top_k * kWeightBytes);
    p.recv_grad_w = segs(recv_bytes, recv_off, cfg_.top_k * kWeightBytes);
  }
}

// Chunk c's rows; with chunk 0, every chunk's slots, weights and source tokens, so the receiver
// can lay out all its rows' pairs before it computes the first chunk.
void Dispatcher::post_dispatch_chunk(int c) {
  ChunkPlan& p = chunking_.plan[c];
  std::vector<AllToAllBuffer> bufs{AllToAllBuffer{wire_send(), &p.send_rows, wire_recv(), &p.recv_rows}};
  if (c == 0)
    for (const ChunkPlan& q : chunking_.plan) {
      bufs.push_back({bufs_.send_slot.get(), &q.send_meta, h_.recv_slot_.get(), &q.recv_meta});
      bufs.push_back({bufs_.send_weight.get(), &q.send_meta, h_.recv_weight_.get(), &q.recv_meta});
      bufs.push_back({h_.send_src_token_.get(), &q.send_token, h_.recv_token_.get(), &q.recv_token});
    }
  p.arrived = chunking_.last_op = chunking_.worker->post([this, bufs = std::move(bufs)] {
    const double t0 = now_seconds();
    comm_.all_to_all_v(bufs, deadline());
    stats_.dispatch_transport += now_seconds() - t0;
  });
}

// Chunk c's results go back where its rows came from: into bufs_.back_rows at the
// send rows' pair positions, so the unpermute reads what a serial combine leaves.
void Dispatcher::post_combine_chunk(int c, const void* y) {
  const ChunkPlan& p = chunking_.plan[c];
  chunking_.last_op = chunking_.worker->post([this, &p, y] {
    const double t0 = now_seconds();
    comm_.all_to_all_v(y, p.recv_results, bufs_.back_rows.get(), p.send_results, deadline());
    stats_.combine_transport += now_seconds() - t0;
  });
}

// The chunk the caller computes next, once its rows have arrived.
int Dispatcher::take_chunk(const char* what) {
  MOE_CHECK(h_.chunks_ > 1 && chunking_.next < h_.chunks_, "dispatcher: ", what, " without a chunked pair (chunk ",
            chunking_.next, " of ", h_.chunks_, ")");
  const int c = chunking_.next;
  wait_for(chunking_.plan[c].arrived);
  return c;
}

ChunkRows Dispatcher::next_chunk() {
  const int c = take_chunk("next_chunk");
  if (c == 0) lay_out_returns();  // every row's slots came with chunk 0
  if (c + 1 < h_.chunks_) post_dispatch_chunk(c + 1);
  decode_rows(chunking_.plan[c].first_row, chunking_.plan[c].num_rows);
  return {.first_row = chunking_.plan[c].first_row, .num_rows = chunking_.plan[c].num_rows};
}

// Waits for the worker's op `id`; on a failure, lets every posted op end first
// (they use this dispatcher's buffers).
void Dispatcher::wait_for(transport::TransferWorker::OpId id) {
  try {
    chunking_.worker->wait(id);
  } catch (...) {
    chunking_.worker->drain();
    throw;
  }
}

void Dispatcher::chunk_done(const void* y) {
  MOE_CHECK(chunking_.next < h_.chunks_, "dispatcher: chunk_done without a chunk");
  const ChunkPlan& p = chunking_.plan[chunking_.next];
  const int64_t first = h_.recv_pair_offset_[p.first_row];
  const void* results = encode_results(y, first, h_.recv_pair_offset_[p.first_row + p.num_rows] - first);
  be_.synchronize();
  post_combine_chunk(chunking_.next++, results);
}

// The accounting (docs/transport.md#accounting) of the forward's dispatch: rows for ourselves are not
// transport bytes; the naive scheme sends one row per remote (token, expert) pair.
void Dispatcher::count_bytes() {
  const int R = cfg_.num_ranks, S = cfg_.slots_per_rank, me = comm_.rank();
  host_.per_slot.resize(static_cast<size_t>(R) * S);
  be_.copy_to_host(host_.per_slot.data(), layout_.tokens_per_slot.get(), 4 * host_.per_slot.size());
  const int64_t dispatched_row =
      static_cast<int64_t>(wire_bytes_ + meta_bytes_ + cfg_.top_k * kWeightBytes + kTokenBytes);
  const int64_t naive_pair = static_cast<int64_t>(wire_bytes_ + kSlotBytes + kWeightBytes);
  const int64_t row = static_cast<int64_t>(combine_bytes_);
  for (int r = 0; r < R; ++r) {
    if (r == me) continue;
    stats_.dispatch_bytes += h_.send_counts_[r] * dispatched_row;
    stats_.dispatch_received_bytes += h_.recv_counts_[r] * dispatched_row;
    int64_t pairs = 0;
    for (int s = 0; s < S; ++s) pairs += host_.per_slot[r * S + s];
    stats_.naive_dispatch_bytes += pairs * naive_pair;
    stats_.naive_combine_bytes += pairs * row;
  }
  stats_.received_rows = h_.num_recv_rows_;
}

// The combine's bytes: a row per remote pair, `out` pairs to each peer and `in` from it.
void Dispatcher::count_return_bytes(const std::vector<size_t>& out, const std::vector<size_t>& in) {
  const int64_t row = static_cast<int64_t>(combine_bytes_);
  host_.pairs_out.assign(out.begin(), out.end());
  host_.pairs_in.assign(in.begin(), in.end());
  for (int r = 0; r < cfg_.num_ranks; ++r) {
    if (r == comm_.rank()) continue;
    stats_.combine_bytes += static_cast<int64_t>(out[r]) * row;
    stats_.combine_received_bytes += static_cast<int64_t>(in[r]) * row;
  }
}

const DispatchHandle& Dispatcher::dispatch(const void* x, int64_t T, const int32_t* topk_slot,
                                           const float* topk_weight) {
  MOE_CHECK(T >= 0 && T <= cfg_.max_tokens, "dispatch: ", T, " tokens, the layer holds at most ", cfg_.max_tokens);
  if (chunking_.worker) chunking_.worker->drain();  // a chunked pair abandoned by an error
  stats_ = {};
  h_.topk_slot_ = topk_slot;
  h_.recv_pair_offset_.clear();
  build_layout(x, T, topk_weight);
  exchange(T);
  stats_.chunks = h_.chunks_;
  count_bytes();
  return h_;
}

void Dispatcher::combine(const DispatchHandle& h, const void* y, void* out) {
  check(h);
  if (h_.chunks_ > 1) {
    MOE_CHECK(chunking_.next == h_.chunks_, "dispatcher: combine after ", chunking_.next, " of ", h_.chunks_, " chunks");
    wait_for(chunking_.last_op);
  } else {
    const void* results = encode_results(y, 0, h_.num_recv_pairs());
    be_.synchronize();
    if (opts_.isolate_transport_timing) comm_.barrier(deadline());
    const double t0 = now_seconds();
    comm_.all_to_all_v(results, segs(h_.recv_pairs_, combine_bytes_), bufs_.back_rows.get(),
                       segs(h_.send_pairs_, combine_bytes_), deadline());
    stats_.combine_transport = now_seconds() - t0;
  }
  chunking_.last_transfer = stats_.dispatch_transport + stats_.combine_transport;
  // A token's pair rows, summed in k order.
  be_.unpermute({.num_rows = h_.num_tokens_, .top_k = cfg_.top_k, .hidden = cfg_.hidden, .out_dtype = cfg_.dtype,
                 .accumulate = false, .in_dtype = combine_.dtype, .num_perm_rows = h_.send_pair_offset_.back()},
                {.perm = bufs_.back_rows.get(), .pair_pos = h_.pair_back_pos_.as<int32_t>(), .pair_weight = nullptr,
                 .out = out});
}

// Bytes of the backward pair (docs/transport.md#accounting): a grad row per
// dispatched row out; back, a row per pair and K weight gradients per row.
void Dispatcher::count_backward_bytes() {
  const int R = cfg_.num_ranks;
  const int64_t row = static_cast<int64_t>(row_bytes_), weights = static_cast<int64_t>(cfg_.top_k * kWeightBytes);
  for (int r = 0; r < R; ++r) {
    if (r == comm_.rank()) continue;
    stats_.backward_dispatch_bytes += h_.send_counts_[r] * row;
    stats_.backward_dispatch_received_bytes += h_.recv_counts_[r] * row;
    stats_.backward_combine_bytes += h_.recv_counts_[r] * weights + host_.pairs_out[r] * row;
    stats_.backward_combine_received_bytes += h_.send_counts_[r] * weights + host_.pairs_in[r] * row;
  }
}

const void* Dispatcher::combine_backward(const DispatchHandle& h, const void* grad_out) {
  check(h);
  MOE_CHECK(cfg_.train, "combine_backward on a dispatcher built without train = true");
  const int R = cfg_.num_ranks;
  count_backward_bytes();
  be_.permute({.num_rows = h_.num_tokens_, .top_k = R, .num_out_rows = h_.rank_offset_[R], .hidden = cfg_.hidden,
               .in_dtype = cfg_.dtype, .out_dtype = cfg_.dtype},
              {.rows = grad_out, .src_row = h_.send_src_token_.as<int32_t>(),
               .pair_pos = h_.token_send_row_.as<int32_t>(), .out = bufs_.send_rows.get()});
  be_.synchronize();
  if (h_.chunks_ > 1) {
    chunking_.next = 0;
    post_grad_chunk(0);
    return bufs_.grad_recv_rows.get();
  }
  const double t0 = now_seconds();
  comm_.all_to_all_v(bufs_.send_rows.get(), h_.segs_.send_rows, bufs_.grad_recv_rows.get(), h_.segs_.recv_rows, deadline());
  stats_.backward_dispatch_transport = now_seconds() - t0;
  return bufs_.grad_recv_rows.get();
}

void Dispatcher::post_grad_chunk(int c) {
  ChunkPlan& p = chunking_.plan[c];
  p.arrived = chunking_.last_op = chunking_.worker->post([this, &p] {
    const double t0 = now_seconds();
    comm_.all_to_all_v(bufs_.send_rows.get(), p.send_grad, bufs_.grad_recv_rows.get(), p.recv_grad, deadline());
    stats_.backward_dispatch_transport += now_seconds() - t0;
  });
}

// Chunk c's grad rows and weight gradients go back where its rows came from.
void Dispatcher::post_grad_result_chunk(int c, const void* grad_rows, const float* grad_pair_weight) {
  const ChunkPlan& p = chunking_.plan[c];
  chunking_.last_op = chunking_.worker->post([this, &p, grad_rows, grad_pair_weight] {
    const double t0 = now_seconds();
    comm_.all_to_all_v({AllToAllBuffer{grad_rows, &p.recv_grad_pairs, bufs_.back_rows.get(), &p.send_grad_pairs},
                        AllToAllBuffer{grad_pair_weight, &p.recv_grad_w, bufs_.back_gw.get(), &p.send_grad_w}},
                       deadline());
    stats_.backward_combine_transport += now_seconds() - t0;
  });
}

ChunkRows Dispatcher::next_backward_chunk() {
  const int c = take_chunk("next_backward_chunk");
  if (c + 1 < h_.chunks_) post_grad_chunk(c + 1);
  return {.first_row = chunking_.plan[c].first_row, .num_rows = chunking_.plan[c].num_rows};
}

void Dispatcher::backward_chunk_done(const void* grad_rows, const float* grad_pair_weight) {
  MOE_CHECK(chunking_.next < h_.chunks_, "dispatcher: backward_chunk_done without a chunk");
  be_.synchronize();
  post_grad_result_chunk(chunking_.next++, grad_rows, grad_pair_weight);
}

void Dispatcher::dispatch_backward(const DispatchHandle& h, const void* grad_rows, const float* grad_pair_weight,
                                   float* grad_x32, float* grad_topk_weight) {
  check(h);
  MOE_CHECK(cfg_.train, "dispatch_backward on a dispatcher built without train = true");
  const int K = cfg_.top_k, R = cfg_.num_ranks;
  be_.synchronize();
  if (h_.chunks_ > 1) {
    MOE_CHECK(chunking_.next == h_.chunks_, "dispatcher: dispatch_backward after ", chunking_.next, " of ", h_.chunks_,
              " chunks");
    wait_for(chunking_.last_op);
  } else {
    const double t0 = now_seconds();
    const Segments grad_meta_recv = scaled(h_.recv_counts_, K * kWeightBytes);
    const Segments grad_meta_send = scaled(h_.send_counts_, K * kWeightBytes);
    const Segments grad_recv = segs(h_.recv_pairs_, row_bytes_), grad_send = segs(h_.send_pairs_, row_bytes_);
    comm_.all_to_all_v({AllToAllBuffer{grad_rows, &grad_recv, bufs_.back_rows.get(), &grad_send},
                        AllToAllBuffer{grad_pair_weight, &grad_meta_recv, bufs_.back_gw.get(), &grad_meta_send}},
                       deadline());
    stats_.backward_combine_transport = now_seconds() - t0;
  }
  be_.unpermute({.num_rows = h_.num_tokens_, .top_k = K, .hidden = cfg_.hidden, .out_dtype = DType::kF32,
                 .accumulate = false, .in_dtype = cfg_.dtype, .num_perm_rows = h_.send_pair_offset_.back()},
                {.perm = bufs_.back_rows.get(), .pair_pos = h_.pair_back_pos_.as<int32_t>(), .pair_weight = nullptr,
                 .out = grad_x32});
  be_.combine_pair_scalars(h_.topk_slot_, h_.token_send_row_.as<int32_t>(), h_.num_tokens_, K, R,
                           cfg_.slots_per_rank, bufs_.back_gw.as<float>(), grad_topk_weight);
}

}  // namespace moe::ep
