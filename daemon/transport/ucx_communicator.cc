#include "moe/transport/ucx_communicator.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/sha.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <array>
#include <cstring>
#include <deque>
#include <map>
#include <optional>

#include "moe/base/log.h"
#include "op_book.h"
#include "p2p_collectives.h"
#include "tags.h"

namespace moe::transport {
namespace {

using Kind = TagKind;  // tags.h: kind | sequence | source rank

constexpr uint64_t kFullMask = ~uint64_t{0};
constexpr uint64_t kKindMask = uint64_t{0xff} << 56;
constexpr auto kDrainTimeout = std::chrono::seconds(2);
// A failing rank tells its remote peers whom it blames before it closes its
// endpoints (an abort notice), so a peer that sees that rank's connection drop
// blames the real culprit. How long the failing rank waits for its notices to
// leave, and how long a peer whose endpoint failed waits for a notice to arrive:
constexpr auto kNoticeSendTimeout = std::chrono::milliseconds(200);
constexpr auto kNoticeGrace = std::chrono::milliseconds(100);

std::string status_str(ucs_status_t s) { return ucs_status_string(s); }

// What rank `from` shows rank `to` at wire-up (docs/transport.md#job-key):
// HMAC-SHA256 under the job's key of the pair, so a proof is good for one
// direction of one pair of one job only.
using Proof = std::array<uint8_t, SHA256_DIGEST_LENGTH>;
Proof key_proof(const std::string& key, int from, int to) {
  const std::string what = "moed data plane v1 " + std::to_string(from) + "->" + std::to_string(to);
  Proof p{};
  unsigned int n = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), reinterpret_cast<const unsigned char*>(what.data()),
       what.size(), p.data(), &n);
  return p;
}

}  // namespace

namespace {
// One posted request. Kept in a deque (stable addresses): a receive's completion
// callback writes into its Op.
struct UcxOp {
  void* req = nullptr;
  int peer = -1;
  bool is_recv = false;
  size_t bytes = 0;
  bool done = false;
  ucs_status_t status = UCS_OK;
  ucp_tag_recv_info_t info{};
  bool recv_completed = false;  // set by on_recv
  ucs_status_t recv_status = UCS_OK;
  bool local = false;
  LocalHub::Completion local_done;  // completion of a hub op
  std::shared_ptr<const void> keep;  // a background transfer's buffer owner
};
}  // namespace

struct UcxCommunicator::Impl : detail::OpBook<UcxCommunicator::Impl, UcxOp> {
  using Op = UcxOp;
  struct Peer {
    bool local = false;  // through the hub, not UCX
    ucp_ep_h ep = nullptr;
    bool failed = false;
    std::string error;
  };

  int rank, size;
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  int event_fd = -1;  // the worker's, owned by UCX
  int wake_fd = -1;   // ours: the hub signals completions of local ops here, abort() a failed group
  int epoll_fd = -1;
  std::shared_ptr<LocalHub> hub;
  std::vector<Peer> peers;
  // Ops abandoned after a failure whose requests UCX still holds; kept alive so a
  // late callback writes into valid memory.
  std::vector<std::deque<Op>> abandoned;
  // The posted receive of abort notices from any peer (re-posted after each), and
  // the culprit each peer named (-1: no notice).
  struct NoticeRecv {
    void* req = nullptr;
    int32_t culprit = -1;
    bool completed = false;
    ucs_status_t status = UCS_OK;
    ucp_tag_recv_info_t info{};
  } notice;
  std::vector<int> blamed_by;
  int32_t notice_payload = -1;

  static void on_notice(void*, ucs_status_t status, const ucp_tag_recv_info_t* info, void* user) {
    auto* n = static_cast<NoticeRecv*>(user);
    n->status = status;
    if (info) n->info = *info;
    n->completed = true;
  }

  void post_notice_recv() {
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    p.cb.recv = &Impl::on_notice;
    p.user_data = &notice;
    notice.completed = false;
    const ucs_status_ptr_t r =
        ucp_tag_recv_nbx(worker, &notice.culprit, sizeof notice.culprit, make_tag(Kind::kAbort, 0, 0), kKindMask, &p);
    notice.req = UCS_PTR_IS_PTR(r) ? r : nullptr;
  }

