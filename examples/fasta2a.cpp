// fasta2a: the command-line program. `fasta2a plan` plans traffic matrices (a recorded trace or a
// synthetic generator), verifies every plan, and compares the FAST plan with the spread-out and
// direct baselines in the alpha-beta cost model (times other than synthesis are model
// predictions). `fasta2a run` executes all-to-allv calls with real bytes on a transport, checks
// every received byte, and measures them against direct execution on the same transport.
#include <fasta2a/common.hpp>
#include <fasta2a/cost_model.hpp>
#include <fasta2a/decompose.hpp>
#include <fasta2a/engine.hpp>
#include <fasta2a/fewer_stages.hpp>
#include <fasta2a/host.hpp>
#include <fasta2a/json.hpp>
#include <fasta2a/pattern.hpp>
#include <fasta2a/plan.hpp>
#include <fasta2a/planner.hpp>
#include <fasta2a/svg.hpp>
#include <fasta2a/topology.hpp>
#include <fasta2a/traffic.hpp>
#include <fasta2a/verify.hpp>
#ifdef FASTA2A_HAVE_MPI
#include <fasta2a/mpi.hpp>
#endif

#include <algorithm>
#include <atomic>
#include <barrier>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <fstream>
#include <iostream>
#include <iterator>
#include <limits>
#include <new>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <variant>
#include <vector>

namespace {

namespace fa = fasta2a;
using fa::bytes_t;
using fa::rank_t;

constexpr const char* general_usage =
    "usage: fasta2a plan [options]     plan all-to-allv traffic with FAST (see fasta2a plan --help)\n"
    "       fasta2a run [options]      execute all-to-allv calls with real bytes (see fasta2a run --help)\n"
    "       fasta2a --help             this text\n";

constexpr const char* plan_usage = R"(usage: fasta2a plan --servers S --gpus G INPUT [options]

Plans all-to-allv traffic matrices with FAST, verifies every plan, and compares it with the
spread-out and direct baselines. One table row per matrix. LB, FAST, spread-out and direct are
predictions of the alpha-beta MODEL (bytes / bandwidth + alpha per stage), not measurements;
synth is the measured wall time of planning (median of --repeat runs): the whole plan, and
rank 0's part, which is what each rank computes per call.

Topology:
  --servers S             servers (required, at least 1)
  --gpus G                GPUs per server, one 50 GB/s NIC each (required, at least 1)
  --scaleup switch|mesh   switch: H200 NVSwitch, 450 GB/s per GPU port (default);
                          mesh: MI300X xGMI, 64 GB/s per GPU pair
Planning:
  --decomposer NAME       how the FAST plan is staged: birkhoff (exact, the paper; default),
                          bottleneck (exact, max-min matchings: fewer stages), quantized (weights
                          in multiples of a quantum chosen from --alpha: bounded padding, far fewer
                          stages), best (whichever of those three or spread-out the scale-out
                          model predicts fastest),
                          spread-out, direct
  --adaptive              also predict direct sending, and send directly where that is faster
                          (small messages); the choice and its reason are printed and reported
  --granule BYTES         rail loads balanced to, and messages split on, this size; generated
                          matrices are made of it too (default 1)
  --alpha US              model cost of one stage's synchronisation, microseconds (default 10)
  --max-plan-bytes B      refuse to build a plan larger than B bytes (default 2GiB)
  --repeat N              synthesis time = median of N plannings of one matrix (default 5)
Input, exactly one of:
  --matrix FILE           trace of whitespace-separated counts, (S*G) x (S*G) per matrix
      --index K           plan matrix K of the trace, from 0 (default 0)
      --all               plan every matrix of the trace; a summary line follows the table
      --unit BYTES        bytes per count, e.g. 8192 for a bf16 token of hidden size 4096 (default 1)
  --uniform               every rank sends the same to every rank
  --zipf S                destinations drawn with Zipf(S) popularity
  --hotspot K             K hot ranks receive --hot-share F of every rank's bytes (default 0.5)
  --lognormal SIGMA       per-rank load log-normal with parameter SIGMA
      --bytes-per-rank B  bytes each rank sends (default 64MiB)
      --seed N            generator seed (default 1)
Output files (the plan and timeline of the first planned matrix):
  --json FILE             the FAST plan, format fasta2a.plan.v1
  --report FILE           one JSON object per line and matrix: index, ranks, servers, gpus, bytes,
                          stages, scaleup_bytes, staging_bytes (largest per-rank staging buffer),
                          lower_bound_s, predicted_s, predicted_spreadout_s, predicted_direct_s,
                          synthesis_us (whole plan), synthesis_rank_us (rank 0's part),
                          decomposer and choice (the schedule used and why, with best/--adaptive)
  --svg FILE              the model's timeline, FAST above direct sending

Sizes take the suffixes K, M, G (or KiB, MiB, GiB): powers of 1024. Options take their value as
the next argument or after '=' (--servers=4).
Exit status: 0 done; 1 a plan failed verification (a bug in fasta2a); 2 bad input or plan too large.
)";

constexpr const char* run_usage = R"(usage: fasta2a run --servers S --gpus G INPUT [options]

Executes all-to-allv calls with real bytes through the fasta2a engine: every send buffer is filled
with a pattern of (source, destination, offset) and every received byte is checked. Each call is
timed from the first rank's start to the last rank's return (median of --iters calls after one
warm-up), next to direct execution (every message straight to its destination) on the same
transport and buffers, and beside the plan's model figures.

  --transport host        ranks are threads of this process, sharing memory (default)
  --iters N               timed calls per matrix (default 5)
  --rail-window W         rail stages a rank may have in flight (engine_options::rail_window,
                          default 5)
  --report FILE           one JSON object per line and matrix: index, ranks, servers, gpus, bytes,
                          stages, staging_bytes, call_s, direct_call_s, speedup, plan_s, exchange_s,
                          execute_s, predicted_s, predicted_direct_s, lower_bound_s, bytes_checked

Topology, planning and input options are those of `fasta2a plan` (--servers, --gpus, --scaleup,
--decomposer, --granule, --alpha, --max-plan-bytes, --matrix/--index/--all/--unit, --uniform,
--zipf, --hotspot/--hot-share, --lognormal, --bytes-per-rank, --seed). One process holds every
rank's buffers: size --unit or --bytes-per-rank to the machine's memory.
Exit status: 0 every byte arrived; 1 a byte was wrong or a plan failed verification (a bug);
2 bad input.
)";

/// A plan that failed the verifier: a bug in the library, reported apart from bad input.
struct verification_failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// printf into a std::string: the table and the report need fixed-width numbers, and g++ 12 has
/// no <format>.
[[gnu::format(printf, 1, 2)]] std::string strf(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  char buf[512];
  const int n = std::vsnprintf(buf, sizeof buf, fmt, args);
  va_end(args);
  return n < 0 ? std::string()
               : std::string(buf, std::min<std::size_t>(static_cast<std::size_t>(n), sizeof buf - 1));
}

