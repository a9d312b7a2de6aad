// fasta2a: reading plans back from "fasta2a.plan.v1" documents (DESIGN.md section 5), written by
// write_plan_json (json_writer.hpp) or by another tool. The reader walks the document once with a
// strict JSON tokenizer (RFC 8259, nothing more) and builds no tree; it rebuilds an executable plan
// and rejects any document whose hops are not the routes the library itself would take.
#pragma once

#include <array>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "fasta2a/common.hpp"
#include "fasta2a/json_writer.hpp" // plan_json_format: the reader accepts what the writer writes
#include "fasta2a/plan.hpp"

namespace fasta2a {
namespace detail {

/// What kind of JSON value stands somewhere, for the reader's checks and messages. Numbers without
/// fraction or exponent are integers (kept exactly, in 64 bits); the others are reals.
enum class json_type : std::uint8_t { null, boolean, integer, real, string, array, object };

/// "null", "a boolean", "an integer", ...: for messages.
inline const char* json_type_name(json_type t) noexcept {
  switch (t) {
  case json_type::null: return "null";
  case json_type::boolean: return "a boolean";
  case json_type::integer: return "an integer";
  case json_type::real: return "a number with a fraction or exponent";
  case json_type::string: return "a string";
  case json_type::array: return "an array";
  case json_type::object: return "an object";
  }
  return "?";
}

/// A number token: integers exactly, everything else as a double.
struct json_number_token {
  bool integer = true;
  bool negative = false;
  std::uint64_t magnitude = 0;
  double real = 0;
  std::size_t begin = 0, end = 0; ///< byte range of the token
};

/// Reads JSON (RFC 8259, nothing more: no comments, no trailing commas, no leading zeros, no NaN)
/// token by token, for the plan reader, which asks for what it expects next (a name, a string, a
/// number, a container) instead of building a tree. Errors say where and what: "JSON syntax error
/// at byte N: expected X, found Y".
class json_cursor {
public:
  explicit json_cursor(std::string_view text) noexcept : s_(text) {}

  std::string_view text() const noexcept { return s_; }
  std::size_t pos() const noexcept { return i_; }
  bool at_end() const noexcept { return i_ >= s_.size(); }
  char peek() const noexcept { return i_ < s_.size() ? s_[i_] : '\0'; }

  void skip_space() noexcept {
    while (i_ < s_.size()) {
      const char c = s_[i_];
      if (c != ' ' && c != '\n' && c != '\r' && c != '\t') break;
      ++i_;
    }
  }

  /// What stands at the current position, for messages.
  std::string found() const {
    if (at_end()) return "the end of the document";
    const auto c = static_cast<unsigned char>(s_[i_]);
    if (c >= 0x20 && c < 0x7f) return std::string("'") + static_cast<char>(c) + "'";
    static constexpr char hex[] = "0123456789abcdef";
    return std::string("byte 0x") + hex[c >> 4] + hex[c & 15];
  }

  [[noreturn]] void fail(std::string_view expected) const {
    throw error("JSON syntax error at byte " + std::to_string(i_) + ": expected " +
                std::string(expected) + ", found " + found());
  }
  [[noreturn]] void fail_at(std::size_t at, std::string_view problem) const {
    throw error("JSON syntax error at byte " + std::to_string(at) + ": " + std::string(problem));
  }

  void expect(char c, std::string_view expected) {
    if (at_end() || s_[i_] != c) fail(expected);
    ++i_;
  }

  /// The type of the value that starts here (after white space), or nullopt if none can.
  std::optional<json_type> next_type() {
    skip_space();
    switch (peek()) {
    case '{': return json_type::object;
    case '[': return json_type::array;
    case '"': return json_type::string;
    case 't': case 'f': return json_type::boolean;
    case 'n': return json_type::null;
    case '-': case '0': case '1': case '2': case '3': case '4':
    case '5': case '6': case '7': case '8': case '9': return json_type::integer; // or real: see number()
    default: return std::nullopt;
    }
  }

  /// Iterates a container whose opening bracket was consumed: true while another element or
  /// member follows (its separator consumed), false after the closing bracket.
  bool next(char close, bool& first) {
    skip_space();
    if (first) {
      first = false;
      if (peek() == close) {
        ++i_;
        return false;
      }
      return true;
    }
    if (peek() == ',') {
      ++i_;
      skip_space();
      if (peek() == close)
        fail(close == '}' ? "another member after ',' (trailing commas are not allowed)"
                          : "another value after ',' (trailing commas are not allowed)");
      return true;
    }
    if (peek() == close) {
      ++i_;
      return false;
    }
    fail(close == '}' ? "',' or '}' after an object member" : "',' or ']' after an array element");
  }

  /// A member name and its ':'.
  void name(std::string& out) {
    skip_space();
    if (peek() != '"') fail("a member name in double quotes");
    string(out);
    skip_space();
    expect(':', "':' after a member name");
  }

