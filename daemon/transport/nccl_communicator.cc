#include "moe/transport/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "nccl_reduce.h"

namespace moe::transport {
namespace {

// How often a wait polls NCCL's state and the stream; init polls more slowly.
constexpr auto kPollInterval = std::chrono::microseconds(100);
constexpr auto kInitPollInterval = std::chrono::milliseconds(1);
// How long the destructor lets ncclCommFinalize flush before it aborts instead.
constexpr auto kFinalizeTimeout = std::chrono::seconds(10);

// An NCCL result as text, with NCCL's own last message when it has one.
std::string nccl_error(ncclComm_t comm, ncclResult_t r) {
  std::string s = ncclGetErrorString(r);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') s += std::string(" (") + last + ")";
  return s;
}

bool nccl_ok(ncclResult_t r) { return r == ncclSuccess || r == ncclInProgress; }

int64_t ms_between(Clock::time_point from, Clock::time_point to) {
  return std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::milliseconds>(to - from).count());
}

// `base` + `offset` bytes.
void* at(void* base, size_t offset) { return static_cast<uint8_t*>(base) + offset; }
const void* at(const void* base, size_t offset) { return static_cast<const uint8_t*>(base) + offset; }

// Makes `device` current for one call and gives the caller's device back after.
// Teardown mode never throws.
class DeviceScope {
 public:
  DeviceScope(int device, const char* what, bool teardown = false) : device_(device) {
    if (cudaGetDevice(&saved_) != cudaSuccess) {
      saved_ = -1;
      cudaGetLastError();
    }
    if (saved_ == device) return;
    const cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess && !teardown)
      throw TransportError(-1, std::string(what) + ": cudaSetDevice(" + std::to_string(device) +
                                   "): " + cudaGetErrorString(e));
  }
  ~DeviceScope() {
    if (saved_ >= 0 && saved_ != device_) cudaSetDevice(saved_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int device_;
  int saved_ = -1;
};

// A stream callback that holds its stream until *release turns true: the
// kStall fault. It calls no CUDA function, as stream callbacks must not.
void CUDART_CB hold_stream(void* release) {
  const auto* flag = static_cast<const std::atomic<bool>*>(release);
  while (!flag->load(std::memory_order_acquire)) std::this_thread::sleep_for(std::chrono::microseconds(200));
}

}  // namespace

struct NcclCommunicator::Impl {
  // One blocking operation, as its errors name it.
  struct Op {
    std::string name;
    int peer = -1;  // -1: a collective (NCCL does not say which peer it waits for)
    Clock::time_point start;
    Deadline deadline;
  };

  // A background transfer: queued by isend/irecv, issued in one group with the
  // others at the next call, then an event recorded after it on `background`.
  enum class Stage { kQueued, kIssued, kRecorded, kDone };
  struct Transfer {
    bool is_send = false;
    int peer = -1;
    void* data = nullptr;
    size_t bytes = 0;
    std::shared_ptr<const void> keep;
    Stage stage = Stage::kQueued;
    cudaEvent_t done = nullptr;
  };

  int rank, size, device;

  // Guards comm and the broken state: abort() may come from another thread while
  // the rank's thread waits. Every NCCL call is made with it held.
  mutable std::mutex mu;
  ncclComm_t comm = nullptr;
  bool broken = false;
  int broken_peer = -1;
  std::string broken_reason;
  std::atomic<bool> release_stalls{false};  // set by the abort: hold_stream returns

  cudaStream_t stream = nullptr;      // collectives and blocking send/recv
  cudaStream_t background = nullptr;  // isend/irecv
  int64_t* counts_dev = nullptr;      // [2R]: exchange_counts' send, then receive half
  int64_t* counts_host = nullptr;     // [2R], pinned
  float* barrier_dev = nullptr;       // [1], stays 0
  float* workspace = nullptr;         // all_reduce_sum's [R, count], stream-ordered
  size_t workspace_bytes = 0;

  std::map<TransferId, Transfer> transfers;
  TransferId next_transfer = 1;

