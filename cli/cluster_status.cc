// moectl cluster status.
#include "moe/ctl/json.h"
#include "agent_call.h"
#include "format.h"
#include "moe/spec/job_spec.h"

namespace moe::ctl {
namespace {

// "cuda (fp32=cublas bf16=cublas) on 8x NVIDIA H200"
std::string backend_name(const v1::NodeInfo& n) {
  std::string s = n.backend() == v1::BACKEND_CUDA ? "cuda" : n.backend() == v1::BACKEND_CPU ? "cpu" : "?";
  if (!n.gemm_engine().empty()) s += " (" + n.gemm_engine() + ")";
  // Runs of equal names as "Nx name" (a node's GPUs are usually all alike).
  for (int i = 0; i < n.device_names_size();) {
    int j = i;
    while (j < n.device_names_size() && n.device_names(j) == n.device_names(i)) ++j;
    s += (i == 0 ? " on " : ", ") + std::to_string(j - i) + "x " + n.device_names(i);
    i = j;
  }
  return s;
}

}  // namespace

int cluster_status(const Globals& g, std::ostream& out, std::ostream& err) {
  return with_agent(g, err, [&](rpc::RpcClient& c, const Resolved& r) {
    v1::Envelope req;
    req.mutable_cluster_status();
    const v1::ClusterStatus st = c.call(req, g.timeout).cluster_status_reply();
    if (g.json) {
      out << to_json(st) << "\n";
      return kExitOk;
    }
    out << "agent " << r.agent << " (metrics " << (st.agent_metrics_address().empty() ? "off" : st.agent_metrics_address())
        << "), world " << ranks_text(st.registered_ranks(), st.world_size()) << ", "
        << (st.running_job().empty() ? "idle" : "running " + st.running_job()) << ", " << st.queued_jobs()
        << " queued\n";
    if (!st.state_error().empty())
      out << "WARNING: the agent cannot write its state directory since " << local_time(st.state_error_since_unix_ms())
          << " (" << st.state_error() << "): a restarted agent would lose what changed since\n";
    if (st.nodes_size() == 0) out << "no node has registered yet\n";
    std::vector<std::vector<std::string>> rows = {
        {"NODE", "NAME", "STATE", "RANKS", "BACKEND", "CONTROL", "METRICS", "HEARTBEAT"}};
    for (const auto& n : st.nodes())
      rows.push_back({std::to_string(n.node_index()), n.name(), short_enum_name(*v1::NodeState_descriptor()->FindValueByNumber(n.state())),
                      std::to_string(n.rank_base()) + "-" + std::to_string(n.rank_base() + n.devices() - 1),
                      backend_name(n), n.control_address(), n.metrics_address().empty() ? "off" : n.metrics_address(),
                      n.state() == v1::NODE_STATE_DEAD && n.dead_since_unix_ms() > 0
                          ? "dead since " + local_time(n.dead_since_unix_ms())
                          : fmt(n.last_heartbeat_age_seconds(), 2) + "s ago"});
    print_table(out, rows);
    return kExitOk;
  });
}

}  // namespace moe::ctl
