// Tests for fasta2a/traffic.hpp: trace readers, check_traffic and the synthetic generators.
#include <doctest/doctest.h>

#include "checks.hpp"
#include "workloads.hpp"

#include <fasta2a/traffic.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <sys/stat.h>
#include <unistd.h>

using fasta2a::bytes_t;
using fasta2a::rank_t;
using fasta2a::traffic_matrix;
using fasta2a::testing::contains;
using fasta2a::testing::megatron;
using fasta2a::testing::have_megatron;

namespace {

/// A fresh directory under the system temp dir, removed with everything in it at scope exit.
class temp_dir {
public:
  temp_dir() {
    static std::atomic<int> counter{0};
    const auto stamp = std::chrono::steady_clock::now().time_since_epoch().count();
    path_ = std::filesystem::temp_directory_path() /
            ("fasta2a-test-traffic-" + std::to_string(::getpid()) + "-" + std::to_string(stamp) + "-" +
             std::to_string(counter++));
    std::filesystem::create_directories(path_);
  }
  ~temp_dir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;

  /// Writes `text` to a file named `name` in the directory and returns its path.
  std::string write(const std::string& name, const std::string& text) const {
    const auto p = path_ / name;
    std::ofstream out(p, std::ios::binary);
    out << text;
    return p.string();
  }
  std::string path(const std::string& name) const { return (path_ / name).string(); }

private:
  std::filesystem::path path_;
};

/// One number per line, like the Megatron trace.
std::string numbers_text(const std::vector<bytes_t>& values) {
  std::string s;
  for (bytes_t v : values)
    s += std::to_string(v) + "\n";
  return s;
}

/// `count` numbers 0, 1, 2, ... one per line.
std::string sequence_text(std::size_t count) {
  std::vector<bytes_t> v(count);
  for (std::size_t k = 0; k < count; ++k)
    v[k] = k;
  return numbers_text(v);
}

/// The message of the fasta2a::error `f` throws; fails the test if it throws nothing.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const fasta2a::error& e) {
    return e.what();
  }
  FAIL("expected a fasta2a::error");
  return {};
}

bool all_multiples(const traffic_matrix& m, bytes_t granule) {
  for (Eigen::Index i = 0; i < m.rows(); ++i)
    for (Eigen::Index j = 0; j < m.cols(); ++j)
      if (m(i, j) % granule != 0)
        return false;
  return true;
}

bool rows_sum_to(const traffic_matrix& m, bytes_t expected) {
  for (Eigen::Index i = 0; i < m.rows(); ++i)
    if (m.row(i).sum() != expected)
      return false;
  return true;
}

std::vector<bytes_t> column_sums(const traffic_matrix& m) {
  std::vector<bytes_t> c(static_cast<std::size_t>(m.cols()), 0);
  for (Eigen::Index i = 0; i < m.rows(); ++i)
    for (Eigen::Index j = 0; j < m.cols(); ++j)
      c[static_cast<std::size_t>(j)] += m(i, j);
  return c;
}

double max_column_share(const traffic_matrix& m) {
  const auto c = column_sums(m);
  return static_cast<double>(*std::max_element(c.begin(), c.end())) / static_cast<double>(m.sum());
}

const std::vector<rank_t> sizes = {1, 2, 4, 7, 16, 32};
const std::vector<bytes_t> granules = {1, 64, 4096};
const std::vector<bytes_t> byte_counts = {0, 1, 4095, 1u << 20, 123456789};
} // namespace

// ----------------------------------------------------------------------------------------------
// Megatron trace
// ----------------------------------------------------------------------------------------------

TEST_CASE("traffic.read.megatron_count") {
  if (!have_megatron())
    return;
  CHECK(fasta2a::count_matrices(megatron, 32) == 600);
}

TEST_CASE("traffic.read.megatron_first_matrix_sums") {
  if (!have_megatron())
    return;
  const traffic_matrix m = fasta2a::read_matrix(megatron, 32);
  REQUIRE(m.rows() == 32);
  REQUIRE(m.cols() == 32);
  CHECK(rows_sum_to(m, 8192));
  CHECK(fasta2a::check_traffic(m, 32) == 32u * 8192u);
}

