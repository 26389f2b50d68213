#include <algorithm>
#include <filesystem>
#include <fstream>
#include <numeric>

#include "benches.h"
#include "moe/ep/moe_layer.h"
#include "moe/io/layer_io.h"
#include "moe/layer_spec/job_layers.h"
#include "moe/model/synthetic.h"
#include "moe/base/check.h"
#include "moe/base/clock.h"
#include "moe/kernels/cpu_backend.h"
#include "moe/v1/job.pb.h"
#include "moe/spec/job_spec.h"

namespace moe::bench {
namespace {

using kernels::DType;

// A kernels enum as the spec's: the proto values are spelled as the kernels'
// names (score_name, dtype_name, ...), whose switches cover every value.
template <typename ProtoEnum>
ProtoEnum proto_enum(bool (*parse)(const std::string&, ProtoEnum*), const char* name) {
  ProtoEnum v{};
  MOE_CHECK(parse(name, &v), "the job spec has no value '", name, "'");
  return v;
}

v1::JobSpec spec_of(const LayerBenchOptions& o) {
  v1::JobSpec s;
  s.set_experts(o.experts);
  s.set_top_k(o.top_k);
  s.set_hidden(o.hidden);
  s.set_ffn_hidden(o.ffn);
  s.set_layers(1);
  s.set_score(proto_enum(v1::JobSpec::Score_Parse, kernels::score_name(o.score)));
  s.set_num_groups(o.num_groups);
  s.set_group_top_k(o.group_top_k);
  s.set_norm_topk_prob(true);
  s.set_routed_scaling_factor(1.0);
  s.set_dtype(proto_enum(v1::JobSpec::DType_Parse, kernels::dtype_name(o.dtype)));
  s.set_capacity_factor(o.capacity_factor);
  s.set_drop_policy(proto_enum(v1::JobSpec::DropPolicy_Parse, kernels::drop_policy_name(o.drop_policy)));
  s.set_tokens_per_rank(o.tokens);
  s.set_steps(1);
  s.set_mode(o.train ? v1::JobSpec::train : v1::JobSpec::forward);
  s.set_moments_dtype(proto_enum(v1::JobSpec::DType_Parse, kernels::dtype_name(o.moments)));
  s.set_skew(o.skew);
  s.set_seed(o.seed);
  s.set_dump_dir(o.dump_dir);
  return s;
}

// The weight bytes a forward step reads: every expert with a kept pair, its w13
// and w2 in the compute dtype (what the expert GEMMs stream).
int64_t weight_bytes_read(const int32_t* kept_idx, int64_t pairs, const LayerBenchOptions& o) {
  std::vector<bool> touched(o.experts, false);
  for (int64_t p = 0; p < pairs; ++p)
    if (kept_idx[p] >= 0) touched[kept_idx[p]] = true;
  const int64_t experts = std::count(touched.begin(), touched.end(), true);
  return experts * 3 * static_cast<int64_t>(o.hidden) * o.ffn * static_cast<int64_t>(kernels::dtype_size(o.dtype));
}

// A STREAM-like read: the best of `repeats` passes summing `bytes` of memory split
// over the pool's threads (the sum is kept so the reads cannot be dropped), GB/s.
double read_gbps(kernels::ThreadPool& pool, int64_t bytes, int repeats) {
  const int64_t n = std::max<int64_t>(bytes / 8, 1);
  std::vector<double> data(n, 1.0);
  const int64_t tasks = pool.num_threads();
  std::vector<double> sums(tasks);
  double best = 0;
  for (int r = 0; r < repeats; ++r) {
    const double t0 = now_seconds();
    pool.parallel_for(tasks, [&](int64_t t, int) {
      const int64_t b = n * t / tasks, e = n * (t + 1) / tasks;
      double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
      int64_t i = b;
      for (; i + 4 <= e; i += 4) {
        s0 += data[i];
        s1 += data[i + 1];
        s2 += data[i + 2];
        s3 += data[i + 3];
      }
      for (; i < e; ++i) s0 += data[i];
      sums[t] = s0 + s1 + s2 + s3;
    });
    best = std::max(best, 8.0 * n / (now_seconds() - t0) / 1e9);
  }
  MOE_CHECK(std::accumulate(sums.begin(), sums.end(), 0.0) == static_cast<double>(n), "read bandwidth: bad sum");
  return best;
}

void write_spec_json(const std::string& path, const v1::JobSpec& spec) {
  std::ofstream out(path);
  out << spec::to_json(spec);
  MOE_CHECK(out.good(), path, ": write failed");
}

}  // namespace

void add_cpu_kernels(Report& r, kernels::DType dtype) {
  const kernels::CpuBackendInfo info = kernels::cpu_backend_info();
  r.add("cpu", info.cpu_model);
  r.add("cpu_isa", info.cpu_isa);  // the backend's own kernels (MOE_CPU_ISA caps it)
  r.add("row_gemm_kernel", info.row_gemm);
  r.add("gemm_engine", info.gemm_engine(dtype));  // the weight gradients'
  r.add("openblas_core", info.openblas_core);
  r.add("onednn_isa", info.isa);
}

Report run_layer_bench(const LayerBenchOptions& o) {
  MOE_CHECK(o.threads >= 1, "--threads must be >= 1, got ", o.threads);
  MOE_CHECK(o.iters >= 1, "--iters must be >= 1, got ", o.iters);
  MOE_CHECK(o.tokens >= 0, "--tokens must be >= 0, got ", o.tokens);
  kernels::ThreadPool pool(o.threads);
  auto be = kernels::make_cpu_backend(pool);

  // The layer a one-rank job of these flags runs, built as the daemon builds it.
  const v1::JobSpec job = spec_of(o);
  // Released before the same-run peak and bandwidth measurements, so they add
  // nothing to the layer's peak RSS.
  auto layer_ptr = std::make_unique<ep::MoeLayer>(layer_spec::layer_config(job), *be);
  ep::MoeLayer& layer = *layer_ptr;
  const model::LayerShape shape = layer_spec::layer_shape(job);
  // A temporary: the bench keeps no copy of the weights beside the layer's (its peak RSS is the layer's).
  layer.set_weights(layer_spec::layer_weights(job, 0, std::vector<bool>(o.experts, true)));

  const int64_t T = o.tokens, H = o.hidden;
  std::vector<float> x32(T * H), g32(T * H);
  model::fill_inputs(o.seed, 0, 0, T, o.hidden, x32.data());
  model::fill_inputs(o.seed ^ 0x67726164ull, 0, 0, T, o.hidden, g32.data());  // grad_out ("grad")
  const std::vector<uint8_t> x = model::to_storage(x32, o.dtype), grad_out = model::to_storage(g32, o.dtype);
  std::vector<uint8_t> out(x.size()), grad_x(x.size());

  MOE_CHECK(o.optimizer == "none" || o.train, "--optimizer ", o.optimizer, " needs --mode train");
  kernels::OptimizerConfig opt;
  opt.kind = o.optimizer == "sgd" ? kernels::OptimizerKind::kSgd : kernels::OptimizerKind::kAdam;
  opt.moments = o.moments;
  MOE_CHECK(o.moments == kernels::DType::kF32 || o.optimizer == "adam", "--moments bf16 needs --optimizer adam");
  int64_t updates = 0;
  auto step = [&] {
    layer.forward(x.data(), T, out.data());
    if (o.train) layer.backward(grad_out.data(), grad_x.data());
    if (o.optimizer != "none") layer.optimizer_step(opt, ++updates);
  };

  // Step 0, dumped when asked.
  step();
  if (!o.dump_dir.empty()) {
    std::filesystem::create_directories(o.dump_dir);
    io::LayerDump d;
    d.dtype = o.dtype;
    d.shape = shape;
    d.top_k = o.top_k;
    d.num_tokens = T;
    d.x = x.data();
    d.out = out.data();
    d.topk_idx = layer.kept_idx();
    d.topk_weight = layer.topk_weight();
    const model::LayerWeights used = layer.weights();
    d.weights = &used;
    for (int e = 0; e < o.experts; ++e) d.experts.push_back(e);
    if (o.train) {
      d.grad_out = grad_out.data();
      d.grad_x = grad_x.data();
      d.grad_gate = layer.grad_gate();
      d.grad_w13 = layer.grad_w13();
      d.grad_w2 = layer.grad_w2();
    }
    io::write_layer_dump(o.dump_dir + "/rank0.safetensors", d);
    write_spec_json(o.dump_dir + "/spec.json", spec_of(o));
  }
  for (int i = 1; i < o.warmup; ++i) step();

  struct Sample {
    double seconds;
    ep::PhaseTimes phases;
  };
  std::vector<Sample> samples;
  for (int i = 0; i < o.iters; ++i) {
    const double t0 = now_seconds();
    step();
    samples.push_back({now_seconds() - t0, layer.times()});
  }
  std::sort(samples.begin(), samples.end(), [](const Sample& a, const Sample& b) { return a.seconds < b.seconds; });
  const Sample& median = samples[samples.size() / 2];
  const int64_t weight_bytes = weight_bytes_read(layer.kept_idx(), T * o.top_k, o);
  layer_ptr.reset();

  // The peak is the GEMM the layer ran on: its engine, in its dtype (a bf16 oneDNN
  // matmul for bf16 on oneDNN), same threads, same process; the OpenBLAS sgemm peak
  // beside it for comparison with fp32 figures.
  const kernels::CpuBackendInfo info = kernels::cpu_backend_info();
  const kernels::GemmEngine engine = info.engines.of(o.dtype);
  const double peak = kernels::measure_gemm_gflops(engine, o.dtype, o.threads, o.peak_n, 3);
  const double sgemm_peak = engine == kernels::GemmEngine::kOpenBlas
                                ? peak
                                : kernels::measure_sgemm_gflops(o.threads, o.peak_n, 3);
  const double fwd_flops = 2.0 * T * o.experts * H + 6.0 * T * o.top_k * H * static_cast<double>(o.ffn);
  const double flops = o.train ? 3 * fwd_flops : fwd_flops;
  const double gflops = flops / median.seconds / 1e9;
  // The small-batch floor: the step's weight bytes over the same-run read bandwidth.
  const double read_bw = read_gbps(pool, std::max<int64_t>(weight_bytes, 1 << 20), 5);
  const double weight_gbps = weight_bytes / median.seconds / 1e9;

  Report r;
  r.add("bench", "layer");
  r.add("backend", be->name());
  add_cpu_kernels(r, o.dtype);
  r.add("mode", o.train ? "train" : "forward");
  r.add("dtype", kernels::dtype_name(o.dtype));
  r.add("threads", static_cast<int64_t>(o.threads));
  r.add("tokens", T).add("hidden", static_cast<int64_t>(H)).add("ffn", static_cast<int64_t>(o.ffn));
  r.add("experts", static_cast<int64_t>(o.experts)).add("top_k", static_cast<int64_t>(o.top_k));
  r.add("iters", static_cast<int64_t>(o.iters));
  r.add("step_seconds_p50", median.seconds);
  r.add("step_seconds_min", samples.front().seconds);
  r.add("tokens_per_second", T / median.seconds);
  r.add("gflops", gflops);
  r.add("gemm_peak_gflops", peak);
  r.add("fraction_of_gemm_peak", gflops / peak);
  r.add("fp32_sgemm_peak_gflops", sgemm_peak);
  r.add("weight_bytes_read", weight_bytes);
  r.add("read_bandwidth_gbps", read_bw);
  r.add("fraction_of_read_bandwidth", weight_gbps / read_bw);
  Report& ph = r.section("phase_seconds");
  ph.add("router", median.phases.router);
  ph.add("permute", median.phases.permute);
  ph.add("expert_gemm", median.phases.expert_gemm);
  ph.add("swiglu", median.phases.swiglu);
  ph.add("combine", median.phases.combine);
  ph.add("backward", median.phases.backward);
  if (o.optimizer != "none") {
    ph.add("optimizer", median.phases.optimizer);
    r.add("optimizer", o.optimizer);
    if (o.optimizer == "adam") r.add("moments", kernels::dtype_name(o.moments));
    r.add("optimizer_share", median.phases.optimizer / median.seconds);
  }
  if (!o.dump_dir.empty()) r.add("dump_dir", o.dump_dir);
  return r;
}

}  // namespace moe::bench
