#include "moe/tensor_wire/tensor_port.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <openssl/evp.h>
#include <openssl/rand.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <future>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "moe/base/check.h"
#include "moe/base/log.h"

namespace moe::tensor_wire {
namespace {

constexpr size_t kProbesPerTurn = 64;  // messages taken off UCX's queue before the port looks at its work again
constexpr int kIdleWaitMs = 20;        // the longest sleep between turns (deadlines are checked each turn)

std::array<uint8_t, 12> nonce_of(uint64_t tag) {
  std::array<uint8_t, 12> nonce{};
  for (int i = 0; i < 8; ++i) nonce[i] = static_cast<uint8_t>(tag >> (8 * i));
  return nonce;
}

struct CipherCtx {
  EVP_CIPHER_CTX* ctx = EVP_CIPHER_CTX_new();
  ~CipherCtx() { EVP_CIPHER_CTX_free(ctx); }
};

std::string status_str(ucs_status_t s) { return ucs_status_string(s); }

}  // namespace

Key new_key() {
  Key key{};
  MOE_CHECK(RAND_bytes(key.data(), static_cast<int>(key.size())) == 1, "tensor wire: RAND_bytes failed");
  return key;
}

uint64_t make_tag(Direction direction, uint32_t receiver_peer, uint32_t seq) {
  return (uint64_t{static_cast<uint8_t>(direction)} << 56) | (uint64_t{receiver_peer & kMaxPeerId} << 32) | seq;
}

// GMAC: AES-256-GCM over the bytes as associated data, nothing encrypted.
std::string seal(const Key& key, uint64_t tag, const void* plain, size_t n) {
  MOE_CHECK(n <= size_t{INT32_MAX}, "tensor wire: a message of ", n, " bytes is too large to seal");
  const auto nonce = nonce_of(tag);
  CipherCtx c;
  std::string out(n + kSealBytes, '\0');
  if (n > 0) std::memcpy(out.data(), plain, n);
  auto* mac = reinterpret_cast<unsigned char*>(out.data()) + n;
  int len = 0;
  const bool ok = c.ctx && EVP_EncryptInit_ex(c.ctx, EVP_aes_256_gcm(), nullptr, key.data(), nonce.data()) == 1 &&
                  (n == 0 || EVP_EncryptUpdate(c.ctx, nullptr, &len, static_cast<const unsigned char*>(plain),
                                               static_cast<int>(n)) == 1) &&
                  EVP_EncryptFinal_ex(c.ctx, mac, &len) == 1 &&
                  EVP_CIPHER_CTX_ctrl(c.ctx, EVP_CTRL_GCM_GET_TAG, kSealBytes, mac) == 1;
  MOE_CHECK(ok, "tensor wire: sealing a message failed");
  return out;
}

bool open(const Key& key, uint64_t tag, std::string& message) {
  if (message.size() < kSealBytes || message.size() - kSealBytes > size_t{INT32_MAX}) return false;
  const size_t n = message.size() - kSealBytes;
  const auto nonce = nonce_of(tag);
  CipherCtx c;
  auto* p = reinterpret_cast<unsigned char*>(message.data());
  unsigned char none[1];
  int len = 0;
  const bool ok = c.ctx && EVP_DecryptInit_ex(c.ctx, EVP_aes_256_gcm(), nullptr, key.data(), nonce.data()) == 1 &&
                  (n == 0 || EVP_DecryptUpdate(c.ctx, nullptr, &len, p, static_cast<int>(n)) == 1) &&
                  EVP_CIPHER_CTX_ctrl(c.ctx, EVP_CTRL_GCM_SET_TAG, kSealBytes, p + n) == 1 &&
                  EVP_DecryptFinal_ex(c.ctx, none, &len) == 1;
  if (!ok) return false;
  message.resize(n);
  return true;
}

// Everything below `commands` is the port thread's alone.
struct TensorPort::Impl {
  struct Peer {
    ucp_ep_h ep = nullptr;
    Key key{};
    size_t max_message = 0, max_unclaimed = 0, unclaimed = 0;
    std::string failed;  // why its endpoint failed; "" while it works
  };
  struct Recv {  // a message taken off UCX's queue, being received
    void* req = nullptr;
    uint32_t peer = 0;
    uint64_t tag = 0;
    std::string data;  // sealed; empty for a message dropped unread
    bool done = false;
    ucs_status_t status = UCS_OK;
  };
  struct Send {
    void* req = nullptr;
    std::string data;  // sealed
    Sent sent;
    bool done = false;
    ucs_status_t status = UCS_OK;
  };
  struct Arrival {
    uint32_t peer = 0;
    std::string data;  // opened
    Clock::time_point at;
  };
  struct Expect {
    uint32_t peer = 0;
    size_t bytes = 0;
    Clock::time_point deadline;
    Arrived arrived;
  };

