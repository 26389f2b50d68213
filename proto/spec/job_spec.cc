#include "moe/spec/job_spec.h"

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <vector>

#include "moe/base/check.h"
#include "moe/base/text.h"
#include "moe/spec/strict_json.h"

namespace moe::spec {
namespace {

[[noreturn]] void invalid(const std::string& field, const std::string& reason) {
  throw moe::InvalidArgument(field + ": " + reason);
}

void require(bool ok, const std::string& field, const std::string& reason) {
  if (!ok) invalid(field, reason);
}

// A field without a default: 0 means it was not given.
void required(int64_t value, const std::string& field) {
  if (value != 0) return;
  std::string flag = field;
  std::replace(flag.begin(), flag.end(), '_', '-');
  invalid(field, "required (--" + flag + ")");
}

// Names and label keys and values: [A-Za-z0-9._-], 1 to 63 characters.
bool is_name(const std::string& s) {
  if (s.empty() || s.size() > 63) return false;
  return std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isalnum(c) || c == '.' || c == '_' || c == '-'; });
}

}  // namespace

namespace {

// A serving job (docs/serving.md) runs until cancelled and serves forward calls;
// what it does not do yet is refused by name.
void validate_serving(const v1::JobSpec& s) {
  if (s.mode() != v1::JobSpec::serve) {
    require(!s.has_serve_max_wait_ms(), "serve_max_wait_ms", "is for serving jobs (--mode serve)");
    require(!s.serve_train(), "serve_train", "is for serving jobs (--mode serve)");
    for (const auto& [field, set] : {std::pair<const char*, bool>{"trace_dir", !s.trace_dir().empty()},
                                     {"trace_tokens", s.trace_tokens() != 0},
                                     {"trace_hidden", s.trace_hidden()}})
      require(!set, field, "records a serving job's calls (--mode serve)");
    return;
  }
  require(s.inputs().empty(), "inputs", "a serving job's rows are its callers': inputs are for forward and train jobs");
  require(!s.trace_dir().empty() || (s.trace_tokens() == 0 && !s.trace_hidden()), "trace_dir",
          "trace_tokens and trace_hidden need a folder to write the trace to");
  require(s.steps() == 0, "steps", "a serving job runs until cancelled: leave it unset");
  require(s.capacity_factor() == 0, "capacity_factor",
          "a served row's output must not depend on the calls it is batched with: serving is dropless (0)");
  require(s.serve_max_wait_ms() >= 0 && s.serve_max_wait_ms() <= 10000, "serve_max_wait_ms",
          "must be in [0, 10000], got " + std::to_string(s.serve_max_wait_ms()));
  for (const auto& [field, set] : {std::pair<const char*, bool>{"verify", s.verify()},
                                   {"dump_dir", !s.dump_dir().empty()},
                                   {"bias_update_rate", s.bias_update_rate() != 0},
                                   // a step's batch is the calls it merged: not a batch of the model's
                                   {"aux_loss_coeff", s.aux_loss_coeff() != 0},
                                   {"z_loss_coeff", s.z_loss_coeff() != 0}})
    require(!set, field, "not for serving jobs yet (docs/serving.md)");
  require(s.trace_tokens() >= 0, "trace_tokens", "must be >= 0, got " + std::to_string(s.trace_tokens()));
  require(s.checkpoint_dir().empty() || s.serve_train(), "checkpoint_dir",
          "a serving job that does not train (--serve-train) changes no weights: nothing to checkpoint");
  // A node's loss takes the handles and gradient sums it held (docs/serving.md#elastic-serving).
  require(!(s.elastic() && s.serve_train()), "elastic", "not for a serving job that trains (--serve-train) yet");
}

}  // namespace

