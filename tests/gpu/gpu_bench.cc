// GPU benchmarks (gpu_bench.h). Times are medians of `iters` timed repetitions
// after `warmup` untimed ones; kernels are timed with CUDA events on the stream
// they run on, whole layer steps with the host clock around a synchronised step.
#include "gpu_bench.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <sstream>
#include <thread>

#include "moe/base/check.h"
#include "moe/base/clock.h"
#include "moe/ep/moe_layer.h"
#include "moe/kernels/buffer.h"
#include "moe/kernels/cuda_device.h"
#include "moe/model/counter_rng.h"
#include "report.h"

namespace moe::gpucheck {
namespace {

using kernels::Backend;
using kernels::Buffer;
using bench::median;
using kernels::DType;

void cuda_ok(cudaError_t e, const char* what) {
  MOE_CHECK(e == cudaSuccess, what, ": ", cudaGetErrorString(e));
}

// Median seconds of f(), the device idle before and after each timed call.
double time_synced(const BenchShape& s, const std::function<void()>& f) {
  for (int i = 0; i < s.warmup; ++i) f();
  cuda_ok(cudaDeviceSynchronize(), "bench");
  std::vector<double> t;
  for (int i = 0; i < s.iters; ++i) {
    const double t0 = now_seconds();
    f();
    cuda_ok(cudaDeviceSynchronize(), "bench");
    t.push_back(now_seconds() - t0);
  }
  return median(t);
}

// Uniform values in [-a, a) keyed by (seed, i), filled by every hardware thread:
// the bench's weights are ~1.2e9 values, too many for one thread's normal draws.
void fill_uniform(std::vector<float>& v, uint64_t seed, float a) {
  const size_t n = v.size();
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      for (size_t i = n * t / threads; i < n * (t + 1) / threads; ++i)
        v[i] = a * (2.0f * static_cast<float>(model::key_hash({seed, i}) >> 40) / 16777216.0f - 1.0f);
    });
  for (std::thread& th : pool) th.join();
}

model::LayerWeights bench_weights(const BenchShape& s) {
  const size_t H = s.hidden, I = s.ffn_hidden, E = s.experts;
  model::LayerWeights w;
  w.gate.resize(E * H);
  w.w13.resize(E * 2 * I * H);
  w.w2.resize(E * H * I);
  // Uniform with the variance of N(0, 1/fan_in): a = sqrt(3 / fan_in).
  fill_uniform(w.gate, 1, std::sqrt(3.0f / H));
  fill_uniform(w.w13, 2, std::sqrt(3.0f / H));
  fill_uniform(w.w2, 3, std::sqrt(3.0f / I));
  return w;
}

std::string json_of(const bench::Report& r) {
  std::ostringstream os;
  r.print_json(os);
  std::string s = os.str();
  s.erase(std::remove(s.begin(), s.end(), '\n'), s.end());
  return s;
}

bench::Report header(const char* name, const BenchShape& s) {
  bench::Report r;
  r.add("bench", name).add("device", kernels::cuda_devices().at(0).name).add("dtype", "bf16");
  r.add("tokens", s.tokens).add("hidden", int64_t{s.hidden}).add("ffn", int64_t{s.ffn_hidden});
  r.add("experts", int64_t{s.experts}).add("top_k", int64_t{s.top_k}).add("iters", int64_t{s.iters});
  return r;
}

