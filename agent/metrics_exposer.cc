#include "moe/agent/metrics_exposer.h"

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>

#include <algorithm>

#include "moe/http/metrics_endpoint.h"

namespace moe::agent {
namespace {

// "JOB_STATE_SUCCEEDED" -> "succeeded"
std::string lower_state(const std::string& enum_name, size_t prefix) {
  std::string s = enum_name.substr(prefix);
  std::transform(s.begin(), s.end(), s.begin(), ::tolower);
  return s;
}

}  // namespace

struct MetricsExposer::Impl {
  Impl(rpc::asio::io_context& io, const Agent& a, const std::string& listen)
      : agent(a), timer(io), registry(std::make_shared<prometheus::Registry>()), endpoint(listen, registry) {
    using namespace prometheus;
    epoch = &BuildGauge().Name("moe_placement_epoch").Help("Epoch of the placement map in force").Register(*registry);
    balanced = &BuildGauge().Name("moe_placement_balancedness")
                    .Help("Mean rank load / max rank load of the map under the last measured loads").Register(*registry);
    replicas = &BuildGauge().Name("moe_expert_replicas").Help("Replicas of each logical expert").Register(*registry);
    // Exposed (at 0) though nothing counts rebalances yet.
    BuildCounter().Name("moe_rebalances_total").Help("Placement maps applied by rebalancing").Register(*registry);
    nodes = &BuildGauge().Name("moe_nodes").Help("Registered nodes by state").Register(*registry);
    jobs = &BuildGauge().Name("moe_jobs").Help("Jobs by state").Register(*registry);
    BuildGauge().Name("moe_build_info").Help("moed build").Register(*registry)
        .Add({{"version", MOE_VERSION}}).Set(1);  // no "role": the scrape target's label
    refresh();
  }

  void refresh() {
    for (const auto& [state, n] : agent.membership().counts())
      nodes->Add({{"state", lower_state(v1::NodeState_Name(state), 11)}}).Set(n);  // drop NODE_STATE_
    for (const auto& [state, n] : agent.scheduler().counts())
      jobs->Add({{"state", lower_state(v1::JobState_Name(state), 10)}}).Set(n);  // drop JOB_STATE_
    const PlacementService& p = agent.placement();
    for (const auto& m : p.maps()) {
      const std::string layer = std::to_string(m.layer());
      epoch->Add({{"layer", layer}}).Set(static_cast<double>(m.epoch()));
      for (int e = 0; e < m.logcnt_size(); ++e)
        replicas->Add({{"layer", layer}, {"expert", std::to_string(e)}}).Set(m.logcnt(e));
      balanced->Add({{"layer", layer}}).Set(p.balancedness(m.layer()));
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
  prometheus::Family<prometheus::Gauge>* epoch;
  prometheus::Family<prometheus::Gauge>* balanced;
  prometheus::Family<prometheus::Gauge>* replicas;
  prometheus::Family<prometheus::Gauge>* nodes;
  prometheus::Family<prometheus::Gauge>* jobs;
};

MetricsExposer::MetricsExposer(rpc::asio::io_context& io, const Agent& agent, const std::string& listen)
    : impl_(std::make_unique<Impl>(io, agent, listen)) {}

MetricsExposer::~MetricsExposer() { impl_->timer.cancel(); }

std::string MetricsExposer::address() const { return impl_->endpoint.address(); }

}  // namespace moe::agent
