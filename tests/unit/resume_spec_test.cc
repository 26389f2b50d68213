// The resume rule (docs/jobs.md#checkpoints-and-resume): a resumed job may change
// only steps, checkpoint_*, the verify/dump fields, tokens_per_rank, name, labels and
// the node-loss policy (elastic, min_node_replicas, dead_node_timeout_ms); any other
// field that differs from the checkpoint's spec is refused, naming the field. Every
// field of JobSpec is tried, so a field added later is covered too.
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "moe/base/check.h"
#include "moe/spec/checkpoint_manifest.h"
#include "moe/spec/job_spec.h"

namespace moe::test {
namespace {

using google::protobuf::FieldDescriptor;

const std::set<std::string> kMayDiffer = {"steps",  "checkpoint_dir", "checkpoint_every", "resume",
                                          "verify", "verify_step",    "dump_dir",         "dump_step",
                                          "tokens_per_rank", "name", "labels",
                                          "elastic", "elastic_batch", "min_node_replicas", "dead_node_timeout_ms",
                                          "overlap_chunks", "moments_dtype", "exact_replica_grads",
                                          "mode", "serve_train", "serve_max_wait_ms",
                                          "trace_dir", "trace_tokens", "trace_hidden"};  // run-only: what a run records

v1::JobSpec base() {
  v1::JobSpec s;
  s.set_experts(8);
  s.set_top_k(2);
  s.set_hidden(32);
  s.set_ffn_hidden(16);
  s.set_tokens_per_rank(64);
  s.set_steps(10);
  s.set_mode(v1::JobSpec::train);
  return spec::with_defaults(s);
}

// `s` with field fd set to another value than it has.
v1::JobSpec changed(v1::JobSpec s, const FieldDescriptor* fd) {
  if (fd->is_map()) {  // labels
    (*s.mutable_labels())["team"] = "x";
    return s;
  }
  const auto* r = s.GetReflection();
  switch (fd->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32: r->SetInt32(&s, fd, r->GetInt32(s, fd) + 1); break;
    case FieldDescriptor::CPPTYPE_INT64: r->SetInt64(&s, fd, r->GetInt64(s, fd) + 1); break;
    case FieldDescriptor::CPPTYPE_UINT32: r->SetUInt32(&s, fd, r->GetUInt32(s, fd) + 1); break;
    case FieldDescriptor::CPPTYPE_UINT64: r->SetUInt64(&s, fd, r->GetUInt64(s, fd) + 1); break;
    case FieldDescriptor::CPPTYPE_DOUBLE: r->SetDouble(&s, fd, r->GetDouble(s, fd) + 0.5); break;
    case FieldDescriptor::CPPTYPE_FLOAT: r->SetFloat(&s, fd, r->GetFloat(s, fd) + 0.5f); break;
    case FieldDescriptor::CPPTYPE_BOOL: r->SetBool(&s, fd, !r->GetBool(s, fd)); break;
    case FieldDescriptor::CPPTYPE_STRING: r->SetString(&s, fd, r->GetString(s, fd) + "x"); break;
    case FieldDescriptor::CPPTYPE_ENUM: {
      const auto* e = fd->enum_type();
      const int now = r->GetEnumValue(s, fd);
      r->SetEnumValue(&s, fd, e->value((e->FindValueByNumber(now)->index() + 1) % e->value_count())->number());
      break;
    }
    case FieldDescriptor::CPPTYPE_MESSAGE: ADD_FAILURE() << fd->name() << ": a message field this test cannot change"; break;
  }
  return s;
}

TEST(ResumeSpec, EveryFieldButTheAllowedOnesIsRefusedNamingIt) {
  const v1::JobSpec checkpoint = base();
  const auto* d = v1::JobSpec::descriptor();
  ASSERT_GT(d->field_count(), 30);
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* fd = d->field(i);
    const v1::JobSpec resumed = changed(checkpoint, fd);
    if (kMayDiffer.count(fd->name())) {
      EXPECT_NO_THROW(spec::check_resume_spec(checkpoint, resumed)) << fd->name();
      continue;
    }
    try {
      spec::check_resume_spec(checkpoint, resumed);
      ADD_FAILURE() << "a resume that changes " << fd->name() << " was accepted";
    } catch (const moe::Error& e) {
      EXPECT_NE(std::string(e.what()).find("resume: " + fd->name() + " is "), std::string::npos) << e.what();
    }
  }
  EXPECT_NO_THROW(spec::check_resume_spec(checkpoint, checkpoint));
}

}  // namespace
}  // namespace moe::test