  std::optional<NcclFault> fault;         // injected, not yet due
  int fault_countdown = 0;                // blocking operations before it is due
  std::optional<NcclFault> active_fault;  // the fault the running operation suffers

  Impl(int rank_, int size_, int device_) : rank(rank_), size(size_), device(device_) {}
  ~Impl();

  Op make_op(std::string name, int peer, Deadline deadline) const {
    return Op{std::move(name), peer, Clock::now(), deadline};
  }

  // ---- broken state ----

  void check_usable_locked() const {
    if (broken) throw TransportError(broken_peer, "communicator was aborted: " + broken_reason);
  }
  // Locks, then throws if the communicator was aborted.
  std::unique_lock<std::mutex> enter() const {
    std::unique_lock<std::mutex> lock(mu);
    check_usable_locked();
    return lock;
  }
  void check_usable() const { (void)enter(); }

  // Aborts NCCL (its kernels stop waiting) and remembers the first reason.
  void abort_locked(int peer, const std::string& why) {
    if (broken) return;
    broken = true;
    broken_peer = peer;
    broken_reason = why;
    release_stalls.store(true, std::memory_order_release);
    if (comm != nullptr) ncclCommAbort(comm);
    comm = nullptr;
  }
  [[noreturn]] void fail_locked(int peer, const std::string& msg) {
    abort_locked(peer, msg);
    throw TransportError(peer, msg);
  }
  [[noreturn]] void fail_locked(const Op& op, const std::string& msg) { fail_locked(op.peer, op.name + ": " + msg); }

  void cuda_locked(const Op& op, cudaError_t e, const char* what) {
    if (e != cudaSuccess) fail_locked(op, std::string(what) + ": " + cudaGetErrorString(e));
  }
  void nccl_locked(const Op& op, ncclResult_t r, const char* what) {
    if (!nccl_ok(r)) fail_locked(op, std::string(what) + ": " + nccl_error(comm, r));
  }

  // ---- setup and teardown ----

  void create_resources();
  void init_comm(const std::string& unique_id, Deadline deadline);
  [[noreturn]] void init_failed(const std::string& why);
  bool background_in_flight() const;
  void finalize_or_abort_locked();

  // ---- waiting ----

  // NCCL's asynchronous state: ncclSuccess, or ncclInProgress while it still
  // connects or enqueues what the last call issued. Fails op on an error.
  ncclResult_t state_locked(const Op& op) {
    if (active_fault == NcclFault::kError)
      fail_locked(op, std::string("NCCL error: ") + ncclGetErrorString(ncclRemoteError) + " (injected fault)");
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm, &state);
    if (r != ncclSuccess) fail_locked(op, "ncclCommGetAsyncError: " + nccl_error(comm, r));
    if (!nccl_ok(state)) fail_locked(op, "NCCL error: " + nccl_error(comm, state));
    return state;
  }

  bool stream_done_locked(const Op& op, cudaStream_t s) {
    const cudaError_t e = cudaStreamQuery(s);
    if (e == cudaErrorNotReady) return false;
    cuda_locked(op, e, "CUDA stream");
    return true;
  }

  [[noreturn]] void timed_out_locked(const Op& op) {
    const std::string waited = "timed out after " + std::to_string(ms_between(op.start, Clock::now())) + " ms";
    if (op.peer >= 0) fail_locked(op, waited + " waiting for rank " + std::to_string(op.peer) + " (NCCL)");
    fail_locked(op, waited + " waiting for NCCL (peer unknown to NCCL)");
  }

  // Polls until NCCL enqueued everything issued (state ncclSuccess) and, when `s`
  // is given, `s` ran everything enqueued on it. Throws on an NCCL or CUDA error,
  // at op.deadline, or when another thread aborted the communicator.
  void wait(const Op& op, cudaStream_t s) {
    for (;;) {
      {
        const auto lock = enter();
        if (state_locked(op) == ncclSuccess && (s == nullptr || stream_done_locked(op, s))) return;
        if (Clock::now() >= op.deadline) timed_out_locked(op);
      }
      std::this_thread::sleep_for(kPollInterval);
    }
  }

