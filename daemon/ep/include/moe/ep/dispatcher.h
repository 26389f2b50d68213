// Dispatch and combine (docs/layer.md#dispatch-and-combine) across the ranks of a
// Communicator: a paired operation with a handle, as DeepEP's dispatch/combine
// and Megatron's token dispatcher are.
//
//   dispatch(x, topk_slot, topk_weight) -> handle: the rows this rank received,
//       each with its local expert slots and routing weights. A token goes to a
//       rank ONCE however many of its experts live there; the receiver fans it out.
//   combine(handle, y, out): each received row's results go back to its source
//       as one row per pair (its local slots in k order), and the source sums a
//       token's K rows in k order, wherever its experts live.
// Backward reuses the forward's handle (docs/layer.md#backward): combine^T = dispatch, so
//   combine_backward(handle, grad_out) sends grad_out rows where x rows went;
//   dispatch_backward(handle, grad_rows, grad_pair_weight) brings the grad rows
//       and per-pair routing-weight gradients back like a combine.
//
// Wire formats (docs/layer.md#wire-formats): the forward pair's rows may travel
// narrower than the layer computes (dispatch: bf16, or fp8 with a scale per 128
// values; combine: bf16); every row is encoded, the rank's own included, so the
// result does not depend on where an expert lives. The backward pair moves rows
// in the layer dtype.
//
// Wire sizes (docs/transport.md#accounting: bytes for OTHER ranks only):
//   a dispatched row  = wire row bytes + K x (int32 slot + fp32 weight) + an int32
//                       source token
//   a combined row    = combine wire row bytes, one per (token, expert) pair
//   a backward row    = row_bytes out; back, row_bytes a pair + K fp32 weight
//                       gradients a row
//   the naive scheme  = one row + one slot + one weight per (token, expert) pair
//
// Overlap (docs/layer.md#overlap): with more than one rank the dispatcher may split
// both pairs into chunks of rows, moved by a TransferWorker while the caller computes:
//
//   h = dispatch(...)                      // chunks() > 1: every row's slots and
//                                          // weights, and chunk 0's rows, on their way
//   for c in 0..chunks()-1:
//     ch = next_chunk()                    // chunk c has arrived; c + 1 goes out
//     compute rows [ch.first_row, + ch.num_rows) of y
//     chunk_done(y)                        // chunk c's results go back
//   combine(h, y, out)                     // waits for every result; same bits
//
//   g = combine_backward(h, grad_out)      // chunk 0's grad rows on their way
//   for c in 0..chunks()-1:
//     ch = next_backward_chunk()           // chunk c's grad rows are in g
//     compute rows ch of grad_rows, grad_pair_weight
//     backward_chunk_done(grad_rows, grad_pair_weight)
//   dispatch_backward(h, grad_rows, grad_pair_weight, ...)  // waits; same bits
//
// The ranks agree on the chunk count at every dispatch (the largest any rank
// proposes); the backward uses the forward's. A row is computed the same way in
// any chunk, and a token's pair rows are summed in k order after all of them are
// back, so the outputs depend on neither the chunking nor the placement. Sums over
// rows (weight gradients) take them in h.source_key()'s order, which neither
// changes (h.row_order() lays the pairs out for the chunks).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "moe/layer_spec/layer_config.h"
#include "moe/map/expert_map.h"
#include "moe/kernels/api.h"
#include "moe/kernels/buffer.h"
#include "moe/transport/communicator.h"
#include "moe/transport/transfer_worker.h"

