#include "moe/ctl/json.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include <charconv>
#include <cmath>
#include <sstream>

#include "moe/base/check.h"

namespace moe::ctl {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

// "JobState" -> "JOB_STATE_".
std::string enum_prefix(const google::protobuf::EnumDescriptor& e) {
  std::string out;
  for (size_t i = 0; i < e.name().size(); ++i) {
    const char c = e.name()[i];
    if (i > 0 && std::isupper(static_cast<unsigned char>(c))) out += '_';
    out += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  }
  return out + "_";
}

void put_string(std::ostream& out, const std::string& s) {
  out << '"';
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': out << "\\\""; break;
      case '\\': out << "\\\\"; break;
      case '\n': out << "\\n"; break;
      case '\t': out << "\\t"; break;
      case '\r': out << "\\r"; break;
      default:
        if (c < 0x20) {
          static const char* hex = "0123456789abcdef";
          out << "\\u00" << hex[c >> 4] << hex[c & 15];
        } else {
          out << ch;
        }
    }
  }
  out << '"';
}

void put_double(std::ostream& out, double v) {
  if (!std::isfinite(v)) {
    out << "null";
    return;
  }
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);  // shortest that reads back the same
  out.write(buf, r.ptr - buf);
}

std::string base64(const std::string& bytes) {
  static const char* a = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  size_t i = 0;
  for (; i + 2 < bytes.size(); i += 3) {
    const uint32_t n = (uint8_t(bytes[i]) << 16) | (uint8_t(bytes[i + 1]) << 8) | uint8_t(bytes[i + 2]);
    out += {a[n >> 18], a[(n >> 12) & 63], a[(n >> 6) & 63], a[n & 63]};
  }
  if (i + 1 == bytes.size()) {
    const uint32_t n = uint8_t(bytes[i]) << 16;
    out += {a[n >> 18], a[(n >> 12) & 63], '=', '='};
  } else if (i + 2 == bytes.size()) {
    const uint32_t n = (uint8_t(bytes[i]) << 16) | (uint8_t(bytes[i + 1]) << 8);
    out += {a[n >> 18], a[(n >> 12) & 63], a[(n >> 6) & 63], '='};
  }
  return out;
}

void put_message(std::ostream& out, const Message& m, int indent);

// Compact output (one line, JSON Lines) for streams; set per to_json call.
thread_local bool compact = false;

std::string newline() { return compact ? "" : "\n"; }
std::string pad_of(int indent) { return compact ? "" : std::string(indent, ' '); }

// One value of a field: the field's only value, or element `index` of a repeated one.
void put_value(std::ostream& out, const Message& m, const FieldDescriptor& f, int index, int indent) {
  const Reflection& r = *m.GetReflection();
  const bool rep = f.is_repeated();
  switch (f.cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32: out << (rep ? r.GetRepeatedInt32(m, &f, index) : r.GetInt32(m, &f)); break;
    case FieldDescriptor::CPPTYPE_INT64: out << (rep ? r.GetRepeatedInt64(m, &f, index) : r.GetInt64(m, &f)); break;
    case FieldDescriptor::CPPTYPE_UINT32: out << (rep ? r.GetRepeatedUInt32(m, &f, index) : r.GetUInt32(m, &f)); break;
    case FieldDescriptor::CPPTYPE_UINT64: out << (rep ? r.GetRepeatedUInt64(m, &f, index) : r.GetUInt64(m, &f)); break;
    case FieldDescriptor::CPPTYPE_DOUBLE: put_double(out, rep ? r.GetRepeatedDouble(m, &f, index) : r.GetDouble(m, &f)); break;
    case FieldDescriptor::CPPTYPE_FLOAT: put_double(out, rep ? r.GetRepeatedFloat(m, &f, index) : r.GetFloat(m, &f)); break;
    case FieldDescriptor::CPPTYPE_BOOL: out << ((rep ? r.GetRepeatedBool(m, &f, index) : r.GetBool(m, &f)) ? "true" : "false"); break;
    case FieldDescriptor::CPPTYPE_ENUM: {
      const int number = rep ? r.GetRepeatedEnumValue(m, &f, index) : r.GetEnumValue(m, &f);
      const auto* v = f.enum_type()->FindValueByNumber(number);
      if (v) put_string(out, short_enum_name(*v));
      else out << number;
      break;
    }
    case FieldDescriptor::CPPTYPE_STRING: {
      const std::string s = rep ? r.GetRepeatedString(m, &f, index) : r.GetString(m, &f);
      put_string(out, f.type() == FieldDescriptor::TYPE_BYTES ? base64(s) : s);
      break;
    }
    case FieldDescriptor::CPPTYPE_MESSAGE:
      put_message(out, rep ? r.GetRepeatedMessage(m, &f, index) : r.GetMessage(m, &f), indent);
      break;
  }
}

