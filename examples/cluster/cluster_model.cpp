// fasta2a: the cost model against the emulated cluster's measurements. Reads a results .jsonl of
// bench_cluster.sh (one JSON object per method and run, as cluster_bench prints them), regenerates
// each cell's traffic matrix with the benchmark's own generator (cluster_workload.hpp), plans it
// as the benchmark's engine did (same decomposer, parameters and granule), and predicts it with
// both models of cost_model.hpp on the emulated cluster's figures: the step-synchronous model and
// the pipelined one (the engine's rail window). Prints predicted / measured per cell, then the
// median and the worst ratio per model. Every predicted figure is a MODEL; only the measured
// column was measured (by bench_cluster.sh, on the day its results were recorded).
//
//   cluster_model examples/cluster/results/results.jsonl --trace ../shared/workloads/megatron-4n-32gpu.txt
//
// Nothing is run on a network: this reads recorded results.
#include "cluster_workload.hpp"

#include <fasta2a/cost_model.hpp>
#include <fasta2a/engine.hpp>
#include <fasta2a/plan_reader.hpp>
#include <fasta2a/planner.hpp>
#include <fasta2a/registry.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

namespace fa = fasta2a;
namespace fj = fasta2a::detail; // the plan reader's JSON cursor
using fa::bytes_t;

namespace {

constexpr const char* usage = R"(usage: cluster_model RESULTS.jsonl [options]
  --trace FILE           the Megatron trace the megatron[I] cells were reduced from
  --uniform-bytes B      bytes per rank of the uniform cells (bench_cluster.sh's default 64MiB)
  --zipf-bytes B         ... of the zipf(X) cells (default 16MiB)
  --hotspot-bytes B      ... of the hotspot cells (default 8MiB; one hot rank, share 0.5)
  --megatron-unit U      bytes per token of the megatron[I] cells (default 4096)
  --seed S --granule B   the benchmark's generator seed and engine granule (defaults 1, 4096)
  --plan-alpha-ms A      the stage cost the benchmark's decomposers and fast-adaptive planned
                         with (cluster_bench --alpha-ms; default 5)
  --alpha-ms A           the stage cost both models charge (default: --plan-alpha-ms)
  --rail-window W        the engine's stages in flight (cluster_bench --rail-window; default 5)
  --scaleup-gbyte X      scale-up bandwidth per rank port, GB/s (default 450, what cluster_bench
                         gives its engine's topology for the shared memory inside a server)
  --markdown             print the table as Markdown
  --expect-cells N       fail unless N engine cells (methods other than mpi_alltoallv) were predicted
Cells are (workload, method); measured is the median over runs of each run's median call, as in
bench_cluster.sh's table. Ratios are predicted / measured. A cell whose regenerated matrix or
stage count differs from the recorded one is an error: the prediction would be of another plan.
)";

struct options {
  std::string results;
  std::string trace;
  bytes_t uniform_bytes = bytes_t{64} << 20, zipf_bytes = bytes_t{16} << 20, hotspot_bytes = bytes_t{8} << 20;
  bytes_t megatron_unit = 4096, granule = 4096;
  std::uint64_t seed = 1;
  double plan_alpha_s = 5e-3;
  std::optional<double> alpha_s;
  std::size_t rail_window = fa::engine_options{}.rail_window;
  double scaleup = 450e9;
  bool markdown = false;
  std::optional<std::size_t> expect_cells;
};

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::fputs(usage, stdout);
      std::exit(0);
    }
    if (flag == "--markdown") {
      o.markdown = true;
      continue;
    }
    if (!flag.starts_with("--")) {
      if (!o.results.empty()) throw fa::error("more than one results file ('" + o.results + "', '" + std::string(flag) + "')");
      o.results = flag;
      continue;
    }
    if (i + 1 >= argc) throw fa::error("option " + std::string(flag) + " needs a value");
    const std::string v = argv[++i];
    const auto number = [&](double lo) {
      std::size_t used = 0;
      double x = 0;
      try {
        x = std::stod(v, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used != v.size() || !std::isfinite(x) || x < lo)
        throw fa::error(std::string(flag) + ": expected a number of at least " + std::to_string(lo) + ", got '" + v + "'");
      return x;
    };
    if (flag == "--trace") o.trace = v;
    else if (flag == "--uniform-bytes") o.uniform_bytes = fa::parse_bytes(v, flag);
    else if (flag == "--zipf-bytes") o.zipf_bytes = fa::parse_bytes(v, flag);
    else if (flag == "--hotspot-bytes") o.hotspot_bytes = fa::parse_bytes(v, flag);
    else if (flag == "--megatron-unit") o.megatron_unit = fa::parse_bytes(v, flag);
    else if (flag == "--granule") o.granule = fa::parse_bytes(v, flag);
    else if (flag == "--seed") o.seed = static_cast<std::uint64_t>(number(0));
    else if (flag == "--plan-alpha-ms") o.plan_alpha_s = number(0) * 1e-3;
    else if (flag == "--alpha-ms") o.alpha_s = number(0) * 1e-3;
    else if (flag == "--rail-window") o.rail_window = static_cast<std::size_t>(number(1));
    else if (flag == "--expect-cells") o.expect_cells = static_cast<std::size_t>(number(0));
    else if (flag == "--scaleup-gbyte") o.scaleup = number(1e-9) * 1e9;
    else throw fa::error("unknown option '" + std::string(flag) + "' (try --help)");
  }
  if (o.results.empty()) throw fa::error("no results file given (try --help)");
  if (o.granule < 1) throw fa::error("--granule must be at least 1");
  return o;
}