  /// A string, escapes decoded; UTF-8 is validated, control characters must be escaped.
  void string(std::string& out) {
    out.clear();
    const std::size_t start = i_;
    expect('"', "'\"'");
    for (;;) {
      std::size_t run = i_;
      while (run < s_.size()) {
        const auto c = static_cast<unsigned char>(s_[run]);
        if (c == '"' || c == '\\' || c < 0x20 || c >= 0x80) break;
        ++run;
      }
      out.append(s_.data() + i_, run - i_);
      i_ = run;
      if (at_end())
        fail_at(start, "unterminated string (no closing '\"' before the end of the document)");
      const auto c = static_cast<unsigned char>(s_[i_]);
      if (c == '"') {
        ++i_;
        return;
      }
      if (c == '\\') escape(out);
      else if (c < 0x20) fail_at(i_, "control character " + found() + " in a string must be escaped");
      else utf8(out);
    }
  }

  /// A number: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?. Integers must fit in 64 bits
  /// (magnitude up to 2^63 when negative); other numbers must fit in a double.
  json_number_token number() {
    json_number_token n;
    n.begin = i_;
    if (peek() == '-') {
      n.negative = true;
      ++i_;
    }
    if (!digit(peek())) fail("a digit");
    bool overflow = false;
    if (peek() == '0') {
      ++i_;
      if (digit(peek())) fail_at(n.begin, "a number must not have leading zeros");
    } else {
      while (digit(peek())) {
        const auto d = static_cast<std::uint64_t>(s_[i_] - '0');
        overflow |= __builtin_mul_overflow(n.magnitude, std::uint64_t{10}, &n.magnitude);
        overflow |= __builtin_add_overflow(n.magnitude, d, &n.magnitude);
        ++i_;
      }
    }
    if (peek() == '.') {
      n.integer = false;
      ++i_;
      if (!digit(peek())) fail("a digit after the decimal point");
      while (digit(peek())) ++i_;
    }
    if (peek() == 'e' || peek() == 'E') {
      n.integer = false;
      ++i_;
      if (peek() == '+' || peek() == '-') ++i_;
      if (!digit(peek())) fail("a digit in the exponent");
      while (digit(peek())) ++i_;
    }
    n.end = i_;
    if (n.integer) {
      if (overflow || (n.negative && n.magnitude > (std::uint64_t{1} << 63)))
        fail_at(n.begin, "integer " + token(n.begin, n.end) + " does not fit in 64 bits");
      return n;
    }
    const auto res = std::from_chars(s_.data() + n.begin, s_.data() + n.end, n.real);
    if (res.ec != std::errc{} || res.ptr != s_.data() + n.end)
      fail_at(n.begin, "number " + token(n.begin, n.end) + " is out of the range of a double");
    return n;
  }

  /// A literal (true, false, null) that must stand here.
  /// The document text from `begin` to `end`, quoted and cut short if long, for messages.
  std::string token(std::size_t begin, std::size_t end) const {
    constexpr std::size_t shown = 40;
    std::string_view t = s_.substr(begin, end - begin);
    if (t.size() <= shown) return "'" + std::string(t) + "'";
    return "'" + std::string(t.substr(0, shown)) + "...'";
  }

  /// After the top-level value: nothing but white space may follow.
  void finish() {
    skip_space();
    if (!at_end()) fail("the end of the document after the top-level value");
  }

private:
  static bool digit(char c) noexcept { return c >= '0' && c <= '9'; }

  int hex4(std::size_t at) {
    if (s_.size() - i_ < 4) fail_at(at, "a \\u escape needs four hex digits");
    int v = 0;
    for (int k = 0; k < 4; ++k) {
      const char c = s_[i_++];
      int d;
      if (c >= '0' && c <= '9') d = c - '0';
      else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
      else if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
      else fail_at(at, "a \\u escape needs four hex digits");
      v = v * 16 + d;
    }
    return v;
  }