  PortOptions opts;
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  std::string address;
  int event_fd = -1, wake_fd = -1, epoll_fd = -1;
  std::thread thread;
  std::atomic<bool> stopping{false};
  std::atomic<size_t> peer_count{0};
  std::atomic<uint64_t> dropped{0};

  std::mutex mu;  // guards commands
  std::deque<std::function<void()>> commands;
  std::mutex keys_mu;  // guards keys: the peers' keys, for sealing on the sender's thread
  std::map<uint32_t, Key> keys;

  std::map<uint32_t, Peer> peers;
  uint32_t next_peer = 1;
  std::list<Recv> recvs;
  std::list<Send> sends;
  std::map<uint64_t, Arrival> arrivals;
  std::map<uint64_t, Expect> expects;
  char scratch[16];  // where a dropped message is "received" (truncated)

  explicit Impl(PortOptions o) : opts(o) { init_ucx(); }

  void init_ucx() {
    ucp_config_t* config = nullptr;
    ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
    MOE_CHECK(s == UCS_OK, "tensor wire: ucp_config_read: ", status_str(s));
    if (opts.allow_shared_memory && std::getenv("UCX_MM_ERROR_HANDLING") == nullptr)
      ucp_config_modify(config, "MM_ERROR_HANDLING", "y");
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
    s = ucp_init(&params, config, &context);
    ucp_config_release(config);
    MOE_CHECK(s == UCS_OK, "tensor wire: ucp_init: ", status_str(s));
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;  // the port's thread only
    s = ucp_worker_create(context, &wp, &worker);
    MOE_CHECK(s == UCS_OK, "tensor wire: ucp_worker_create: ", status_str(s));
    ucp_address_t* a = nullptr;
    size_t n = 0;
    s = ucp_worker_get_address(worker, &a, &n);
    MOE_CHECK(s == UCS_OK, "tensor wire: ucp_worker_get_address: ", status_str(s));
    address.assign(reinterpret_cast<const char*>(a), n);
    ucp_worker_release_address(worker, a);
    s = ucp_worker_get_efd(worker, &event_fd);
    MOE_CHECK(s == UCS_OK, "tensor wire: ucp_worker_get_efd: ", status_str(s));
    epoll_fd = ::epoll_create1(EPOLL_CLOEXEC);
    wake_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    MOE_CHECK(epoll_fd >= 0 && wake_fd >= 0, "tensor wire: epoll/eventfd: ", std::strerror(errno));
    epoll_event ev{};
    ev.events = EPOLLIN;
    MOE_CHECK(::epoll_ctl(epoll_fd, EPOLL_CTL_ADD, event_fd, &ev) == 0 &&
                  ::epoll_ctl(epoll_fd, EPOLL_CTL_ADD, wake_fd, &ev) == 0,
              "tensor wire: epoll_ctl: ", std::strerror(errno));
  }

  ~Impl() {
    if (thread.joinable()) {
      stopping = true;
      wake();
      thread.join();
    }
    if (worker) ucp_worker_destroy(worker);
    if (context) ucp_cleanup(context);
    if (epoll_fd >= 0) ::close(epoll_fd);
    if (wake_fd >= 0) ::close(wake_fd);
  }

  void wake() {
    const uint64_t one = 1;
    [[maybe_unused]] const ssize_t n = ::write(wake_fd, &one, sizeof one);
  }

  void post(std::function<void()> f) {
    {
      std::lock_guard<std::mutex> lock(mu);
      commands.push_back(std::move(f));
    }
    wake();
  }

  // ---- the port's thread ----

  void run() {
    while (!stopping) {
      run_commands();
      while (ucp_worker_progress(worker) != 0) {
      }
      take_messages();
      finish_recvs();
      finish_sends();
      expire(Clock::now());
      if (ucp_worker_arm(worker) == UCS_OK && commands_empty()) {
        epoll_event ev[2];
        ::epoll_wait(epoll_fd, ev, 2, kIdleWaitMs);
        uint64_t drain;
        [[maybe_unused]] const ssize_t n = ::read(wake_fd, &drain, sizeof drain);
      }
    }
    shut_down();
  }