TEST_CASE("traffic.read.megatron_every_row_sums_to_8192_tokens") {
  if (!have_megatron())
    return;
  const auto start = std::chrono::steady_clock::now();
  const auto trace = fasta2a::read_trace(megatron, 32);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  MESSAGE("read_trace of the Megatron trace took ", seconds, " s");
#ifndef FASTA2A_SANITIZED
  CHECK(seconds < 1.0); // a bound on the plain build's speed: ASan+UBSan at -O0 took 2.6 s on a loaded machine
#endif
  REQUIRE(trace.size() == 600);
  std::size_t bad_rows = 0;
  for (const auto& m : trace)
    for (Eigen::Index i = 0; i < 32; ++i)
      bad_rows += m.row(i).sum() != 8192;
  CHECK(bad_rows == 0);
}

TEST_CASE("traffic.read.megatron_read_matrix_equals_read_trace") {
  if (!have_megatron())
    return;
  const auto trace = fasta2a::read_trace(megatron, 32);
  for (std::size_t k : {std::size_t{0}, std::size_t{1}, std::size_t{299}, std::size_t{599}}) {
    CAPTURE(k);
    CHECK(fasta2a::read_matrix(megatron, 32, k) == trace[k]);
  }
}

TEST_CASE("traffic.read.megatron_unit_scaling") {
  if (!have_megatron())
    return;
  const traffic_matrix tokens = fasta2a::read_matrix(megatron, 32, 5);
  const traffic_matrix bytes = fasta2a::read_matrix(megatron, 32, 5, 8192);
  CHECK(bytes == (tokens * bytes_t{8192}).eval());
  CHECK(rows_sum_to(bytes, bytes_t{8192} * 8192));
  const auto trace = fasta2a::read_trace(megatron, 32, 8192);
  CHECK(trace[5] == bytes);
}

TEST_CASE("traffic.read.megatron_wrong_n_is_not_whole") {
  if (!have_megatron())
    return;
  // 614400 numbers are 600 matrices of 32 x 32 but not a whole number of 31 x 31 ones.
  const std::string what = error_of([] { fasta2a::count_matrices(megatron, 31); });
  CHECK(contains(what, "614400 numbers"));
  CHECK(contains(what, "31 x 31"));
  CHECK(contains(what, "truncated?"));
}

// ----------------------------------------------------------------------------------------------
// Readers on small files
// ----------------------------------------------------------------------------------------------

TEST_CASE("traffic.read.small_file_layout") {
  temp_dir dir;
  // Two 2 x 2 matrices, with mixed whitespace and no final newline.
  const std::string path = dir.write("two.txt", "1 2\n3\t4\r\n\n 5 6 7   8");
  CHECK(fasta2a::count_matrices(path, 2) == 2);
  CHECK(fasta2a::count_matrices(path, 1) == 8);
  const traffic_matrix m1 = fasta2a::read_matrix(path, 2, 1, 10);
  CHECK(m1(0, 0) == 50);
  CHECK(m1(0, 1) == 60);
  CHECK(m1(1, 0) == 70);
  CHECK(m1(1, 1) == 80);
  const auto trace = fasta2a::read_trace(path, 2);
  REQUIRE(trace.size() == 2);
  CHECK(trace[0](1, 0) == 3);
  CHECK(trace[1] == (m1 / bytes_t{10}).eval());
}

TEST_CASE("traffic.read.largest_64_bit_value") {
  temp_dir dir;
  const std::string path = dir.write("max.txt", "18446744073709551615\n");
  CHECK(fasta2a::read_matrix(path, 1)(0, 0) == std::numeric_limits<bytes_t>::max());
  const std::string over = dir.write("over.txt", "18446744073709551616\n");
  const std::string what = error_of([&] { fasta2a::read_matrix(over, 1); });
  CHECK(contains(what, "line 1"));
  CHECK(contains(what, "'18446744073709551616'"));
  CHECK(contains(what, "64 bits"));
}

