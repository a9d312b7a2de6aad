// fasta2a: traffic matrices -- checking them, reading recorded traces, generating synthetic ones.
#pragma once

#include <fasta2a/common.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <type_traits>
#include <limits>
#include <numbers>
#include <numeric>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace fasta2a {

/// Bytes rank i sends to rank j, row-major. Entry [i][i] is a local copy.
using traffic_matrix = Eigen::Matrix<bytes_t, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// A read-only view of a traffic matrix whose rows may lie apart in memory: row i starts
/// `outerStride()` entries after row i - 1 (the engine plans from the gathered send counts in
/// place, each rank's row followed by its header). A traffic_matrix, or an
/// `Eigen::Map<const traffic_matrix, 0, Eigen::OuterStride<>>`, binds to it without a copy.
using traffic_view = Eigen::Ref<const traffic_matrix, 0, Eigen::OuterStride<>>;

namespace detail {

inline void require_positive_ranks(rank_t n, const char* who) {
  if (n <= 0)
    throw error(std::string(who) + ": the number of ranks must be positive, got " + std::to_string(n));
}

/// a + b, or an error whose message is built only on failure: the callers name a row or a column,
/// and formatting that name for every addition would dominate the cost of the check.
template <class Message>
inline bytes_t add_or_throw(bytes_t a, bytes_t b, Message&& message) {
  bytes_t r;
  if (__builtin_add_overflow(a, b, &r))
    throw error("byte count overflows 64 bits: " + message());
  return r;
}

} // namespace detail

/// Returns the total bytes of `m`. Throws fasta2a::error unless `m` is n x n with n > 0, and unless
/// every row sum, every column sum and the total fit in 64 bits; the message names the offending
/// size, row or column.
inline bytes_t check_traffic(const traffic_view& m, rank_t n) {
  detail::require_positive_ranks(n, "check_traffic");
  if (m.rows() != n || m.cols() != n)
    throw error("traffic matrix is " + std::to_string(m.rows()) + " x " + std::to_string(m.cols()) +
                ", the topology has " + std::to_string(n) + " ranks");
  std::vector<bytes_t> column(static_cast<std::size_t>(n), 0);
  bytes_t total = 0;
  for (Eigen::Index i = 0; i < n; ++i) {
    bytes_t row = 0;
    for (Eigen::Index j = 0; j < n; ++j) {
      const bytes_t v = m(i, j);
      row = detail::add_or_throw(row, v, [&] { return "row " + std::to_string(i) + " of the traffic matrix"; });
      auto& c = column[static_cast<std::size_t>(j)];
      c = detail::add_or_throw(c, v, [&] { return "column " + std::to_string(j) + " of the traffic matrix"; });
    }
    total = detail::checked_add(total, row, "total of the traffic matrix");
  }
  return total;
}

// ---------------------------------------------------------------------------------------------
// Trace files
// ---------------------------------------------------------------------------------------------

namespace detail {

/// Opens a trace file for reading, refusing what is not a regular file before it is opened: a
/// FIFO would block in the open itself (require_regular_file says what else it refuses and why).
inline std::ifstream open_trace_file(const std::string& path) {
  require_regular_file(path, "trace file");
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw error("cannot open trace file '" + path + "'");
  return in;
}

inline bool is_space(char c) {
  return c == ' ' || c == '\n' || c == '\t' || c == '\r' || c == '\v' || c == '\f';
}

/// The token as it should appear in a message: long garbage (a binary file) is cut short, and
/// non-printable bytes are escaped (printable).
inline std::string quote_token(std::string_view token) {
  constexpr std::size_t shown = 40;
  // Appended piece by piece: GCC 12 at -O3 misreads "'" + std::string(...) as an overlapping
  // memcpy (a false -Wrestrict).
  std::string s;
  s.reserve(shown * 4 + 5);
  s += '\'';
  s += printable(token.substr(0, shown));
  if (token.size() > shown) s += "...";
  s += '\'';
  return s;
}

/// The one tokenizer behind every trace reader, fed text in pieces of any size (a token may span
/// two pieces): calls sink(position, value, line) for every number in order (position counts
/// numbers from 0, line from 1). Every token is validated as soon as its bytes arrive, so a
/// malformed file is an error at its first bad byte, without reading the rest.
template <class Sink>
class number_scanner {
public:
  number_scanner(const std::string& path, Sink& sink) : path_(path), sink_(sink) {}