namespace moe::ep {

using kernels::DType;

struct DispatcherOptions {
  std::chrono::milliseconds timeout{30000};  // deadline of every transport wait
  // Benchmarks: a barrier before each timed all-to-all, so transport times do not
  // include waiting for a slower rank's compute. Off in production.
  bool isolate_transport_timing = false;
  // Chunks of both pairs: 0 chooses by chunk_rule from the last step, n >= 1 asks
  // for n (1: serial).
  int overlap_chunks = 0;
};

// The chunk count this rank proposes (docs/layer.md#overlap): 1 (serial) before
// anything was measured or while the shorter of transfer and compute is under a
// fifth of the longer; else enough chunks that the part left unhidden, about
// min(transfer, compute) / chunks, stays under a tenth of the longer; at most
// kMaxChunks, and no fewer than kMinExpertRows rows per local expert in a chunk
// (fewer, and the GEMMs read an expert's weights for too few rows).
constexpr int kMaxChunks = 8;
constexpr double kMinExpertRows = 128;
int chunk_rule(double transfer_seconds, double compute_seconds, double rows_per_expert);

struct DispatcherConfig {
  int hidden = 0;
  int top_k = 0;
  DType dtype = DType::kF32;
  int64_t max_tokens = 0;  // per rank
  int num_ranks = 0;
  int slots_per_rank = 0;
  bool train = false;  // keep what the backward pair needs
  // The wire formats (kernels::resolve_wire's rules): nullopt the layer's own;
  // never wider than dtype; the combine's plain (fp32 or bf16).
  kernels::WireChoice dispatch_wire, combine_wire;
};

// Bytes and seconds of the last dispatch/combine pair (forward) and of its
// backward pair. Bytes count what this rank hands to (sent) or takes from
// (received) the transport for other ranks.
struct DispatchStats {
  int64_t received_rows = 0;  // N: rows this rank received, its own included
  int64_t dispatch_bytes = 0, dispatch_received_bytes = 0;
  int64_t combine_bytes = 0, combine_received_bytes = 0;
  int64_t naive_dispatch_bytes = 0, naive_combine_bytes = 0;
  double dispatch_transport = 0, combine_transport = 0;  // the all-to-alls alone
  int64_t backward_dispatch_bytes = 0, backward_dispatch_received_bytes = 0;
  int64_t backward_combine_bytes = 0, backward_combine_received_bytes = 0;
  double backward_dispatch_transport = 0, backward_combine_transport = 0;
  int chunks = 1;  // of the forward pair
};

// One chunk of a chunked dispatch: rows [first_row, first_row + num_rows) of the
// handle's received rows (and their slots and weights).
struct ChunkRows {
  int64_t first_row = 0, num_rows = 0;
};

class Dispatcher;

// Rows [first[r], first[r] + count[r]) of a buffer, per peer r.
struct PairRanges {
  std::vector<size_t> first, count;
};

// What dispatch leaves for combine and the backward pair. Owned by its
// Dispatcher and valid until the next dispatch.
class DispatchHandle {
 public:
  int64_t num_tokens() const { return num_tokens_; }
  int64_t num_recv_rows() const { return num_recv_rows_; }
  const void* recv_rows() const { return recv_rows_.get(); }                 // [N, H] dtype
  const int32_t* recv_slot() const { return recv_slot_.as<int32_t>(); }     // [N, K] local slot or -1
  const float* recv_weight() const { return recv_weight_.as<float>(); }     // [N, K]
  // A train dispatcher that can chunk: the received rows in an order every chunk
  // count cuts into runs, chunk c being the c-th run ([N], docs/layer.md#overlap);
  // null otherwise.
  const int32_t* row_order() const { return row_order_.as<int32_t>(); }  // allocated only then
  // The results' layout (docs/layer.md#dispatch-and-combine): received row n's
  // results are rows [recv_pair_offset()[n], recv_pair_offset()[n + 1]) of y, one
  // per local slot of the row in k order. Host, [N + 1]; set once the rows' slots
  // are in (after dispatch, or a chunked dispatch's first next_chunk).
  const int64_t* recv_pair_offset() const { return recv_pair_offset_.data(); }
  // Each received row's source: (its rank << 32) | its token index there. The
  // same on any rank for a token, and sorted it is source order (peer by peer,
  // each peer's rows as it sent them), which no chunking or placement changes.
  // Host, [N]; set with recv_pair_offset in a train dispatcher (empty otherwise).
  const int64_t* source_key() const { return source_key_.empty() ? nullptr : source_key_.data(); }
  int64_t num_recv_pairs() const { return recv_pair_offset_.empty() ? 0 : recv_pair_offset_.back(); }

