#include "moe/node/daemon.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "moe/base/check.h"
#include "moe/kernels/cpu_backend.h"
#ifdef MOE_WITH_CUDA
#include "moe/kernels/cuda_device.h"
#endif
#include "moe/base/log.h"

namespace moe::node {

using rpc::RpcError;

namespace {

std::string host_name() {
  char buf[256] = {};
  ::gethostname(buf, sizeof buf - 1);
  return buf;
}

#ifdef MOE_WITH_CUDA
std::vector<std::string> gpu_names() {
  std::vector<std::string> names;
  for (const kernels::CudaDeviceInfo& d : kernels::cuda_devices()) names.push_back(d.name);
  return names;
}
#else
std::vector<std::string> gpu_names() { return {}; }
#endif

BackendChoice cuda_choice(std::vector<std::string> gpus) {
  BackendChoice c;
  c.kind = v1::BACKEND_CUDA;
  c.device_names = std::move(gpus);
#ifdef MOE_WITH_CUDA
  c.make = [](kernels::ThreadPool&, int device) { return kernels::make_cuda_backend(device); };
#endif
  return c;
}

BackendChoice cpu_choice() {
  BackendChoice c;
  c.kind = v1::BACKEND_CPU;
  c.device_names = {kernels::cpu_backend_info().cpu_model};
  c.make = [](kernels::ThreadPool& pool, int) { return kernels::make_cpu_backend(pool); };
  return c;
}

}  // namespace

BackendChoice resolve_backend(const std::string& requested, BackendFactory override_factory, int devices) {
  if (requested != "cpu" && requested != "auto" && requested != "cuda")
    throw InvalidArgument("--backend must be auto, cpu or cuda, got '" + requested + "'");
  std::vector<std::string> gpus = gpu_names();
  if (requested == "cuda") {
#ifndef MOE_WITH_CUDA
    throw InvalidArgument(
                   "--backend cuda: this moed was built without CUDA (nvcc was not found at build time); use cpu");
#endif
    if (gpus.empty())
      throw InvalidArgument("--backend cuda: no CUDA device is visible here; use cpu");
  }
  const bool fits = !gpus.empty() && devices <= static_cast<int>(gpus.size());
  if (requested == "auto" && !gpus.empty() && !fits)
    log::warn("--backend auto: ", devices, " ranks, ", gpus.size(), " GPUs visible (one rank each); using the CPU backend");
  const bool cuda = requested == "cuda" || (requested == "auto" && fits);
  const bool overridden = static_cast<bool>(override_factory);
  BackendChoice c = cuda ? cuda_choice(std::move(gpus)) : cpu_choice();
  if (overridden) c.make = std::move(override_factory);
  // What runs is what registers: ask a backend of the factory itself. A GPU the
  // CUDA backend cannot run on (not sm_90) is an error for --backend cuda; auto
  // then runs on the CPU instead.
  kernels::ThreadPool probe(1);
  std::unique_ptr<kernels::Backend> be;
  try {
    be = c.make(probe, 0);
  } catch (const std::exception& e) {
    if (!cuda || overridden) throw;
    if (requested == "cuda") throw InvalidArgument(std::string("--backend cuda: ") + e.what());
    log::warn("--backend auto: ", e.what(), "; using the CPU backend");
    c = cpu_choice();
    be = c.make(probe, 0);
  }
  c.name = be->name();
  c.gemm_engine = be->gemm_engine();
  return c;
}

int resolve_devices(int requested, const BackendChoice& backend) {
  if (requested < 0) throw InvalidArgument("--devices must be >= 0, got " + std::to_string(requested));
  if (backend.kind != v1::BACKEND_CUDA) return requested == 0 ? 1 : requested;
  const int gpus = static_cast<int>(backend.device_names.size());
  if (requested > gpus)
    throw InvalidArgument("--devices " + std::to_string(requested) + ": only " +
                                                        std::to_string(gpus) +
                                                        " CUDA devices are visible (one rank per GPU)");
  return requested == 0 ? gpus : requested;
}

Daemon::Daemon(rpc::asio::io_context& io, DaemonOptions options) : io_(io), opts_(std::move(options)) {
  backend_ = resolve_backend(opts_.backend, opts_.make_backend, opts_.devices);
  opts_.devices = resolve_devices(opts_.devices, backend_);
  if (opts_.threads <= 0) opts_.threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  server_ = std::make_unique<rpc::RpcServer>(
      io_, rpc::ServerOptions::make(opts_.listen, opts_.token, "moed", opts_.tls), [this](const v1::Envelope& req, const rpc::RequestContext& ctx) { return handle(req, ctx); });
  if (opts_.name.empty()) opts_.name = host_name() + ":" + std::to_string(server_->port());
  if (const char* f = std::getenv("MOE_FAULT_INJECT")) faults_ = FaultInjection::parse(f, opts_.name);
  if (!opts_.metrics.empty()) {
    metrics_ = std::make_unique<metrics::DaemonMetrics>(opts_.metrics);
    metrics_->set_build_info(MOE_VERSION, backend_.name, backend_.gemm_engine);
  }
  log::init("moed", opts_.name);
  log::info("serving the agent on ", server_->address(), ", ", opts_.devices, " ", backend_.name, " device(s) (",
            backend_.gemm_engine, "; ", backend_.device_names.empty() ? "?" : backend_.device_names[0], "), ",
            opts_.threads, " threads",
            metrics_ ? ", metrics on " + metrics_->address() : "");
  heartbeat_ = std::thread([this] { heartbeat_loop(); });
}

Daemon::~Daemon() { stop(); }

std::string Daemon::metrics_address() const { return metrics_ ? metrics_->address() : ""; }

void Daemon::stop() {
  std::unique_ptr<JobRunner> runner;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
    runner = std::move(runner_);
  }
  stop_cv_.notify_all();
  if (heartbeat_.joinable()) heartbeat_.join();
  runner.reset();  // cancels and joins the ranks
  rpc::asio::post(io_, [this] { server_->stop(); });
}