  bool commands_empty() {
    std::lock_guard<std::mutex> lock(mu);
    return commands.empty();
  }

  void run_commands() {
    std::deque<std::function<void()>> now;
    {
      std::lock_guard<std::mutex> lock(mu);
      now.swap(commands);
    }
    for (auto& f : now) f();
  }

  static void on_ep_error(void* arg, ucp_ep_h ep, ucs_status_t status) {
    auto* self = static_cast<Impl*>(arg);
    for (auto& [id, p] : self->peers)
      if (p.ep == ep) p.failed = "its endpoint failed (" + status_str(status) + ")";
  }

  uint32_t connect(const std::string& addr, const Key& key, size_t max_message, size_t max_unclaimed, uint32_t id) {
    if (peers.size() >= kMaxPeerId) throw InvalidArgument("tensor wire: every peer id is in use");
    if (id > kMaxPeerId || (id != 0 && peers.count(id)))
      throw InvalidArgument("tensor wire: peer id " + std::to_string(id) + " is in use or out of range");
    if (id == 0) {
      while (next_peer == 0 || peers.count(next_peer)) next_peer = (next_peer + 1) & kMaxPeerId;
      id = next_peer;
      next_peer = (next_peer + 1) & kMaxPeerId;
    }
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = reinterpret_cast<const ucp_address_t*>(addr.data());
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = &Impl::on_ep_error;
    ep.err_handler.arg = this;
    Peer p;
    p.key = key;
    p.max_message = max_message;
    p.max_unclaimed = max_unclaimed;
    const ucs_status_t s = ucp_ep_create(worker, &ep, &p.ep);
    if (s != UCS_OK) throw InvalidArgument("tensor wire: cannot reach the peer's address: " + status_str(s));
    peers.emplace(id, p);
    peer_count = peers.size();
    std::lock_guard<std::mutex> lock(keys_mu);
    keys[id] = key;
    return id;
  }

  void disconnect(uint32_t id, const std::string& why) {
    const auto it = peers.find(id);
    if (it == peers.end()) return;
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    const ucs_status_ptr_t r = ucp_ep_close_nbx(it->second.ep, &p);
    if (UCS_PTR_IS_PTR(r)) ucp_request_free(r);
    peers.erase(it);
    peer_count = peers.size();
    {
      std::lock_guard<std::mutex> lock(keys_mu);
      keys.erase(id);
    }
    for (auto e = expects.begin(); e != expects.end();)
      if (e->second.peer == id) {
        e->second.arrived(why, {});
        e = expects.erase(e);
      } else {
        ++e;
      }
    std::erase_if(arrivals, [id](const auto& a) { return a.second.peer == id; });
  }

  static void on_recv(void*, ucs_status_t status, const ucp_tag_recv_info_t*, void* user) {
    auto* r = static_cast<Recv*>(user);
    r->status = status;
    r->done = true;
  }

  static void on_send(void*, ucs_status_t status, void* user) {
    auto* s = static_cast<Send*>(user);
    s->status = status;
    s->done = true;
  }

  // Takes every waiting message off UCX's queue: received in full if its
  // sender may send it, else "received" into 16 bytes (truncated) and dropped.
  void take_messages() {
    for (size_t i = 0; i < kProbesPerTurn; ++i) {
      ucp_tag_recv_info_t info{};
      ucp_tag_message_h msg = ucp_tag_probe_nb(worker, 0, 0, 1, &info);
      if (!msg) return;
      Recv& r = recvs.emplace_back();
      r.tag = info.sender_tag;
      r.peer = static_cast<uint32_t>(r.tag >> 32) & kMaxPeerId;
      const auto p = peers.find(r.peer);
      const bool take = static_cast<uint8_t>(r.tag >> 56) == static_cast<uint8_t>(opts.receives) &&
                        p != peers.end() && p->second.failed.empty() && info.length >= kSealBytes &&
                        info.length - kSealBytes <= p->second.max_message &&
                        p->second.unclaimed + info.length <= p->second.max_unclaimed;
      if (take) {
        r.data.resize(info.length);
        p->second.unclaimed += info.length;
      } else {
        ++dropped;
      }
      ucp_request_param_t param{};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
      param.cb.recv = &Impl::on_recv;
      param.user_data = &r;
      void* buf = take ? static_cast<void*>(r.data.data()) : static_cast<void*>(scratch);
      const ucs_status_ptr_t req = ucp_tag_msg_recv_nbx(worker, buf, take ? r.data.size() : sizeof scratch, msg, &param);
      if (UCS_PTR_IS_ERR(req)) {
        r.done = true;
        r.status = UCS_PTR_STATUS(req);
      } else {
        r.req = req;
      }
    }
  }