  void feed(std::string_view text) {
    constexpr bytes_t max = std::numeric_limits<bytes_t>::max();
    for (char c : text) {
      if (problem_ != nullptr) { // show the rest of the bad token (up to 41 bytes), then throw
        if (is_space(c) || shown_.size() > 40) bad();
        shown_ += c;
        continue;
      }
      if (is_space(c)) {
        if (in_token_) finish_token();
        line_ += (c == '\n');
        continue;
      }
      in_token_ = true;
      if (shown_.size() <= 40) shown_ += c;
      if (c < '0' || c > '9') {
        problem_ = " is not a non-negative decimal integer";
        continue;
      }
      const auto digit = static_cast<bytes_t>(c - '0');
      if (value_ > (max - digit) / 10) {
        problem_ = " does not fit in 64 bits";
        continue;
      }
      value_ = value_ * 10 + digit;
    }
    if (problem_ != nullptr) bad();
  }

  /// Ends the text; returns how many numbers there were.
  std::size_t finish() {
    if (in_token_) finish_token();
    return count_;
  }

private:
  void finish_token() {
    sink_(count_, value_, line_);
    ++count_;
    value_ = 0;
    in_token_ = false;
    shown_.clear();
  }
  [[noreturn]] void bad() const {
    throw error("trace file '" + path_ + "' line " + std::to_string(line_) + ": " + quote_token(shown_) + problem_);
  }

  const std::string& path_;
  Sink& sink_;
  std::size_t line_ = 1, count_ = 0;
  bytes_t value_ = 0;
  bool in_token_ = false;
  const char* problem_ = nullptr; // set on a bad byte: the rest of the token is shown, then it throws
  std::string shown_; // the token so far, up to 41 bytes (for messages)
};

/// for_each_number over a whole text in memory.
template <class Sink>
std::size_t for_each_number(const std::string& path, std::string_view text, Sink&& sink) {
  number_scanner<std::remove_reference_t<Sink>> scan(path, sink);
  scan.feed(text);
  return scan.finish();
}

/// for_each_number over a file, read in 1 MiB pieces: memory stays bounded whatever the file's
/// size, and a file that is not text (a sparse or binary file) is refused at its first bad byte.
template <class Sink>
std::size_t for_each_number_in_file(const std::string& path, Sink&& sink) {
  std::ifstream in = open_trace_file(path);
  number_scanner<std::remove_reference_t<Sink>> scan(path, sink);
  std::string buf(std::size_t{1} << 20, '\0');
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    const std::streamsize got = in.gcount();
    if (got <= 0) break;
    scan.feed(std::string_view(buf.data(), static_cast<std::size_t>(got)));
  }
  if (in.bad())
    throw error("cannot read trace file '" + path + "'");
  return scan.finish();
}

/// Reads and validates a whole trace of n x n matrices, feeding each number to `sink` as
/// for_each_number does; returns the number of matrices (at least one).
template <class Sink>
std::size_t scan_trace(const std::string& path, rank_t n, Sink&& sink) {
  require_positive_ranks(n, "trace reader");
  const std::size_t numbers = for_each_number_in_file(path, sink);
  const auto per_matrix = static_cast<std::size_t>(n) * static_cast<std::size_t>(n);
  const std::string shape = std::to_string(n) + " x " + std::to_string(n);
  if (numbers == 0)
    throw error("trace file '" + path + "' is empty: it holds no " + shape + " matrix");
  if (numbers % per_matrix != 0)
    throw error("trace file '" + path + "' holds " + std::to_string(numbers) + " numbers, not a whole number of " +
                shape + " matrices: truncated?");
  return numbers / per_matrix;
}

