#include "moe/client/session.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <thread>

#include "moe/base/check.h"
#include "moe/base/random.h"
#include "moe/rpc/frame.h"
#include "moe/tensor_wire/tensor_port.h"

namespace moe::client {
namespace {

// How long a node that failed a call is passed over (docs/serving.md#elastic-serving).
constexpr std::chrono::milliseconds kAway{500};
// How often a call opens the tensor wire to a node again when the node says it lost it.
constexpr int kWireReopens = 3;

// 128 random bits in hex: this session's connections, to the nodes (Hello.session).
std::string new_session_id() {
  std::string id;
  for (unsigned char c : random_bytes(16)) {
    char hex[3];
    std::snprintf(hex, sizeof hex, "%02x", c);
    id += hex;
  }
  return id;
}

}  // namespace

rpc::ClientOptions Session::options_for(const std::string& address) const {
  rpc::ClientOptions o = rpc::ClientOptions::make(address, opts_.token, "client", opts_.name, opts_.tls);
  o.session = session_id_;
  return o;
}

Session::Session(SessionOptions options) : opts_(std::move(options)), session_id_(new_session_id()) {
  rpc::RpcClient agent(options_for(opts_.agent));
  spec_ = running_job(agent).spec();
  find_nodes();
  if (nodes_.empty()) throw rpc::RpcError(v1::ERROR_CODE_UNAVAILABLE, "job " + opts_.job + ": no node is alive");
  wait_until_nodes_run_it();
}

void Session::find_nodes() {
  rpc::RpcClient agent(options_for(opts_.agent));
  v1::Envelope status;
  status.mutable_cluster_status();
  const v1::Envelope cluster = agent.call(status, opts_.timeout);
  std::lock_guard<std::mutex> lock(mu_);
  for (const v1::NodeInfo& n : cluster.cluster_status_reply().nodes())
    if (n.state() == v1::NODE_STATE_ALIVE && !n.control_address().empty() &&
        std::find(nodes_.begin(), nodes_.end(), n.control_address()) == nodes_.end()) {
      nodes_.push_back(n.control_address());
      away_.push_back({});
    }
}

// The job once it runs: a queued one (its cluster still busy) is waited for,
// up to the session's timeout.
v1::JobResult Session::running_job(rpc::RpcClient& agent) const {
  const auto until = std::chrono::steady_clock::now() + opts_.timeout;
  v1::Envelope get;
  get.mutable_get_job()->set_job_id(opts_.job);
  for (;;) {
    const v1::Envelope reply = agent.call(get, opts_.timeout);
    if (!reply.has_job()) throw rpc::RpcError(v1::ERROR_CODE_INTERNAL, "the agent answered " + rpc::payload_name(reply));
    const v1::JobResult& job = reply.job();
    if (job.spec().mode() != v1::JobSpec::serve)
      throw rpc::RpcError(v1::ERROR_CODE_FAILED_PRECONDITION, "job " + opts_.job + " is not a serving job (--mode serve)");
    if (job.state() == v1::JOB_STATE_RUNNING) return job;
    if (job.state() != v1::JOB_STATE_QUEUED || std::chrono::steady_clock::now() > until) {
      std::string state = v1::JobState_Name(job.state()).substr(std::strlen("JOB_STATE_"));
      std::transform(state.begin(), state.end(), state.begin(), [](unsigned char c) { return std::tolower(c); });
      throw rpc::RpcError(v1::ERROR_CODE_FAILED_PRECONDITION, "job " + opts_.job + " is not running (" + state +
                                                                  (job.message().empty() ? "" : ": " + job.message()) +
                                                                  ")");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // polling the agent for the job's start
  }
}

// The agent records a job RUNNING as it asks the daemons to start it: a node
// answers the job's calls once its daemon started it, a moment later.
void Session::wait_until_nodes_run_it() {
  const auto until = std::chrono::steady_clock::now() + opts_.timeout;
  int polls = 0;
  for (const std::string& address : nodes_) {
    rpc::RpcClient node(options_for(address));
    v1::Envelope ask;
    ask.mutable_daemon_status();
    for (;;) {
      const v1::Envelope s = node.call(ask, opts_.timeout);
      if (s.daemon_status_reply().running_job() == opts_.job) {
        steps_ = std::max<int64_t>(steps_, s.daemon_status_reply().serve_steps());
        break;
      }
      if (std::chrono::steady_clock::now() > until)
        throw rpc::RpcError(v1::ERROR_CODE_UNAVAILABLE, "job " + opts_.job + " did not start on the node at " + address +
                                                            " within " + std::to_string(opts_.timeout.count()) + " ms");
      if (++polls % 50 == 0) {  // a job that failed to start says why, at once
        rpc::RpcClient agent(options_for(opts_.agent));
        running_job(agent);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));  // polling the daemon for the job's start
    }
    std::lock_guard<std::mutex> lock(mu_);
    idle_[address].push_back(std::make_unique<rpc::RpcClient>(std::move(node)));
  }
}

Session::~Session() = default;

bool Session::is_no_wire(const rpc::RpcError& e) {
  return e.code() == v1::ERROR_CODE_FAILED_PRECONDITION && std::string(e.what()).rfind(tensor_wire::kNoWire, 0) == 0;
}

void Session::forget_wire(size_t node) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = links_.find(node);
  if (it == links_.end()) return;
  wire_->remove_peer(it->second.link);
  links_.erase(it);
}