// --- the results file: the few fields a cell needs --------------------------------------------

struct row {
  std::string workload, method, executed;
  int servers = 0, gpus = 0;
  double rate_mbit = 0, median_s = 0;
  bytes_t bytes = 0, inter = 0;
  std::size_t stages = 0;
  std::size_t line = 0;
};

void skip_value(fj::json_cursor& c) {
  const auto t = c.next_type();
  if (!t) c.fail("a JSON value");
  std::string s;
  switch (*t) {
  case fj::json_type::string: c.string(s); return;
  case fj::json_type::integer:
  case fj::json_type::real: c.number(); return;
  case fj::json_type::boolean:
  case fj::json_type::null: {
    const std::string_view word = c.peek() == 't' ? "true" : c.peek() == 'f' ? "false" : "null";
    for (char ch : word) c.expect(ch, "the literal " + std::string(word));
    return;
  }
  case fj::json_type::array:
  case fj::json_type::object: {
    const char close = *t == fj::json_type::array ? ']' : '}';
    c.expect(*t == fj::json_type::array ? '[' : '{', "a container");
    for (bool first = true; c.next(close, first);) {
      if (close == '}') c.name(s);
      skip_value(c); // next_type skips the white space before the value
    }
    return;
  }
  }
}

double number_of(fj::json_cursor& c) {
  if (c.next_type() != fj::json_type::integer) c.fail("a number");
  const fj::json_number_token n = c.number();
  if (!n.integer) return n.real;
  return n.negative ? -static_cast<double>(n.magnitude) : static_cast<double>(n.magnitude);
}

