// fasta2a CLI: what the commands print and write: number formatting, the `fasta2a plan` table and
// its report lines (JSON, one object per matrix), statistics over matrices, output files.
#pragma once

#include <fasta2a/common.hpp>

#include <cstddef>
#include <ostream>
#include <string>
#include <vector>

namespace cli {

namespace fa = fasta2a;
using fasta2a::bytes_t;
using fasta2a::rank_t;

/// Bytes per MiB, for tables.
inline constexpr double mib = 1024.0 * 1024.0;

/// printf into a std::string: the tables need fixed-width numbers, and g++ 12 has no <format>.
/// Output past 511 bytes is cut.
[[gnu::format(printf, 1, 2)]] std::string strf(const char* fmt, ...);

/// The median, or NaN for no values.
double median(std::vector<double> v);

/// The median of the finite values (NaN ratios of empty matrices left out), or NaN if none is.
double finite_median(const std::vector<double>& v);

/// a / b, or NaN (left out of medians, null in reports) when b is zero: an empty matrix has no
/// meaningful speed-up.
double ratio(double a, double b);

/// Writes `text` to `path`, or throws fasta2a::error naming the file (`what`: "JSON", "SVG").
void write_file(const std::string& path, const std::string& text, const char* what);

/// What one matrix's row of the `fasta2a plan` table (and line of its report) holds.
struct row {
  std::size_t index = 0;
  rank_t ranks = 0;
  int servers = 0, gpus = 0;
  bytes_t bytes = 0;
  std::size_t stages = 0;
  bytes_t scaleup_bytes = 0;
  bytes_t staging_max = 0;     // the largest per-rank staging buffer
  long double staging_sum = 0; // all ranks' buffers: a sum that may pass 64 bits, shown in MiB only
  double lower_bound_s = 0, lower_bound_alpha_s = 0, fast_s = 0, spread_s = 0, direct_s = 0, synthesis_us = 0, synthesis_rank_us = 0;
  std::string decomposer, choice; // which schedule the FAST plan uses, and why (adaptive choices)
  bytes_t staging_budget = 0;      // the plan's (0: none)
  std::uint32_t staging_ring = 0;  // slots per ring where staging is shared
  bytes_t buffer_max = 0;          // the most bytes any rank sends or receives
  double staging_over_own_max = 0; // the largest of any rank's staging over its own larger buffer
};

/// The two header lines of the `fasta2a plan` table.
void print_header(std::ostream& os);

/// One row of the `fasta2a plan` table.
void print_row(std::ostream& os, const row& r);

/// One line of `fasta2a plan --report`: a JSON object of the row's figures (keys documented in
/// plan_usage), then a newline.
void write_report_line(std::ostream& os, const row& r);

/// What one matrix's row of `fasta2a plan --rank R` holds: rank R's part only, no whole plan and
/// no baselines (figures that need every rank's scale-up loads are left out).
struct rank_row {
  std::size_t index = 0;
  rank_t ranks = 0, rank = 0;
  int servers = 0, gpus = 0;
  bytes_t bytes = 0;           // the whole matrix's
  std::size_t stages = 0, pieces = 0, ops = 0;
  bytes_t staging = 0;         // rank R's staging buffer
  bytes_t staging_max = 0;     // the largest of any rank (a view knows every rank's size)
  double lower_bound_s = 0, lower_bound_alpha_s = 0, scaleout_s = 0, synthesis_rank_us = 0;
  std::string decomposer, choice;
  std::string checked; // "whole plan" or "own messages": how the view was checked
};

/// The two header lines of the `fasta2a plan --rank R` table.
void print_rank_header(std::ostream& os);

/// One row of the `fasta2a plan --rank R` table.
void print_rank_row(std::ostream& os, const rank_row& r);

/// One line of `fasta2a plan --rank R --report`: a JSON object (keys documented in plan_usage).
void write_rank_report_line(std::ostream& os, const rank_row& r);

} // namespace cli
