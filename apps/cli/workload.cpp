// fasta2a CLI: loading and describing the input traffic.
#include "workload.hpp"

#include "report.hpp" // strf

#include <utility>

namespace cli {
namespace {

/// A size as the command line takes it: "1K", "64M", "1G" where it is a whole number of those,
/// else bytes.
std::string size_text(bytes_t b) {
  for (const auto& [suffix, shift] : {std::pair{"G", 30}, std::pair{"M", 20}, std::pair{"K", 10}})
    if (b != 0 && b % (bytes_t{1} << shift) == 0) return std::to_string(b >> shift) + suffix;
  return std::to_string(b);
}

/// The generator's option as given, with its value: "--zipf 1.2".
std::string generator_text(const options& o) {
  switch (o.input) {
  case input_kind::zipf: return strf("--zipf %g", o.zipf_s);
  case input_kind::hotspot: return strf("--hotspot %d", o.hot);
  case input_kind::lognormal: return strf("--lognormal %g", o.sigma);
  default: return o.input_flag;
  }
}

/// A generator that was asked for traffic (--bytes-per-rank above 0) and made none: planning the
/// all-zero matrix would exit 0 with a table of zeros, and the user would take it for the traffic
/// asked for. Every count rounds down to whole granules, so bytes per rank below one granule give
/// nothing whatever the generator; log-normal loads also give nothing when SIGMA is so large that
/// every rank's draw is a tiny fraction of the mean. `--bytes-per-rank 0` asks for no traffic and
/// gets it (a plan of no stages). A trace's all-zero matrix is not refused either: it is what was
/// recorded (a step in which no token moved), and planning it is correct.
void refuse_empty_generated(const options& o, const fa::traffic_matrix& m) {
  if (o.bytes_per_rank == 0 || !(m.array() == 0).all()) return;
  const std::string bytes = "--bytes-per-rank " + size_text(o.bytes_per_rank);
  const std::string granule = "--granule " + size_text(o.granule);
  if (o.bytes_per_rank < o.granule)
    throw fa::error(generator_text(o) + " with " + bytes + " rounded down to a multiple of " + granule +
                    " gives no traffic: every count is 0; use a smaller --granule or more --bytes-per-rank");
  if (o.input == input_kind::lognormal)
    throw fa::error(generator_text(o) + " with " + bytes + " and " + granule +
                    " gives no traffic: every rank's load, --bytes-per-rank x exp(SIGMA Z - SIGMA^2 / 2), "
                    "rounds down to 0 granules; use a smaller --lognormal SIGMA, a smaller --granule or more "
                    "--bytes-per-rank");
  // Not reached by today's generators (each row of the others sums to --bytes-per-rank rounded
  // down to a granule), but a new one must not plan nothing silently either.
  throw fa::error(generator_text(o) + " with " + bytes + " and " + granule + " gives no traffic: every count is 0");
}

} // namespace

workload load_workload(const options& o, rank_t n) {
  // A traffic matrix holds 8 bytes per pair of ranks: refused before it is allocated where this
  // process cannot hold it (`run --servers 4096 --gpus 8` met std::bad_alloc under ulimit -v).
  const long double matrix = 8.0L * n * n;
  if (matrix > memory_limit_bytes())
    throw fa::error(strf("a traffic matrix of %d x %d ranks takes %.0Lf bytes, more than this process can hold (%.0Lf "
                         "bytes: its physical memory, or ulimit -v): run fewer ranks",
                         n, n, matrix, memory_limit_bytes()));
  workload w;
  switch (o.input) {
  case input_kind::matrix:
    if (o.all) w.matrices = fa::read_trace(o.matrix_path, n, o.unit);
    else {
      w.matrices.push_back(fa::read_matrix(o.matrix_path, n, o.index, o.unit));
      w.first_index = o.index;
    }
    break;
  case input_kind::uniform:
    w.matrices.push_back(fa::uniform_traffic(n, o.bytes_per_rank, o.seed, o.granule));
    break;
  case input_kind::zipf:
    w.matrices.push_back(fa::zipf_traffic(n, o.zipf_s, o.bytes_per_rank, o.seed, o.granule));
    break;
  case input_kind::hotspot:
    w.matrices.push_back(fa::hotspot_traffic(n, o.hot, o.hot_share, o.bytes_per_rank, o.seed, o.granule));
    break;
  case input_kind::lognormal:
    w.matrices.push_back(fa::lognormal_traffic(n, o.sigma, o.bytes_per_rank, o.seed, o.granule));
    break;
  case input_kind::none: throw fa::error("no input");
  }
  if (o.input != input_kind::matrix) refuse_empty_generated(o, w.matrices.front());
  return w;
}

std::string input_description(const options& o) {
  switch (o.input) {
  case input_kind::matrix:
    return "trace '" + o.matrix_path + "'" +
           (o.all ? std::string(", all matrices") : ", matrix " + std::to_string(o.index)) + ", unit " +
           std::to_string(o.unit) + " B";
  case input_kind::uniform: return "uniform, " + std::to_string(o.bytes_per_rank) + " B per rank";
  case input_kind::zipf:
    return strf("zipf(%g), %llu B per rank, seed %llu", o.zipf_s,
                static_cast<unsigned long long>(o.bytes_per_rank), static_cast<unsigned long long>(o.seed));
  case input_kind::hotspot:
    return strf("hotspot(%d hot, share %g), %llu B per rank, seed %llu", o.hot, o.hot_share,
                static_cast<unsigned long long>(o.bytes_per_rank), static_cast<unsigned long long>(o.seed));
  case input_kind::lognormal:
    return strf("lognormal(sigma %g), %llu B per rank, seed %llu", o.sigma,
                static_cast<unsigned long long>(o.bytes_per_rank), static_cast<unsigned long long>(o.seed));
  case input_kind::none: break;
  }
  return "none";
}

} // namespace cli