  void unclaim(uint32_t peer, size_t sealed_bytes) {
    if (const auto p = peers.find(peer); p != peers.end()) p->second.unclaimed -= std::min(p->second.unclaimed, sealed_bytes);
  }

  void finish_recvs() {
    for (auto it = recvs.begin(); it != recvs.end();) {
      if (!it->done) {
        ++it;
        continue;
      }
      if (it->req) ucp_request_free(it->req);
      if (!it->data.empty()) arrive(*it);
      it = recvs.erase(it);
    }
  }

  // A received message from a peer: opened and handed to its expectation, or
  // kept unclaimed; dropped if it does not open.
  void arrive(Recv& r) {
    const size_t sealed = r.data.size();
    const auto p = peers.find(r.peer);
    if (r.status != UCS_OK || p == peers.end() || !open(p->second.key, r.tag, r.data) || arrivals.count(r.tag)) {
      ++dropped;
      unclaim(r.peer, sealed);
      return;
    }
    if (const auto e = expects.find(r.tag); e != expects.end() && e->second.peer == r.peer) {
      unclaim(r.peer, sealed);
      hand_over(e->second, std::move(r.data));
      expects.erase(e);
      return;
    }
    arrivals.emplace(r.tag, Arrival{r.peer, std::move(r.data), Clock::now()});
  }

  static void hand_over(Expect& e, std::string data) {
    if (data.size() != e.bytes)
      e.arrived("the message has " + std::to_string(data.size()) + " bytes, expected " + std::to_string(e.bytes), {});
    else
      e.arrived("", std::move(data));
  }

  void finish_sends() {
    for (auto it = sends.begin(); it != sends.end();) {
      if (!it->done) {
        ++it;
        continue;
      }
      if (it->req) ucp_request_free(it->req);
      it->sent(it->status == UCS_OK ? "" : "the send failed (" + status_str(it->status) + ")");
      it = sends.erase(it);
    }
  }

  void start_send(uint32_t peer, uint64_t tag, std::string sealed, Sent sent) {
    const auto p = peers.find(peer);
    if (p == peers.end()) return sent("no such peer on the tensor wire");
    if (!p->second.failed.empty()) return sent("the peer's " + p->second.failed);
    Send& s = sends.emplace_back();
    s.data = std::move(sealed);
    s.sent = std::move(sent);
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    param.cb.send = &Impl::on_send;
    param.user_data = &s;
    const ucs_status_ptr_t req = ucp_tag_send_nbx(p->second.ep, s.data.data(), s.data.size(), tag, &param);
    if (UCS_PTR_IS_ERR(req)) {
      s.done = true;
      s.status = UCS_PTR_STATUS(req);
    } else {
      s.req = req;
    }
  }

  void start_expect(uint32_t peer, uint64_t tag, Expect e) {
    if (const auto a = arrivals.find(tag); a != arrivals.end() && a->second.peer == peer) {
      unclaim(peer, a->second.data.size() + kSealBytes);
      hand_over(e, std::move(a->second.data));
      arrivals.erase(a);
      return;
    }
    const auto p = peers.find(peer);
    if (p == peers.end()) return e.arrived("no such peer on the tensor wire", {});
    if (!expects.try_emplace(tag, std::move(e)).second)  // try_emplace leaves e alone when the tag is there
      e.arrived("message " + std::to_string(tag) + " is already expected", {});
  }