void Daemon::register_once(rpc::RpcClient& agent) {
  v1::Envelope req;
  auto* r = req.mutable_register_node();
  r->set_name(opts_.name);
  r->set_devices(opts_.devices);
  r->set_backend(backend_.kind);
  r->set_gemm_engine(backend_.gemm_engine);
  for (int i = 0; i < opts_.devices; ++i)  // this node's ranks' devices: its GPUs, or the CPU
    r->add_device_names(backend_.device_names[std::min<size_t>(i, backend_.device_names.size() - 1)]);
  r->set_control_address(server_->advertised_address());
  r->set_metrics_address(metrics_address());
  r->set_host(host_name());
  {
    // Until the agent recorded the job's end, its reports (re-sent after this)
    // keep the node busy with it.
    std::lock_guard<std::mutex> lock(mu_);
    if (runner_ && (!runner_->finished() || !runner_->settled())) r->set_running_job(runner_->job_id());
  }
  const v1::Envelope reply = agent.call(req, std::chrono::seconds(5));
  const int64_t before = link_.incarnation();
  link_.registered(reply.register_node_reply().agent_incarnation());
  std::lock_guard<std::mutex> lock(mu_);
  // A new agent knows nothing of a rebalance the old one had in flight: what this
  // node staged for it will never be committed, so the job drops it.
  if (runner_ && before != 0 && before != link_.incarnation()) runner_->rebalance_mailbox().abandon("the agent restarted");
  node_index_ = reply.register_node_reply().node_index();
  heartbeat_ms_ = std::max<int64_t>(50, reply.register_node_reply().heartbeat_interval_ms());
  log::set_identity(opts_.name + "/node" + std::to_string(node_index_));
  log::info("registered as node ", node_index_, " (ranks ", reply.register_node_reply().rank_base(), "-",
            reply.register_node_reply().rank_base() + opts_.devices - 1, ")");
}

void Daemon::heartbeat_loop() {
  rpc::RpcClient agent(rpc::ClientOptions::make(opts_.agent, opts_.token, "moed", opts_.name, opts_.tls));
  const auto started = std::chrono::steady_clock::now();
  bool registered = false;
  std::string last_error;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (stopping_) return;
    }
    try {
      if (!registered) {
        register_once(agent);
        registered = true;
      } else {
        v1::Envelope hb;
        hb.mutable_heartbeat()->set_node_index(node_index_);
        hb.mutable_heartbeat()->set_name(opts_.name);
        const v1::HeartbeatReply reply = agent.call(hb, std::chrono::seconds(2)).heartbeat_reply();
        link_.reached();
        if (!reply.known() || reply.agent_incarnation() != link_.incarnation()) {
          log::warn(reply.known() ? "the agent restarted" : "the agent does not know this node",
                    ": registering again");
          registered = false;
          continue;
        }
      }
      last_error.clear();
    } catch (const RpcError& e) {
      if (e.code() == v1::ERROR_CODE_UNAVAILABLE || e.code() == v1::ERROR_CODE_DEADLINE_EXCEEDED) {
        link_.unreachable(std::chrono::steady_clock::now());
        check_agent_grace();
      }
      if (e.what() != last_error) log::warn("agent ", opts_.agent, ": ", e.what());
      last_error = e.what();
      if (!registered && std::chrono::steady_clock::now() - started > opts_.register_timeout &&
          e.code() != v1::ERROR_CODE_UNAVAILABLE && e.code() != v1::ERROR_CODE_DEADLINE_EXCEEDED)
        log::error("registration refused: ", e.what());
    }
    std::unique_lock<std::mutex> lock(mu_);
    stop_cv_.wait_for(lock, std::chrono::milliseconds(heartbeat_ms_), [&] { return stopping_; });
  }
}