v1::JobSpec with_defaults(v1::JobSpec s) {
  if (!s.has_layers()) s.set_layers(1);
  if (!s.has_norm_topk_prob()) s.set_norm_topk_prob(true);
  if (!s.has_routed_scaling_factor()) s.set_routed_scaling_factor(1.0);
  if (!s.has_lr()) s.set_lr(1e-3);
  if (s.score() == v1::JobSpec::SCORE_UNSPECIFIED) s.set_score(v1::JobSpec::softmax);
  if (s.dtype() == v1::JobSpec::DTYPE_UNSPECIFIED) s.set_dtype(v1::JobSpec::fp32);
  if (s.drop_policy() == v1::JobSpec::DROP_POLICY_UNSPECIFIED) s.set_drop_policy(v1::JobSpec::probs);
  if (s.mode() == v1::JobSpec::MODE_UNSPECIFIED) s.set_mode(v1::JobSpec::forward);
  if (s.optimizer() == v1::JobSpec::OPTIMIZER_UNSPECIFIED) s.set_optimizer(v1::JobSpec::adam);
  if (s.skew().empty()) s.set_skew("uniform");
  if (s.elastic_batch() == v1::JobSpec::ELASTIC_BATCH_UNSPECIFIED) s.set_elastic_batch(v1::JobSpec::global);
  if (s.mode() == v1::JobSpec::serve && !s.has_serve_max_wait_ms()) s.set_serve_max_wait_ms(5);
  if (!s.trace_dir().empty() && s.trace_tokens() == 0) s.set_trace_tokens(65536);
  return s;
}

