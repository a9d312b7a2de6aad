// fasta2a: basic vocabulary shared by every header (sizes, ranks, errors).
#pragma once

#include <charconv>
#include <cstdint>
#include <filesystem>
#include <initializer_list>
#include <limits>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

/// Forces inlining of small hot lambdas on the planner's path (GCC and Clang).
#if defined(__GNUC__) || defined(__clang__)
#define FASTA2A_INLINE __attribute__((always_inline))
#else
#define FASTA2A_INLINE
#endif

namespace fasta2a {

/// Byte counts and offsets. Always 64-bit unsigned: MoE messages reach gigabytes and sums of them
/// are checked against overflow rather than allowed to wrap.
using bytes_t = std::uint64_t;

/// A global rank number, server-major: rank = server * gpus_per_server + local.
using rank_t = std::int32_t;

/// Every error fasta2a reports is a `fasta2a::error`: its message names the problem (which size,
/// which file, which rank) so that a user can fix the input without reading the library.
class error : public std::runtime_error {
public:
  using std::runtime_error::runtime_error;
};

/// Raised when a call gave up waiting (engine_options::timeout, or a transport's or bootstrap's own):
/// for a peer's signal, for its own sends to leave, for a collective, or for the caller's stream.
/// Its message names the rank it waited for where there is one. That rank may itself be waiting
/// for another; a launcher that can ask every rank (fasta2a run's MPI roll call) can add which
/// ranks are really missing. Catch fasta2a::error to handle every failure alike.
class timeout_error : public error {
public:
  using error::error;
};

/// Raised when a plan would exceed the configured size limits (stages or memory).
class plan_too_large : public error {
public:
  using error::error;
};

namespace detail {

/// Folds words into a 64-bit digest (not cryptographic: it catches misconfiguration between ranks).
inline std::uint64_t fold_words(std::initializer_list<std::uint64_t> words) noexcept {
  std::uint64_t h = 0x2545f4914f6cdd1dull;
  for (std::uint64_t w : words) {
    h ^= w + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    h *= 0xff51afd7ed558ccdull;
  }
  return h;
}

/// The length of the well-formed UTF-8 sequence at text[i] (a byte >= 0x80), or 0 if there is none:
/// the shortest-form rules of RFC 3629, where the second byte's range depends on the lead byte,
/// which rules out overlong forms, surrogates and code points past U+10FFFF.
inline std::size_t utf8_sequence_length(std::string_view text, std::size_t i) noexcept {
  const auto byte = [&](std::size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char c = byte(i);
  std::size_t len = 0;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) len = 2;
  else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  }
  if (len == 0 || text.size() - i < len) return 0;
  for (std::size_t k = 1; k < len; ++k) {
    const unsigned char b = byte(i + k);
    if (k == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF)) return 0;
  }
  return len;
}

} // namespace detail

/// A byte count as tools take it on their command lines: a non-negative integer with an optional
/// K, M, G or KiB, MiB, GiB suffix (powers of 1024). Throws fasta2a::error naming `what` (an
/// option's name, say) for anything else, for digits past 64 bits and for a product that
/// overflows 64 bits: a size is never wrapped or truncated.
inline bytes_t parse_bytes(std::string_view text, std::string_view what = "size") {
  static constexpr std::pair<std::string_view, unsigned> suffixes[] = {{"KiB", 10}, {"MiB", 20}, {"GiB", 30},
                                                                       {"K", 10},   {"M", 20},   {"G", 30}};
  unsigned shift = 0;
  std::string_view digits = text;
  for (const auto& [suffix, s] : suffixes)
    if (text.size() > suffix.size() && text.ends_with(suffix)) {
      digits = text.substr(0, text.size() - suffix.size());
      shift = s;
      break;
    }
  const std::string quoted = std::string(what) + " value '" + std::string(text) + "'";
  if (digits.empty() || digits.front() == '-' || digits.front() == '+')
    throw error(std::string(what) + " expects a non-negative integer with an optional K/M/G suffix, got '" +
                std::string(text) + "'" + (digits.starts_with('-') ? " (negative)" : ""));
  bytes_t v = 0;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), v);
  if (ec == std::errc::result_out_of_range)
    throw error(quoted + " is too large (at most " + std::to_string(std::numeric_limits<bytes_t>::max()) + ")");
  if (ec != std::errc() || end != digits.data() + digits.size())
    throw error(std::string(what) + " expects a non-negative integer with an optional K/M/G suffix, got '" +
                std::string(text) + "'");
  if (shift > 0 && v > (std::numeric_limits<bytes_t>::max() >> shift))
    throw error(quoted + " is too large: it overflows 64 bits");
  return v << shift;
}

namespace detail {

/// a + b, or an error naming `what` if the sum does not fit in 64 bits.
inline bytes_t checked_add(bytes_t a, bytes_t b, const char* what) {
  bytes_t r;
  if (__builtin_add_overflow(a, b, &r))
    throw error(std::string("byte count overflows 64 bits: ") + what);
  return r;
}

/// a * b, or an error naming `what` if the product does not fit in 64 bits.
inline bytes_t checked_mul(bytes_t a, bytes_t b, const char* what) {
  bytes_t r;
  if (__builtin_mul_overflow(a, b, &r))
    throw error(std::string("byte count overflows 64 bits: ") + what);
  return r;
}

/// Text for a message: printable ASCII as is, anything else (a NUL byte, control characters,
/// bytes of a binary file, a peer's terminal escapes) as \xNN, so that a message is never cut
/// short or garbled by what it quotes. A backslash becomes \\, unless `backslash` is false (text
/// escaped once already, passed on).
inline std::string printable(std::string_view text, bool backslash = true) {
  static constexpr char hex[] = "0123456789abcdef";
  std::string s;
  s.reserve(text.size());
  for (char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '\\' && backslash) s += "\\\\";
    else if (c >= 0x20 && c < 0x7f) s += ch;
    else {
      s += "\\x";
      s += hex[c >> 4];
      s += hex[c & 15];
    }
  }
  return s;
}

/// Refuses a path that is not a regular file before anything opens it, naming the path and what
/// it is: "trace file '/tmp/f' is a FIFO, not a regular file" (`role` is "trace file"). Opening a
/// FIFO for reading blocks in open() itself until a writer comes, which may be never; a character
/// device waits for input (a terminal) or never ends (/dev/zero, /dev/urandom); a directory opens
/// on some systems and then reads as garbage or "out of memory"; a socket cannot be opened at all.
/// A path that cannot be examined (missing, not permitted) passes: opening it fails, and the caller
/// says so as it always did. Symbolic links are followed, so a link to a regular file is one. The
/// check and the open are two steps, and a file swapped in between is not seen: enough for a file
/// named on a command line, which is the caller's own.
inline void require_regular_file(const std::string& path, std::string_view role) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (ec) return;
  const char* kind = nullptr;
  switch (st.type()) {
  case fs::file_type::regular:
  case fs::file_type::none: // status() failed (ec is set then): handled above
  case fs::file_type::not_found: return;
  case fs::file_type::directory: kind = "a directory"; break;
  case fs::file_type::fifo: kind = "a FIFO"; break;
  case fs::file_type::socket: kind = "a socket"; break;
  case fs::file_type::character: kind = "a character device"; break;
  case fs::file_type::block: kind = "a block device"; break;
  default: kind = "of an unknown type"; break; // symlink (not returned by status()), unknown
  }
  throw error(std::string(role) + " '" + printable(path) + "' is " + kind + ", not a regular file");
}

} // namespace detail
} // namespace fasta2a
