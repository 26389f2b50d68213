#include "moe/agent/metrics_exposer.h"

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>

#include <algorithm>

#include "moe/http/metrics_endpoint.h"

namespace moe::agent {

double balancedness(const v1::PlacementMap& m, const std::vector<double>& loads) {
  if (m.num_ranks() <= 0 || m.slots_per_rank() <= 0) return 0;
  std::vector<double> rank(m.num_ranks(), 0.0);
  for (int p = 0; p < m.phy2log_size(); ++p) {
    const int e = m.phy2log(p);
    if (e < 0 || e >= static_cast<int>(loads.size()) || e >= m.logcnt_size() || m.logcnt(e) <= 0) continue;
    rank[p / m.slots_per_rank()] += loads[e] / m.logcnt(e);
  }
  const double mx = *std::max_element(rank.begin(), rank.end());
  double mean = 0;
  for (double v : rank) mean += v / rank.size();
  return mx > 0 ? mean / mx : 0;
}

struct MetricsExposer::Impl {
  Impl(rpc::asio::io_context& io, const Agent& a, const std::string& listen)
      : agent(a), timer(io), registry(std::make_shared<prometheus::Registry>()), endpoint(listen, registry) {
    epoch = &prometheus::BuildGauge().Name("moe_placement_epoch").Help("Epoch of the placement map in force").Register(*registry).Add({});
    balanced = &prometheus::BuildGauge().Name("moe_placement_balancedness")
                    .Help("Mean rank load / max rank load of the map under the last measured loads").Register(*registry);
    replicas = &prometheus::BuildGauge().Name("moe_expert_replicas").Help("Replicas of each logical expert").Register(*registry);
    // Exposed (at 0) though nothing counts rebalances yet.
    prometheus::BuildCounter().Name("moe_rebalances_total").Help("Placement maps applied by rebalancing")
        .Register(*registry).Add({});
    nodes = &prometheus::BuildGauge().Name("moe_nodes").Help("Registered nodes by state").Register(*registry);
    jobs = &prometheus::BuildGauge().Name("moe_jobs").Help("Jobs by state").Register(*registry);
    prometheus::BuildGauge().Name("moe_build_info").Help("moed build").Register(*registry)
        .Add({{"version", "0.1.0"}, {"role", "moe-agent"}}).Set(1);
    refresh();
  }

  void refresh() {
    epoch->Set(static_cast<double>(agent.placement_epoch()));
    for (const auto& [state, n] : agent.node_counts()) {
      const std::string name = state == v1::NODE_STATE_ALIVE ? "alive" : "dead";
      nodes->Add({{"state", name}}).Set(n);
    }
    for (const auto& [state, n] : agent.job_counts()) {
      std::string name = v1::JobState_Name(state).substr(10);  // drop "JOB_STATE_"
      std::transform(name.begin(), name.end(), name.begin(), ::tolower);
      jobs->Add({{"state", name}}).Set(n);
    }
    const auto& maps = agent.maps();
    const auto& loads = agent.last_expert_loads();
    for (const auto& m : maps) {
      const std::string layer = std::to_string(m.layer());
      for (int e = 0; e < m.logcnt_size(); ++e)
        replicas->Add({{"layer", layer}, {"expert", std::to_string(e)}}).Set(m.logcnt(e));
      if (m.layer() < static_cast<int>(loads.size()))
        balanced->Add({{"layer", layer}}).Set(balancedness(m, loads[m.layer()]));
    }
    timer.expires_after(std::chrono::seconds(1));
    timer.async_wait([this](boost::system::error_code ec) {
      if (!ec) refresh();
    });
  }

  const Agent& agent;
  rpc::asio::steady_timer timer;
  std::shared_ptr<prometheus::Registry> registry;
  http::MetricsEndpoint endpoint;
  prometheus::Gauge* epoch;
  prometheus::Family<prometheus::Gauge>* balanced;
  prometheus::Family<prometheus::Gauge>* replicas;
  prometheus::Family<prometheus::Gauge>* nodes;
  prometheus::Family<prometheus::Gauge>* jobs;
};

MetricsExposer::MetricsExposer(rpc::asio::io_context& io, const Agent& agent, const std::string& listen)
    : impl_(std::make_unique<Impl>(io, agent, listen)) {}

MetricsExposer::~MetricsExposer() { impl_->timer.cancel(); }

}  // namespace moe::agent
