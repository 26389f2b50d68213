#include "moe/node/serve_stats.h"

#include "moe/base/latency_buckets.h"
#include "moe/node/serve_queue.h"

namespace moe::node {

void ServeStats::record(int lane, int64_t rows, double seconds, bool ok, const std::string& caller) {
  std::lock_guard<std::mutex> lock(mu_);
  if (lane < 0 || lane >= static_cast<int>(lanes_.size())) return;  // a call refused before it named a lane
  Lane& l = lanes_[lane];
  if (callers_.size() < kMaxCallers) callers_.insert(caller.substr(0, 64));  // a window carries at most so many
  if (!ok) {
    ++l.failed;
    return;
  }
  ++l.calls;
  l.rows += rows;
  l.latency.resize(kLatencyBuckets, 0);
  ++l.latency[latency_bucket(seconds * 1e3)];
}

void ServeStats::take(v1::ServeWindow& w) {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < lanes_.size(); ++i) {
    Lane& l = lanes_[i];
    if (l.calls == 0 && l.failed == 0) continue;
    v1::ServeLaneCalls* c = w.add_calls();
    c->set_layer(static_cast<int>(i) / kServeKinds);
    c->set_backward(static_cast<int>(i) % kServeKinds == static_cast<int>(ServeKind::kBackward));
    c->set_calls(l.calls);
    c->set_failed(l.failed);
    c->set_rows(l.rows);
    while (!l.latency.empty() && l.latency.back() == 0) l.latency.pop_back();
    for (int64_t n : l.latency) c->add_latency_buckets(n);
    l = Lane{};
  }
  for (const std::string& c : callers_) {
    if (w.callers_size() == kMaxCallers) break;
    w.add_callers(c);
  }
  callers_.clear();
}

}  // namespace moe::node