  void escape(std::string& out) {
    const std::size_t at = i_++;
    if (at_end()) fail_at(at, "unterminated string (it ends in a '\\')");
    const char c = s_[i_++];
    switch (c) {
    case '"': out += '"'; return;
    case '\\': out += '\\'; return;
    case '/': out += '/'; return;
    case 'b': out += '\b'; return;
    case 'f': out += '\f'; return;
    case 'n': out += '\n'; return;
    case 'r': out += '\r'; return;
    case 't': out += '\t'; return;
    case 'u': break;
    default: --i_; fail_at(at, "invalid escape '\\" + std::string(1, c) + "' in a string");
    }
    std::uint32_t cp = static_cast<std::uint32_t>(hex4(at));
    if (cp >= 0xDC00 && cp <= 0xDFFF) fail_at(at, "unpaired UTF-16 surrogate in a \\u escape");
    if (cp >= 0xD800 && cp <= 0xDBFF) {
      if (s_.substr(i_, 2) != "\\u") fail_at(at, "unpaired UTF-16 surrogate in a \\u escape");
      i_ += 2;
      const auto lo = static_cast<std::uint32_t>(hex4(at));
      if (lo < 0xDC00 || lo > 0xDFFF) fail_at(at, "unpaired UTF-16 surrogate in a \\u escape");
      cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
    }
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  // One multi-byte UTF-8 sequence, checked as RFC 3629 allows: no overlong forms, no surrogates,
  // nothing past U+10FFFF.
  void utf8(std::string& out) {
    const std::size_t at = i_;
    const auto b0 = static_cast<unsigned char>(s_[i_]);
    int extra;
    unsigned char lo = 0x80, hi = 0xBF; // allowed range of the second byte
    if (b0 >= 0xC2 && b0 <= 0xDF) extra = 1;
    else if (b0 == 0xE0) extra = 2, lo = 0xA0;
    else if (b0 >= 0xE1 && b0 <= 0xEC) extra = 2;
    else if (b0 == 0xED) extra = 2, hi = 0x9F;
    else if (b0 >= 0xEE && b0 <= 0xEF) extra = 2;
    else if (b0 == 0xF0) extra = 3, lo = 0x90;
    else if (b0 >= 0xF1 && b0 <= 0xF3) extra = 3;
    else if (b0 == 0xF4) extra = 3, hi = 0x8F;
    else fail_at(at, "invalid UTF-8 in a string");
    if (s_.size() - i_ <= static_cast<std::size_t>(extra)) fail_at(at, "invalid UTF-8 in a string");
    for (int k = 1; k <= extra; ++k) {
      const auto b = static_cast<unsigned char>(s_[i_ + static_cast<std::size_t>(k)]);
      if (k == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF))
        fail_at(at, "invalid UTF-8 in a string");
    }
    out.append(s_.data() + i_, static_cast<std::size_t>(extra) + 1);
    i_ += static_cast<std::size_t>(extra) + 1;
  }

  std::string_view s_;
  std::size_t i_ = 0;
};

} // namespace detail

/// Options of read_plan_json.
struct plan_read_options {
  /// The granule the plan was made with (plan_options::granule). A document does not record it and
  /// `verify` checks the rail loads of a server pair against it, so a plan made with a granule above
  /// 1 verifies only when it is given here.
  bytes_t granule = 1;
  /// As plan_options::max_plan_bytes: a document whose plan would take more storage (its message
  /// index is ranks^2 entries whatever its length) is refused with plan_too_large.
  std::size_t max_plan_bytes = std::size_t{2} << 30;
};

namespace detail {

/// Reads a plan document in one pass with the JSON cursor (no tree: a tree of a million pieces
/// would take gigabytes), then checks it against DESIGN.md section 5 and the routes of plan::route_of.
class plan_json_reader {
public:
  plan_json_reader(std::string_view text, plan_read_options opt) : c_(text), opt_(opt) {}

  plan read() {
    if (opt_.granule == 0) throw error("plan_read_options::granule must be at least 1 byte");
    c_.skip_space();
    if (c_.at_end()) c_.fail("a JSON object (the document is empty)");
    const std::size_t start = c_.pos();
    object_or_fail({}, "the document");
    read_top(start);
    c_.finish();
    validate();
    return std::move(p_);
  }

private:
  // Where in the document a problem is: the plan object, stage i, piece i, or hop h of piece i.
  struct where {
    const char* what = nullptr; // nullptr: the plan object
    std::size_t index = 0;
    int hop = -1;
  };

  static std::string name_of(where w) {
    if (w.what == nullptr) return "the plan object";
    std::string s = std::string(w.what) + " " + std::to_string(w.index);
    if (w.hop >= 0) s += ", hop " + std::to_string(w.hop);
    return s;
  }

  [[noreturn]] static void fail(where w, const std::string& problem, std::size_t at) {
    throw error(std::string(plan_json_format) + ": " + name_of(w) + ": " + problem + " (at byte " +
                std::to_string(at) + ")");
  }

  // Appended piece by piece: GCC 12 at -O3 misreads '"\"" + std::string(f) + "\""' as an
  // overlapping memcpy (a false -Wrestrict).
  static std::string quoted(std::string_view field) {
    std::string s;
    s.reserve(field.size() + 2);
    s += '"';
    s += field;
    s += '"';
    return s;
  }

  void object_or_fail(where w, std::string_view what) { container_or_fail(w, what, json_type::object, '{'); }

  // The value here must be a container of type `want`; a value of another type is an error naming
  // `what`, anything that is not a value a syntax error.
  void container_or_fail(where w, std::string_view what, json_type want, char open) {
    const std::optional<json_type> t = c_.next_type();
    if (!t) c_.fail("a value");
    if (*t != want) {
      const std::size_t at = c_.pos();
      // A number's kind needs its token: "1.5" is not an integer.
      const json_type got = *t == json_type::integer && !c_.number().integer ? json_type::real : *t;
      fail(w, std::string(what) + " must be " + json_type_name(want) + ", found " +
                  json_type_name(got), at);
    }
    c_.expect(open, "'{'");
  }