// ---------------------------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------------------------

enum class input_kind { none, matrix, uniform, zipf, hotspot, lognormal };

struct options {
  int servers = 0;
  int gpus = 0;
  fa::link_model links = fa::h200_links;
  std::string decomposer = "birkhoff";
  bool adaptive = false;
  bytes_t granule = 1;
  double alpha_us = 10;
  std::size_t max_plan_bytes = fa::plan_options{}.max_plan_bytes;
  unsigned repeat = 5;

  input_kind input = input_kind::none;
  std::string input_flag; // as given, for messages
  std::string matrix_path;
  std::size_t index = 0;
  bool all = false;
  bytes_t unit = 1;
  double zipf_s = 0;
  rank_t hot = 0;
  double hot_share = 0.5;
  double sigma = 0;
  bytes_t bytes_per_rank = bytes_t{64} << 20;
  std::uint64_t seed = 1;

  std::string json_path, report_path, svg_path;

  // fasta2a run
  std::string transport = "host";
  unsigned iters = 5;
  std::size_t rail_window = fa::engine_options{}.rail_window;
  bool compare_mpi = false;
};

/// A non-negative decimal integer that fits in `max`, or an error naming the option.
std::uint64_t parse_uint(std::string_view flag, std::string_view text, std::uint64_t max) {
  if (text.empty() || text.front() == '-' || text.front() == '+')
    throw fa::error(std::string(flag) + " expects a non-negative integer, got '" + std::string(text) + "'" +
                    (text.starts_with('-') ? " (negative)" : ""));
  std::uint64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec == std::errc::result_out_of_range ||
      (ec == std::errc() && end == text.data() + text.size() && v > max))
    throw fa::error(std::string(flag) + " value '" + std::string(text) + "' is too large (at most " +
                    std::to_string(max) + ")");
  if (ec != std::errc() || end != text.data() + text.size())
    throw fa::error(std::string(flag) + " expects a non-negative integer, got '" + std::string(text) + "'");
  return v;
}

/// A finite, non-negative decimal number.
double parse_real(std::string_view flag, std::string_view text) {
  double v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || !std::isfinite(v))
    throw fa::error(std::string(flag) + " expects a non-negative number, got '" + std::string(text) + "'");
  if (v < 0)
    throw fa::error(std::string(flag) + " expects a non-negative number, got '" + std::string(text) +
                    "' (negative)");
  return v;
}

int parse_positive_int(std::string_view flag, std::string_view text) {
  const auto v = parse_uint(flag, text, static_cast<std::uint64_t>(std::numeric_limits<int>::max()));
  if (v == 0) throw fa::error(std::string(flag) + " must be at least 1, got 0");
  return static_cast<int>(v);
}

/// Parses the arguments of `fasta2a plan` (or, with `run`, of `fasta2a run`). Returns nothing
/// when help was asked for.
std::optional<options> parse_options(const std::vector<std::string_view>& args, bool run) {
  options o;
  const char* command = run ? "fasta2a run" : "fasta2a plan";
  std::set<std::string, std::less<>> given;
  bool have_index = false, have_unit = false, have_share = false, have_bytes = false, have_seed = false;
  const auto set_input = [&](input_kind k, std::string_view flag) {
    if (o.input != input_kind::none)
      throw fa::error("two inputs given (" + o.input_flag + " and " + std::string(flag) +
                      "): give exactly one of --matrix, --uniform, --zipf, --hotspot, --lognormal");
    o.input = k;
    o.input_flag = std::string(flag);
  };
  for (std::size_t i = 0; i < args.size(); ++i) {
    std::string_view arg = args[i];
    if (arg == "--help" || arg == "-h") return std::nullopt;
    if (!arg.starts_with("--"))
      throw fa::error("unexpected argument '" + std::string(arg) +
                      "' (options start with --; see fasta2a plan --help)");
    std::string_view flag = arg;
    std::optional<std::string_view> inline_value;
    if (const auto eq = arg.find('='); eq != std::string_view::npos) {
      flag = arg.substr(0, eq);
      inline_value = arg.substr(eq + 1);
    }
    // A value is the rest after '=' or the next argument; an option in its place means the value
    // was forgotten, which says more than "'--gpus' is not a number".
    const auto value = [&]() -> std::string_view {
      if (inline_value) return *inline_value;
      if (i + 1 >= args.size() || args[i + 1].starts_with("--"))
        throw fa::error("option " + std::string(flag) + " needs a value");
      return args[++i];
    };
    const auto no_value = [&] {
      if (inline_value) throw fa::error("option " + std::string(flag) + " takes no value");
    };
    if (!given.insert(std::string(flag)).second)
      throw fa::error("option " + std::string(flag) + " given more than once");
    const bool run_only =
        flag == "--transport" || flag == "--iters" || flag == "--compare-mpi" || flag == "--rail-window";
    const bool plan_only = flag == "--json" || flag == "--svg" || flag == "--repeat";
    if ((run_only && !run) || (plan_only && run))
      throw fa::error("option " + std::string(flag) + " does not apply to " + command + " (see " + command +
                      " --help)");

    if (flag == "--servers") o.servers = parse_positive_int(flag, value());
    else if (flag == "--gpus") o.gpus = parse_positive_int(flag, value());
    else if (flag == "--scaleup") {
      const std::string_view v = value();
      if (v == "switch") o.links = fa::h200_links;
      else if (v == "mesh") o.links = fa::mi300x_links;
      else throw fa::error("--scaleup expects switch or mesh, got '" + std::string(v) + "'");
    } else if (flag == "--decomposer") {
      const std::string_view v = value();
      if (v != "birkhoff" && v != "bottleneck" && v != "quantized" && v != "best" && v != "spread-out" &&
          v != "direct")
        throw fa::error("--decomposer expects birkhoff, bottleneck, quantized, best, spread-out or direct, got '" +
                        std::string(v) + "'");
      o.decomposer = std::string(v);
    } else if (flag == "--adaptive") {
      no_value();
      o.adaptive = true;
    } else if (flag == "--granule") {
      o.granule = fa::parse_bytes(value(), flag);
      if (o.granule == 0) throw fa::error("--granule must be at least 1 byte, got 0");
    } else if (flag == "--alpha") o.alpha_us = parse_real(flag, value());
    else if (flag == "--max-plan-bytes") {
      const bytes_t b = fa::parse_bytes(value(), flag);
      o.max_plan_bytes =
          static_cast<std::size_t>(std::min<bytes_t>(b, std::numeric_limits<std::size_t>::max()));
    } else if (flag == "--repeat") o.repeat = static_cast<unsigned>(parse_positive_int(flag, value()));
    else if (flag == "--matrix") {
      set_input(input_kind::matrix, flag);
      o.matrix_path = std::string(value());
    } else if (flag == "--index") {
      o.index = parse_uint(flag, value(), std::numeric_limits<std::size_t>::max());
      have_index = true;
    } else if (flag == "--all") {
      no_value();
      o.all = true;
    } else if (flag == "--unit") {
      o.unit = fa::parse_bytes(value(), flag);
      if (o.unit == 0) throw fa::error("--unit must be at least 1 byte per count, got 0");
      have_unit = true;
    } else if (flag == "--uniform") {
      no_value();
      set_input(input_kind::uniform, flag);
    } else if (flag == "--zipf") {
      set_input(input_kind::zipf, flag);
      o.zipf_s = parse_real(flag, value());
    } else if (flag == "--hotspot") {
      set_input(input_kind::hotspot, flag);
      o.hot = parse_positive_int(flag, value());
    } else if (flag == "--hot-share") {
      const std::string_view v = value();
      o.hot_share = parse_real(flag, v);
      if (o.hot_share > 1) throw fa::error("--hot-share must be in [0, 1], got " + std::string(v));
      have_share = true;
    } else if (flag == "--lognormal") {
      set_input(input_kind::lognormal, flag);
      o.sigma = parse_real(flag, value());
    } else if (flag == "--bytes-per-rank") {
      o.bytes_per_rank = fa::parse_bytes(value(), flag);
      have_bytes = true;
    } else if (flag == "--seed") {
      o.seed = parse_uint(flag, value(), std::numeric_limits<std::uint64_t>::max());
      have_seed = true;
    } else if (flag == "--json") o.json_path = std::string(value());
    else if (flag == "--report") o.report_path = std::string(value());
    else if (flag == "--svg") o.svg_path = std::string(value());
    else if (flag == "--transport") {
      const std::string_view v = value();
      if (v != "host" && v != "mpi") throw fa::error("--transport expects host or mpi, got '" + std::string(v) + "'");
      o.transport = std::string(v);
    } else if (flag == "--iters") o.iters = static_cast<unsigned>(parse_positive_int(flag, value()));
    else if (flag == "--rail-window") o.rail_window = static_cast<std::size_t>(parse_positive_int(flag, value()));
    else if (flag == "--compare-mpi") {
      no_value();
      o.compare_mpi = true;
    } else throw fa::error("unknown option '" + std::string(flag) + "' (see " + command + " --help)");
  }

  // Options that only mean something with another one are errors alone: silently ignoring
  // `--unit 8192` on a generator would print a plan of other traffic than the user asked for.
  // Under MPI the servers follow from the process count and --gpus.
  if (o.servers == 0 && !(run && o.transport == "mpi"))
    throw fa::error("--servers S is required (servers, at least 1)");
  if (o.gpus == 0) throw fa::error("--gpus G is required (GPUs per server, at least 1)");
  if (o.input == input_kind::none)
    throw fa::error(
        "no input: give --matrix FILE or one of --uniform, --zipf S, --hotspot K, --lognormal SIGMA");
  const bool trace = o.input == input_kind::matrix;
  if (!trace && (have_index || have_unit || o.all))
    throw fa::error(std::string(have_index  ? "--index"
                                : have_unit ? "--unit"
                                            : "--all") +
                    " applies to --matrix only, not to " + o.input_flag);
  if (trace && (have_bytes || have_seed))
    throw fa::error(std::string(have_bytes ? "--bytes-per-rank" : "--seed") +
                    " applies to the generators only, not to --matrix");
  if (have_share && o.input != input_kind::hotspot) throw fa::error("--hot-share applies to --hotspot only");
  if (o.all && have_index) throw fa::error("--all and --index cannot be combined: --all plans every matrix");
  o.links.scaleout_alpha = o.alpha_us * 1e-6; // the topology's scale-out model (fa::scaleout_of)
  return o;
}