/// Scales trace entries by bytes per count, refusing products that would wrap.
class entry_scaler {
public:
  entry_scaler(const std::string& path, rank_t n, bytes_t unit)
      : path_(path), n_(static_cast<std::size_t>(n)), unit_(unit) {
    if (unit == 0)
      throw error("trace reader: unit (bytes per count) must be positive, got 0 for '" + path + "'");
    // One division here instead of one per entry.
    limit_ = std::numeric_limits<bytes_t>::max() / unit;
  }

  bytes_t operator()(std::size_t position, bytes_t value, std::size_t line) const {
    if (value > limit_) {
      const std::size_t k = position / (n_ * n_);
      const std::size_t ij = position % (n_ * n_);
      throw error("trace file '" + path_ + "' line " + std::to_string(line) + ": entry [" +
                  std::to_string(ij / n_) + "][" + std::to_string(ij % n_) + "] of matrix " + std::to_string(k) +
                  " is " + std::to_string(value) + ", times " + std::to_string(unit_) +
                  " bytes per count overflows 64 bits");
    }
    return value * unit_;
  }

private:
  const std::string& path_;
  std::size_t n_;
  bytes_t unit_;
  bytes_t limit_;
};

/// check_traffic with the matrix's place in the trace added to the message.
inline void check_trace_matrix(const traffic_matrix& m, rank_t n, const std::string& path, std::size_t index) {
  try {
    check_traffic(m, n);
  } catch (const error& e) {
    throw error("matrix " + std::to_string(index) + " of trace file '" + path + "': " + e.what());
  }
}

} // namespace detail

/// Number of whole n x n matrices in a trace file of whitespace-separated non-negative decimal
/// integers (row-major, matrices one after another). Validates the whole file: throws
/// fasta2a::error naming the path (and line and token where there is one) if the file is missing
/// or unreadable, is not a regular file (a directory, a FIFO, a device: refused before it is
/// opened, since opening a FIFO blocks until a writer comes), is empty, holds a token that is not
/// a non-negative decimal integer or does not fit in 64 bits, or holds a count of numbers that is
/// not a multiple of n*n; also if n <= 0.
inline std::size_t count_matrices(const std::string& path, rank_t n) {
  return detail::scan_trace(path, n, [](std::size_t, bytes_t, std::size_t) {});
}

/// The index-th (0-based) n x n matrix of the trace, every entry multiplied by `unit` (bytes per
/// count, e.g. 8192 per token). Same errors as count_matrices, plus: index past the end, unit == 0,
/// an entry times unit overflowing 64 bits, and row/column sums overflowing (check_traffic).
inline traffic_matrix read_matrix(const std::string& path, rank_t n, std::size_t index = 0, bytes_t unit = 1) {
  detail::require_positive_ranks(n, "read_matrix");
  const detail::entry_scaler scale(path, n, unit);
  const auto per_matrix = static_cast<std::size_t>(n) * static_cast<std::size_t>(n);
  traffic_matrix m = traffic_matrix::Zero(n, n);
  // An index whose first position does not fit in size_t cannot be in any file; it must not wrap
  // around onto a real matrix, and is reported as past the end below.
  const bool addressable = index < std::numeric_limits<std::size_t>::max() / per_matrix;
  const std::size_t first = addressable ? index * per_matrix : 0;
  const std::size_t matrices = detail::scan_trace(path, n, [&](std::size_t pos, bytes_t value, std::size_t line) {
    if (addressable && pos >= first && pos - first < per_matrix)
      m.data()[pos - first] = scale(pos, value, line);
  });
  if (index >= matrices)
    throw error("matrix index " + std::to_string(index) + " is past the end of '" + path + "', which holds " +
                std::to_string(matrices) + " matrices of " + std::to_string(n) + " x " + std::to_string(n));
  detail::check_trace_matrix(m, n, path, index);
  return m;
}