  // ---- one blocking operation: begin(), post under the lock, complete() ----

  // Takes the injected fault if it is due now, then issues queued background
  // transfers ahead of the operation.
  void begin(const Op& op) {
    {
      const auto lock = enter();
      active_fault.reset();
      if (fault && fault_countdown-- == 0) {
        active_fault = fault;
        fault.reset();
      }
    }
    wait(op, nullptr);
    {
      const auto lock = enter();
      record_issued_locked(op);
      if (!issue_queued_locked(op)) return;
    }
    wait(op, nullptr);
    const auto lock = enter();
    record_issued_locked(op);
  }

  // Waits for what the operation posted on `s`. CUDA work may follow NCCL's on a
  // stream only once NCCL enqueued it, hence the first wait.
  void complete(const Op& op, cudaStream_t s) {
    wait(op, nullptr);
    {
      const auto lock = enter();
      if (active_fault == NcclFault::kStall)
        cuda_locked(op, cudaLaunchHostFunc(s, &hold_stream, &release_stalls), "cudaLaunchHostFunc");
    }
    wait(op, s);
  }

  // Runs `post` (NCCL point-to-point calls; returns the first failure) in one
  // NCCL group.
  template <typename Post>
  void group_locked(const Op& op, Post post) {
    nccl_locked(op, ncclGroupStart(), "ncclGroupStart");
    const ncclResult_t posted = post();
    const ncclResult_t ended = ncclGroupEnd();
    nccl_locked(op, nccl_ok(posted) ? ended : posted, "NCCL group");
  }

  void post_all_to_all_locked(const Op& op, const std::vector<AllToAllBuffer>& buffers);

  // ---- background transfers ----

  // Issues every queued transfer in one group on `background`; false if none.
  bool issue_queued_locked(const Op& op) {
    const bool any = std::any_of(transfers.begin(), transfers.end(),
                                 [](const auto& kv) { return kv.second.stage == Stage::kQueued; });
    if (!any) return false;
    group_locked(op, [&] {
      ncclResult_t first = ncclSuccess;
      for (auto& [id, t] : transfers) {
        if (t.stage != Stage::kQueued) continue;
        const ncclResult_t r = t.is_send ? ncclSend(t.data, t.bytes, ncclChar, t.peer, comm, background)
                                         : ncclRecv(t.data, t.bytes, ncclChar, t.peer, comm, background);
        if (first == ncclSuccess) first = r;
        t.stage = Stage::kIssued;
      }
      return first;
    });
    return true;
  }

  // Records the completion event of every issued transfer. Only once NCCL's state
  // is ncclSuccess: before, the transfer may not be on the stream yet.
  void record_issued_locked(const Op& op) {
    for (auto& [id, t] : transfers) {
      if (t.stage != Stage::kIssued) continue;
      cuda_locked(op, cudaEventCreateWithFlags(&t.done, cudaEventDisableTiming), "cudaEventCreate");
      cuda_locked(op, cudaEventRecord(t.done, background), "cudaEventRecord");
      t.stage = Stage::kRecorded;
    }
  }

  TransferId queue(bool is_send, int peer, void* data, size_t bytes, std::shared_ptr<const void> keep);
  bool test(TransferId id);
};

// ---------------------------------------------------------------------------
// Setup and teardown

void NcclCommunicator::Impl::create_resources() {
  auto check = [](cudaError_t e, const char* what) {
    if (e != cudaSuccess) throw TransportError(-1, std::string("nccl init: ") + what + ": " + cudaGetErrorString(e));
  };
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  check(cudaStreamCreateWithFlags(&background, cudaStreamNonBlocking), "cudaStreamCreate");
  check(cudaMalloc(&counts_dev, 2 * size * sizeof(int64_t)), "cudaMalloc");
  check(cudaMallocHost(&counts_host, 2 * size * sizeof(int64_t)), "cudaMallocHost");
  check(cudaMalloc(&barrier_dev, sizeof(float)), "cudaMalloc");
  check(cudaMemset(barrier_dev, 0, sizeof(float)), "cudaMemset");
}