  // Takes in a notice that arrived; true if one did.
  bool take_notice() {
    if (!notice.req || !notice.completed) return false;
    ucp_request_free(notice.req);
    notice.req = nullptr;
    const int from = static_cast<int>(notice.info.sender_tag & 0xffff);
    if (notice.status == UCS_OK && from >= 0 && from < size && notice.culprit >= 0 && notice.culprit < size)
      blamed_by[from] = notice.culprit;
    if (notice.status != UCS_ERR_CANCELED) post_notice_recv();
    return true;
  }

  // Sends the notice "I stop because of `culprit`" to every remote peer whose
  // endpoint still works, and waits a bounded time for the sends to leave.
  void send_notices(int culprit) {
    notice_payload = culprit;  // a member: a send still pending reads it until its endpoint closes
    std::vector<void*> sending;
    for (int r = 0; r < size; ++r) {
      if (r == rank || peers[r].local || !peers[r].ep || peers[r].failed || r == culprit) continue;
      ucp_request_param_t p{};
      const ucs_status_ptr_t req = ucp_tag_send_nbx(peers[r].ep, &notice_payload, sizeof notice_payload, make_tag(Kind::kAbort, 0, rank), &p);
      if (UCS_PTR_IS_PTR(req)) sending.push_back(req);
    }
    const auto until = Clock::now() + kNoticeSendTimeout;
    while (!sending.empty() && Clock::now() < until) {
      ucp_worker_progress(worker);
      std::erase_if(sending, [](void* req) {
        if (ucp_request_check_status(req) == UCS_INPROGRESS) return false;
        ucp_request_free(req);
        return true;
      });
    }
    for (void* req : sending) ucp_request_free(req);  // UCX completes it when the endpoint closes
  }

  // A remote peer's endpoint failed: give its abort notice, sent before it closed,
  // a moment to arrive, so we blame whom it blamed.
  int culprit_behind(int peer) {
    const auto until = Clock::now() + kNoticeGrace;
    while (blamed_by[peer] < 0 && Clock::now() < until) {
      ucp_worker_progress(worker);
      take_notice();
    }
    return blamed_by[peer] >= 0 ? blamed_by[peer] : peer;
  }

  static void on_recv(void*, ucs_status_t status, const ucp_tag_recv_info_t* info, void* user) {
    auto* op = static_cast<Op*>(user);
    op->recv_status = status;
    if (info) op->info = *info;
    op->recv_completed = true;
  }

  static void on_ep_error(void* arg, ucp_ep_h, ucs_status_t status) {
    auto* p = static_cast<Peer*>(arg);
    p->failed = true;
    p->error = status_str(status);
  }

  void check_usable() const {
    if (broken) throw_broken();
    if (aborted.load()) throw TransportError(-1, "aborted: " + aborted_why());
  }

  // Why a peer failed, and whom to blame: the peer, or (for a local sibling that
  // stopped because of another rank) that rank.
  std::optional<LocalHub::Failure> peer_failure(int peer) {
    take_notice();
    if (peers[peer].local) return hub->failure_of(peer);
    if (blamed_by[peer] >= 0)
      return LocalHub::Failure{"it stopped because rank " + std::to_string(blamed_by[peer]) + " failed", blamed_by[peer]};
    if (peers[peer].failed) return LocalHub::Failure{peers[peer].error, culprit_behind(peer)};
    return std::nullopt;
  }

  [[noreturn]] void fail_peer(int peer, const char* what, const LocalHub::Failure& why) {
    fail(why.culprit, std::string(what) + ": rank " + std::to_string(peer) + " failed (" + why.reason + ")");
  }

  void check_peer(int peer, const char* what) {
    MOE_CHECK(peer >= 0 && peer < size && peer != rank, what, ": peer ", peer, " out of range or self");
    if (const auto why = peer_failure(peer)) fail_peer(peer, what, *why);
  }

  // Posts op, whose peer check_peer accepted.
  void start_send(Op& op, int peer, const void* buf, size_t bytes, uint64_t tag) {
    op.peer = peer;
    op.bytes = bytes;
    if (peers[peer].local) {
      op.local = true;
      hub->post_send(rank, peer, tag, buf, bytes, &op.local_done);
      return;
    }
    ucp_request_param_t p{};
    const ucs_status_ptr_t r = ucp_tag_send_nbx(peers[peer].ep, buf, bytes, tag, &p);
    settle_posted(op, r);
  }