row read_row(std::string_view text, std::size_t line) {
  fj::json_cursor c(text);
  row r;
  r.line = line;
  c.skip_space();
  c.expect('{', "'{' (each line of a results file is one JSON object)");
  std::string key;
  std::map<std::string, bool> seen;
  for (bool first = true; c.next('}', first);) {
    c.name(key);
    c.skip_space();
    seen[key] = true;
    if (key == "workload") c.string(r.workload);
    else if (key == "method") c.string(r.method);
    else if (key == "executed") c.string(r.executed);
    else if (key == "servers") r.servers = static_cast<int>(number_of(c));
    else if (key == "gpus") r.gpus = static_cast<int>(number_of(c));
    else if (key == "rate_mbit") r.rate_mbit = number_of(c);
    else if (key == "median_s") r.median_s = number_of(c);
    else if (key == "bytes") r.bytes = static_cast<bytes_t>(number_of(c));
    else if (key == "inter_server_bytes") r.inter = static_cast<bytes_t>(number_of(c));
    else if (key == "stages") r.stages = static_cast<std::size_t>(number_of(c));
    else skip_value(c);
  }
  c.finish();
  for (const char* need : {"workload", "method", "servers", "gpus", "rate_mbit", "median_s", "bytes", "inter_server_bytes", "stages"})
    if (!seen.count(need)) throw fa::error("line " + std::to_string(line) + ": no \"" + need + "\" field");
  if (r.servers < 1 || r.gpus < 1 || !(r.rate_mbit > 0) || !(r.median_s > 0))
    throw fa::error("line " + std::to_string(line) + ": servers, gpus, rate_mbit and median_s must be positive");
  return r;
}

// --- a cell's workload, as bench_cluster.sh ran it ---------------------------------------------

/// The workload a label names (bench_cluster.sh's labels: uniform, zipf(X), hotspot, megatron[I],
/// each possibly followed by " [tcp: ...]").
fa::cluster::workload_spec spec_of(const std::string& label, const options& o) {
  fa::cluster::workload_spec w;
  w.seed = o.seed;
  w.granule = o.granule;
  const std::string name = label.substr(0, label.find(" ["));
  const auto inside = [&](char open, char close) {
    const std::size_t a = name.find(open), b = name.rfind(close);
    if (a == std::string::npos || b != name.size() - 1 || b <= a + 1)
      throw fa::error("workload '" + label + "': expected " + name.substr(0, a) + open + "..." + close);
    return name.substr(a + 1, b - a - 1);
  };
  if (name == "uniform") {
    w.workload = "uniform";
    w.bytes_per_rank = o.uniform_bytes;
  } else if (name == "hotspot") {
    w.workload = "hotspot";
    w.hot = 1;
    w.share = 0.5;
    w.bytes_per_rank = o.hotspot_bytes;
  } else if (name.starts_with("zipf(")) {
    w.workload = "zipf";
    w.zipf = std::stod(inside('(', ')'));
    w.bytes_per_rank = o.zipf_bytes;
  } else if (name.starts_with("megatron[")) {
    w.workload = "megatron";
    w.index = std::stoul(inside('[', ']'));
    w.unit = o.megatron_unit;
    if (o.trace.empty()) throw fa::error("workload '" + label + "' needs the Megatron trace: --trace FILE");
    w.matrix = o.trace;
  } else {
    throw fa::error("workload '" + label + "': not one bench_cluster.sh makes (uniform, zipf(X), hotspot, megatron[I])");
  }
  return w;
}

struct cell {
  std::string workload, method;
  std::vector<const row*> runs;
  double measured = 0;
  std::size_t stages = 0;
  std::string executed;
  bool engine = false;
  double step_sync = 0, pipelined = 0;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/// The ratio farthest from 1 (by |log|).
double worst(const std::vector<double>& v) {
  double w = 1;
  for (double x : v)
    if (std::abs(std::log(x)) > std::abs(std::log(w))) w = x;
  return w;
}

int run(int argc, char** argv) {
  const options o = parse(argc, argv);
  const double alpha = o.alpha_s.value_or(o.plan_alpha_s);
  std::ifstream in(o.results);
  if (!in) throw fa::error("cannot read " + o.results);
  std::vector<row> rows;
  std::size_t line_no = 0;
  for (std::string line; std::getline(in, line);) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    rows.push_back(read_row(line, line_no));
  }
  if (rows.empty()) throw fa::error(o.results + " holds no results");