// Non-blocking init: NCCL connects in the background while we poll its state,
// so a rank that never joins costs a deadline, not a hang.
void NcclCommunicator::Impl::init_comm(const std::string& unique_id, Deadline deadline) {
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), sizeof id.internal);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const auto start = Clock::now();
  const std::lock_guard<std::mutex> lock(mu);
  ncclResult_t state = ncclCommInitRankConfig(&comm, size, id, rank, &config);
  while (state == ncclInProgress) {
    if (Clock::now() >= deadline)
      init_failed("timed out after " + std::to_string(ms_between(start, Clock::now())) +
                  " ms waiting for the other ranks to join (NCCL: " + ncclGetErrorString(ncclInProgress) + ")");
    std::this_thread::sleep_for(kInitPollInterval);
    const ncclResult_t r = ncclCommGetAsyncError(comm, &state);
    if (r != ncclSuccess) state = r;
  }
  if (state != ncclSuccess) init_failed(nccl_error(comm, state));
}

[[noreturn]] void NcclCommunicator::Impl::init_failed(const std::string& why) {
  const std::string msg = "nccl init: rank " + std::to_string(rank) + " of " + std::to_string(size) + " on device " +
                          std::to_string(device) + ": " + why;
  if (comm != nullptr) ncclCommAbort(comm);
  comm = nullptr;
  broken = true;
  broken_reason = msg;
  throw TransportError(-1, msg);
}

// True if an issued background transfer has not finished: NCCL still waits for
// its peer, and only an abort lets go of it.
bool NcclCommunicator::Impl::background_in_flight() const {
  return std::any_of(transfers.begin(), transfers.end(), [](const auto& kv) {
    const Transfer& t = kv.second;
    return t.stage == Stage::kIssued || (t.stage == Stage::kRecorded && cudaEventQuery(t.done) != cudaSuccess);
  });
}

// A clean shutdown: ncclCommFinalize flushes, then ncclCommDestroy. Aborts
// instead when the flush fails or takes longer than kFinalizeTimeout.
void NcclCommunicator::Impl::finalize_or_abort_locked() {
  ncclResult_t state = ncclCommFinalize(comm);
  const auto until = Clock::now() + kFinalizeTimeout;
  while (state == ncclInProgress && Clock::now() < until) {
    std::this_thread::sleep_for(kInitPollInterval);
    if (ncclCommGetAsyncError(comm, &state) != ncclSuccess) state = ncclInternalError;
  }
  if (state == ncclSuccess) ncclCommDestroy(comm);
  else ncclCommAbort(comm);
  comm = nullptr;
}

NcclCommunicator::Impl::~Impl() {
  const DeviceScope scope(device, "nccl teardown", /*teardown=*/true);
  release_stalls.store(true, std::memory_order_release);
  {
    const std::lock_guard<std::mutex> lock(mu);
    if (comm != nullptr && (broken || background_in_flight())) ncclCommAbort(comm);
    else if (comm != nullptr) finalize_or_abort_locked();
    comm = nullptr;
  }
  // NCCL's kernels have ended (finished or aborted): drain our streams, then free.
  if (workspace != nullptr) cudaFreeAsync(workspace, stream);
  if (stream != nullptr) cudaStreamSynchronize(stream);
  if (background != nullptr) cudaStreamSynchronize(background);
  for (auto& [id, t] : transfers)
    if (t.done != nullptr) cudaEventDestroy(t.done);
  transfers.clear();  // releases the buffers' owners
  if (counts_dev != nullptr) cudaFree(counts_dev);
  if (counts_host != nullptr) cudaFreeHost(counts_host);
  if (barrier_dev != nullptr) cudaFree(barrier_dev);
  if (stream != nullptr) cudaStreamDestroy(stream);
  if (background != nullptr) cudaStreamDestroy(background);
}