  void start_recv(Op& op, int peer, void* buf, size_t bytes, uint64_t tag) {
    op.peer = peer;
    op.is_recv = true;
    op.bytes = bytes;
    if (peers[peer].local) {
      op.local = true;
      hub->post_recv(peer, rank, tag, buf, bytes, &op.local_done);
      return;
    }
    ucp_request_param_t p{};
    // No immediate completion: UCX 1.13 does not fill recv_info on that path, and the
    // received length is what tells a short message from a good one.
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    p.cb.recv = &Impl::on_recv;
    p.user_data = &op;
    const ucs_status_ptr_t r = ucp_tag_recv_nbx(worker, buf, bytes, tag, kFullMask, &p);
    settle_posted(op, r);
  }

  static void settle_posted(Op& op, ucs_status_ptr_t r) {
    if (r == nullptr) {
      op.done = true;  // completed in place; recv_info (if any) is filled
    } else if (UCS_PTR_IS_ERR(r)) {
      op.done = true;
      op.status = UCS_PTR_STATUS(r);
    } else {
      op.req = r;
    }
  }

  // Polls one op; frees its request when complete. Receives complete through
  // on_recv (which carries the received length); sends by request status.
  void poll(Op& op) {
    if (op.done) return;
    if (op.local) {
      if (op.local_done.state.load(std::memory_order_acquire) == 0) return;
      op.done = true;
      op.status = UCS_OK;
      op.info.length = op.local_done.bytes;
      return;
    }
    ucs_status_t s;
    if (op.is_recv) {
      if (!op.recv_completed) return;
      s = op.recv_status;
    } else {
      s = ucp_request_check_status(op.req);
      if (s == UCS_INPROGRESS) return;
    }
    ucp_request_free(op.req);
    op.req = nullptr;
    op.done = true;
    op.status = s;
  }

  // Closes endpoints (force: pending requests on them complete with an error,
  // which is how UCX lets go of our buffers) and waits a bounded time for the
  // close requests themselves.
  void close_endpoints(const std::vector<int>& which, bool force) {
    std::vector<void*> closing;
    for (int r : which) {
      Peer& p = peers[r];
      if (!p.ep) continue;
      ucp_request_param_t param{};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      param.flags = force || p.failed ? UCP_EP_CLOSE_FLAG_FORCE : 0;
      const ucs_status_ptr_t req = ucp_ep_close_nbx(p.ep, &param);
      p.ep = nullptr;
      if (UCS_PTR_IS_PTR(req)) closing.push_back(req);
    }
    const auto until = Clock::now() + kDrainTimeout;
    while (!closing.empty() && Clock::now() < until) {
      ucp_worker_progress(worker);
      std::erase_if(closing, [](void* req) {
        if (ucp_request_check_status(req) == UCS_INPROGRESS) return false;
        ucp_request_free(req);
        return true;
      });
    }
    // Closes still in progress (a peer that woke from SIGSTOP into aborted
    // endpoints): released to UCX, which finishes them itself. An unreleased
    // request makes ucp_worker_destroy assert.
    for (void* req : closing) ucp_request_free(req);
  }

  ~Impl() {
    if (notice.req) {  // cancel the notice receive; its callback runs in progress
      ucp_request_cancel(worker, notice.req);
      const auto until = Clock::now() + kDrainTimeout;
      while (!notice.completed && Clock::now() < until) ucp_worker_progress(worker);
      if (notice.completed) ucp_request_free(notice.req);
      notice.req = nullptr;
    }
    std::vector<int> all(peers.size());
    for (size_t r = 0; r < peers.size(); ++r) all[r] = static_cast<int>(r);
    // Background transfers still in flight: cancel the receives and force-close,
    // so UCX lets go of their buffers before they are freed.
    bool pending = false;
    std::vector<int> unused;
    for (auto& [id, op] : background) {
      pending |= !op.done;
      if (worker) release(op, unused);
    }
    if (worker) close_endpoints(all, broken || pending);
    if (worker)
      for (auto& [id, op] : background) poll(op);
    if (hub) {
      hub->withdraw(rank);
      hub->detach(rank);
    }
    if (epoll_fd >= 0) ::close(epoll_fd);  // the worker's event fd belongs to UCX
    if (wake_fd >= 0) ::close(wake_fd);
    if (worker) ucp_worker_destroy(worker);
    if (context) ucp_cleanup(context);
  }

