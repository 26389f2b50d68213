#include "moe/spec/strict_json.h"

#include <cctype>
#include <cstdlib>
#include <set>

#include "moe/base/check.h"

namespace moe::spec {

std::string TextPosition::text() const {
  return "line " + std::to_string(line) + ", column " + std::to_string(column);
}

namespace {

constexpr int kMaxDepth = 64;

// A recursive-descent reader over the text; each read_* consumes one
// production and throws naming where the text broke the grammar.
class Reader {
 public:
  explicit Reader(const std::string& text) : s_(text) {}

  std::vector<JsonMember> top_object() {
    skip_space();
    if (peek() != '{') fail("a spec is a JSON object: expected '{'" + found());
    std::vector<JsonMember> members;
    read_object(0, &members);
    skip_space();
    if (i_ < s_.size()) fail("text after the end of the object" + found());
    return members;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const { throw moe::InvalidArgument(at(i_).text() + ": " + what); }

  // Where byte `index` is; walks on from the last answer (members come in order).
  TextPosition at(size_t index) const {
    if (index < walked_) walked_ = 0, walked_at_ = TextPosition{};
    for (; walked_ < index && walked_ < s_.size(); ++walked_) {
      if (s_[walked_] == '\n') {
        ++walked_at_.line;
        walked_at_.column = 1;
      } else {
        ++walked_at_.column;
      }
    }
    return walked_at_;
  }

  char peek() const { return i_ < s_.size() ? s_[i_] : '\0'; }
  std::string found() const {
    if (i_ >= s_.size()) return ", found the end of the text";
    const unsigned char c = static_cast<unsigned char>(s_[i_]);
    return std::isprint(c) ? std::string(", found '") + s_[i_] + "'" : ", found byte " + std::to_string(c);
  }

  void skip_space() {
    while (i_ < s_.size()) {
      const char c = s_[i_];
      if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
        ++i_;
      } else if (c == '/' && i_ + 1 < s_.size() && (s_[i_ + 1] == '/' || s_[i_ + 1] == '*')) {
        fail("JSON has no comments");
      } else {
        return;
      }
    }
  }

  void expect(char c, const char* what) {
    skip_space();
    if (peek() != c) fail(std::string("expected ") + what + found());
    ++i_;
  }

  // Reads any value; fills `m`'s kind and value when given (a top-level member).
  void read_value(int depth, JsonMember* m) {
    skip_space();
    const char c = peek();
    char kind = 0;
    std::string text;
    if (c == '{') {
      kind = 'o', read_object(depth + 1, nullptr);
    } else if (c == '[') {
      kind = 'a', read_array(depth + 1);
    } else if (c == '"') {
      kind = 's', text = read_string();
    } else if (c == '-' || std::isdigit(static_cast<unsigned char>(c))) {
      kind = 'n', text = read_number();
    } else if (word("true") || word("false")) {
      kind = 'b', text = s_.substr(i_, c == 't' ? 4 : 5), i_ += text.size();
    } else if (word("null")) {
      kind = 'z', i_ += 4;
    } else {
      fail("expected a value (string, number, true, false, null, object or array)" + found());
    }
    if (m) m->kind = kind, m->value = text;
  }

  bool word(const char* w) const { return s_.compare(i_, std::char_traits<char>::length(w), w) == 0; }

  // The items of an object or array after its opening character, each read by
  // `item`, separated by commas, up to `close`: no trailing comma.
  template <typename Item>
  void read_list(char close, Item item) {
    skip_space();
    if (peek() == close) {
      ++i_;
      return;
    }
    for (;;) {
      skip_space();
      if (peek() == close) fail(std::string("a trailing comma before '") + close + "'");
      item();
      skip_space();
      if (peek() != ',' && peek() != close) fail(std::string("expected ',' or '") + close + "'" + found());
      if (s_[i_++] == close) return;
    }
  }

