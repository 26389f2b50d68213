// moectl's JSON (docs/cli.md#json): the one way every command prints a reply
// with -o json, and reads such output back (tests, scripts in C++).
//
// Field names as in the .proto (snake_case), in the .proto's order; zero values
// printed (proto3 `optional` fields and messages only when set); enum values by
// their short name (JOB_STATE_SUCCEEDED -> "SUCCEEDED": the enum's own prefix
// dropped; JobSpec's "softmax" as is); every integer and double a JSON number
// (a non-finite double prints as null); repeated fields as arrays, maps as
// objects; bytes as base64. Indented by two, one object per output.
#pragma once

#include <google/protobuf/message.h>

#include <string>

namespace moe::ctl {

// one_line: no line breaks or indentation (a JSON Lines stream, `job status --watch`).
std::string to_json(const google::protobuf::Message& m, bool one_line = false);
// Parses what to_json printed (short or full enum names) into m; throws
// moe::InvalidArgument naming the problem.
void from_json(const std::string& json, google::protobuf::Message& m);
// An enum value's short name: its name without the enum's UPPER_SNAKE prefix.
std::string short_enum_name(const google::protobuf::EnumValueDescriptor& v);

}  // namespace moe::ctl
