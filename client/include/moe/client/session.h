// The expert service's client (docs/serving.md): a program's session with a
// serving job. It finds the job and its nodes through the agent, then calls the
// job's layers on the nodes' daemons over the control plane (the token and TLS
// as every client of it), spreading its calls over the nodes. A library the
// daemon does not need; it links no kernels and no transport.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "moe/rpc/client.h"
#include "moe/v1/job.pb.h"

namespace moe::tensor_wire {
class TensorPort;
}

namespace moe::client {

struct SessionOptions {
  std::string agent;  // HOST:PORT of moe-agent
  std::string token;
  rpc::TlsFiles tls;
  std::string job;  // the serving job's id
  std::string name = "client";
  std::chrono::milliseconds timeout{30000};  // of each call
  // A call whose rows have at least this many bytes sends them, and gets its
  // answer, on the tensor wire (UCX, sealed under a key per session and node;
  // docs/serving.md#data-path); smaller calls carry them. 0: every call;
  // SIZE_MAX: none.
  size_t wire_min_bytes = kWireMinBytes;
  static constexpr size_t kWireMinBytes = 128 << 10;  // measured: docs/serving.md#data-path
};

// Thread-safe: calls from several threads run at once, one connection per node
// each (a connection carries one call at a time).
//
// Nodes come and go under an elastic job (docs/serving.md#elastic-serving): a
// forward call, a step or a weight read whose node cannot be reached (or no
// longer runs the job) is sent to the next node, within the call's timeout; the
// session asks the agent for the job's nodes again when none is left. A forward
// is a pure function of its rows and a step names its number (the job applies
// it once), so sending one again changes nothing. A backward call goes to the
// node that holds its handle, and fails if that node is gone.
class Session {
 public:
  // Waits (up to the timeout) for a queued job to start. Throws rpc::RpcError:
  // the agent unreachable, no such job, or one that is not a running serving job.
  explicit Session(SessionOptions options);
  ~Session();

  const v1::JobSpec& spec() const { return spec_; }
  int hidden() const { return spec_.hidden(); }
  int layers() const { return spec_.layers(); }

  // The layer's output for x [rows, hidden] in the job's dtype (its bytes,
  // row-major). Throws moe::InvalidArgument for rows < 1, rpc::RpcError with what
  // the job refused (the field and why) or why the call failed (UNAVAILABLE: the
  // node's queue is full, or the job stopped).
  std::vector<uint8_t> forward_bytes(int layer, const void* x, int64_t rows, v1::JobSpec::DType dtype);
  // An fp32 job's layer on fp32 rows.
  std::vector<float> forward(int layer, const std::vector<float>& x);

  // Training (a job submitted with --serve-train; docs/serving.md#training).
  // A forward kept for one backward: the rows stay on the node that answered,
  // under the handle.
  struct Handle {
    size_t node = 0;  // index into the session's nodes
    uint64_t id = 0;
    int layer = 0;
    int64_t rows = 0;
  };
  struct Kept {
    std::vector<uint8_t> y;
    Handle handle;
  };
  Kept forward_kept(int layer, const void* x, int64_t rows, v1::JobSpec::DType dtype);
  // The gradient of the forward's input for grad_y [rows, hidden] (the gradient
  // of its output); the layer's weight gradients add up on the cluster until
  // step(). The handle is spent, also when the call fails.
  std::vector<uint8_t> backward_bytes(const Handle& handle, const void* grad_y, v1::JobSpec::DType dtype);
  // One optimizer step on the gradients summed since the last: applied once
  // `clients` callers (each a distinct `caller`, default the session's name)
  // asked for it. Returns the job's optimizer steps. Asking again after a lost
  // reply applies nothing twice.
  int64_t step(int clients = 1, const std::string& caller = "");
  // Every layer's weights as the job computes with them (fp32 masters when it trains).
  v1::ServeWeightsReply weights();
  // The job's optimizer steps, as the session last heard.
  int64_t steps() const { return steps_; }

 private:
  using Clock = std::chrono::steady_clock;
  rpc::ClientOptions options_for(const std::string& address) const;
  v1::JobResult running_job(rpc::RpcClient& agent) const;
  // The job's alive nodes the agent knows, added to nodes_ (indices stay).
  void find_nodes();
  void wait_until_nodes_run_it();
  Kept forward_call(int layer, const void* x, int64_t rows, v1::JobSpec::DType dtype, bool keep);
  // The call on the next node in turn that is not marked away; on to the next
  // when a node cannot be reached or does not run the job (until `until`).
  // Returns the node that answered and its reply.
  // `request` builds the call for each attempt (a call's rows are copied once an attempt).
  std::pair<size_t, v1::Envelope> call_any(const std::function<v1::Envelope(size_t node)>& request);
  // The next node in turn not marked away; kNone when every one is.
  size_t next_node();
  static constexpr size_t kNone = ~size_t{0};
  // One call on `node`, on a connection of the pool (a new one when every
  // connection to that node is in use).
  v1::Envelope call_node(size_t node, v1::Envelope request);
  // The reply's payload, or an RpcError naming what came instead.
  static void expect(const v1::Envelope& reply, bool has, const char* what);

  // The tensor wire (docs/serving.md#data-path): a call's rows sent to `node`
  // on it (the wire to that node opened on first use), and the answer taken.
  // A failure is an unreached node's (RpcError::unreached()).
  struct WireCall {
    uint32_t link = 0;       // our id for the node
    uint32_t node_peer = 0;  // the node's id for us
    uint32_t seq = 0;
  };
  bool on_wire(size_t bytes) const { return bytes >= opts_.wire_min_bytes; }
  WireCall send_on_wire(size_t node, const void* rows, size_t bytes);
  WireCall open_wire(size_t node);
  std::string take_from_wire(const WireCall& call, size_t bytes);
  // The node no longer knows our wire (it restarted, or closed it): the next call opens it again.
  void forget_wire(size_t node);
  static bool is_no_wire(const rpc::RpcError& e);

  SessionOptions opts_;
  const std::string session_id_;  // Hello.session of every connection
  v1::JobSpec spec_;
  std::atomic<int64_t> steps_{0};
  std::mutex mu_;  // what follows
  std::vector<std::string> nodes_;     // control addresses of the job's nodes, only ever added to
  std::vector<Clock::time_point> away_;  // per node: skipped until then (it failed a call)
  size_t next_ = 0;
  std::map<std::string, std::vector<std::unique_ptr<rpc::RpcClient>>> idle_;  // by node address
  std::unique_ptr<tensor_wire::TensorPort> wire_;  // made at the first call on the wire
  std::map<size_t, WireCall> links_;  // by node: the open wire (seq: the last used)
  uint32_t next_link_ = 1;
};

}  // namespace moe::client
