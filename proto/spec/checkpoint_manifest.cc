#include "moe/spec/checkpoint_manifest.h"

#include <google/protobuf/text_format.h>
#include <google/protobuf/util/json_util.h>

#include <cstdio>
#include <filesystem>
#include <set>

#include "moe/base/check.h"
#include "moe/base/file.h"
#include "moe/spec/expert_map_codec.h"

namespace moe::spec {

namespace fs = std::filesystem;

std::string step_folder_name(int step) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%06d", step);
  return name;
}

std::string resolve_checkpoint(const std::string& path) {
  MOE_CHECK(fs::exists(path), "checkpoint: ", path, " does not exist");
  MOE_CHECK(fs::is_directory(path), "checkpoint: ", path, " is not a folder (a step folder or a checkpoint_dir)");
  if (fs::exists(fs::path(path) / kManifestName)) return path;
  std::string best;
  for (const auto& entry : fs::directory_iterator(path)) {
    const std::string name = entry.path().filename().string();
    if (!entry.is_directory() || name.rfind("step-", 0) != 0 || name.size() != 11) continue;
    if (!fs::exists(entry.path() / kManifestName)) continue;  // incomplete: never taken
    if (name > best) best = name;
  }
  MOE_CHECK(!best.empty(), "checkpoint: ", path, " holds no complete checkpoint (no step-NNNNNN/", kManifestName, ")");
  return (fs::path(path) / best).string();
}

v1::CheckpointManifest manifest_from_json(const std::string& text, const std::string& path) {
  v1::CheckpointManifest m;
  const auto st = google::protobuf::util::JsonStringToMessage(text, &m);
  MOE_CHECK(st.ok(), "checkpoint: ", path, " is malformed: ", st.message().as_string());
  MOE_CHECK(m.format() == 1, "checkpoint: ", path, " has format ", m.format(), ", this build reads 1");
  MOE_CHECK(m.maps_size() == m.spec().layers(), "checkpoint: ", path, " holds ", m.maps_size(), " maps for ",
            m.spec().layers(), " layers");
  for (const v1::CheckpointFile& f : m.files()) {
    const fs::path name(f.name());
    MOE_CHECK(!f.name().empty() && name == name.filename() && name != "." && name != "..", "checkpoint: ", path,
              " lists '", f.name(), "', not a file name in its folder");
  }
  for (int l = 0; l < m.maps_size(); ++l) {
    MOE_CHECK(m.maps(l).layer() == l, "checkpoint: ", path, " holds the map of layer ", m.maps(l).layer(), " at ", l);
    try {
      (void)from_proto(m.maps(l));
    } catch (const Error& e) {
      throw Error("checkpoint: " + path + ": " + e.what());
    }
  }
  return m;
}

v1::CheckpointManifest read_manifest(const std::string& folder) {
  const std::string path = (fs::path(folder) / kManifestName).string();
  MOE_CHECK(fs::exists(path), "checkpoint: ", path, " is missing (an incomplete checkpoint)");
  return manifest_from_json(read_file(path), path);
}

void check_files(const std::string& folder, const v1::CheckpointManifest& m) {
  for (const v1::CheckpointFile& f : m.files()) {
    const fs::path p = fs::path(folder) / f.name();
    MOE_CHECK(fs::exists(p), "checkpoint: ", p.string(), " is missing");
    const double bytes = static_cast<double>(fs::file_size(p));
    MOE_CHECK(bytes == f.bytes(), "checkpoint: ", p.string(), " is truncated or changed: ", bytes, " bytes, ",
              kManifestName, " recorded ", f.bytes());
  }
}

void check_resume_spec(const v1::JobSpec& checkpoint, const v1::JobSpec& resumed) {
  static const std::set<std::string> may_differ = {
      "steps", "checkpoint_dir", "checkpoint_every", "resume", "verify", "verify_step", "dump_dir", "dump_step",
      "tokens_per_rank", "name", "labels", "elastic", "elastic_batch", "min_node_replicas", "dead_node_timeout_ms",
      "overlap_chunks", "moments_dtype", "exact_replica_grads",
      // a trained model may be served, and a served one trained on (docs/serving.md#checkpoints)
      "mode", "serve_train", "serve_max_wait_ms", "trace_dir", "trace_tokens", "trace_hidden"};
  const auto* d = v1::JobSpec::descriptor();
  for (int i = 0; i < d->field_count(); ++i) {
    const auto* fd = d->field(i);
    if (may_differ.count(fd->name())) continue;
    std::string a, b;
    google::protobuf::TextFormat::PrintFieldValueToString(checkpoint, fd, -1, &a);
    google::protobuf::TextFormat::PrintFieldValueToString(resumed, fd, -1, &b);
    MOE_CHECK(a == b, "resume: ", fd->name(), " is ", b, " but the checkpoint was written with ", a,
              " (only steps, checkpoint_*, verify/dump fields, tokens_per_rank, name, labels, the elastic, node-loss and overlap fields, moments_dtype and the mode, serve and trace fields may change)");
  }
}

void check_resume_steps(const v1::CheckpointManifest& m, const v1::JobSpec& resumed) {
  if (resumed.mode() == v1::JobSpec::serve || m.step() < resumed.steps()) return;  // serving has no last step
  throw InvalidArgument("steps: the checkpoint has " + std::to_string(m.step()) + " steps done and the job asks for " +
                        std::to_string(resumed.steps()) + "; give --steps above " + std::to_string(m.step()) +
                        " (steps count from step 0)");
}

v1::CheckpointManifest load_for_resume(const v1::JobSpec& resumed, std::string& folder) {
  folder = resolve_checkpoint(resumed.resume());
  v1::CheckpointManifest m = read_manifest(folder);
  check_files(folder, m);
  check_resume_spec(m.spec(), resumed);
  check_resume_steps(m, resumed);
  return m;
}

}  // namespace moe::spec
