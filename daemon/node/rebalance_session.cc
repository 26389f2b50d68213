#include "moe/node/rebalance_session.h"

#include <algorithm>
#include <sstream>
#include <thread>

#include "moe/base/check.h"
#include "moe/base/clock.h"
#include "moe/base/log.h"
#include "moe/spec/expert_map_codec.h"

namespace moe::node {

FaultInjection FaultInjection::parse(const std::string& spec, const std::string& node) {
  FaultInjection f;
  std::stringstream in(spec);
  for (std::string item; std::getline(in, item, ',');) {
    if (item.empty()) continue;
    const auto colon = item.find(':');
    MOE_CHECK(colon != std::string::npos, "MOE_FAULT_INJECT: expects NODE:FAULT, got '", item, "'");
    if (item.substr(0, colon) != node) continue;
    const std::string fault = item.substr(colon + 1);
    if (fault == "refuse-copy") f.refuse_copy = true;
    else if (fault == "stall-copy") f.stall_copy = true;
    else if (fault == "die-on-commit") f.die_on_commit = true;
    else MOE_CHECK(false, "MOE_FAULT_INJECT: unknown fault '", fault, "' (refuse-copy, stall-copy, die-on-commit)");
  }
  return f;
}

const std::string& RebalanceMailbox::job_of(const v1::Envelope& m) {
  return m.has_prepare_rebalance() ? m.prepare_rebalance().job_id()
         : m.has_commit_rebalance() ? m.commit_rebalance().job_id()
                                    : m.abort_rebalance().job_id();
}

void RebalanceMailbox::deliver(const v1::Envelope& m) {
  const std::string& job = job_of(m);
  if (job != job_id_)
    throw rpc::RpcError(v1::ERROR_CODE_FAILED_PRECONDITION, "job " + job + " is not running here (" + job_id_ + " is)");
  if (m.has_prepare_rebalance()) {
    const v1::PrepareRebalance& p = m.prepare_rebalance();
    log::info("job ", job_id_, ": PREPARE epoch ", p.epoch(), " (", p.copies_size(), " copies)");
    prepare(p);
  } else if (m.has_commit_rebalance()) {
    log::info("job ", job_id_, ": COMMIT epoch ", m.commit_rebalance().epoch());
    commit(m.commit_rebalance().epoch());
  } else if (m.has_abort_rebalance()) {
    log::info("job ", job_id_, ": ABORT epoch ", m.abort_rebalance().epoch(), " (", m.abort_rebalance().reason(), ")");
    abort(m.abort_rebalance().epoch());
  }
}

void RebalanceMailbox::prepare(const v1::PrepareRebalance& p) {
  std::lock_guard<std::mutex> lock(mu_);
  prepare_ = p;
}

void RebalanceMailbox::commit(int64_t epoch) {
  std::lock_guard<std::mutex> lock(mu_);
  committed_ = epoch;
}

void RebalanceMailbox::abort(int64_t epoch) {
  std::lock_guard<std::mutex> lock(mu_);
  aborted_ = epoch;
  if (prepare_ && prepare_->epoch() == epoch) prepare_.reset();
}

void RebalanceMailbox::abandon(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!prepare_) return;
  log::info("job ", job_id_, ": ", why, "; dropping what epoch ", prepare_->epoch(), " staged");
  aborted_ = prepare_->epoch();
  prepare_.reset();
}

RebalanceMailbox::View RebalanceMailbox::view() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {prepare_, committed_, aborted_};
}

bool RebalanceMailbox::rank_ready(int64_t epoch) {
  std::lock_guard<std::mutex> lock(mu_);
  if (ready_epoch_ != epoch) {
    ready_epoch_ = epoch;
    ready_ranks_ = 0;
  }
  return ++ready_ranks_ == local_ranks_;
}

bool RebalanceMailbox::claim_refusal(int64_t epoch) {
  std::lock_guard<std::mutex> lock(mu_);
  if (refused_epoch_ == epoch) return false;
  refused_epoch_ = epoch;
  return true;
}

void RebalanceMailbox::done(int64_t epoch) {
  std::lock_guard<std::mutex> lock(mu_);
  if (prepare_ && prepare_->epoch() == epoch) prepare_.reset();
}

RebalanceSession::RebalanceSession(RebalanceSessionEnv env, ModelStack& stack, RebalanceMailbox& mailbox,
                                   rpc::RpcClient& agent)
    : env_(std::move(env)), stack_(stack), mailbox_(mailbox), agent_(agent) {}

void RebalanceSession::vote(float* v) {
  const RebalanceMailbox::View view = mailbox_.view();
  std::fill(v, v + kVoteFloats, 0.0f);
  voted_prepare_.reset();
  if (!staged_ && view.prepare) {
    voted_prepare_ = view.prepare;
    v[0] = 1;
    v[1] = static_cast<float>(view.prepare->epoch() & 0xfffff);
  }
  if (staged_) {
    v[2] = view.committed == staged_->epoch() ? 1.0f : 0.0f;
    v[3] = view.aborted == staged_->epoch() ? 1.0f : 0.0f;
  }
}