std::string NcclCommunicator::make_unique_id() {
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) throw TransportError(-1, std::string("nccl: ncclGetUniqueId: ") + nccl_error(nullptr, r));
  return std::string(id.internal, sizeof id.internal);
}

NcclCommunicator::NcclCommunicator(int rank, int size, int device, const std::string& unique_id,
                                   Deadline init_deadline)
    : rank_(rank), size_(size), device_(device), impl_(std::make_unique<Impl>(rank, size, device)) {
  MOE_CHECK(size >= 1 && rank >= 0 && rank < size, "nccl: bad rank ", rank, " of ", size);
  MOE_CHECK(device >= 0, "nccl: bad CUDA device ", device);
  MOE_CHECK(unique_id.size() == sizeof(ncclUniqueId), "nccl: the unique id has ", unique_id.size(),
            " bytes, expected ", sizeof(ncclUniqueId));
  const DeviceScope scope(device, "nccl init");
  impl_->create_resources();
  impl_->init_comm(unique_id, init_deadline);
}

NcclCommunicator::~NcclCommunicator() = default;  // Impl::~Impl tears down

// ---------------------------------------------------------------------------
// Collectives

// Self segments are copies on `stream` (before the group: nothing may follow
// NCCL's work on a stream until NCCL enqueued it); the rest is one group with a
// send and a receive per peer and non-empty segment. Several buffers to one peer
// stay in buffer order on both sides (NCCL keeps a group's calls to one peer in
// order), so they match.
void NcclCommunicator::Impl::post_all_to_all_locked(const Op& op, const std::vector<AllToAllBuffer>& buffers) {
  for (const AllToAllBuffer& b : buffers)
    if (const size_t n = b.send_segs->bytes[rank])
      cuda_locked(op,
                  cudaMemcpyAsync(at(b.recv, b.recv_segs->offset[rank]), at(b.send, b.send_segs->offset[rank]), n,
                                  cudaMemcpyDefault, stream),
                  "self-segment copy");
  group_locked(op, [&] {
    ncclResult_t first = ncclSuccess;
    for (int r = 0; r < size; ++r) {
      if (r == rank) continue;
      for (const AllToAllBuffer& b : buffers) {
        const size_t out = b.send_segs->bytes[r], in = b.recv_segs->bytes[r];
        ncclResult_t s = ncclSuccess, q = ncclSuccess;
        if (out != 0) s = ncclSend(at(b.send, b.send_segs->offset[r]), out, ncclChar, r, comm, stream);
        if (in != 0) q = ncclRecv(at(b.recv, b.recv_segs->offset[r]), in, ncclChar, r, comm, stream);
        if (first == ncclSuccess) first = s != ncclSuccess ? s : q;
      }
    }
    return first;
  });
}

void NcclCommunicator::all_to_all_v(const std::vector<AllToAllBuffer>& buffers, Deadline deadline) {
  for (const AllToAllBuffer& b : buffers) {
    check_segments(b, size_);
    MOE_CHECK(b.send_segs->bytes[rank_] == b.recv_segs->bytes[rank_], "all_to_all_v: self segment sizes differ (",
              b.send_segs->bytes[rank_], " vs ", b.recv_segs->bytes[rank_], ")");
  }
  Impl& m = *impl_;
  const DeviceScope scope(device_, "all_to_all_v");
  const Impl::Op op = m.make_op("all_to_all_v", -1, deadline);
  m.begin(op);
  {
    const auto lock = m.enter();
    m.post_all_to_all_locked(op, buffers);
  }
  m.complete(op, m.stream);
}