// ---------------------------------------------------------------------------------------------
// Planning
// ---------------------------------------------------------------------------------------------

double median(std::vector<double> v) {
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  const std::size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : (v[h - 1] + v[h]) / 2;
}

/// Plans t `repeat` times with one planner into one plan, as a runtime would every iteration
/// (storage reused), and returns the median wall time in microseconds.
/// With `rank` >= 0, times that rank's part of the plan (planner::make_rank_into) instead.
template <class Planner>
double timed_make(Planner& planner, const fa::traffic_matrix& t, fa::plan& out, unsigned repeat,
                  rank_t rank = -1) {
  std::vector<double> us;
  us.reserve(repeat);
  for (unsigned r = 0; r < repeat; ++r) {
    const auto start = std::chrono::steady_clock::now();
    if (rank >= 0) planner.make_rank_into(t, rank, out);
    else planner.make_into(t, out);
    const auto stop = std::chrono::steady_clock::now();
    us.push_back(std::chrono::duration<double, std::micro>(stop - start).count());
  }
  return median(std::move(us));
}

/// Runs the independent verifier; exact decomposers must also meet the lower bound exactly.
template <fa::Decomposer D>
void check_plan(const fa::plan& p, const fa::traffic_matrix& t, const char* which) {
  const fa::verify_result r = fa::verify(p, t, fa::verify_options{.exact_lower_bound = D::exact});
  if (!r) throw verification_failure(std::string("the ") + which + " plan fails verification: " + r.error);
}

/// The decomposer a planner type was built with.
template <class Planner> struct decomposer_of;
template <class Topo, class D> struct decomposer_of<fa::planner<Topo, D>> { using type = D; };

using best_decomposer = fa::best_of_decomposer<fa::birkhoff_decomposer, fa::bottleneck_decomposer,
                                                fa::quantized_decomposer, fa::spread_out_decomposer>;

/// Calls f with the decomposer named on the command line, configured with the topology's
/// scale-out model (--alpha, NIC bandwidth) where it models time: the one place a name becomes a type.
template <class F>
decltype(auto) with_decomposer(const options& o, const fa::scaleout_model& net, F&& f) {
  const fa::quantized_decomposer quantized(net, fa::quantum_rule::formula);
  if (o.decomposer == "bottleneck") return f(fa::bottleneck_decomposer{});
  if (o.decomposer == "quantized") return f(quantized);
  if (o.decomposer == "best")
    return f(best_decomposer(net, fa::birkhoff_decomposer{}, fa::bottleneck_decomposer{},
                             quantized, fa::spread_out_decomposer{}));
  if (o.decomposer == "spread-out") return f(fa::spread_out_decomposer{});
  if (o.decomposer == "direct") return f(fa::direct_decomposer{});
  return f(fa::birkhoff_decomposer{});
}

/// Planning options from the command line: --adaptive adds the direct fallback at --alpha.
fa::plan_options planning_options(const options& o) {
  fa::plan_options p{o.granule, o.max_plan_bytes};
  if (o.adaptive) p.direct_if_faster_alpha = o.alpha_us * 1e-6;
  return p;
}

fa::engine_options engine_options_of(const options& o) {
  fa::engine_options e;
  e.planning = planning_options(o);
  e.rail_window = o.rail_window;
  return e;
}

