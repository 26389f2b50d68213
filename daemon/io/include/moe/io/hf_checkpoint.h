// A Hugging Face checkpoint (docs/formats.md#hugging-face-schemes): one safetensors file, or several behind
// an index, `model.safetensors.index.json` = {"metadata": {..}, "weight_map":
// {tensor name: shard file name, ..}} with the shards in the index's folder.
//
// Shards are opened when a tensor in them is first asked about, header only;
// tensor data is read (pread) only by read_f32. So a rank reads the headers of
// the shards holding the tensors it looks at and the bytes of the tensors it
// reads, nothing else. Every error names the tensor and the file.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "moe/io/safetensors.h"

namespace moe::io {

class HfCheckpoint {
 public:
  // `path`: a .safetensors file, an index (.json), or a folder holding
  // model.safetensors.index.json or else model.safetensors. Reads the index (or
  // the single file's header); throws moe::Error naming the path and the problem.
  explicit HfCheckpoint(const std::string& path);

  const std::string& path() const { return path_; }
  bool sharded() const { return !index_path_.empty(); }
  // Whether the checkpoint lists the tensor (the weight map, or the file's header).
  bool has(const std::string& name) const;
  // Every tensor name that starts with `prefix`, sorted.
  std::vector<std::string> names_with_prefix(const std::string& prefix) const;

  // The tensor's header entry, from its shard (opened now if it was not).
  // Throws naming the tensor when it is not listed, its shard cannot be opened,
  // or the shard lacks it.
  const TensorInfo& info(const std::string& name);
  // As SafetensorsReader::read_f32, from the tensor's shard.
  std::vector<float> read_f32(const std::string& name, const std::vector<int64_t>& shape);

  // The files opened so far (the index not counted) and the bytes read from them.
  std::vector<std::string> opened_files() const;
  uint64_t bytes_read() const;

 private:
  SafetensorsReader& shard_of(const std::string& name);
  void read_index(const std::string& index_path);

  std::string path_;
  std::string index_path_;                         // empty: a single file
  std::map<std::string, std::string> weight_map_;  // tensor -> shard path (sharded only)
  std::map<std::string, std::unique_ptr<SafetensorsReader>> open_;  // by file path
};

}  // namespace moe::io