  // Cells in the file's order.
  std::vector<cell> cells;
  for (const row& r : rows) {
    auto it = std::find_if(cells.begin(), cells.end(),
                           [&](const cell& c) { return c.workload == r.workload && c.method == r.method; });
    if (it == cells.end()) {
      cell c;
      c.workload = r.workload;
      c.method = r.method;
      cells.push_back(std::move(c));
      it = cells.end() - 1;
    }
    const row& f = it->runs.empty() ? r : *it->runs.front();
    if (f.servers != r.servers || f.gpus != r.gpus || f.rate_mbit != r.rate_mbit || f.bytes != r.bytes || f.stages != r.stages)
      throw fa::error("line " + std::to_string(r.line) + ": " + r.workload + " / " + r.method +
                      " differs from its earlier runs in shape, rate, bytes or stages");
    it->runs.push_back(&r);
  }

  std::map<std::string, fa::traffic_matrix> matrices;
  std::size_t skipped = 0;
  for (cell& c : cells) {
    const row& r = *c.runs.front();
    std::vector<double> meds;
    for (const row* x : c.runs) meds.push_back(x->median_s);
    c.measured = median(meds);
    c.stages = r.stages;
    c.executed = r.executed;
    const bool mpi = c.method == "mpi_alltoallv";
    const std::optional<fa::cluster::engine_method> em = fa::cluster::engine_method_of(c.method);
    if (!mpi && !em) {
      std::fprintf(stderr, "cluster_model: %s / %s: not the engine's nor MPI_Alltoallv: not predicted\n",
                   c.workload.c_str(), c.method.c_str());
      ++skipped;
      continue;
    }
    c.engine = !mpi;
    const int S = r.servers, G = r.gpus;
    const fa::rank_t n = S * G;
    const std::string key = c.workload + "/" + std::to_string(n);
    if (!matrices.count(key)) matrices.emplace(key, fa::cluster::make_traffic(spec_of(c.workload, o), n));
    const fa::traffic_matrix& t = matrices.at(key);
    bytes_t total = 0, inter = 0;
    for (fa::rank_t i = 0; i < n; ++i)
      for (fa::rank_t j = 0; j < n; ++j) {
        total += t(i, j);
        if (i / G != j / G) inter += t(i, j);
      }
    if (total != r.bytes || inter != r.inter)
      throw fa::error(c.workload + " / " + c.method + ": the regenerated matrix has " + std::to_string(total) + " bytes (" +
                      std::to_string(inter) + " between servers), the recorded run " + std::to_string(r.bytes) + " (" +
                      std::to_string(r.inter) + "): not the benchmark's matrix (sizes, seed or trace differ)");

    // The plan, as cluster_bench's engine made it: its topology (the shaped NIC rate, scale-up
    // 450 GB/s, default alpha) and decomposer parameters (the NIC rate and --alpha-ms).
    const double b_out = r.rate_mbit * 1e6 / 8;
    const fa::two_tier_topology engine_topo(S, G, fa::link_model{fa::scaleup_kind::switch_fabric, 450e9, b_out});
    const fa::decomposer_params dp{.scaleout = {.alpha_s = o.plan_alpha_s, .bandwidth = b_out},
                                   .quantum = fa::quantum_rule::search};
    const fa::cluster::engine_method e = mpi ? fa::cluster::engine_method{"direct"} : *em;
    const std::optional<double> fallback = e.adaptive ? std::optional<double>(o.plan_alpha_s) : std::nullopt;
    const fa::plan p = fa::with_decomposer(e.decomposer, dp, [&](auto dec) {
      fa::planner<fa::two_tier_topology, decltype(dec)> pl(
          engine_topo, {.granule = o.granule, .direct_if_faster_alpha = fallback}, std::move(dec));
      return pl.make(t);
    });
    if (c.engine && p.stages() != r.stages)
      throw fa::error(c.workload + " / " + c.method + ": the plan has " + std::to_string(p.stages()) +
                      " stages, the recorded run " + std::to_string(r.stages) + ": not the benchmark's plan");

    // The emulated cluster in the models: the shaped NIC rate, alpha per stage, shared memory as
    // a switch of --scaleup-gbyte per rank.
    const fa::two_tier_topology model_topo(S, G, fa::link_model{fa::scaleup_kind::switch_fabric, o.scaleup, b_out, alpha});
    const fa::prediction pr = fa::predict(model_topo, p, {.alpha = alpha, .rail_window = o.rail_window});
    c.step_sync = pr.step_synchronous_s();
    c.pipelined = *pr.pipelined_s;
  }