TEST_CASE("traffic.read.missing_file") {
  temp_dir dir;
  const std::string path = dir.path("does-not-exist.txt");
  for (auto f : {+[](const std::string& p) { fasta2a::count_matrices(p, 2); },
                 +[](const std::string& p) { fasta2a::read_matrix(p, 2); },
                 +[](const std::string& p) { fasta2a::read_trace(p, 2); }}) {
    const std::string what = error_of([&] { f(path); });
    CHECK(contains(what, path));
    CHECK(contains(what, "cannot open"));
  }
}

TEST_CASE("traffic.read.not_a_regular_file") {
  // Issue 50, defect 11: a FIFO blocked the readers in open() for ever (nobody writes it); /dev/null
  // read as an empty trace, a directory as "out of memory" on some systems. Each is refused by its
  // type before it is opened, promptly, naming the path and what it is.
  temp_dir dir;
  const std::string fifo = dir.path("fifo");
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  const std::string subdir = dir.path("subdir");
  std::filesystem::create_directory(subdir);
  const std::pair<std::string, std::string> inputs[] = {
      {fifo, "a FIFO"}, {"/dev/null", "a character device"}, {subdir, "a directory"}};
  for (const auto& input : inputs)
    for (auto f : {+[](const std::string& p) { fasta2a::count_matrices(p, 2); },
                   +[](const std::string& p) { fasta2a::read_matrix(p, 2); },
                   +[](const std::string& p) { fasta2a::read_trace(p, 2); }}) {
      // Named copies, not structured bindings: clang 14 cannot capture those in a lambda.
      const std::string& path = input.first;
      const std::string& kind = input.second;
      CAPTURE(path);
      CHECK(fasta2a::testing::error_reading_promptly(path, [&] { f(path); }) ==
            "trace file '" + path + "' is " + kind + ", not a regular file");
    }
}

TEST_CASE("traffic.read.malformed_tokens") {
  temp_dir dir;
  for (const std::string token : {"-3", "12x", "1e5", "+4", "0x10", "3.0"}) {
    CAPTURE(token);
    // The bad token sits on line 6, after the first 2 x 2 matrix: it is an error all the same.
    const std::string path = dir.write("bad.txt", "1\n2\n3\n4\n5\n" + token + "\n7\n8\n");
    for (auto f : {+[](const std::string& p) { fasta2a::count_matrices(p, 2); },
                   +[](const std::string& p) { fasta2a::read_matrix(p, 2, 0); },
                   +[](const std::string& p) { fasta2a::read_trace(p, 2); }}) {
      const std::string what = error_of([&] { f(path); });
      CHECK(contains(what, path));
      CHECK(contains(what, "line 6"));
      CHECK(contains(what, "'" + token + "'"));
      CHECK(contains(what, "not a non-negative decimal integer"));
    }
  }
}

TEST_CASE("traffic.read.truncated_file") {
  temp_dir dir;
  const std::string path = dir.write("short.txt", sequence_text(1000));
  const std::string what = error_of([&] { fasta2a::read_trace(path, 32); });
  CHECK(contains(what, path));
  CHECK(contains(what, "holds 1000 numbers, not a whole number of 32 x 32 matrices: truncated?"));
  CHECK_THROWS_WITH_AS(fasta2a::read_matrix(path, 32), doctest::Contains("truncated?"), fasta2a::error);
  CHECK_THROWS_WITH_AS(fasta2a::count_matrices(path, 32), doctest::Contains("truncated?"), fasta2a::error);
}

TEST_CASE("traffic.read.empty_file") {
  temp_dir dir;
  for (const std::string text : {"", "  \n\n\t \n"}) {
    const std::string path = dir.write("empty.txt", text);
    const std::string what = error_of([&] { fasta2a::count_matrices(path, 4); });
    CHECK(contains(what, path));
    CHECK(contains(what, "empty"));
    CHECK_THROWS_WITH_AS(fasta2a::read_matrix(path, 4), doctest::Contains("empty"), fasta2a::error);
    CHECK_THROWS_WITH_AS(fasta2a::read_trace(path, 4), doctest::Contains("empty"), fasta2a::error);
  }
}

