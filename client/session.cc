#include "moe/client/session.h"

#include <cstring>

#include "moe/rpc/frame.h"

namespace moe::client {
namespace {

rpc::ClientOptions options_for(const SessionOptions& o, const std::string& address) {
  return rpc::ClientOptions::make(address, o.token, "client", o.name, o.tls);
}

}  // namespace

Session::Session(SessionOptions options) : opts_(std::move(options)) {
  rpc::RpcClient agent(options_for(opts_, opts_.agent));
  v1::Envelope get;
  get.mutable_get_job()->set_job_id(opts_.job);
  const v1::Envelope job = agent.call(get, opts_.timeout);
  if (!job.has_job()) throw rpc::RpcError(v1::ERROR_CODE_INTERNAL, "the agent answered " + rpc::payload_name(job));
  if (job.job().spec().mode() != v1::JobSpec::serve)
    throw rpc::RpcError(v1::ERROR_CODE_FAILED_PRECONDITION, "job " + opts_.job + " is not a serving job (--mode serve)");
  if (job.job().state() != v1::JOB_STATE_RUNNING)
    throw rpc::RpcError(v1::ERROR_CODE_FAILED_PRECONDITION,
                        "job " + opts_.job + " is " + v1::JobState_Name(job.job().state()) + ", not running");
  spec_ = job.job().spec();
  v1::Envelope status;
  status.mutable_cluster_status();
  const v1::Envelope cluster = agent.call(status, opts_.timeout);
  for (const v1::NodeInfo& n : cluster.cluster_status_reply().nodes())
    if (n.state() == v1::NODE_STATE_ALIVE && !n.control_address().empty()) nodes_.push_back(n.control_address());
  if (nodes_.empty()) throw rpc::RpcError(v1::ERROR_CODE_UNAVAILABLE, "job " + opts_.job + ": no node is alive");
}

Session::~Session() = default;

v1::Envelope Session::call_node(v1::Envelope request) {
  const std::string& address = nodes_[next_++ % nodes_.size()];
  std::unique_ptr<rpc::RpcClient> conn;
  {
    std::lock_guard<std::mutex> lock(pool_mu_);
    auto& idle = idle_[address];
    if (!idle.empty()) {
      conn = std::move(idle.back());
      idle.pop_back();
    }
  }
  if (!conn) conn = std::make_unique<rpc::RpcClient>(options_for(opts_, address));
  v1::Envelope reply = conn->call(std::move(request), opts_.timeout);  // a failed call's connection is dropped
  std::lock_guard<std::mutex> lock(pool_mu_);
  idle_[address].push_back(std::move(conn));
  return reply;
}

std::vector<uint8_t> Session::forward_bytes(int layer, const void* x, int64_t rows, v1::JobSpec::DType dtype) {
  const size_t bytes = static_cast<size_t>(rows) * hidden() * (dtype == v1::JobSpec::bf16 ? 2 : 4);
  v1::Envelope req;
  v1::ServeForward* f = req.mutable_serve_forward();
  f->set_job_id(opts_.job);
  f->set_layer(layer);
  f->set_rows(rows);
  f->set_hidden(hidden());
  f->set_dtype(dtype);
  f->set_x(static_cast<const char*>(x), bytes);
  const v1::Envelope reply = call_node(std::move(req));
  if (!reply.has_serve_forward_reply())
    throw rpc::RpcError(v1::ERROR_CODE_INTERNAL, "the node answered " + rpc::payload_name(reply));
  const std::string& y = reply.serve_forward_reply().y();
  if (y.size() != bytes)
    throw rpc::RpcError(v1::ERROR_CODE_INTERNAL, "the node answered " + std::to_string(y.size()) + " bytes for " +
                                                     std::to_string(bytes));
  return {y.begin(), y.end()};
}

std::vector<float> Session::forward(int layer, const std::vector<float>& x) {
  const int64_t rows = hidden() > 0 ? static_cast<int64_t>(x.size()) / hidden() : 0;
  const std::vector<uint8_t> y = forward_bytes(layer, x.data(), rows, v1::JobSpec::fp32);
  std::vector<float> out(y.size() / 4);
  std::memcpy(out.data(), y.data(), y.size());
  return out;
}

}  // namespace moe::client
