#include "moe/node/job_runner.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>

#include "moe/ep/ep_layer.h"
#include "moe/ep/reference.h"
#include "moe/io/layer_io.h"
#include "moe/node/job_model.h"
#include "moe/base/check.h"
#include "moe/kernels/cpu_backend.h"
#include "moe/base/log.h"
#include "moe/rpc/rpc.h"
#include "moe/spec/job_spec.h"
#include "moe/transport/ucx_communicator.h"

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

// a <- a + b element-wise in fp32, stored in the job dtype.
void add_into(std::vector<uint8_t>& a, const std::vector<uint8_t>& b, size_t n, DType t) {
  if (t == DType::kF32) {
    auto* x = reinterpret_cast<float*>(a.data());
    const auto* y = reinterpret_cast<const float*>(b.data());
    for (size_t i = 0; i < n; ++i) x[i] += y[i];
  } else {
    auto* x = reinterpret_cast<kernels::bf16_t*>(a.data());
    const auto* y = reinterpret_cast<const kernels::bf16_t*>(b.data());
    for (size_t i = 0; i < n; ++i) x[i] = kernels::f32_to_bf16(kernels::bf16_to_f32(x[i]) + kernels::bf16_to_f32(y[i]));
  }
}

// What one layer saw at step 0, for verify and the dump.
struct Snapshot {
  std::vector<uint8_t> x, out;          // [T, H] dtype
  std::vector<int32_t> topk_idx, kept_idx;
  std::vector<float> topk_weight;
  std::vector<uint8_t> grad_out, grad_x;  // train: the gradient reaching out, and the MoE path's grad_x
};

// Folds |got - want| over a tensor into v: max_abs, and max_rel relative to the
// tensor's scale (max |want|).
template <typename Got>
void compare(v1::Verify& v, const Got& got, const std::vector<double>& want) {
  double max_abs = 0, scale = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = std::fabs(static_cast<double>(got[i]) - want[i]);
    max_abs = std::isnan(d) ? INFINITY : std::max(max_abs, d);
    scale = std::max(scale, std::fabs(want[i]));
  }
  v.set_max_abs_error(std::max(v.max_abs_error(), max_abs));
  v.set_max_rel_error(std::max(v.max_rel_error(), scale > 0 ? max_abs / scale : max_abs));
}

// One rank of one job.
class RankRun {
 public:
  RankRun(const v1::StartJob& job, const RunnerEnv& env, int rank, std::shared_ptr<transport::LocalHub> hub,
          rpc::RpcClient& agent)
      : job_(job),
        spec_(job.spec()),
        env_(env),
        rank_(rank),
        world_(job.world_size()),
        T_(spec_.tokens_per_rank()),
        H_(spec_.hidden()),
        L_(spec_.layers()),
        dt_(job_dtype(spec_)),
        train_(spec_.mode() == v1::JobSpec::train),
        pool_(env.threads_per_rank),
        backend_(kernels::make_cpu_backend(pool_)),
        boot_(agent, job.job_id(), rank),
        comm_(rank, world_, boot_, [&] {
          transport::UcxOptions o;
          o.hub = hub;
          return o;
        }()),
        agent_(agent) {
    MOE_CHECK(job_.maps_size() == L_, "start: ", job_.maps_size(), " placement maps for ", L_, " layers");
    const ep::MoeLayerConfig cfg = layer_config(spec_);
    ep::MoeLayerConfig teacher_cfg = cfg;
    teacher_cfg.train = false;
    v1::JobSpec teacher_spec = spec_;  // "the same architecture built from seed+1"
    teacher_spec.set_seed(spec_.seed() + 1);
    teacher_spec.clear_weights();
    for (int l = 0; l < L_; ++l) {
      maps_.push_back(expert_map(job_.maps(l)));
      ep::EpOptions eo;
      eo.timeout = env_.transport_timeout;
      eo.tag_base = static_cast<uint32_t>(l) << 24;
      const std::vector<bool> needed = maps_.back().hosted(rank_);
      layers_.push_back(std::make_unique<ep::EpLayer>(cfg, maps_.back(), comm_, *backend_, eo));
      layers_.back()->set_weights(layer_weights(spec_, l, needed));
      if (train_) {
        teacher_.push_back(std::make_unique<ep::EpLayer>(teacher_cfg, maps_.back(), comm_, *backend_, eo));
        teacher_.back()->set_weights(layer_weights(teacher_spec, l, needed));
      }
    }
    const size_t bytes = T_ * H_ * kernels::dtype_size(dt_) + 1;
    xs_.assign(L_ + 1, std::vector<uint8_t>(bytes));
    out_.resize(bytes);
    grad_.resize(bytes);
    grad_x_.resize(bytes);
    snaps_.resize(L_);
    opt_.kind = spec_.optimizer() == v1::JobSpec::sgd ? kernels::OptimizerKind::kSgd : kernels::OptimizerKind::kAdam;
    opt_.lr = static_cast<float>(spec_.has_lr() ? spec_.lr() : 1e-3);
    verify_.set_passed(true);
    log::info("job ", job_.job_id(), ": rank ", rank_, " of ", world_, " ready (", L_, " layers, ", T_, " tokens, ",
              train_ ? "train" : "forward", ")");
  }

