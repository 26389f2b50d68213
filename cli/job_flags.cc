#include "moe/ctl/job_flags.h"

#include <google/protobuf/descriptor.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <set>

#include "moe/base/check.h"
#include "moe/base/file.h"
#include "moe/ctl/hf_config.h"
#include "moe/rpc/frame.h"
#include "moe/spec/checkpoint_manifest.h"
#include "moe/spec/job_spec.h"
#include "moe/spec/strict_json.h"

namespace moe::ctl {
namespace {

using google::protobuf::FieldDescriptor;

[[noreturn]] void bad(const std::string& field, const std::string& text, const std::string& why) {
  throw moe::InvalidArgument(field + ": " + why + ", got '" + text + "'");
}

const FieldDescriptor& field_of(const std::string& name) {
  const FieldDescriptor* f = v1::JobSpec::descriptor()->FindFieldByName(name);
  MOE_CHECK(f != nullptr, "JobSpec has no field '", name, "'");
  return *f;
}

int64_t parse_int(const std::string& field, const std::string& text, int64_t lo, int64_t hi) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno == ERANGE || v < lo || v > hi) bad(field, text, "expects an integer");
  return v;
}

double parse_double(const std::string& field, const std::string& text) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0') bad(field, text, "expects a number");
  return v;
}

// The default of a field as with_defaults fills it, for help texts.
std::string default_text(const FieldDescriptor& f) {
  static const v1::JobSpec defaults = spec::with_defaults(v1::JobSpec());
  const auto* r = defaults.GetReflection();
  switch (f.cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32: return std::to_string(r->GetInt32(defaults, &f));
    case FieldDescriptor::CPPTYPE_INT64: return std::to_string(r->GetInt64(defaults, &f));
    case FieldDescriptor::CPPTYPE_UINT64: return std::to_string(r->GetUInt64(defaults, &f));
    case FieldDescriptor::CPPTYPE_DOUBLE: {
      std::ostringstream os;
      os << r->GetDouble(defaults, &f);
      return os.str();
    }
    case FieldDescriptor::CPPTYPE_BOOL: return r->GetBool(defaults, &f) ? "true" : "false";
    case FieldDescriptor::CPPTYPE_ENUM: {  // unset (*_UNSPECIFIED): the help says what that means
      const auto* v = r->GetEnum(defaults, &f);
      return v->number() == 0 ? "" : v->name();
    }
    case FieldDescriptor::CPPTYPE_STRING: {
      const std::string s = r->GetString(defaults, &f);
      return s.empty() ? "none" : s;
    }
    default: return "";  // repeated and map fields: none
  }
}

// What --help shows for the value of a field's flag.
std::string type_name(const FieldDescriptor& f) {
  switch (f.cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
    case FieldDescriptor::CPPTYPE_INT64: return "INT";
    case FieldDescriptor::CPPTYPE_UINT64: return "UINT";
    case FieldDescriptor::CPPTYPE_DOUBLE: return "FLOAT";
    case FieldDescriptor::CPPTYPE_ENUM: return "NAME";
    case FieldDescriptor::CPPTYPE_BOOL: return "[=true|false]";
    default: return "TEXT";
  }
}

// The fields a JobSpec JSON text sets (its keys, by proto or JSON name).
std::set<std::string> json_fields(const std::string& json) {
  std::set<std::string> out;
  for (const spec::JsonMember& m : spec::strict_json_object(json)) {
    const FieldDescriptor* f = v1::JobSpec::descriptor()->FindFieldByName(m.key);
    if (!f) f = v1::JobSpec::descriptor()->FindFieldByCamelcaseName(m.key);
    if (f) out.insert(f->name());
  }
  return out;
}

// A required field the user set to 0 (a flag or a file's key) is a value out of
// range, not a missing one: proto3 cannot tell the two apart after parsing.
void check_given_zeros(const v1::JobSpec& s, const std::set<std::string>& set_by_user) {
  for (const JobFieldDoc& doc : job_field_docs()) {
    if (!doc.required || !set_by_user.count(doc.field)) continue;
    if (std::string(doc.field) == "steps" && s.mode() == v1::JobSpec::serve) continue;  // unset there: 0
    const FieldDescriptor& f = field_of(doc.field);
    const auto* r = s.GetReflection();
    const int64_t v = f.cpp_type() == FieldDescriptor::CPPTYPE_INT32 ? r->GetInt32(s, &f) : r->GetInt64(s, &f);
    if (v < 1)
      throw moe::InvalidArgument(std::string(doc.field) + ": must be >= 1, got " + std::to_string(v) + " (" +
                                 flag_name(doc.field) + ")");
  }
}