  // The table.
  const char* fmt_head = o.markdown ? "| workload | method | stages | measured (s) | step-synchronous (s) | ratio | pipelined, W=%zu (s) | ratio |\n|---|---|---|---|---|---|---|---|\n"
                                    : "%-14s %-22s %6s %12s %12s %7s %12s %7s  (pipelined: W=%zu)\n";
  if (o.markdown) std::printf(fmt_head, o.rail_window);
  else std::printf(fmt_head, "workload", "method", "stages", "measured_s", "stepsync_s", "ratio", "pipelined_s", "ratio", o.rail_window);
  std::vector<double> rs, rp, rs_staged, rp_staged;
  std::size_t predicted = 0;
  for (const cell& c : cells) {
    if (c.step_sync <= 0 && c.pipelined <= 0) continue;
    ++predicted;
    const double a = c.step_sync / c.measured, b = c.pipelined / c.measured;
    std::string m = c.method;
    if (!c.engine) m += " (modelled as direct)";
    else if (!c.executed.empty() && c.executed != "birkhoff" && c.method.starts_with("fast-adaptive")) m += " [ran: " + c.executed + "]";
    if (o.markdown)
      std::printf("| %s | %s | %zu | %.3f | %.3f | %.3f | %.3f | %.3f |\n", c.workload.c_str(), m.c_str(), c.stages,
                  c.measured, c.step_sync, a, c.pipelined, b);
    else
      std::printf("%-14s %-22s %6zu %12.4f %12.4f %7.3f %12.4f %7.3f\n", c.workload.c_str(), m.c_str(), c.stages,
                  c.measured, c.step_sync, a, c.pipelined, b);
    if (!c.engine) continue;
    rs.push_back(a);
    rp.push_back(b);
    if (c.stages > 0) {
      rs_staged.push_back(a);
      rp_staged.push_back(b);
    }
  }
  if (rs.empty()) throw fa::error(o.results + ": no engine cell to predict");
  for (std::size_t i = 0; i < rs.size(); ++i)
    if (!std::isfinite(rs[i]) || !(rs[i] > 0) || !std::isfinite(rp[i]) || !(rp[i] > 0))
      throw fa::error("a ratio is not a finite positive number (a defect)");
  std::printf("\n%s engine cells (predicted / measured): step-synchronous median %.3f, worst %.3f; pipelined (W=%zu) median %.3f, worst %.3f\n",
              std::to_string(rs.size()).c_str(), median(rs), worst(rs), o.rail_window, median(rp), worst(rp));
  if (!rs_staged.empty())
    std::printf("%zu staged cells: step-synchronous median %.3f, worst %.3f; pipelined median %.3f, worst %.3f\n",
                rs_staged.size(), median(rs_staged), worst(rs_staged), median(rp_staged), worst(rp_staged));
  std::printf("model: NIC %g Mbit/s (payload), alpha %g ms per stage, scale-up %g GB/s per rank; plans with alpha %g ms, "
              "granule %llu; %zu cells predicted, %zu not\n",
              rows.front().rate_mbit, alpha * 1e3, o.scaleup / 1e9, o.plan_alpha_s * 1e3,
              static_cast<unsigned long long>(o.granule), predicted, skipped);
  if (o.expect_cells && rs.size() != *o.expect_cells)
    throw fa::error(std::to_string(rs.size()) + " engine cells predicted, " + std::to_string(*o.expect_cells) + " expected");
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cluster_model: error: %s\n", e.what());
    return 1;
  }
}