void validate(const v1::JobSpec& s, int world_size) {
  for (const auto& [field, value] : {std::pair<const char*, int64_t>{"experts", s.experts()}, {"top_k", s.top_k()},
                                     {"hidden", s.hidden()}, {"ffn_hidden", s.ffn_hidden()},
                                     {"tokens_per_rank", s.tokens_per_rank()}})
    required(value, field);
  const bool serve = s.mode() == v1::JobSpec::serve;
  if (!serve) required(s.steps(), "steps");
  validate_serving(s);
  require(s.name().empty() || is_name(s.name()), "name",
          "must be 1-63 of [A-Za-z0-9._-], got '" + s.name() + "'");
  for (const auto& [k, v] : s.labels())
    require(is_name(k) && is_name(v), "labels", "keys and values must be 1-63 of [A-Za-z0-9._-], got '" + k + "=" + v + "'");
  require(s.dead_node_timeout_ms() >= 0, "dead_node_timeout_ms",
          "must be >= 0, got " + std::to_string(s.dead_node_timeout_ms()));
  require(s.combine_wire() == v1::WIRE_UNSPECIFIED || s.combine_wire() == v1::fp32 || s.combine_wire() == v1::bf16,
          "combine_wire", "must be fp32 or bf16 (results go back at 16 bits or more)");
  for (const auto& [field, wire] : {std::pair<const char*, v1::Wire>{"dispatch_wire", s.dispatch_wire()},
                                    {"combine_wire", s.combine_wire()}})
    require(wire != v1::fp32 || s.dtype() != v1::JobSpec::bf16, field,
            "fp32 is wider than the layer's bf16 rows (leave it unset for the layer dtype)");
  require(s.moments_dtype() != v1::JobSpec::bf16 || (s.mode() == v1::JobSpec::train && s.optimizer() != v1::JobSpec::sgd),
          "moments_dtype", "bf16 moments need a train job with the adam optimizer (sgd and forward jobs keep none)");
  require(s.overlap_chunks() >= 0 && s.overlap_chunks() <= 8, "overlap_chunks",
          "must be in [0, 8] (0: chosen per step), got " + std::to_string(s.overlap_chunks()));
  require(s.min_node_replicas() >= 0, "min_node_replicas", "must be >= 0, got " + std::to_string(s.min_node_replicas()));
  require(s.experts() >= 1, "experts", "must be >= 1, got " + std::to_string(s.experts()));
  require(s.experts() <= 65536, "experts", "must be <= 65536, got " + std::to_string(s.experts()));
  require(s.top_k() >= 1 && s.top_k() <= s.experts(), "top_k",
          "must be in [1, experts=" + std::to_string(s.experts()) + "], got " + std::to_string(s.top_k()));
  require(s.hidden() >= 1, "hidden", "must be >= 1, got " + std::to_string(s.hidden()));
  require(s.ffn_hidden() >= 1, "ffn_hidden", "must be >= 1, got " + std::to_string(s.ffn_hidden()));
  require(!s.has_layers() || (s.layers() >= 1 && s.layers() <= 1024), "layers",
          "must be in [1, 1024], got " + std::to_string(s.layers()));
  require(s.num_groups() >= 0, "num_groups", "must be >= 0, got " + std::to_string(s.num_groups()));
  if (s.num_groups() > 1) {
    require(s.experts() % s.num_groups() == 0, "num_groups",
            "experts (" + std::to_string(s.experts()) + ") must be divisible by num_groups (" +
                std::to_string(s.num_groups()) + ")");
    require(s.group_top_k() >= 1 && s.group_top_k() <= s.num_groups(), "group_top_k",
            "must be in [1, num_groups=" + std::to_string(s.num_groups()) + "], got " + std::to_string(s.group_top_k()));
    const int per_group = s.experts() / s.num_groups();
    require(s.top_k() <= s.group_top_k() * per_group, "top_k",
            "exceeds the experts of the kept groups (group_top_k " + std::to_string(s.group_top_k()) + " x " +
                std::to_string(per_group) + ")");
  } else {
    require(s.group_top_k() == 0, "group_top_k", "needs num_groups > 1");
  }
  require(!s.has_routed_scaling_factor() ||
              (std::isfinite(s.routed_scaling_factor()) && s.routed_scaling_factor() > 0),
          "routed_scaling_factor", "must be finite and > 0");
  require(std::isfinite(s.capacity_factor()) && s.capacity_factor() >= 0, "capacity_factor",
          "must be finite and >= 0 (0 = dropless)");
  require(s.tokens_per_rank() >= 1 && s.tokens_per_rank() <= (int64_t{1} << 24), "tokens_per_rank",
          "must be in [1, 16777216], got " + std::to_string(s.tokens_per_rank()));
  require(serve || s.steps() >= 1, "steps", "must be >= 1, got " + std::to_string(s.steps()));
  require(!s.has_lr() || (std::isfinite(s.lr()) && s.lr() > 0), "lr", "must be finite and > 0");
  require(s.verify_step() >= 0 && s.verify_step() < std::max(1, s.steps()), "verify_step",
          "must be in [0, steps=" + std::to_string(s.steps()) + "), got " + std::to_string(s.verify_step()));
  require(s.dump_step() >= 0 && s.dump_step() < std::max(1, s.steps()), "dump_step",
          "must be in [0, steps=" + std::to_string(s.steps()) + "), got " + std::to_string(s.dump_step()));
  if (!s.skew().empty() && s.skew() != "uniform") {
    const std::string prefix = "zipf:";
    require(s.skew().rfind(prefix, 0) == 0, "skew", "must be uniform or zipf:ALPHA, got '" + s.skew() + "'");
    const std::string num = s.skew().substr(prefix.size());
    char* end = nullptr;
    const double alpha = std::strtod(num.c_str(), &end);
    require(!num.empty() && end && *end == '\0' && std::isfinite(alpha) && alpha >= 0, "skew",
            "ALPHA in '" + s.skew() + "' must be a finite number >= 0");
  }
  require(s.weights_prefix().empty() || !s.weights().empty(), "weights_prefix", "needs weights");
  require(s.weights_first_layer() >= 0, "weights_first_layer", "must be >= 0");
  require(s.weights_first_layer() == 0 || !s.weights().empty(), "weights_first_layer", "needs weights");
  for (const auto& [field, v] : {std::pair<const char*, double>{"aux_loss_coeff", s.aux_loss_coeff()},
                                 {"z_loss_coeff", s.z_loss_coeff()},
                                 {"bias_update_rate", s.bias_update_rate()}})
    require(std::isfinite(v) && v >= 0, field, "must be finite and >= 0");
  require(s.shared_experts() >= 0, "shared_experts", "must be >= 0, got " + std::to_string(s.shared_experts()));
  require(s.shared_experts() == 0 || s.shared_ffn_hidden() >= 1, "shared_ffn_hidden",
          "must be >= 1 with shared_experts, got " + std::to_string(s.shared_ffn_hidden()));
  require(!s.shared_expert_gate() || s.shared_experts() > 0, "shared_expert_gate", "needs shared_experts > 0");
  require(s.checkpoint_every() >= 0, "checkpoint_every", "must be >= 0");
  require(s.checkpoint_dir().empty() || s.mode() != v1::JobSpec::forward, "checkpoint_dir",
          "checkpoints are for train jobs");
  // Per-rank working memory of one layer's buffers (rows x hidden, fp32), a guard
  // against specs that would only fail deep inside a daemon.
  const double rows = static_cast<double>(s.tokens_per_rank()) * std::max(1, s.top_k());
  require(rows * (s.hidden() + 2.0 * s.ffn_hidden()) * 4 < 64e9, "tokens_per_rank",
          "needs more than 64 GB of activations per rank with this hidden/ffn_hidden/top_k");
  if (world_size > 4096)
    invalid("experts", "the cluster has " + std::to_string(world_size) + " ranks; jobs run on at most 4096");
  if (world_size > 0)
    require(s.experts() % world_size == 0, "experts",
            std::to_string(s.experts()) + " experts do not divide over the " + std::to_string(world_size) +
                " ranks of the cluster");
}