// ServeOpenWire on `node`: its address, its id for us and the key; the node
// becomes a peer of our port under a fresh id of ours. Returns the link at seq 1.
Session::WireCall Session::open_wire(size_t node) {
  forget_wire(node);
  uint32_t link = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    link = next_link_;
    next_link_ = next_link_ % tensor_wire::kMaxPeerId + 1;
  }
  v1::Envelope open;
  v1::ServeOpenWire* o = open.mutable_serve_open_wire();
  o->set_job_id(opts_.job);
  o->set_client_address(wire_->address());
  o->set_client_peer(link);
  const v1::Envelope reply = call_node(node, std::move(open));
  expect(reply, reply.has_serve_open_wire_reply(), "opening the tensor wire");
  const v1::ServeOpenWireReply& r = reply.serve_open_wire_reply();
  tensor_wire::Key key{};
  if (r.key().size() != key.size() || r.node_peer() == 0)
    throw rpc::RpcError(v1::ERROR_CODE_INTERNAL, "the node opened the tensor wire with a " +
                                                     std::to_string(r.key().size()) + "-byte key");
  std::memcpy(key.data(), r.key().data(), key.size());
  try {
    wire_->add_peer(r.node_address(), key, size_t{1} << 30, size_t{1} << 30, link);
  } catch (const Error& e) {
    throw rpc::RpcError(v1::ERROR_CODE_UNAVAILABLE, e.what(), rpc::RpcError::Peer::kUnreached);
  }
  const WireCall call{link, r.node_peer(), 1};
  std::lock_guard<std::mutex> lock(mu_);
  links_[node] = call;
  return call;
}

Session::WireCall Session::send_on_wire(size_t node, const void* rows, size_t bytes) {
  WireCall call;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!wire_)
      wire_ = std::make_unique<tensor_wire::TensorPort>(tensor_wire::PortOptions{tensor_wire::Direction::kToClient});
    if (const auto it = links_.find(node); it != links_.end() && it->second.seq < UINT32_MAX) {
      call = it->second;
      call.seq = ++it->second.seq;
    }
  }
  if (call.seq == 0) call = open_wire(node);  // first use, or a new key once a key's sequences ran out
  try {
    wire_->send_and_wait(call.link, tensor_wire::make_tag(tensor_wire::Direction::kToNode, call.node_peer, call.seq),
                         rows, bytes, Clock::now() + opts_.timeout);
  } catch (const Error& e) {  // the node's endpoint failed: as a connection that broke
    forget_wire(node);
    throw rpc::RpcError(v1::ERROR_CODE_UNAVAILABLE, e.what(), rpc::RpcError::Peer::kUnreached);
  }
  return call;
}

std::string Session::take_from_wire(const WireCall& call, size_t bytes) {
  try {
    return wire_->take(call.link, tensor_wire::make_tag(tensor_wire::Direction::kToClient, call.link, call.seq), bytes,
                       Clock::now() + opts_.timeout);
  } catch (const Error& e) {
    throw rpc::RpcError(v1::ERROR_CODE_UNAVAILABLE, std::string("the answer: ") + e.what());
  }
}

