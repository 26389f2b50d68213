#include "moe/agent/metrics_exposer.h"

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
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
                    .Help("Mean rank load / max rank load over the load window").Register(*registry);
    replicas = &BuildGauge().Name("moe_expert_replicas").Help("Replicas of each logical expert").Register(*registry);
    load = &BuildGauge().Name("moe_expert_load")
                .Help("(token, expert) pairs routed to each logical expert over the load window").Register(*registry);
    rebalances = &BuildCounter().Name("moe_rebalances_total").Help("Live rebalances by result").Register(*registry);
    rebalance_seconds = &BuildHistogram()
                             .Name("moe_rebalance_seconds")
                             .Help("PREPARE to COMMIT or ABORT of a live rebalance")
                             .Register(*registry)
                             .Add({}, Histogram::BucketBoundaries{0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100});
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
    // The last job's shape: its maps and live windows.
    const v1::PlacementReply p = agent.placement().describe({}, std::nullopt);
    for (const v1::LayerPlacement& lp : p.layers()) {
      const v1::PlacementMap& m = lp.map();
      const std::string layer = std::to_string(m.layer());
      epoch->Add({{"layer", layer}}).Set(static_cast<double>(m.epoch()));
      balanced->Add({{"layer", layer}}).Set(lp.balancedness());
      for (int e = 0; e < m.logcnt_size(); ++e) {
        const std::map<std::string, std::string> labels = {{"layer", layer}, {"expert", std::to_string(e)}};
        replicas->Add(labels).Set(m.logcnt(e));
        load->Add(labels).Set(e < lp.expert_loads_size() ? lp.expert_loads(e) : 0.0);
      }
    }
    refresh_rebalances();
    timer.expires_after(std::chrono::seconds(1));
    timer.async_wait([this](boost::system::error_code ec) {
      if (!ec) refresh();
    });
  }

  // Counters move by what happened since the last refresh.
  void refresh_rebalances() {
    for (const auto& [result, n] : agent.rebalancer().counts()) {
      std::string name = v1::RebalanceResult_Name(result).substr(17);  // drop REBALANCE_RESULT_
      std::transform(name.begin(), name.end(), name.begin(), ::tolower);
      prometheus::Counter& c = rebalances->Add({{"result", name}});
      c.Increment(static_cast<double>(n) - c.Value());
    }
    const auto& d = agent.rebalancer().durations();
    for (; observed < d.size(); ++observed) rebalance_seconds->Observe(d[observed]);
  }

  const Agent& agent;
  rpc::asio::steady_timer timer;
  prometheus::Family<prometheus::Counter>* rebalances;
  prometheus::Histogram* rebalance_seconds;
  size_t observed = 0;
  std::shared_ptr<prometheus::Registry> registry;
  http::MetricsEndpoint endpoint;
  prometheus::Family<prometheus::Gauge>* epoch;
  prometheus::Family<prometheus::Gauge>* balanced;
  prometheus::Family<prometheus::Gauge>* replicas;
  prometheus::Family<prometheus::Gauge>* load;
  prometheus::Family<prometheus::Gauge>* nodes;
  prometheus::Family<prometheus::Gauge>* jobs;
};

MetricsExposer::MetricsExposer(rpc::asio::io_context& io, const Agent& agent, const std::string& listen)
    : impl_(std::make_unique<Impl>(io, agent, listen)) {}

MetricsExposer::~MetricsExposer() { impl_->timer.cancel(); }

std::string MetricsExposer::address() const { return impl_->endpoint.address(); }

}  // namespace moe::agent
