#include "moe/jobs/job_result.h"

#include <algorithm>
#include <set>
#include <string>

#include "moe/base/latency_buckets.h"

namespace moe::agent {
namespace {

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The step of a complete step's reports (a whole step may miss some).
int step_of(const std::vector<v1::StepStats>& by_rank) {
  for (const v1::StepStats& s : by_rank)
    if (s.step_seconds() > 0) return s.step();
  return 0;
}

// The most ranks any step had (an elastic job's worlds differ).
int max_world(const JobReports& r) {
  size_t w = static_cast<size_t>(r.world);
  for (const auto& [step, by_rank] : r.steps) w = std::max(w, by_rank.size());
  return static_cast<int>(w);
}

// Per layer, the mean / max of the rank loads (docs/jobs.md#result), taken per
// world (a run of steps of one world epoch and size: an elastic job renumbers its
// ranks at each world change) and weighted by its steps:
// a world that lost a rank has no idle rank to count. A rank's load is its pairs
// per step it reported, so a step declared whole without a lost rank's report
// does not make that rank look idle.
class WorldBalance {
 public:
  explicit WorldBalance(int layers) : per_layer_(layers, 0.0), load_(layers) {}

  void add(const std::vector<v1::StepStats>& by_rank) {
    if (by_rank.empty()) return;
    int64_t world_epoch = 0;
    for (const v1::StepStats& s : by_rank)
      if (s.step_seconds() > 0) {
        world_epoch = s.world_epoch();
        break;
      }
    if (by_rank.size() != reports_.size() || world_epoch != world_epoch_) close_world(by_rank.size());
    world_epoch_ = world_epoch;
    for (size_t rank = 0; rank < by_rank.size(); ++rank) {
      const v1::StepStats& s = by_rank[rank];
      if (s.step_seconds() <= 0) continue;  // missing from a whole step
      ++reports_[rank];
      for (size_t l = 0; l < std::min(load_.size(), static_cast<size_t>(s.layer_pairs_size())); ++l)
        load_[l][rank] += s.layer_pairs(static_cast<int>(l));
    }
    ++world_steps_;
  }

  // Per layer, over every step added.
  std::vector<double> per_layer() {
    close_world(0);
    std::vector<double> out(per_layer_.size(), 0.0);
    for (size_t l = 0; l < out.size(); ++l) out[l] = steps_ > 0 ? per_layer_[l] / steps_ : 0.0;
    return out;
  }

 private:
  void close_world(size_t next_ranks) {
    for (size_t l = 0; l < load_.size(); ++l) {
      std::vector<double> per_step;
      for (size_t rank = 0; rank < reports_.size(); ++rank)
        if (reports_[rank] > 0) per_step.push_back(load_[l][rank] / reports_[rank]);
      per_layer_[l] += world_steps_ * balancedness_of(per_step);
      load_[l].assign(next_ranks, 0.0);
    }
    reports_.assign(next_ranks, 0);
    steps_ += world_steps_;
    world_steps_ = 0;
  }

