// moectl: the command line of a moed cluster (DESIGN 9). Thin main: flags into
// the calls of ctl.h, whose return value is the exit code.
#include <CLI/CLI.hpp>
#include <google/protobuf/descriptor.h>

#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>

#include "moe/ctl/ctl.h"
#include "moe/rpc/frame.h"
#include "moe/spec/job_spec.h"

namespace {

using namespace moe;

// Applies the job flags that were given on top of the spec (from -f or empty).
struct JobFlags {
  std::string file;
  std::optional<int> experts, top_k, hidden, ffn_hidden, layers, num_groups, group_top_k, steps;
  std::optional<std::string> score, dtype, drop_policy, mode, skew, optimizer, dump_dir, weights, weights_prefix,
      norm_topk_prob;
  std::optional<double> routed_scaling_factor, capacity_factor, lr;
  std::optional<int64_t> tokens_per_rank;
  std::optional<uint64_t> seed;
  bool verify = false;

  void add(CLI::App* c) {
    c->add_option("-f,--file", file, "a JobSpec as JSON")->check(CLI::ExistingFile);
    c->add_option("--experts", experts);
    c->add_option("--top-k", top_k);
    c->add_option("--hidden", hidden);
    c->add_option("--ffn-hidden", ffn_hidden);
    c->add_option("--layers", layers);
    c->add_option("--score", score, "softmax or sigmoid");
    c->add_option("--num-groups", num_groups);
    c->add_option("--group-top-k", group_top_k);
    c->add_option("--norm-topk-prob", norm_topk_prob, "true or false");
    c->add_option("--routed-scaling-factor", routed_scaling_factor);
    c->add_option("--dtype", dtype, "fp32 or bf16");
    c->add_option("--capacity-factor", capacity_factor);
    c->add_option("--drop-policy", drop_policy, "probs or position");
    c->add_option("--tokens-per-rank", tokens_per_rank);
    c->add_option("--steps", steps);
    c->add_option("--mode", mode, "forward or train");
    c->add_option("--skew", skew, "uniform or zipf:ALPHA");
    c->add_option("--seed", seed);
    c->add_option("--lr", lr);
    c->add_option("--optimizer", optimizer, "adam or sgd");
    c->add_flag("--verify", verify, "recompute step 0 with the fp64 reference");
    c->add_option("--dump-dir", dump_dir);
    c->add_option("--weights", weights, "a safetensors file");
    c->add_option("--weights-prefix", weights_prefix);
  }

  // Throws RpcError(INVALID_ARGUMENT) naming the field.
  v1::JobSpec build() const {
    v1::JobSpec s;
    if (!file.empty()) {
      std::ifstream in(file);
      std::stringstream ss;
      ss << in.rdbuf();
      s = spec::spec_from_json(ss.str());
    }
    auto bad = [](const std::string& field, const std::string& v) {
      throw rpc::RpcError(v1::ERROR_CODE_INVALID_ARGUMENT, field + ": unknown value '" + v + "'");
    };
    if (experts) s.set_experts(*experts);
    if (top_k) s.set_top_k(*top_k);
    if (hidden) s.set_hidden(*hidden);
    if (ffn_hidden) s.set_ffn_hidden(*ffn_hidden);
    if (layers) s.set_layers(*layers);
    if (num_groups) s.set_num_groups(*num_groups);
    if (group_top_k) s.set_group_top_k(*group_top_k);
    if (steps) s.set_steps(*steps);
    if (tokens_per_rank) s.set_tokens_per_rank(*tokens_per_rank);
    if (seed) s.set_seed(*seed);
    if (routed_scaling_factor) s.set_routed_scaling_factor(*routed_scaling_factor);
    if (capacity_factor) s.set_capacity_factor(*capacity_factor);
    if (lr) s.set_lr(*lr);
    if (skew) s.set_skew(*skew);
    if (dump_dir) s.set_dump_dir(*dump_dir);
    if (weights) s.set_weights(*weights);
    if (weights_prefix) s.set_weights_prefix(*weights_prefix);
    if (verify) s.set_verify(true);
    if (norm_topk_prob) {
      if (*norm_topk_prob != "true" && *norm_topk_prob != "false") bad("norm_topk_prob", *norm_topk_prob);
      s.set_norm_topk_prob(*norm_topk_prob == "true");
    }
    // The enum flags are spelled as the proto's value names; 0 is "unspecified".
    auto set_enum = [&](const char* field, const std::optional<std::string>& text) {
      if (!text) return;
      const google::protobuf::FieldDescriptor* f = v1::JobSpec::descriptor()->FindFieldByName(field);
      const google::protobuf::EnumValueDescriptor* v = f->enum_type()->FindValueByName(*text);
      if (!v || v->number() == 0) bad(field, *text);
      s.GetReflection()->SetEnum(&s, f, v);
    };
    set_enum("score", score);
    set_enum("dtype", dtype);
    set_enum("drop_policy", drop_policy);
    set_enum("mode", mode);
    set_enum("optimizer", optimizer);
    return s;
  }
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"moectl: run and inspect a moed cluster"};
  app.require_subcommand(1);
  ctl::Globals g;
  std::string output = "table";
  app.add_option("--agent", g.agent, "HOST:PORT of moe-agent")->envname("MOE_AGENT");
  app.add_option("--token-file", g.token_file, "cluster token file")->envname("MOE_TOKEN_FILE");
  app.add_option("--state-dir", g.state_dir, "local cluster state")->envname("MOE_STATE_DIR");
  app.add_option("--output", output, "table or json")->check(CLI::IsMember({"table", "json"}));