TEST_CASE("traffic.read.non_positive_n") {
  temp_dir dir;
  const std::string path = dir.write("one.txt", "1\n");
  for (rank_t n : {0, -1}) {
    CHECK_THROWS_WITH_AS(fasta2a::count_matrices(path, n), doctest::Contains("must be positive"), fasta2a::error);
    CHECK_THROWS_WITH_AS(fasta2a::read_matrix(path, n), doctest::Contains("must be positive"), fasta2a::error);
    CHECK_THROWS_WITH_AS(fasta2a::read_trace(path, n), doctest::Contains("must be positive"), fasta2a::error);
  }
}

TEST_CASE("traffic.read.index_past_end") {
  temp_dir dir;
  const std::string path = dir.write("three.txt", sequence_text(3 * 4));
  CHECK(fasta2a::read_matrix(path, 2, 2)(1, 1) == 11);
  const std::string what = error_of([&] { fasta2a::read_matrix(path, 2, 3); });
  CHECK(contains(what, "matrix index 3 is past the end of '" + path + "', which holds 3 matrices of 2 x 2"));
  // An index so large that index * n * n wraps must still be reported, not alias a real matrix.
  CHECK_THROWS_WITH_AS(fasta2a::read_matrix(path, 2, std::numeric_limits<std::size_t>::max() / 4 + 1),
                       doctest::Contains("past the end"), fasta2a::error);
}

TEST_CASE("traffic.read.unit_zero_and_entry_overflow") {
  temp_dir dir;
  const bytes_t big = (bytes_t{1} << 62) + 1;
  const std::string path = dir.write("big.txt", numbers_text({1, 2, 3, big}));
  CHECK_THROWS_WITH_AS(fasta2a::read_matrix(path, 2, 0, 0), doctest::Contains("unit"), fasta2a::error);
  CHECK_THROWS_WITH_AS(fasta2a::read_trace(path, 2, 0), doctest::Contains("unit"), fasta2a::error);
  CHECK(fasta2a::read_matrix(path, 2, 0, 3)(1, 1) == big * 3);
  for (auto f : {+[](const std::string& p) { fasta2a::read_matrix(p, 2, 0, 4); },
                 +[](const std::string& p) { fasta2a::read_trace(p, 2, 4); }}) {
    const std::string what = error_of([&] { f(path); });
    CHECK(contains(what, path));
    CHECK(contains(what, "line 4"));
    CHECK(contains(what, "entry [1][1] of matrix 0"));
    CHECK(contains(what, "overflows 64 bits"));
  }
}

TEST_CASE("traffic.read.row_sum_overflow_in_file") {
  temp_dir dir;
  const bytes_t half = bytes_t{1} << 63;
  // Matrix 1's row 0 sums to 2^64: each entry fits, the sum does not.
  const std::string path = dir.write("rows.txt", numbers_text({1, 1, 1, 1, half, half, 0, 0}));
  CHECK(fasta2a::read_matrix(path, 2, 0) == traffic_matrix::Ones(2, 2));
  for (auto f : {+[](const std::string& p) { fasta2a::read_matrix(p, 2, 1); },
                 +[](const std::string& p) { fasta2a::read_trace(p, 2); }}) {
    const std::string what = error_of([&] { f(path); });
    CHECK(contains(what, "matrix 1 of trace file '" + path + "'"));
    CHECK(contains(what, "row 0"));
  }
}

// ----------------------------------------------------------------------------------------------
// check_traffic
// ----------------------------------------------------------------------------------------------

TEST_CASE("traffic.check.shape") {
  CHECK_THROWS_WITH_AS(fasta2a::check_traffic(traffic_matrix::Zero(31, 32), 32),
                       "traffic matrix is 31 x 32, the topology has 32 ranks", fasta2a::error);
  CHECK_THROWS_WITH_AS(fasta2a::check_traffic(traffic_matrix::Zero(8, 8), 16),
                       "traffic matrix is 8 x 8, the topology has 16 ranks", fasta2a::error);
  CHECK_THROWS_WITH_AS(fasta2a::check_traffic(traffic_matrix::Zero(0, 0), 0), doctest::Contains("must be positive"),
                       fasta2a::error);
  CHECK(fasta2a::check_traffic(traffic_matrix::Zero(4, 4), 4) == 0);
  traffic_matrix m(2, 2);
  m << 1, 2, 3, 4;
  CHECK(fasta2a::check_traffic(m, 2) == 10);
}