/// The FAST planner with the decomposer chosen on the command line.
template <fa::Topology Topo>
using fast_planner =
    std::variant<fa::planner<Topo, fa::birkhoff_decomposer>, fa::planner<Topo, fa::bottleneck_decomposer>,
                 fa::planner<Topo, fa::quantized_decomposer>, fa::planner<Topo, best_decomposer>,
                 fa::planner<Topo, fa::spread_out_decomposer>, fa::planner<Topo, fa::direct_decomposer>>;

template <fa::Topology Topo>
fast_planner<Topo> make_fast_planner(const options& o, const Topo& topo) {
  return with_decomposer(o, fa::scaleout_of(topo), [&](auto dec) -> fast_planner<Topo> {
    return fa::planner<Topo, decltype(dec)>(topo, planning_options(o), dec);
  });
}

/// The traffic the options ask for: one generated matrix, one matrix of a trace, or all of them.
struct workload {
  std::vector<fa::traffic_matrix> matrices;
  std::size_t first_index = 0; // trace index of matrices[0]
};

workload load_workload(const options& o, rank_t n) {
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

/// What one matrix's row of the table (and line of the report) holds.
struct row {
  std::size_t index = 0;
  rank_t ranks = 0;
  int servers = 0, gpus = 0;
  bytes_t bytes = 0;
  std::size_t stages = 0;
  bytes_t scaleup_bytes = 0;
  bytes_t staging_max = 0;     // the largest per-rank staging buffer
  long double staging_sum = 0; // all ranks' buffers: a sum that may pass 64 bits, shown in MiB only
  double lower_bound_s = 0, fast_s = 0, spread_s = 0, direct_s = 0, synthesis_us = 0, synthesis_rank_us = 0;
  std::string decomposer, choice; // which schedule the FAST plan uses, and why (adaptive choices)
};

/// A JSON string literal.
std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) out += strf("\\u%04x", c);
    else out += c;
  }
  return out + "\"";
}

constexpr double mib = 1024.0 * 1024.0;

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

/// A JSON number; JSON has no NaN or infinity, so those become null.
std::string json_real(double x) { return std::isfinite(x) ? strf("%.9g", x) : std::string("null"); }


void write_report_line(std::ostream& os, const row& r) {
  os << "{\"index\": " << r.index << ", \"ranks\": " << r.ranks << ", \"servers\": " << r.servers
     << ", \"gpus\": " << r.gpus << ", \"bytes\": " << r.bytes << ", \"stages\": " << r.stages
     << ", \"scaleup_bytes\": " << r.scaleup_bytes << ", \"staging_bytes\": " << r.staging_max
     << ", \"lower_bound_s\": " << json_real(r.lower_bound_s) << ", \"predicted_s\": " << json_real(r.fast_s)
     << ", \"predicted_spreadout_s\": " << json_real(r.spread_s)
     << ", \"predicted_direct_s\": " << json_real(r.direct_s)
     << ", \"synthesis_us\": " << json_real(r.synthesis_us)
     << ", \"synthesis_rank_us\": " << json_real(r.synthesis_rank_us)
     << ", \"decomposer\": " << json_string(r.decomposer) << ", \"choice\": " << json_string(r.choice) << "}\n";
}

/// Writes `text` to `path`, or an error naming the file.
void write_file(const std::string& path, const std::string& text, const char* what) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw fa::error("cannot open " + std::string(what) + " file '" + path + "' for writing");
  out << text;
  out.flush();
  if (!out) throw fa::error("cannot write " + std::string(what) + " file '" + path + "'");
}

/// A ratio, or NaN (left out of medians) when the denominator is zero: an empty matrix has no
/// meaningful speed-up.
double ratio(double a, double b) { return b > 0 ? a / b : std::nan(""); }

/// The fields every `fasta2a run` report line starts with (host and MPI transports alike), without
/// the closing brace: the caller adds its own fields.
template <class Topo>
void report_call_fields(std::ostream& out, std::size_t index, int ranks, const Topo& topo, bytes_t total,
                        std::size_t stages, bytes_t staging, double call_s, double direct_s,
                        const fa::call_stats& stats) {
  out << "{\"index\": " << index << ", \"ranks\": " << ranks << ", \"servers\": " << topo.servers()
      << ", \"gpus\": " << topo.gpus_per_server() << ", \"bytes\": " << total << ", \"stages\": " << stages
      << ", \"staging_bytes\": " << staging << ", \"call_s\": " << json_real(call_s)
      << ", \"direct_call_s\": " << json_real(direct_s) << ", \"speedup\": " << json_real(ratio(direct_s, call_s))
      << ", \"plan_s\": " << json_real(stats.plan_s) << ", \"exchange_s\": " << json_real(stats.exchange_s)
      << ", \"execute_s\": " << json_real(stats.execute_s);
}

double finite_median(const std::vector<double>& v) {
  std::vector<double> f;
  std::copy_if(v.begin(), v.end(), std::back_inserter(f), [](double x) { return std::isfinite(x); });
  return median(std::move(f));
}

