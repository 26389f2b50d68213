#include "moe/node/serve_requests.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "moe/base/check.h"

namespace moe::node {

void ServeRequests::ask_step(int64_t step, int clients, const std::string& caller, StepDone done) {
  int64_t steps = 0;
  StepDone replaced;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!closed_.empty()) throw Error(closed_);
    if (clients < 1) throw InvalidArgument("clients: must be >= 1, got " + std::to_string(clients));
    steps = steps_;
    if (step == steps_ + 2) {
      early_calls_.push_back({step, clients, caller, std::move(done)});
      return;
    }
    if (step > steps_ + 1)
      throw InvalidArgument("step: the job applied " + std::to_string(steps_) + " optimizer steps, the next is " +
                            std::to_string(steps_ + 1) + ", got " + std::to_string(step));
    if (step == steps_ + 1) {
      for (const StepCall& c : step_calls_)
        if (c.clients != clients)
          throw InvalidArgument("clients: step " + std::to_string(step) + "'s callers said " +
                                std::to_string(c.clients) + ", got " + std::to_string(clients));
      const auto again = std::find_if(step_calls_.begin(), step_calls_.end(),
                                      [&](const StepCall& c) { return c.caller == caller; });
      if (again == step_calls_.end()) {
        step_calls_.push_back({step, clients, caller, std::move(done)});
        return;
      }
      replaced = std::exchange(again->done, std::move(done));
    }
  }
  if (replaced) return replaced("step " + std::to_string(step) + ": " + caller + " asked again", steps, false);
  if (step < 1) throw InvalidArgument("step: must be >= 1, got " + std::to_string(step));
  done("", steps, false);  // applied before: exactly once
}

void ServeRequests::ask_weights(WeightsDone done) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!closed_.empty()) throw Error(closed_);
  weight_calls_.push_back(std::move(done));
}

void ServeRequests::vote(float* v) const {
  std::lock_guard<std::mutex> lock(mu_);
  v[0] = static_cast<float>(step_calls_.size());
  v[1] = step_calls_.empty() ? 0.0f : static_cast<float>(step_calls_.front().clients);
  v[2] = step_calls_.empty() ? 0.0f : 1.0f;
  v[3] = static_cast<float>(weight_calls_.size());
}

bool ServeRequests::step_due(const float* sum) {
  if (sum[2] <= 0) return false;
  const double clients = std::ceil(static_cast<double>(sum[1]) / sum[2]);  // nodes' callers say the same
  return sum[0] >= clients;
}

void ServeRequests::step_done(const std::string& error) {
  std::vector<StepCall> calls, early;
  int64_t steps = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (error.empty()) ++steps_;
    steps = steps_;
    calls.swap(step_calls_);
    early.swap(early_calls_);
  }
  for (StepCall& c : calls) c.done(error, steps, error.empty());
  for (StepCall& c : early) {
    try {
      ask_step(c.step, c.clients, c.caller, c.done);
    } catch (const std::exception& e) {
      c.done(e.what(), steps, false);
    }
  }
}

void ServeRequests::weights_read(const std::string& error, const v1::ServeWeightsReply& reply) {
  std::vector<WeightsDone> calls;
  {
    std::lock_guard<std::mutex> lock(mu_);
    calls.swap(weight_calls_);
  }
  for (WeightsDone& d : calls) d(error, reply);
}

void ServeRequests::resume_at(int64_t steps) {
  std::lock_guard<std::mutex> lock(mu_);
  steps_ = steps;
}

int64_t ServeRequests::steps() const {
  std::lock_guard<std::mutex> lock(mu_);
  return steps_;
}

void ServeRequests::close(const std::string& why) {
  std::vector<StepCall> steps;
  std::vector<WeightsDone> weights;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!closed_.empty()) return;
    closed_ = why;
    steps.swap(step_calls_);
    steps.insert(steps.end(), std::make_move_iterator(early_calls_.begin()), std::make_move_iterator(early_calls_.end()));
    early_calls_.clear();
    weights.swap(weight_calls_);
  }
  for (StepCall& c : steps) c.done(why, 0, false);
  for (WeightsDone& d : weights) d(why, {});
}

}  // namespace moe::node