TEST_CASE("traffic.check.overflow") {
  const bytes_t near = (bytes_t{1} << 63) + 5;
  traffic_matrix rows = traffic_matrix::Zero(3, 3);
  rows(2, 0) = near;
  rows(2, 1) = near;
  CHECK_THROWS_WITH_AS(fasta2a::check_traffic(rows, 3), doctest::Contains("row 2"), fasta2a::error);

  traffic_matrix cols = traffic_matrix::Zero(3, 3);
  cols(0, 1) = near;
  cols(2, 1) = near;
  CHECK_THROWS_WITH_AS(fasta2a::check_traffic(cols, 3), doctest::Contains("column 1"), fasta2a::error);

  // Every row and column fits, the total does not.
  traffic_matrix total = traffic_matrix::Zero(2, 2);
  total(0, 0) = near;
  total(1, 1) = near;
  CHECK_THROWS_WITH_AS(fasta2a::check_traffic(total, 2), doctest::Contains("total"), fasta2a::error);

  traffic_matrix fits = traffic_matrix::Zero(2, 2);
  fits(0, 0) = std::numeric_limits<bytes_t>::max();
  CHECK(fasta2a::check_traffic(fits, 2) == std::numeric_limits<bytes_t>::max());
}

// ----------------------------------------------------------------------------------------------
// Generators
// ----------------------------------------------------------------------------------------------

TEST_CASE("traffic.gen.uniform_rows_columns_granules") {
  for (rank_t n : sizes)
    for (bytes_t g : granules)
      for (bytes_t b : byte_counts) {
        CAPTURE(n);
        CAPTURE(g);
        CAPTURE(b);
        const traffic_matrix m = fasta2a::uniform_traffic(n, b, 7, g);
        REQUIRE(m.rows() == n);
        CHECK(rows_sum_to(m, b / g * g));
        CHECK(all_multiples(m, g));
        const auto c = column_sums(m);
        CHECK(*std::max_element(c.begin(), c.end()) - *std::min_element(c.begin(), c.end()) <= g);
        // Entries differ by at most one granule too: "as evenly as the granule allows".
        CHECK(m.maxCoeff() - m.minCoeff() <= g);
      }
}

TEST_CASE("traffic.gen.zipf_and_hotspot_rows_exact") {
  for (std::uint64_t seed = 0; seed < 200; ++seed)
    for (rank_t n : {1, 3, 8, 32}) {
      const bytes_t g = granules[seed % granules.size()];
      const bytes_t b = byte_counts[seed % byte_counts.size()];
      CAPTURE(seed);
      CAPTURE(n);
      const double s = static_cast<double>(seed % 4) * 0.5;
      const traffic_matrix z = fasta2a::zipf_traffic(n, s, b, seed, g);
      CHECK(rows_sum_to(z, b / g * g));
      CHECK(all_multiples(z, g));
      const rank_t hot = 1 + static_cast<rank_t>(seed % static_cast<std::uint64_t>(n));
      const traffic_matrix h = fasta2a::hotspot_traffic(n, hot, 0.7, b, seed, g);
      CHECK(rows_sum_to(h, b / g * g));
      CHECK(all_multiples(h, g));
    }
}

TEST_CASE("traffic.gen.same_seed_same_matrix") {
  for (std::uint64_t seed = 0; seed < 200; seed += 7) {
    CAPTURE(seed);
    CHECK(fasta2a::zipf_traffic(16, 1.2, 1 << 20, seed, 64) == fasta2a::zipf_traffic(16, 1.2, 1 << 20, seed, 64));
    CHECK(fasta2a::hotspot_traffic(16, 3, 0.5, 1 << 20, seed, 64) ==
          fasta2a::hotspot_traffic(16, 3, 0.5, 1 << 20, seed, 64));
    CHECK(fasta2a::lognormal_traffic(16, 1.0, 1 << 20, seed, 64) ==
          fasta2a::lognormal_traffic(16, 1.0, 1 << 20, seed, 64));
    CHECK(fasta2a::uniform_traffic(16, 1 << 20, seed, 64) == fasta2a::uniform_traffic(16, 1 << 20, 0, 64));
  }
}