/// Every matrix of the trace, in file order, each entry multiplied by `unit`. Same errors as
/// read_matrix. Reads the whole file into memory and parses it in one pass.
inline std::vector<traffic_matrix> read_trace(const std::string& path, rank_t n, bytes_t unit = 1) {
  detail::require_positive_ranks(n, "read_trace");
  const detail::entry_scaler scale(path, n, unit);
  const auto per_matrix = static_cast<std::size_t>(n) * static_cast<std::size_t>(n);
  std::vector<traffic_matrix> trace;
  detail::scan_trace(path, n, [&](std::size_t pos, bytes_t value, std::size_t line) {
    const std::size_t offset = pos % per_matrix;
    if (offset == 0)
      trace.emplace_back(n, n);
    trace.back().data()[offset] = scale(pos, value, line);
  });
  for (std::size_t k = 0; k < trace.size(); ++k)
    detail::check_trace_matrix(trace[k], n, path, k);
  return trace;
}

// ---------------------------------------------------------------------------------------------
// Synthetic traffic
// ---------------------------------------------------------------------------------------------

namespace detail {

/// splitmix64: tiny, fully specified by its arithmetic, so a seed gives the same stream on every
/// machine and standard library (std:: distributions do not promise that).
class splitmix64 {
public:
  explicit splitmix64(std::uint64_t seed) : state_(seed) {}

  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }

  /// Uniform in [0, 1): the top 53 bits scaled exactly, so no rounding depends on the platform.
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

  /// Uniform integer in [0, bound), bound > 0. Rejection removes the modulo bias.
  std::uint64_t below(std::uint64_t bound) {
    const std::uint64_t threshold = (0 - bound) % bound;
    while (true) {
      const std::uint64_t r = next();
      if (r >= threshold)
        return r % bound;
    }
  }

  /// Standard normal by Box-Muller (one value per call, the sine partner is dropped for simplicity).
  double normal() {
    const double u1 = 1.0 - uniform(); // in (0, 1]: log(u1) stays finite
    const double u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
  }

private:
  std::uint64_t state_;
};

/// A seeded random permutation of 0..n-1 (Fisher-Yates).
inline std::vector<rank_t> random_order(rank_t n, splitmix64& rng) {
  std::vector<rank_t> order(static_cast<std::size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  for (std::size_t k = order.size(); k > 1; --k)
    std::swap(order[k - 1], order[static_cast<std::size_t>(rng.below(k))]);
  return order;
}

inline void check_generator(rank_t n, bytes_t granule, const char* who) {
  require_positive_ranks(n, who);
  if (granule == 0)
    throw error(std::string(who) + ": granule must be at least 1 byte, got 0");
}

inline void check_finite(double x, const char* name, const char* who) {
  if (!std::isfinite(x))
    throw error(std::string(who) + ": " + name + " must be finite, got " + std::to_string(x));
}

/// Splits `units` over `targets` of row `row` as evenly as integers allow; the targets that get one
/// unit more start at position `rotation`, so rows with different rotations spread the remainder
/// over different columns.
inline void spread_evenly(traffic_matrix& m, Eigen::Index row, const std::vector<rank_t>& targets, bytes_t units,
                          std::size_t rotation, bytes_t granule) {
  const std::size_t k = targets.size();
  if (k == 0 || units == 0)
    return;
  const bytes_t base = units / k;
  const bytes_t extra = units % k;
  for (std::size_t t = 0; t < k; ++t) {
    const bytes_t u = base + (((t + k - rotation % k) % k) < extra ? 1 : 0);
    m(row, targets[t]) += u * granule;
  }
}

/// Largest-remainder apportionment: integer shares of `units` proportional to `weights` (finite,
/// non-negative, positive sum) that add up to `units` exactly. Remainders go to the largest
/// fractional parts, ties to the lower index, so the result is a function of the weights alone.
inline std::vector<bytes_t> apportion(const std::vector<double>& weights, bytes_t units) {
  const std::size_t n = weights.size();
  std::vector<bytes_t> share(n, 0);
  if (units == 0 || n == 0)
    return share;
  double total = 0;
  for (double w : weights)
    total += w;
  const auto u = static_cast<double>(units);
  std::vector<double> fraction(n, 0.0);
  bytes_t given = 0;
  for (std::size_t j = 0; j < n; ++j) {
    const double quota = u * (weights[j] / total);
    // Rounding can push a quota to or past `units` (and 2^64 does not convert): cap every share so
    // the running sum never exceeds `units`; the fix-up below restores the exact total.
    bytes_t whole = quota >= u ? units : static_cast<bytes_t>(quota);
    if (whole > units - given)
      whole = units - given;
    else
      fraction[j] = quota - std::floor(quota);
    share[j] = whole;
    given += whole;
  }
  const bytes_t left = units - given;
  if (left == 0)
    return share;
  std::vector<std::size_t> order(n);
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return fraction[a] != fraction[b] ? fraction[a] > fraction[b] : a < b;
  });
  // Normally left < n; with quotas beyond double precision it may be more, so go round as needed.
  for (std::size_t t = 0; t < n; ++t)
    share[order[t]] += left / n + (t < left % n ? 1 : 0);
  return share;
}

} // namespace detail

