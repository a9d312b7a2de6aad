// fasta2a CLI: formatting, statistics, the plan table and report lines, output files.
#include "report.hpp"

#include <fasta2a/json_writer.hpp>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <fstream>
#include <iterator>

namespace cli {

std::string strf(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  char buf[512];
  const int n = std::vsnprintf(buf, sizeof buf, fmt, args);
  va_end(args);
  return n < 0 ? std::string()
               : std::string(buf, std::min<std::size_t>(static_cast<std::size_t>(n), sizeof buf - 1));
}

double median(std::vector<double> v) {
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  const std::size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : (v[h - 1] + v[h]) / 2;
}

double finite_median(const std::vector<double>& v) {
  std::vector<double> f;
  std::copy_if(v.begin(), v.end(), std::back_inserter(f), [](double x) { return std::isfinite(x); });
  return median(std::move(f));
}

double ratio(double a, double b) { return b > 0 ? a / b : std::nan(""); }

void write_file(const std::string& path, const std::string& text, const char* what) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw fa::error("cannot open " + std::string(what) + " file '" + path + "' for writing");
  out << text;
  out.flush();
  if (!out) throw fa::error("cannot write " + std::string(what) + " file '" + path + "'");
}

void print_header(std::ostream& os) {
  os << strf("%5s %5s %5s %11s %6s %10s %11s %11s %9s %9s %10s %9s %9s %9s\n", "index", "ranks", "SxG", "bytes",
             "stages", "scale-up", "staging", "staging", "LB", "FAST", "spread-out", "direct", "synth", "synth")
     << strf("%5s %5s %5s %11s %6s %10s %11s %11s %9s %9s %10s %9s %9s %9s\n", "", "", "", "MiB", "", "MiB",
             "MiB max/rk", "MiB total", "ms model", "ms model", "ms model", "ms model", "us all", "us rank0");
}

void print_row(std::ostream& os, const row& r) {
  const std::string shape = std::to_string(r.servers) + "x" + std::to_string(r.gpus);
  os << strf("%5zu %5d %5s %11.2f %6zu %10.2f %11.2f %11.2f %9.4f %9.4f %10.4f %9.4f %9.1f %9.1f\n", r.index,
             r.ranks, shape.c_str(), static_cast<double>(r.bytes) / mib, r.stages,
             static_cast<double>(r.scaleup_bytes) / mib, static_cast<double>(r.staging_max) / mib,
             static_cast<double>(r.staging_sum / mib), r.lower_bound_s * 1e3, r.fast_s * 1e3,
             r.spread_s * 1e3, r.direct_s * 1e3, r.synthesis_us, r.synthesis_rank_us);
}

void write_report_line(std::ostream& os, const row& r) {
  std::string line;
  fa::json_writer(line)
      .begin_object()
      .field("index", r.index)
      .field("ranks", r.ranks)
      .field("servers", r.servers)
      .field("gpus", r.gpus)
      .field("bytes", r.bytes)
      .field("stages", r.stages)
      .field("scaleup_bytes", r.scaleup_bytes)
      .field("staging_bytes", r.staging_max)
      .field("lower_bound_s", r.lower_bound_s)
      .field("lower_bound_alpha_s", r.lower_bound_alpha_s)
      .field("predicted_s", r.fast_s)
      .field("predicted_over_lower_bound_alpha", r.lower_bound_alpha_s > 0 ? r.fast_s / r.lower_bound_alpha_s : 0.0)
      .field("predicted_spreadout_s", r.spread_s)
      .field("predicted_direct_s", r.direct_s)
      .field("synthesis_us", r.synthesis_us)
      .field("synthesis_rank_us", r.synthesis_rank_us)
      .field("decomposer", r.decomposer)
      .field("choice", r.choice)
      .field("staging_budget", r.staging_budget)
      .field("staging_ring", r.staging_ring)
      .field("buffer_bytes_max", r.buffer_max)
      .field("staging_over_own_buffer_max", r.staging_over_own_max)
      .end_object();
  os << line << '\n';
}

void print_rank_header(std::ostream& os) {
  os << strf("%5s %5s %5s %5s %11s %6s %9s %9s %11s %11s %9s %9s %9s %9s\n", "index", "ranks", "SxG", "rank", "bytes",
             "stages", "pieces", "ops", "staging", "staging", "LB", "LB+alpha", "scale-out", "synth")
     << strf("%5s %5s %5s %5s %11s %6s %9s %9s %11s %11s %9s %9s %9s %9s\n", "", "", "", "", "MiB", "", "of rank",
             "of rank", "MiB rank", "MiB max/rk", "ms model", "ms model", "ms model", "us rank");
}

void print_rank_row(std::ostream& os, const rank_row& r) {
  const std::string shape = std::to_string(r.servers) + "x" + std::to_string(r.gpus);
  os << strf("%5zu %5d %5s %5d %11.2f %6zu %9zu %9zu %11.2f %11.2f %9.4f %9.4f %9.4f %9.1f\n", r.index, r.ranks,
             shape.c_str(), r.rank, static_cast<double>(r.bytes) / mib, r.stages, r.pieces, r.ops,
             static_cast<double>(r.staging) / mib, static_cast<double>(r.staging_max) / mib, r.lower_bound_s * 1e3,
             r.lower_bound_alpha_s * 1e3, r.scaleout_s * 1e3, r.synthesis_rank_us);
}

void write_rank_report_line(std::ostream& os, const rank_row& r) {
  std::string line;
  fa::json_writer(line)
      .begin_object()
      .field("index", r.index)
      .field("ranks", r.ranks)
      .field("servers", r.servers)
      .field("gpus", r.gpus)
      .field("rank", r.rank)
      .field("bytes", r.bytes)
      .field("stages", r.stages)
      .field("pieces", r.pieces)
      .field("ops", r.ops)
      .field("staging_bytes", r.staging)
      .field("staging_bytes_max", r.staging_max)
      .field("lower_bound_s", r.lower_bound_s)
      .field("lower_bound_alpha_s", r.lower_bound_alpha_s)
      .field("predicted_scaleout_s", r.scaleout_s)
      .field("synthesis_rank_us", r.synthesis_rank_us)
      .field("decomposer", r.decomposer)
      .field("choice", r.choice)
      .field("checked", r.checked)
      .end_object();
  os << line << '\n';
}

} // namespace cli
