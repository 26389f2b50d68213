#include "moe/node/world_change.h"

#include <algorithm>
#include <memory>
#include <set>
#include <thread>

#include "moe/base/check.h"
#include "moe/base/log.h"
#include "moe/node/checkpoint.h"
#include "moe/spec/checkpoint_manifest.h"

namespace moe::node {

v1::Envelope rank_halted(const Halted& h, const std::vector<HeldStack>& held) {
  v1::Envelope msg;
  auto* r = msg.mutable_rank_halted();
  r->set_job_id(h.job_id);
  r->set_rank(h.rank);
  r->set_world_epoch(h.world_epoch);
  r->set_applied_steps(h.applied_steps);
  r->set_pending(h.pending);
  r->set_message(h.why);
  if (h.failed_peer >= 0) r->set_failed_peer(h.failed_peer);
  for (int l = 0; l < held.front().stack.num_layers(); ++l) {
    std::vector<bool> hosted(held.front().stack.map(l).num_experts, false);
    for (const HeldStack& w : held) {  // the current stack, and those kept until the new world proves itself
      const std::vector<bool> here = w.stack.map(l).hosted(w.rank);
      for (size_t e = 0; e < hosted.size() && e < here.size(); ++e) hosted[e] = hosted[e] || here[e];
    }
    auto* layer = r->add_hosted();
    for (size_t e = 0; e < hosted.size(); ++e)
      if (hosted[e]) layer->add_experts(static_cast<int>(e));
  }
  return msg;
}

void roll_back(const WorldTarget& to, const v1::NewWorld& next, transport::Deadline until) {
  const v1::CheckpointManifest m = spec::read_manifest(next.rollback());
  MOE_CHECK(m.step() == next.resume_step(), "world change: the checkpoint ", next.rollback(), " is of step ", m.step(),
            ", the new world resumes at ", next.resume_step());
  load_checkpoint(next.rollback(), m, to.stack, to.rank);
  to.comm.barrier(until);
  log::info("job ", to.job_id, ": rank ", to.rank, " rolled back to ", next.rollback(), " (step ", m.step(), ")");
}

namespace {

constexpr uint32_t kReplicatedTag = 1u << 30;  // apart from the moves' tags (their index)

void wait_for(transport::Communicator& comm, transport::Communicator::TransferId id, transport::Deadline until,
              const std::string& what) {
  while (!comm.test(id)) {
    MOE_CHECK(transport::Clock::now() < until, "world change: ", what, " did not complete in time");
    std::this_thread::yield();
  }
}

// What every rank holds alike (router, shared experts, their optimizer state,
// the selection bias): a rank that had it keeps its own (identical on every
// survivor once each caught up); a joining rank gets it from the first rank
// that has it.
void move_replicated(const HeldStack* from, const WorldTarget& to, const v1::NewWorld& next,
                     transport::Deadline until) {
  const bool train = to.job.train, moments = to.job.adam;
  const int L = to.stack.num_layers();
  std::vector<bool> has(next.world_size(), false);
  for (int r : next.new_rank())
    if (r >= 0) has[r] = true;
  const int source = static_cast<int>(std::find(has.begin(), has.end(), true) - has.begin());
  MOE_CHECK(source < next.world_size(), "world change: no rank of world ", next.world_epoch(), " has the job's state");
  auto state_of = [&](const ep::EpLayer& layer) {
    ep::EpLayer::ReplicatedState st;
    if (train) st = layer.replicated_state(moments);
    st.selection_bias = layer.selection_bias();
    return st;
  };
  auto install = [&](ep::EpLayer& layer, const ep::EpLayer::ReplicatedState& st) {
    if (train) layer.set_replicated_state(st);
    layer.set_selection_bias(st.selection_bias);
  };
  if (from) {
    for (int l = 0; l < L; ++l) install(to.stack.layer(l), state_of(from->stack.layer(l)));
    if (to.rank != source) return;
    auto sizes = std::make_shared<std::vector<int64_t>>();
    auto payload = std::make_shared<std::vector<float>>();
    for (int l = 0; l < L; ++l) {
      ep::EpLayer::ReplicatedState st = state_of(from->stack.layer(l));
      for (const auto* v : st.arrays()) {
        sizes->push_back(static_cast<int64_t>(v->size()));
        payload->insert(payload->end(), v->begin(), v->end());
      }
    }
    std::vector<transport::Communicator::TransferId> sent;
    for (int r = 0; r < next.world_size(); ++r) {
      if (has[r]) continue;
      sent.push_back(to.comm.isend(r, sizes->data(), sizes->size() * sizeof(int64_t), kReplicatedTag, sizes));
      sent.push_back(to.comm.isend(r, payload->data(), payload->size() * sizeof(float), kReplicatedTag + 1, payload));
    }
    for (const auto id : sent) wait_for(to.comm, id, until, "sending the replicated state to a joining rank");
    return;
  }
  auto sizes = std::make_shared<std::vector<int64_t>>(ep::EpLayer::ReplicatedState{}.arrays().size() * L);
  wait_for(to.comm, to.comm.irecv(source, sizes->data(), sizes->size() * sizeof(int64_t), kReplicatedTag, sizes), until,
           "the replicated state's sizes");
  int64_t total = 0;
  for (int64_t n : *sizes) total += n;
  auto payload = std::make_shared<std::vector<float>>(total);
  wait_for(to.comm, to.comm.irecv(source, payload->data(), payload->size() * sizeof(float), kReplicatedTag + 1, payload),
           until, "the replicated state");
  size_t at = 0, k = 0;
  for (int l = 0; l < L; ++l) {
    ep::EpLayer::ReplicatedState st;
    for (auto* v : st.arrays()) {
      v->assign(payload->begin() + at, payload->begin() + at + (*sizes)[k]);
      at += (*sizes)[k++];
    }
    install(to.stack.layer(l), st);
  }
}

// Where this rank holds expert e of layer l: the first stack of `held` that
// has it (null: nowhere), and its slot there.
std::pair<const HeldStack*, int> holder(const std::vector<HeldStack>& held, int l, int e) {
  for (const HeldStack& w : held) {
    const moe::ExpertMap& m = w.stack.map(l);
    for (int s = 0; s < m.slots_per_rank; ++s)
      if (m.expert_at(w.rank, s) == e) return {&w, s};
  }
  return {nullptr, -1};
}

struct Incoming {  // an expert state on its way to this rank
  int layer, expert;
  std::shared_ptr<ep::ExpertState> state;
  std::shared_ptr<std::vector<float>> wire;
  transport::Communicator::TransferId id;
};

// Posts every move of `next` this rank sends or receives; returns the receives.
std::vector<Incoming> post_moves(const std::vector<HeldStack>& held, const WorldTarget& to, const v1::NewWorld& next,
                                 std::vector<transport::Communicator::TransferId>& outgoing) {
  const model::LayerShape& shape = to.job.shape;
  std::vector<Incoming> incoming;
  for (int i = 0; i < next.moves_size(); ++i) {
    const v1::ExpertMove& mv = next.moves(i);
    if (mv.from_rank() == to.rank && mv.to_rank() != to.rank) {
      const auto [w, s] = holder(held, mv.layer(), mv.expert());
      MOE_CHECK(w, "world change: told to send expert ", mv.expert(), " of layer ", mv.layer(),
                ", which this rank does not hold");
      ep::ExpertState st;
      st.resize(shape.hidden, shape.ffn_hidden, to.job.adam);
      w->stack.layer(mv.layer()).export_slot(s, st);
      auto wire = std::make_shared<std::vector<float>>(st.to_wire());
      outgoing.push_back(to.comm.isend(mv.to_rank(), wire->data(), wire->size() * sizeof(float), i, wire));
    }
    if (mv.to_rank() == to.rank && mv.from_rank() != to.rank) {
      Incoming in{mv.layer(), mv.expert(), std::make_shared<ep::ExpertState>(), nullptr, 0};
      in.state->resize(shape.hidden, shape.ffn_hidden, to.job.adam);
      in.wire = std::make_shared<std::vector<float>>(in.state->floats());
      in.id = to.comm.irecv(mv.from_rank(), in.wire->data(), in.wire->size() * sizeof(float), i, in.wire);
      incoming.push_back(std::move(in));
    }
  }
  return incoming;
}

// Each slot of the new stack takes its expert from the old stack when this rank
// held it, else from the rank the agent named (a surviving replica, bitwise
// equal to the lost one). A forward job's experts are the spec's, built by the
// new stack.
}  // namespace

void move_state(const std::vector<HeldStack>& held, bool from_a_world, const WorldTarget& to, const v1::NewWorld& next,
                transport::Deadline until) {
  move_replicated(from_a_world ? &held.front() : nullptr, to, next, until);
  if (!to.job.train) return to.comm.barrier(until);
  std::vector<transport::Communicator::TransferId> outgoing;
  std::vector<Incoming> incoming = post_moves(held, to, next, outgoing);
  std::set<std::pair<int, int>> moved_here;
  for (const Incoming& in : incoming) moved_here.insert({in.layer, in.expert});
  for (int l = 0; l < to.stack.num_layers(); ++l) {  // the experts this rank keeps
    for (int s = 0; s < to.stack.map(l).slots_per_rank; ++s) {
      const int e = to.stack.map(l).expert_at(to.rank, s);
      if (e < 0 || moved_here.count({l, e})) continue;
      const auto [w, o] = holder(held, l, e);
      MOE_CHECK(w, "world change: no source for expert ", e, " of layer ", l, " on rank ", to.rank);
      ep::ExpertState st;
      st.resize(to.job.shape.hidden, to.job.shape.ffn_hidden, to.job.adam);
      w->stack.layer(l).export_slot(o, st);
      to.stack.layer(l).import_slot(s, st);
    }
  }
  for (Incoming& in : incoming) {
    wait_for(to.comm, in.id, until, "expert " + std::to_string(in.expert) + " of layer " + std::to_string(in.layer));
    in.state->from_wire(*in.wire);
    const moe::ExpertMap& m = to.stack.map(in.layer);  // every slot of the expert here
    for (int s = 0; s < m.slots_per_rank; ++s)
      if (m.expert_at(to.rank, s) == in.expert) to.stack.layer(in.layer).import_slot(s, *in.state);
  }
  for (const auto id : outgoing) wait_for(to.comm, id, until, "an expert copy");
  to.comm.barrier(until);
}

}  // namespace moe::node
