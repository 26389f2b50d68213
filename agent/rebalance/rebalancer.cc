#include "moe/rebalance/rebalancer.h"

#include <sstream>

#include "moe/base/log.h"
#include "moe/rpc/frame.h"

namespace moe::agent {

using rpc::RpcError;

double expert_copy_bytes(const v1::JobSpec& spec) {
  const double tensor = 3.0 * spec.ffn_hidden() * spec.hidden() * sizeof(float);
  if (spec.mode() != v1::JobSpec::train) return tensor;
  return tensor * (spec.optimizer() == v1::JobSpec::sgd ? 1 : 3);
}

Rebalancer::Rebalancer(RebalanceOptions options, PlacementService& placement, const Scheduler& scheduler,
                       const Membership& members, RebalanceActions& actions)
    : opts_(options), placement_(placement), scheduler_(scheduler), members_(members), actions_(actions) {
  for (auto r : {v1::REBALANCE_RESULT_COMMITTED, v1::REBALANCE_RESULT_ABORTED, v1::REBALANCE_RESULT_FAILED})
    counts_[r] = 0;
}

// The plan as a reply: the changed layers' maps, balancedness before and
// predicted, and the copies with their bytes in the running job. With no job on
// the shape nothing is copied (the next job loads its experts where the maps
// place them), so the reply lists no copies, dry run or not.
v1::RebalanceReply Rebalancer::plan_reply(const v1::RebalanceRequest& req, const RunningJob* job) const {
  const ShapeKey shape = job ? job->shape : ShapeKey::of(req.shape());
  const RebalancePlan plan =
      placement_.plan(shape, req.has_redundant_experts() ? std::optional<int>(req.redundant_experts()) : std::nullopt,
                      req.has_layer() ? std::optional<int>(req.layer()) : std::nullopt);
  v1::RebalanceReply r;
  *r.mutable_shape() = plan.shape.proto();
  for (const auto& m : plan.maps) *r.add_maps() = m;
  *r.mutable_balancedness_before() = {plan.before.begin(), plan.before.end()};
  *r.mutable_predicted_balancedness() = {plan.predicted.begin(), plan.predicted.end()};
  if (!job) {
    r.set_message("no job runs on the shape: the maps take force for the next job, nothing is copied");
    return r;
  }
  const double bytes = expert_copy_bytes(job->reports.spec);
  for (v1::ExpertCopy c : plan.copies) {
    c.set_bytes(bytes);
    r.set_copy_bytes(r.copy_bytes() + bytes);
    *r.add_copies() = c;
  }
  r.set_job_id(job->id);
  return r;
}

uint64_t Rebalancer::start(const v1::RebalanceRequest& req, Clock::time_point now) {
  if (live_) throw RpcError(v1::ERROR_CODE_FAILED_PRECONDITION, "a rebalance of " + live_->reply.job_id() + " is in progress");
  const RunningJob* job = scheduler_.running();
  // The running job's shape unless another one is named.
  if (job && !(req.shape().experts() == 0 || ShapeKey::of(req.shape()) == job->shape)) job = nullptr;
  if (job && job->ending()) throw RpcError(v1::ERROR_CODE_FAILED_PRECONDITION, "job " + job->id + " is ending");
  v1::RebalanceReply reply = plan_reply(req, job);
  const uint64_t id = next_id_++;
  if (req.dry_run()) {
    reply.set_result(v1::REBALANCE_RESULT_DRY_RUN);
    complete(id, std::move(reply));
    return id;
  }
  if (!job) {  // nothing runs on the shape: the next job starts on the new maps
    reply.set_epoch(placement_.install(ShapeKey::of(reply.shape()), {reply.maps().begin(), reply.maps().end()}, 0,
                                       "a rebalance between jobs"));
    reply.set_result(v1::REBALANCE_RESULT_COMMITTED);  // plan_reply's message says what that means
    ++counts_[v1::REBALANCE_RESULT_COMMITTED];
    log::info("placement: rebalanced ", ShapeKey::of(reply.shape()).name(), " to epoch ", reply.epoch());
    complete(id, std::move(reply));
    return id;
  }
  Live live{.id = id, .reply = std::move(reply), .started = now};
  const int64_t epoch = placement_.reserve_epoch();
  live.reply.set_epoch(epoch);
  for (auto& m : *live.reply.mutable_maps()) m.set_epoch(epoch);
  // Every layer's map: the changed ones new, the others as they are.
  std::vector<v1::PlacementMap> all = placement_.maps(job->shape);
  for (const auto& m : live.reply.maps()) all[m.layer()] = m;
  live.prepare.set_job_id(job->id);
  live.prepare.set_epoch(epoch);
  for (const auto& m : all) *live.prepare.add_maps() = m;
  *live.prepare.mutable_copies() = live.reply.copies();
  for (const NodeRecord& n : members_.nodes()) live.waiting.insert(n.name);
  log::info("rebalance: job ", job->id, " to epoch ", epoch, ", ", live.reply.copies_size(), " copies (",
            live.reply.copy_bytes() / 1e6, " MB)");
  live_ = std::move(live);
  actions_.prepare(live_->prepare);
  return id;
}

const v1::RebalanceReply* Rebalancer::result(uint64_t id) const {
  const auto it = done_.find(id);
  return it == done_.end() ? nullptr : &it->second;
}

void Rebalancer::complete(uint64_t id, v1::RebalanceReply reply) {
  done_[id] = std::move(reply);
  while (done_.size() > 64) done_.erase(done_.begin());
  actions_.rebalance_done(done_[id]);
}

void Rebalancer::on_ready(const v1::RebalanceReady& r, Clock::time_point now) {
  if (!live_ || r.epoch() != live_->prepare.epoch() || r.job_id() != live_->prepare.job_id()) return;
  if (!r.ok()) return finish(v1::REBALANCE_RESULT_ABORTED, "node " + r.node() + " refused: " + r.reason(), now);
  live_->waiting.erase(r.node());
  if (!live_->waiting.empty()) return;
  // Every node holds its copies: the epoch is committed, and never aborted.
  std::vector<v1::PlacementMap> maps(live_->reply.maps().begin(), live_->reply.maps().end());
  placement_.install(ShapeKey::of(live_->reply.shape()), std::move(maps), live_->prepare.epoch(),
                     "a live rebalance of " + live_->prepare.job_id());
  v1::CommitRebalance c;
  c.set_job_id(live_->prepare.job_id());
  c.set_epoch(live_->prepare.epoch());
  actions_.commit(c);
  finish(v1::REBALANCE_RESULT_COMMITTED, "", now);
}

void Rebalancer::on_prepare_failed(int64_t epoch, const std::string& node, const std::string& error,
                                   Clock::time_point now) {
  if (live_ && live_->prepare.epoch() == epoch)
    finish(v1::REBALANCE_RESULT_ABORTED, "PREPARE to node " + node + " failed: " + error, now);
}

void Rebalancer::on_job_ended(const std::string& job_id, const std::string& why, Clock::time_point now) {
  if (live_ && live_->prepare.job_id() == job_id)
    finish(v1::REBALANCE_RESULT_FAILED, "job " + job_id + " ended: " + why, now);
}

void Rebalancer::on_world_halted(const std::string& job_id, const std::string& why, Clock::time_point now) {
  if (live_ && live_->prepare.job_id() == job_id)
    finish(v1::REBALANCE_RESULT_FAILED, "job " + job_id + " changes its world: " + why, now);
}

void Rebalancer::tick(Clock::time_point now) {
  if (!live_ || now - live_->started < opts_.timeout) return;
  std::string who;
  for (const std::string& node : live_->waiting) who += (who.empty() ? "" : ", ") + node;
  std::string copies;
  for (const v1::ExpertCopy& c : live_->prepare.copies()) {
    const int node = members_.devices_per_node() > 0 ? c.to_rank() / members_.devices_per_node() : -1;
    if (node >= 0 && node < members_.num_nodes() && live_->waiting.count(members_.nodes()[node].name))
      copies += (copies.empty() ? "" : "; ") + std::string("layer ") + std::to_string(c.layer()) + " expert " +
                std::to_string(c.expert()) + " rank " + std::to_string(c.from_rank()) + " -> " +
                std::to_string(c.to_rank());
  }
  std::ostringstream within;
  within << opts_.timeout.count() / 1000.0;
  finish(v1::REBALANCE_RESULT_ABORTED,
         "copies did not complete within " + within.str() + " s on node(s) " + who +
             (copies.empty() ? "" : " (" + copies + ")"),
         now);
}

// Ends the live rebalance: ABORT to the daemons unless it committed or the job
// is gone, then the reply for its waiter.
void Rebalancer::finish(v1::RebalanceResult result, const std::string& message, Clock::time_point now) {
  Live live = std::move(*live_);
  live_.reset();
  if (result == v1::REBALANCE_RESULT_ABORTED) {
    v1::AbortRebalance a;
    a.set_job_id(live.prepare.job_id());
    a.set_epoch(live.prepare.epoch());
    a.set_reason(message);
    actions_.abort(a);
  }
  live.reply.set_result(result);
  live.reply.set_message(message);
  live.reply.set_seconds(std::chrono::duration<double>(now - live.started).count());
  ++counts_[result];
  durations_.push_back(live.reply.seconds());
  if (result == v1::REBALANCE_RESULT_COMMITTED)
    log::info("rebalance: job ", live.prepare.job_id(), " committed epoch ", live.prepare.epoch(), " in ",
              live.reply.seconds(), " s");
  else
    log::warn("rebalance: job ", live.prepare.job_id(), " epoch ", live.prepare.epoch(), " ",
              v1::RebalanceResult_Name(result), ": ", message);
  complete(live.id, std::move(live.reply));
}

}  // namespace moe::agent