// A resumed job's spec (docs/jobs.md#checkpoints-and-resume): the checkpoint's,
// without its run-only fields (verify, dump, resume), with the fields the user set
// over it; refused naming the field when one may not change, or when the steps
// do not go past the checkpoint's.
v1::JobSpec resumed_spec(v1::JobSpec given, const std::set<std::string>& set_by_user) {
  const v1::CheckpointManifest m = spec::read_manifest(spec::resolve_checkpoint(given.resume()));
  v1::JobSpec s = m.spec();
  for (const char* run_only : {"verify", "verify_step", "dump_dir", "dump_step", "steps", "name", "labels", "trace_dir",
                               "trace_tokens", "trace_hidden"})
    s.GetReflection()->ClearField(&s, &field_of(run_only));
  std::set<std::string> names = set_by_user;
  names.insert("resume");
  std::vector<const FieldDescriptor*> fields;  // each once: a field swapped twice would swap back
  for (const std::string& name : names) fields.push_back(&field_of(name));
  s.GetReflection()->SwapFields(&s, &given, fields);
  // A trained model served without training writes no checkpoints: the
  // training run's folder is not carried over (one the user gives is refused).
  if (s.mode() == v1::JobSpec::serve && !s.serve_train())
    for (const char* field : {"checkpoint_dir", "checkpoint_every"})
      if (!set_by_user.count(field)) s.GetReflection()->ClearField(&s, &field_of(field));
  spec::check_resume_spec(m.spec(), s);
  if (s.steps() > 0) spec::check_resume_steps(m, s);
  return s;
}

}  // namespace