  // An integer field in [lo, hi].
  template <class Int>
  Int integer(where w, std::string_view field, Int lo, Int hi) {
    const std::optional<json_type> t = c_.next_type();
    if (!t) c_.fail("a value");
    const std::size_t at = c_.pos();
    // Built only on failure: formatting it for every number would dominate the reading time.
    auto must = [&] {
      return "field " + quoted(field) + " must be an integer in [" + std::to_string(lo) + ", " +
             std::to_string(hi) + "], found ";
    };
    if (*t != json_type::integer) fail(w, must() + json_type_name(*t), at);
    const detail::json_number_token n = c_.number();
    if (!n.integer)
      fail(w, must() + c_.token(n.begin, n.end) + " (fractions and exponents are not allowed)", at);
    bool ok;
    Int v{};
    if (n.negative) {
      const auto neg = static_cast<std::int64_t>(std::uint64_t{0} - n.magnitude);
      ok = std::cmp_greater_equal(neg, lo) && std::cmp_less_equal(neg, hi);
      if (ok) v = static_cast<Int>(neg);
    } else {
      ok = std::cmp_greater_equal(n.magnitude, lo) && std::cmp_less_equal(n.magnitude, hi);
      if (ok) v = static_cast<Int>(n.magnitude);
    }
    if (!ok) fail(w, must() + c_.token(n.begin, n.end), at);
    return v;
  }

  std::uint64_t bytes_field(where w, std::string_view field) {
    return integer<std::uint64_t>(w, field, 0, std::numeric_limits<std::uint64_t>::max());
  }
  std::int32_t count_field(where w, std::string_view field, std::int32_t lo) {
    return integer<std::int32_t>(w, field, lo, std::numeric_limits<std::int32_t>::max());
  }

  void string_field(where w, std::string_view field, std::string& out) {
    const std::optional<json_type> t = c_.next_type();
    if (!t) c_.fail("a value");
    if (*t != json_type::string) {
      const std::size_t at = c_.pos();
      const json_type got = *t == json_type::integer && !c_.number().integer ? json_type::real : *t;
      fail(w, "field " + quoted(field) + " must be a string, found " + json_type_name(got), at);
    }
    c_.string(out);
  }

  // Reads the members of an object whose '{' was consumed: each name must be one of `fields` and
  // appear once, and all must be present but those whose bit is set in `optional`;
  // `on_field(index)` reads the value.
  template <std::size_t N, class F>
  void members(where w, std::size_t start, const std::array<std::string_view, N>& fields, F&& on_field,
               unsigned optional = 0) {
    unsigned seen = 0;
    bool first = true;
    while (c_.next('}', first)) {
      c_.skip_space();
      const std::size_t at = c_.pos();
      c_.name(name_);
      std::size_t k = 0;
      while (k < N && fields[k] != name_) ++k;
      if (k == N)
        fail(w, "unknown field " + quoted(std::string_view(name_).substr(0, 40)) +
                    expected_fields(fields), at);
      if (seen & (1u << k)) fail(w, "field " + quoted(name_) + " appears twice", at);
      seen |= 1u << k;
      on_field(k);
    }
    for (std::size_t k = 0; k < N; ++k)
      if (!(seen & (1u << k)) && !(optional & (1u << k))) fail(w, "missing field " + quoted(fields[k]), start);
  }

  template <std::size_t N>
  static std::string expected_fields(const std::array<std::string_view, N>& fields) {
    std::string s = " (expected ";
    for (std::size_t k = 0; k < N; ++k) s += (k ? ", " : "") + quoted(fields[k]);
    return s + ")";
  }

  void read_top(std::size_t start) {
    static constexpr std::array<std::string_view, 5> fields{"format", "servers", "gpus_per_server",
                                                            "stages", "pieces"};
    members(where{}, start, fields, [&](std::size_t k) {
      switch (k) {
      case 0: {
        c_.skip_space();
        const std::size_t at = c_.pos();
        string_field({}, "format", name_);
        if (name_ != plan_json_format)
          fail({}, "field \"format\" is " + c_.token(at, c_.pos()) + ", expected \"" +
                       std::string(plan_json_format) + "\"", at);
        break;
      }
      case 1: p_.servers = count_field({}, "servers", 1); break;
      case 2: p_.gpus_per_server = count_field({}, "gpus_per_server", 1); break;
      case 3: read_stages(); break;
      default: read_pieces(); break;
      }
    });
  }

  void read_stages() {
    container_or_fail({}, "field \"stages\"", json_type::array, '[');
    bool first = true;
    while (c_.next(']', first)) {
      const where w{"stage", p_.stage_weight.size()};
      c_.skip_space();
      const std::size_t start = c_.pos();
      stage_at_.push_back(start);
      object_or_fail(w, "a stage");
      // "rails" (optional): a per-rail plan's stage, each rail's weight and permutation.
      static constexpr std::array<std::string_view, 3> fields{"weight", "perm", "rails"};
      bytes_t weight = 0;
      std::size_t count = 0;
      rails_len_.push_back(no_rails);
      members(w, start, fields, [&](std::size_t k) {
        if (k == 0) {
          weight = bytes_field(w, "weight");
          return;
        }
        if (k == 2) {
          read_rails(w);
          return;
        }
        container_or_fail(w, "field \"perm\"", json_type::array, '[');
        bool f = true;
        while (c_.next(']', f)) {
          p_.stage_perm.push_back(integer<std::int32_t>(w, "perm", -1, INT32_MAX));
          ++count;
        }
      }, 1u << 2);
      p_.stage_weight.push_back(weight);
      perm_len_.push_back(count);
    }
  }