TEST_CASE("traffic.gen.known_values_pin_the_generators") {
  // Pinned outputs: a change here means every recorded benchmark input changed too.
  const traffic_matrix z = fasta2a::zipf_traffic(4, 1.0, 1000, 42);
  const traffic_matrix h = fasta2a::hotspot_traffic(4, 1, 0.5, 1000, 42);
  const traffic_matrix l = fasta2a::lognormal_traffic(4, 1.0, 1000, 42);
  traffic_matrix z_expected(4, 4), h_expected(4, 4), l_expected(4, 4);
  z_expected << 217, 90, 558, 135, //
      268, 107, 493, 132,          //
      235, 119, 476, 170,          //
      225, 106, 528, 141;
  h_expected << 167, 167, 500, 166, //
      166, 167, 500, 167,           //
      167, 166, 500, 167,           //
      167, 167, 500, 166;
  l_expected << 367, 366, 366, 366, //
      96, 97, 97, 96,               //
      183, 183, 183, 183,           //
      189, 189, 188, 189;
  CHECK(z == z_expected);
  CHECK(h == h_expected);
  CHECK(l == l_expected);
}

TEST_CASE("traffic.gen.different_seeds_differ") {
  int zipf_same = 0, hot_same = 0, logn_same = 0;
  for (std::uint64_t seed = 0; seed < 200; ++seed)
    for (rank_t n : {4, 16}) {
      zipf_same += fasta2a::zipf_traffic(n, 1.0, 1 << 20, seed) == fasta2a::zipf_traffic(n, 1.0, 1 << 20, seed + 1);
      logn_same += fasta2a::lognormal_traffic(n, 1.0, 1 << 20, seed) ==
                   fasta2a::lognormal_traffic(n, 1.0, 1 << 20, seed + 1);
      // Hot sets of 2 out of n can coincide by chance (1 in 6 for n = 4), so only most pairs must differ.
      hot_same += fasta2a::hotspot_traffic(n, 2, 0.8, 1 << 20, seed) ==
                  fasta2a::hotspot_traffic(n, 2, 0.8, 1 << 20, seed + 1);
    }
  CHECK(zipf_same == 0);
  CHECK(logn_same == 0);
  CHECK(hot_same < 100); // out of 400; expected about 200/6 + 200/120
}

TEST_CASE("traffic.gen.zipf_skew_grows_with_s") {
  for (std::uint64_t seed = 0; seed < 200; ++seed)
    for (rank_t n : {8, 32}) {
      CAPTURE(seed);
      CAPTURE(n);
      double previous = 0;
      for (double s : {0.0, 0.8, 1.6, 3.0}) {
        CAPTURE(s);
        const double share = max_column_share(fasta2a::zipf_traffic(n, s, bytes_t{1} << 30, seed, 4096));
        CHECK(share > previous);
        previous = share;
      }
    }
  // s = 0 is near-uniform: only the jitter separates columns.
  const double flat = max_column_share(fasta2a::zipf_traffic(32, 0.0, bytes_t{1} << 30, 3));
  CHECK(flat < 1.15 / 32);
}

TEST_CASE("traffic.gen.zipf_hot_expert_is_shared") {
  // Every sender's largest destination is the same rank once s is large.
  const traffic_matrix m = fasta2a::zipf_traffic(16, 2.0, bytes_t{1} << 30, 11);
  Eigen::Index first = 0;
  m.row(0).maxCoeff(&first);
  for (Eigen::Index i = 1; i < 16; ++i) {
    Eigen::Index j = 0;
    m.row(i).maxCoeff(&j);
    CHECK(j == first);
  }
}