size_t Session::next_node() {
  std::lock_guard<std::mutex> lock(mu_);
  const Clock::time_point now = Clock::now();
  for (size_t tried = 0; tried < nodes_.size(); ++tried) {
    const size_t node = next_++ % nodes_.size();
    if (away_[node] <= now) return node;
  }
  return kNone;
}

std::pair<size_t, v1::Envelope> Session::call_any(const std::function<v1::Envelope(size_t node)>& request) {
  const Clock::time_point until = Clock::now() + opts_.timeout;
  std::string last;
  int reopens = 0;
  for (;;) {
    const size_t node = next_node();
    if (node != kNone) {
      try {
        return {node, call_node(node, request(node))};
      } catch (const rpc::RpcError& e) {
        if (is_no_wire(e) && ++reopens <= kWireReopens) {
          forget_wire(node);
          continue;
        }
        // Anything the node answered about the call itself is the caller's answer.
        if (!e.unreached() && e.code() != v1::ERROR_CODE_NOT_FOUND) throw;
        last = e.what();
        std::lock_guard<std::mutex> lock(mu_);
        away_[node] = Clock::now() + kAway;
      }
      continue;
    }
    // Every node failed a call lately: the job may have moved to others, or ended.
    if (Clock::now() > until)
      throw rpc::RpcError(v1::ERROR_CODE_UNAVAILABLE, "job " + opts_.job + ": no node answered within " +
                                                          std::to_string(opts_.timeout.count()) + " ms (last: " +
                                                          last + ")");
    rpc::RpcClient agent(options_for(opts_.agent));
    running_job(agent);  // throws once the job ended
    find_nodes();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // polling the agent while the job recovers
  }
}

void Session::expect(const v1::Envelope& reply, bool has, const char* what) {
  if (!has)
    throw rpc::RpcError(v1::ERROR_CODE_INTERNAL, std::string("the node answered ") + rpc::payload_name(reply) +
                                                     " to " + what);
}

v1::Envelope Session::call_node(size_t node, v1::Envelope request) {
  std::string address;
  std::unique_ptr<rpc::RpcClient> conn;
  {
    std::lock_guard<std::mutex> lock(mu_);
    address = nodes_.at(node);
    auto& idle = idle_[address];
    if (!idle.empty()) {
      conn = std::move(idle.back());
      idle.pop_back();
    }
  }
  if (!conn) conn = std::make_unique<rpc::RpcClient>(options_for(address));
  // A connection whose call failed in transport is dropped; one whose node
  // answered with an error stays (its session's handles live on the node while
  // one of its connections does: docs/serving.md#disconnects).
  auto give_back = [&] {
    std::lock_guard<std::mutex> lock(mu_);
    idle_[address].push_back(std::move(conn));
  };
  try {
    v1::Envelope reply = conn->call(std::move(request), opts_.timeout);
    give_back();
    return reply;
  } catch (const rpc::RpcError& e) {
    if (!e.unreached() && e.code() != v1::ERROR_CODE_DEADLINE_EXCEEDED) give_back();
    throw;
  }
}

std::vector<uint8_t> Session::forward_bytes(int layer, const void* x, int64_t rows, v1::JobSpec::DType dtype) {
  return forward_call(layer, x, rows, dtype, false).y;
}

std::vector<float> Session::forward(int layer, const std::vector<float>& x) {
  if (hidden() < 1 || x.size() % hidden() != 0)
    throw InvalidArgument("x: " + std::to_string(x.size()) + " values are not whole rows of " +
                          std::to_string(hidden()));
  const int64_t rows = static_cast<int64_t>(x.size()) / hidden();
  const std::vector<uint8_t> y = forward_bytes(layer, x.data(), rows, v1::JobSpec::fp32);
  std::vector<float> out(y.size() / 4);
  std::memcpy(out.data(), y.data(), y.size());
  return out;
}

Session::Kept Session::forward_kept(int layer, const void* x, int64_t rows, v1::JobSpec::DType dtype) {
  return forward_call(layer, x, rows, dtype, true);
}

