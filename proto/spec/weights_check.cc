#include "moe/spec/weights_check.h"

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "moe/base/check.h"
#include "moe/base/text.h"
#include "moe/spec/strict_json.h"

namespace moe::spec {
namespace {

namespace fs = std::filesystem;

// A safetensors header is JSON of at most this many bytes (the format's own bound).
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

[[noreturn]] void refuse(const std::string& why) { throw moe::InvalidArgument("weights: " + why); }

// The members of a JSON object text, a refusal naming `file` when it is not one.
std::vector<JsonMember> members_of(const std::string& text, const std::string& file) {
  try {
    return strict_json_object(text);
  } catch (const moe::InvalidArgument& e) {
    refuse(file + ": not valid JSON: " + e.what());
  }
}

// tensor name -> its header entry's text, from a safetensors file's header.
std::map<std::string, std::string> safetensors_header(const std::string& file) {
  std::error_code ec;
  if (!fs::is_regular_file(file, ec)) refuse(file + " is not a regular file");  // a FIFO would block the agent
  std::ifstream in(file, std::ios::binary);
  if (!in) refuse("cannot read " + file);
  unsigned char size_bytes[8];
  if (!in.read(reinterpret_cast<char*>(size_bytes), 8)) refuse(file + " is not a safetensors file (shorter than 8 bytes)");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | size_bytes[i];
  const uint64_t file_size = fs::file_size(file, ec);
  if (ec) refuse("cannot read " + file + ": " + ec.message());
  if (n == 0 || n > kMaxHeaderBytes || n > file_size - 8)
    refuse(file + " is not a safetensors file (header size " + std::to_string(n) + " of a " +
           std::to_string(file_size) + "-byte file)");
  std::string header(n, '\0');
  if (!in.read(header.data(), static_cast<std::streamsize>(n))) refuse("cannot read the header of " + file);
  std::map<std::string, std::string> out;
  for (const JsonMember& m : members_of(header, file))
    if (m.key != "__metadata__") out[m.key] = header.substr(m.value_offset, m.value_size);
  return out;
}

// The dims of an entry's "shape": [8, 64] -> {8, 64}.
std::vector<int64_t> shape_of(const std::string& entry, const std::string& file) {
  std::vector<int64_t> dims;
  for (const JsonMember& m : members_of(entry, file)) {
    if (m.key != "shape" || m.kind != 'a') continue;
    const std::string list = entry.substr(m.value_offset + 1, m.value_size - 2);
    for (size_t at = 0; at < list.size();) {
      const size_t comma = std::min(list.find(',', at), list.size());
      dims.push_back(std::strtoll(list.substr(at, comma - at).c_str(), nullptr, 10));
      at = comma + 1;
    }
  }
  return dims;
}

// What the agent reads of a checkpoint: the tensor names, each with the file
// that holds it (an index's shards are opened only for the tensors asked about).
struct TensorList {
  std::map<std::string, std::string> file_of;  // tensor -> file
  std::string describe;                        // the path as the messages name it
};

TensorList list_index(const fs::path& index) {
  std::string text;
  std::error_code ec;
  if (!fs::is_regular_file(index, ec)) refuse(index.string() + " is not a regular file");
  {
    std::ifstream in(index);
    if (!in) refuse("cannot read " + index.string());
    text.assign(std::istreambuf_iterator<char>(in), {});
  }
  TensorList t{{}, index.string()};
  for (const JsonMember& m : members_of(text, index.string())) {
    if (m.key != "weight_map") continue;
    if (m.kind != 'o') refuse(index.string() + ": weight_map is not an object");
    for (const JsonMember& w : members_of(text.substr(m.value_offset, m.value_size), index.string())) {
      // A shard is a file of the index's own folder (the daemons refuse a path too).
      if (w.kind != 's' || w.value.empty() || w.value.find('/') != std::string::npos || w.value == "." ||
          w.value == "..")
        refuse(index.string() + ": weight_map[\"" + w.key + "\"] is not a file name in the index's folder");
      t.file_of[w.key] = (index.parent_path() / w.value).string();
    }
  }
  if (t.file_of.empty()) refuse(index.string() + " has no weight_map (a Hugging Face model.safetensors.index.json has one)");
  return t;
}

TensorList list_tensors(const std::string& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) refuse(path + " does not exist (the agent reads it at submit, the nodes as they load)");
  fs::path p = path;
  if (fs::is_directory(p, ec)) {
    if (fs::exists(p / "model.safetensors.index.json", ec)) return list_index(p / "model.safetensors.index.json");
    if (!fs::exists(p / "model.safetensors", ec))
      refuse(path + " is a folder without model.safetensors.index.json or model.safetensors");
    p /= "model.safetensors";
  }
  if (p.extension() == ".json") return list_index(p);
  TensorList t{{}, p.string()};
  for (const auto& [name, entry] : safetensors_header(p.string())) t.file_of[name] = p.string();
  return t;
}

// "layers 0-1" / "no layer": what the router tensors present say, for messages.
std::string layers_present(const TensorList& t, const v1::JobSpec& s) {
  const std::string key = "{layer}";
  const size_t at = s.weights_prefix().find(key);
  if (at == std::string::npos) return "";
  const std::string head = s.weights_prefix().substr(0, at);
  const std::string tail = s.weights_prefix().substr(at + key.size()) + "gate.weight";
  std::set<int> layers;
  for (const auto& [name, file] : t.file_of) {
    if (name.rfind(head, 0) != 0 || name.size() <= head.size() + tail.size()) continue;
    if (name.compare(name.size() - tail.size(), tail.size(), tail) != 0) continue;
    const std::string mid = name.substr(head.size(), name.size() - head.size() - tail.size());
    if (!mid.empty() && mid.find_first_not_of("0123456789") == std::string::npos) layers.insert(std::atoi(mid.c_str()));
  }
  if (layers.empty()) return " (it has no router named " + head + "{layer}" + tail + ")";
  return " (it has the routers of checkpoint layers " + std::to_string(*layers.begin()) + "-" +
         std::to_string(*layers.rbegin()) + ")";
}

}  // namespace

