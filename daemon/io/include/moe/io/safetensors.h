// safetensors files (the Hugging Face format): an 8-byte little-endian header
// length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {..}},
// then the raw data. F32, BF16 and I32 are read and written; other dtypes may be
// present in a file and are reported only if one of them is read.
//
// Every error names the file and what is wrong: truncated file, bad header,
// missing tensor, wrong shape, unsupported dtype.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace moe::io {

enum class StDType { kF32, kBF16, kI32, kOther };

struct TensorInfo {
  std::string name;
  std::string dtype_name;  // as in the header, e.g. "BF16"
  StDType dtype = StDType::kOther;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // offsets into the data section
  uint64_t end = 0;
  int64_t numel() const;
};

std::string shape_str(const std::vector<int64_t>& shape);

class SafetensorsReader {
 public:
  explicit SafetensorsReader(const std::string& path);
  ~SafetensorsReader();
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;

  const std::string& path() const { return path_; }
  bool has(const std::string& name) const { return tensors_.count(name) != 0; }
  const TensorInfo& info(const std::string& name) const;  // throws "missing tensor"
  std::vector<std::string> names() const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // F32 or BF16 tensors as fp32; the shape must equal `shape`.
  std::vector<float> read_f32(const std::string& name, const std::vector<int64_t>& shape) const;
  std::vector<int32_t> read_i32(const std::string& name, const std::vector<int64_t>& shape) const;

 private:
  const TensorInfo& checked(const std::string& name, const std::vector<int64_t>& shape) const;
  std::string path_;
  const uint8_t* map_ = nullptr;
  size_t map_size_ = 0;
  const uint8_t* data_ = nullptr;  // start of the data section
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

class SafetensorsWriter {
 public:
  // Stores fp32 values as F32, or rounded to BF16.
  void add_f32(const std::string& name, const std::vector<int64_t>& shape, const float* data,
               StDType stored = StDType::kF32);
  void add_i32(const std::string& name, const std::vector<int64_t>& shape, const int32_t* data);
  // Bytes already in `dtype` (F32, BF16 or I32), numel x element size of them.
  void add_raw(const std::string& name, StDType dtype, const std::vector<int64_t>& shape,
               const void* data);
  void set_metadata(const std::string& key, const std::string& value) { metadata_[key] = value; }
  // Writes PATH.tmp, then renames it over PATH: a reader never sees half a file.
  void write(const std::string& path) const;

 private:
  struct Entry {
    std::string name;
    StDType dtype;
    std::vector<int64_t> shape;
    std::vector<uint8_t> bytes;
  };
  void add(Entry e);
  std::vector<Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace moe::io
