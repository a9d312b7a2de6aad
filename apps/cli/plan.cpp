// fasta2a CLI: `fasta2a plan`. Plans traffic matrices with FAST, verifies every plan, and compares
// it with the spread-out and direct baselines in the alpha-beta cost model (times other than
// synthesis are model predictions).
#include "commands.hpp"
#include "options.hpp"
#include "report.hpp"
#include "workload.hpp"

#include <fasta2a/cost_model.hpp>
#include <fasta2a/decompose.hpp>
#include <fasta2a/json_writer.hpp>
#include <fasta2a/plan.hpp>
#include <fasta2a/planner.hpp>
#include <fasta2a/registry.hpp>
#include <fasta2a/svg.hpp>
#include <fasta2a/topology.hpp>
#include <fasta2a/traffic.hpp>
#include <fasta2a/verify.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <variant>
#include <vector>

namespace cli {
namespace {

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

/// A planner of every registered decomposer type, on one topology type.
template <class Topo, class Decomposers> struct planners_of;
template <class Topo, class... Ds> struct planners_of<Topo, std::tuple<Ds...>> {
  using type = std::variant<fa::planner<Topo, Ds>...>;
};

/// The FAST planner with the decomposer chosen on the command line.
template <fa::Topology Topo>
using fast_planner = typename planners_of<Topo, fa::registered_decomposers>::type;

/// The FAST planner of --decomposer, configured from --alpha, --adaptive and the topology's NICs.
template <fa::Topology Topo>
fast_planner<Topo> make_fast_planner(const options& o, const Topo& topo) {
  return fa::with_decomposer(o.decomposer, decomposer_params_of(fa::scaleout_of(topo)),
                             [&](auto dec) -> fast_planner<Topo> {
                               return fa::planner<Topo, decltype(dec)>(topo, planning_options(o), dec);
                             });
}

/// Checks rank r's view against the whole plan of the same matrix: the same stages, staging sizes
/// and total, and the whole plan's pieces that r sends, receives or carries on its rail, in the
/// same order with the same values, and r's ops on the same pieces in the same order (the promise
/// of planner::make_rank). Throws verification_failure naming the first difference.
void check_view_against_whole(const fa::plan& view, const fa::plan& whole, rank_t r) {
  const auto fail = [&](const std::string& what) {
    throw verification_failure("rank " + std::to_string(r) + "'s part differs from the whole plan: " + what);
  };
  if (view.decomposer != whole.decomposer || view.choice != whole.choice || view.staged != whole.staged)
    fail("decomposer or choice");
  if (view.stage_weight != whole.stage_weight || view.stage_perm != whole.stage_perm) fail("stages");
  if (view.staging_bytes != whole.staging_bytes) fail("staging sizes");
  if (view.total_bytes != whole.total_bytes || view.rail_load != whole.rail_load) fail("total or rail load");
  std::size_t k = 0;
  for (const fa::piece& pc : whole.pieces) {
    const bool rails = pc.rail >= 0 && (whole.rail_source(pc) == r || whole.rail_target(pc) == r);
    if (pc.src != r && pc.dst != r && !rails) continue;
    if (k >= view.pieces.size()) fail("it lacks piece " + std::to_string(k) + " and later ones");
    if (!(view.pieces[k] == pc)) fail("piece " + std::to_string(k));
    ++k;
  }
  if (k != view.pieces.size()) fail("it has " + std::to_string(view.pieces.size() - k) + " pieces too many");
  for (std::size_t t = 0; t < whole.op_stages(); ++t) {
    const auto a = view.ops(r, t), b = whole.ops(r, t);
    if (a.size() != b.size()) fail("the number of ops in stage " + std::to_string(t));
    for (std::size_t i = 0; i < a.size(); ++i)
      if (a[i].kind != b[i].kind || !(view.pieces[a[i].piece] == whole.pieces[b[i].piece]))
        fail("op " + std::to_string(i) + " of stage " + std::to_string(t));
  }
}

/// `fasta2a plan --rank R`: rank R's part only (planner::make_rank_into), what rank R computes per
/// call, in memory of the matrix plus one rank's part: no whole plan and no baselines. Each part is
/// checked on its own (fasta2a::verify_rank_view); where the whole plan is small (at most 256 ranks,
/// within --max-plan-bytes) it is also built, verified, and the part compared with it.

// The --report file, truncated, or a closed stream when none was asked for.
std::ofstream open_report(const std::string& path) {
  std::ofstream report;
  if (path.empty()) return report;
  report.open(path, std::ios::binary | std::ios::trunc);
  if (!report) throw fa::error("cannot open report file '" + path + "' for writing");
  return report;
}

template <fa::Topology Topo> int plan_rank_on(const Topo& topo, const options& o) {
  const rank_t n = topo.ranks(), R = o.rank;
  const int S = topo.servers(), G = topo.gpus_per_server();
  if (R >= n)
    throw fa::error(strf("--rank %d is not a rank of %d servers x %d GPUs (ranks 0 to %d)", R, S, G, n - 1));
  const auto scratch = [&](bool whole) {
    return fa::with_decomposer(o.decomposer, decomposer_params_of(fa::scaleout_of(topo)),
                               [&](auto dec) { return fa::planner_scratch_bytes<decltype(dec)>(S, G, whole); });
  };
  const long double need = 8.0L * n * n + scratch(false);
  if (need > static_cast<long double>(o.max_plan_bytes))
    throw fa::plan_too_large(strf("%d servers x %d GPUs need about %.0Lf bytes to plan rank %d's part (the traffic "
                                  "matrix, and the S^2 scratch of the FAST planner), more than the plan size limit "
                                  "of %zu bytes (raise --max-plan-bytes)",
                                  S, G, need, R, o.max_plan_bytes));
  const bool compare = n <= 256 && 8.0L * n * n + scratch(true) <= static_cast<long double>(o.max_plan_bytes);

  fast_planner<Topo> fast = make_fast_planner(o, topo);
  fa::plan view, whole;
  const fa::scaleout_model net = fa::scaleout_of(topo, fa::cost_params{o.alpha_s});

  std::ofstream report = open_report(o.report_path);
  const workload w = load_workload(o, n);
  const auto print_preamble = [&] {
    std::cout << "# fasta2a plan: " << S << " servers x " << G << " GPUs, scale-up " << fa::to_string(topo.scaleup())
              << strf(" %g GB/s", topo.scaleup_bandwidth() / 1e9)
              << (topo.scaleup() == fa::scaleup_kind::switch_fabric ? " per port" : " per pair")
              << strf(", NIC %g GB/s", topo.scaleout_bandwidth() / 1e9) << "; decomposer " << o.decomposer
              << ", granule " << o.granule << " B, alpha " << strf("%g", o.alpha_s * 1e6) << " us\n"
              << "# input: " << input_description(o) << "\n"
              << "# rank " << R << "'s part only (--rank): no whole plan, no baselines. LB, LB+alpha, scale-out: "
              << "alpha-beta MODEL figures, not measurements (scale-out: the stages' alpha + weight / NIC "
              << "bandwidth, the FAST prediction without its scale-up steps); synth: measured wall time of "
              << "planning rank " << R << "'s part, median of " << o.repeat << "\n";
    print_rank_header(std::cout);
  };

  std::vector<double> synth;
  for (std::size_t k = 0; k < w.matrices.size(); ++k) {
    const fa::traffic_matrix& t = w.matrices[k];
    rank_row r;
    r.checked = "own messages";
    const bytes_t budget = staging_budget_of(o, t);
    r.synthesis_rank_us = std::visit(
        [&](auto& p) {
          p.set_staging_budget(budget);
          const double us = timed_make(p, t, view, o.repeat, R);
          using D = typename decomposer_of<std::remove_cvref_t<decltype(p)>>::type;
          const fa::verify_result v = fa::verify_rank_view(view, t, fa::verify_options{.exact_lower_bound = D::exact});
          if (!v) throw verification_failure("rank " + std::to_string(R) + "'s part fails verification: " + v.error);
          if (compare) {
            try {
              p.make_into(t, whole);
            } catch (const fa::plan_too_large&) {
              return us; // the whole plan is past the limit after all: the part's own check stands
            }
            check_plan<D>(whole, t, "FAST");
            check_view_against_whole(view, whole, R);
            r.checked = "whole plan";
          }
          return us;
        },
        fast);
    r.index = w.first_index + k;
    r.ranks = n;
    r.rank = R;
    r.servers = S;
    r.gpus = G;
    r.bytes = view.total_bytes;
    r.stages = view.stages();
    r.pieces = view.pieces.size();
    r.ops = view.op_list.size();
    r.staging = view.staging_bytes[static_cast<std::size_t>(R)];
    for (bytes_t b : view.staging_bytes) r.staging_max = std::max(r.staging_max, b);
    r.decomposer = view.decomposer;
    r.choice = view.choice;
    const fa::lower_bounds lb = fa::lower_bound(topo, t);
    r.lower_bound_s = lb.overall_s();
    r.lower_bound_alpha_s = lb.staged_s(o.alpha_s);
    if (view.staged) {
      r.scaleout_s = fa::scaleout_time(view, net);
    } else { // direct sending: the busiest NIC's inter-server bytes, from the matrix (as predict does)
      std::vector<bytes_t> send(static_cast<std::size_t>(n), 0), recv(static_cast<std::size_t>(n), 0);
      for (rank_t i = 0; i < n; ++i)
        for (rank_t j = 0; j < n; ++j)
          if (i / G != j / G) {
            send[static_cast<std::size_t>(i)] += t(i, j);
            recv[static_cast<std::size_t>(j)] += t(i, j);
          }
      bytes_t nic = 0;
      for (rank_t i = 0; i < n; ++i) nic = std::max({nic, send[static_cast<std::size_t>(i)], recv[static_cast<std::size_t>(i)]});
      r.scaleout_s = net.direct_time(nic);
    }

    if (k == 0) print_preamble();
    print_rank_row(std::cout, r);
    if (!r.choice.empty()) std::cout << "#   matrix " << r.index << " uses " << r.decomposer << ": " << r.choice << "\n";
    std::cout << "#   matrix " << r.index << ": rank " << R << "'s part "
              << (r.checked == "whole plan" ? "checked, and equal to the whole plan's part for that rank"
                                            : "checked on its own (its messages tiled exactly; the whole plan is "
                                              "not built past 256 ranks or --max-plan-bytes)")
              << "\n";
    if (report.is_open()) {
      write_rank_report_line(report, r);
      if (!report) throw fa::error("cannot write report file '" + o.report_path + "'");
    }
    synth.push_back(r.synthesis_rank_us);
  }
  if (report.is_open()) {
    report.flush();
    if (!report) throw fa::error("cannot write report file '" + o.report_path + "'");
  }
  if (o.all)
    std::cout << "# summary over " << w.matrices.size() << " matrices (medians): synthesis "
              << strf("%.1f us", median(synth)) << " rank " << R << "'s part\n";
  std::cout.flush();
  return 0;
}

/// `fasta2a plan` on one topology type: a runtime-sized one or, for 8 GPUs per server, the
/// compile-time-sized one. Every plan is verified before any of its figures is printed.
template <fa::Topology Topo> int plan_on(const Topo& topo, const options& o) {
  const rank_t n = topo.ranks();
  // The traffic matrix (8 bytes per rank pair) and the three planners' scratch and message index
  // (fasta2a::planner_scratch_bytes: FAST, spread-out and direct are all held at once) must fit the
  // limit: say so before allocating any of it.
  const int S = topo.servers(), G = topo.gpus_per_server();
  const long double need =
      8.0L * n * n +
      fa::with_decomposer(o.decomposer, decomposer_params_of(fa::scaleout_of(topo)),
                          [&](auto dec) { return fa::planner_scratch_bytes<decltype(dec)>(S, G, true); }) +
      fa::planner_scratch_bytes<fa::spread_out_decomposer>(S, G, true) +
      fa::planner_scratch_bytes<fa::direct_decomposer>(S, G, true);
  if (need > static_cast<long double>(o.max_plan_bytes))
    throw fa::plan_too_large(strf("%d servers x %d GPUs need about %.0Lf bytes to plan (the traffic matrix, and the "
                                  "S^2 x G scratch and ranks^2 message index of the FAST, spread-out and direct "
                                  "planners), more than the plan size limit of %zu bytes (raise --max-plan-bytes)",
                                  S, G, need, o.max_plan_bytes));

  const fa::plan_options popt{o.granule, o.max_plan_bytes};
  fast_planner<Topo> fast = make_fast_planner(o, topo);
  fa::planner<Topo, fa::spread_out_decomposer> spread(topo, popt);
  fa::planner<Topo, fa::direct_decomposer> direct(topo, popt);
  fa::plan fast_plan, spread_plan, direct_plan;
  const fa::cost_params cp{o.alpha_s};

  std::ofstream report = open_report(o.report_path);

  const workload w = load_workload(o, n);
  // The header is printed with the first row, which follows the first verified plan: input that
  // fails to plan leaves nothing on stdout but the error on stderr.
  const auto print_preamble = [&] {
    std::cout << "# fasta2a plan: " << topo.servers() << " servers x " << topo.gpus_per_server()
              << " GPUs, scale-up " << fa::to_string(topo.scaleup())
              << strf(" %g GB/s", topo.scaleup_bandwidth() / 1e9)
              << (topo.scaleup() == fa::scaleup_kind::switch_fabric ? " per port" : " per pair")
              << strf(", NIC %g GB/s", topo.scaleout_bandwidth() / 1e9) << "; decomposer " << o.decomposer
              << ", granule " << o.granule << " B, alpha " << strf("%g", o.alpha_s * 1e6) << " us\n"
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
    r.staging_budget = staging_budget_of(o, t);
    r.synthesis_us = std::visit(
        [&](auto& p) {
          p.set_staging_budget(r.staging_budget);
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
    r.staging_ring = fast_plan.staging_ring;
    for (rank_t x = 0; x < n; ++x) {
      const bytes_t b = fast_plan.staging_bytes[static_cast<std::size_t>(x)];
      const bytes_t own = std::max<bytes_t>(t.row(x).sum(), t.col(x).sum());
      r.staging_max = std::max(r.staging_max, b);
      r.staging_sum += static_cast<long double>(b);
      r.buffer_max = std::max(r.buffer_max, own);
      if (b > 0) r.staging_over_own_max = std::max(r.staging_over_own_max, own == 0 ? INFINITY : static_cast<double>(b) / static_cast<double>(own));
    }
    const fa::lower_bounds lb = fa::lower_bound(topo, t);
    r.lower_bound_s = lb.overall_s();
    r.lower_bound_alpha_s = lb.staged_s(o.alpha_s);
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
      style.note = "Input: " + input_description(o) + strf("; alpha %g us per stage, ", o.alpha_s * 1e6) +
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

} // namespace

/// Eight GPUs per server is the common server: plan it with the compile-time-sized topology,
/// whose per-server loops unroll; any other size takes the runtime-sized one.
int plan_command(const options& o) {
  if (o.rank >= 0) {
    if (o.gpus == 8) return plan_rank_on(fa::fixed_topology<8>(o.servers, o.links), o);
    return plan_rank_on(fa::two_tier_topology(o.servers, o.gpus, o.links), o);
  }
  if (o.gpus == 8) return plan_on(fa::fixed_topology<8>(o.servers, o.links), o);
  return plan_on(fa::two_tier_topology(o.servers, o.gpus, o.links), o);
}

} // namespace cli
