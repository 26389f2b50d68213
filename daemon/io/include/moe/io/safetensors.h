// safetensors files (the Hugging Face format): an 8-byte little-endian header
// length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {..}},
// then the raw data. F32, BF16 and I32 are read and written; other dtypes may be
// present in a file and are reported only if one of them is read.
//
// Every error names the file and what is wrong: truncated file, bad header,
// missing tensor, wrong shape, unsupported dtype.
//
// The reader reads the header when opened and each tensor's bytes (pread) when
// asked for: a rank that needs a few experts of a large checkpoint reads those.
#pragma once

#include <atomic>
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
  // Opens the file and reads its header (nothing else).
  explicit SafetensorsReader(const std::string& path);
  ~SafetensorsReader();
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;

  const std::string& path() const { return path_; }
  bool has(const std::string& name) const { return tensors_.count(name) != 0; }
  const TensorInfo& info(const std::string& name) const;  // throws "missing tensor"
  std::vector<std::string> names() const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // F32 or BF16 tensors as fp32 (BF16 converts exactly); the shape must equal
  // `shape`. Reads that tensor's bytes only. Safe to call from several threads.
  std::vector<float> read_f32(const std::string& name, const std::vector<int64_t>& shape) const;
  std::vector<int32_t> read_i32(const std::string& name, const std::vector<int64_t>& shape) const;

  // Bytes read from the file so far: the 8-byte length and the header, then
  // the data of every tensor read.
  uint64_t bytes_read() const { return bytes_read_.load(); }
  uint64_t header_bytes() const { return data_offset_; }  // 8 + header length

 private:
  const TensorInfo& checked(const std::string& name, const std::vector<int64_t>& shape) const;
  // Reads n bytes at file offset `offset` into dst; throws naming `what` if the
  // file ends early or the read fails.
  void read_at(void* dst, uint64_t n, uint64_t offset, const std::string& what) const;
  void parse_header(const std::string& text, uint64_t data_size);
  std::string path_;
  int fd_ = -1;
  uint64_t data_offset_ = 0;  // file offset of the data section
  mutable std::atomic<uint64_t> bytes_read_{0};
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