  // After a failure: local ops are done; a pending UCX receive is cancelled, and
  // the endpoint of any pending op is to be force-closed.
  void release(Op& op, std::vector<int>& to_close) {
    if (op.done) return;
    if (op.local) {
      op.done = true;
      return;
    }
    if (op.is_recv) ucp_request_cancel(worker, op.req);
    if (std::find(to_close.begin(), to_close.end(), op.peer) == to_close.end()) to_close.push_back(op.peer);
  }

  // Wire-up: one message each way on every pair, so every connection exists and a
  // peer that dies later is noticed by everyone; each carries the sender's proof
  // of the job key, checked before any tensor is read from that peer. A wrong or
  // missing proof fails the communicator, naming the peer.
  void prove_job_key(const std::string& key, Deadline deadline) {
    const uint64_t round_seq = seq++;
    std::vector<Proof> mine(size), got(size);
    for (int r = 0; r < size; ++r)
      if (r != rank) post_recv(r, got[r].data(), got[r].size(), make_tag(Kind::kWireup, round_seq, r), "connect");
    for (int r = 0; r < size; ++r) {
      if (r == rank) continue;
      mine[r] = key_proof(key, rank, r);
      post_send(r, mine[r].data(), mine[r].size(), make_tag(Kind::kWireup, round_seq, rank), "connect");
    }
    wait_all(deadline, "connect");
    for (int r = 0; r < size; ++r) {
      if (r == rank) continue;
      const Proof want = key_proof(key, r, rank);
      if (CRYPTO_memcmp(got[r].data(), want.data(), want.size()) == 0) continue;
      const std::string why = "connect: the data-plane peer at rank " + std::to_string(r) +
                              "'s address does not hold this job's key: refused before reading from it";
      log::warn("ucx rank ", rank, ": ", why);
      fail(r, why);
    }
  }

  [[noreturn]] void fail(int peer, const std::string& msg) {
    // Cancel what is still posted and make UCX release it, so no request writes
    // into (or reads from) a caller's buffer after we return: receives are
    // cancelled; endpoints with requests still pending, and the failed peer's, are
    // force-closed, which completes their requests with an error.
    if (hub) hub->withdraw(rank);  // the hub forgets our buffers
    send_notices(peer);
    std::vector<int> to_close;
    if (peer >= 0 && peer < size && peer != rank && !peers[peer].local) to_close.push_back(peer);
    for (Op& op : ops) release(op, to_close);
    for (auto& [id, op] : background) release(op, to_close);
    close_endpoints(to_close, true);
    const auto until = Clock::now() + kDrainTimeout;
    bool pending = true;
    while (pending && Clock::now() < until) {
      ucp_worker_progress(worker);
      pending = false;
      for (Op& op : ops) {
        poll(op);
        pending |= !op.done;
      }
    }
    for (auto& [id, op] : background) poll(op);  // background ops stay where they are until teardown
    bool any_pending = false;
    for (const Op& op : ops) any_pending |= !op.done;
    if (any_pending) abandoned.push_back(std::move(ops));  // elements keep their addresses
    ops.clear();
    mark_broken(peer, msg);
    throw TransportError(peer, msg);
  }

  // A background transfer: progresses the worker once; true once it completed,
  // throws naming the peer when it failed.
  bool settled_background(Op& op, const char* what) {
    ucp_worker_progress(worker);
    poll(op);
    if (op.done && op.status != UCS_OK)
      fail(op.local ? op.peer : culprit_behind(op.peer),
           std::string(what) + ": rank " + std::to_string(op.peer) + " failed: " + status_str(op.status));
    if (op.done && op.is_recv && op.info.length != op.bytes)
      fail(op.peer, std::string(what) + ": rank " + std::to_string(op.peer) + " sent " +
                        std::to_string(op.info.length) + " bytes, expected " + std::to_string(op.bytes));
    if (!op.done)
      if (const auto why = peer_failure(op.peer)) fail_peer(op.peer, what, *why);
    return op.done;
  }

