// fasta2a: writing JSON. A small general-purpose writer (string escaping, exact numbers, null for
// what JSON cannot hold, objects and arrays with their commas) for reports and tools, and the plan
// writer: plans as "fasta2a.plan.v1" documents (DESIGN.md section 5). Reading plans back is
// plan_reader.hpp's job.
#pragma once

#include <algorithm>
#include <charconv>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <ostream>
#include <ranges>
#include <string>
#include <string_view>
#include <vector>

#include "fasta2a/common.hpp"
#include "fasta2a/plan.hpp"

namespace fasta2a {

// =================================================================================================
// General JSON text
// =================================================================================================

/// Appends `text` to `out` as a JSON string literal (RFC 8259), quotes included. '"', '\\' and
/// every control character below U+0020 are escaped (\b, \f, \n, \r, \t by name, the others as
/// \u00XX); well-formed UTF-8 is copied as it is. Bytes that are not well-formed UTF-8 (stray
/// continuation bytes, overlong forms, surrogates, code points past U+10FFFF, cut-off sequences)
/// each become U+FFFD, so the result is always valid JSON: the text written is often a file
/// name, and a file name may be any bytes.
inline void append_json_string(std::string& out, std::string_view text) {
  static constexpr char hex[] = "0123456789abcdef";
  out += '"';
  const auto byte = [&](std::size_t i) { return static_cast<unsigned char>(text[i]); };
  std::size_t i = 0;
  while (i < text.size()) {
    // Copy the longest run that needs no escaping in one append.
    std::size_t run = i;
    while (run < text.size()) {
      const unsigned char c = byte(run);
      if (c == '"' || c == '\\' || c < 0x20 || c >= 0x80) break;
      ++run;
    }
    out.append(text.data() + i, run - i);
    i = run;
    if (i == text.size()) break;
    const unsigned char c = byte(i);
    if (c < 0x80) {
      switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        out += "\\u00";
        out += hex[c >> 4];
        out += hex[c & 15];
      }
      ++i;
      continue;
    }
    // One multi-byte sequence, copied if well-formed.
    const std::size_t len = detail::utf8_sequence_length(text, i);
    const bool ok = len > 0;
    if (ok) {
      out.append(text.data() + i, len);
      i += len;
    } else {
      out += "\\ufffd"; // one replacement per bad byte; the next byte starts afresh
      ++i;
    }
  }
  out += '"';
}

/// `text` as a JSON string literal, quotes included (see append_json_string).
inline std::string json_string(std::string_view text) {
  std::string out;
  out.reserve(text.size() + 2);
  append_json_string(out, text);
  return out;
}

/// Appends an integer, exactly (all 64 bits; no locale, no exponent).
template <std::integral Int>
  requires(!std::same_as<Int, bool>)
inline void append_json_number(std::string& out, Int v) {
  char buf[24];
  const auto res = std::to_chars(buf, buf + sizeof buf, v);
  out.append(buf, res.ptr);
}

/// Appends a real as the shortest text that reads back as the same double ("0.1", "1e-05",
/// "2.5e+20"), or `null` for NaN and infinities, which JSON cannot hold: a report line stays
/// valid JSON when a ratio has no meaning (0 / 0).
inline void append_json_number(std::string& out, double x) {
  if (!std::isfinite(x)) {
    out += "null";
    return;
  }
  char buf[32];
  const auto res = std::to_chars(buf, buf + sizeof buf, x);
  out.append(buf, res.ptr);
}

/// A real as append_json_number writes it.
inline std::string json_number(double x) {
  std::string out;
  append_json_number(out, x);
  return out;
}

/// Writes one JSON value (usually an object: a report line) into a string, putting in the commas
/// and colons and checking the nesting as it goes. Members and elements are separated by ", " and
/// names by ": ", all on one line. Each call returns the writer, so calls chain:
///
///     std::string line;
///     json_writer(line).begin_object().field("ranks", 32).field("time_s", 0.25).end_object();
///
/// Misuse (a value in an object without its name, a name outside an object, a second top-level
/// value, closing what is not open) throws fasta2a::error rather than writing invalid JSON.
class json_writer {
public:
  /// Appends to `out` (which may already hold text: a writer adds one value).
  explicit json_writer(std::string& out) : out_(out) {}

  /// Opens an object (as a value: in an object, after its name).
  json_writer& begin_object() {
    before_value();
    out_ += '{';
    open_.push_back({'}', true, false});
    return *this;
  }
  /// Closes the innermost object.
  json_writer& end_object() { return close('}'); }
  /// Opens an array.
  json_writer& begin_array() {
    before_value();
    out_ += '[';
    open_.push_back({']', true, false});
    return *this;
  }
  /// Closes the innermost array.
  json_writer& end_array() { return close(']'); }

  /// The name of the next member of the innermost object (escaped as a string).
  json_writer& key(std::string_view name) {
    if (open_.empty() || open_.back().close != '}')
      throw error("json_writer: member name \"" + std::string(name.substr(0, 40)) + "\" outside an object");
    state& s = open_.back();
    if (s.named) throw error("json_writer: member name \"" + std::string(name.substr(0, 40)) + "\" after another name");
    if (!s.first) out_ += ", ";
    s.first = false;
    s.named = true;
    append_json_string(out_, name);
    out_ += ": ";
    return *this;
  }

