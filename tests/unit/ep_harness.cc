#include "ep_harness.h"

#include <set>
#include <sstream>

#include "moe/io/safetensors.h"
#include "moe/base/check.h"
#include "moe/kernels/cpu_backend.h"
#include "moe/transport/inproc_communicator.h"
#include "moe/ep/reference.h"
#include "rank_threads.h"
#include "test_util.h"

namespace moe::test {
namespace {

constexpr uint64_t kGradSeedTag = 0x67726164ull;  // "grad"

std::vector<float> inputs(uint64_t seed, int64_t begin, int64_t T, int H, kernels::DType dtype) {
  std::vector<float> v(T * H);
  model::fill_inputs(seed, 0, begin, T, H, v.data());
  if (dtype == kernels::DType::kBF16) model::round_to_bf16(v);
  return v;
}

model::LayerWeights case_weights(const EpCase& c) {
  model::LayerWeights w = model::make_layer_weights(
      c.seed, 0,
      {.hidden = c.hidden, .ffn_hidden = c.ffn, .num_experts = c.experts, .shared_ffn_hidden = c.shared,
       .shared_gate = c.shared_gate});
  w.logit_bias = model::skew_logit_bias(c.skew, c.seed, c.experts);
  return w;
}

// A wire choice in a case's string: the format's number, -1 for the layer's own.
int wire_code(kernels::WireChoice w) { return w ? static_cast<int>(*w) : -1; }
kernels::WireChoice wire_of_code(int code) {
  if (code < 0) return std::nullopt;
  return static_cast<kernels::WireFormat>(code);
}

}  // namespace

std::vector<double> expert_input(const EpCase& c, const std::vector<float>& x) {
  const kernels::WireFormat w = c.dispatch_wire.value_or(kernels::wire_of(c.dtype));
  return ref::expert_rows_through(w, c.dtype, x, c.hidden);
}

EpCase small_case(const std::string& name, std::vector<int64_t> tokens, MapKind map) {
  EpCase c;
  c.name = name;
  c.ranks = static_cast<int>(tokens.size());
  c.tokens = std::move(tokens);
  c.hidden = 32;
  c.ffn = 16;
  c.experts = 24;
  c.top_k = 4;
  c.map = map;
  return c;
}

std::vector<EpCase> plain_and_replica_cases() {
  std::vector<EpCase> v;
  const std::vector<std::vector<int64_t>> tokens = {{37}, {40, 23}, {31, 0, 44}, {20, 35, 1, 28},
                                                    {9, 0, 14, 3, 11, 7, 0, 12}};
  for (const auto& t : tokens)
    for (MapKind m : {MapKind::kContiguous, MapKind::kReplicas})
      v.push_back(small_case(std::string(m == MapKind::kContiguous ? "plain" : "replicas") + "_R" +
                                 std::to_string(t.size()),
                             t, m));
  return v;
}

int64_t EpCase::token_begin(int rank) const {
  int64_t b = 0;
  for (int r = 0; r < rank; ++r) b += tokens[r];
  return b;
}

int64_t EpCase::total_tokens() const { return token_begin(ranks); }

ep::MoeLayerConfig EpCase::layer_config() const {
  return ep::layer_config({.experts = experts,
                           .top_k = top_k,
                           .hidden = hidden,
                           .ffn_hidden = ffn,
                           .score = score,
                           .dtype = dtype,
                           .capacity_factor = capacity_factor,
                           .tokens_per_rank = std::max<int64_t>(1, *std::max_element(tokens.begin(), tokens.end())),
                           .train = train,
                           .aux_loss_coeff = aux,
                           .z_loss_coeff = z,
                           .shared_experts = shared > 0 ? 1 : 0,
                           .shared_ffn_hidden = shared,
                           .shared_expert_gate = shared_gate});
}

moe::ExpertMap EpCase::expert_map() const {
  const int E = experts, R = ranks;
  switch (map) {
    case MapKind::kContiguous:
      return moe::ExpertMap::contiguous(E, R);
    case MapKind::kReplicas: {
      // Each rank gets its E/R experts plus a replica of the next rank's first
      // expert (for R = 1: a second copy of expert 0 on the same rank).
      const int per = E / R, S = per + 1;
      std::vector<int32_t> p(R * S);
      for (int r = 0; r < R; ++r) {
        for (int i = 0; i < per; ++i) p[r * S + i] = r * per + i;
        p[r * S + per] = ((r + 1) % R) * per;
      }
      return moe::ExpertMap::make(E, R, S, std::move(p));
    }
    case MapKind::kEmptyRank: {
      // The last rank hosts nothing; the others split the experts.
      MOE_CHECK(R >= 2, "empty-rank map needs two ranks");
      const int S = (E + R - 2) / (R - 1);
      std::vector<int32_t> p(R * S, -1);
      for (int e = 0; e < E; ++e) p[(e / S) * S + e % S] = e;
      return moe::ExpertMap::make(E, R, S, std::move(p));
    }
    case MapKind::kTwoReplicasOnARank: {
      // As kReplicas, with two slots of the next rank's first expert on each rank.
      const int per = E / R, S = per + 2;
      std::vector<int32_t> p(R * S);
      for (int r = 0; r < R; ++r) {
        for (int i = 0; i < per; ++i) p[r * S + i] = r * per + i;
        p[r * S + per] = p[r * S + per + 1] = ((r + 1) % R) * per;
      }
      return moe::ExpertMap::make(E, R, S, std::move(p));
    }
    case MapKind::kReversed: {
      // The contiguous map read backwards: rank r hosts rank R-1-r's experts, last first.
      const moe::ExpertMap c = moe::ExpertMap::contiguous(E, R);
      std::vector<int32_t> p(c.phy2log.rbegin(), c.phy2log.rend());
      return moe::ExpertMap::make(E, R, c.slots_per_rank, std::move(p));
    }
  }
  detail::fail("unknown map kind");
}

std::string EpCase::encode() const {
  std::ostringstream os;
  os << "name=" << name << ";R=" << ranks << ";T=";
  for (size_t i = 0; i < tokens.size(); ++i) os << (i ? "," : "") << tokens[i];
  os << ";H=" << hidden << ";I=" << ffn << ";E=" << experts << ";K=" << top_k << ";score=" << kernels::score_name(score)
     << ";cf=" << capacity_factor << ";dtype=" << kernels::dtype_name(dtype) << ";map=" << static_cast<int>(map)
     << ";seed=" << seed << ";skew=" << skew << ";aux=" << aux << ";z=" << z << ";shared=" << shared
     << ";sgate=" << shared_gate << ";train=" << train << ";chunks=" << overlap_chunks << ";xrg=" << exact_replica_grads
     << ";dwire=" << wire_code(dispatch_wire) << ";cwire=" << wire_code(combine_wire);
  return os.str();
}

EpCase EpCase::decode(const std::string& s) {
  EpCase c;
  std::istringstream in(s);
  std::string item;
  while (std::getline(in, item, ';')) {
    const auto eq = item.find('=');
    MOE_CHECK(eq != std::string::npos, "ep case: bad item '", item, "'");
    const std::string k = item.substr(0, eq), v = item.substr(eq + 1);
    if (k == "name") c.name = v;
    else if (k == "R") c.ranks = std::stoi(v);
    else if (k == "T") {
      c.tokens.clear();
      std::istringstream ts(v);
      std::string t;
      while (std::getline(ts, t, ',')) c.tokens.push_back(std::stoll(t));
    } else if (k == "H") c.hidden = std::stoi(v);
    else if (k == "I") c.ffn = std::stoi(v);
    else if (k == "E") c.experts = std::stoi(v);
    else if (k == "K") c.top_k = std::stoi(v);
    else if (k == "score") c.score = kernels::parse_score(v);
    else if (k == "cf") c.capacity_factor = std::stod(v);
    else if (k == "dtype") c.dtype = kernels::parse_dtype(v);
    else if (k == "map") c.map = static_cast<MapKind>(std::stoi(v));
    else if (k == "seed") c.seed = std::stoull(v);
    else if (k == "skew") c.skew = v;
    else if (k == "aux") c.aux = std::stod(v);
    else if (k == "z") c.z = std::stod(v);
    else if (k == "shared") c.shared = std::stoi(v);
    else if (k == "sgate") c.shared_gate = v == "1";
    else if (k == "train") c.train = v == "1";
    else if (k == "chunks") c.overlap_chunks = std::stoi(v);
    else if (k == "xrg") c.exact_replica_grads = v == "1";
    else if (k == "dwire") c.dispatch_wire = wire_of_code(std::stoi(v));
    else if (k == "cwire") c.combine_wire = wire_of_code(std::stoi(v));
    else detail::fail("ep case: unknown key '", k, "'");
  }
  MOE_CHECK(static_cast<int>(c.tokens.size()) == c.ranks, "ep case: ", c.tokens.size(), " token counts for ", c.ranks,
            " ranks");
  return c;
}

void RankResult::save(const std::string& path) const {
  io::SafetensorsWriter w;
  w.set_metadata("rank", std::to_string(rank));
  w.set_metadata("dispatch_bytes", std::to_string(dispatch_bytes));
  w.set_metadata("combine_bytes", std::to_string(combine_bytes));
  w.set_metadata("naive_dispatch_bytes", std::to_string(naive_dispatch_bytes));
  w.set_metadata("chunks", std::to_string(chunks));
  auto f32 = [&](const char* name, const std::vector<float>& v) {
    w.add_f32(name, {static_cast<int64_t>(v.size())}, v.data());
  };
  auto i32 = [&](const char* name, const std::vector<int32_t>& v) {
    w.add_i32(name, {static_cast<int64_t>(v.size())}, v.data());
  };
  f32("out", out);
  f32("grad_x", grad_x);
  i32("topk_idx", topk_idx);
  i32("kept_idx", kept_idx);
  f32("grad_gate", grad_gate);
  f32("grad_w13", grad_w13);
  f32("grad_w2", grad_w2);
  f32("losses", losses);
  f32("grad_shared_w13", grad_shared_w13);
  f32("grad_shared_w2", grad_shared_w2);
  f32("grad_shared_gate", grad_shared_gate);
  w.write(path);
}

RankResult RankResult::load(const std::string& path) {
  io::SafetensorsReader r(path);
  RankResult res;
  res.rank = std::stoi(r.metadata().at("rank"));
  res.dispatch_bytes = std::stoll(r.metadata().at("dispatch_bytes"));
  res.combine_bytes = std::stoll(r.metadata().at("combine_bytes"));
  res.naive_dispatch_bytes = std::stoll(r.metadata().at("naive_dispatch_bytes"));
  res.chunks = std::stoi(r.metadata().at("chunks"));
  auto f32 = [&](const char* name) { return r.read_f32(name, r.info(name).shape); };
  auto i32 = [&](const char* name) { return r.read_i32(name, r.info(name).shape); };
  res.out = f32("out");
  res.grad_x = f32("grad_x");
  res.topk_idx = i32("topk_idx");
  res.kept_idx = i32("kept_idx");
  res.grad_gate = f32("grad_gate");
  res.grad_w13 = f32("grad_w13");
  res.grad_w2 = f32("grad_w2");
  res.losses = f32("losses");
  res.grad_shared_w13 = f32("grad_shared_w13");
  res.grad_shared_w2 = f32("grad_shared_w2");
  res.grad_shared_gate = f32("grad_shared_gate");
  return res;
}

RankResult run_rank(const EpCase& c, transport::Communicator& comm, kernels::Backend& be,
                    transport::Communicator* data_comm) {
  const int rank = comm.rank(), H = c.hidden, K = c.top_k, I = c.ffn;
  const moe::ExpertMap map = c.expert_map();
  ep::EpLayer layer(c.layer_config(), map, comm, be,
                    {.timeout = std::chrono::seconds(30),
                     .tag_base = 0,
                     .overlap_chunks = c.overlap_chunks,
                     .exact_replica_grads = c.exact_replica_grads,
                     .dispatch_wire = c.dispatch_wire,
                     .combine_wire = c.combine_wire,
                     .data_comm = data_comm});
  layer.set_weights(case_weights(c));
  const int64_t T = c.tokens[rank], begin = c.token_begin(rank);
  const auto x = model::to_storage(inputs(c.seed, begin, T, H, c.dtype), c.dtype);
  const auto go = model::to_storage(inputs(c.seed ^ kGradSeedTag, begin, T, H, c.dtype), c.dtype);
  std::vector<uint8_t> out(x.size()), gx(x.size());
  layer.forward(x.data(), T, begin, out.data());
  RankResult res;
  res.rank = rank;
  res.out = model::from_storage(out.data(), T * H, c.dtype);
  res.topk_idx.assign(layer.topk_idx(), layer.topk_idx() + T * K);
  res.kept_idx.assign(layer.kept_idx(), layer.kept_idx() + T * K);
  res.dispatch_bytes = layer.stats().transfer.dispatch_bytes;
  res.combine_bytes = layer.stats().transfer.combine_bytes;
  res.naive_dispatch_bytes = layer.stats().transfer.naive_dispatch_bytes;
  res.chunks = layer.stats().transfer.chunks;
  if (!c.train) return res;
  layer.backward(go.data(), gx.data());
  res.grad_x = model::from_storage(gx.data(), T * H, c.dtype);
  res.grad_gate.assign(layer.grad_gate(), layer.grad_gate() + static_cast<size_t>(c.experts) * H);
  const int S = map.slots_per_rank;
  for (int s = 0; s < S; ++s) {
    res.grad_w13.insert(res.grad_w13.end(), layer.grad_w13(s), layer.grad_w13(s) + 2 * I * H);
    res.grad_w2.insert(res.grad_w2.end(), layer.grad_w2(s), layer.grad_w2(s) + H * I);
  }
  res.losses = {static_cast<float>(layer.balance_losses().aux), static_cast<float>(layer.balance_losses().z)};
  if (ep::SharedExperts* sh = layer.shared_experts()) {
    res.grad_shared_w13.assign(sh->grad_w13(), sh->grad_w13() + sh->w13_size());
    res.grad_shared_w2.assign(sh->grad_w2(), sh->grad_w2() + sh->w2_size());
    if (sh->gate_size()) res.grad_shared_gate.assign(sh->grad_gate(), sh->grad_gate() + sh->gate_size());
  }
  return res;
}

namespace {

// run_rank on every rank's thread; a rank's error fails the test, naming the case.
std::vector<RankResult> run_case(Kind kind, const EpCase& c, int threads_per_rank) {
  std::vector<RankResult> results(c.ranks);
  const std::vector<std::string> errors = run_ranks(kind, c.ranks, [&](transport::Communicator& comm) {
    kernels::ThreadPool pool(threads_per_rank);
    auto be = kernels::make_cpu_backend(pool);
    results[comm.rank()] = run_rank(c, comm, *be);
    // UCX ranks stay until every peer has what it needs from them.
    if (kind != Kind::kInProc) comm.barrier(transport::deadline_in(std::chrono::seconds(30)));
  });
  for (int r = 0; r < c.ranks; ++r) EXPECT_EQ(errors[r], "") << c.name << " rank " << r;
  return results;
}

}  // namespace

std::vector<RankResult> run_inproc(const EpCase& c, int threads_per_rank) {
  return run_case(Kind::kInProc, c, threads_per_rank);
}

std::vector<RankResult> run_hybrid(const EpCase& c) { return run_case(Kind::kHybrid, c, 1); }

std::vector<RankResult> run_inproc_with_data_comm(const EpCase& c) {
  std::vector<RankResult> results(c.ranks);
  transport::InProcGroup data(c.ranks);
  std::vector<std::unique_ptr<transport::Communicator>> data_comms;
  for (int r = 0; r < c.ranks; ++r) data_comms.push_back(data.communicator(r));
  const std::vector<std::string> errors = run_ranks(Kind::kInProc, c.ranks, [&](transport::Communicator& comm) {
    kernels::ThreadPool pool(1);
    auto be = kernels::make_cpu_backend(pool);
    try {
      results[comm.rank()] = run_rank(c, comm, *be, data_comms[comm.rank()].get());
    } catch (const std::exception& e) {
      data.abort(comm.rank(), e.what());  // the peers waiting on the data group fail too
      throw;
    }
  });
  for (int r = 0; r < c.ranks; ++r) EXPECT_EQ(errors[r], "") << c.name << " rank " << r;
  return results;
}

int64_t analytic_dispatch_bytes(const EpCase& c, const RankResult& r) {
  const moe::ExpertMap map = c.expert_map();
  const int K = c.top_k;
  const int64_t row = static_cast<int64_t>(kernels::dtype_size(c.dtype)) * c.hidden + 8 * K + 4;  // slots, weights, the source token
  const int64_t T = c.tokens[r.rank], begin = c.token_begin(r.rank);
  int64_t bytes = 0;
  for (int64_t t = 0; t < T; ++t) {
    std::set<int> ranks;
    for (int k = 0; k < K; ++k) {
      const int32_t e = r.kept_idx[t * K + k];
      if (e < 0) continue;
      const uint32_t rep = kernels::replica_index(begin + t, e, map.logcnt[e]);
      ranks.insert(map.rank_of_slot(map.replicas(e)[rep]));
    }
    ranks.erase(r.rank);
    bytes += static_cast<int64_t>(ranks.size()) * row;
  }
  return bytes;
}

namespace {

// The balancing losses (the ranks' shares add up to the global ones) and the
// shared experts' gradients (every rank holds the sum over ranks).
void check_balancing_and_shared(const EpCase& c, const ref::Forward& f, const ref::Grads& g,
                                const std::vector<RankResult>& results) {
  if (c.aux > 0 || c.z > 0) {
    double aux = 0, z = 0;
    for (const RankResult& r : results) {
      aux += r.losses[0];
      z += r.losses[1];
    }
    EXPECT_TRUE(close("aux and z losses", {aux, z}, {f.aux_loss, f.z_loss}, 1e-5, 1e-7));
    if (c.aux > 0) {
      EXPECT_GT(f.aux_loss, 0);
    }
    if (c.z > 0) {
      EXPECT_GT(f.z_loss, 0);
    }
  }
  if (c.shared == 0) return;
  const bool bf16 = c.dtype == kernels::DType::kBF16;
  const double rt = bf16 ? 1.0 / 64 : 1e-4, at = bf16 ? 1.0 / 256 : 1e-5;
  for (const RankResult& r : results) {
    SCOPED_TRACE("rank " + std::to_string(r.rank));
    EXPECT_TRUE(close("grad_shared_w13", to_double(r.grad_shared_w13), g.grad_shared_w13, rt, at));
    EXPECT_TRUE(close("grad_shared_w2", to_double(r.grad_shared_w2), g.grad_shared_w2, rt, at));
    if (c.shared_gate) {
      EXPECT_TRUE(close("grad_shared_gate", to_double(r.grad_shared_gate), g.grad_shared_gate, rt, at));
    }
    EXPECT_GT(nonzero_fraction(to_double(r.grad_shared_w13)), 0.5);
  }
}

}  // namespace

void check_against_reference(const EpCase& c, const std::vector<RankResult>& results) {
  SCOPED_TRACE(c.name);
  const int64_t Ttot = c.total_tokens();
  const int H = c.hidden, I = c.ffn, K = c.top_k, E = c.experts;
  const model::LayerWeights w = ep::weights_as_used(case_weights(c), c.dtype);
  const ref::Weights rw = ep::reference_weights(w);
  const std::vector<double> x = to_double(inputs(c.seed, 0, Ttot, H, c.dtype));
  const std::vector<double> go = to_double(inputs(c.seed ^ kGradSeedTag, 0, Ttot, H, c.dtype));
  const ref::Config rc = ep::reference_config(c.layer_config());
  std::vector<int32_t> topk;
  for (const RankResult& r : results) topk.insert(topk.end(), r.topk_idx.begin(), r.topk_idx.end());
  ASSERT_EQ(static_cast<int64_t>(topk.size()), Ttot * K);
  const ref::Forward own = ref::forward(rc, rw, x, Ttot, ref::segmented(c.tokens));
  for (int64_t t = 0; t < Ttot; ++t) {
    if (own.selection_margin[t] <= 1e-5) continue;  // a near-tie fp32 cannot break like fp64
    for (int k = 0; k < K; ++k) ASSERT_EQ(topk[t * K + k], own.topk_idx[t * K + k]) << "token " << t;
  }
  ref::ForwardOptions fo = ref::forced(topk.data(), c.tokens);
  const std::vector<double> ex = expert_input(c, inputs(c.seed, 0, Ttot, H, c.dtype));
  if (!ex.empty()) fo.expert_x = &ex;
  const ref::Forward f = ref::forward(rc, rw, x, Ttot, fo);
  const ref::Grads g = ref::backward(rc, rw, x, f, go);

  // bf16: every rank's partial combine row and the final output are each rounded
  // once to bf16 (2^-8 relative each: 8 significant bits), so hold them to 2^-7 of
  // the value plus 2^-8 of the tensor's scale (partials may cancel). The oneDNN
  // engine also rounds h and dgu to bf16 before the GEMMs that read them: an
  // element moves by at most 2^-8 of its sum of |terms| (RoundingSums, numeric.h),
  // allowed twice over for the fp32 accumulation behind those operands.
  // A bf16 combine wire rounds the partial rows alone: the same bound for out.
  const bool bf16 = c.dtype == kernels::DType::kBF16;
  const bool bf16_out = bf16 || c.combine_wire == kernels::WireFormat::kBF16;
  const double rt = bf16 ? 0x1.0p-7 : 1e-4, at = bf16 ? 0x1.0p-8 : 1e-5;
  const double out_rt = bf16_out ? 0x1.0p-7 : rt, out_at = bf16_out ? 0x1.0p-8 : at;
  const bool rounds_operands = bf16 && kernels::cpu_backend_info().engines.bf16 == kernels::GemmEngine::kOneDnn;
  const double coef = rounds_operands ? 2 * kBf16Roundoff : 0.0;
  const RoundingSums sums = rounding_sums(rc, rw, ex.empty() ? x : ex, f, g, go);
  std::vector<double> out_all, gx_all;
  std::vector<int32_t> kept_all;
  for (const RankResult& r : results) {
    out_all.insert(out_all.end(), r.out.begin(), r.out.end());
    gx_all.insert(gx_all.end(), r.grad_x.begin(), r.grad_x.end());
    kept_all.insert(kept_all.end(), r.kept_idx.begin(), r.kept_idx.end());
  }
  EXPECT_EQ(kept_all, f.kept_idx);
  EXPECT_TRUE(close_bounded("out", out_all, f.out, sums.out, coef, out_rt, out_at, Ttot == 0));
  if (Ttot > 0) EXPECT_GT(nonzero_fraction(out_all), 0.5);
  if (!c.train) return;  // a forward-only layer
  EXPECT_TRUE(close_bounded("grad_x", gx_all, g.grad_x, sums.grad_x, coef, rt, at, Ttot == 0));
  if (Ttot > 0) EXPECT_GT(nonzero_fraction(gx_all), 0.5);
  const moe::ExpertMap map = c.expert_map();
  const size_t n13 = 2 * static_cast<size_t>(I) * H, n2 = static_cast<size_t>(H) * I;
  auto slice = [](const std::vector<double>& v, size_t begin, size_t n) {
    return std::vector<double>(v.begin() + begin, v.begin() + begin + n);
  };
  for (const RankResult& r : results) {
    SCOPED_TRACE("rank " + std::to_string(r.rank));
    EXPECT_TRUE(close("grad_gate", to_double(r.grad_gate), g.grad_gate, 1e-4, 1e-5, Ttot == 0));
    for (int s = 0; s < map.slots_per_rank; ++s) {
      const int32_t e = map.expert_at(r.rank, s);
      if (e < 0) continue;
      EXPECT_TRUE(close_bounded("grad_w13 of expert " + std::to_string(e),
                                to_double(std::vector<float>(r.grad_w13.begin() + s * n13, r.grad_w13.begin() + (s + 1) * n13)),
                                slice(g.grad_w13, e * n13, n13), slice(sums.grad_w13, e * n13, n13), coef, 1e-4, 1e-5,
                                true));
      EXPECT_TRUE(close_bounded("grad_w2 of expert " + std::to_string(e),
                                to_double(std::vector<float>(r.grad_w2.begin() + s * n2, r.grad_w2.begin() + (s + 1) * n2)),
                                slice(g.grad_w2, e * n2, n2), slice(sums.grad_w2, e * n2, n2), coef, 1e-4, 1e-5, true));
    }
  }
  check_balancing_and_shared(c, f, g, results);
  // Replicas hold bitwise identical gradients.
  for (int e = 0; e < E; ++e) {
    const std::vector<int32_t> reps = map.replicas(e);
    for (size_t i = 1; i < reps.size(); ++i) {
      const RankResult& a = results[map.rank_of_slot(reps[0])];
      const RankResult& b = results[map.rank_of_slot(reps[i])];
      const size_t sa = reps[0] % map.slots_per_rank, sb = reps[i] % map.slots_per_rank;
      EXPECT_TRUE(std::equal(a.grad_w13.begin() + sa * n13, a.grad_w13.begin() + (sa + 1) * n13,
                             b.grad_w13.begin() + sb * n13))
          << "replica " << i << " of expert " << e << " differs";
      EXPECT_TRUE(std::equal(a.grad_w2.begin() + sa * n2, a.grad_w2.begin() + (sa + 1) * n2, b.grad_w2.begin() + sb * n2))
          << "replica " << i << " of expert " << e << " differs";
    }
  }
}

}  // namespace moe::test
