// A JSON text read strictly (RFC 8259), for files people write by hand: no
// trailing commas, no comments, no duplicate keys at any depth, one value and
// nothing after it. protobuf's JSON parser accepts the first two and lets the
// last duplicate win; a spec file read through this says where it went wrong.
#pragma once

#include <string>
#include <vector>

namespace moe::spec {

// Where a character of the text is, 1-based, for messages: "line 3, column 14".
struct TextPosition {
  int line = 1;
  int column = 1;
  std::string text() const;
};

// One member of the top-level object: its key, the kind of its value
// ('s'tring, 'n'umber, 'b'oolean, 'z' null, 'o'bject, 'a'rray), the value's
// text (a string's without its quotes and escapes undone; a number's as
// written; others empty) and where key and value start.
struct JsonMember {
  std::string key;
  char kind = 0;
  std::string value;
  TextPosition key_at;
  TextPosition value_at;
  size_t value_offset = 0, value_size = 0;  // the value's bytes in the text (to read a nested one)
};

// The top-level object's members in the text's order. Throws moe::InvalidArgument
// "line L, column C: what" on the first violation, or when the text is not one
// object. Nesting deeper than 64 is refused.
std::vector<JsonMember> strict_json_object(const std::string& text);

}  // namespace moe::spec
