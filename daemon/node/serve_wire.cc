// The daemon's side of the tensor wire (docs/serving.md#data-path): a client
// session opens it on a control-plane call and gets the node's UCX address, its
// id and a fresh key; a call that names its wire peer and a sequence then has its
// rows sent there, sealed, and gets its answer back the same way. A session's
// wire peers close with its last connection to the node.
#include "moe/base/check.h"
#include "moe/layer_spec/job_layers.h"
#include "moe/node/daemon.h"
#include "serve_completion.h"

namespace moe::node {

using rpc::RpcError;

namespace {

constexpr size_t kMaxWireSessions = 256;  // open wire peers a node keeps
// A session's rows waiting on the wire for their calls, in the node's largest calls.
constexpr size_t kUnclaimedCalls = 8;

struct WireCall {
  uint32_t peer = 0, seq = 0;
  int64_t rows = 0;
  int hidden = 0;
  v1::JobSpec::DType dtype = v1::JobSpec::fp32;
};

WireCall wire_call_of(const v1::Envelope& req) {
  if (req.has_serve_forward()) {
    const v1::ServeForward& f = req.serve_forward();
    return {f.wire_peer(), f.wire_seq(), f.rows(), f.hidden(), f.dtype()};
  }
  if (req.has_serve_backward()) {
    const v1::ServeBackward& b = req.serve_backward();
    return {b.wire_peer(), b.wire_seq(), b.rows(), b.hidden(), b.dtype()};
  }
  return {};
}

size_t dtype_bytes(v1::JobSpec::DType dtype) { return dtype == v1::JobSpec::bf16 ? 2 : 4; }

}  // namespace

bool Daemon::is_wire_call(const v1::Envelope& req) { return wire_call_of(req).seq > 0; }

rpc::awaitable<v1::Envelope> Daemon::serve_open_wire(const v1::ServeOpenWire& call, const rpc::RequestContext& ctx) {
  if (ctx.client_session.empty())
    throw InvalidArgument("the tensor wire opens for a client session only (Hello.session is empty)");
  if (call.client_peer() == 0 || call.client_peer() > tensor_wire::kMaxPeerId)
    throw InvalidArgument("client_peer: must be 1.." + std::to_string(tensor_wire::kMaxPeerId) + ", got " +
                          std::to_string(call.client_peer()));
  if (call.client_address().empty()) throw InvalidArgument("client_address: empty");
  const tensor_wire::Key key = tensor_wire::new_key();
  v1::Envelope reply;
  std::lock_guard<std::mutex> lock(mu_);
  ServingNode& node = serving_node(call.job_id());
  if (wire_peers_.size() >= kMaxWireSessions)
    throw RpcError(v1::ERROR_CODE_UNAVAILABLE, "the tensor wire of " + opts_.name + " has " +
                                                   std::to_string(kMaxWireSessions) + " sessions open");
  const layer_spec::JobView job(runner_->spec());
  const size_t max_message = static_cast<size_t>(node.limits.call_rows) * job.shape.hidden * 4;  // fp32 at most
  if (!wire_) wire_ = std::make_unique<tensor_wire::TensorPort>(tensor_wire::PortOptions{tensor_wire::Direction::kToNode});
  const uint32_t id = wire_->add_peer(call.client_address(), key, max_message, kUnclaimedCalls * max_message);
  wire_peers_[id] = WirePeer{ctx.client_session, call.job_id(), call.client_peer()};
  watch_session(node, call.job_id(), ctx);
  v1::ServeOpenWireReply* r = reply.mutable_serve_open_wire_reply();
  r->set_node_address(wire_->address());
  r->set_node_peer(id);
  r->set_key(key.data(), key.size());
  co_return reply;
}

void Daemon::close_wire_peers(const std::string& session) {
  for (auto it = wire_peers_.begin(); it != wire_peers_.end();) {
    if (it->second.session != session) {
      ++it;
      continue;
    }
    wire_->remove_peer(it->first);
    it = wire_peers_.erase(it);
  }
}

rpc::awaitable<v1::Envelope> Daemon::with_wire_rows(const v1::Envelope& req, const rpc::RequestContext& ctx) {
  const WireCall w = wire_call_of(req);
  // The byte count comes from the call's own fields; make_serve_call checks them against the job.
  if (w.rows < 1 || w.rows > (int64_t{1} << 24)) throw InvalidArgument("rows: must be 1..2^24, got " + std::to_string(w.rows));
  if (w.hidden < 1 || w.hidden > (1 << 20)) throw InvalidArgument("hidden: must be 1..2^20, got " + std::to_string(w.hidden));
  const size_t bytes = static_cast<size_t>(w.rows) * w.hidden * dtype_bytes(w.dtype);
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = wire_peers_.find(w.peer);
    if (it == wire_peers_.end() || it->second.session != ctx.client_session)
      throw RpcError(v1::ERROR_CODE_FAILED_PRECONDITION, std::string(tensor_wire::kNoWire) + " " +
                                                             std::to_string(w.peer) + " of this session on " +
                                                             opts_.name + ": open it again (ServeOpenWire)");
  }
  auto done = std::make_shared<ServeCompletion>(io_);
  auto rows = std::make_shared<std::string>();  // written before done->end posts
  wire_->expect(w.peer, tensor_wire::make_tag(tensor_wire::Direction::kToNode, w.peer, w.seq), bytes, ctx.deadline,
                [done, rows](const std::string& error, std::string data) {
                  *rows = std::move(data);
                  done->end(error);
                });
  if (!co_await done->wait(ctx.deadline))
    throw RpcError(v1::ERROR_CODE_DEADLINE_EXCEEDED, "the call's rows did not arrive on the tensor wire in time");
  if (!done->error().empty())
    throw RpcError(v1::ERROR_CODE_UNAVAILABLE, "the call's rows on the tensor wire: " + done->error());
  v1::Envelope filled = req;
  if (filled.has_serve_forward())
    filled.mutable_serve_forward()->set_x(std::move(*rows));
  else
    filled.mutable_serve_backward()->set_grad_y(std::move(*rows));
  co_return filled;
}

rpc::awaitable<void> Daemon::wire_answer(const v1::Envelope& req, const std::string& bytes, const rpc::RequestContext& ctx) {
  const WireCall w = wire_call_of(req);
  uint32_t client_peer = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = wire_peers_.find(w.peer);
    if (it == wire_peers_.end())
      throw RpcError(v1::ERROR_CODE_UNAVAILABLE, "the session's tensor wire closed before its answer went");
    client_peer = it->second.client_peer;
  }
  auto done = std::make_shared<ServeCompletion>(io_);
  wire_->send(w.peer, tensor_wire::make_tag(tensor_wire::Direction::kToClient, client_peer, w.seq), bytes.data(),
              bytes.size(), [done](const std::string& error) { done->end(error); });
  if (!co_await done->wait(ctx.deadline))
    throw RpcError(v1::ERROR_CODE_DEADLINE_EXCEEDED, "the answer did not leave on the tensor wire in time");
  if (!done->error().empty())
    throw RpcError(v1::ERROR_CODE_UNAVAILABLE, "the answer on the tensor wire: " + done->error());
}

}  // namespace moe::node