  // A stage's "rails": [{"weight", "perm"}, ...], one per rail, in rail order; kept in document
  // order (stage by stage) until validate() knows the shape.
  void read_rails(where w) {
    container_or_fail(w, "field \"rails\"", json_type::array, '[');
    std::size_t rails = 0;
    bool first = true;
    while (c_.next(']', first)) {
      c_.skip_space();
      const std::size_t start = c_.pos();
      object_or_fail(w, "an entry of \"rails\"");
      static constexpr std::array<std::string_view, 2> fields{"weight", "perm"};
      std::size_t count = 0;
      members(w, start, fields, [&](std::size_t k) {
        if (k == 0) {
          rail_weights_.push_back(bytes_field(w, "weight"));
          return;
        }
        container_or_fail(w, "field \"perm\" of a rail", json_type::array, '[');
        bool f = true;
        while (c_.next(']', f)) {
          rail_perms_.push_back(integer<std::int32_t>(w, "perm", -1, INT32_MAX));
          ++count;
        }
      });
      rail_perm_len_.push_back(count);
      ++rails;
    }
    rails_len_.back() = rails;
  }

  void read_pieces() {
    container_or_fail({}, "field \"pieces\"", json_type::array, '[');
    bool first = true;
    while (c_.next(']', first)) {
      const where w{"piece", p_.pieces.size()};
      c_.skip_space();
      const std::size_t start = c_.pos();
      piece_at_.push_back(start);
      object_or_fail(w, "a piece");
      static constexpr std::array<std::string_view, 5> fields{"src", "dst", "offset", "bytes", "hops"};
      piece pc;
      route r;
      members(w, start, fields, [&](std::size_t k) {
        switch (k) {
        case 0: pc.src = count_field(w, "src", 0); break;
        case 1: pc.dst = count_field(w, "dst", 0); break;
        case 2: pc.offset = bytes_field(w, "offset"); break;
        case 3: pc.bytes = bytes_field(w, "bytes"); break;
        default: read_hops(w, r); break;
        }
      });
      p_.pieces.push_back(pc);
      routes_.push_back(r);
    }
  }

  void read_hops(where pw, route& r) {
    container_or_fail(pw, "field \"hops\"", json_type::array, '[');
    bool first = true;
    while (c_.next(']', first)) {
      c_.skip_space();
      const std::size_t start = c_.pos();
      if (r.size == 3) fail(pw, "more than 3 hops (a route has at most balance, rail, redistribute)", start);
      const where w{pw.what, pw.index, r.size};
      object_or_fail(w, "a hop");
      static constexpr std::array<std::string_view, 4> fields{"kind", "from", "to", "stage"};
      hop h{};
      members(w, start, fields, [&](std::size_t k) {
        switch (k) {
        case 0: {
          c_.skip_space();
          const std::size_t at = c_.pos();
          string_field(w, "kind", name_);
          h.kind = kind_of(w, at);
          break;
        }
        case 1: h.from = count_field(w, "from", 0); break;
        case 2: h.to = count_field(w, "to", 0); break;
        default: h.stage = count_field(w, "stage", 0); break;
        }
      });
      r.hops[static_cast<std::size_t>(r.size++)] = h;
    }
  }

  hop_kind kind_of(where w, std::size_t at) const {
    static constexpr hop_kind kinds[] = {hop_kind::self, hop_kind::intra, hop_kind::balance,
                                         hop_kind::rail, hop_kind::redistribute, hop_kind::direct};
    for (hop_kind k : kinds)
      if (name_ == to_string(k)) return k;
    fail(w, "field \"kind\" is " + c_.token(at, c_.pos()) +
                ", expected one of self, intra, balance, rail, redistribute, direct", at);
  }

  static std::string describe(const route& r) {
    std::string s = "[";
    for (int h = 0; h < r.size; ++h) {
      const hop& x = r.hops[static_cast<std::size_t>(h)];
      if (h) s += ", ";
      s += std::string(to_string(x.kind)) + " " + std::to_string(x.from) + "->" +
           std::to_string(x.to) + " stage " + std::to_string(x.stage);
    }
    return s + "]";
  }