// The layer forward (a forward-only layer) and train step (forward + backward).
std::vector<std::string> bench_layer(const BenchShape& s, const model::LayerWeights& w) {
  std::vector<std::string> out;
  auto be = kernels::make_cuda_backend(0);
  std::vector<float> x32(static_cast<size_t>(s.tokens) * s.hidden);
  fill_uniform(x32, 4, 1.7f);
  const std::vector<uint8_t> x_host = model::to_storage(x32, DType::kBF16);
  Buffer x(*be, x_host.size()), out_buf(*be, x_host.size()), grad(*be, x_host.size());
  be->copy_to_device(x.get(), x_host.data(), x_host.size());
  be->copy_to_device(grad.get(), x_host.data(), x_host.size());
  for (bool train : {false, true}) {
    ep::MoeLayer layer(ep::layer_config({.experts = s.experts,
                                         .top_k = s.top_k,
                                         .hidden = s.hidden,
                                         .ffn_hidden = s.ffn_hidden,
                                         .dtype = DType::kBF16,
                                         .tokens_per_rank = s.tokens,
                                         .train = train}),
                       *be);
    layer.set_weights(w);
    const double sec = time_synced(s, [&] {
      layer.forward(x.get(), s.tokens, out_buf.get());
      if (train) layer.backward(grad.get(), out_buf.get());
    });
    bench::Report r = header("gpu_layer", s);
    r.add("mode", train ? "train" : "forward").add("gemm_engine", be->gemm_engine(DType::kBF16));
    r.add("step_seconds_p50", sec).add("tokens_per_second", static_cast<double>(s.tokens) / sec);
    const ep::PhaseTimes& p = layer.times();  // of the last step
    r.section("last_step_phase_seconds")
        .add("router", p.router)
        .add("permute", p.permute)
        .add("expert_gemm", p.expert_gemm)
        .add("swiglu", p.swiglu)
        .add("combine", p.combine)
        .add("backward", p.backward);
    out.push_back(json_of(r));
  }
  return out;
}