TEST_CASE("traffic.gen.hotspot_share") {
  for (std::uint64_t seed = 0; seed < 200; ++seed)
    for (rank_t n : {8, 32}) {
      // share / hot stays above the cold ranks' (1 - share) / (n - hot), so the hot columns are the
      // largest ones and the test can find them without knowing which ranks the seed chose.
      const rank_t hot = 1 + static_cast<rank_t>(seed % 3);
      const double share = 0.5 + 0.1 * static_cast<double>(seed % 5);
      CAPTURE(seed);
      CAPTURE(n);
      CAPTURE(hot);
      CAPTURE(share);
      const bytes_t b = bytes_t{1} << 24;
      const bytes_t g = 64;
      const traffic_matrix m = fasta2a::hotspot_traffic(n, hot, share, b, seed, g);
      auto c = column_sums(m);
      std::sort(c.begin(), c.end(), std::greater<>());
      bytes_t hot_bytes = 0;
      for (rank_t k = 0; k < hot; ++k)
        hot_bytes += c[static_cast<std::size_t>(k)];
      const double got = static_cast<double>(hot_bytes) / static_cast<double>(m.sum());
      // Each row's hot part is rounded to the nearest granule.
      CHECK(std::abs(got - share) <= static_cast<double>(g) / static_cast<double>(b));
      // Hot columns share evenly; so do cold ones.
      CHECK(c[0] - c[static_cast<std::size_t>(hot - 1)] <= g * static_cast<bytes_t>(n));
      CHECK(c[static_cast<std::size_t>(hot)] - c.back() <= g * static_cast<bytes_t>(n));
    }
  // hot == n: everything is hot, which is uniform.
  const traffic_matrix all = fasta2a::hotspot_traffic(8, 8, 0.25, 8000, 5);
  CHECK(all == fasta2a::uniform_traffic(8, 8000, 5));
}

TEST_CASE("traffic.gen.lognormal_mean_and_spread") {
  const bytes_t b = bytes_t{1} << 30;
  double sum = 0;
  std::size_t ranks = 0;
  bytes_t smallest = std::numeric_limits<bytes_t>::max(), largest = 0;
  for (std::uint64_t seed = 0; seed < 20; ++seed) {
    const traffic_matrix m = fasta2a::lognormal_traffic(256, 0.5, b, seed, 4096);
    CHECK(all_multiples(m, 4096));
    for (Eigen::Index i = 0; i < m.rows(); ++i) {
      const bytes_t row = m.row(i).sum();
      sum += static_cast<double>(row);
      smallest = std::min(smallest, row);
      largest = std::max(largest, row);
      ++ranks;
      // Split evenly: entries of a row differ by at most one granule.
      CHECK(m.row(i).maxCoeff() - m.row(i).minCoeff() <= 4096);
    }
  }
  const double mean = sum / static_cast<double>(ranks) / static_cast<double>(b);
  MESSAGE("lognormal mean row sum / bytes_per_rank = ", mean);
  // 5120 draws with sigma 0.5: the standard error of the mean is about 0.0075.
  CHECK(mean == doctest::Approx(1.0).epsilon(0.04));
  CHECK(largest > 2 * smallest);
  // sigma = 0 is exactly bytes_per_rank per rank.
  CHECK(rows_sum_to(fasta2a::lognormal_traffic(16, 0.0, 1 << 20, 9, 4096), 1 << 20));
}

TEST_CASE("traffic.gen.lognormal_overflow") {
  bool threw = false;
  for (std::uint64_t seed = 0; seed < 50 && !threw; ++seed) {
    try {
      fasta2a::lognormal_traffic(64, 3.0, bytes_t{1} << 62, seed);
    } catch (const fasta2a::error& e) {
      threw = true;
      CHECK(contains(e.what(), "overflows 64 bits"));
      CHECK(contains(e.what(), "rank "));
    }
  }
  CHECK(threw);
}