/// `fasta2a plan` on one topology type: a runtime-sized one or, for 8 GPUs per server, the
/// compile-time-sized one. Every plan is verified before any of its figures is printed.
template <fa::Topology Topo> int plan_command(const Topo& topo, const options& o) {
  const rank_t n = topo.ranks();
  // A plan indexes every message (two 4-byte words per rank pair), so a topology whose index
  // alone passes the limit cannot be planned: say so before allocating an n x n matrix for it.
  const long double index_bytes = 8.0L * n * n;
  if (index_bytes > static_cast<long double>(o.max_plan_bytes))
    throw fa::plan_too_large(strf("%d ranks need %.0Lf bytes of plan just to index their messages, more than "
                                  "the plan size limit of %zu bytes (raise --max-plan-bytes)",
                                  n, index_bytes, o.max_plan_bytes));

  const fa::plan_options popt{o.granule, o.max_plan_bytes};
  fast_planner<Topo> fast = make_fast_planner(o, topo);
  fa::planner<Topo, fa::spread_out_decomposer> spread(topo, popt);
  fa::planner<Topo, fa::direct_decomposer> direct(topo, popt);
  fa::plan fast_plan, spread_plan, direct_plan;
  const fa::cost_params cp{o.alpha_us * 1e-6};

  std::ofstream report;
  if (!o.report_path.empty()) {
    report.open(o.report_path, std::ios::binary | std::ios::trunc);
    if (!report) throw fa::error("cannot open report file '" + o.report_path + "' for writing");
  }

  const workload w = load_workload(o, n);
  // The header is printed with the first row, which follows the first verified plan: input that
  // fails to plan leaves nothing on stdout but the error on stderr.
  const auto print_preamble = [&] {
    std::cout << "# fasta2a plan: " << topo.servers() << " servers x " << topo.gpus_per_server()
              << " GPUs, scale-up " << fa::to_string(topo.scaleup())
              << strf(" %g GB/s", topo.scaleup_bandwidth() / 1e9)
              << (topo.scaleup() == fa::scaleup_kind::switch_fabric ? " per port" : " per pair")
              << strf(", NIC %g GB/s", topo.scaleout_bandwidth() / 1e9) << "; decomposer " << o.decomposer
              << ", granule " << o.granule << " B, alpha " << strf("%g", o.alpha_us) << " us\n"
              << "# input: " << input_description(o) << "\n"
              << "# LB, FAST, spread-out, direct: alpha-beta MODEL predictions, not measurements; "
              << "synth: measured wall time of planning, median of " << o.repeat << "\n";
    print_header(std::cout);
  };

  std::vector<double> direct_over_fast, fast_over_lb, synth, synth_rank;
  for (std::size_t k = 0; k < w.matrices.size(); ++k) {
    const fa::traffic_matrix& t = w.matrices[k];
    const bool first = k == 0;
    const bool draw = first && !o.svg_path.empty();

    row r;
    r.synthesis_us = std::visit(
        [&](auto& p) {
          r.synthesis_rank_us = timed_make(p, t, fast_plan, o.repeat, 0);
          const double us = timed_make(p, t, fast_plan, o.repeat);
          using D = typename decomposer_of<std::remove_cvref_t<decltype(p)>>::type;
          check_plan<D>(fast_plan, t, "FAST");
          return us;
        },
        fast);
    spread.make_into(t, spread_plan);
    check_plan<fa::spread_out_decomposer>(spread_plan, t, "spread-out");
    direct.make_into(t, direct_plan);
    check_plan<fa::direct_decomposer>(direct_plan, t, "direct");

    const fa::prediction pf = fa::predict(topo, fast_plan, cp, draw);
    const fa::prediction pd = fa::predict(topo, direct_plan, cp, draw);
    const fa::prediction ps = fa::predict(topo, spread_plan, cp);
    r.index = w.first_index + k;
    r.ranks = n;
    r.servers = topo.servers();
    r.gpus = topo.gpus_per_server();
    r.bytes = fast_plan.total_bytes;
    r.stages = fast_plan.stages();
    r.scaleup_bytes = fast_plan.scaleup_bytes;
    r.decomposer = fast_plan.decomposer;
    r.choice = fast_plan.choice;
    for (bytes_t b : fast_plan.staging_bytes) {
      r.staging_max = std::max(r.staging_max, b);
      r.staging_sum += static_cast<long double>(b);
    }
    r.lower_bound_s = fa::lower_bound(topo, t).overall_s();
    r.fast_s = pf.total_s;
    r.spread_s = ps.total_s;
    r.direct_s = pd.total_s;

    if (first && !o.json_path.empty()) {
      std::ostringstream json;
      fa::write_plan_json(json, fast_plan);
      write_file(o.json_path, json.str(), "JSON");
    }
    if (draw) {
      std::ostringstream svg;
      fa::timeline_style style;
      style.fast_label = "FAST (" + o.decomposer + ")";
      style.note = "Input: " + input_description(o) + strf("; alpha %g us per stage, ", o.alpha_us) +
                   strf("NIC %g GB/s, scale-up %g GB/s (%s).", topo.scaleout_bandwidth() / 1e9,
                        topo.scaleup_bandwidth() / 1e9, fa::to_string(topo.scaleup()));
      const std::string what =
          o.input == input_kind::matrix ? "matrix " + std::to_string(r.index) : input_description(o);
      const std::string title =
          "fasta2a timeline: " + what + strf(" on %d servers x %d GPUs", r.servers, r.gpus);
      fa::write_timeline_svg(svg, title, pf, pd, n, topo.gpus_per_server(), r.lower_bound_s, style);
      write_file(o.svg_path, svg.str(), "SVG");
    }

    if (first) print_preamble();
    print_row(std::cout, r);
    if (!r.choice.empty()) std::cout << "#   matrix " << r.index << " uses " << r.decomposer << ": " << r.choice << "\n";
    if (report.is_open()) {
      write_report_line(report, r);
      if (!report) throw fa::error("cannot write report file '" + o.report_path + "'");
    }
    direct_over_fast.push_back(ratio(r.direct_s, r.fast_s));
    fast_over_lb.push_back(ratio(r.fast_s, r.lower_bound_s));
    synth.push_back(r.synthesis_us);
    synth_rank.push_back(r.synthesis_rank_us);
  }
  if (report.is_open()) {
    report.flush();
    if (!report) throw fa::error("cannot write report file '" + o.report_path + "'");
  }
  if (o.all) {
    // NaN when no matrix moved a byte (every ratio undefined).
    const auto times = [](double x) { return std::isfinite(x) ? strf("%.3fx", x) : std::string("n/a"); };
    std::cout << "# summary over " << w.matrices.size() << " matrices (medians): direct/FAST "
              << times(finite_median(direct_over_fast)) << ", FAST/LB " << times(finite_median(fast_over_lb))
              << " (model); synthesis " << strf("%.1f us", median(synth)) << " whole plan, "
              << strf("%.1f us", median(synth_rank)) << " rank 0's part\n";
  }
  std::cout.flush();
  return 0;
}

// ---------------------------------------------------------------------------------------------
// Running: real bytes through the engine
// ---------------------------------------------------------------------------------------------

/// A wrong byte: the engine delivered something other than what was sent (a bug in fasta2a).
struct delivery_failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Throws delivery_failure if any byte rank `me` received in call `call` differs from its
/// sender's pattern.
void check_delivery(const fa::packed_layout& l, std::span<const std::byte> recv, rank_t me, unsigned call) {
  rank_t from = -1;
  if (const auto bad = l.mismatches(recv, me, &from))
    throw delivery_failure("rank " + std::to_string(me) + ": " + std::to_string(bad) + " received bytes are wrong, the first from rank " +
                           std::to_string(from) + " (call " + std::to_string(call) + ")");
}

/// What running one matrix on one engine type measured.
struct run_figures {
  double call_s = 0;          // median over iterations of (last rank's return - first rank's start)
  fa::call_stats stats{};     // rank 0's breakdown of the median call
  bytes_t bytes_checked = 0;  // received bytes compared with the pattern, all iterations
  std::size_t stages = 0;
  bytes_t staging_max = 0;
};

