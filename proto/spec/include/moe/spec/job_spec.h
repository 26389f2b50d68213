// JobSpec rules shared by moectl (early checks), moe-agent (authoritative) and
// moed: defaults, validation naming the field, and JSON in and out.
#pragma once

#include <string>

#include "moe/v1/job.pb.h"

namespace moe::spec {

// The spec with every defaulted field filled (layers 1, norm_topk_prob true,
// scaling 1, lr 1e-3, skew "uniform", and the enums' first real value). The one
// place JobSpec defaults live: the agent fills them at submit, so daemons read
// every field as given.
v1::JobSpec with_defaults(v1::JobSpec spec);

// Throws moe::InvalidArgument with "FIELD: reason". world_size > 0 adds
// the checks that depend on the cluster (experts divide over the ranks).
void validate(const v1::JobSpec& spec, int world_size = 0);

// JSON as docs/cli.md#output prints it (preserve_proto_field_names, always_print_primitive_fields).
std::string to_json(const google::protobuf::Message& m, bool pretty = true);
// Parses a JobSpec from JSON read strictly (strict_json.h); throws
// moe::InvalidArgument naming the problem and its line and column.
v1::JobSpec spec_from_json(const std::string& json);
// "softmax | sigmoid": an enum field's real values (not *_UNSPECIFIED).
std::string enum_choices(const google::protobuf::FieldDescriptor& f);

}  // namespace moe::spec