// Median event-timed seconds of f() on `stream`.
double time_events(const BenchShape& s, cudaStream_t stream, const std::function<void()>& f) {
  cudaEvent_t a, b;
  cuda_ok(cudaEventCreate(&a), "event");
  cuda_ok(cudaEventCreate(&b), "event");
  for (int i = 0; i < s.warmup; ++i) f();
  std::vector<double> t;
  for (int i = 0; i < s.iters; ++i) {
    cuda_ok(cudaEventRecord(a, stream), "event");
    f();
    cuda_ok(cudaEventRecord(b, stream), "event");
    cuda_ok(cudaEventSynchronize(b), "event");
    float ms = 0;
    cuda_ok(cudaEventElapsedTime(&ms, a, b), "event");
    t.push_back(ms * 1e-3);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return median(t);
}

// A balanced random layout of T rows onto E experts (K distinct each).
struct BenchLayout {
  std::vector<int64_t> offset;  // host [E + 1]
  Buffer src_row, pair_pos, weight;
  int64_t M = 0;
};

BenchLayout make_layout(Backend& be, const BenchShape& s) {
  const int64_t T = s.tokens;
  const int K = s.top_k, E = s.experts;
  std::vector<int32_t> row_expert(T * K);
  for (int64_t t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) row_expert[t * K + k] = static_cast<int32_t>((t * 7 + k * (E / K) + (t % 3)) % E);
  std::vector<float> w(T * K, 1.0f / K);
  Buffer re(be, 4 * T * K), rw(be, 4 * T * K);
  be.copy_to_device(re.get(), row_expert.data(), 4 * T * K);
  be.copy_to_device(rw.get(), w.data(), 4 * T * K);
  BenchLayout l;
  l.offset.assign(E + 1, 0);
  l.src_row = Buffer(be, 4 * T * K);
  l.pair_pos = Buffer(be, 4 * T * K);
  l.weight = Buffer(be, 4 * T * K);
  Buffer ws(be, be.permute_layout_workspace_bytes({T, K, E}));
  be.permute_layout({T, K, E}, {re.as<int32_t>(), rw.as<float>(), l.offset.data(), l.src_row.as<int32_t>(),
                                l.weight.as<float>(), l.pair_pos.as<int32_t>(), ws.get()});
  l.M = l.offset[E];
  return l;
}

std::vector<std::string> bench_permute(const BenchShape& s) {
  auto be = kernels::make_cuda_backend(0);
  const int64_t T = s.tokens, H = s.hidden;
  BenchLayout l = make_layout(*be, s);
  const int64_t M = l.M;
  Buffer rows(*be, 2 * T * H), perm(*be, 2 * M * H), y(*be, 4 * M * H), combined(*be, 2 * T * H), copy(*be, 2 * M * H);
  be->fill_zero(rows.get(), rows.bytes());
  be->fill_zero(y.get(), y.bytes());
  be->synchronize();  // the buffers come from the backend's stream-ordered pool; the copy runs on another stream
  cudaStream_t stream;
  cuda_ok(cudaStreamCreate(&stream), "stream");
  const double t_copy = time_events(s, stream, [&] {
    cuda_ok(cudaMemcpyAsync(copy.get(), perm.get(), 2 * M * H, cudaMemcpyDeviceToDevice, stream), "copy");
  });
  cudaStreamDestroy(stream);
  const double t_perm = time_synced(s, [&] {
    be->permute({T, s.top_k, M, s.hidden, DType::kBF16, DType::kBF16},
                {rows.get(), l.src_row.as<int32_t>(), l.pair_pos.as<int32_t>(), perm.get()});
  });
  const double t_unperm = time_synced(s, [&] {
    be->unpermute({T, s.top_k, s.hidden, DType::kBF16, false, DType::kF32},
                  {y.get(), l.pair_pos.as<int32_t>(), nullptr, combined.get()});
  });
  const double copy_gbps = 2.0 * 2 * M * H / t_copy / 1e9;  // read + write
  const double perm_gbps = (2.0 * M * H + 2.0 * M * H) / t_perm / 1e9;
  const double unperm_gbps = (4.0 * M * H + 2.0 * T * H) / t_unperm / 1e9;
  bench::Report r = header("gpu_permute", s);
  r.add("rows_permuted", M).add("d2d_copy_gbps", copy_gbps);
  r.add("permute_bf16_gbps", perm_gbps).add("permute_vs_copy", perm_gbps / copy_gbps);
  r.add("unpermute_fp32_to_bf16_gbps", unperm_gbps).add("unpermute_vs_copy", unperm_gbps / copy_gbps);
  r.add("note", "bytes moved = read + write; the copy moves the permuted tensor's bytes once each way");
  return {json_of(r)};
}

// One dense bf16 GEMM [M, H] x [H, 3I] -> fp32: the same FLOPs as the expert
// MLP's two GEMMs (2 M H 2I + 2 M I H).
double dense_gemm_seconds(const BenchShape& s, int64_t M) {
  const int64_t H = s.hidden, N = 3 * int64_t{s.ffn_hidden};
  void *a, *b, *c;
  cuda_ok(cudaMalloc(&a, 2 * M * H), "dense gemm");
  cuda_ok(cudaMalloc(&b, 2 * H * N), "dense gemm");
  cuda_ok(cudaMalloc(&c, 4 * M * N), "dense gemm");
  cuda_ok(cudaMemset(a, 0, 2 * M * H), "dense gemm");
  cuda_ok(cudaMemset(b, 0, 2 * H * N), "dense gemm");
  cublasHandle_t h;
  MOE_CHECK(cublasCreate(&h) == CUBLAS_STATUS_SUCCESS, "cublasCreate");
  const float one = 1.0f, zero = 0.0f;
  const double sec = time_events(s, nullptr, [&] {
    MOE_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(N), static_cast<int>(M), static_cast<int>(H),
                           &one, b, CUDA_R_16BF, static_cast<int>(H), a, CUDA_R_16BF, static_cast<int>(H), &zero, c,
                           CUDA_R_32F, static_cast<int>(N), CUBLAS_COMPUTE_32F,
                           CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS,
              "dense cublasGemmEx");
  });
  cublasDestroy(h);
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  return sec;
}