  // Everything that needs the whole document: sizes against servers and GPUs, the routes, the
  // grouping by message; then the executor's index.
  void validate() {
    const int S = p_.servers, G = p_.gpus_per_server;
    const std::size_t T = p_.stage_weight.size();
    // Sizes first, with the planner's own accounting, so that a short document claiming a huge
    // cluster is refused before anything of that size is allocated.
    if (static_cast<std::uint64_t>(S) * static_cast<std::uint64_t>(G) > (std::uint64_t{1} << 24))
      throw plan_too_large(std::string(plan_json_format) + ": " + std::to_string(S) + " servers x " +
                           std::to_string(G) + " GPUs is too many ranks for a plan");
    const std::size_t n = static_cast<std::size_t>(S) * static_cast<std::size_t>(G);
    const std::size_t slots = T == 0 ? 1 : T;
    const double rail_stages = rails_len_.empty() || rails_len_[0] == no_rails ? 0 : static_cast<double>(G);
    const double need = static_cast<double>(T) * (static_cast<double>(S) * 4 + 8) * (1 + rail_stages) +
                        (static_cast<double>(n) * static_cast<double>(slots) + 1) * 4 +
                        2.0 * static_cast<double>(n) * static_cast<double>(n) * 4 +
                        static_cast<double>(p_.pieces.size()) * (sizeof(piece) + 6 * sizeof(rank_op)) +
                        // assign_staging's scratch: stream loads and the layout's two bases, S^2 x G each
                        3.0 * static_cast<double>(S) * static_cast<double>(S) * static_cast<double>(G) *
                            sizeof(bytes_t);
    if (need > static_cast<double>(opt_.max_plan_bytes))
      throw plan_too_large(std::string(plan_json_format) + ": the plan (" + std::to_string(n) +
                           " ranks, " + std::to_string(T) + " stages, " +
                           std::to_string(p_.pieces.size()) + " pieces) would take about " +
                           std::to_string(static_cast<std::uint64_t>(need)) +
                           " bytes (message index, op index, pieces and the S^2 x G staging layout), past "
                           "the limit of " + std::to_string(opt_.max_plan_bytes) +
                           "; raise plan_read_options::max_plan_bytes");
    // rank_op::piece and the op index are 32-bit: at most 6 ops per piece.
    if (p_.pieces.size() > (std::size_t{0xffffffffu} - 1) / 6)
      throw plan_too_large(std::string(plan_json_format) + ": too many pieces to index");

    for (std::size_t t = 0; t < T; ++t) {
      const where w{"stage", t};
      if (perm_len_[t] != static_cast<std::size_t>(S))
        fail(w, "field \"perm\" has " + std::to_string(perm_len_[t]) + " entries, the plan has " +
                    std::to_string(S) + " servers", stage_at_[t]);
      check_perm(w, p_.stage_perm.data() + t * static_cast<std::size_t>(S), "", stage_at_[t]);
    }
    validate_rails();

    p_.message_first.assign(n * n, 0);
    p_.message_count.assign(n * n, 0);
    std::size_t open = ~std::size_t{0}; // message of the previous piece
    std::size_t first_direct = ~std::size_t{0}, first_rail = ~std::size_t{0};
    bytes_t total = 0, scaleup = 0;
    const auto N = static_cast<rank_t>(n);
    for (std::size_t i = 0; i < p_.pieces.size(); ++i) {
      piece& pc = p_.pieces[i];
      const route& r = routes_[i];
      const where w{"piece", i};
      const std::size_t at = piece_at_[i];
      auto ranks = [&] { return ", the plan has " + std::to_string(n) + " ranks"; };
      if (pc.src >= N) fail(w, "field \"src\" is " + std::to_string(pc.src) + ranks(), at);
      if (pc.dst >= N) fail(w, "field \"dst\" is " + std::to_string(pc.dst) + ranks(), at);
      if (pc.bytes == 0)
        fail(w, "field \"bytes\" is 0 (a piece carries at least one byte; an empty message has no piece)",
             at);
      if (pc.offset + pc.bytes < pc.offset) fail(w, "offset + bytes overflows 64 bits", at);
      if (r.size == 0) fail(w, "field \"hops\" is empty (every piece takes at least one hop)", at);
      const hop* rail_hop = nullptr;
      for (int h = 0; h < r.size; ++h) {
        const hop& x = r.hops[static_cast<std::size_t>(h)];
        const where wh{"piece", i, h};
        if (x.from >= N) fail(wh, "field \"from\" is " + std::to_string(x.from) + ranks(), at);
        if (x.to >= N) fail(wh, "field \"to\" is " + std::to_string(x.to) + ranks(), at);
        if (x.kind == hop_kind::rail && rail_hop == nullptr) rail_hop = &x;
        if (x.kind == hop_kind::direct && first_direct == ~std::size_t{0}) first_direct = i;
      }
      // The piece's rail and stage are those of its rail hop; then the hops must be exactly the
      // route that rail and stage give, which catches every other inconsistency at once.
      pc.rail = -1;
      pc.stage = 0;
      if (rail_hop != nullptr) {
        if (p_.server_of(pc.src) == p_.server_of(pc.dst))
          fail(w, "a rail hop in a message within server " + std::to_string(p_.server_of(pc.src)) +
                      " (rail hops join two servers; same-server pieces take one intra or self hop)", at);
        if (static_cast<std::size_t>(rail_hop->stage) >= T)
          fail(w, "its rail hop is in stage " + std::to_string(rail_hop->stage) + ", the plan has " +
                      std::to_string(T) + " stages", at);
        pc.rail = rail_hop->from % G;
        pc.stage = rail_hop->stage;
        if (first_rail == ~std::size_t{0}) first_rail = i;
      }
      const route want = p_.route_of(pc);
      bool same = want.size == r.size;
      for (int h = 0; same && h < r.size; ++h)
        same = want.hops[static_cast<std::size_t>(h)] == r.hops[static_cast<std::size_t>(h)];
      if (!same) {
        const std::string how = pc.rail >= 0 ? "; on rail " + std::to_string(pc.rail) + " in stage " +
                                                   std::to_string(pc.stage) + " (from its rail hop)"
                                             : "";
        fail(w, "hops " + describe(r) + " are not the route of a piece " + std::to_string(pc.src) +
                    "->" + std::to_string(pc.dst) + how + ", which is " + describe(want), at);
      }
      // Grouping: the plan indexes each message as one run of pieces.
      const std::size_t m = static_cast<std::size_t>(pc.src) * n + static_cast<std::size_t>(pc.dst);
      if (m != open) {
        if (p_.message_count[m] != 0)
          fail(w, "the pieces of message " + std::to_string(pc.src) + "->" + std::to_string(pc.dst) +
                      " are not contiguous (piece " + std::to_string(p_.message_first[m]) +
                      " belongs to it too, and pieces of other messages lie between)", at);
        p_.message_first[m] = static_cast<std::uint32_t>(i);
        open = m;
      }
      ++p_.message_count[m];
      total = checked_add(total, pc.bytes, "sum of the pieces' bytes");
      for (int h = 0; h < r.size; ++h) {
        const hop_kind k = r.hops[static_cast<std::size_t>(h)].kind;
        if (k == hop_kind::intra || k == hop_kind::balance || k == hop_kind::redistribute)
          scaleup = checked_add(scaleup, pc.bytes, "sum of the scale-up bytes");
      }
    }
    if (first_direct != ~std::size_t{0} && (T > 0 || first_rail != ~std::size_t{0}))
      fail(where{"piece", first_direct},
           "a direct hop in a plan with " +
               (T > 0 ? std::to_string(T) + " stages"
                      : "a rail hop (piece " + std::to_string(first_rail) + ")") +
               ": only plans of the direct baseline, without stages or rails, take direct hops",
           piece_at_[first_direct]);

    p_.decomposer = "json";
    p_.staged = first_direct == ~std::size_t{0};
    p_.granule = opt_.granule;
    p_.rail_load = 0; // not recorded in the document
    p_.total_bytes = total;
    p_.scaleup_bytes = scaleup;
    build_index(p_);
  }