  std::vector<double> per_layer_;          // weighted sums over closed worlds
  std::vector<std::vector<double>> load_;  // [layer][rank] pairs in the open world
  std::vector<int> reports_;               // [rank] steps reported in it
  int64_t world_epoch_ = 0;                // of the open world
  double steps_ = 0, world_steps_ = 0;
};

double mean_of(const std::vector<double>& v) {
  double sum = 0;
  for (double x : v) sum += x;
  return v.empty() ? 0.0 : sum / static_cast<double>(v.size());
}

// Steps every rank reported (or declared whole), in step order.
std::vector<const std::vector<v1::StepStats>*> complete_steps(const JobReports& r) {
  std::vector<const std::vector<v1::StepStats>*> out;
  for (const auto& [step, by_rank] : r.steps) {
    auto reported = [&](const v1::StepStats& s) { return s.step() == step && s.step_seconds() > 0; };
    const bool complete = r.whole.count(step)
                              ? std::any_of(by_rank.begin(), by_rank.end(), reported)
                              : static_cast<int>(by_rank.size()) >= r.world &&
                                    std::all_of(by_rank.begin(), by_rank.end(), reported);
    if (complete) out.push_back(&by_rank);
  }
  return out;
}

// Per step, each phase's slowest rank; the result is the median over steps (every
// PhaseSeconds field alike, by reflection).
void fill_times(const std::vector<const std::vector<v1::StepStats>*>& steps, int64_t tokens_per_step,
                v1::JobResult& rec) {
  const auto* desc = v1::PhaseSeconds::descriptor();
  const auto* refl = v1::PhaseSeconds::GetReflection();
  std::vector<double> step_time, layer_time;
  std::vector<std::vector<double>> phases(desc->field_count());
  for (const auto* by_rank : steps) {
    double t = 0, layer = 0;
    std::vector<double> slowest(desc->field_count(), 0.0);
    for (const v1::StepStats& s : *by_rank) {
      t = std::max(t, s.step_seconds());
      // The synthetic task's own phases are not the layer's (docs/jobs.md#result).
      const v1::PhaseSeconds& ph = s.phase_seconds();
      layer = std::max(layer, s.step_seconds() - ph.teacher() - ph.inputs());
      for (int f = 0; f < desc->field_count(); ++f)
        slowest[f] = std::max(slowest[f], refl->GetDouble(s.phase_seconds(), desc->field(f)));
    }
    step_time.push_back(t);
    layer_time.push_back(layer);
    for (int f = 0; f < desc->field_count(); ++f) phases[f].push_back(slowest[f]);
  }
  const double p50 = median(step_time);
  // Counted from step 0: a resumed job's first step is its checkpoint's.
  rec.set_steps_completed(steps.empty() ? 0.0 : static_cast<double>(step_of(*steps.back()) + 1));
  rec.set_step_seconds_p50(p50);
  rec.set_tokens_per_second(p50 > 0 ? static_cast<double>(tokens_per_step) / p50 : 0.0);
  const double layer_p50 = median(layer_time);
  rec.set_layer_step_seconds_p50(layer_p50);
  rec.set_layer_tokens_per_second(layer_p50 > 0 ? static_cast<double>(tokens_per_step) / layer_p50 : 0.0);
  v1::PhaseSeconds* ph = rec.mutable_phase_seconds();
  for (int f = 0; f < desc->field_count(); ++f) refl->SetDouble(ph, desc->field(f), median(phases[f]));
  // Each step's expert phase is already its slowest rank's.
  rec.set_slowest_rank_expert_seconds(ph->expert());
  int chunks = 0;
  if (!steps.empty())
    for (const v1::StepStats& s : *steps.back()) chunks = std::max(chunks, s.overlap_chunks());
  rec.set_overlap_chunks(chunks);
}

// Sums over steps and ranks: bytes, loss per step, received rows, expert tokens
// per layer, pairs per layer and rank.
void fill_sums(const std::vector<const std::vector<v1::StepStats>*>& steps, const JobReports& r,
               v1::JobResult& rec) {
  const int L = r.spec.layers(), E = r.spec.experts(), W = max_world(r);
  std::vector<std::vector<double>> expert_tokens(L, std::vector<double>(E, 0.0));
  std::vector<std::vector<double>> layer_rank(L, std::vector<double>(W, 0.0));
  std::vector<double> received(W, 0.0);
  double dbytes = 0, nbytes = 0, cbytes = 0;
  for (const auto* by_rank : steps) {
    double loss = 0, aux = 0, z = 0;
    const v1::StepStats* whole = nullptr;  // a report with the step's losses over every rank
    for (int rank = 0; rank < static_cast<int>(by_rank->size()); ++rank) {
      const v1::StepStats& s = (*by_rank)[rank];
      if (s.step_seconds() <= 0) continue;  // missing from a whole step
      if (s.has_job_loss()) whole = &s;
      aux += s.aux_loss();
      z += s.z_loss();
      dbytes += s.dispatch_bytes();
      nbytes += s.naive_dispatch_bytes();
      cbytes += s.combine_bytes();
      loss += s.loss();
      received[rank] += s.received_rows();
      for (int l = 0; l < std::min(L, s.layer_pairs_size()); ++l) layer_rank[l][rank] += s.layer_pairs(l);
      for (int l = 0; l < std::min(L, s.expert_tokens_size()); ++l)
        for (int e = 0; e < std::min(E, s.expert_tokens(l).tokens_size()); ++e)
          expert_tokens[l][e] += s.expert_tokens(l).tokens(e);
    }
    if (r.spec.mode() != v1::JobSpec::train) continue;
    if (whole) loss = whole->job_loss(), aux = whole->job_aux_loss(), z = whole->job_z_loss();
    rec.add_loss(loss);
    rec.add_aux_loss(aux);
    rec.add_z_loss(z);
  }
  rec.set_dispatch_bytes(dbytes);
  rec.set_naive_dispatch_bytes(nbytes);
  rec.set_combine_bytes(cbytes);
  for (const auto& layer : expert_tokens) *rec.add_expert_tokens()->mutable_tokens() = {layer.begin(), layer.end()};
  *rec.mutable_rank_received_rows() = {received.begin(), received.end()};
  std::vector<double> rank_tokens(W, 0.0);
  for (const auto& layer : layer_rank) {
    *rec.add_layer_rank_tokens()->mutable_tokens() = {layer.begin(), layer.end()};
    for (int rank = 0; rank < W; ++rank) rank_tokens[rank] += layer[rank];
  }
  *rec.mutable_rank_tokens() = {rank_tokens.begin(), rank_tokens.end()};
  WorldBalance balance(L);
  for (const auto* by_rank : steps) balance.add(*by_rank);
  const std::vector<double> per_layer = balance.per_layer();
  *rec.mutable_layer_balancedness() = {per_layer.begin(), per_layer.end()};
  rec.set_balancedness(mean_of(per_layer));
}

// The epoch a step ran under: the newest of its layers' maps.
int64_t step_epoch(const std::vector<v1::StepStats>& by_rank) {
  int64_t epoch = 0;
  for (const v1::StepStats& s : by_rank)
    for (int64_t e : s.layer_epoch()) epoch = std::max(epoch, e);
  return epoch;
}

// Each epoch the job ran under (docs/jobs.md#result): its steps, balancedness over them,
// and the medians of its step and slowest-rank expert times.
void fill_epochs(const std::vector<const std::vector<v1::StepStats>*>& steps, const JobReports& r,
                 v1::JobResult& rec) {
  const int L = r.spec.layers();
  size_t i = 0;
  while (i < steps.size()) {
    const int64_t epoch = step_epoch(*steps[i]);
    WorldBalance balance(L);
    std::vector<double> step_time, expert;
    v1::EpochRun* run = rec.add_epochs();
    run->set_epoch(epoch);
    run->set_first_step(step_of(*steps[i]));
    for (; i < steps.size() && step_epoch(*steps[i]) == epoch; ++i) {
      double t = 0, pe = 0;
      for (int rank = 0; rank < static_cast<int>(steps[i]->size()); ++rank) {
        const v1::StepStats& s = (*steps[i])[rank];
        t = std::max(t, s.step_seconds());
        pe = std::max(pe, s.phase_seconds().expert());
      }
      balance.add(*steps[i]);
      step_time.push_back(t);
      expert.push_back(pe);
    }
    run->set_steps(static_cast<int32_t>(step_time.size()));
    run->set_balancedness(mean_of(balance.per_layer()));
    run->set_step_seconds_p50(median(step_time));
    run->set_first_step_seconds(step_time.front());
    run->set_slowest_rank_expert_seconds(median(expert));
  }
  if (rec.epochs_size() > 0 && rec.epochs(rec.epochs_size() - 1).epoch() > 0)
    rec.set_placement_epoch(static_cast<double>(rec.epochs(rec.epochs_size() - 1).epoch()));
}

// Only for an ended job whose ranks ran the check: a rank that checked reports
// its errors or a pass, one that never got there reports neither.
void fill_verify(const JobReports& r, v1::JobState state, v1::JobResult& rec) {
  rec.clear_verify();
  if (!r.spec.verify() || state == v1::JOB_STATE_RUNNING || state == v1::JOB_STATE_QUEUED) return;
  const bool checked = std::any_of(r.verify.begin(), r.verify.end(), [](const v1::Verify& v) {
    return v.passed() || v.max_abs_error() != 0 || v.max_rel_error() != 0;  // NaN counts
  });
  if (!checked) return;
  v1::Verify v;
  v.set_passed(state == v1::JOB_STATE_SUCCEEDED);
  for (const v1::Verify& rv : r.verify) {
    v.set_max_abs_error(std::max(v.max_abs_error(), rv.max_abs_error()));
    v.set_max_rel_error(std::max(v.max_rel_error(), rv.max_rel_error()));
    v.set_passed(v.passed() && rv.passed());
  }
  *rec.mutable_verify() = v;
}

}  // namespace

namespace {

// A serving job's tokens/s: rows its ranks computed over the windows' time
// (a window's time: its slowest rank's), all layers counted.
void fill_serve_rate(const std::vector<const std::vector<v1::StepStats>*>& steps, v1::JobResult& rec) {
  double rows = 0, seconds = 0;
  for (const auto* by_rank : steps) {
    double t = 0;
    for (const v1::StepStats& s : *by_rank) {
      t = std::max(t, s.step_seconds());
      for (double n : s.serve().layer_rows()) rows += n;
    }
    seconds += t;
  }
  const double rate = seconds > 0 ? rows / seconds : 0.0;
  rec.set_tokens_per_second(rate);
  rec.set_layer_tokens_per_second(rate);
}

}  // namespace

v1::ServeProgress serve_progress(const std::vector<v1::StepStats>& by_rank) {
  v1::ServeProgress p;
  double seconds = 0, steps = 0, rows_computed = 0;
  std::map<std::pair<int, bool>, v1::ServeLaneCalls> lanes;  // merged over nodes
  std::set<std::string> callers;
  for (const v1::StepStats& s : by_rank) {
    seconds = std::max(seconds, s.step_seconds());
    steps = std::max(steps, static_cast<double>(s.serve().steps()));
    for (double n : s.serve().layer_rows()) rows_computed += n;
    callers.insert(s.serve().callers().begin(), s.serve().callers().end());
    p.set_queued_rows(p.queued_rows() + s.serve().queued_rows());
    p.set_optimizer_steps(std::max(p.optimizer_steps(), s.serve().optimizer_steps()));
    for (const v1::ServeLaneCalls& c : s.serve().calls()) {
      v1::ServeLaneCalls& m = lanes[{c.layer(), c.backward()}];
      m.set_calls(m.calls() + c.calls());
      m.set_failed(m.failed() + c.failed());
      m.set_rows(m.rows() + c.rows());
      for (int b = 0; b < c.latency_buckets_size(); ++b) {
        while (m.latency_buckets_size() <= b) m.add_latency_buckets(0);
        m.set_latency_buckets(b, m.latency_buckets(b) + c.latency_buckets(b));
      }
    }
  }
  p.set_window_seconds(seconds);
  p.set_clients(static_cast<int32_t>(callers.size()));
  if (seconds <= 0) return p;
  // Rows a step: every rank's rows over the steps that ran a lane.
  p.set_step_rows(steps > 0 ? rows_computed / steps : 0.0);
  double calls = 0, failed = 0, rows = 0;
  for (const auto& [key, c] : lanes) {
    calls += c.calls();
    failed += c.failed();
    rows += c.rows();
    if (c.calls() == 0) continue;
    v1::ServeLane* l = p.add_lanes();
    l->set_layer(key.first);
    l->set_backward(key.second);
    l->set_calls_per_second(c.calls() / seconds);
    l->set_rows_per_call(static_cast<double>(c.rows()) / c.calls());
    const std::vector<int64_t> buckets(c.latency_buckets().begin(), c.latency_buckets().end());
    l->set_p50_ms(latency_quantile_ms(buckets, 0.5));
    l->set_p99_ms(latency_quantile_ms(buckets, 0.99));
  }
  p.set_calls_per_second(calls / seconds);
  p.set_failed_per_second(failed / seconds);
  p.set_rows_per_second(rows / seconds);
  return p;
}

void fill_result(const JobReports& r, v1::JobState state, v1::JobResult& rec) {
  rec.clear_loss();
  rec.clear_aux_loss();
  rec.clear_z_loss();
  rec.clear_expert_tokens();
  rec.clear_layer_rank_tokens();
  rec.clear_layer_balancedness();
  rec.clear_epochs();
  const auto steps = complete_steps(r);
  fill_times(steps, r.spec.tokens_per_rank() * r.world, rec);
  if (r.spec.mode() == v1::JobSpec::serve) fill_serve_rate(steps, rec);
  fill_sums(steps, r, rec);
  fill_epochs(steps, r, rec);
  fill_verify(r, state, rec);
}

}  // namespace moe::agent
