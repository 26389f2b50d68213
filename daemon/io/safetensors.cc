#include "moe/io/safetensors.h"

#include <fcntl.h>
#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "moe/base/check.h"
#include "moe/base/file.h"
#include "moe/kernels/types.h"

namespace moe::io {
namespace {

constexpr uint64_t kMaxHeaderBytes = 100u << 20;  // the format's own limit

size_t dtype_size(StDType t) {
  switch (t) {
    case StDType::kF32:
    case StDType::kI32:
      return 4;
    case StDType::kBF16:
      return 2;
    case StDType::kOther:
      break;
  }
  return 0;
}

const char* dtype_str(StDType t) {
  switch (t) {
    case StDType::kF32:
      return "F32";
    case StDType::kBF16:
      return "BF16";
    case StDType::kI32:
      return "I32";
    case StDType::kOther:
      break;
  }
  return "?";
}

StDType parse_dtype(const std::string& s) {
  if (s == "F32") return StDType::kF32;
  if (s == "BF16") return StDType::kBF16;
  if (s == "I32") return StDType::kI32;
  return StDType::kOther;
}

// A JSON number that must be a non-negative integer below 2^53.
uint64_t as_index(const google::protobuf::Value& v, const std::string& path, const std::string& what) {
  const double d = v.number_value();
  MOE_CHECK(v.kind_case() == google::protobuf::Value::kNumberValue && d >= 0 && d <= 9007199254740992.0 &&
                std::floor(d) == d,
            path, ": bad header: ", what, " is not a non-negative integer");
  return static_cast<uint64_t>(d);
}

std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

SafetensorsReader::SafetensorsReader(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  MOE_CHECK(fd_ >= 0, path, ": cannot open: ", std::strerror(errno));
  try {
    struct stat st {};
    MOE_CHECK(::fstat(fd_, &st) == 0, path, ": cannot stat: ", std::strerror(errno));
    MOE_CHECK(!S_ISDIR(st.st_mode), path, ": is a folder, not a safetensors file");
    const uint64_t file_size = static_cast<uint64_t>(st.st_size);
    MOE_CHECK(file_size >= 8, path, ": truncated: ", file_size, " bytes, shorter than the 8-byte header length");
    uint8_t len[8];
    read_at(len, 8, 0, "the header length");
    uint64_t header_len = 0;
    for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len[i];
    MOE_CHECK(header_len <= kMaxHeaderBytes, path, ": bad header: length ", header_len,
              " exceeds the format limit of ", kMaxHeaderBytes);
    MOE_CHECK(header_len <= file_size - 8, path, ": truncated: header of ", header_len, " bytes but only ",
              file_size - 8, " follow the length");
    std::string text(header_len, '\0');
    read_at(text.data(), header_len, 8, "the header");
    data_offset_ = 8 + header_len;
    parse_header(text, file_size - data_offset_);
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

void SafetensorsReader::parse_header(const std::string& text, uint64_t data_size) {
  const std::string& path = path_;
  google::protobuf::Struct header;
  const auto status = google::protobuf::util::JsonStringToMessage(text, &header);
  MOE_CHECK(status.ok(), path, ": bad header: not a JSON object (", status.message().as_string(), ")");
  for (const auto& [name, value] : header.fields()) {
    if (name == "__metadata__") {
      MOE_CHECK(value.has_struct_value(), path, ": bad header: __metadata__ is not an object");
      for (const auto& [k, v] : value.struct_value().fields()) {
        MOE_CHECK(v.kind_case() == google::protobuf::Value::kStringValue, path,
                  ": bad header: __metadata__[", k, "] is not a string");
        metadata_[k] = v.string_value();
      }
      continue;
    }
    MOE_CHECK(value.has_struct_value(), path, ": bad header: entry '", name, "' is not an object");
    const auto& f = value.struct_value().fields();
    const auto dt = f.find("dtype"), sh = f.find("shape"), off = f.find("data_offsets");
    MOE_CHECK(dt != f.end() && dt->second.kind_case() == google::protobuf::Value::kStringValue, path,
              ": bad header: tensor '", name, "' has no dtype string");
    MOE_CHECK(sh != f.end() && sh->second.has_list_value(), path, ": bad header: tensor '", name,
              "' has no shape list");
    MOE_CHECK(off != f.end() && off->second.has_list_value() && off->second.list_value().values_size() == 2,
              path, ": bad header: tensor '", name, "' needs data_offsets [begin, end]");
    TensorInfo t;
    t.name = name;
    t.dtype_name = dt->second.string_value();
    t.dtype = parse_dtype(t.dtype_name);
    for (const auto& d : sh->second.list_value().values())
      t.shape.push_back(static_cast<int64_t>(as_index(d, path, "a dimension of '" + name + "'")));
    t.begin = as_index(off->second.list_value().values(0), path, "data_offsets of '" + name + "'");
    t.end = as_index(off->second.list_value().values(1), path, "data_offsets of '" + name + "'");
    MOE_CHECK(t.begin <= t.end, path, ": bad header: tensor '", name, "' has data_offsets [", t.begin, ", ",
              t.end, "] out of order");
    MOE_CHECK(t.end <= data_size, path, ": truncated: tensor '", name, "' ends at data byte ", t.end,
              " but the file has ", data_size, " data bytes");
    if (t.dtype != StDType::kOther)
      MOE_CHECK(t.end - t.begin == static_cast<uint64_t>(t.numel()) * dtype_size(t.dtype), path,
                ": bad header: tensor '", name, "' of shape ", shape_str(t.shape), " and dtype ", t.dtype_name,
                " needs ", t.numel() * dtype_size(t.dtype), " bytes, offsets give ", t.end - t.begin);
    tensors_.emplace(name, std::move(t));
  }
}

SafetensorsReader::~SafetensorsReader() { ::close(fd_); }

void SafetensorsReader::read_at(void* dst, uint64_t n, uint64_t offset, const std::string& what) const {
  auto* p = static_cast<uint8_t*>(dst);
  uint64_t done = 0;
  while (done < n) {
    const ssize_t got = ::pread(fd_, p + done, n - done, static_cast<off_t>(offset + done));
    if (got < 0 && errno == EINTR) continue;
    MOE_CHECK(got >= 0, path_, ": cannot read ", what, ": ", std::strerror(errno));
    MOE_CHECK(got > 0, path_, ": truncated: the file ended while reading ", what);
    done += static_cast<uint64_t>(got);
  }
  bytes_read_ += n;
}

const TensorInfo& SafetensorsReader::info(const std::string& name) const {
  const auto it = tensors_.find(name);
  MOE_CHECK(it != tensors_.end(), path_, ": missing tensor '", name, "'");
  return it->second;
}

std::vector<std::string> SafetensorsReader::names() const {
  std::vector<std::string> out;
  for (const auto& [name, info] : tensors_) out.push_back(name);
  return out;
}

const TensorInfo& SafetensorsReader::checked(const std::string& name,
                                             const std::vector<int64_t>& shape) const {
  const TensorInfo& t = info(name);
  MOE_CHECK(t.shape == shape, path_, ": tensor '", name, "' has shape ", shape_str(t.shape),
            ", expected ", shape_str(shape));
  return t;
}

std::vector<float> SafetensorsReader::read_f32(const std::string& name,
                                               const std::vector<int64_t>& shape) const {
  const TensorInfo& t = checked(name, shape);
  MOE_CHECK(t.dtype == StDType::kF32 || t.dtype == StDType::kBF16, path_, ": tensor '", name, "' has dtype ",
            t.dtype_name, "; expected F32 or BF16");
  std::vector<float> out(t.numel());
  const std::string what = "tensor '" + name + "'";
  if (t.dtype == StDType::kF32) {
    read_at(out.data(), t.end - t.begin, data_offset_ + t.begin, what);
    return out;
  }
  std::vector<kernels::bf16_t> raw(out.size());
  read_at(raw.data(), t.end - t.begin, data_offset_ + t.begin, what);
  for (size_t i = 0; i < out.size(); ++i) out[i] = kernels::bf16_to_f32(raw[i]);
  return out;
}

std::vector<int32_t> SafetensorsReader::read_i32(const std::string& name,
                                                 const std::vector<int64_t>& shape) const {
  const TensorInfo& t = checked(name, shape);
  MOE_CHECK(t.dtype == StDType::kI32, path_, ": tensor '", name, "' has dtype ", t.dtype_name,
            "; expected I32");
  std::vector<int32_t> out(t.numel());
  read_at(out.data(), t.end - t.begin, data_offset_ + t.begin, "tensor '" + name + "'");
  return out;
}

void SafetensorsWriter::add(Entry e) {
  for (const auto& x : entries_)
    MOE_CHECK(x.name != e.name, "safetensors writer: tensor '", e.name, "' added twice");
  MOE_CHECK(e.name != "__metadata__", "safetensors writer: '__metadata__' is reserved");
  entries_.push_back(std::move(e));
}

void SafetensorsWriter::add_f32(const std::string& name, const std::vector<int64_t>& shape,
                                const float* data, StDType stored) {
  MOE_CHECK(stored == StDType::kF32 || stored == StDType::kBF16,
            "safetensors writer: fp32 data is stored as F32 or BF16");
  Entry e{name, stored, shape, {}};
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  e.bytes.resize(n * dtype_size(stored));
  if (stored == StDType::kF32) {
    if (n) std::memcpy(e.bytes.data(), data, 4 * n);
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const kernels::bf16_t v = kernels::f32_to_bf16(data[i]);
      std::memcpy(e.bytes.data() + 2 * i, &v, 2);
    }
  }
  add(std::move(e));
}

void SafetensorsWriter::add_i32(const std::string& name, const std::vector<int64_t>& shape,
                                const int32_t* data) {
  add_raw(name, StDType::kI32, shape, data);
}

void SafetensorsWriter::add_raw(const std::string& name, StDType dtype,
                                const std::vector<int64_t>& shape, const void* data) {
  MOE_CHECK(dtype != StDType::kOther, "safetensors writer: tensor '", name, "' has no dtype");
  Entry e{name, dtype, shape, {}};
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  e.bytes.resize(n * dtype_size(dtype));
  if (n) std::memcpy(e.bytes.data(), data, e.bytes.size());
  add(std::move(e));
}

void SafetensorsWriter::write(const std::string& path) const {
  std::string header = "{";
  bool first = true;
  if (!metadata_.empty()) {
    header += "\"__metadata__\":{";
    bool f2 = true;
    for (const auto& [k, v] : metadata_) {
      header += (f2 ? "" : ",") + ("\"" + json_escape(k) + "\":\"" + json_escape(v) + "\"");
      f2 = false;
    }
    header += "}";
    first = false;
  }
  uint64_t offset = 0;
  for (const auto& e : entries_) {
    header += first ? "" : ",";
    first = false;
    header += "\"" + json_escape(e.name) + "\":{\"dtype\":\"" + dtype_str(e.dtype) + "\",\"shape\":[";
    for (size_t i = 0; i < e.shape.size(); ++i) header += (i ? "," : "") + std::to_string(e.shape[i]);
    header += "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(offset + e.bytes.size()) + "]}";
    offset += e.bytes.size();
  }
  header += "}";
  while (header.size() % 8 != 0) header += ' ';  // data section 8-byte aligned

  // Whole or not at all (write, fsync, rename): dumps and checkpoints survive a crash.
  std::string bytes(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>(n >> (8 * i));
  bytes += header;
  for (const auto& e : entries_) bytes.append(reinterpret_cast<const char*>(e.bytes.data()), e.bytes.size());
  write_file_atomically(path, bytes);
}

}  // namespace moe::io