  CLI::App* cluster = app.add_subcommand("cluster", "a local cluster on loopback")->require_subcommand(1);
  ctl::ClusterUpOptions up;
  CLI::App* cup = cluster->add_subcommand("up", "start an agent and daemons in the background");
  cup->add_option("--nodes", up.nodes)->check(CLI::Range(1, 64));
  cup->add_option("--devices-per-node", up.devices_per_node)->check(CLI::Range(1, 64));
  cup->add_option("--backend", up.backend)->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  CLI::App* cdown = cluster->add_subcommand("down", "stop the local cluster");
  CLI::App* cstatus = cluster->add_subcommand("status", "nodes and ranks");

  CLI::App* job = app.add_subcommand("job", "jobs")->require_subcommand(1);
  JobFlags jf;
  bool wait = false;
  CLI::App* jsubmit = job->add_subcommand("submit", "submit a job (flags are JobSpec fields in kebab-case)");
  jf.add(jsubmit);
  jsubmit->add_flag("--wait", wait, "wait for the result (exit 1 if it fails)");
  std::string job_id;
  CLI::App* jstatus = job->add_subcommand("status", "a job's record");
  jstatus->add_option("id", job_id)->required();
  CLI::App* jwait = job->add_subcommand("wait", "wait for a job to end");
  jwait->add_option("id", job_id)->required();
  CLI::App* jlist = job->add_subcommand("list", "all jobs");
  CLI::App* jcancel = job->add_subcommand("cancel", "cancel a queued or running job");
  jcancel->add_option("id", job_id)->required();

  CLI::App* placement = app.add_subcommand("placement", "expert placement")->require_subcommand(1);
  CLI::App* pshow = placement->add_subcommand("show", "the map in force");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : ctl::kExitUsage;
  }
  g.json = output == "json";
  std::ostream& out = std::cout;
  std::ostream& err = std::cerr;
  if (*cup) return ctl::cluster_up(g, up, out, err);
  if (*cdown) return ctl::cluster_down(g, out, err);
  if (*cstatus) return ctl::cluster_status(g, out, err);
  if (*jsubmit) {
    v1::JobSpec spec;
    try {
      spec = jf.build();
    } catch (const std::exception& e) {
      err << "moectl: invalid spec: " << e.what() << "\n";
      return ctl::kExitUsage;
    }
    return ctl::job_submit(g, spec, wait, out, err);
  }
  if (*jstatus) return ctl::job_status(g, job_id, out, err);
  if (*jwait) return ctl::job_wait(g, job_id, out, err);
  if (*jlist) return ctl::job_list(g, out, err);
  if (*jcancel) return ctl::job_cancel(g, job_id, out, err);
  if (*pshow) return ctl::placement_show(g, out, err);
  return ctl::kExitUsage;
}