 private:
  friend class Dispatcher;
  int64_t num_tokens_ = 0, num_recv_rows_ = 0, recv_capacity_ = -1;
  int chunks_ = 1;
  const int32_t* topk_slot_ = nullptr;             // [T, K], the caller's
  std::vector<int64_t> send_counts_, recv_counts_;  // rows per peer
  std::vector<int64_t> rank_offset_;                // [R + 1] host
  struct Segments {  // a serial pass's segments per peer, each way
    transport::Segments send_rows, recv_rows, send_meta, recv_meta;  // rows: layer dtype
    transport::Segments send_token, recv_token;                      // a row's source token: 4 bytes
    transport::Segments send_wire, recv_wire;                        // the forward's dispatch wire
  } segs_;
  // Serial: the pair rows coming back (results, input gradients) per peer, of its
  // received rows (recv) and of this rank's send rows (send).
  PairRanges recv_pairs_, send_pairs_;
  std::vector<int64_t> recv_pair_offset_, send_pair_offset_;  // host, [N + 1], [send rows + 1]
  std::vector<int64_t> source_key_;                          // host, [N]
  kernels::Buffer token_send_row_, send_src_token_;  // the layout, [T, R] and [rows]
  kernels::Buffer pair_back_pos_;  // [T, K]: pair (t, k)'s row among the returned pair rows, or -1
  kernels::Buffer recv_rows_, recv_slot_, recv_weight_, recv_token_, row_order_;
};

class Dispatcher {
 public:
  Dispatcher(const DispatcherConfig& cfg, transport::Communicator& comm, kernels::Backend& be,
             const DispatcherOptions& options = {});

  // x [T, H] dtype; topk_slot [T, K] physical slots or -1 (select_replicas);
  // topk_weight [T, K]. topk_slot must stay valid until dispatch_backward.
  const DispatchHandle& dispatch(const void* x, int64_t T, const int32_t* topk_slot, const float* topk_weight);
  // The agreed chunk count of the last dispatch (1: everything arrived already).
  int chunks() const { return h_.chunks_; }
  // Chunked: waits for the next chunk's rows and sends the one after it.
  ChunkRows next_chunk();
  // Chunked: the pairs of the chunk next_chunk() gave are computed in y [P, H]; sends them back.
  void chunk_done(const void* y);
  // y [P, H] dtype, a row per received pair (h.recv_pair_offset()) -> out [T, H]
  // dtype. Chunked: waits for every chunk's results (y was sent by chunk_done).
  void combine(const DispatchHandle& h, const void* y, void* out);
  // The forward's expert seconds and (token, expert) pairs per local expert of
  // the step, for the next chunk proposal.
  void note_compute(double seconds, double rows_per_expert) {
    chunking_.last_compute = seconds;
    chunking_.last_rows_per_expert = rows_per_expert;
  }
  // grad_out [T, H] dtype -> the grad rows [N, H] dtype each receiver gets.
  // Chunked: they arrive chunk by chunk (next_backward_chunk).
  const void* combine_backward(const DispatchHandle& h, const void* grad_out);
  // Chunked: waits for the next chunk's grad rows and sends the one after it.
  ChunkRows next_backward_chunk();
  // Chunked: that chunk's pairs of grad_rows [P, H] and rows of grad_pair_weight
  // [N, K] are computed; sends them back.
  void backward_chunk_done(const void* grad_rows, const float* grad_pair_weight);
  // grad_rows [P, H] dtype (a row per received pair), grad_pair_weight [N, K] ->
  // grad_x32 [T, H] (=, k order) and grad_topk_weight [T, K] at the source. Chunked: waits for every
  // chunk (sent by backward_chunk_done).
  void dispatch_backward(const DispatchHandle& h, const void* grad_rows, const float* grad_pair_weight,
                         float* grad_x32, float* grad_topk_weight);

  const DispatchStats& stats() const { return stats_; }