  // The S entries of a stage's (or, after `what`, a rail's) permutation: each -1 (idle) or
  // another server.
  void check_perm(where w, const std::int32_t* perm, const std::string& what, std::size_t at) {
    const int S = p_.servers;
    for (int s = 0; s < S; ++s)
      if (perm[s] >= S || perm[s] == s)
        fail(w, what + "perm[" + std::to_string(s) + "] is " + std::to_string(perm[s]) +
                    "; it must be -1 (idle) or another server in [0, " + std::to_string(S) + ")",
             at);
  }

  // A per-rail plan's stages: every stage or none has "rails", G of them, each a permutation of
  // S entries like a stage's; the stage itself then weighs its heaviest rail and names no server
  // (stage t is each rail's t-th: plan::rail_weight, plan::rail_perm).
  void validate_rails() {
    const int S = p_.servers, G = p_.gpus_per_server;
    const std::size_t T = p_.stage_weight.size();
    if (T == 0) return;
    const bool per_rail = rails_len_[0] != no_rails;
    const auto Sz = static_cast<std::size_t>(S), Gz = static_cast<std::size_t>(G);
    std::size_t at = 0; // entries of rail_perms_ and rail_weights_ read so far
    for (std::size_t t = 0; t < T; ++t) {
      const where w{"stage", t};
      if ((rails_len_[t] != no_rails) != per_rail)
        fail(w, per_rail ? "field \"rails\" is missing, and stage 0 has it (a per-rail plan's stages all have it)"
                         : "field \"rails\" is here, and stage 0 has none (only a per-rail plan's stages have it, all of them)",
             stage_at_[t]);
      if (!per_rail) continue;
      if (rails_len_[t] != Gz)
        fail(w, "field \"rails\" has " + std::to_string(rails_len_[t]) + " entries, the plan has " +
                    std::to_string(G) + " GPUs per server (one entry a rail)", stage_at_[t]);
      bytes_t heaviest = 0;
      for (std::size_t k = 0; k < Gz; ++k) {
        const std::size_t r = t * Gz + k;
        if (rail_perm_len_[r] != Sz)
          fail(w, "rails[" + std::to_string(k) + "]: field \"perm\" has " + std::to_string(rail_perm_len_[r]) +
                      " entries, the plan has " + std::to_string(S) + " servers", stage_at_[t]);
        check_perm(w, rail_perms_.data() + at, "rails[" + std::to_string(k) + "]: ", stage_at_[t]);
        at += Sz;
        heaviest = std::max(heaviest, rail_weights_[r]);
      }
      if (p_.stage_weight[t] != heaviest)
        fail(w, "field \"weight\" is " + std::to_string(p_.stage_weight[t]) + "; a per-rail stage weighs its heaviest rail, " +
                    std::to_string(heaviest), stage_at_[t]);
      for (int s = 0; s < S; ++s)
        if (p_.stage_perm[t * Sz + static_cast<std::size_t>(s)] != -1)
          fail(w, "perm[" + std::to_string(s) + "] is " + std::to_string(p_.stage_perm[t * Sz + static_cast<std::size_t>(s)]) +
                      "; a per-rail stage's own perm is -1 everywhere (each rail's is in \"rails\")",
               stage_at_[t]);
    }
    if (!per_rail) return;
    p_.rail_weight.assign(T * Gz, 0);
    for (std::size_t t = 0; t < T; ++t)
      for (std::size_t k = 0; k < Gz; ++k) p_.rail_weight[k * T + t] = rail_weights_[t * Gz + k];
    p_.rail_perm = std::move(rail_perms_); // stage-major, then rail: the plan's (t * G + k) * S + s
  }