  // Runs the steps while should_stop() (agreed by all ranks) is false; returns the
  // number of steps completed.
  int run(const std::function<bool()>& cancel_requested) {
    int step = 0;
    for (; step < spec_.steps(); ++step) {
      float stop = cancel_requested() ? 1.0f : 0.0f;
      comm_.all_reduce_sum(&stop, 1, deadline());
      if (stop > 0) break;
      v1::Envelope report;
      auto* r = report.mutable_step_report();
      r->set_job_id(job_.job_id());
      r->set_rank(rank_);
      v1::StepStats* st = r->mutable_stats();
      st->set_step(step);
      const double t0 = now_seconds();
      forward(step, st);
      if (train_) {
        train(step, st);
        optimize(step, st);
      }
      st->set_step_seconds(now_seconds() - t0);
      if (env_.metrics) env_.metrics->record_step(rank_, st->step_seconds());
      agent_.call(report, std::chrono::seconds(10));
      // Step 0's snapshots, gradients (the optimizer leaves them) and initial
      // weights (rebuilt from the spec) are what verify and the dump need.
      if (step == 0) {
        if (spec_.verify()) verify_step0();
        if (!spec_.dump_dir().empty()) dump_step0();
      }
    }
    comm_.barrier(deadline());  // nobody tears down endpoints a peer still uses
    return step;
  }

  const v1::Verify& verification() const { return verify_; }

 private:
  transport::Deadline deadline() const { return transport::deadline_in(env_.transport_timeout); }
  int64_t token_begin() const { return static_cast<int64_t>(rank_) * T_; }