  // Waits for every posted op; throws naming the peer on failure or deadline.
  void wait_all(Deadline deadline, const char* what) {
    for (;;) {
      if (aborted.load()) fail(-1, std::string(what) + ": aborted: " + aborted_why());
      while (ucp_worker_progress(worker) != 0) {
      }
      bool all_done = true;
      for (Op& op : ops) {
        poll(op);
        if (op.done && op.status != UCS_OK)
          fail(op.local ? op.peer : culprit_behind(op.peer),
               std::string(what) + ": " + (op.is_recv ? "receive from" : "send to") + " rank " +
                   std::to_string(op.peer) + " failed: " + status_str(op.status));
        if (op.done && op.is_recv && op.info.length != op.bytes)
          fail(op.peer, std::string(what) + ": rank " + std::to_string(op.peer) + " sent " +
                            std::to_string(op.info.length) + " bytes, expected " + std::to_string(op.bytes));
        if (!op.done)
          if (const auto why = peer_failure(op.peer)) fail_peer(op.peer, what, *why);
        all_done &= op.done;
      }
      if (all_done) {
        ops.clear();
        return;
      }
      const auto now = Clock::now();
      if (now >= deadline) {
        int late = -1;
        for (const Op& op : ops)
          if (!op.done) {
            late = op.peer;
            break;
          }
        fail(late, std::string(what) + ": timed out waiting for rank " + std::to_string(late));
      }
      const ucs_status_t armed = ucp_worker_arm(worker);
      if (armed == UCS_ERR_BUSY) continue;  // events arrived meanwhile: progress again
      if (armed != UCS_OK) fail(-1, std::string(what) + ": ucp_worker_arm: " + status_str(armed));
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count();
      epoll_event ev[2];
      ::epoll_wait(epoll_fd, ev, 2, static_cast<int>(std::clamp<int64_t>(left, 1, 1000)));
      if (wake_fd >= 0) {
        uint64_t n;
        (void)!::read(wake_fd, &n, sizeof n);  // reset the eventfd; the ops say what happened
      }
    }
  }
};

