#include "moe/agent/metrics_exposer.h"

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <algorithm>
#include <set>

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
    world_changes = &BuildCounter().Name("moe_world_changes_total")
                         .Help("Elastic jobs' changes of world (a node lost, docs/jobs.md#elastic-jobs) by cause")
                         .Register(*registry);
    for (const char* kind : {"peer_failed", "node_dead", "node_restarted", "node_joined"}) world_changes->Add({{"cause", kind}});
    recovery_seconds = &BuildHistogram()
                            .Name("moe_world_change_recovery_seconds")
                            .Help("An elastic job's halt to the new world's first complete step")
                            .Register(*registry)
                            .Add({}, Histogram::BucketBoundaries{0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60});
    shape_info = &BuildGauge().Name("moe_placement_shape_info")
                      .Help("The shape (EXPERTSxLAYERS@NODESxDEVICES) the placement series are of: the last job's")
                      .Register(*registry);
    job_gauges.step = &BuildGauge().Name("moe_job_step").Help("Complete steps of the running job").Register(*registry);
    job_gauges.steps = &BuildGauge().Name("moe_job_steps").Help("Steps the running job asks for").Register(*registry);
    job_gauges.loss = &BuildGauge().Name("moe_job_loss").Help("The running train job's latest step loss").Register(*registry);
    job_gauges.tps = &BuildGauge().Name("moe_job_tokens_per_second")
                  .Help("Tokens per second of the running job over its recent steps").Register(*registry);
    job_gauges.step_seconds = &BuildGauge().Name("moe_job_step_seconds")
                           .Help("Median slowest-rank step time of the running job's recent steps").Register(*registry);
    job_gauges.eta = &BuildGauge().Name("moe_job_eta_seconds").Help("Seconds the running job has left at its recent pace")
                  .Register(*registry);
    nodes = &BuildGauge().Name("moe_nodes").Help("Registered nodes by state").Register(*registry);
    jobs = &BuildGauge().Name("moe_jobs").Help("Jobs by state").Register(*registry);
    if (agent.saves_state())
      state_saved = &BuildGauge().Name("moe_agent_state_saved")
                         .Help("1 while the agent's state directory takes every write, 0 while it refuses them")
                         .Register(*registry)
                         .Add({});
    BuildGauge().Name("moe_build_info").Help("moed build").Register(*registry)
        .Add({{"version", MOE_VERSION}}).Set(1);  // no "role": the scrape target's label
    refresh();
  }

  // Sets a gauge of this refresh; the ones a refresh does not set are removed
  // (another shape's layers, an empty window, a job that ended).
  void set(prometheus::Family<prometheus::Gauge>* f, const std::map<std::string, std::string>& labels, double v) {
    prometheus::Gauge& g = f->Add(labels);
    g.Set(v);
    fresh.emplace(f, &g);
  }

  void refresh() {
    for (const auto& [state, n] : agent.membership().counts())
      nodes->Add({{"state", lower_state(v1::NodeState_Name(state), 11)}}).Set(n);  // drop NODE_STATE_
    for (const auto& [state, n] : agent.scheduler().counts())
      jobs->Add({{"state", lower_state(v1::JobState_Name(state), 10)}}).Set(n);  // drop JOB_STATE_
    if (state_saved) state_saved->Set(agent.state_error().empty() ? 1 : 0);
    refresh_placement();
    refresh_job();
    for (const auto& [family, gauge] : shown)
      if (!fresh.count({family, gauge})) family->Remove(gauge);
    shown.swap(fresh);
    fresh.clear();
    refresh_rebalances();
    timer.expires_after(std::chrono::seconds(1));
    timer.async_wait([this](boost::system::error_code ec) {
      if (!ec) refresh();
    });
  }

  // The last job's shape only (docs/metrics.md#agent-metrics): its maps and live windows.
  void refresh_placement() {
    const v1::PlacementReply p = agent.placement().describe({}, std::nullopt);
    if (p.layers_size() > 0) {
      const v1::PlacementShape& sh = p.shape();
      set(shape_info, {{"shape", std::to_string(sh.experts()) + "x" + std::to_string(sh.layers()) + "@" +
                                     std::to_string(sh.nodes()) + "x" + std::to_string(sh.devices_per_node())}},
          1);
    }
    for (const v1::LayerPlacement& lp : p.layers()) {
      const v1::PlacementMap& m = lp.map();
      const std::string layer = std::to_string(m.layer());
      set(epoch, {{"layer", layer}}, static_cast<double>(m.epoch()));
      if (lp.rank_window_steps() > 0) set(balanced, {{"layer", layer}}, lp.balancedness());  // absent while empty
      for (int e = 0; e < m.logcnt_size(); ++e) {
        const std::map<std::string, std::string> labels = {{"layer", layer}, {"expert", std::to_string(e)}};
        set(replicas, labels, m.logcnt(e));
        if (lp.window_steps() > 0) set(load, labels, e < lp.expert_loads_size() ? lp.expert_loads(e) : 0.0);
      }
    }
  }

  // The running job's progress (docs/jobs.md#progress); nothing between jobs.
  void refresh_job() {
    const RunningJob* run = agent.scheduler().running();
    if (!run) return;
    const v1::JobResult& rec = agent.scheduler().record(run->id);
    const v1::JobProgress& p = rec.progress();
    const std::map<std::string, std::string> job = {{"job_id", rec.job_id()}, {"name", rec.spec().name()}};
    set(job_gauges.step, job, p.step());
    set(job_gauges.steps, job, rec.spec().steps());
    if (p.has_loss()) set(job_gauges.loss, job, p.loss());
    if (p.recent_steps() > 0) {
      set(job_gauges.tps, job, p.tokens_per_second());
      set(job_gauges.step_seconds, job, p.step_seconds());
    }
    if (p.has_eta_seconds()) set(job_gauges.eta, job, p.eta_seconds());
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
    for (const auto& [kind, n] : agent.scheduler().world_changes()) {
      prometheus::Counter& c = world_changes->Add({{"cause", kind}});
      c.Increment(static_cast<double>(n) - c.Value());
    }
    const auto& r = agent.scheduler().recovery_seconds();
    for (; recoveries < r.size(); ++recoveries) recovery_seconds->Observe(r[recoveries]);
  }

  const Agent& agent;
  rpc::asio::steady_timer timer;
  prometheus::Family<prometheus::Counter>* rebalances;
  prometheus::Histogram* rebalance_seconds;
  size_t observed = 0;
  prometheus::Family<prometheus::Counter>* world_changes;
  prometheus::Histogram* recovery_seconds;
  size_t recoveries = 0;
  std::shared_ptr<prometheus::Registry> registry;
  http::MetricsEndpoint endpoint;
  prometheus::Gauge* state_saved = nullptr;
  prometheus::Family<prometheus::Gauge>* epoch;
  prometheus::Family<prometheus::Gauge>* balanced;
  prometheus::Family<prometheus::Gauge>* replicas;
  prometheus::Family<prometheus::Gauge>* load;
  prometheus::Family<prometheus::Gauge>* nodes;
  prometheus::Family<prometheus::Gauge>* jobs;
  prometheus::Family<prometheus::Gauge>* shape_info;
  struct JobGauges {  // the running job's progress
    prometheus::Family<prometheus::Gauge>*step, *steps, *loss, *tps, *step_seconds, *eta;
  } job_gauges;
  using Series = std::pair<prometheus::Family<prometheus::Gauge>*, prometheus::Gauge*>;
  std::set<Series> shown, fresh;  // the gauges the last refresh set, and this one's
};

MetricsExposer::MetricsExposer(rpc::asio::io_context& io, const Agent& agent, const std::string& listen)
    : impl_(std::make_unique<Impl>(io, agent, listen)) {}

MetricsExposer::~MetricsExposer() { impl_->timer.cancel(); }

std::string MetricsExposer::address() const { return impl_->endpoint.address(); }

}  // namespace moe::agent