const std::vector<JobFieldDoc>& job_field_docs() {
  static const std::vector<JobFieldDoc> docs = {
      {"experts", "logical experts per layer (E)", true},
      {"top_k", "experts each token is routed to (K)", true},
      {"hidden", "hidden size H, elements", true},
      {"ffn_hidden", "expert FFN width I, elements", true},
      {"layers", "MoE layers in the residual stack", false},
      {"score", "router score function", false},
      {"num_groups", "expert groups of group-limited routing (0: none)", false},
      {"group_top_k", "groups kept per token under group-limited routing", false},
      {"norm_topk_prob", "divide the selected routing weights by their sum", false},
      {"routed_scaling_factor", "factor on the routing weights", false},
      {"dtype", "storage dtype of activations and weights", false},
      {"capacity_factor", "cf: ceil(cf x T x K / E) pairs kept per expert per source rank (0: dropless)", false},
      {"drop_policy", "which pairs capacity drops first", false},
      {"tokens_per_rank", "tokens per rank per step (T)", true},
      {"steps", "steps to run (a serving job runs until cancelled)", true},
      {"mode", "forward only, train against a teacher, or serve the layers to programs (docs/serving.md)", false},
      {"skew", "routing skew: uniform or zipf:ALPHA", false},
      {"seed", "seed of the synthetic inputs and weights", false},
      {"lr", "learning rate of the optimizer (train)", false},
      {"optimizer", "optimizer of the train mode", false},
      {"moments_dtype", "how Adam keeps its moments (unset: fp32; bf16 halves the optimizer state)", false},
      {"verify", "check step 0 against the fp64 reference", false},
      {"dump_dir", "folder for layer 0's step-0 tensors (rank{r}.safetensors, spec.json)", false},
      {"weights", "safetensors file to read the weights from (none: synthetic from the seed)", false},
      {"weights_prefix", "tensor name prefix of the weights, may hold {layer}", false},
      {"verify_step", "the step verify checks, with the weights that step used", false},
      {"dump_step", "the step the dump covers", false},
      {"weights_first_layer", "job layer l reads checkpoint layer weights_first_layer + l", false},
      {"aux_loss_coeff", "load-balancing loss coefficient (Switch/Megatron aux loss over the global batch)", false},
      {"z_loss_coeff", "router z-loss coefficient: mean logsumexp(logits)^2", false},
      {"bias_update_rate", "aux-loss-free balancing: selection bias += rate x sign(mean load - load) per step", false},
      {"shared_experts", "dense SwiGLU shared experts every token runs on its own rank", false},
      {"shared_ffn_hidden", "width of one shared expert, elements", false},
      {"shared_expert_gate", "Qwen2-MoE gate: out = routed + sigmoid(x . w_g) x shared", false},
      {"checkpoint_dir", "train: write step-{s:06d}/ checkpoints here", false},
      {"trace_dir", "serve: write each rank's routing of the calls here when the job ends (routing-rank{r}.safetensors)",
       false},
      {"trace_tokens", "serve: forward rows a layer and rank the trace keeps, the first ones (default 65536)", false},
      {"trace_hidden", "serve: the trace keeps those rows' hidden states too", false},
      {"inputs", "forward/train: the tokens are layer 0's rows of a routing trace (one recorded with --trace-hidden)",
       false},
      {"checkpoint_every", "steps between checkpoints (0: only at the end)", false},
      {"resume",
       "a checkpoint folder (or a checkpoint_dir: its latest complete step) to start from; the spec is the "
       "checkpoint's, flags change only what resume allows",
       false},
      {"name", "a name for the job, shown by job status and job list: 1-63 of [A-Za-z0-9._-]", false},
      {"labels", "a label KEY=VALUE (repeatable), for job list --selector", false},
      {"dead_node_timeout_ms",
       "while the job runs, a node silent this long is dead (0: the agent's --heartbeat-timeout-ms; at least 4 "
       "heartbeat intervals, 1000 by default)",
       false},
      {"min_node_replicas",
       "every expert's copies on at least this many nodes (0 or 1: no rule; 2: a node's death loses no expert); the "
       "shape gets the redundant slots it needs and keeps them for its later jobs until `moectl placement reset`",
       false},
      {"elastic",
       "when a node is lost, go on on the surviving nodes from the step in flight (experts from their replicas) "
       "instead of failing",
       false},
      {"elastic_batch", "after an elastic job's world change: keep the global batch, or the tokens per rank", false},
      {"dispatch_wire",
       "the format the forward dispatch's rows travel in (unset: the layer dtype); fp8 is e4m3 with a scale per 128 "
       "values",
       false},
      {"combine_wire", "the format the combine's results travel back in (unset: the layer dtype)", false,
       "fp32 | bf16"},
      {"serve_max_wait_ms",
       "serve: how long a rank waits for its recent callers' next calls before a step (0: not at all; "
       "docs/serving.md#batching)",
       false},
      {"serve_train",
       "serve: the layers also take backward calls (gradients summed per layer) and optimizer steps "
       "(--optimizer, --lr), for programs training through the cluster",
       false},
      {"exact_replica_grads",
       "a replicated expert's gradient taken at its primary over all of its pairs: the bits of a job without the "
       "replicas, for the primary's computing the replicas' share again",
       false},
      {"overlap_chunks",
       "chunks of each forward dispatch/combine pipelined with the experts: 0 chooses from the measured link, 1 is "
       "serial, up to 8",
       false},
  };
  return docs;
}

std::string flag_name(const std::string& field) {
  std::string s = "--" + field;
  for (char& c : s)
    if (c == '_') c = '-';
  return s;
}

std::string flag_help(const JobFieldDoc& doc) {
  const FieldDescriptor& f = field_of(doc.field);
  std::string help = doc.help;
  if (f.cpp_type() == FieldDescriptor::CPPTYPE_ENUM) help += ": " + (doc.choices ? doc.choices : spec::enum_choices(f));
  if (f.cpp_type() == FieldDescriptor::CPPTYPE_BOOL) help += ": true | false";
  if (doc.required) return help + " (required)";
  const std::string d = default_text(f);
  return d.empty() ? help : help + " (default: " + d + ")";
}

void set_field(v1::JobSpec& s, const std::string& field, const std::string& text) {
  const FieldDescriptor& f = field_of(field);
  const auto* r = s.GetReflection();
  switch (f.cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      return r->SetInt32(&s, &f, static_cast<int32_t>(parse_int(field, text, INT32_MIN, INT32_MAX)));
    case FieldDescriptor::CPPTYPE_INT64:
      return r->SetInt64(&s, &f, parse_int(field, text, INT64_MIN, INT64_MAX));
    case FieldDescriptor::CPPTYPE_UINT64:
      return r->SetUInt64(&s, &f, static_cast<uint64_t>(parse_int(field, text, 0, INT64_MAX)));
    case FieldDescriptor::CPPTYPE_DOUBLE: return r->SetDouble(&s, &f, parse_double(field, text));
    case FieldDescriptor::CPPTYPE_BOOL:
      if (text != "true" && text != "false") bad(field, text, "expects true or false");
      return r->SetBool(&s, &f, text == "true");
    case FieldDescriptor::CPPTYPE_ENUM: {
      const auto* v = f.enum_type()->FindValueByName(text);
      if (!v || v->number() == 0) bad(field, text, "expects " + spec::enum_choices(f));
      return r->SetEnum(&s, &f, v);
    }
    case FieldDescriptor::CPPTYPE_STRING: return r->SetString(&s, &f, text);
    default: bad(field, text, "has a type moectl cannot set");
  }
}