 private:
  transport::Deadline deadline() const { return transport::deadline_in(opts_.timeout); }
  bool encoded_dispatch() const { return dispatch_.format != kernels::wire_of(cfg_.dtype); }
  bool encoded_combine() const { return combine_.format != kernels::wire_of(cfg_.dtype); }
  // The dispatch wire's rows: sent from, received into.
  const void* wire_send() const { return encoded_dispatch() ? bufs_.send_wire.get() : bufs_.send_rows.get(); }
  void* wire_recv() { return encoded_dispatch() ? bufs_.recv_wire.get() : h_.recv_rows_.get(); }
  void build_layout(const void* x, int64_t T, const float* topk_weight);
  void exchange(int64_t T);
  void exchange_counts_and_chunks();
  void check_received_counts(const std::vector<int64_t>& proposed_chunks) const;
  int propose_chunks();
  bool can_chunk() const;
  void plan_chunks();
  void build_row_order();
  void lay_out_returns();
  void count_received_pairs();
  void place_returned_pairs();
  void plan_returns();
  void key_sources(const std::vector<PairRanges>& arrived);
  void post_dispatch_chunk(int c);
  void post_combine_chunk(int c, const void* y);
  void post_grad_chunk(int c);
  void post_grad_result_chunk(int c, const void* grad_rows, const float* grad_pair_weight);
  int take_chunk(const char* what);
  void wait_for(transport::TransferWorker::OpId id);
  void encode_send_rows(const void* x, int64_t T);
  void decode_rows(int64_t first, int64_t n);
  const void* encode_results(const void* y, int64_t first_pair, int64_t pairs);
  void count_bytes();
  void count_return_bytes(const std::vector<size_t>& out, const std::vector<size_t>& in);
  void count_backward_bytes();
  void reserve(int64_t rows);
  void check(const DispatchHandle& h) const;

  DispatcherConfig cfg_;
  transport::Communicator& comm_;
  kernels::Backend& be_;
  DispatcherOptions opts_;
  const size_t row_bytes_, meta_bytes_;
  // The wires, resolved (rows of kernels::kWireFormats), and the bytes of a row on each.
  const kernels::WireFormatInfo &dispatch_, &combine_;
  size_t wire_bytes_, combine_bytes_;
  DispatchHandle h_;
  struct LayoutBuffers {  // the layout kernel's counts and workspace
    kernels::Buffer tokens_per_rank, tokens_per_slot, in_rank, ws;
  } layout_;
  struct RowBuffers {  // rows and their metadata on the backend
    kernels::Buffer send_slot, send_weight, send_rows, back_rows, back_gw, grad_recv_rows;
    // Encoded rows when a wire is narrower than the layer (else empty): what is
    // sent and received, and the results before they go back.
    kernels::Buffer send_wire, recv_wire, y_wire;
    kernels::Buffer proposals;  // [3 R] floats: propose_chunks' all-reduce
  } bufs_;
  struct HostCopies {
    std::vector<int32_t> per_slot;  // pairs per physical slot, for the naive figures
    std::vector<int32_t> slots, send_row, back_pos, token;  // lay_out_returns' copies
    std::vector<int64_t> pairs_out, pairs_in;  // pair rows back per peer: this rank's results, and ours from it
  } host_;
  DispatchStats stats_;
  // Chunked pairs: per chunk, the segments of rows and of metadata each way.
  struct ChunkPlan {
    transport::Segments send_rows, recv_rows, send_meta, recv_meta;  // rows: dispatch wire bytes
    transport::Segments send_token, recv_token;                      // 4 bytes a row
    transport::Segments send_grad, recv_grad;                       // backward rows: row_bytes_
    transport::Segments send_grad_w, recv_grad_w;                   // K weight gradients a row, back
    PairRanges send_row_ranges, recv_row_ranges;                    // the chunk's rows, per peer
    // Pair rows back (plan_returns): results in combine wire bytes, input gradients in row_bytes_.
    transport::Segments send_results, recv_results, send_grad_pairs, recv_grad_pairs;
    int64_t first_row = 0, num_rows = 0;  // of the received rows (chunk-major)
    transport::TransferWorker::OpId arrived = 0;  // the op bringing its rows (forward or backward)
  };
  struct Chunking {  // docs/layer.md#overlap
    std::vector<ChunkPlan> plan;
    int next = 0;
    transport::TransferWorker::OpId last_op = 0;
    std::unique_ptr<transport::TransferWorker> worker;  // made at the first chunked dispatch
    double last_compute = 0, last_transfer = 0, last_rows_per_expert = 0;  // for the next step's proposal
  } chunking_;
};

}  // namespace moe::ep