  /// A string value.
  json_writer& value(std::string_view text) {
    before_value();
    append_json_string(out_, text);
    return *this;
  }
  /// A string value (not a boolean: without this overload a pointer would convert to bool).
  json_writer& value(const char* text) { return value(std::string_view(text)); }
  /// A string value.
  json_writer& value(const std::string& text) { return value(std::string_view(text)); }
  /// true or false. A template, so that nothing converts to bool on its way here: a pointer
  /// passed by mistake is a compile error rather than `true`.
  template <std::same_as<bool> Bool>
  json_writer& value(Bool b) {
    before_value();
    out_ += b ? "true" : "false";
    return *this;
  }
  /// An integer, exactly.
  template <std::integral Int>
    requires(!std::same_as<Int, bool>)
  json_writer& value(Int v) {
    before_value();
    append_json_number(out_, v);
    return *this;
  }
  /// A real: shortest round-trip text, or null when it is not finite.
  json_writer& value(double x) {
    before_value();
    append_json_number(out_, x);
    return *this;
  }
  /// null.
  json_writer& value(std::nullptr_t) {
    before_value();
    out_ += "null";
    return *this;
  }
  /// The value, or null when there is none.
  template <class T>
  json_writer& value(const std::optional<T>& v) {
    return v ? value(*v) : value(nullptr);
  }
  /// An array of the range's elements, each written by value().
  template <std::ranges::input_range R>
    requires(!std::convertible_to<const R&, std::string_view>)
  json_writer& value(const R& range) {
    begin_array();
    for (const auto& x : range) value(x);
    return end_array();
  }

  /// key(name) then value(v): one member of the innermost object.
  template <class T>
  json_writer& field(std::string_view name, const T& v) {
    key(name);
    return value(v);
  }

  /// Whether one complete value has been written (everything opened is closed).
  bool done() const noexcept { return wrote_top_ && open_.empty(); }

private:
  struct state {
    char close;  // '}' or ']'
    bool first;  // nothing written in it yet
    bool named;  // an object whose next member's name is written, its value not yet
  };

  void before_value() {
    if (open_.empty()) {
      if (wrote_top_) throw error("json_writer: a second value after the complete top-level value");
      wrote_top_ = true;
      return;
    }
    state& s = open_.back();
    if (s.close == '}') {
      if (!s.named) throw error("json_writer: a value in an object needs a member name (key) first");
      s.named = false;
      return;
    }
    if (!s.first) out_ += ", ";
    s.first = false;
  }

  json_writer& close(char c) {
    if (open_.empty() || open_.back().close != c)
      throw error(std::string("json_writer: '") + c + "' closes nothing that is open" +
                  (open_.empty() ? "" : std::string(" (the innermost open value needs '") + open_.back().close + "')"));
    if (open_.back().named) throw error("json_writer: an object closed after a member name without its value");
    open_.pop_back();
    out_ += c;
    return *this;
  }

  std::string& out_;
  std::vector<state> open_;
  bool wrote_top_ = false;
};

// =================================================================================================
// Plan documents
// =================================================================================================

/// The value of a plan document's "format" field.
inline constexpr std::string_view plan_json_format = "fasta2a.plan.v1";

namespace detail {

/// Appends a plan document to `out`; with `os`, hands `out` to the stream whenever it grows past a
/// chunk, so that a plan of millions of pieces never needs its whole document in memory. Its own
/// fixed layout (one stage or piece per line) rather than json_writer's: every piece goes through
/// here, and a plan's fields are all numbers and fixed names, which need no checking or escaping.
class plan_json_writer {
public:
  plan_json_writer(std::string& out, std::ostream* os) : out_(out), os_(os) {}

