#include "moe/cluster/membership.h"

#include <algorithm>

#include "moe/base/check.h"
#include "moe/base/clock.h"
#include "moe/rpc/frame.h"

namespace moe::agent {

using rpc::RpcError;

const NodeRecord& Membership::register_node(const v1::RegisterNodeRequest& r, bool job_running, Clock::time_point now) {
  if (r.name().empty()) throw InvalidArgument("name: a node needs a name");
  if (r.devices() < 1) throw InvalidArgument("devices: must be >= 1");
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
  n.restored = false;
  // A restarted daemon runs nothing; one we took for dead may still be winding
  // down a job, and stays busy until its ranks report.
  n.busy_job = r.running_job();
  n.busy_ranks.clear();
  if (!r.running_job().empty())
    for (int i = 0; i < r.devices(); ++i) n.busy_ranks.insert(n.index * r.devices() + i);
  n.devices = r.devices();
  n.backend = r.backend();
  n.gemm_engine = r.gemm_engine();
  n.device_names.assign(r.device_names().begin(), r.device_names().end());
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

std::vector<int> Membership::expire(Clock::time_point now, Clock::duration timeout) {
  std::vector<int> dead;
  for (NodeRecord& n : nodes_) {
    const bool waited = n.state == v1::NODE_STATE_ALIVE || n.state == v1::NODE_STATE_UNHEARD;
    if (!waited || now - n.last_heartbeat <= timeout) continue;
    n.state = v1::NODE_STATE_DEAD;
    n.dead_since_unix_ms = unix_ms();
    n.busy_job.clear();
    n.busy_ranks.clear();
    dead.push_back(n.index);
  }
  return dead;
}

void Membership::forgive_stall(Clock::time_point from, Clock::time_point to) {
  for (NodeRecord& n : nodes_) {
    const bool waited = n.state == v1::NODE_STATE_ALIVE || n.state == v1::NODE_STATE_UNHEARD;
    if (waited && n.last_heartbeat < from) n.last_heartbeat = std::min(n.last_heartbeat + (to - from), to);
  }
}

void Membership::mark_busy(const std::string& job_id, int node) {
  for (NodeRecord& n : nodes_) {
    if (node >= 0 && n.index != node) continue;
    n.busy_job = job_id;
    n.busy_ranks.clear();
    for (int i = 0; i < devices_per_node_; ++i) n.busy_ranks.insert(n.index * devices_per_node_ + i);
  }
}

bool Membership::rank_done(const std::string& job_id, int rank) {
  if (devices_per_node_ <= 0 || rank < 0) return false;
  const int node = rank / devices_per_node_;
  if (node >= num_nodes() || nodes_[node].busy_job != job_id || !nodes_[node].busy_ranks.erase(rank)) return false;
  if (!nodes_[node].busy_ranks.empty()) return false;
  nodes_[node].busy_job.clear();
  return true;
}

bool Membership::ready_for_job() const {
  if (nodes_.empty()) return false;
  return std::all_of(nodes_.begin(), nodes_.end(),
                     [](const NodeRecord& n) { return n.state == v1::NODE_STATE_ALIVE && n.busy_job.empty(); });
}

std::string Membership::not_ready_reason() const {
  if (nodes_.empty()) return "a node to register";
  for (const NodeRecord& n : nodes_) {
    if (n.state == v1::NODE_STATE_DEAD)
      return "node " + n.name + ": dead" +
             (n.dead_since_unix_ms > 0 ? " since " + utc_time_of_day(n.dead_since_unix_ms) : std::string()) +
             " (start its moed again; a local cluster: moectl node restart " + n.name + ")";
    if (n.state == v1::NODE_STATE_UNHEARD) return "node " + n.name + ": not re-registered since the agent restarted";
  }
  for (const NodeRecord& n : nodes_)
    if (!n.busy_job.empty()) return "node " + n.name + ": still finishing " + n.busy_job;
  return "";
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
  std::map<v1::NodeState, int> c = {{v1::NODE_STATE_ALIVE, 0}, {v1::NODE_STATE_DEAD, 0}, {v1::NODE_STATE_UNHEARD, 0}};
  for (const NodeRecord& n : nodes_) ++c[n.state];
  return c;
}

std::string Membership::backend_mismatch() const {
  for (const NodeRecord& n : nodes_)
    if (n.backend != nodes_.front().backend)
      return "the nodes run different backends (" + nodes_.front().name + ": " + v1::Backend_Name(nodes_.front().backend) +
             ", " + n.name + ": " + v1::Backend_Name(n.backend) + "); a job's ranks must all run one";
  return "";
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
    for (const std::string& d : n.device_names) i->add_device_names(d);
    i->set_rank_base(n.index * devices_per_node_);
    i->set_control_address(n.control_address);
    i->set_metrics_address(n.metrics_address);
    i->set_last_heartbeat_age_seconds(std::chrono::duration<double>(now - n.last_heartbeat).count());
    if (n.state == v1::NODE_STATE_DEAD) i->set_dead_since_unix_ms(n.dead_since_unix_ms);
  }
  s.set_devices_per_node(devices_per_node_);
  s.set_world_size(alive_ranks());
  s.set_registered_ranks(world_size());
}

v1::MembershipState Membership::state() const {
  v1::MembershipState s;
  s.set_devices_per_node(devices_per_node_);
  for (const NodeRecord& n : nodes_) {
    v1::MemberState* m = s.add_nodes();
    m->set_name(n.name);
    m->set_node_index(n.index);
    m->set_devices(n.devices);
    m->set_backend(n.backend);
    m->set_gemm_engine(n.gemm_engine);
    for (const std::string& d : n.device_names) m->add_device_names(d);
    m->set_control_address(n.control_address);
    m->set_metrics_address(n.metrics_address);
  }
  return s;
}

void Membership::restore(const v1::MembershipState& s, Clock::time_point now) {
  MOE_CHECK(s.nodes().empty() || s.devices_per_node() >= 1, "membership.devices_per_node: must be >= 1, got ",
            s.devices_per_node());
  std::vector<NodeRecord> nodes;
  for (const v1::MemberState& m : s.nodes()) {
    const std::string at = "membership.nodes[" + std::to_string(nodes.size()) + "]";
    MOE_CHECK(m.node_index() == static_cast<int>(nodes.size()), at, ".node_index: ", m.node_index(), ", expected ",
              nodes.size());
    MOE_CHECK(!m.name().empty(), at, ".name: empty");
    MOE_CHECK(m.devices() == s.devices_per_node(), at, ".devices: ", m.devices(), ", the cluster's nodes have ",
              s.devices_per_node());
    NodeRecord n;
    n.name = m.name();
    n.index = m.node_index();
    n.state = v1::NODE_STATE_UNHEARD;
    n.restored = true;
    n.devices = m.devices();
    n.backend = m.backend();
    n.gemm_engine = m.gemm_engine();
    n.device_names.assign(m.device_names().begin(), m.device_names().end());
    n.control_address = m.control_address();
    n.metrics_address = m.metrics_address();
    n.last_heartbeat = now;  // the heartbeat timeout runs from the restore
    nodes.push_back(std::move(n));
  }
  nodes_ = std::move(nodes);
  devices_per_node_ = nodes_.empty() ? 0 : s.devices_per_node();
}

}  // namespace moe::agent
