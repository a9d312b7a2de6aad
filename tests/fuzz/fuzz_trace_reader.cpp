// libFuzzer target: the trace readers (count_matrices, read_matrix, read_trace in traffic.hpp) and
// the CLI's loader over them (apps/cli/workload.cpp, compiled in), on arbitrary file contents.
// Input: byte 0 picks n (1..12 ranks), byte 1 the unit (bytes per count), byte 2 the matrix
// index; the rest is the file, which the readers open by path (an in-memory file).
// Properties: only fasta2a::error escapes; the readers accept exactly the files an independent
// tokenizer accepts (whitespace-separated decimal integers below 2^64, a positive whole number of
// n x n matrices) and give exactly its numbers times the unit; read_matrix(k) is read_trace()[k];
// count_matrices is the trace's length; a trace written back as text reads back equal; the CLI's
// load_workload gives what the library readers give.
#include "fuzz_common.hpp"

#include "workload.hpp" // apps/cli

#include <fasta2a/traffic.hpp>

#include <limits>
#include <optional>
#include <vector>

namespace fa = fasta2a;

namespace {

// The reference: the numbers of the file, or nothing where a token is not a decimal integer
// below 2^64. Written independently of traffic.hpp's tokenizer (isspace in the C locale).
std::optional<std::vector<fa::bytes_t>> reference_numbers(std::string_view text) {
  std::vector<fa::bytes_t> out;
  std::size_t i = 0;
  auto space = [](char c) { return c == ' ' || (c >= '\t' && c <= '\r'); };
  while (i < text.size()) {
    if (space(text[i])) {
      ++i;
      continue;
    }
    unsigned __int128 v = 0;
    for (; i < text.size() && !space(text[i]); ++i) {
      if (text[i] < '0' || text[i] > '9') return std::nullopt;
      v = v * 10 + static_cast<unsigned>(text[i] - '0');
      if (v > std::numeric_limits<fa::bytes_t>::max()) return std::nullopt;
    }
    out.push_back(static_cast<fa::bytes_t>(v));
  }
  return out;
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static fuzz::memory_file file;
  fuzz::bytes in(data, size);
  const fa::rank_t n = 1 + in.u8() % 12;
  const std::uint8_t unit_pick = in.u8();
  const fa::bytes_t unit = unit_pick < 128   ? 1
                           : unit_pick < 192 ? 8192
                           : unit_pick < 224 ? fa::bytes_t{1} << (unit_pick % 64)
                           : unit_pick < 255 ? unit_pick - 224u // 0 included: refused
                                             : ~fa::bytes_t{0};
  const std::size_t index = in.u8();
  const std::string_view text = in.rest();
  const std::string& path = file.write(text);

  // What the reference says the readers must do.
  const auto numbers = reference_numbers(text);
  const auto per_matrix = static_cast<std::size_t>(n) * static_cast<std::size_t>(n);
  const bool well_formed = numbers && !numbers->empty() && numbers->size() % per_matrix == 0;

  std::size_t count = 0;
  const bool counted = fuzz::documented_errors_only("count_matrices", [&] { count = fa::count_matrices(path, n); });
  FUZZ_CHECK(counted == well_formed, counted ? "count_matrices accepts a malformed trace" : "count_matrices refuses a well-formed trace");

  std::vector<fa::traffic_matrix> trace;
  const bool traced = fuzz::documented_errors_only("read_trace", [&] { trace = fa::read_trace(path, n, unit); });
  FUZZ_CHECK(!traced || counted, "read_trace accepts what count_matrices refuses");
  if (traced) {
    FUZZ_CHECK(trace.size() == count, "read_trace and count_matrices disagree on the number of matrices");
    for (std::size_t k = 0; k < trace.size(); ++k)
      for (fa::rank_t i = 0; i < n; ++i)
        for (fa::rank_t j = 0; j < n; ++j) {
          const fa::bytes_t v = (*numbers)[k * per_matrix + static_cast<std::size_t>(i) * n + j];
          FUZZ_CHECK(trace[k](i, j) == v * unit && (v == 0 || trace[k](i, j) / v == unit),
                     "entry [" + std::to_string(i) + "][" + std::to_string(j) + "] of matrix " + std::to_string(k) +
                         " is not the file's number times the unit");
        }
  }
  // Refusals of a well-formed file: only where the unit makes an entry or a sum overflow, or is 0.
  if (counted && !traced && unit == 1) {
    bool overflow = false;
    for (std::size_t k = 0; k < count && !overflow; ++k) {
      for (fa::rank_t i = 0; i < n; ++i) {
        unsigned __int128 row = 0, col = 0;
        for (fa::rank_t j = 0; j < n; ++j) {
          row += (*numbers)[k * per_matrix + static_cast<std::size_t>(i) * n + j];
          col += (*numbers)[k * per_matrix + static_cast<std::size_t>(j) * n + i];
        }
        overflow = overflow || row > std::numeric_limits<fa::bytes_t>::max() ||
                   col > std::numeric_limits<fa::bytes_t>::max();
      }
    }
    // The total of a matrix may overflow too; check_traffic refuses that as well.
    if (!overflow)
      for (std::size_t k = 0; k < count && !overflow; ++k) {
        unsigned __int128 total = 0;
        for (std::size_t e = 0; e < per_matrix; ++e) total += (*numbers)[k * per_matrix + e];
        overflow = total > std::numeric_limits<fa::bytes_t>::max();
      }
    FUZZ_CHECK(overflow, "read_trace with unit 1 refuses a well-formed trace whose sums fit in 64 bits");
  }

  // read_matrix(k) is matrix k of the trace; past the end it is an error.
  for (std::size_t k : {std::size_t{0}, index, count, std::numeric_limits<std::size_t>::max() / 2}) {
    fa::traffic_matrix m;
    const bool one = fuzz::documented_errors_only("read_matrix", [&] { m = fa::read_matrix(path, n, k, unit); });
    if (k >= count) FUZZ_CHECK(!one, "read_matrix accepts an index past the end");
    else if (traced) FUZZ_CHECK(one && m == trace[k], "read_matrix(k) is not matrix k of read_trace");
    if (one) FUZZ_CHECK(counted && k < count, "read_matrix accepts a trace count_matrices refuses");
  }

  // The CLI's loader is these readers.
  cli::options o;
  o.input = cli::input_kind::matrix;
  o.matrix_path = path;
  o.unit = unit;
  o.all = index % 2 == 0;
  o.index = index % 3;
  cli::workload w;
  const bool loaded = fuzz::documented_errors_only("cli::load_workload", [&] { w = cli::load_workload(o, n); });
  if (o.all) {
    FUZZ_CHECK(loaded == traced, "load_workload --all disagrees with read_trace");
    if (loaded) FUZZ_CHECK(w.matrices == trace, "load_workload --all gives other matrices than read_trace");
  } else if (traced) {
    FUZZ_CHECK(loaded == (o.index < count), "load_workload --index disagrees with read_matrix");
    if (loaded) FUZZ_CHECK(w.matrices.size() == 1 && w.matrices[0] == trace[o.index] && w.first_index == o.index,
                           "load_workload --index gives another matrix than read_trace");
  }

  // Written back as text (unit 1), the trace reads back equal.
  if (traced && unit == 1) {
    std::string back;
    for (const fa::traffic_matrix& m : trace)
      for (fa::rank_t i = 0; i < n; ++i) {
        for (fa::rank_t j = 0; j < n; ++j) back += std::to_string(m(i, j)) + (j + 1 < n ? " " : "\n");
      }
    std::vector<fa::traffic_matrix> again;
    const bool reread = fuzz::documented_errors_only("read_trace of a written trace",
                                                     [&] { again = fa::read_trace(file.write(back), n, 1); });
    FUZZ_CHECK(reread && again == trace, "a trace written back as text does not read back equal");
  }
  return 0;
}