TEST_CASE("traffic.gen.parameter_errors") {
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  using fasta2a::error;
  CHECK_THROWS_WITH_AS(fasta2a::uniform_traffic(0, 100, 1), doctest::Contains("must be positive"), error);
  CHECK_THROWS_WITH_AS(fasta2a::uniform_traffic(4, 100, 1, 0), doctest::Contains("granule"), error);
  CHECK_THROWS_WITH_AS(fasta2a::zipf_traffic(-2, 1.0, 100, 1), doctest::Contains("must be positive"), error);
  CHECK_THROWS_WITH_AS(fasta2a::zipf_traffic(4, 1.0, 100, 1, 0), doctest::Contains("granule"), error);
  CHECK_THROWS_WITH_AS(fasta2a::zipf_traffic(4, -0.5, 100, 1), doctest::Contains("non-negative"), error);
  CHECK_THROWS_WITH_AS(fasta2a::zipf_traffic(4, inf, 100, 1), doctest::Contains("finite"), error);
  CHECK_THROWS_WITH_AS(fasta2a::zipf_traffic(4, nan, 100, 1), doctest::Contains("finite"), error);
  CHECK_THROWS_WITH_AS(fasta2a::hotspot_traffic(0, 1, 0.5, 100, 1), doctest::Contains("must be positive"), error);
  CHECK_THROWS_WITH_AS(fasta2a::hotspot_traffic(4, 0, 0.5, 100, 1), doctest::Contains("hot must be in [1, 4]"), error);
  CHECK_THROWS_WITH_AS(fasta2a::hotspot_traffic(4, 5, 0.5, 100, 1), doctest::Contains("got 5"), error);
  CHECK_THROWS_WITH_AS(fasta2a::hotspot_traffic(4, 1, 1.5, 100, 1), doctest::Contains("share must be in [0, 1]"),
                       error);
  CHECK_THROWS_WITH_AS(fasta2a::hotspot_traffic(4, 1, -0.1, 100, 1), doctest::Contains("share"), error);
  CHECK_THROWS_WITH_AS(fasta2a::hotspot_traffic(4, 1, nan, 100, 1), doctest::Contains("finite"), error);
  CHECK_THROWS_WITH_AS(fasta2a::hotspot_traffic(4, 1, 0.5, 100, 1, 0), doctest::Contains("granule"), error);
  CHECK_THROWS_WITH_AS(fasta2a::lognormal_traffic(0, 1.0, 100, 1), doctest::Contains("must be positive"), error);
  CHECK_THROWS_WITH_AS(fasta2a::lognormal_traffic(4, -1.0, 100, 1), doctest::Contains("non-negative"), error);
  CHECK_THROWS_WITH_AS(fasta2a::lognormal_traffic(4, inf, 100, 1), doctest::Contains("finite"), error);
  CHECK_THROWS_WITH_AS(fasta2a::lognormal_traffic(4, 1.0, 100, 1, 0), doctest::Contains("granule"), error);
  // Boundary values are accepted.
  CHECK_NOTHROW(fasta2a::hotspot_traffic(4, 4, 0.0, 100, 1));
  CHECK_NOTHROW(fasta2a::hotspot_traffic(4, 1, 1.0, 100, 1));
  CHECK_NOTHROW(fasta2a::zipf_traffic(1, 0.0, 100, 1));
}

TEST_CASE("parse_bytes.suffixes_and_refusals") {
  CHECK(fasta2a::parse_bytes("0") == 0);
  CHECK(fasta2a::parse_bytes("4096") == 4096);
  CHECK(fasta2a::parse_bytes("4K") == 4096);
  CHECK(fasta2a::parse_bytes("4KiB") == 4096);
  CHECK(fasta2a::parse_bytes("16M") == bytes_t{16} << 20);
  CHECK(fasta2a::parse_bytes("16MiB") == bytes_t{16} << 20);
  CHECK(fasta2a::parse_bytes("3G") == bytes_t{3} << 30);
  CHECK(fasta2a::parse_bytes("18446744073709551615") == std::numeric_limits<bytes_t>::max());
  CHECK(fasta2a::parse_bytes("17179869183G") == bytes_t{17179869183} << 30); // the largest G that fits
  const auto refused = [](std::string_view text) {
    try {
      fasta2a::parse_bytes(text, "--bytes");
    } catch (const fasta2a::error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  for (std::string_view bad : {"", "K", "1.5M", "-4", "+4", "4k", "4 K", "4KB", "0x10", "M16"}) {
    CAPTURE(bad);
    const std::string msg = refused(bad);
    CHECK(msg.find("--bytes expects a non-negative integer") != std::string::npos);
  }
  CHECK(refused("-4").find("(negative)") != std::string::npos);
  CHECK(refused("18446744073709551616").find("too large (at most 18446744073709551615)") != std::string::npos);
  CHECK(refused("17179869184G").find("overflows 64 bits") != std::string::npos);
}