// Host counts go through pinned memory and the device buffer: copy in, an
// all-to-all of 8 bytes per peer, copy out, all on `stream`.
void NcclCommunicator::exchange_counts(const int64_t* send, int64_t* recv, Deadline deadline) {
  Impl& m = *impl_;
  const DeviceScope scope(device_, "exchange_counts");
  const Impl::Op op = m.make_op("exchange_counts", -1, deadline);
  m.begin(op);
  const size_t R = static_cast<size_t>(size_), bytes = R * sizeof(int64_t);
  const Segments segs = Segments::packed(std::vector<size_t>(R, sizeof(int64_t)));
  {
    const auto lock = m.enter();
    std::memcpy(m.counts_host, send, bytes);
    m.cuda_locked(op, cudaMemcpyAsync(m.counts_dev, m.counts_host, bytes, cudaMemcpyHostToDevice, m.stream), "copy in");
    m.post_all_to_all_locked(op, {AllToAllBuffer{m.counts_dev, &segs, m.counts_dev + R, &segs}});
  }
  m.wait(op, nullptr);  // NCCL enqueued the exchange: the copy out may follow it
  {
    const auto lock = m.enter();
    m.cuda_locked(op, cudaMemcpyAsync(m.counts_host + R, m.counts_dev + R, bytes, cudaMemcpyDeviceToHost, m.stream),
                  "copy out");
  }
  m.complete(op, m.stream);
  std::memcpy(recv, m.counts_host + R, bytes);
}

void NcclCommunicator::all_reduce_sum(float* data, size_t count, Deadline deadline) {
  Impl& m = *impl_;
  if (size_ == 1 || count == 0) {  // the sum of one rank is its data
    m.check_usable();
    return;
  }
  MOE_CHECK(count <= SIZE_MAX / sizeof(float) / static_cast<size_t>(size_), "all_reduce: ", count,
            " floats is too many");
  const DeviceScope scope(device_, "all_reduce");
  const Impl::Op op = m.make_op("all_reduce", -1, deadline);
  m.begin(op);
  const size_t bytes = static_cast<size_t>(size_) * count * sizeof(float);
  {
    const auto lock = m.enter();
    if (m.workspace_bytes < bytes) {  // stream-ordered: no device-wide sync behind a background transfer
      if (m.workspace != nullptr) m.cuda_locked(op, cudaFreeAsync(m.workspace, m.stream), "cudaFreeAsync");
      m.workspace = nullptr;
      m.workspace_bytes = 0;
      m.cuda_locked(op, cudaMallocAsync(reinterpret_cast<void**>(&m.workspace), bytes, m.stream), "cudaMallocAsync");
      m.workspace_bytes = bytes;
    }
    m.nccl_locked(op, ncclAllGather(data, m.workspace, count, ncclFloat, m.comm, m.stream), "ncclAllGather");
  }
  m.wait(op, nullptr);  // NCCL enqueued the gather: the sum may follow it
  {
    const auto lock = m.enter();
    m.cuda_locked(op, detail::launch_sum_ranks(m.workspace, size_, count, data, m.stream), "sum kernel");
  }
  m.complete(op, m.stream);
}

// A one-float all-reduce of zeros: completes once every rank reached it.
void NcclCommunicator::barrier(Deadline deadline) {
  Impl& m = *impl_;
  const DeviceScope scope(device_, "barrier");
  const Impl::Op op = m.make_op("barrier", -1, deadline);
  m.begin(op);
  {
    const auto lock = m.enter();
    m.nccl_locked(op, ncclAllReduce(m.barrier_dev, m.barrier_dev, 1, ncclFloat, ncclSum, m.comm, m.stream),
                  "ncclAllReduce");
  }
  m.complete(op, m.stream);
}

// ---------------------------------------------------------------------------
// Point-to-point

void NcclCommunicator::send(int peer, const void* data, size_t bytes, uint32_t, Deadline deadline) {
  MOE_CHECK(peer >= 0 && peer < size_ && peer != rank_, "send: peer ", peer, " out of range or self");
  Impl& m = *impl_;
  if (bytes == 0) {
    m.check_usable();
    return;
  }
  const DeviceScope scope(device_, "send");
  const Impl::Op op = m.make_op("send", peer, deadline);
  m.begin(op);
  {
    const auto lock = m.enter();
    m.group_locked(op, [&] { return ncclSend(data, bytes, ncclChar, peer, m.comm, m.stream); });
  }
  m.complete(op, m.stream);
}