  static constexpr std::size_t no_rails = ~std::size_t{0};

  json_cursor c_;
  plan_read_options opt_;
  plan p_;
  std::vector<std::size_t> rails_len_;     // entries of each stage's "rails" (no_rails: none)
  std::vector<std::size_t> rail_perm_len_; // entries of each rail's "perm", stage by stage
  std::vector<bytes_t> rail_weights_;      // each rail's weight, stage by stage
  std::vector<std::int32_t> rail_perms_;   // each rail's perm, stage by stage
  std::vector<route> routes_;            // hops as the document lists them, per piece
  std::vector<std::size_t> piece_at_;    // byte offset of each piece, for messages
  std::vector<std::size_t> stage_at_;    // byte offset of each stage
  std::vector<std::size_t> perm_len_;    // entries of each stage's "perm"
  std::string name_;                     // scratch for member names and strings
};

} // namespace detail

/// Rebuilds a plan from a "fasta2a.plan.v1" document (as write_plan_json writes it; members may
/// come in any order), per-rail plans included (every stage with "rails": G entries {"weight",
/// "perm"}, the stage's weight their heaviest and its perm -1 everywhere). Promises a plan that plan::route_of, the message index and the op index
/// agree on: each piece's rail and stage are taken from its rail hop (none for self, intra and
/// direct pieces) and its hops must be exactly the route those give; the pieces of each message
/// must be contiguous. The result has decomposer "json", granule `opt.granule`, staged unless a
/// piece takes a direct hop, rail_load 0 (unknown), total_bytes and scaleup_bytes summed from the
/// pieces and hops, staging offsets and op index as detail::build_index makes them. It does not
/// check the plan against a traffic matrix: that is `verify`'s job.
///
/// Throws fasta2a::error on invalid JSON ("JSON syntax error at byte N: expected ..., found ..."),
/// on a wrong "format", and on a missing, repeated, unknown or mistyped field or a value out of
/// range, naming the field, the stage or piece (and hop) index and its byte offset; on hops that are
/// not the piece's route, pieces of one message that are not contiguous, and direct hops in a
/// staged plan, naming the piece. Throws plan_too_large past opt.max_plan_bytes.
inline plan read_plan_json(std::string_view text, plan_read_options opt = {}) {
  return detail::plan_json_reader(text, opt).read();
}

/// read_plan_json of the file at `path`; errors are prefixed with the path, and a file that cannot
/// be opened or read is an error naming it, as is one that is not a regular file (a directory, a
/// FIFO, a device, a socket: "plan file '/tmp/f' is a FIFO, not a regular file"), refused before it
/// is opened since opening a FIFO blocks until a writer comes.
inline plan load_plan_json(const std::string& path, plan_read_options opt = {}) {
  detail::require_regular_file(path, "plan file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw error("cannot open plan file '" + path + "'");
  std::string text;
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  if (size < 0) throw error("cannot read plan file '" + path + "'");
  // The text is held whole while it is read: a document is refused before it is read when it alone
  // passes the limit (its plan takes less memory than its text: about 100 bytes of JSON per piece).
  if (static_cast<std::uintmax_t>(size) > opt.max_plan_bytes)
    throw plan_too_large("plan file '" + path + "' is " + std::to_string(size) + " bytes, past the limit of " +
                         std::to_string(opt.max_plan_bytes) + "; raise plan_read_options::max_plan_bytes");
  in.seekg(0, std::ios::beg);
  text.resize(static_cast<std::size_t>(size));
  if (size > 0 && !in.read(text.data(), size)) throw error("cannot read plan file '" + path + "'");
  try {
    return read_plan_json(text, opt);
  } catch (const plan_too_large& e) {
    throw plan_too_large("plan file '" + path + "': " + e.what());
  } catch (const error& e) {
    throw error("plan file '" + path + "': " + e.what());
  }
}

} // namespace fasta2a