void JobFlags::add(CLI::App* c) {
  c->add_option("-f,--file", file_, "a JobSpec as JSON; flags given override it")->check(CLI::ExistingFile);
  c->add_option("--hf-config", hf_config_,
                "a Hugging Face config.json (mixtral, qwen2_moe, qwen3_moe, deepseek_v2, deepseek_v3): the model "
                "fields from it; -f and flags override it")
      ->check(CLI::ExistingFile);
  const auto* d = v1::JobSpec::descriptor();
  for (int i = 0; i < d->field_count(); ++i) {
    const std::string field = d->field(i)->name();
    const auto& docs = job_field_docs();
    const auto doc = std::find_if(docs.begin(), docs.end(), [&](const JobFieldDoc& x) { return field == x.field; });
    MOE_CHECK(doc != docs.end(), "moectl: JobSpec field '", field, "' has no flag documentation");
    const std::string help = flag_help(*doc);
    const FieldDescriptor& f = *d->field(i);
    if (f.is_map()) {  // labels: --label KEY=VALUE, repeatable
      c->add_option("--label", labels_, help)->type_name("KEY=VALUE");
      continue;
    }
    std::string& value = values_[field];
    CLI::Option* o = f.cpp_type() == FieldDescriptor::CPPTYPE_BOOL ? c->add_flag(flag_name(field), value, help)
                                                                    : c->add_option(flag_name(field), value, help);
    o->type_name(type_name(f));
    o->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);  // a flag given twice: the last one counts
    o->each([this, field](const std::string& v) { given_[field] = v; });
  }
}

v1::JobSpec JobFlags::build() const {
  v1::JobSpec s;
  std::set<std::string> set_by_user;
  if (!file_.empty()) {
    const std::string json = read_file(file_);
    try {
      s = spec::spec_from_json(json);
    } catch (const moe::InvalidArgument& e) {
      throw moe::InvalidArgument(file_ + ": " + e.what());
    }
    set_by_user = json_fields(json);
  }
  for (const auto& [field, text] : given_) {
    set_field(s, field, text);
    set_by_user.insert(field);
  }
  for (const std::string& kv : labels_) {
    const size_t eq = kv.find('=');
    if (eq == std::string::npos || eq == 0) bad("labels", kv, "expects KEY=VALUE");
    (*s.mutable_labels())[kv.substr(0, eq)] = kv.substr(eq + 1);
    set_by_user.insert("labels");
  }
  check_given_zeros(s, set_by_user);
  if (!s.resume().empty()) s = resumed_spec(s, set_by_user);
  if (!hf_config_.empty()) s = apply_hf_model(hf_model_from_config(read_file(hf_config_), hf_config_), s, set_by_user);
  // Paths as the user meant them, wherever the agent and the daemons run from.
  for (auto [get, set] : {std::pair{&v1::JobSpec::weights, &v1::JobSpec::set_weights<const std::string&>},
                          std::pair{&v1::JobSpec::dump_dir, &v1::JobSpec::set_dump_dir<const std::string&>},
                          std::pair{&v1::JobSpec::checkpoint_dir, &v1::JobSpec::set_checkpoint_dir<const std::string&>},
                          std::pair{&v1::JobSpec::trace_dir, &v1::JobSpec::set_trace_dir<const std::string&>},
                          std::pair{&v1::JobSpec::inputs, &v1::JobSpec::set_inputs<const std::string&>},
                          std::pair{&v1::JobSpec::resume, &v1::JobSpec::set_resume<const std::string&>}})
    if (!(s.*get)().empty()) (s.*set)(std::filesystem::absolute((s.*get)()).lexically_normal().string());
  return s;
}

}  // namespace moe::ctl