  // x_{l+1} = x_l + moe_l(x_l); xs_[l] keeps every layer's input for backward.
  void forward(int step, v1::StepStats* st) {
    const int K = spec_.top_k(), E = spec_.experts();
    xs_[0] = model::to_storage(step_inputs(spec_, rank_, step), dt_);
    for (int l = 0; l < L_; ++l) {
      ep::EpLayer& layer = *layers_[l];
      layer.forward(xs_[l].data(), T_, token_begin(), out_.data());
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
      for (int64_t p = 0; p < T_ * K; ++p)
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
        env_.metrics->record(rank_, ms);
      }
      if (step == 0) {
        Snapshot& s = snaps_[l];
        s.x = xs_[l];
        s.out = out_;
        s.topk_idx.assign(layer.topk_idx(), layer.topk_idx() + T_ * K);
        s.kept_idx.assign(layer.kept_idx(), layer.kept_idx() + T_ * K);
        s.topk_weight.assign(layer.topk_weight(), layer.topk_weight() + T_ * K);
      }
      xs_[l + 1] = xs_[l];
      add_into(xs_[l + 1], out_, T_ * H_, dt_);
    }
  }

  // The teacher's targets, the loss L = sum ||y - y_teacher||^2 / (T_global H) (this
  // rank's share), and the backward through the residual stack:
  // dL/dx_l = g + moe_l^T(g) with g = dL/dx_{l+1}.
  void train(int step, v1::StepStats* st) {
    const size_t n = T_ * H_;
    std::vector<uint8_t> xt = xs_[0];
    for (int l = 0; l < L_; ++l) {
      teacher_[l]->forward(xt.data(), T_, token_begin(), out_.data());
      add_into(xt, out_, n, dt_);
    }
    const std::vector<float> y = model::from_storage(xs_[L_].data(), n, dt_);
    const std::vector<float> yt = model::from_storage(xt.data(), n, dt_);
    const double norm = static_cast<double>(T_) * world_ * H_;
    double loss = 0;
    std::vector<float> g(n);
    for (size_t i = 0; i < n; ++i) {
      const double d = static_cast<double>(y[i]) - yt[i];
      loss += d * d;
      g[i] = static_cast<float>(2.0 * d / norm);
    }
    st->set_loss(loss / norm);
    const double t0 = now_seconds();
    grad_ = model::to_storage(g, dt_);
    for (int l = L_ - 1; l >= 0; --l) {
      layers_[l]->backward(grad_.data(), grad_x_.data());
      if (env_.metrics) {
        const ep::EpStats& es = layers_[l]->stats();
        env_.metrics->record_backward(rank_, {es.backward_dispatch, es.backward_combine, es.backward_dispatch_bytes,
                                              es.backward_combine_bytes});
      }
      if (step == 0) {
        snaps_[l].grad_out = grad_;
        snaps_[l].grad_x = grad_x_;
      }
      add_into(grad_, grad_x_, n, dt_);
    }
    st->mutable_phase_seconds()->set_backward(now_seconds() - t0);
  }

  void optimize(int step, v1::StepStats* st) {
    const double t0 = now_seconds();
    for (auto& layer : layers_) layer->optimizer_step(opt_, step + 1);
    st->mutable_phase_seconds()->set_optimizer(now_seconds() - t0);
  }

  // Step 0 recomputed with the fp64 reference, layer by layer, with the weights
  // step 0 used: each layer's output on this rank's tokens (capacity is per source
  // rank, so nobody else's tokens are needed) and, in train mode, its gradients:
  // grad_x on our tokens directly; the router and expert weight gradients, which
  // sum over every rank's tokens, by all-reducing each rank's reference share.
  void verify_step0() {
    const int K = spec_.top_k(), E = spec_.experts(), I = spec_.ffn_hidden();
    const ref::Config rc = ep::reference_config(layer_config(spec_));
    // fp32: accumulation-order noise. bf16: out, grad_x and each rank's partial
    // combine row are rounded once each (2^-9).
    const double tol = dt_ == DType::kF32 ? 1e-4 : 1.0 / 64;
    bool ok = true;
    for (int l = 0; l < L_; ++l) {
      const Snapshot& s = snaps_[l];
      const model::LayerWeights w =
          ep::weights_as_used(layer_weights(spec_, l, std::vector<bool>(E, true)), dt_);
      const ref::Weights rw = ep::reference_weights(w);
      const std::vector<float> xf = model::from_storage(s.x.data(), T_ * H_, dt_);
      const std::vector<double> x(xf.begin(), xf.end());
      // The reference's own selection must agree except at near-ties fp32 cannot
      // break; the numbers are then compared on our selection.
      const ref::Forward own = ref::forward(rc, rw, x, T_);
      for (int64_t t = 0; t < T_; ++t) {
        if (own.selection_margin[t] <= 1e-5) continue;
        for (int k = 0; k < K; ++k) ok &= own.topk_idx[t * K + k] == s.topk_idx[t * K + k];
      }
      const ref::Forward f = ref::forward(rc, rw, x, T_, {s.topk_idx.data(), {}});
      ok &= f.kept_idx == s.kept_idx;
      v1::Verify lv;  // out and grad_x, held to tol
      compare(lv, model::from_storage(s.out.data(), T_ * H_, dt_), f.out);
      if (train_) {
        const std::vector<float> go = model::from_storage(s.grad_out.data(), T_ * H_, dt_);
        const ref::Grads g = ref::backward(rc, rw, x, f, std::vector<double>(go.begin(), go.end()));
        compare(lv, model::from_storage(s.grad_x.data(), T_ * H_, dt_), g.grad_x);
        ok &= lv.max_rel_error() <= tol;
        std::vector<float> gate(g.grad_gate.begin(), g.grad_gate.end());
        std::vector<float> w13(g.grad_w13.begin(), g.grad_w13.end()), w2(g.grad_w2.begin(), g.grad_w2.end());
        comm_.all_reduce_sum(gate.data(), gate.size(), deadline());
        comm_.all_reduce_sum(w13.data(), w13.size(), deadline());
        comm_.all_reduce_sum(w2.data(), w2.size(), deadline());
        v1::Verify gv;  // weight gradients are fp32 whatever the storage dtype
        compare(gv, layers_[l]->grad_gate(), std::vector<double>(gate.begin(), gate.end()));
        const size_t n13 = 2 * static_cast<size_t>(I) * H_, n2 = static_cast<size_t>(H_) * I;
        for (int s2 = 0; s2 < maps_[l].slots_per_rank; ++s2) {
          const int e = maps_[l].expert_at(rank_, s2);
          if (e < 0) continue;
          compare(gv, layers_[l]->grad_w13(s2), std::vector<double>(w13.begin() + e * n13, w13.begin() + (e + 1) * n13));
          compare(gv, layers_[l]->grad_w2(s2), std::vector<double>(w2.begin() + e * n2, w2.begin() + (e + 1) * n2));
        }
        // Weight gradients are fp32 sums over every rank's tokens, whatever the
        // storage dtype (their inputs are exact bf16 values in a bf16 job).
        ok &= gv.max_rel_error() <= 1e-3;
        lv.set_max_abs_error(std::max(lv.max_abs_error(), gv.max_abs_error()));
        lv.set_max_rel_error(std::max(lv.max_rel_error(), gv.max_rel_error()));
      } else {
        ok &= lv.max_rel_error() <= tol;
      }
      verify_.set_max_abs_error(std::max(verify_.max_abs_error(), lv.max_abs_error()));
      verify_.set_max_rel_error(std::max(verify_.max_rel_error(), lv.max_rel_error()));
    }
    verify_.set_passed(ok && std::isfinite(verify_.max_abs_error()));
  }

  // rank{r}.safetensors for layer 0 at step 0 (DESIGN 6); rank 0 adds spec.json.
  void dump_step0() {
    std::filesystem::create_directories(spec_.dump_dir());
    const Snapshot& s = snaps_[0];
    io::LayerDump d;
    d.dtype = dt_;
    d.shape = layer_shape(spec_);
    d.top_k = spec_.top_k();
    d.num_tokens = T_;
    d.x = s.x.data();
    d.out = s.out.data();
    d.topk_idx = s.kept_idx.data();
    d.topk_weight = s.topk_weight.data();
    const std::vector<bool> mine = maps_[0].hosted(rank_);
    for (int e = 0; e < spec_.experts(); ++e)
      if (mine[e]) d.experts.push_back(e);
    const model::LayerWeights w = ep::weights_as_used(layer_weights(spec_, 0, mine), dt_);
    d.weights = &w;
    // Expert gradients indexed by logical expert, from this rank's slots.
    std::vector<float> g13, g2;
    if (train_) {
      const size_t I = spec_.ffn_hidden(), n13 = 2 * I * H_, n2 = H_ * I;
      g13.assign(spec_.experts() * n13, 0.0f);
      g2.assign(spec_.experts() * n2, 0.0f);
      for (int slot = 0; slot < maps_[0].slots_per_rank; ++slot) {
        const int e = maps_[0].expert_at(rank_, slot);
        if (e < 0) continue;
        std::copy_n(layers_[0]->grad_w13(slot), n13, g13.begin() + e * n13);
        std::copy_n(layers_[0]->grad_w2(slot), n2, g2.begin() + e * n2);
      }
      d.grad_out = s.grad_out.data();
      d.grad_x = s.grad_x.data();
      d.grad_gate = layers_[0]->grad_gate();
      d.grad_w13 = g13.data();
      d.grad_w2 = g2.data();
    }
    io::write_layer_dump(spec_.dump_dir() + "/rank" + std::to_string(rank_) + ".safetensors", d);
    if (rank_ == 0) std::ofstream(spec_.dump_dir() + "/spec.json") << spec::to_json(spec_);
  }

  const v1::StartJob& job_;
  const v1::JobSpec& spec_;
  const RunnerEnv& env_;
  const int rank_, world_;
  const int64_t T_;
  const int H_, L_;
  const DType dt_;
  const bool train_;
  kernels::ThreadPool pool_;
  std::unique_ptr<kernels::Backend> backend_;
  AgentBootstrap boot_;
  transport::UcxCommunicator comm_;
  rpc::RpcClient& agent_;
  std::vector<ep::ExpertMap> maps_;
  std::vector<std::unique_ptr<ep::EpLayer>> layers_, teacher_;
  std::vector<std::vector<uint8_t>> xs_;  // xs_[l]: input of layer l; xs_[L]: the stack's output
  std::vector<uint8_t> out_, grad_, grad_x_;
  std::vector<Snapshot> snaps_;
  kernels::OptimizerConfig opt_;
  v1::Verify verify_;
};

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
  const int rank = env_.node_index * env_.devices + local;
  rpc::RpcClient agent(rpc::ClientOptions::make(env_.agent_address, env_.token, "moed",
                                                env_.node_name + "/rank" + std::to_string(rank)));
  v1::Envelope done;
  auto* d = done.mutable_rank_done();
  d->set_job_id(job_.job_id());
  d->set_rank(rank);
  try {
    RankRun run(job_, env_, rank, hub_, agent);
    const int steps = run.run([this] { return cancel_.load(); });
    if (steps < job_.spec().steps()) {
      d->set_ok(false);
      d->set_cancelled(true);
      d->set_cancel_requested_here(cancel_.load());
      d->set_message("cancelled at step " + std::to_string(steps) + " (" + cancel_reason() + ")");
    } else {
      d->set_ok(true);
      if (job_.spec().verify()) *d->mutable_verify() = run.verification();
    }
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
