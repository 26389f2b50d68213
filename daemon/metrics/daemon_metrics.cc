#include "moe/metrics/daemon_metrics.h"

#include <prometheus/counter.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <map>
#include <tuple>

#include "moe/http/metrics_endpoint.h"

namespace moe::metrics {
namespace {

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
    expert_tokens = &BuildCounter().Name("moe_expert_tokens_total").Help("Tokens routed to each logical expert, by source rank").Register(*registry);
    rank_tokens = &BuildCounter().Name("moe_rank_tokens_total").Help("Rows each rank's experts processed").Register(*registry);
    dispatch = &BuildHistogram().Name("moe_dispatch_seconds").Help("All-to-all time of a dispatch").Register(*registry);
    combine = &BuildHistogram().Name("moe_combine_seconds").Help("All-to-all time of a combine").Register(*registry);
    expert = &BuildHistogram().Name("moe_expert_compute_seconds").Help("Expert stage time of a layer").Register(*registry);
    bytes = &BuildCounter().Name("moe_transport_bytes_total").Help("Bytes handed to the transport for other ranks").Register(*registry);
    naive = &BuildCounter().Name("moe_naive_transport_bytes_total").Help("Bytes one row per (token, expert) would have sent").Register(*registry);
    step = &BuildHistogram().Name("moe_step_seconds").Help("Wall time of a job step on a rank").Register(*registry);
  }

  // Family::Add is thread-safe and returns the existing child for known labels.
  prometheus::Counter& counter(prometheus::Family<prometheus::Counter>* f, const std::map<std::string, std::string>& l) {
    return f->Add(l);
  }
  prometheus::Histogram& histogram(prometheus::Family<prometheus::Histogram>* f, const std::map<std::string, std::string>& l) {
    return f->Add(l, seconds_buckets());
  }

  std::shared_ptr<prometheus::Registry> registry;
  http::MetricsEndpoint endpoint;
  prometheus::Family<prometheus::Counter>* expert_tokens;
  prometheus::Family<prometheus::Counter>* rank_tokens;
  prometheus::Family<prometheus::Histogram>* dispatch;
  prometheus::Family<prometheus::Histogram>* combine;
  prometheus::Family<prometheus::Histogram>* expert;
  prometheus::Family<prometheus::Counter>* bytes;
  prometheus::Family<prometheus::Counter>* naive;
  prometheus::Family<prometheus::Histogram>* step;
};

DaemonMetrics::DaemonMetrics(const std::string& listen) : impl_(std::make_unique<Impl>(listen)) {}
DaemonMetrics::~DaemonMetrics() = default;

int DaemonMetrics::port() const { return impl_->endpoint.port(); }

void DaemonMetrics::record(int rank, const LayerStep& s) {
  Impl& m = *impl_;
  const std::string r = std::to_string(rank), layer = std::to_string(s.layer);
  for (size_t e = 0; e < s.expert_tokens.size(); ++e)
    if (s.expert_tokens[e] > 0)
      m.counter(m.expert_tokens, {{"layer", layer}, {"expert", std::to_string(e)}, {"rank", r}})
          .Increment(static_cast<double>(s.expert_tokens[e]));
  m.counter(m.rank_tokens, {{"rank", r}}).Increment(static_cast<double>(s.rows));
  m.histogram(m.dispatch, {{"direction", "forward"}}).Observe(s.dispatch_seconds);
  m.histogram(m.combine, {{"direction", "forward"}}).Observe(s.combine_seconds);
  m.histogram(m.expert, {}).Observe(s.expert_seconds);
  m.counter(m.bytes, {{"op", "dispatch"}, {"direction", "forward"}}).Increment(static_cast<double>(s.dispatch_bytes));
  m.counter(m.bytes, {{"op", "combine"}, {"direction", "forward"}}).Increment(static_cast<double>(s.combine_bytes));
  m.counter(m.naive, {{"op", "dispatch"}}).Increment(static_cast<double>(s.naive_dispatch_bytes));
}

void DaemonMetrics::record_backward(int, const LayerBackwardStep& s) {
  Impl& m = *impl_;
  m.histogram(m.dispatch, {{"direction", "backward"}}).Observe(s.dispatch_seconds);
  m.histogram(m.combine, {{"direction", "backward"}}).Observe(s.combine_seconds);
  m.counter(m.bytes, {{"op", "dispatch"}, {"direction", "backward"}}).Increment(static_cast<double>(s.dispatch_bytes));
  m.counter(m.bytes, {{"op", "combine"}, {"direction", "backward"}}).Increment(static_cast<double>(s.combine_bytes));
}

void DaemonMetrics::record_step(int, double seconds) { impl_->histogram(impl_->step, {}).Observe(seconds); }

}  // namespace moe::metrics