  void write(const plan& p) {
    const std::size_t T = p.stages();
    const std::size_t S = p.servers > 0 ? static_cast<std::size_t>(p.servers) : 0;
    // plan::perm reads stage_perm unchecked: refuse a plan whose arrays disagree rather than read
    // past the end.
    if (p.stage_perm.size() != T * S)
      throw error("write_plan_json: the plan has " + std::to_string(T) + " stages of " +
                  std::to_string(S) + " servers but " + std::to_string(p.stage_perm.size()) +
                  " permutation entries");
    const std::size_t G = p.gpus_per_server > 0 ? static_cast<std::size_t>(p.gpus_per_server) : 0;
    if (p.per_rail() && (p.rail_weight.size() != T * G || p.rail_perm.size() != T * G * S))
      throw error("write_plan_json: the plan has " + std::to_string(T) + " per-rail stages of " + std::to_string(G) +
                  " rails and " + std::to_string(S) + " servers but " + std::to_string(p.rail_weight.size()) +
                  " rail weights and " + std::to_string(p.rail_perm.size()) + " rail permutation entries");
    text("{\"format\": \"");
    text(plan_json_format);
    text("\",\n \"servers\": ");
    number(p.servers);
    text(", \"gpus_per_server\": ");
    number(p.gpus_per_server);
    // The direct baseline (staged == false) has no stages, so "stages" is [] and its inter-server
    // pieces take one hop of kind "direct": an extension of the format, since such a plan is not a
    // FAST plan. read_plan_json accepts it back as an unstaged plan.
    text(",\n \"stages\": [");
    for (std::size_t t = 0; t < T; ++t) {
      text(t == 0 ? "\n  {\"weight\": " : ",\n  {\"weight\": ");
      number(p.stage_weight[t]);
      text(", \"perm\": [");
      for (std::size_t s = 0; s < S; ++s) {
        if (s > 0) text(", ");
        number(p.stage_perm[t * S + s]);
      }
      text("]");
      // A per-rail plan's stage t is each rail's t-th (plan::rail_weight, plan::rail_perm): its
      // own weight is the heaviest rail's and its perm -1 everywhere.
      if (p.per_rail()) {
        text(", \"rails\": [");
        for (std::size_t k = 0; k < G; ++k) {
          text(k == 0 ? "{\"weight\": " : ", {\"weight\": ");
          number(p.rail_weight[k * T + t]);
          text(", \"perm\": [");
          for (std::size_t s = 0; s < S; ++s) {
            if (s > 0) text(", ");
            number(p.rail_perm[(t * G + k) * S + s]);
          }
          text("]}");
        }
        text("]");
      }
      text("}");
      maybe_flush();
    }
    text(T == 0 ? "],\n \"pieces\": [" : "\n ],\n \"pieces\": [");
    for (std::size_t i = 0; i < p.pieces.size(); ++i) {
      const piece& pc = p.pieces[i];
      text(i == 0 ? "\n  {\"src\": " : ",\n  {\"src\": ");
      number(pc.src);
      text(", \"dst\": ");
      number(pc.dst);
      text(", \"offset\": ");
      number(pc.offset);
      text(", \"bytes\": ");
      number(pc.bytes);
      text(", \"hops\": [");
      const route r = p.route_of(pc);
      for (int h = 0; h < r.size; ++h) {
        const hop& x = r.hops[static_cast<std::size_t>(h)];
        text(h == 0 ? "{\"kind\": \"" : ", {\"kind\": \"");
        text(to_string(x.kind));
        text("\", \"from\": ");
        number(x.from);
        text(", \"to\": ");
        number(x.to);
        text(", \"stage\": ");
        number(x.stage);
        text("}");
      }
      text("]}");
      maybe_flush();
    }
    text(p.pieces.empty() ? "]\n}\n" : "\n ]\n}\n");
    flush();
  }

private:
  static constexpr std::size_t chunk = std::size_t{1} << 20;

  void text(std::string_view s) { out_.append(s); }

  // std::to_chars: no locale, no stream state, no allocation; iostream formatting per number
  // would dominate the time of a large plan.
  template <class Int>
  void number(Int v) {
    append_json_number(out_, v);
  }

  void maybe_flush() {
    if (os_ != nullptr && out_.size() >= chunk) flush();
  }

  void flush() {
    if (os_ == nullptr) return;
    os_->write(out_.data(), static_cast<std::streamsize>(out_.size()));
    out_.clear();
    if (!*os_) throw error("write_plan_json: writing to the output stream failed");
  }

  std::string& out_;
  std::ostream* os_;
};

} // namespace detail

/// Writes p as a "fasta2a.plan.v1" document (DESIGN.md section 5): the fields "format", "servers",
/// "gpus_per_server", "stages" (each {"weight", "perm"}) and "pieces" (each {"src", "dst",
/// "offset", "bytes", "hops"}, every hop {"kind", "from", "to", "stage"} as `p.route_of` gives it),
/// in that order, one stage or one piece per line, pieces in plan order. A plan of the direct
/// baseline (`staged == false`) is written with "stages": [] and hops of kind "direct". A per-rail
/// plan (plan::per_rail) gives each stage a third field, "rails": G entries {"weight", "perm"}, rail
/// k's t-th stage, with the stage's own weight the heaviest rail's and its perm -1 everywhere (an
/// extension of DESIGN.md's format, which has server-level stages only). The output
/// depends on nothing but p, so equal plans give identical documents. Throws fasta2a::error if the
/// plan's stage arrays disagree in size or the stream fails.
inline void write_plan_json(std::ostream& os, const plan& p) {
  std::string buf;
  buf.reserve(std::size_t{1} << 20);
  detail::plan_json_writer(buf, &os).write(p);
}

/// The document write_plan_json writes, as a string.
inline std::string plan_to_json(const plan& p) {
  std::string out;
  // About 80 bytes per hop-less piece and 60 per hop: reserving avoids most regrowth.
  out.reserve(256 + p.stages() * (24 + 4 * static_cast<std::size_t>(std::max(p.servers, 0))) *
                        (p.per_rail() ? 1 + static_cast<std::size_t>(std::max(p.gpus_per_server, 0)) : 1) +
              p.pieces.size() * 200);
  detail::plan_json_writer(out, nullptr).write(p);
  return out;
}

} // namespace fasta2a
