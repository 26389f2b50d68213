#include "moe/io/hf_checkpoint.h"

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include <filesystem>

#include "moe/base/check.h"
#include "moe/base/file.h"

namespace moe::io {
namespace {

namespace fs = std::filesystem;

constexpr const char* kIndexName = "model.safetensors.index.json";
constexpr const char* kSingleName = "model.safetensors";

bool is_json(const std::string& path) { return fs::path(path).extension() == ".json"; }

}  // namespace

HfCheckpoint::HfCheckpoint(const std::string& path) : path_(path) {
  std::error_code ec;
  std::string file = path;
  if (fs::is_directory(path, ec)) {
    const fs::path index = fs::path(path) / kIndexName, single = fs::path(path) / kSingleName;
    if (fs::exists(index, ec)) file = index.string();
    else if (fs::exists(single, ec)) file = single.string();
    else detail::fail(path, ": a folder without ", kIndexName, " or ", kSingleName);
  }
  if (is_json(file)) {
    read_index(file);
    return;
  }
  open_.emplace(file, std::make_unique<SafetensorsReader>(file));
}

void HfCheckpoint::read_index(const std::string& index_path) {
  index_path_ = index_path;
  google::protobuf::Struct index;
  const auto st = google::protobuf::util::JsonStringToMessage(read_file(index_path), &index);
  MOE_CHECK(st.ok(), index_path, ": bad index: not a JSON object (", st.message().as_string(), ")");
  const auto map = index.fields().find("weight_map");
  MOE_CHECK(map != index.fields().end() && map->second.has_struct_value(), index_path,
            ": bad index: no \"weight_map\" object");
  const fs::path folder = fs::path(index_path).parent_path();
  for (const auto& [name, shard] : map->second.struct_value().fields()) {
    MOE_CHECK(shard.kind_case() == google::protobuf::Value::kStringValue && !shard.string_value().empty(),
              index_path, ": bad index: weight_map[\"", name, "\"] is not a file name");
    // A shard is a file of the index's own folder: a path could make a daemon read any file.
    const std::string& file = shard.string_value();
    MOE_CHECK(file.find('/') == std::string::npos && file != "." && file != "..", index_path,
              ": bad index: weight_map[\"", name, "\"] is '", file, "', not a file name in the index's folder");
    weight_map_.emplace(name, (folder / shard.string_value()).string());
  }
}

bool HfCheckpoint::has(const std::string& name) const {
  return sharded() ? weight_map_.count(name) != 0 : open_.begin()->second->has(name);
}

std::vector<std::string> HfCheckpoint::names_with_prefix(const std::string& prefix) const {
  std::vector<std::string> out;
  if (!sharded()) {
    for (const std::string& n : open_.begin()->second->names())
      if (n.rfind(prefix, 0) == 0) out.push_back(n);
    return out;
  }
  for (auto it = weight_map_.lower_bound(prefix); it != weight_map_.end() && it->first.rfind(prefix, 0) == 0; ++it)
    out.push_back(it->first);
  return out;
}

SafetensorsReader& HfCheckpoint::shard_of(const std::string& name) {
  if (!sharded()) return *open_.begin()->second;
  const auto it = weight_map_.find(name);
  MOE_CHECK(it != weight_map_.end(), index_path_, ": missing tensor '", name, "' (not in the weight_map)");
  auto& reader = open_[it->second];
  if (!reader) {
    try {
      reader = std::make_unique<SafetensorsReader>(it->second);
    } catch (const Error& e) {
      open_.erase(it->second);
      detail::fail(e.what(), " (the shard of tensor '", name, "' in ", index_path_, ")");
    }
  }
  MOE_CHECK(reader->has(name), reader->path(), ": missing tensor '", name, "', which ", index_path_,
            " places in this shard");
  return *reader;
}

const TensorInfo& HfCheckpoint::info(const std::string& name) { return shard_of(name).info(name); }

std::vector<float> HfCheckpoint::read_f32(const std::string& name, const std::vector<int64_t>& shape) {
  return shard_of(name).read_f32(name, shape);
}

std::vector<std::string> HfCheckpoint::opened_files() const {
  std::vector<std::string> out;
  for (const auto& [file, reader] : open_) out.push_back(file);
  return out;
}

uint64_t HfCheckpoint::bytes_read() const {
  uint64_t n = 0;
  for (const auto& [file, reader] : open_) n += reader->bytes_read();
  return n;
}

}  // namespace moe::io