Session::Kept Session::forward_call(int layer, const void* x, int64_t rows, v1::JobSpec::DType dtype, bool keep) {
  if (rows < 1) throw InvalidArgument("rows: must be >= 1, got " + std::to_string(rows));
  const size_t bytes = static_cast<size_t>(rows) * hidden() * (dtype == v1::JobSpec::bf16 ? 2 : 4);
  WireCall wire;  // the last attempt's, when on the wire
  const auto [node, reply] = call_any([&](size_t to) {
    v1::Envelope req;
    v1::ServeForward* f = req.mutable_serve_forward();
    f->set_job_id(opts_.job);
    f->set_layer(layer);
    f->set_rows(rows);
    f->set_hidden(hidden());
    f->set_dtype(dtype);
    if (on_wire(bytes)) {
      wire = send_on_wire(to, x, bytes);
      f->set_wire_peer(wire.node_peer);
      f->set_wire_seq(wire.seq);
    } else {
      f->set_x(static_cast<const char*>(x), bytes);
    }
    f->set_keep_for_backward(keep);
    return req;
  });
  expect(reply, reply.has_serve_forward_reply(), "a forward call");
  const v1::ServeForwardReply& r = reply.serve_forward_reply();
  const std::string y = r.y_on_wire() ? take_from_wire(wire, bytes) : r.y();
  if (y.size() != bytes || (keep && r.handle() == 0))
    throw rpc::RpcError(v1::ERROR_CODE_INTERNAL, "the node answered " + std::to_string(y.size()) + " bytes for " +
                                                     std::to_string(bytes) + (keep ? " and no handle" : ""));
  return {{y.begin(), y.end()}, {node, r.handle(), layer, rows}};
}

std::vector<uint8_t> Session::backward_bytes(const Handle& handle, const void* grad_y, v1::JobSpec::DType dtype) {
  const size_t bytes = static_cast<size_t>(handle.rows) * hidden() * (dtype == v1::JobSpec::bf16 ? 2 : 4);
  WireCall wire;
  auto request = [&] {
    v1::Envelope req;
    v1::ServeBackward* b = req.mutable_serve_backward();
    b->set_job_id(opts_.job);
    b->set_layer(handle.layer);
    b->set_handle(handle.id);
    b->set_rows(handle.rows);
    b->set_hidden(hidden());
    b->set_dtype(dtype);
    if (on_wire(bytes)) {
      wire = send_on_wire(handle.node, grad_y, bytes);
      b->set_wire_peer(wire.node_peer);
      b->set_wire_seq(wire.seq);
    } else {
      b->set_grad_y(static_cast<const char*>(grad_y), bytes);
    }
    return req;
  };
  v1::Envelope reply;
  for (int reopens = 0;; ++reopens) {  // the handle stays good while the wire is refused
    try {
      reply = call_node(handle.node, request());
      break;
    } catch (const rpc::RpcError& e) {
      if (!is_no_wire(e) || reopens >= kWireReopens) throw;
      forget_wire(handle.node);
    }
  }
  expect(reply, reply.has_serve_backward_reply(), "a backward call");
  const v1::ServeBackwardReply& r = reply.serve_backward_reply();
  const std::string g = r.grad_x_on_wire() ? take_from_wire(wire, bytes) : r.grad_x();
  if (g.size() != bytes)
    throw rpc::RpcError(v1::ERROR_CODE_INTERNAL, "the node answered " + std::to_string(g.size()) + " bytes for " +
                                                     std::to_string(bytes));
  return {g.begin(), g.end()};
}

int64_t Session::step(int clients, const std::string& caller) {
  v1::Envelope req;
  v1::ServeStep* s = req.mutable_serve_step();
  s->set_job_id(opts_.job);
  s->set_step(steps_ + 1);
  s->set_clients(clients);
  s->set_caller(caller.empty() ? opts_.name : caller);
  const v1::Envelope reply = call_any([&](size_t) { return req; }).second;
  expect(reply, reply.has_serve_step_reply(), "a step");
  int64_t seen = steps_;
  while (seen < reply.serve_step_reply().step() && !steps_.compare_exchange_weak(seen, reply.serve_step_reply().step())) {
  }
  return reply.serve_step_reply().step();
}

v1::ServeWeightsReply Session::weights() {
  v1::Envelope req;
  req.mutable_serve_weights()->set_job_id(opts_.job);
  v1::Envelope reply = call_any([&](size_t) { return req; }).second;
  expect(reply, reply.has_serve_weights_reply(), "a weight read");
  return std::move(*reply.mutable_serve_weights_reply());
}

}  // namespace moe::client