  void read_object(int depth, std::vector<JsonMember>* members) {
    if (depth > kMaxDepth) fail("nested deeper than " + std::to_string(kMaxDepth));
    ++i_;  // '{'
    std::set<std::string> keys;
    read_list('}', [&] {
      if (peek() != '"') fail("expected a key in double quotes" + found());
      JsonMember m;
      const size_t key_start = i_;
      m.key = read_string();
      if (!keys.insert(m.key).second) {
        i_ = key_start;
        fail("duplicate key \"" + m.key + "\" (each field once)");
      }
      expect(':', "':' after the key");
      skip_space();
      if (members) m.key_at = at(key_start), m.value_at = at(i_);  // the top level's only
      m.value_offset = i_;
      read_value(depth, members ? &m : nullptr);
      m.value_size = i_ - m.value_offset;
      if (members) members->push_back(std::move(m));
    });
  }

  void read_array(int depth) {
    if (depth > kMaxDepth) fail("nested deeper than " + std::to_string(kMaxDepth));
    ++i_;  // '['
    read_list(']', [&] { read_value(depth, nullptr); });
  }

  // A string's contents with the escapes undone (\uXXXX as UTF-8, pairs joined).
  std::string read_string() {
    ++i_;  // '"'
    std::string out;
    for (;;) {
      if (i_ >= s_.size()) fail("a string without its closing '\"'");
      const char c = s_[i_];
      if (c == '"') {
        ++i_;
        return out;
      }
      if (static_cast<unsigned char>(c) < 0x20) fail("a control character inside a string (escape it)");
      if (c != '\\') {
        out += c, ++i_;
        continue;
      }
      ++i_;
      const char e = peek();
      static const std::string simple = "\"\\/bfnrt", meaning = "\"\\/\b\f\n\r\t";
      if (const size_t k = simple.find(e); e != '\0' && k != std::string::npos) {
        out += meaning[k], ++i_;
      } else if (e == 'u') {
        append_utf8(out, read_code_point());
      } else {
        fail("an unknown escape in a string" + found());
      }
    }
  }

  unsigned hex4() {
    ++i_;  // 'u'
    unsigned v = 0;
    for (int k = 0; k < 4; ++k, ++i_) {
      const char h = peek();
      if (!std::isxdigit(static_cast<unsigned char>(h))) fail("\\u needs four hex digits" + found());
      v = v * 16 + static_cast<unsigned>(std::isdigit(static_cast<unsigned char>(h)) ? h - '0' : (std::tolower(h) - 'a' + 10));
    }
    return v;
  }

  // A \uXXXX escape (i_ at the 'u'); a pair of surrogates joined, a lone one U+FFFD.
  unsigned read_code_point() {
    const unsigned hi = hex4();
    if (hi >= 0xDC00 && hi <= 0xDFFF) return 0xFFFD;  // a low surrogate alone
    if (hi < 0xD800 || hi > 0xDBFF) return hi;
    if (!word("\\u")) return 0xFFFD;  // a high surrogate alone
    const size_t second = i_;
    ++i_;
    const unsigned lo = hex4();
    if (lo >= 0xDC00 && lo <= 0xDFFF) return 0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00);
    i_ = second;  // not its pair: that escape is read on its own
    return 0xFFFD;
  }

  static void append_utf8(std::string& out, unsigned cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6)), out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12)), out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18)), out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F)), out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  // -?(0|[1-9]d*)(.d+)?([eE][+-]?d+)?
  std::string read_number() {
    const size_t start = i_;
    auto digits = [&] {
      const size_t from = i_;
      while (std::isdigit(static_cast<unsigned char>(peek()))) ++i_;
      return i_ > from;
    };
    if (peek() == '-') ++i_;
    if (peek() == '0') {
      ++i_;
      if (std::isdigit(static_cast<unsigned char>(peek()))) fail("a number with a leading zero");
    } else if (!digits()) {
      fail("expected a digit" + found());
    }
    if (peek() == '.') {
      ++i_;
      if (!digits()) fail("expected a digit after '.'" + found());
    }
    if (peek() == 'e' || peek() == 'E') {
      ++i_;
      if (peek() == '+' || peek() == '-') ++i_;
      if (!digits()) fail("expected a digit in the exponent" + found());
    }
    return s_.substr(start, i_ - start);
  }

  const std::string& s_;
  size_t i_ = 0;
  mutable size_t walked_ = 0;  // at()'s cursor
  mutable TextPosition walked_at_;
};

}  // namespace

std::vector<JsonMember> strict_json_object(const std::string& text) { return Reader(text).top_object(); }

}  // namespace moe::spec