UcxCommunicator::UcxCommunicator(int rank, int size, Bootstrap& bootstrap, const UcxOptions& options)
    : impl_(std::make_unique<Impl>()), rank_(rank), size_(size) {
  MOE_CHECK(size >= 1 && size < (1 << 16) && rank >= 0 && rank < size, "ucx: bad rank ", rank, " of ", size);
  Impl& m = *impl_;
  m.rank = rank;
  m.size = size;

  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  MOE_CHECK(s == UCS_OK, "ucx: ucp_config_read: ", status_str(s));
  if (options.allow_shared_memory && std::getenv("UCX_MM_ERROR_HANDLING") == nullptr)
    ucp_config_modify(config, "MM_ERROR_HANDLING", "y");
  // Every message eager (docs/transport.md#eager-messages): a rendezvous handshake
  // would wait behind the bulk data queued on a slow TCP link.
  if (std::getenv("UCX_RNDV_THRESH") == nullptr) ucp_config_modify(config, "RNDV_THRESH", "inf");
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
  s = ucp_init(&params, config, &m.context);
  ucp_config_release(config);
  MOE_CHECK(s == UCS_OK, "ucx: ucp_init: ", status_str(s));

  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;  // a TransferWorker may make the calls (one thread at a time)
  s = ucp_worker_create(m.context, &wp, &m.worker);
  MOE_CHECK(s == UCS_OK, "ucx: ucp_worker_create: ", status_str(s));
  s = ucp_worker_get_efd(m.worker, &m.event_fd);
  MOE_CHECK(s == UCS_OK, "ucx: ucp_worker_get_efd: ", status_str(s));
  m.epoll_fd = ::epoll_create1(EPOLL_CLOEXEC);
  MOE_CHECK(m.epoll_fd >= 0, "ucx: epoll_create1: ", std::strerror(errno));
  epoll_event ev{};
  ev.events = EPOLLIN;
  MOE_CHECK(::epoll_ctl(m.epoll_fd, EPOLL_CTL_ADD, m.event_fd, &ev) == 0, "ucx: epoll_ctl: ", std::strerror(errno));
  m.wake_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  MOE_CHECK(m.wake_fd >= 0, "ucx: eventfd: ", std::strerror(errno));
  MOE_CHECK(::epoll_ctl(m.epoll_fd, EPOLL_CTL_ADD, m.wake_fd, &ev) == 0, "ucx: epoll_ctl: ", std::strerror(errno));
  m.hub = options.hub;
  if (m.hub) {
    MOE_CHECK(m.hub->is_local(rank), "ucx: rank ", rank, " is not in the local hub it was given");
    m.hub->attach(rank, m.wake_fd);
  }

  ucp_address_t* address = nullptr;
  size_t address_len = 0;
  s = ucp_worker_get_address(m.worker, &address, &address_len);
  MOE_CHECK(s == UCS_OK, "ucx: ucp_worker_get_address: ", status_str(s));
  const std::string mine(reinterpret_cast<const char*>(address), address_len);
  ucp_worker_release_address(m.worker, address);
  const std::vector<std::string> all = bootstrap.all_gather(mine);
  MOE_CHECK(static_cast<int>(all.size()) == size, "ucx: bootstrap returned ", all.size(), " addresses for ", size,
            " ranks");

  m.peers.resize(size);
  m.blamed_by.assign(size, -1);
  m.post_notice_recv();
  for (int r = 0; r < size; ++r) {
    Impl::Peer& p = m.peers[r];
    p.local = m.hub && m.hub->is_local(r);
    if (r == rank || p.local) continue;
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = reinterpret_cast<const ucp_address_t*>(all[r].data());
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = &Impl::on_ep_error;
    ep.err_handler.arg = &p;
    s = ucp_ep_create(m.worker, &ep, &p.ep);
    if (s != UCS_OK)  // the peer is named: the agent blames it, as for a failed transfer
      throw TransportError(r, "ucx: cannot connect to rank " + std::to_string(r) + " (ucp_ep_create: " +
                                  status_str(s) + ")");
  }
  m.prove_job_key(options.job_key, Clock::now() + options.connect_timeout);
}

UcxCommunicator::~UcxCommunicator() = default;  // Impl::~Impl tears down

void UcxCommunicator::all_to_all_v(const std::vector<AllToAllBuffer>& buffers, Deadline deadline) {
  impl_->check_usable();
  detail::all_to_all_v(*impl_, rank_, size_, buffers, deadline);
}

void UcxCommunicator::all_reduce_sum(float* data, size_t count, Deadline deadline) {
  impl_->check_usable();
  detail::all_reduce_sum(*impl_, rank_, size_, data, count, deadline, impl_->reduce_parts);
}

void UcxCommunicator::barrier(Deadline deadline) {
  Impl& m = *impl_;
  m.check_usable();
  detail::token_round(m, rank_, size_, Kind::kBarrier, deadline, "barrier");
}

void UcxCommunicator::send(int peer, const void* data, size_t bytes, uint32_t tag, Deadline deadline) {
  impl_->send(rank_, peer, data, bytes, tag, deadline);
}

void UcxCommunicator::recv(int peer, void* data, size_t bytes, uint32_t tag, Deadline deadline) {
  impl_->recv(peer, data, bytes, tag, deadline);
}

Communicator::TransferId UcxCommunicator::isend(int peer, const void* data, size_t bytes, uint32_t tag,
                                                std::shared_ptr<const void> keep) {
  return impl_->isend(rank_, peer, data, bytes, tag, std::move(keep));
}

Communicator::TransferId UcxCommunicator::irecv(int peer, void* data, size_t bytes, uint32_t tag,
                                                std::shared_ptr<const void> keep) {
  return impl_->irecv(peer, data, bytes, tag, std::move(keep));
}

void UcxCommunicator::abort(const std::string& why) {
  if (!impl_->record_abort(why)) return;
  const uint64_t one = 1;
  (void)!::write(impl_->wake_fd, &one, sizeof one);  // a wait in epoll_wait looks at the flag now
}

bool UcxCommunicator::test(TransferId id) { return impl_->test(id); }

}  // namespace moe::transport