void Daemon::check_agent_grace() {
  const auto away = link_.unreachable_for(std::chrono::steady_clock::now());
  if (away <= opts_.agent_grace) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (!runner_ || runner_->finished()) return;
  char seconds[32];
  std::snprintf(seconds, sizeof seconds, "%.1f", std::chrono::duration<double>(away).count());
  runner_->stop_for_agent("agent unreachable for " + std::string(seconds) + " s");
}

void Daemon::start_job(const v1::StartJob& start) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_) throw RpcError(v1::ERROR_CODE_UNAVAILABLE, "daemon " + opts_.name + " is stopping");
  if (runner_ && !runner_->finished())
    throw RpcError(v1::ERROR_CODE_FAILED_PRECONDITION, "daemon " + opts_.name + " is running " + runner_->job_id());
  if (node_index_ < 0) throw RpcError(v1::ERROR_CODE_FAILED_PRECONDITION, "daemon " + opts_.name + " is not registered");
  runner_.reset();  // joins the finished previous job's threads
  RunnerEnv env;
  env.agent_address = opts_.agent;
  env.token = opts_.token;
  env.tls = opts_.tls;
  env.node_name = opts_.name;
  env.node_index = node_index_;
  env.devices = opts_.devices;
  env.threads_per_rank = std::max(1, opts_.threads / opts_.devices);
  env.make_backend = backend_.make;
  env.metrics = metrics_.get();
  env.transport_timeout = opts_.transport_timeout;
  env.stop_grace = opts_.stop_grace;
  env.faults = faults_;
  env.link = &link_;
  log::info("starting ", start.job_id(), " as ranks ", node_index_ * opts_.devices, "-",
            (node_index_ + 1) * opts_.devices - 1, " of ", start.world_size());
  runner_ = std::make_unique<JobRunner>(start, env);
}

rpc::awaitable<v1::Envelope> Daemon::handle(const v1::Envelope& req, const rpc::RequestContext& ctx) {
  if (is_serve_call(req)) co_return co_await serve_call(req, ctx);
  v1::Envelope reply;
  if (req.has_start_job()) {
    start_job(req.start_job());
    reply.mutable_ack();
  } else if (req.has_prepare_rebalance() || req.has_commit_rebalance() || req.has_abort_rebalance()) {
    if (req.has_commit_rebalance() && faults_.die_on_commit) {
      log::error("MOE_FAULT_INJECT die-on-commit: exiting on COMMIT epoch ", req.commit_rebalance().epoch());
      std::_Exit(137);  // as if SIGKILLed: no reply, no cleanup
    }
    std::lock_guard<std::mutex> lock(mu_);
    const std::string& job = RebalanceMailbox::job_of(req);
    if (!runner_ || runner_->job_id() != job || (req.has_prepare_rebalance() && runner_->finished()))
      throw RpcError(v1::ERROR_CODE_FAILED_PRECONDITION, "job " + job + " is not running on " + opts_.name);
    runner_->rebalance_mailbox().deliver(req);
    reply.mutable_ack();
  } else if (req.has_cancel_job()) {
    std::lock_guard<std::mutex> lock(mu_);
    if (runner_ && runner_->job_id() == req.cancel_job().job_id()) {
      if (req.cancel_job().failed())
        runner_->fail(req.cancel_job().reason());
      else
        runner_->cancel(req.cancel_job().reason());
    }
    reply.mutable_ack();
  } else if (req.has_halt_world() || req.has_new_world()) {  // elastic jobs (docs/jobs.md#elastic-jobs)
    std::lock_guard<std::mutex> lock(mu_);
    const std::string& job = req.has_halt_world() ? req.halt_world().job_id() : req.new_world().job_id();
    if (!runner_ || runner_->job_id() != job || runner_->finished())
      throw RpcError(v1::ERROR_CODE_FAILED_PRECONDITION, "job " + job + " is not running on " + opts_.name);
    if (req.has_halt_world())
      runner_->halt(req.halt_world().world_epoch(), req.halt_world().reason());
    else
      runner_->new_world(req.new_world());
    reply.mutable_ack();
  } else if (req.has_daemon_status()) {
    std::lock_guard<std::mutex> lock(mu_);
    auto* s = reply.mutable_daemon_status_reply();
    s->set_name(opts_.name);
    s->set_node_index(node_index_);
    s->set_devices(opts_.devices);
    if (runner_ && !runner_->finished()) s->set_running_job(runner_->job_id());
    if (runner_ && runner_->serving()) s->set_serve_steps(runner_->serving()->requests.steps());
  } else {
    throw InvalidArgument("moed does not serve " + rpc::payload_name(req));
  }
  co_return reply;
}

}  // namespace moe::node