/// Every rank sends bytes_per_rank (rounded down to a multiple of granule) split as evenly as the
/// granule allows over all n destinations, itself included. The one-granule remainders are rotated
/// by sender, so column sums differ by at most one granule as well. Entries are multiples of
/// granule. `seed` is accepted so all generators share a signature; the result does not depend on
/// it. Throws fasta2a::error if n <= 0 or granule == 0.
inline traffic_matrix uniform_traffic(rank_t n, bytes_t bytes_per_rank, std::uint64_t seed, bytes_t granule = 1) {
  (void)seed;
  detail::check_generator(n, granule, "uniform_traffic");
  std::vector<rank_t> all(static_cast<std::size_t>(n));
  std::iota(all.begin(), all.end(), 0);
  traffic_matrix m = traffic_matrix::Zero(n, n);
  for (rank_t i = 0; i < n; ++i)
    detail::spread_evenly(m, i, all, bytes_per_rank / granule, static_cast<std::size_t>(i), granule);
  return m;
}

/// Zipf(s) destinations: a seeded random popularity order pi over ranks, shared by all senders (a hot
/// expert is hot for everyone); sender i weighs destination j by (1 / (pi(j)+1))^s times a per-(i,j)
/// jitter uniform in [0.75, 1.25), so rows differ. s = 0 is near-uniform. Every row sums exactly to
/// bytes_per_rank rounded down to a multiple of granule; entries are multiples of granule; the same
/// seed gives the same matrix. Throws fasta2a::error if n <= 0, granule == 0, or s is negative or
/// not finite.
inline traffic_matrix zipf_traffic(rank_t n, double s, bytes_t bytes_per_rank, std::uint64_t seed,
                                   bytes_t granule = 1) {
  detail::check_generator(n, granule, "zipf_traffic");
  detail::check_finite(s, "exponent s", "zipf_traffic");
  if (s < 0)
    throw error("zipf_traffic: exponent s must be non-negative, got " + std::to_string(s));
  detail::splitmix64 rng(seed);
  const std::vector<rank_t> order = detail::random_order(n, rng);
  std::vector<double> popularity(static_cast<std::size_t>(n));
  for (std::size_t p = 0; p < order.size(); ++p)
    popularity[static_cast<std::size_t>(order[p])] = std::pow(1.0 / static_cast<double>(p + 1), s);
  const bytes_t units = bytes_per_rank / granule;
  traffic_matrix m(n, n);
  std::vector<double> weights(static_cast<std::size_t>(n));
  for (rank_t i = 0; i < n; ++i) {
    for (std::size_t j = 0; j < weights.size(); ++j)
      weights[j] = popularity[j] * (0.75 + 0.5 * rng.uniform());
    const std::vector<bytes_t> row = detail::apportion(weights, units);
    for (rank_t j = 0; j < n; ++j)
      m(i, j) = row[static_cast<std::size_t>(j)] * granule;
  }
  return m;
}

