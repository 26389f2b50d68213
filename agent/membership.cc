#include "moe/agent/membership.h"

#include <algorithm>

#include "moe/rpc/frame.h"

namespace moe::agent {

using rpc::RpcError;

const NodeRecord& Membership::register_node(const v1::RegisterNodeRequest& r, bool job_running, Clock::time_point now) {
  if (r.name().empty()) throw RpcError(v1::ERROR_CODE_INVALID_ARGUMENT, "name: a node needs a name");
  if (r.devices() < 1) throw RpcError(v1::ERROR_CODE_INVALID_ARGUMENT, "devices: must be >= 1");
  if (devices_per_node_ == 0) devices_per_node_ = r.devices();
  if (r.devices() != devices_per_node_)
    throw RpcError(v1::ERROR_CODE_FAILED_PRECONDITION,
                   "devices: node " + r.name() + " has " + std::to_string(r.devices()) + ", the cluster's nodes have " +
                       std::to_string(devices_per_node_));
  auto it = std::find_if(nodes_.begin(), nodes_.end(), [&](const NodeRecord& n) { return n.name == r.name(); });
  if (it == nodes_.end()) {
    if (job_running)
      throw RpcError(v1::ERROR_CODE_UNAVAILABLE, "a job is running; node " + r.name() + " can join when it ends");
    NodeRecord n;
    n.name = r.name();
    n.index = static_cast<int>(nodes_.size());
    nodes_.push_back(n);
    it = nodes_.end() - 1;
  }
  NodeRecord& n = *it;
  n.state = v1::NODE_STATE_ALIVE;
  // A restarted daemon runs nothing; one we took for dead may still be winding
  // down a job, and stays busy until its ranks report.
  n.busy_job = r.running_job();
  n.busy_ranks = r.running_job().empty() ? 0 : r.devices();
  n.devices = r.devices();
  n.backend = r.backend();
  n.gemm_engine = r.gemm_engine();
  n.control_address = r.control_address();
  n.metrics_address = r.metrics_address();
  n.last_heartbeat = now;
  return n;
}

bool Membership::heartbeat(const v1::HeartbeatRequest& r, Clock::time_point now) {
  const bool known = r.node_index() >= 0 && r.node_index() < num_nodes() && nodes_[r.node_index()].name == r.name() &&
                     nodes_[r.node_index()].state == v1::NODE_STATE_ALIVE;
  if (known) nodes_[r.node_index()].last_heartbeat = now;
  return known;
}

std::vector<int> Membership::expire(Clock::time_point now) {
  std::vector<int> dead;
  for (NodeRecord& n : nodes_) {
    if (n.state != v1::NODE_STATE_ALIVE || now - n.last_heartbeat <= heartbeat_timeout_) continue;
    n.state = v1::NODE_STATE_DEAD;
    n.busy_job.clear();
    n.busy_ranks = 0;
    dead.push_back(n.index);
  }
  return dead;
}

void Membership::mark_busy(const std::string& job_id) {
  for (NodeRecord& n : nodes_) {
    n.busy_job = job_id;
    n.busy_ranks = devices_per_node_;
  }
}

bool Membership::rank_done(const std::string& job_id, int rank) {
  if (devices_per_node_ <= 0 || rank < 0) return false;
  const int node = rank / devices_per_node_;
  if (node >= num_nodes() || nodes_[node].busy_job != job_id) return false;
  if (--nodes_[node].busy_ranks > 0) return false;
  nodes_[node].busy_job.clear();
  nodes_[node].busy_ranks = 0;
  return true;
}

bool Membership::ready_for_job() const {
  if (nodes_.empty()) return false;
  return std::all_of(nodes_.begin(), nodes_.end(),
                     [](const NodeRecord& n) { return n.state == v1::NODE_STATE_ALIVE && n.busy_job.empty(); });
}

bool Membership::any_dead() const {
  return std::any_of(nodes_.begin(), nodes_.end(), [](const NodeRecord& n) { return n.state != v1::NODE_STATE_ALIVE; });
}

int Membership::alive_ranks() const {
  int alive = 0;
  for (const NodeRecord& n : nodes_) alive += n.state == v1::NODE_STATE_ALIVE;
  return alive * devices_per_node_;
}

std::string Membership::describe_rank(int rank) const {
  const std::string r = "rank " + std::to_string(rank);
  if (devices_per_node_ <= 0 || rank < 0 || rank / devices_per_node_ >= num_nodes()) return r;
  return r + " (node " + nodes_[rank / devices_per_node_].name + ")";
}

std::string Membership::describe_node(const NodeRecord& n) const {
  const int first = n.index * devices_per_node_, last = first + devices_per_node_ - 1;
  return "node " + n.name + " (ranks " + std::to_string(first) + "-" + std::to_string(last) + ")";
}

std::map<v1::NodeState, int> Membership::counts() const {
  std::map<v1::NodeState, int> c = {{v1::NODE_STATE_ALIVE, 0}, {v1::NODE_STATE_DEAD, 0}};
  for (const NodeRecord& n : nodes_) ++c[n.state];
  return c;
}

void Membership::fill_status(v1::ClusterStatus& s, Clock::time_point now) const {
  for (const NodeRecord& n : nodes_) {
    auto* i = s.add_nodes();
    i->set_name(n.name);
    i->set_node_index(n.index);
    i->set_state(n.state);
    i->set_devices(n.devices);
    i->set_backend(n.backend);
    i->set_gemm_engine(n.gemm_engine);
    i->set_rank_base(n.index * devices_per_node_);
    i->set_control_address(n.control_address);
    i->set_metrics_address(n.metrics_address);
    i->set_last_heartbeat_age_seconds(std::chrono::duration<double>(now - n.last_heartbeat).count());
  }
  s.set_devices_per_node(devices_per_node_);
  s.set_world_size(alive_ranks());
}

}  // namespace moe::agent
