// moed, the node daemon: serves the agent on a control port (start/cancel a job,
// status), registers with the agent and sends heartbeats (re-registering when the
// agent forgets it or restarted), runs at most one job at a time on its devices,
// and exposes Prometheus metrics. While the agent is away the job runs on and its
// reports are held; past --agent-grace the job stops at the next step boundary. Stops cleanly on SIGTERM (the job's ranks stop at the next
// step boundary).
#pragma once

#include <atomic>
#include <map>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "moe/metrics/daemon_metrics.h"
#include "moe/node/job_runner.h"
#include "moe/rpc/server.h"
#include "moe/tensor_wire/tensor_port.h"

namespace moe::node {

struct DaemonOptions {
  std::string agent;              // HOST:PORT
  std::string token;
  rpc::TlsFiles tls;  // empty: plain TCP (--plaintext)
  std::string name;               // stable node name (default: host name + control port)
  int devices = 0;                // EP ranks here; 0: one per GPU (cuda), 1 (cpu)
  std::string backend = "auto";   // auto | cpu | cuda
  // Makes the ranks' backends; empty: the one --backend names. (Tests pass their own.)
  BackendFactory make_backend;
  std::string listen = "127.0.0.1:0";
  std::string metrics;            // "" (off), "PORT" or "HOST:PORT"
  int threads = 0;                // cores to use; 0 = all
  std::chrono::milliseconds register_timeout{30000};
  std::chrono::milliseconds transport_timeout{30000};
  // How long a job runs on while the agent cannot be reached (its reports held).
  std::chrono::milliseconds agent_grace{30000};
  // How long a stopping daemon waits for its job's ranks to reach a step boundary
  // before it aborts their transfers (docs/architecture.md#processes).
  std::chrono::milliseconds stop_grace{5000};
};

// What --backend resolved to on this machine.
struct BackendChoice {
  v1::Backend kind = v1::BACKEND_UNSPECIFIED;
  std::string name;         // "cpu", "cuda"
  std::string gemm_engine;  // the backend's GEMM engine per dtype
  std::vector<std::string> device_names;  // the GPUs (one rank each), or the CPU model
  BackendFactory make;
};

// Resolves auto | cpu | cuda for `devices` ranks (0: one per GPU). auto is CUDA
// where this build has it and the visible GPUs can hold the ranks (one each),
// else the CPU; throws moe::InvalidArgument naming why the backend
// cannot run here (a CUDA request without a CUDA build or device).
BackendChoice resolve_backend(const std::string& requested, BackendFactory override_factory = {}, int devices = 0);

// The ranks a daemon runs: --devices, or with 0 one per GPU (cuda) or 1 (cpu).
// Throws moe::InvalidArgument when a CUDA daemon asks for more ranks
// than it sees GPUs (two ranks cannot share one).
int resolve_devices(int requested, const BackendChoice& backend);

class Daemon {
 public:
  Daemon(rpc::asio::io_context& io, DaemonOptions options);
  ~Daemon();
  // Stops heartbeats, cancels and joins a running job, stops serving.
  void stop();
  const BackendChoice& backend() const { return backend_; }
  std::string metrics_address() const;  // "" when off

 private:
  rpc::awaitable<v1::Envelope> handle(const v1::Envelope& req, const rpc::RequestContext& ctx);
  // A program's call of a serving job (docs/serving.md; daemon/node/serve_calls.cc):
  // queued for the node's ranks; the reply once they ran it, or its error.
  static bool is_serve_call(const v1::Envelope& req);
  rpc::awaitable<v1::Envelope> serve_call(const v1::Envelope& req, const rpc::RequestContext& ctx);
  rpc::awaitable<v1::Envelope> serve_rows(const v1::Envelope& req, const rpc::RequestContext& ctx);
  void watch_session(ServingNode& node, const std::string& job_id, const rpc::RequestContext& ctx);  // under mu_
  rpc::awaitable<v1::Envelope> serve_step(const v1::ServeStep& call, const rpc::RequestContext& ctx);
  rpc::awaitable<v1::Envelope> serve_weights(const v1::ServeWeights& call, const rpc::RequestContext& ctx);
  // The tensor wire (docs/serving.md#data-path; daemon/node/serve_wire.cc): a
  // client session's large rows over UCX, sealed under a key given here.
  static bool is_wire_call(const v1::Envelope& req);  // a rows call whose rows are on the wire
  rpc::awaitable<v1::Envelope> serve_open_wire(const v1::ServeOpenWire& call, const rpc::RequestContext& ctx);
  // A rows call whose rows are on the wire: `req` with them filled in (awaited).
  rpc::awaitable<v1::Envelope> with_wire_rows(const v1::Envelope& req, const rpc::RequestContext& ctx);
  // Sends a call's answer back on the wire (awaited until it left).
  rpc::awaitable<void> wire_answer(const v1::Envelope& req, const std::string& bytes, const rpc::RequestContext& ctx);
  void close_wire_peers(const std::string& session);  // under mu_
  // Under mu_: the node's state of serving job `job_id`, or the RpcError saying why none.
  ServingNode& serving_node(const std::string& job_id);
  // Under mu_: the same, or null once the job is gone (a call ending after it).
  ServingNode* serving_node_if(const std::string& job_id);
  void start_job(const v1::StartJob& start);
  void heartbeat_loop();
  void register_once(rpc::RpcClient& agent);
  // Past the grace without the agent, the running job stops.
  void check_agent_grace();

  rpc::asio::io_context& io_;
  DaemonOptions opts_;
  BackendChoice backend_;
  FaultInjection faults_;  // test hooks
  AgentLink link_;
  std::unique_ptr<metrics::DaemonMetrics> metrics_;
  std::unique_ptr<rpc::RpcServer> server_;
  std::mutex mu_;  // guards runner_, node_index_, stopping_
  std::condition_variable stop_cv_;
  std::unique_ptr<JobRunner> runner_;
  // The tensor wire, made at the first ServeOpenWire, and its peers (client
  // sessions) by the node's id for them. Under mu_.
  struct WirePeer {
    std::string session, job_id;
    uint32_t client_peer = 0;  // the client's id for this node
  };
  std::unique_ptr<tensor_wire::TensorPort> wire_;
  std::map<uint32_t, WirePeer> wire_peers_;
  int node_index_ = -1;
  int64_t heartbeat_ms_ = 500;
  bool stopping_ = false;
  std::thread heartbeat_;
};

}  // namespace moe::node