void NcclCommunicator::recv(int peer, void* data, size_t bytes, uint32_t, Deadline deadline) {
  MOE_CHECK(peer >= 0 && peer < size_ && peer != rank_, "recv: peer ", peer, " out of range or self");
  Impl& m = *impl_;
  if (bytes == 0) {
    m.check_usable();
    return;
  }
  const DeviceScope scope(device_, "recv");
  const Impl::Op op = m.make_op("recv", peer, deadline);
  m.begin(op);
  {
    const auto lock = m.enter();
    m.group_locked(op, [&] { return ncclRecv(data, bytes, ncclChar, peer, m.comm, m.stream); });
  }
  m.complete(op, m.stream);
}

// ---------------------------------------------------------------------------
// Background transfers

Communicator::TransferId NcclCommunicator::Impl::queue(bool is_send, int peer, void* data, size_t bytes,
                                                       std::shared_ptr<const void> keep) {
  const auto lock = enter();
  const TransferId id = next_transfer++;
  Transfer& t = transfers[id];
  t.is_send = is_send;
  t.peer = peer;
  t.data = data;
  t.bytes = bytes;
  t.keep = std::move(keep);
  t.stage = bytes == 0 ? Stage::kDone : Stage::kQueued;
  return id;
}

// Issues what is queued (when NCCL is ready for another call), records events of
// what NCCL enqueued, and reports whether `id`'s event has passed.
bool NcclCommunicator::Impl::test(TransferId id) {
  const auto lock = enter();
  const auto it = transfers.find(id);
  MOE_CHECK(it != transfers.end(), "test: no transfer ", id);
  Transfer& t = it->second;
  const Op op{t.is_send ? "isend" : "irecv", t.peer, Clock::now(), Deadline::max()};
  if (t.stage != Stage::kDone) {
    if (state_locked(op) == ncclInProgress) return false;
    record_issued_locked(op);
    if (issue_queued_locked(op) && state_locked(op) == ncclSuccess) record_issued_locked(op);
    if (t.stage != Stage::kRecorded) return false;
    const cudaError_t e = cudaEventQuery(t.done);
    if (e == cudaErrorNotReady) return false;
    cuda_locked(op, e, "cudaEventQuery");
    cudaEventDestroy(t.done);
  }
  transfers.erase(it);
  return true;
}

Communicator::TransferId NcclCommunicator::isend(int peer, const void* data, size_t bytes, uint32_t,
                                                 std::shared_ptr<const void> keep) {
  MOE_CHECK(peer >= 0 && peer < size_, "isend: peer ", peer, " out of range");
  return impl_->queue(true, peer, const_cast<void*>(data), bytes, std::move(keep));
}

Communicator::TransferId NcclCommunicator::irecv(int peer, void* data, size_t bytes, uint32_t,
                                                 std::shared_ptr<const void> keep) {
  MOE_CHECK(peer >= 0 && peer < size_, "irecv: peer ", peer, " out of range");
  return impl_->queue(false, peer, data, bytes, std::move(keep));
}

bool NcclCommunicator::test(TransferId id) {
  const DeviceScope scope(device_, "test");
  return impl_->test(id);
}

// ---------------------------------------------------------------------------
// Abort and fault injection

void NcclCommunicator::abort(const std::string& why) {
  const DeviceScope scope(device_, "abort", /*teardown=*/true);
  const std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->abort_locked(-1, why);
}

bool NcclCommunicator::aborted() const {
  const std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->broken;
}

void NcclCommunicator::inject_fault(NcclFault fault, int after_calls) {
  MOE_CHECK(after_calls >= 0, "inject_fault: after_calls must be >= 0, got ", after_calls);
  const std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->fault = fault;
  impl_->fault_countdown = after_calls;
}

}  // namespace moe::transport