  void expire(Clock::time_point now) {
    for (auto it = expects.begin(); it != expects.end();) {
      const auto p = peers.find(it->second.peer);
      std::string why;
      if (p == peers.end()) why = "the peer left the tensor wire";
      else if (!p->second.failed.empty()) why = "the peer's " + p->second.failed;
      else if (now >= it->second.deadline) why = "the message did not arrive in time";
      if (why.empty()) {
        ++it;
        continue;
      }
      it->second.arrived(why, {});
      it = expects.erase(it);
    }
    for (auto it = arrivals.begin(); it != arrivals.end();) {
      if (now - it->second.at < opts.unclaimed) {
        ++it;
        continue;
      }
      ++dropped;
      unclaim(it->second.peer, it->second.data.size() + kSealBytes);
      it = arrivals.erase(it);
    }
  }

  void shut_down() {
    run_commands();
    for (Recv& r : recvs)
      if (r.req && !r.done) ucp_request_cancel(worker, r.req);
    while (ucp_worker_progress(worker) != 0) {
    }
    std::vector<uint32_t> ids;
    for (const auto& [id, p] : peers) ids.push_back(id);
    for (uint32_t id : ids) disconnect(id, "the tensor wire closed");
    for (int i = 0; i < 100 && !(recvs.empty() && sends.empty()); ++i) {  // bounded: a send to a dead peer
      ucp_worker_progress(worker);
      finish_recvs();
      finish_sends();
    }
    for (Send& s : sends)
      if (!s.done) s.sent("the tensor wire closed");
    for (auto& [tag, e] : expects) e.arrived("the tensor wire closed", {});
    expects.clear();
  }
};

TensorPort::TensorPort(PortOptions options) : impl_(std::make_unique<Impl>(options)) {
  impl_->thread = std::thread([impl = impl_.get()] { impl->run(); });
}

TensorPort::~TensorPort() = default;

const std::string& TensorPort::address() const { return impl_->address; }
size_t TensorPort::peers() const { return impl_->peer_count; }
uint64_t TensorPort::dropped() const { return impl_->dropped; }

uint32_t TensorPort::add_peer(const std::string& address, const Key& key, size_t max_message, size_t max_unclaimed,
                              uint32_t id) {
  auto result = std::make_shared<std::promise<uint32_t>>();
  auto future = result->get_future();
  impl_->post([=, impl = impl_.get()] {
    try {
      result->set_value(impl->connect(address, key, max_message, max_unclaimed, id));
    } catch (...) {
      result->set_exception(std::current_exception());
    }
  });
  return future.get();
}

void TensorPort::remove_peer(uint32_t peer) {
  impl_->post([=, impl = impl_.get()] { impl->disconnect(peer, "the peer left the tensor wire"); });
}

void TensorPort::send(uint32_t peer, uint64_t tag, const void* plain, size_t n, Sent sent) {
  std::optional<Key> key;
  {
    std::lock_guard<std::mutex> lock(impl_->keys_mu);
    if (const auto it = impl_->keys.find(peer); it != impl_->keys.end()) key = it->second;
  }
  if (!key) return sent("no such peer on the tensor wire");
  impl_->post([=, impl = impl_.get(), sealed = seal(*key, tag, plain, n)]() mutable {
    impl->start_send(peer, tag, std::move(sealed), std::move(sent));
  });
}

void TensorPort::expect(uint32_t peer, uint64_t tag, size_t bytes, Clock::time_point deadline, Arrived arrived) {
  impl_->post([=, impl = impl_.get()]() mutable {
    impl->start_expect(peer, tag, Impl::Expect{peer, bytes, deadline, std::move(arrived)});
  });
}

void TensorPort::send_and_wait(uint32_t peer, uint64_t tag, const void* plain, size_t n, Clock::time_point deadline) {
  auto done = std::make_shared<std::promise<std::string>>();
  auto f = done->get_future();
  send(peer, tag, plain, n, [done](const std::string& error) { done->set_value(error); });
  if (f.wait_until(deadline) != std::future_status::ready) throw Error("tensor wire: the send did not finish in time");
  if (const std::string error = f.get(); !error.empty()) throw Error("tensor wire: " + error);
}

std::string TensorPort::take(uint32_t peer, uint64_t tag, size_t bytes, Clock::time_point deadline) {
  auto done = std::make_shared<std::promise<std::pair<std::string, std::string>>>();
  auto f = done->get_future();
  expect(peer, tag, bytes, deadline, [done](const std::string& error, std::string data) {
    done->set_value({error, std::move(data)});
  });
  auto [error, data] = f.get();  // the port answers by the deadline
  if (!error.empty()) throw Error("tensor wire: " + error);
  return std::move(data);
}

}  // namespace moe::tensor_wire