/// `hot` ranks, chosen by the seed, receive `share` of every sender's bytes (to the nearest granule),
/// split evenly among them; the rest goes evenly to the other n - hot ranks (if hot == n, everything
/// goes to the hot ranks). Every row sums exactly to bytes_per_rank rounded down to a multiple of
/// granule; entries are multiples of granule; remainders rotate by sender. Throws fasta2a::error if
/// n <= 0, granule == 0, hot is not in [1, n], or share is not in [0, 1].
inline traffic_matrix hotspot_traffic(rank_t n, rank_t hot, double share, bytes_t bytes_per_rank,
                                      std::uint64_t seed, bytes_t granule = 1) {
  detail::check_generator(n, granule, "hotspot_traffic");
  detail::check_finite(share, "share", "hotspot_traffic");
  if (hot < 1 || hot > n)
    throw error("hotspot_traffic: hot must be in [1, " + std::to_string(n) + "], got " + std::to_string(hot));
  if (share < 0 || share > 1)
    throw error("hotspot_traffic: share must be in [0, 1], got " + std::to_string(share));
  detail::splitmix64 rng(seed);
  std::vector<rank_t> order = detail::random_order(n, rng);
  std::vector<rank_t> hot_ranks(order.begin(), order.begin() + hot);
  std::vector<rank_t> cold_ranks(order.begin() + hot, order.end());
  // Sorted so that the rotation of remainders walks columns in rank order, independent of the draw.
  std::sort(hot_ranks.begin(), hot_ranks.end());
  std::sort(cold_ranks.begin(), cold_ranks.end());
  const bytes_t units = bytes_per_rank / granule;
  bytes_t hot_units = units;
  if (!cold_ranks.empty()) {
    const double want = std::round(share * static_cast<double>(units));
    hot_units = want >= static_cast<double>(units) ? units : static_cast<bytes_t>(want);
  }
  traffic_matrix m = traffic_matrix::Zero(n, n);
  for (rank_t i = 0; i < n; ++i) {
    const auto rotation = static_cast<std::size_t>(i);
    detail::spread_evenly(m, i, hot_ranks, hot_units, rotation, granule);
    detail::spread_evenly(m, i, cold_ranks, units - hot_units, rotation, granule);
  }
  return m;
}

/// Log-normal per-rank load: rank i sends bytes_per_rank * exp(sigma * Z_i - sigma^2 / 2) (so the
/// mean is bytes_per_rank), rounded down to a multiple of granule, split evenly over all
/// destinations with remainders rotated by sender. Z_i are seeded standard normals; the same seed
/// gives the same matrix. Throws fasta2a::error if n <= 0, granule == 0, sigma is negative or not
/// finite, or a rank's load does not fit in 64 bits (the message names the rank).
inline traffic_matrix lognormal_traffic(rank_t n, double sigma, bytes_t bytes_per_rank, std::uint64_t seed,
                                        bytes_t granule = 1) {
  detail::check_generator(n, granule, "lognormal_traffic");
  detail::check_finite(sigma, "sigma", "lognormal_traffic");
  if (sigma < 0)
    throw error("lognormal_traffic: sigma must be non-negative, got " + std::to_string(sigma));
  detail::splitmix64 rng(seed);
  std::vector<rank_t> all(static_cast<std::size_t>(n));
  std::iota(all.begin(), all.end(), 0);
  constexpr double two_to_64 = 18446744073709551616.0;
  traffic_matrix m = traffic_matrix::Zero(n, n);
  for (rank_t i = 0; i < n; ++i) {
    const double z = rng.normal();
    const double load = static_cast<double>(bytes_per_rank) * std::exp(sigma * z - 0.5 * sigma * sigma);
    if (!(load < two_to_64))
      throw error("lognormal_traffic: rank " + std::to_string(i) + "'s load of " + std::to_string(load) +
                  " bytes (bytes_per_rank " + std::to_string(bytes_per_rank) + ", sigma " + std::to_string(sigma) +
                  ") overflows 64 bits");
    const double whole_units = std::floor(load / static_cast<double>(granule));
    // load < 2^64 bounds whole_units * granule, but the division rounds: convert only what fits.
    if (!(whole_units < two_to_64))
      throw error("lognormal_traffic: rank " + std::to_string(i) + "'s load overflows 64 bits");
    const auto units = static_cast<bytes_t>(whole_units);
    detail::checked_mul(units, granule, "lognormal_traffic: a rank's load in bytes");
    detail::spread_evenly(m, i, all, units, static_cast<std::size_t>(i), granule);
  }
  return m;
}

} // namespace fasta2a