// The expert MLP's GEMM seconds (its own phase clock) under one GEMM mode and dtype.
double expert_gemm_seconds(const BenchShape& s, const model::LayerWeights& w, const char* mode, DType dtype,
                           int64_t* rows) {
  ::setenv("MOE_CUDA_GEMM", mode, 1);
  auto be = kernels::make_cuda_backend(0);
  ::unsetenv("MOE_CUDA_GEMM");
  const int64_t T = s.tokens, H = s.hidden;
  BenchLayout l = make_layout(*be, s);
  kernels::ExpertMlpConfig c;
  c.num_experts = s.experts;
  c.hidden = s.hidden;
  c.ffn_hidden = s.ffn_hidden;
  c.max_rows = l.M;
  c.max_src_rows = T;
  c.x_dtype = dtype;
  Buffer x(*be, kernels::dtype_size(dtype) * T * H), w13(*be, 4 * w.w13.size()), w2(*be, 4 * w.w2.size()),
      y(*be, 4 * l.M * H), ws(*be, be->expert_mlp_workspace_bytes(c));
  be->fill_zero(x.get(), x.bytes());
  be->copy_to_device(w13.get(), w.w13.data(), w13.bytes());
  be->copy_to_device(w2.get(), w.w2.data(), w2.bytes());
  auto packed = be->make_expert_weights(c);
  be->pack_expert_weights(*packed, w13.as<float>(), w2.as<float>(), 0, s.experts);
  std::vector<double> t;
  for (int i = 0; i < s.warmup + s.iters; ++i) {
    kernels::ExpertMlpStats stats;
    be->expert_mlp_forward(c, {x.get(), l.offset.data(), l.src_row.as<int32_t>(), l.weight.as<float>(),
                               w13.as<float>(), w2.as<float>(), packed.get(), y.as<float>(), nullptr, ws.get(),
                               &stats, {}});
    if (i >= s.warmup) t.push_back(stats.gemm_seconds);
  }
  *rows = l.M;
  return median(t);
}

// bf16 (the layer's path) against one dense GEMM of the same FLOPs; and the two
// ways to run groups, in fp32: cublasGemmGroupedBatchedEx has no kernel for bf16
// operands with an fp32 output, so bf16 groups always run on the loop.
std::vector<std::string> bench_gemm(const BenchShape& s, const model::LayerWeights& w) {
  int64_t M = 0;
  const double bf16_loop = expert_gemm_seconds(s, w, "loop", DType::kBF16, &M);
  const double dense = dense_gemm_seconds(s, M);
  const double fp32_loop = expert_gemm_seconds(s, w, "loop", DType::kF32, &M);
  const double fp32_grouped = expert_gemm_seconds(s, w, "grouped", DType::kF32, &M);
  const double flops = 6.0 * M * s.hidden * s.ffn_hidden;
  bench::Report r = header("gpu_expert_gemm", s);
  r.add("rows", M).add("flops", flops);
  r.add("dense_cublas_bf16_tflops", flops / dense / 1e12);
  r.add("expert_bf16_tflops", flops / bf16_loop / 1e12).add("expert_bf16_vs_dense", dense / bf16_loop);
  r.add("expert_fp32_loop_tflops", flops / fp32_loop / 1e12);
  r.add("expert_fp32_grouped_tflops", flops / fp32_grouped / 1e12).add("fp32_grouped_vs_loop", fp32_loop / fp32_grouped);
  return {json_of(r)};
}

}  // namespace

std::vector<std::string> run_benches(const BenchShape& shape) {
  std::vector<std::string> out = bench_permute(shape);
  const model::LayerWeights w = bench_weights(shape);
  for (std::string& line : bench_gemm(shape, w)) out.push_back(std::move(line));
  for (std::string& line : bench_layer(shape, w)) out.push_back(std::move(line));
  return out;
}

}  // namespace moe::gpucheck