std::string checkpoint_prefix(const v1::JobSpec& s, int layer) {
  return replace_all(s.weights_prefix(), "{layer}", std::to_string(s.weights_first_layer() + layer));
}

void check_weights(const v1::JobSpec& s) {
  if (s.weights().empty()) return;
  const TensorList t = list_tensors(s.weights());
  std::map<std::string, std::map<std::string, std::string>> headers;  // by file, each read once
  const int layers = std::max(1, s.layers());
  for (int l = 0; l < layers; ++l) {
    const std::string router = checkpoint_prefix(s, l) + "gate.weight";
    const auto it = t.file_of.find(router);
    if (it == t.file_of.end())
      refuse("job layer " + std::to_string(l) + " reads " + router + ", which " + t.describe + " does not hold" +
             layers_present(t, s) + "; check --layers, --weights-prefix and --weights-first-layer");
    auto [cached, fresh] = headers.try_emplace(it->second);
    if (fresh) cached->second = safetensors_header(it->second);
    const auto& header = cached->second;
    const auto entry = header.find(router);
    if (entry == header.end()) refuse(it->second + " does not hold " + router + ", which the index places there");
    const std::vector<int64_t> shape = shape_of(entry->second, it->second);
    if (shape != std::vector<int64_t>{s.experts(), s.hidden()}) {
      std::string dims;
      for (int64_t d : shape) dims += (dims.empty() ? "" : ", ") + std::to_string(d);
      refuse("tensor '" + router + "' in " + it->second + " has shape [" + dims + "], the spec gives [" +
             std::to_string(s.experts()) + ", " + std::to_string(s.hidden()) + "]: experts is " +
             std::to_string(s.experts()) + ", hidden is " + std::to_string(s.hidden()));
    }
  }
}

}  // namespace moe::spec