std::string to_json(const google::protobuf::Message& m, bool pretty) {
  google::protobuf::util::JsonPrintOptions o;
  o.preserve_proto_field_names = true;
  o.always_print_primitive_fields = true;
  o.add_whitespace = pretty;
  std::string out;
  const auto st = google::protobuf::util::MessageToJsonString(m, &out, o);
  if (!st.ok()) throw Error("cannot print JSON: " + st.ToString());
  return out;
}

namespace {

using google::protobuf::FieldDescriptor;

// What a JSON value of this field must be, or "" when the member's kind fits.
std::string kind_mismatch(const FieldDescriptor& f, const JsonMember& m) {
  if (m.kind == 'z') return "";  // null: the field's default, as protobuf reads it
  if (f.is_map()) return m.kind == 'o' ? "" : "expects an object of \"KEY\": \"VALUE\"";
  switch (f.cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
    case FieldDescriptor::CPPTYPE_INT64:
    case FieldDescriptor::CPPTYPE_UINT64: {
      const size_t digits = m.value.rfind('-', 0) == 0 ? 1 : 0;  // -?[0-9]+, in a number or a string
      const bool integer = m.value.size() > digits && m.value.find_first_not_of("0123456789", digits) == std::string::npos;
      return (m.kind == 'n' || m.kind == 's') && integer ? "" : "expects an integer";
    }
    case FieldDescriptor::CPPTYPE_DOUBLE: return m.kind == 'n' ? "" : "expects a number";
    case FieldDescriptor::CPPTYPE_BOOL: return m.kind == 'b' ? "" : "expects true or false";
    case FieldDescriptor::CPPTYPE_STRING: return m.kind == 's' ? "" : "expects a string";
    case FieldDescriptor::CPPTYPE_ENUM: {
      const auto* v = m.kind == 's' ? f.enum_type()->FindValueByName(m.value) : nullptr;
      return v && v->number() != 0 ? "" : "expects " + enum_choices(f);
    }
    default: return "";
  }
}

// A member of the spec's JSON refused naming its line and column: a key that is
// no JobSpec field (with the nearest field, "ffn_hiden" -> "ffn_hidden"), or a
// value of the wrong kind (with the valid values of an enum).
void check_members(const std::vector<JsonMember>& members) {
  const auto* d = v1::JobSpec::descriptor();
  std::vector<std::string> names;
  for (int i = 0; i < d->field_count(); ++i) names.push_back(d->field(i)->name());
  for (const JsonMember& m : members) {
    const FieldDescriptor* f = d->FindFieldByName(m.key);
    if (!f) f = d->FindFieldByCamelcaseName(m.key);
    if (!f) {
      const std::string best = nearest_word(m.key, names);
      throw moe::InvalidArgument(m.key_at.text() + ": unknown field '" + m.key + "'" +
                                 (best.empty() ? std::string(" (docs/jobs.md#spec lists the fields)")
                                               : " (did you mean '" + best + "'?)"));
    }
    const std::string why = kind_mismatch(*f, m);
    if (why.empty()) continue;
    const std::string got = m.kind == 's' ? "\"" + m.value + "\"" : m.kind == 'n' || m.kind == 'b' ? m.value
                            : m.kind == 'o'                         ? "an object"
                                                                    : "an array";
    throw moe::InvalidArgument(m.value_at.text() + ": " + f->name() + ": " + why + ", got " + got);
  }
}

}  // namespace

std::string enum_choices(const google::protobuf::FieldDescriptor& f) {
  std::string out;
  for (int i = 0; i < f.enum_type()->value_count(); ++i) {
    const auto* v = f.enum_type()->value(i);
    if (v->number() == 0) continue;
    out += (out.empty() ? "" : " | ") + v->name();
  }
  return out;
}

v1::JobSpec spec_from_json(const std::string& json) {
  check_members(strict_json_object(json));
  v1::JobSpec s;
  google::protobuf::util::JsonParseOptions o;
  o.ignore_unknown_fields = false;
  const auto st = google::protobuf::util::JsonStringToMessage(json, &s, o);
  if (!st.ok()) {  // the parser's first line: what is wrong and where (its excerpt follows)
    const std::string what(st.message());
    throw moe::InvalidArgument("not a JobSpec in JSON: " + what.substr(0, what.find('\n')));
  }
  return s;
}

}  // namespace moe::spec
