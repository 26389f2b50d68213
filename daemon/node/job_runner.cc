#include "job_runner.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "ep/ep_layer.h"
#include "io/layer_io.h"
#include "job_model.h"
#include "moe/kernels/check.h"
#include "moe/kernels/cpu_backend.h"
#include "moe_ref.h"
#include "rpc/log.h"
#include "rpc/rpc.h"
#include "spec/job_spec.h"
#include "transport/ucx_communicator.h"

namespace moe::node {
namespace {

using kernels::DType;

// The transport bootstrap through the agent: publish our address, get everyone's.
class AgentBootstrap final : public transport::Bootstrap {
 public:
  AgentBootstrap(rpc::RpcClient& agent, std::string job_id, int rank)
      : agent_(agent), job_id_(std::move(job_id)), rank_(rank) {}
  std::vector<std::string> all_gather(const std::string& mine) override {
    v1::Envelope req;
    auto* p = req.mutable_bootstrap_publish();
    p->set_job_id(job_id_);
    p->set_rank(rank_);
    p->set_blob(mine);
    const v1::Envelope reply = agent_.call(req, std::chrono::seconds(60));
    return {reply.bootstrap_addresses().blobs().begin(), reply.bootstrap_addresses().blobs().end()};
  }

 private:
  rpc::RpcClient& agent_;
  std::string job_id_;
  int rank_;
};

// x <- x + out, in fp32, stored in the job dtype.
void residual_add(std::vector<uint8_t>& x, const std::vector<uint8_t>& out, size_t n, DType t) {
  if (t == DType::kF32) {
    auto* a = reinterpret_cast<float*>(x.data());
    const auto* b = reinterpret_cast<const float*>(out.data());
    for (size_t i = 0; i < n; ++i) a[i] += b[i];
  } else {
    auto* a = reinterpret_cast<kernels::bf16_t*>(x.data());
    const auto* b = reinterpret_cast<const kernels::bf16_t*>(out.data());
    for (size_t i = 0; i < n; ++i) a[i] = kernels::f32_to_bf16(kernels::bf16_to_f32(a[i]) + kernels::bf16_to_f32(b[i]));
  }
}

// What one layer saw at step 0, for verify and the dump.
struct Snapshot {
  std::vector<uint8_t> x, out;
  std::vector<int32_t> topk_idx, kept_idx;
  std::vector<float> topk_weight;
};

// Recomputes a layer's step-0 output with the fp64 reference, on this rank's tokens
// (capacity is per source rank, so a rank's tokens need nobody else's).
v1::Verify verify_layer(const v1::JobSpec& spec, int layer, const Snapshot& s) {
  const int64_t T = spec.tokens_per_rank();
  const int H = spec.hidden(), K = spec.top_k();
  const DType dt = job_dtype(spec);
  const model::LayerWeights w =
      ep::weights_as_used(layer_weights(spec, layer, std::vector<bool>(spec.experts(), true)), dt);
  ref::Config rc;
  rc.hidden = H;
  rc.ffn_hidden = spec.ffn_hidden();
  rc.num_experts = spec.experts();
  rc.top_k = K;
  const ep::MoeLayerConfig lc = layer_config(spec);
  rc.score = lc.score;
  rc.num_groups = lc.num_groups;
  rc.group_top_k = lc.group_top_k;
  rc.norm_topk_prob = lc.norm_topk_prob;
  rc.routed_scaling_factor = lc.routed_scaling_factor;
  rc.capacity_factor = lc.capacity_factor;
  rc.drop_policy = lc.drop_policy;
  ref::Weights rw;
  rw.gate.assign(w.gate.begin(), w.gate.end());
  rw.selection_bias.assign(w.selection_bias.begin(), w.selection_bias.end());
  rw.logit_bias.assign(w.logit_bias.begin(), w.logit_bias.end());
  rw.w13.assign(w.w13.begin(), w.w13.end());
  rw.w2.assign(w.w2.begin(), w.w2.end());
  const std::vector<float> xf = model::from_storage(s.x.data(), T * H, dt);
  const std::vector<double> x(xf.begin(), xf.end());
  // The reference's own selection must agree except at near-ties fp32 cannot break;
  // the numbers are then compared on our selection.
  const ref::Forward own = ref::forward(rc, rw, x, T);
  int64_t disagreements = 0;
  for (int64_t t = 0; t < T; ++t)
    if (own.selection_margin[t] > 1e-5)
      for (int k = 0; k < K; ++k) disagreements += own.topk_idx[t * K + k] != s.topk_idx[t * K + k];
  const ref::Forward f = ref::forward(rc, rw, x, T, {s.topk_idx.data(), {}});
  const std::vector<float> out = model::from_storage(s.out.data(), T * H, dt);
  double max_abs = 0, scale = 0;
  for (int64_t i = 0; i < T * H; ++i) {
    max_abs = std::max(max_abs, std::fabs(out[i] - f.out[i]));
    scale = std::max(scale, std::fabs(f.out[i]));
  }
  bool kept_match = f.kept_idx == s.kept_idx;
  v1::Verify v;
  v.set_max_abs_error(max_abs);
  v.set_max_rel_error(scale > 0 ? max_abs / scale : max_abs);
  // fp32: accumulation-order noise; bf16: out is rounded once (2^-9) and each rank's
  // partial combine row once more.
  const double tol = dt == DType::kF32 ? 1e-4 : 1.0 / 64;
  v.set_passed(disagreements == 0 && kept_match && v.max_rel_error() <= tol && std::isfinite(max_abs));
  return v;
}

}  // namespace

JobRunner::JobRunner(v1::StartJob job, RunnerEnv env) : job_(std::move(job)), env_(std::move(env)) {
  std::vector<int> local;
  for (int i = 0; i < env_.devices; ++i) local.push_back(env_.node_index * env_.devices + i);
  hub_ = std::make_shared<transport::LocalHub>(local);
  running_ = env_.devices;
  for (int i = 0; i < env_.devices; ++i) threads_.emplace_back([this, i] { rank_main(i); });
}

JobRunner::~JobRunner() {
  cancel("daemon stopping");
  for (auto& t : threads_) t.join();
}

void JobRunner::cancel(const std::string& reason) {
  std::lock_guard<std::mutex> lock(cancel_mu_);
  if (cancel_.exchange(true)) return;
  cancel_reason_ = reason;
  log::info("job ", job_.job_id(), ": cancel requested (", reason, ")");
}

std::string JobRunner::cancel_reason() const {
  std::lock_guard<std::mutex> lock(cancel_mu_);
  return cancel_reason_.empty() ? "cancelled by another rank" : cancel_reason_;
}

void JobRunner::rank_main(int local) {
  const v1::JobSpec& spec = job_.spec();
  const int rank = env_.node_index * env_.devices + local;
  const int world = job_.world_size();
  rpc::RpcClient agent(rpc::ClientOptions::make(env_.agent_address, env_.token, "moed",
                                                env_.node_name + "/rank" + std::to_string(rank)));
  v1::Envelope done;
  auto* d = done.mutable_rank_done();
  d->set_job_id(job_.job_id());
  d->set_rank(rank);
  try {
    const ep::MoeLayerConfig cfg = layer_config(spec);
    const DType dt = cfg.dtype;
    const int64_t T = spec.tokens_per_rank();
    const int H = spec.hidden(), K = spec.top_k(), E = spec.experts(), L = spec.layers();
    MOE_CHECK(job_.maps_size() == L, "start: ", job_.maps_size(), " placement maps for ", L, " layers");

    kernels::ThreadPool pool(env_.threads_per_rank);
    auto backend = kernels::make_cpu_backend(pool);
    AgentBootstrap boot(agent, job_.job_id(), rank);
    transport::UcxOptions uo;
    uo.hub = hub_;
    transport::UcxCommunicator comm(rank, world, boot, uo);
    const auto deadline = [&] { return transport::deadline_in(env_.transport_timeout); };

    std::vector<std::unique_ptr<ep::EpLayer>> layers;
    std::vector<ep::ExpertMap> maps;
    for (int l = 0; l < L; ++l) {
      maps.push_back(expert_map(job_.maps(l)));
      ep::EpOptions eo;
      eo.timeout = env_.transport_timeout;
      eo.tag_base = static_cast<uint32_t>(l) << 24;
      layers.push_back(std::make_unique<ep::EpLayer>(cfg, maps.back(), comm, *backend, eo));
      std::vector<bool> needed(E, false);
      for (int s = 0; s < maps.back().slots_per_rank; ++s)
        if (maps.back().expert_at(rank, s) >= 0) needed[maps.back().expert_at(rank, s)] = true;
      layers.back()->set_weights(layer_weights(spec, l, needed));
    }
    log::info("job ", job_.job_id(), ": rank ", rank, " of ", world, " ready (", L, " layers, ", T, " tokens)");

    std::vector<Snapshot> snaps(L);
    const bool snapshot = spec.verify() || !spec.dump_dir().empty();
    std::vector<uint8_t> out(T * H * kernels::dtype_size(dt) + 1);
    int step = 0;
    for (; step < spec.steps(); ++step) {
      float stop = cancel_.load() ? 1.0f : 0.0f;
      comm.all_reduce_sum(&stop, 1, deadline());
      if (stop > 0) break;
      const double t0 = ep::now_seconds();
      std::vector<uint8_t> x = model::to_storage(step_inputs(spec, rank, step), dt);
      v1::Envelope report;
      auto* r = report.mutable_step_report();
      r->set_job_id(job_.job_id());
      r->set_rank(rank);
      v1::StepStats* st = r->mutable_stats();
      st->set_step(step);
      for (int l = 0; l < L; ++l) {
        ep::EpLayer& layer = *layers[l];
        layer.forward(x.data(), T, static_cast<int64_t>(rank) * T, out.data());
        const ep::EpStats& es = layer.stats();
        auto* ph = st->mutable_phase_seconds();
        ph->set_router(ph->router() + es.router);
        ph->set_dispatch(ph->dispatch() + es.dispatch);
        ph->set_expert(ph->expert() + es.expert);
        ph->set_combine(ph->combine() + es.combine);
        st->set_dispatch_bytes(st->dispatch_bytes() + es.dispatch_bytes);
        st->set_naive_dispatch_bytes(st->naive_dispatch_bytes() + es.naive_dispatch_bytes);
        st->set_combine_bytes(st->combine_bytes() + es.combine_bytes);
        st->set_expert_rows(st->expert_rows() + es.received_rows);
        metrics::LayerStep ms;
        ms.layer = l;
        ms.expert_tokens.assign(E, 0);
        for (int64_t p = 0; p < T * K; ++p)
          if (layer.kept_idx()[p] >= 0) ++ms.expert_tokens[layer.kept_idx()[p]];
        auto* et = st->add_expert_tokens();
        for (int64_t n : ms.expert_tokens) et->add_tokens(static_cast<double>(n));
        if (env_.metrics) {
          ms.rows = es.received_rows;
          ms.dispatch_seconds = es.dispatch_transport;
          ms.combine_seconds = es.combine_transport;
          ms.expert_seconds = es.expert;
          ms.dispatch_bytes = es.dispatch_bytes;
          ms.combine_bytes = es.combine_bytes;
          ms.naive_dispatch_bytes = es.naive_dispatch_bytes;
          env_.metrics->record(rank, ms);
        }
        if (step == 0 && snapshot) {
          Snapshot& s = snaps[l];
          s.x = x;
          s.out = out;
          s.topk_idx.assign(layer.topk_idx(), layer.topk_idx() + T * K);
          s.kept_idx.assign(layer.kept_idx(), layer.kept_idx() + T * K);
          s.topk_weight.assign(layer.topk_weight(), layer.topk_weight() + T * K);
        }
        residual_add(x, out, T * H, dt);
      }
      st->set_step_seconds(ep::now_seconds() - t0);
      if (env_.metrics) env_.metrics->record_step(rank, st->step_seconds());
      agent.call(report, std::chrono::seconds(10));
      if (step == 0 && !spec.dump_dir().empty()) {
        std::filesystem::create_directories(spec.dump_dir());
        io::LayerDump dump;
        dump.dtype = dt;
        dump.shape = layer_shape(spec);
        dump.top_k = K;
        dump.num_tokens = T;
        dump.x = snaps[0].x.data();
        dump.out = snaps[0].out.data();
        dump.topk_idx = snaps[0].kept_idx.data();
        dump.topk_weight = snaps[0].topk_weight.data();
        std::vector<bool> hosted(E, false);
        for (int s = 0; s < maps[0].slots_per_rank; ++s)
          if (maps[0].expert_at(rank, s) >= 0) hosted[maps[0].expert_at(rank, s)] = true;
        for (int e = 0; e < E; ++e)
          if (hosted[e]) dump.experts.push_back(e);
        const model::LayerWeights w = ep::weights_as_used(layer_weights(spec, 0, hosted), dt);
        dump.weights = &w;
        io::write_layer_dump(spec.dump_dir() + "/rank" + std::to_string(rank) + ".safetensors", dump);
        if (rank == 0) std::ofstream(spec.dump_dir() + "/spec.json") << spec::to_json(spec);
      }
    }
    if (step < spec.steps()) {
      d->set_ok(false);
      d->set_cancelled(true);
      d->set_cancel_requested_here(cancel_.load());
      d->set_message("cancelled at step " + std::to_string(step) + " (" + cancel_reason() + ")");
    } else {
      d->set_ok(true);
      if (spec.verify()) {
        v1::Verify v;
        v.set_passed(true);
        for (int l = 0; l < L; ++l) {
          const v1::Verify lv = verify_layer(spec, l, snaps[l]);
          v.set_max_abs_error(std::max(v.max_abs_error(), lv.max_abs_error()));
          v.set_max_rel_error(std::max(v.max_rel_error(), lv.max_rel_error()));
          v.set_passed(v.passed() && lv.passed());
        }
        *d->mutable_verify() = v;
      }
    }
    comm.barrier(deadline());  // nobody tears down endpoints a peer still uses
  } catch (const transport::TransportError& e) {
    d->set_ok(false);
    d->set_message(e.what());
    d->set_failed_peer(e.peer());
    hub_->abort(rank, e.what(), e.peer());  // siblings waiting on us blame the same rank
  } catch (const std::exception& e) {
    d->set_ok(false);
    d->set_message(e.what());
    hub_->abort(rank, e.what());
  }
  if (!d->ok() && !d->cancelled()) log::warn("job ", job_.job_id(), ": rank ", rank, " failed: ", d->message());
  // Finished before the report: once the agent hears from every rank it may start
  // the next job here, and the daemon must not find this one still running.
  --running_;
  for (int attempt = 1;; ++attempt) {
    try {
      agent.call(done, std::chrono::seconds(10));
      break;
    } catch (const std::exception& e) {
      log::warn("job ", job_.job_id(), ": rank ", rank, " could not report to the agent (attempt ", attempt,
                "): ", e.what());
      if (attempt == 3) break;
    }
  }
}

}  // namespace moe::node
