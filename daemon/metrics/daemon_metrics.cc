#include "moe/metrics/daemon_metrics.h"

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <map>

#include "moe/http/metrics_endpoint.h"

namespace moe::metrics {
namespace {

using Labels = std::map<std::string, std::string>;

// 100 us to about 100 s, 2x apart.
prometheus::Histogram::BucketBoundaries seconds_buckets() {
  prometheus::Histogram::BucketBoundaries b;
  for (double v = 1e-4; v < 120; v *= 2) b.push_back(v);
  return b;
}

}  // namespace

struct DaemonMetrics::Impl {
  explicit Impl(const std::string& listen)
      : registry(std::make_shared<prometheus::Registry>()), endpoint(listen, registry) {
    using namespace prometheus;
    auto counter = [&](const char* name, const char* help) {
      return &BuildCounter().Name(name).Help(help).Register(*registry);
    };
    auto histogram = [&](const char* name, const char* help) {
      return &BuildHistogram().Name(name).Help(help).Register(*registry);
    };
    expert_tokens = counter("moe_expert_tokens_total", "(token, expert) pairs routed to each logical expert, by source rank");
    rank_tokens = counter("moe_rank_tokens_total", "(token, expert) pairs each rank's experts computed");
    dispatch = histogram("moe_dispatch_seconds", "All-to-all time of a dispatch");
    combine = histogram("moe_combine_seconds", "All-to-all time of a combine");
    expert = histogram("moe_expert_compute_seconds", "Expert stage time of a layer");
    sent = counter("moe_transport_bytes_total", "Bytes handed to the transport for other ranks");
    received = counter("moe_transport_received_bytes_total", "Bytes received from other ranks");
    naive = counter("moe_naive_transport_bytes_total", "Bytes one row per (token, expert) pair would have moved");
    step = histogram("moe_step_seconds", "Wall time of a job step on a rank");
    auto gauge = [&](const char* name, const char* help) {
      return &BuildGauge().Name(name).Help(help).Register(*registry);
    };
    copy_bytes = &counter("moe_rebalance_copy_bytes_total", "Expert state this daemon's ranks received in live rebalances")
                      ->Add({});
    build = gauge("moe_build_info", "moed build, backend and GEMM engine");
    serve_calls = counter("moe_serve_calls_total", "Calls of a serving job's layers that ended on this node");
    serve_rows = counter("moe_serve_rows_total", "Rows of the answered calls of a serving job");
    serve_seconds = histogram("moe_serve_call_seconds", "A serving job's answered calls, receipt to reply");
    serve_queued = &gauge("moe_serve_queued_rows", "Rows of a serving job's calls waiting on this node")->Add({});
  }

  void count(prometheus::Family<prometheus::Counter>* f, const Labels& l, double v) { f->Add(l).Increment(v); }
  void observe(prometheus::Family<prometheus::Histogram>* f, const Labels& l, double v) {
    f->Add(l, seconds_buckets()).Observe(v);
  }
  // The series both directions record, by layer, rank and device: a slow link
  // or rank shows as its own series (docs/metrics.md#ranks-across-worlds).
  void record_transfer(const std::string& direction, const RankOf& who, const LayerStep& s) {
    const Labels where = {{"direction", direction},
                          {"layer", std::to_string(s.layer)},
                          {"rank", std::to_string(who.rank)},
                          {"device", std::to_string(who.device)}};
    auto with_op = [&](const char* op) {
      Labels l = where;
      l["op"] = op;
      return l;
    };
    observe(dispatch, where, s.dispatch_seconds);
    observe(combine, where, s.combine_seconds);
    observe(expert, {{"direction", direction}}, s.expert_seconds);
    count(sent, with_op("dispatch"), static_cast<double>(s.dispatch_bytes));
    count(sent, with_op("combine"), static_cast<double>(s.combine_bytes));
    count(received, with_op("dispatch"), static_cast<double>(s.dispatch_received_bytes));
    count(received, with_op("combine"), static_cast<double>(s.combine_received_bytes));
  }

  std::shared_ptr<prometheus::Registry> registry;
  http::MetricsEndpoint endpoint;
  prometheus::Family<prometheus::Counter>*expert_tokens, *rank_tokens, *sent, *received, *naive, *serve_calls,
      *serve_rows;
  prometheus::Family<prometheus::Histogram>*dispatch, *combine, *expert, *step, *serve_seconds;
  prometheus::Family<prometheus::Gauge>* build;
  prometheus::Gauge* serve_queued;
  prometheus::Counter* copy_bytes;
};

DaemonMetrics::DaemonMetrics(const std::string& listen) : impl_(std::make_unique<Impl>(listen)) {}
DaemonMetrics::~DaemonMetrics() = default;

int DaemonMetrics::port() const { return impl_->endpoint.port(); }
std::string DaemonMetrics::address() const { return impl_->endpoint.address(); }

void DaemonMetrics::set_build_info(const std::string& version, const std::string& backend,
                                   const std::string& gemm_engine) {
  impl_->build->Add({{"version", version}, {"backend", backend}, {"gemm_engine", gemm_engine}}).Set(1);
}

void DaemonMetrics::record_forward(const RankOf& who, const LayerStep& s) {
  Impl& m = *impl_;
  const std::string r = std::to_string(who.rank), layer = std::to_string(s.layer);
  for (size_t e = 0; e < s.expert_tokens.size(); ++e)
    if (s.expert_tokens[e] > 0)
      m.count(m.expert_tokens, {{"layer", layer}, {"expert", std::to_string(e)}, {"rank", r}},
              static_cast<double>(s.expert_tokens[e]));
  m.count(m.rank_tokens, {{"layer", layer}, {"rank", r}}, static_cast<double>(s.computed_pairs));
  m.record_transfer("forward", who, s);
  m.count(m.naive, {{"op", "dispatch"}}, static_cast<double>(s.naive_dispatch_bytes));
  m.count(m.naive, {{"op", "combine"}}, static_cast<double>(s.naive_combine_bytes));
}

void DaemonMetrics::record_backward(const RankOf& who, const LayerStep& s) {
  impl_->record_transfer("backward", who, s);
}

void DaemonMetrics::record_step(int, double seconds) { impl_->observe(impl_->step, {}, seconds); }

void DaemonMetrics::record_rebalance_copy(int64_t bytes) { impl_->copy_bytes->Increment(static_cast<double>(bytes)); }

void DaemonMetrics::record_serve_call(int layer, bool backward, bool ok, int64_t rows, double seconds) {
  Impl& m = *impl_;
  const Labels lane = {{"layer", std::to_string(layer)}, {"kind", backward ? "backward" : "forward"}};
  Labels with_outcome = lane;
  with_outcome["outcome"] = ok ? "ok" : "failed";
  m.count(m.serve_calls, with_outcome, 1);
  if (!ok) return;
  m.count(m.serve_rows, lane, static_cast<double>(rows));
  m.observe(m.serve_seconds, lane, seconds);
}

void DaemonMetrics::set_serve_queued_rows(int64_t rows) { impl_->serve_queued->Set(static_cast<double>(rows)); }

}  // namespace moe::metrics