// A map field: an object keyed by the entries' keys, in key order as stored.
void put_map(std::ostream& out, const Message& m, const FieldDescriptor& f, int indent) {
  const Reflection& r = *m.GetReflection();
  const int n = r.FieldSize(m, &f);
  if (n == 0) {
    out << "{}";
    return;
  }
  const std::string pad = pad_of(indent + 2);
  out << "{" << newline();
  for (int i = 0; i < n; ++i) {
    const Message& entry = r.GetRepeatedMessage(m, &f, i);
    const FieldDescriptor& key = *entry.GetDescriptor()->map_key();
    const FieldDescriptor& value = *entry.GetDescriptor()->map_value();
    std::ostringstream k;
    put_value(k, entry, key, -1, 0);
    std::string ks = k.str();
    if (ks.empty() || ks[0] != '"') ks = "\"" + ks + "\"";  // JSON keys are strings
    out << pad << ks << ": ";
    put_value(out, entry, value, -1, indent + 2);
    out << (i + 1 < n ? "," : "") << newline();
  }
  out << pad_of(indent) << "}";
}

// Which fields print: set ones, and zero values of fields without presence.
bool printed(const Message& m, const FieldDescriptor& f) {
  if (f.is_repeated()) return true;
  if (f.has_presence()) return m.GetReflection()->HasField(m, &f);
  return true;
}

void put_message(std::ostream& out, const Message& m, int indent) {
  const Descriptor& d = *m.GetDescriptor();
  const Reflection& r = *m.GetReflection();
  std::vector<const FieldDescriptor*> fields;
  for (int i = 0; i < d.field_count(); ++i)
    if (printed(m, *d.field(i))) fields.push_back(d.field(i));
  if (fields.empty()) {
    out << "{}";
    return;
  }
  const std::string pad = pad_of(indent + 2);
  out << "{" << newline();
  for (size_t i = 0; i < fields.size(); ++i) {
    const FieldDescriptor& f = *fields[i];
    out << pad;
    put_string(out, f.name());
    out << ": ";
    if (f.is_map()) {
      put_map(out, m, f, indent + 2);
    } else if (f.is_repeated()) {
      const int n = r.FieldSize(m, &f);
      const bool scalar = f.cpp_type() != FieldDescriptor::CPPTYPE_MESSAGE;
      out << "[";
      for (int j = 0; j < n; ++j) {
        if (scalar) out << (j ? ", " : "");
        else out << (j ? "," : "") << newline() << pad_of(indent + 4);
        put_value(out, m, f, j, indent + 4);
      }
      if (!scalar && n > 0) out << newline() << pad;
      out << "]";
    } else {
      put_value(out, m, f, -1, indent + 2);
    }
    out << (i + 1 < fields.size() ? "," : "") << newline();
  }
  out << pad_of(indent) << "}";
}

void lengthen_enums(const Descriptor& d, google::protobuf::Struct& s);

// An enum's short name back to its .proto name, inside one JSON value of field f.
void lengthen_value(const FieldDescriptor& f, google::protobuf::Value& v) {
  if (f.cpp_type() == FieldDescriptor::CPPTYPE_ENUM && v.has_string_value()) {
    const auto& e = *f.enum_type();
    if (!e.FindValueByName(v.string_value()) && e.FindValueByName(enum_prefix(e) + v.string_value()))
      v.set_string_value(enum_prefix(e) + v.string_value());
  } else if (f.cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE && v.has_struct_value()) {
    lengthen_enums(*f.message_type(), *v.mutable_struct_value());
  }
}

void lengthen_enums(const Descriptor& d, google::protobuf::Struct& s) {
  for (auto& [key, value] : *s.mutable_fields()) {
    const FieldDescriptor* f = d.FindFieldByName(key);
    if (!f) f = d.FindFieldByCamelcaseName(key);
    if (!f) continue;  // the parser names it
    if (f->is_map() && value.has_struct_value()) {
      for (auto& [k, entry] : *value.mutable_struct_value()->mutable_fields())
        lengthen_value(*f->message_type()->map_value(), entry);
    } else if (f->is_repeated() && value.has_list_value()) {
      for (auto& item : *value.mutable_list_value()->mutable_values()) lengthen_value(*f, item);
    } else {
      lengthen_value(*f, value);
    }
  }
}

}  // namespace

std::string short_enum_name(const google::protobuf::EnumValueDescriptor& v) {
  const std::string prefix = enum_prefix(*v.type());
  return v.name().rfind(prefix, 0) == 0 && v.name().size() > prefix.size() ? v.name().substr(prefix.size()) : v.name();
}

std::string to_json(const Message& m, bool one_line) {
  compact = one_line;
  std::ostringstream out;
  put_message(out, m, 0);
  return out.str();
}

void from_json(const std::string& json, Message& m) {
  google::protobuf::Struct s;
  if (!google::protobuf::util::JsonStringToMessage(json, &s).ok())
    throw moe::InvalidArgument("not a JSON object: " + json.substr(0, 80));
  lengthen_enums(*m.GetDescriptor(), s);
  std::string full;
  if (!google::protobuf::util::MessageToJsonString(s, &full).ok()) throw moe::InvalidArgument("unprintable JSON");
  const auto st = google::protobuf::util::JsonStringToMessage(full, &m);
  if (!st.ok()) throw moe::InvalidArgument(m.GetDescriptor()->name() + ": " + std::string(st.message()));
}

}  // namespace moe::ctl
