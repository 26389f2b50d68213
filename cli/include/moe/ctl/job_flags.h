// moectl's job flags (docs/jobs.md#spec, docs/cli.md#commands): one flag per
// JobSpec field, named after it in kebab-case (--ffn-hidden), made from the
// proto's descriptor and one table of help texts; the default each help names
// comes from spec::with_defaults, the one place defaults live. Flags given on the
// command line override `-f spec.json`, and both override `--hf-config
// config.json` (hf_config.h); a boolean flag takes --flag, --flag=true or
// --flag=false. A relative --weights path is made absolute (the daemons do not
// run in the submitter's folder). With --resume the spec is the checkpoint's,
// the given flags over it (only those resume allows).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "moe/v1/job.pb.h"

namespace CLI {
class App;
}

namespace moe::ctl {

// One JobSpec field's documentation.
struct JobFieldDoc {
  const char* field;
  const char* help;               // what it is and its unit
  bool required;                  // no default: a job must set it
  const char* choices = nullptr;  // an enum's accepted values where fewer than its type's
};
const std::vector<JobFieldDoc>& job_field_docs();

// "ffn_hidden" -> "--ffn-hidden".
std::string flag_name(const std::string& field);
// The help line of a field: its text, then "(required)" or "(default: ...)".
std::string flag_help(const JobFieldDoc& doc);

class JobFlags {
 public:
  // Adds -f/--file, --hf-config and one flag per JobSpec field to a subcommand. Throws
  // moe::Error if a field has no documentation (a new field must get some).
  void add(CLI::App* command);
  // The spec: the Hugging Face config's model fields, the file's over them,
  // the given flags over both. Throws moe::InvalidArgument naming
  // the field (or config key) and the bad value.
  v1::JobSpec build() const;

 private:
  std::string file_;
  std::string hf_config_;
  std::map<std::string, std::string> given_;  // field -> text, only flags that were given
  std::map<std::string, std::string> values_;  // storage CLI11 writes into
  std::vector<std::string> labels_;            // --label KEY=VALUE
};

// Sets one field of spec from its command-line text; throws rpc::RpcError
// (INVALID_ARGUMENT) naming the field.
void set_field(v1::JobSpec& spec, const std::string& field, const std::string& text);

}  // namespace moe::ctl