/// Runs `iters` timed calls (after one warm-up) of the engine with decomposer D on the host
/// transport, every rank a thread, and checks every received byte of every call.
template <fa::Decomposer D, fa::Topology Topo>
run_figures run_host(const Topo& topo, const fa::traffic_matrix& t, const options& o, D dec = D()) {
  using clock = std::chrono::steady_clock;
  const rank_t n = topo.ranks();
  const unsigned calls = o.iters + 1;
  fa::host_fabric fabric(n);
  std::barrier sync(n);
  std::vector<clock::time_point> start(static_cast<std::size_t>(n) * calls), stop(start.size());
  std::vector<std::string> errors(n);
  std::vector<fa::call_stats> stats(calls);
  std::atomic<bytes_t> checked{0};
  run_figures f;
  std::vector<std::thread> threads;
  for (rank_t r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        fa::host_bootstrap boot(fabric, r);
        fa::host_transport tr(fabric, r);
        fa::engine<Topo, fa::host_bootstrap, fa::host_transport, fa::host_transport, D> eng(
            topo, boot, tr, tr, engine_options_of(o), dec);
        const fa::packed_layout l(t, r);
        std::vector<std::byte> send(l.send_bytes), recv(l.recv_bytes);
        l.fill(send, r);
        for (unsigned c = 0; c < calls; ++c) {
          std::fill(recv.begin(), recv.end(), std::byte{0});
          sync.arrive_and_wait();
          start[c * n + r] = clock::now();
          eng.alltoallv(send, l.send_counts, l.send_displs, recv, l.recv_counts, l.recv_displs);
          stop[c * n + r] = clock::now();
          if (r == 0) stats[c] = eng.last_stats();
          check_delivery(l, recv, r, c);
          checked += l.recv_bytes;
          sync.arrive_and_wait(); // nobody refills while another rank still checks
        }
        if (r == 0) {
          f.stages = eng.last_plan().stages();
          for (bytes_t b : eng.last_plan().staging_bytes) f.staging_max = std::max(f.staging_max, b);
        }
      } catch (const std::exception& e) {
        errors[r] = e.what();
        // Leave the barrier so that the other ranks fail on their timeouts instead of waiting here.
        sync.arrive_and_drop();
      }
    });
  for (auto& th : threads) th.join();
  for (rank_t r = 0; r < n; ++r)
    if (!errors[r].empty()) {
      if (errors[r].find("are wrong") != std::string::npos) throw delivery_failure(errors[r]);
      throw fa::error(errors[r]);
    }
  std::vector<std::pair<double, unsigned>> per_call;
  for (unsigned c = 1; c < calls; ++c) { // call 0 is the warm-up
    auto first = start[c * n], last = stop[c * n];
    for (rank_t r = 0; r < n; ++r) {
      first = std::min(first, start[c * n + r]);
      last = std::max(last, stop[c * n + r]);
    }
    per_call.emplace_back(std::chrono::duration<double>(last - first).count(), c);
  }
  std::sort(per_call.begin(), per_call.end());
  const auto& mid = per_call[per_call.size() / 2];
  f.call_s = mid.first;
  f.stats = stats[mid.second];
  f.bytes_checked = checked.load();
  return f;
}

/// `fasta2a run --transport host` on one topology type.
template <fa::Topology Topo> int run_command(const Topo& topo, const options& o) {
  const rank_t n = topo.ranks();
  const workload w = load_workload(o, n);
  const fa::cost_params cp{o.alpha_us * 1e-6};
  std::ofstream report;
  if (!o.report_path.empty()) {
    report.open(o.report_path, std::ios::binary | std::ios::trunc);
    if (!report) throw fa::error("cannot open report file '" + o.report_path + "' for writing");
  }
  std::cout << "# fasta2a run: " << topo.servers() << " servers x " << topo.gpus_per_server()
            << " GPUs as threads of one process (host transport); decomposer " << o.decomposer << ", granule "
            << o.granule << " B\n"
            << "# input: " << input_description(o) << "\n"
            << "# call, direct: measured wall time per all-to-allv (median of " << o.iters
            << " after a warm-up), every received byte checked; model: alpha-beta prediction for the\n"
            << "# NVLink/NIC cluster the plan is made for (this machine has neither)\n"
            << strf("%5s %5s %5s %11s %6s %10s %10s %8s %9s %9s %9s %9s %12s\n", "index", "ranks", "SxG", "bytes",
                    "stages", "call", "direct", "direct/", "plan", "execute", "FAST", "direct", "checked")
            << strf("%5s %5s %5s %11s %6s %10s %10s %8s %9s %9s %9s %9s %12s\n", "", "", "", "MiB", "", "ms",
                    "ms", "call", "us", "ms", "ms model", "ms model", "MiB");
  bytes_t all_checked = 0;
  for (std::size_t k = 0; k < w.matrices.size(); ++k) {
    const fa::traffic_matrix& t = w.matrices[k];
    const run_figures fast =
        with_decomposer(o, fa::scaleout_of(topo), [&](auto dec) { return run_host(topo, t, o, dec); });
    const run_figures direct = run_host<fa::direct_decomposer>(topo, t, o);
    const fa::plan_options popt{o.granule, o.max_plan_bytes};
    const double model_fast = with_decomposer(o, fa::scaleout_of(topo), [&](auto dec) {
      return fa::predict(topo, fa::planner<Topo, decltype(dec)>(topo, planning_options(o), dec).make(t), cp).total_s;
    });
    const double model_direct = fa::predict(topo, fa::make_plan<fa::direct_decomposer>(topo, t, popt), cp).total_s;
    const double lb = fa::lower_bound(topo, t).overall_s();
    const bytes_t total = t.sum();
    const std::string shape = std::to_string(topo.servers()) + "x" + std::to_string(topo.gpus_per_server());
    std::cout << strf("%5zu %5d %5s %11.2f %6zu %10.3f %10.3f %8.2f %9.1f %9.3f %9.4f %9.4f %12.2f\n",
                      w.first_index + k, n, shape.c_str(), total / mib, fast.stages, fast.call_s * 1e3,
                      direct.call_s * 1e3, ratio(direct.call_s, fast.call_s), fast.stats.plan_s * 1e6,
                      fast.stats.execute_s * 1e3, model_fast * 1e3, model_direct * 1e3,
                      (fast.bytes_checked + direct.bytes_checked) / mib);
    all_checked += fast.bytes_checked + direct.bytes_checked;
    if (report.is_open()) {
      report_call_fields(report, w.first_index + k, n, topo, total, fast.stages, fast.staging_max, fast.call_s,
                         direct.call_s, fast.stats);
      report << ", \"predicted_s\": " << json_real(model_fast) << ", \"predicted_direct_s\": " << json_real(model_direct)
             << ", \"lower_bound_s\": " << json_real(lb)
             << ", \"bytes_checked\": " << fast.bytes_checked + direct.bytes_checked << "}\n";
    }
  }
  if (report.is_open() && !report.flush()) throw fa::error("cannot write report file '" + o.report_path + "'");
  std::cout << "# every received byte checked: " << strf("%.2f MiB", all_checked / mib) << ", all correct\n";
  return 0;
}

#ifdef FASTA2A_HAVE_MPI
// ---------------------------------------------------------------------------------------------
// Running over MPI: every process is one rank (fasta2a run --transport mpi, under mpirun)
// ---------------------------------------------------------------------------------------------