void RebalanceSession::act(const float* sum, int step) {
  const auto world = static_cast<float>(env_.world);
  if (!staged_) {
    if (voted_prepare_ && sum[0] == world &&
        sum[1] == static_cast<float>(env_.world * (voted_prepare_->epoch() & 0xfffff)))
      stage(*voted_prepare_, step);
    return;
  }
  if (sum[3] > 0) drop(step);
  else if (sum[2] == world) switch_staged(step);
}

void RebalanceSession::stage(const v1::PrepareRebalance& p, int step) {
  MOE_CHECK(p.maps_size() == stack_.num_layers(), "rebalance: ", p.maps_size(), " maps for ", stack_.num_layers(),
            " layers");
  std::vector<ExpertMap> maps;
  std::vector<std::vector<ExpertCopy>> copies(stack_.num_layers());
  for (const v1::PlacementMap& m : p.maps()) maps.push_back(spec::from_proto(m));
  for (const v1::ExpertCopy& c : p.copies()) {
    MOE_CHECK(c.layer() >= 0 && c.layer() < stack_.num_layers(), "rebalance: a copy of layer ", c.layer());
    copies[c.layer()].push_back({c.expert(), c.from_rank(), c.to_rank(), c.to_slot()});
  }
  staged_ = p;
  staged_ready_ = false;
  stack_.stage(maps, copies);
  log::info("job ", env_.job_id, ": rank ", env_.rank, " staging epoch ", p.epoch(), " from step ", step);
  const auto gained = std::find_if(p.copies().begin(), p.copies().end(),
                                   [&](const v1::ExpertCopy& c) { return c.to_rank() == env_.rank; });
  if (env_.faults.refuse_copy && gained != p.copies().end() && mailbox_.claim_refusal(p.epoch()))
    tell_agent_ready(false, "rank " + std::to_string(env_.rank) + " refuses the copy of layer " +
                                std::to_string(gained->layer()) + " expert " + std::to_string(gained->expert()) +
                                " from rank " + std::to_string(gained->from_rank()) + " (injected fault)");
}

void RebalanceSession::drop(int step) {
  log::info("job ", env_.job_id, ": rank ", env_.rank, " drops staged epoch ", staged_->epoch(), " before step ", step);
  stack_.drop_staged();
  mailbox_.done(staged_->epoch());
  staged_.reset();
}

void RebalanceSession::switch_staged(int step) {
  const int64_t copied = stack_.staged_bytes_received();
  const double t0 = now_seconds();
  stack_.switch_to_staged();
  log::info("job ", env_.job_id, ": rank ", env_.rank, " switched to epoch ", staged_->epoch(), " before step ", step,
            " in ", now_seconds() - t0, " s (", copied, " bytes copied in)");
  if (env_.metrics) env_.metrics->record_rebalance_copy(copied);
  mailbox_.done(staged_->epoch());
  staged_.reset();
}

void RebalanceSession::after_step() {
  if (!staged_ || staged_ready_ || !stack_.staged_ready()) return;
  staged_ready_ = true;
  if (env_.faults.stall_copy) return;  // test hook: this node's copies never complete
  if (mailbox_.rank_ready(staged_->epoch())) tell_agent_ready(true, "");
}

void RebalanceSession::tell_agent_ready(bool ok, const std::string& reason) {
  v1::Envelope msg;
  v1::RebalanceReady* r = msg.mutable_rebalance_ready();
  r->set_job_id(env_.job_id);
  r->set_epoch(staged_->epoch());
  r->set_node(env_.node_name);
  r->set_ok(ok);
  r->set_reason(reason);
  // An agent that does not hear it aborts the rebalance at its timeout, and one
  // that restarted has lost it (the daemon drops the staging when it registers):
  // either way the job goes on, so a READY that cannot be delivered fails nothing.
  // The connection may predate an agent restart that came before the PREPARE:
  // the first call then fails at once on it and the client reconnects, so an
  // unreachable agent is tried again, twice at most (a READY the agent already
  // has is taken again harmlessly), all within the one 10 s deadline.
  using Clock = std::chrono::steady_clock;
  const Clock::time_point deadline = Clock::now() + std::chrono::seconds(10);
  for (int attempt = 0;; ++attempt) {
    try {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      agent_.call(msg, std::max(left, std::chrono::milliseconds(1)));
      return;
    } catch (const rpc::RpcError& e) {
      const auto pause = std::chrono::milliseconds(attempt == 0 ? 0 : 400);
      if (e.code() == v1::ERROR_CODE_UNAVAILABLE && attempt < 2 && Clock::now() + pause < deadline) {
        std::this_thread::sleep_for(pause);
        continue;
      }
      log::warn("job ", env_.job_id, ": rank ", env_.rank, ": READY for epoch ", staged_->epoch(),
                " did not reach the agent: ", e.what());
      return;
    }
  }
}

}  // namespace moe::node