constexpr const char* mpi_run_usage = R"(
Over MPI (this fasta2a is built with the MPI transport), every process is one rank:
  mpirun -np N fasta2a run --transport mpi --gpus G INPUT [options]
  --transport mpi         servers are N / G consecutive ranks (--servers may be left out; if
                          given it must be N / G); every rank holds only its own buffers
  --compare-mpi           also run MPI_Alltoallv on the same send buffers and compare every
                          received byte with the engine's; its time is shown beside the engine's
  Times are the slowest rank's wall time per call after a barrier. The report adds
  mpi_alltoallv_s (null without --compare-mpi) and bytes_compared_mpi.
)";

/// What one matrix measured over MPI, summed or maximised over the ranks where that is meant.
struct mpi_figures {
  double call_s = 0;        // median over calls of the slowest rank's time
  fa::call_stats stats{};   // rank 0's breakdown of that call
  bytes_t checked = 0;      // received bytes compared with the senders' patterns, all ranks and calls
  bytes_t compared = 0;     // received bytes compared with MPI_Alltoallv's, all ranks
  double mpi_s = 0;         // MPI_Alltoallv, as call_s
  std::size_t stages = 0;
  bytes_t staging_max = 0;  // the largest staging buffer of any rank
};

double slowest_rank(double seconds) {
  double m = 0;
  MPI_Allreduce(&seconds, &m, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return m;
}

bytes_t sum_over_ranks(bytes_t x) {
  bytes_t s = 0;
  MPI_Allreduce(&x, &s, 1, MPI_UINT64_T, MPI_SUM, MPI_COMM_WORLD);
  return s;
}

/// One warm-up and o.iters timed calls of the engine with decomposer D on the MPI transport,
/// every received byte of every call checked; with `compare`, MPI_Alltoallv too.
template <fa::Decomposer D>
mpi_figures run_mpi_engine(const fa::two_tier_topology& topo, const fa::traffic_matrix& t, const options& o,
                           bool compare, D dec = D()) {
  using clock = std::chrono::steady_clock;
  int me = 0, n = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  fa::mpi_bootstrap boot(MPI_COMM_WORLD);
  fa::mpi_transport tr(MPI_COMM_WORLD);
  fa::engine<fa::two_tier_topology, fa::mpi_bootstrap, fa::mpi_transport, fa::mpi_transport, D> eng(
      topo, boot, tr, tr, engine_options_of(o), dec);
  const fa::packed_layout l(t, me);
  std::vector<std::byte> send(l.send_bytes), recv(l.recv_bytes);
  l.fill(send, me);

  mpi_figures f;
  std::vector<std::pair<double, fa::call_stats>> calls;
  bytes_t checked = 0;
  for (unsigned c = 0; c <= o.iters; ++c) { // call 0 is the warm-up
    std::fill(recv.begin(), recv.end(), std::byte{0});
    MPI_Barrier(MPI_COMM_WORLD);
    const auto start = clock::now();
    eng.alltoallv(send, l.send_counts, l.send_displs, recv, l.recv_counts, l.recv_displs);
    const double s = slowest_rank(std::chrono::duration<double>(clock::now() - start).count());
    if (c > 0) calls.emplace_back(s, eng.last_stats());
    check_delivery(l, recv, me, c);
    checked += l.recv_bytes;
  }
  std::sort(calls.begin(), calls.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  f.call_s = calls[calls.size() / 2].first;
  f.stats = calls[calls.size() / 2].second;
  f.checked = sum_over_ranks(checked);
  f.stages = eng.last_plan().stages();
  bytes_t staging = eng.staging_bytes();
  MPI_Allreduce(MPI_IN_PLACE, &staging, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
  f.staging_max = staging;

  if (compare) {
    // MPI_Alltoallv counts in int: a larger matrix cannot be compared (every rank must agree).
    int fits = l.send_bytes <= INT_MAX && l.recv_bytes <= INT_MAX ? 1 : 0;
    MPI_Allreduce(MPI_IN_PLACE, &fits, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (!fits) throw fa::error("--compare-mpi: a rank's buffer passes INT_MAX bytes, beyond MPI_Alltoallv's int counts");
    const auto ints = [](const std::vector<std::uint64_t>& v) { return std::vector<int>(v.begin(), v.end()); };
    const std::vector<int> sc = ints(l.send_counts), sd = ints(l.send_displs), rc = ints(l.recv_counts),
                           rd = ints(l.recv_displs);
    std::vector<std::byte> ref(recv.size());
    std::vector<double> times;
    for (unsigned c = 0; c <= o.iters; ++c) {
      MPI_Barrier(MPI_COMM_WORLD);
      const auto start = clock::now();
      MPI_Alltoallv(send.data(), sc.data(), sd.data(), MPI_BYTE, ref.data(), rc.data(), rd.data(), MPI_BYTE,
                    MPI_COMM_WORLD);
      const double s = slowest_rank(std::chrono::duration<double>(clock::now() - start).count());
      if (c > 0) times.push_back(s);
    }
    std::sort(times.begin(), times.end());
    f.mpi_s = times[times.size() / 2];
    bytes_t differ = 0;
    for (std::size_t k = 0; k < recv.size(); ++k) differ += recv[k] != ref[k];
    if (differ != 0)
      throw delivery_failure("rank " + std::to_string(me) + ": " + std::to_string(differ) + " of " +
                             std::to_string(recv.size()) + " received bytes differ from MPI_Alltoallv's");
    f.compared = sum_over_ranks(recv.size());
  }
  return f;
}

/// `fasta2a run --transport mpi`: this process is one rank of MPI_COMM_WORLD.
int run_mpi_command(const options& o) {
  int me = 0, n = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  const fa::two_tier_topology topo = fa::mpi_world_topology(o.gpus, MPI_COMM_WORLD, o.links);
  if (o.servers != 0 && o.servers != topo.servers())
    throw fa::error("--servers " + std::to_string(o.servers) + " does not match " + std::to_string(n) +
                    " MPI ranks of " + std::to_string(o.gpus) + " GPUs per server (" +
                    std::to_string(topo.servers()) + " servers)");
  const workload w = load_workload(o, n); // every rank reads or generates the same matrices
  std::ofstream report;
  if (me == 0 && !o.report_path.empty()) {
    report.open(o.report_path, std::ios::binary | std::ios::trunc);
    if (!report) throw fa::error("cannot open report file '" + o.report_path + "' for writing");
  }
  if (me == 0)
    std::cout << "# fasta2a run: " << topo.servers() << " servers x " << topo.gpus_per_server()
              << " GPUs as " << n << " MPI processes (MPI transport); decomposer " << o.decomposer
              << ", granule " << o.granule << " B\n"
              << "# input: " << input_description(o) << "\n"
              << "# call, direct" << (o.compare_mpi ? ", MPI_Alltoallv" : "")
              << ": the slowest rank's wall time per all-to-allv (median of " << o.iters
              << " after a warm-up), every received byte checked\n"
              << strf("%5s %5s %5s %11s %6s %10s %10s %8s %10s %8s %9s %9s %9s %12s\n", "index", "ranks", "SxG",
                      "bytes", "stages", "call", "direct", "direct/", "Alltoallv", "MPI/", "plan", "exchange",
                      "execute", "checked")
              << strf("%5s %5s %5s %11s %6s %10s %10s %8s %10s %8s %9s %9s %9s %12s\n", "", "", "", "MiB", "", "ms",
                      "ms", "call", "ms", "call", "us", "us", "ms", "MiB");
  bytes_t all_checked = 0, all_compared = 0;
  for (std::size_t k = 0; k < w.matrices.size(); ++k) {
    const fa::traffic_matrix& t = w.matrices[k];
    const mpi_figures fast = with_decomposer(o, fa::scaleout_of(topo), [&](auto dec) {
      return run_mpi_engine(topo, t, o, o.compare_mpi, dec);
    });
    const mpi_figures direct = run_mpi_engine<fa::direct_decomposer>(topo, t, o, false);
    all_checked += fast.checked + direct.checked;
    all_compared += fast.compared;
    if (me != 0) continue;
    const bytes_t total = t.sum();
    const std::string shape = std::to_string(topo.servers()) + "x" + std::to_string(topo.gpus_per_server());
    const std::string mpi_ms = o.compare_mpi ? strf("%10.3f", fast.mpi_s * 1e3) : strf("%10s", "-");
    const std::string mpi_ratio = o.compare_mpi ? strf("%8.2f", ratio(fast.mpi_s, fast.call_s)) : strf("%8s", "-");
    std::cout << strf("%5zu %5d %5s %11.2f %6zu %10.3f %10.3f %8.2f %s %s %9.1f %9.1f %9.3f %12.2f\n",
                      w.first_index + k, n, shape.c_str(), total / mib, fast.stages, fast.call_s * 1e3,
                      direct.call_s * 1e3, ratio(direct.call_s, fast.call_s), mpi_ms.c_str(), mpi_ratio.c_str(),
                      fast.stats.plan_s * 1e6, fast.stats.exchange_s * 1e6, fast.stats.execute_s * 1e3,
                      (fast.checked + direct.checked) / mib);
    if (report.is_open()) {
      report_call_fields(report, w.first_index + k, n, topo, total, fast.stages, fast.staging_max, fast.call_s,
                         direct.call_s, fast.stats);
      report << ", \"mpi_alltoallv_s\": " << (o.compare_mpi ? json_real(fast.mpi_s) : std::string("null"))
             << ", \"bytes_checked\": " << fast.checked + direct.checked
             << ", \"bytes_compared_mpi\": " << fast.compared << "}\n";
    }
  }
  if (report.is_open() && !report.flush()) throw fa::error("cannot write report file '" + o.report_path + "'");
  if (me == 0) {
    std::cout << "# every received byte checked: " << strf("%.2f MiB", all_checked / mib)
              << " against the senders' patterns";
    if (o.compare_mpi) std::cout << strf(", %.2f MiB", all_compared / mib) << " against MPI_Alltoallv";
    std::cout << ", all correct\n";
    std::cout.flush();
  }
  return 0;
}

/// Runs `fasta2a run --transport mpi` between MPI_Init and MPI_Finalize. An error on one rank may
/// leave the others waiting in MPI, so it aborts the whole job (after saying what went wrong)
/// rather than returning.
int run_mpi(const options& o) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) MPI_Init(nullptr, nullptr);
  int me = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  int code = 0;
  try {
    code = run_mpi_command(o);
  } catch (const delivery_failure& e) {
    std::cerr << "fasta2a: error: " << e.what() << " (this is a bug in fasta2a; please report it)\n";
    code = 1;
  } catch (const std::exception& e) { // fasta2a::error and anything else
    std::cerr << "fasta2a: error: rank " << me << ": " << e.what() << "\n";
    code = 2;
  }
  if (code != 0) {
    std::cerr.flush();
    MPI_Abort(MPI_COMM_WORLD, code);
  }
  MPI_Finalize();
  return 0;
}
#endif // FASTA2A_HAVE_MPI

int run_run(const std::vector<std::string_view>& args) {
  const std::optional<options> parsed = parse_options(args, true);
  if (!parsed) {
    std::cout << run_usage;
#ifdef FASTA2A_HAVE_MPI
    std::cout << mpi_run_usage;
#endif
    return 0;
  }
  const options& o = *parsed;
#ifdef FASTA2A_HAVE_MPI
  if (o.transport == "mpi") return run_mpi(o);
#endif
  if (o.transport != "host")
    throw fa::error("--transport " + o.transport + " is not built into this fasta2a (host only)");
  if (o.compare_mpi) throw fa::error("--compare-mpi needs --transport mpi");
  if (o.gpus == 8) return run_command(fa::fixed_topology<8>(o.servers, o.links), o);
  return run_command(fa::two_tier_topology(o.servers, o.gpus, o.links), o);
}

int run_plan(const std::vector<std::string_view>& args) {
  const std::optional<options> parsed = parse_options(args, false);
  if (!parsed) {
    std::cout << plan_usage;
    return 0;
  }
  const options& o = *parsed;
  // Eight GPUs per server is the common server: plan it with the compile-time-sized topology,
  // whose per-server loops unroll; any other size takes the runtime-sized one.
  if (o.gpus == 8) return plan_command(fa::fixed_topology<8>(o.servers, o.links), o);
  return plan_command(fa::two_tier_topology(o.servers, o.gpus, o.links), o);
}

} // namespace

int main(int argc, char** argv) {
  const std::vector<std::string_view> args(argv + 1, argv + argc);
  try {
    if (args.empty()) {
      std::cerr << "fasta2a: error: no command given\n" << general_usage;
      return 2;
    }
    if (args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
      std::cout << general_usage << "\n" << plan_usage;
      return 0;
    }
    if (args[0] == "run") return run_run({args.begin() + 1, args.end()});
    if (args[0] != "plan")
      throw fa::error("unknown command '" + std::string(args[0]) + "' (try fasta2a --help)");
    return run_plan({args.begin() + 1, args.end()});
  } catch (const delivery_failure& e) {
    std::cerr << "fasta2a: error: " << e.what() << " (this is a bug in fasta2a; please report it)\n";
    return 1;
  } catch (const verification_failure& e) {
    std::cerr << "fasta2a: error: " << e.what() << " (this is a bug in fasta2a; please report it)\n";
    return 1;
  } catch (const fa::error& e) { // plan_too_large included
    std::cerr << "fasta2a: error: " << e.what() << "\n";
    return 2;
  } catch (const std::bad_alloc&) {
    std::cerr << "fasta2a: error: out of memory (try fewer ranks or a smaller --max-plan-bytes)\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "fasta2a: error: internal error: " << e.what() << "\n";
    return 1;
  }
}
