// Fewer stages, in the alpha-beta MODEL: for each workload, cluster size and message size, the
// stages and predicted scale-out time of exact Birkhoff (the FAST paper), bottleneck and quantised
// decompositions, at alpha = 0, 5 and 20 us per stage. Times are model figures (NIC 50 GB/s),
// reported as ratios to LB_out (the scale-out lower bound), and the decomposition's wall time.
// Usage: bench_stages [max_servers] (default 512: up to 4096 GPUs; the largest take minutes)
//        bench_stages --lb-alpha [max_servers]   every decomposer against LB_alpha at alpha 10 us,
//                                64 MiB per GPU, 64 to 4096 GPUs, with the unsplit bound
//        bench_stages --per-rail [max_servers] [alpha_us]  an experiment: per-rail schedules (each
//                                rail its own stages) in the model, against LB_alpha and FAST's best
//                                (alpha 10 us unless given)
//        bench_stages --rails [max_servers] [decomposer]  the library's per-rail plans
//                                (plan_options::rails) on --lb-alpha's grid: planned by the decomposer
//                                (default best) as rank 0's part, their scale-out
//                                model over LB_alpha beside the shared plan's, the slowest rail's
//                                stages, a rank's synthesis time, and (up to 320 GPUs) whole plans
//                                verified, with their scale-up bytes per inter-server byte
//        bench_stages --counts   stage counts of the exact decomposers on the Megatron trace (4 x 8,
//                                unit 8192) and Zipf(1.0) 8 x 8 (64 MiB per GPU, seeds 1-32), beside
//                                the non-zeros k of M and the S^2 - 2S + 2 and k - 2S + 2 bounds
//        bench_stages --dump [servers]  the tiled Megatron cell of --lb-alpha (default 40 servers): its
//                                rail matrix M, then the factorized decomposer's stages, unsplit and
//                                split (a line each: weight, then the permutation), for
//                                tests/bench/split_mip.py
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "fasta2a/factorized.hpp"
#include "fasta2a/fewer_stages.hpp"
#include "fasta2a/cost_model.hpp"
#include "fasta2a/planner.hpp"
#include "fasta2a/registry.hpp"
#include "fasta2a/verify.hpp"

using namespace fasta2a;

namespace {

const std::string megatron = std::string(FASTA2A_WORKLOADS_DIR) + "/megatron-4n-32gpu.txt";

// Megatron trace tiled to S x 8 ranks (block (i, j) from a different iteration), scaled so each
// rank sends about bytes_per_rank: the trace's routing skew at any size.
traffic_matrix megatron_tiled(const std::vector<traffic_matrix>& trace, int servers, bytes_t bytes_per_rank) {
  const rank_t n = servers * 8;
  const int blocks = (n + 31) / 32;
  // Each trace rank sends 8192 tokens to 32 ranks; tiling spreads them over `blocks` tiles.
  const bytes_t unit = std::max<bytes_t>(1, bytes_per_rank / (8192 * static_cast<bytes_t>(blocks)));
  traffic_matrix t(n, n);
  for (int bi = 0; bi < blocks; ++bi)
    for (int bj = 0; bj < blocks; ++bj) {
      const auto& m = trace[(static_cast<std::size_t>(bi) * blocks + bj) % trace.size()];
      for (int i = 0; i < 32 && bi * 32 + i < n; ++i)
        for (int j = 0; j < 32 && bj * 32 + j < n; ++j) t(bi * 32 + i, bj * 32 + j) = m(i, j) * unit;
    }
  return t;
}

server_matrix rail_matrix(const traffic_matrix& t, int servers, bytes_t granule) {
  server_matrix m = server_matrix::Zero(servers, servers);
  for (int s = 0; s < servers; ++s)
    for (int d = 0; d < servers; ++d)
      if (s != d) m(s, d) = per_rail_bytes(t.block(s * 8, d * 8, 8, 8).sum(), 8, granule);
  return m;
}

struct outcome {
  std::size_t stages = 0;
  bytes_t weight = 0;
  double ms = 0;
};

template <class D>
outcome run(D dec, const server_matrix& m) {
  stage_list out;
  const auto t0 = std::chrono::steady_clock::now();
  dec.decompose(m, out);
  outcome o;
  o.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  o.stages = out.size();
  for (bytes_t w : out.weights) o.weight += w;
  return o;
}

struct summary {
  std::vector<std::size_t> v;
  void add(std::size_t x) { v.push_back(x); }
  std::string text() {
    std::sort(v.begin(), v.end());
    return std::to_string(v.front()) + " / " + std::to_string(v[v.size() / 2]) + " / " + std::to_string(v.back());
  }
};

// Stage counts (min / median / max) of the exact decomposers over a set of traffic matrices.
void counts_table(const char* label, const std::vector<traffic_matrix>& ts, int servers, bytes_t granule) {
  const auto topo = two_tier_topology(servers, 8);
  planner<two_tier_topology, birkhoff_decomposer> pk(topo, {.granule = granule});
  planner<two_tier_topology, bottleneck_decomposer> pb(topo, {.granule = granule});
  planner<two_tier_topology, slack_decomposer> ps(topo, {.granule = granule});
  summary k, bk, bn, sl, kb;
  plan p;
  for (const traffic_matrix& t : ts) {
    pk.make_into(t, p);
    bk.add(p.stages());
    std::size_t nz = 0;
    for (Eigen::Index i = 0; i < pk.rail_matrix().rows(); ++i)
      for (Eigen::Index j = 0; j < pk.rail_matrix().cols(); ++j) nz += pk.rail_matrix()(i, j) != 0;
    k.add(nz);
    kb.add(nz + 2 > 2 * static_cast<std::size_t>(servers) ? nz + 2 - 2 * static_cast<std::size_t>(servers) : 1);
    pb.make_into(t, p);
    bn.add(p.stages());
    ps.make_into(t, p);
    sl.add(p.stages());
  }
  std::printf("| %s | %zu | %s | %d | %s | %s | %s | %s |\n", label, ts.size(), k.text().c_str(),
              servers * servers - 2 * servers + 2, kb.text().c_str(), bk.text().c_str(), bn.text().c_str(),
              sl.text().c_str());
}

// The least modelled scale-out time of any schedule that serves each server pair in ONE stage (no
// pair split across stages): sort every line's (row's and column's) entries largest first; the
// stages holding a line's i largest entries are i distinct stages, each at least as heavy as its
// i-th largest entry, so the i-th heaviest stage weighs at least the largest i-th entry over all
// lines. Plus alpha per stage: at least the most non-zeros in one line. Where every pair carries
// traffic a schedule of S - 1 stages (the fewest) is of this kind, so a gap between this bound and
// LB_alpha is what splitting pairs must close.
double unsplit_bound(const server_matrix& m, const scaleout_model& net) {
  const Eigen::Index S = m.rows();
  std::vector<bytes_t> envelope(static_cast<std::size_t>(S), 0), line;
  std::size_t degree = 0;
  for (Eigen::Index i = 0; i < S; ++i)
    for (int col = 0; col < 2; ++col) {
      line.clear();
      for (Eigen::Index j = 0; j < S; ++j)
        if (const bytes_t v = col ? m(j, i) : m(i, j); v > 0) line.push_back(v);
      std::sort(line.begin(), line.end(), std::greater<>());
      degree = std::max(degree, line.size());
      for (std::size_t k = 0; k < line.size(); ++k) envelope[k] = std::max(envelope[k], line[k]);
    }
  bytes_t total = 0;
  for (bytes_t e : envelope) total += e;
  return net.phase_time(total, degree);
}

// A workload of issue 13's grid (64 MiB per GPU, granule 8192) on `servers` servers of 8 GPUs; empty
// for the tiled Megatron trace where it was not found.
traffic_matrix grid_traffic(const std::string& w, int servers, const std::vector<traffic_matrix>& trace) {
  const bytes_t per_gpu = bytes_t{64} << 20, granule = 8192;
  const rank_t n = servers * 8;
  if (w == "zipf(0.8)") return zipf_traffic(n, 0.8, per_gpu, 1, granule);
  if (w == "zipf(1.0)") return zipf_traffic(n, 1.0, per_gpu, 1, granule);
  if (w == "zipf(1.2)") return zipf_traffic(n, 1.2, per_gpu, 1, granule);
  if (w == "hotspot") return hotspot_traffic(n, std::max(1, n / 16), 0.5, per_gpu, 1, granule);
  if (!trace.empty()) return megatron_tiled(trace, servers, per_gpu);
  return {};
}

// The stage-aware bound's acceptance grid of issue 13 (alpha 10 us, 64 MiB per GPU): each
// decomposer's modelled scale-out time over LB_alpha = LB_out + (S - 1) alpha, the best of them,
// and the unsplit bound (above) over LB_alpha.
void lb_alpha_table(const std::vector<traffic_matrix>& trace, int max_servers) {
  const scaleout_model net{10e-6, scaleout_model{}.bandwidth};
  const bytes_t granule = 8192;
  std::printf("# scale-out phase in the alpha-beta MODEL (alpha 10 us, 50 GB/s), 64 MiB per GPU: modelled time / LB_alpha,\n"
              "# LB_alpha = LB_out + (S - 1) alpha; stages in brackets. unsplit: the least any schedule serving each\n"
              "# server pair in one stage can reach (a bound, not a decomposition), over LB_alpha. factorized split: in\n"
              "# split mode (pairs split into idle slots; the registry's best uses it). factorized ms, split ms: their\n"
              "# decompositions' wall time on this machine (median of 5 after a warm-up call).\n");
  std::printf("| workload | GPUs | Birkhoff | bottleneck | slack | quantised | spread-out | factorized | factorized split | best | unsplit bound | factorized ms | split ms |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (int servers : {8, 40, 128, 512}) {
    if (servers > max_servers) break;
    for (const char* workload : {"zipf(0.8)", "zipf(1.0)", "zipf(1.2)", "hotspot", "megatron (tiled)"}) {
      const rank_t n = servers * 8;
      const traffic_matrix t = grid_traffic(workload, servers, trace);
      if (t.size() == 0) continue;
      const server_matrix m = rail_matrix(t, servers, granule);
      const double lb_alpha = static_cast<double>(max_line_sum(m)) / net.bandwidth + (servers - 1) * net.alpha_s;
      std::string cells;
      double best = 0;
      const char* best_name = "";
      auto cell = [&](const char* name, auto dec) {
        stage_list out;
        out.max_bytes = std::size_t{1} << 31; // Birkhoff at 4096 GPUs: refused past 2 GiB of stages
        char buf[64];
        try {
          dec.decompose(m, out);
          const double r = net.stages_time(out.weights) / lb_alpha;
          if (best == 0 || r < best) best = r, best_name = name;
          std::snprintf(buf, sizeof buf, " %.3f (%zu) |", r, out.size());
        } catch (const plan_too_large&) {
          std::snprintf(buf, sizeof buf, " over 2 GiB |");
        }
        cells += buf;
      };
      cell("Birkhoff", birkhoff_decomposer{});
      cell("bottleneck", bottleneck_decomposer{});
      cell("slack", slack_decomposer{});
      cell("quantised", quantized_decomposer(net, quantum_rule::formula));
      cell("spread-out", spread_out_decomposer{});
      cell("factorized", factorized_decomposer(net));
      cell("factorized split", factorized_decomposer(net).split_pairs(true));
      // Per-call cost: the same decomposer object (its scratch reused), as a planner calls it.
      auto per_call_ms = [&](bool split) {
        factorized_decomposer fd(net);
        fd.split_pairs(split);
        stage_list scratch;
        fd.decompose(m, scratch);
        std::vector<double> ms;
        for (int rep = 0; rep < 5; ++rep) {
          const auto t0 = std::chrono::steady_clock::now();
          fd.decompose(m, scratch);
          ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
        }
        std::sort(ms.begin(), ms.end());
        return ms[2];
      };
      const double plain_ms = per_call_ms(false), split_ms = per_call_ms(true);
      std::printf("| %s | %d |%s **%.3f** %s | %.3f | %.2f | %.2f |\n", workload, n, cells.c_str(), best, best_name,
                  unsplit_bound(m, net) / lb_alpha, plain_ms, split_ms);
      std::fflush(stdout);
    }
  }
}

// The fastest of the decomposers that win on --lb-alpha's grid (slack, quantised, spread-out,
// factorized in split mode) on x, in model net: its modelled time and stages.
std::pair<double, std::size_t> best_decomposition(const server_matrix& x, const scaleout_model& net) {
  double best = 0;
  std::size_t stages = 0;
  auto one = [&](auto dec) {
    stage_list out;
    dec.decompose(x, out);
    const double time = net.stages_time(out.weights);
    if (best == 0 || time < best) best = time, stages = out.size();
  };
  one(slack_decomposer{});
  one(quantized_decomposer(net, quantum_rule::formula));
  one(spread_out_decomposer{});
  one(factorized_decomposer(net).split_pairs(true));
  return {best, stages};
}

// A per-rail schedule of t (below): the slowest rail's modelled time and stages, the fewest and
// most stages of a rail, and the bytes its phase 1 moves over scale-up links.
struct per_rail_outcome {
  double time = 0;
  std::size_t stages = 0, min_stages = 0, max_stages = 0;
  long double scaleup = 0;
  long double busiest_gpu = 0; // the most scale-up bytes one GPU sends or receives (its port)
};

// Intra-server messages' bytes on each GPU's scale-up port, out and in (both kinds of schedule
// move them alike).
void add_intra(const traffic_matrix& t, int G, std::vector<long double>& tx, std::vector<long double>& rx) {
  for (rank_t i = 0; i < t.rows(); ++i)
    for (rank_t j = 0; j < t.cols(); ++j)
      if (i != j && i / G == j / G) tx[i] += static_cast<long double>(t(i, j)), rx[j] += static_cast<long double>(t(i, j));
}

long double busiest(const std::vector<long double>& tx, const std::vector<long double>& rx) {
  long double most = 0;
  for (std::size_t r = 0; r < tx.size(); ++r) most = std::max({most, tx[r], rx[r]});
  return most;
}

// Each server pair's bytes cut into `chunks` equal chunks (chunks = G: an eighth on every rail, as
// in FAST), chunks largest first, each on the rail where the larger of its two servers' loads on
// that rail grows least; among rails where it grows as little, the one whose GPU sends or receives
// most of the pair (fewest scale-up hops: a byte from GPU u to GPU v riding rail r takes (u != r) +
// (v != r) of them). Rail r's matrix is then decomposed on its own (best_decomposition).
per_rail_outcome per_rail_schedule(const traffic_matrix& t, int servers, int chunks, bytes_t granule,
                                   const scaleout_model& net) {
  const int G = 8;
  struct chunk {
    bytes_t bytes;
    int s, d;
  };
  std::vector<chunk> todo;
  std::vector<long double> sum(static_cast<std::size_t>(servers) * servers, 0);
  // Per pair and GPU: the bytes that GPU sends to the pair's destination server, and receives.
  std::vector<long double> row(sum.size() * G, 0), col(sum.size() * G, 0);
  // Bytes of pair pr that skip a hop on rail r: from GPU r, to GPU r.
  auto own = [&](std::size_t pr, int r) { return row[pr * G + r] + col[pr * G + r]; };
  for (int s = 0; s < servers; ++s)
    for (int d = 0; d < servers; ++d) {
      if (s == d) continue;
      const auto blk = t.block(s * G, d * G, G, G);
      const bytes_t b = blk.sum();
      if (b == 0) continue;
      const std::size_t pr = static_cast<std::size_t>(s) * servers + d;
      sum[pr] = static_cast<long double>(b);
      for (int r = 0; r < G; ++r) {
        row[pr * G + r] = static_cast<long double>(blk.row(r).sum());
        col[pr * G + r] = static_cast<long double>(blk.col(r).sum());
      }
      const bytes_t piece = (b / chunks + granule - 1) / granule * granule;
      bytes_t left = (b + granule - 1) / granule * granule;
      for (int c = 0; c < chunks && left > 0; ++c) {
        const bytes_t x = c + 1 == chunks ? left : std::min(left, piece);
        todo.push_back({x, s, d});
        left -= x;
      }
    }
  std::stable_sort(todo.begin(), todo.end(), [](const chunk& a, const chunk& b) { return a.bytes > b.bytes; });
  std::vector<server_matrix> rail(G, server_matrix::Zero(servers, servers));
  std::vector<bytes_t> out_load(static_cast<std::size_t>(G) * servers, 0), in_load(out_load);
  per_rail_outcome o;
  const rank_t n = servers * G;
  std::vector<long double> tx(static_cast<std::size_t>(n), 0), rx(tx);
  add_intra(t, G, tx, rx);
  for (const chunk& c : todo) {
    const std::size_t pr = static_cast<std::size_t>(c.s) * servers + c.d;
    bytes_t top[8], least = ~bytes_t{0};
    for (int r = 0; r < G; ++r) {
      top[r] = std::max(out_load[r * servers + c.s], in_load[r * servers + c.d]) + c.bytes;
      least = std::min(least, top[r]);
    }
    int best = -1;
    for (int r = 0; r < G; ++r)
      if (top[r] == least && (best < 0 || own(pr, r) > own(pr, best))) best = r;
    rail[best](c.s, c.d) += c.bytes;
    out_load[best * servers + c.s] += c.bytes;
    in_load[best * servers + c.d] += c.bytes;
    // Every byte takes two hops but those from or to GPU best (in this chunk's share of the pair).
    const long double f = static_cast<long double>(c.bytes) / sum[pr];
    o.scaleup += (2 * sum[pr] - own(pr, best)) * f;
    // Gathered onto GPU best of s, spread from GPU best of d.
    for (int u = 0; u < G; ++u) {
      if (u == best) continue;
      tx[c.s * G + u] += f * row[pr * G + u];
      rx[c.s * G + best] += f * row[pr * G + u];
      tx[c.d * G + best] += f * col[pr * G + u];
      rx[c.d * G + u] += f * col[pr * G + u];
    }
  }
  o.busiest_gpu = busiest(tx, rx);
  o.min_stages = ~std::size_t{0};
  for (int r = 0; r < G; ++r) {
    const auto [time, stages] = best_decomposition(rail[r], net);
    if (time > o.time) o.time = time, o.stages = stages;
    o.min_stages = std::min(o.min_stages, stages);
    o.max_stages = std::max(o.max_stages, stages);
  }
  return o;
}

// The library's per-rail plans (plan_options::rails) on issue 13's grid, as a runtime makes them:
// rank 0's part, planned by `best` on an H200 cluster (alpha 10 us, 50 GB/s): the scale-out
// model (scaleout_time: the slowest rail's stages) over LB_alpha, for shared and per-rail
// schedules, the slowest rail's stages, and a rank's synthesis time (median of 3 after a warm-up).
// Up to 40 servers the whole per-rail plan is also made and verified, and its scale-up bytes per
// inter-server byte reported.
void planned_rails_table(const std::vector<traffic_matrix>& trace, int max_servers, const std::string& decomposer) {
  const bytes_t granule = 8192;
  std::printf("# the library's plans (plan_options::rails), scale-out phase in the alpha-beta MODEL (alpha 10 us, 50 GB/s),\n"
              "# 64 MiB per GPU: scaleout_time / LB_alpha (LB_alpha = LB_out + (S - 1) alpha); stages: shared plan's, and the\n"
              "# slowest rail's of the per-rail plan; rank ms: planning rank 0's part (median of 3); verified: the whole\n"
              "# per-rail plan (up to 320 GPUs); up/out: its scale-up bytes per inter-server byte (shared plan's in brackets);\n"
              "# with ends: rails_choice_time / LB_alpha, the scale-out phase plus the first balance and last redistribution\n"
              "# no stage hides (estimated), what rail_schedule::automatic compares; whole plan's total: predict's\n"
              "# step-synchronous total (scale-up and scale-out) over LB_alpha, up to 320 GPUs\n"
              "# decomposer: %s\n", decomposer.c_str());
  std::printf("| workload | GPUs | shared (stages) | per-rail (slowest rail's stages) | with ends: shared / per-rail | auto picks | rank ms shared / per-rail / auto | verified | up/out | whole plan's total: shared / per-rail |\n"
              "|---|---|---|---|---|---|---|---|---|---|\n");
  for (int servers : {8, 40, 128, 512}) {
    if (servers > max_servers) break;
    for (const char* workload : {"zipf(0.8)", "zipf(1.0)", "zipf(1.2)", "hotspot", "megatron (tiled)"}) {
      const traffic_matrix t = grid_traffic(workload, servers, trace);
      if (t.size() == 0) continue;
      const auto topo = h200_cluster(servers);
      const scaleout_model net = scaleout_of(topo);
      const server_matrix m = rail_matrix(t, servers, granule);
      const double lb_alpha = static_cast<double>(max_line_sum(m)) / net.bandwidth + (servers - 1) * net.alpha_s;
      struct outcome {
        double ratio = 0, ends = 0, rank_ms = 0;
        std::size_t stages = 0;
        bool per_rail = false;
        plan whole;
      };
      auto run = [&](rail_schedule rails, bool whole) {
        return with_decomposer(decomposer, {.scaleout = net}, [&](auto dec) {
          planner<fixed_topology<8>, decltype(dec)> pl(topo, {.granule = granule, .rails = rails}, std::move(dec));
          outcome o;
          plan view;
          pl.make_rank_into(t, 0, view);
          std::vector<double> ms;
          for (int rep = 0; rep < 3; ++rep) {
            const auto t0 = std::chrono::steady_clock::now();
            pl.make_rank_into(t, 0, view);
            ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
          }
          std::sort(ms.begin(), ms.end());
          o.rank_ms = ms[1];
          o.ratio = scaleout_time(view, net) / lb_alpha;
          o.ends = rails_choice_time(topo, view, net) / lb_alpha;
          o.per_rail = view.per_rail();
          for (int k = 0; k < 8; ++k) {
            std::size_t n = 0;
            for (std::size_t st = 0; st < view.stages(); ++st) n += view.weight(st, k) > 0;
            o.stages = std::max(o.stages, n);
          }
          if (whole) o.whole = pl.make(t);
          return o;
        });
      };
      const bool whole = servers <= 40;
      const outcome shared = run(rail_schedule::shared, whole), rails = run(rail_schedule::per_rail, whole),
                    chosen = run(rail_schedule::automatic, false);
      std::string verified = "-", up = "-", total = "-";
      if (whole) {
        char tb[64]; // the whole plans' step-synchronous totals (scale-up and scale-out, predict) over LB_alpha
        std::snprintf(tb, sizeof tb, "%.3f / %.3f", predict(topo, shared.whole).total_s / lb_alpha,
                      predict(topo, rails.whole).total_s / lb_alpha);
        total = tb;
        const verify_result v = verify(rails.whole, t);
        verified = v.ok ? "yes" : "NO: " + v.error;
        bytes_t inter = 0;
        for (rank_t i = 0; i < t.rows(); ++i)
          for (rank_t j = 0; j < t.cols(); ++j)
            if (i / 8 != j / 8) inter += t(i, j);
        char b[64];
        std::snprintf(b, sizeof b, "%.2f (%.2f)", static_cast<double>(rails.whole.scaleup_bytes) / static_cast<double>(inter),
                      static_cast<double>(shared.whole.scaleup_bytes) / static_cast<double>(inter));
        up = b;
      }
      std::printf("| %s | %d | %.3f (%zu) | %s%.3f%s (%zu) | %.3f / %.3f | %s | %.2f / %.2f / %.2f | %s | %s | %s |\n", workload,
                  servers * 8, shared.ratio, shared.stages, rails.ratio < shared.ratio ? "**" : "", rails.ratio,
                  rails.ratio < shared.ratio ? "**" : "", rails.stages, shared.ends, rails.ends,
                  chosen.per_rail ? "per-rail" : "shared",
                  shared.rank_ms, rails.rank_ms, chosen.rank_ms, verified.c_str(), up.c_str(), total.c_str());
      std::fflush(stdout);
    }
  }
}

// An experiment the library's plans cannot express (their stages are server-level permutations,
// every rail of a server in step): per-rail schedules. Rail r's NICs follow their own stages (each
// NIC sends to one NIC of its rail and receives from one per stage, so no incast), and the call
// takes as long as the slowest rail (per_rail_schedule). Model times over LB_alpha (which assumes
// all rails in step) for whole pairs on one rail and for the best of 1, 2, 4 and 8 chunks per pair
// (8: FAST's split), the scale-up bytes such a phase 1 moves over FAST's (the planner's whole
// plan, up to 320 GPUs), per byte of traffic between servers, and how long the busiest GPU's
// scale-up port is busy beside the scale-out phase (if that stays well below 1, pipelining can
// hide the scale-up hops under the stages).
void per_rail_table(const std::vector<traffic_matrix>& trace, int max_servers, double alpha_us) {
  const scaleout_model net{alpha_us * 1e-6, scaleout_model{}.bandwidth};
  const bytes_t granule = 8192;
  const int G = 8;
  std::printf("# per-rail schedules in the alpha-beta MODEL (alpha %g us, 50 GB/s), 64 MiB per GPU: the slowest rail's\n"
              "# modelled time / LB_alpha [its stages, the rails' stages min-max]; FAST best: the best server-level\n"
              "# decomposition (--lb-alpha's best); whole: each pair on one rail; best chunks: the fastest of 1, 2, 4, 8\n"
              "# chunks per pair (8: FAST's eighths); scale-up: bytes over scale-up links per byte between servers;\n"
              "# port: the busiest GPU's scale-up port time (450 GB/s each way) over the scale-out time.\n",
              alpha_us);
  std::printf("| workload | GPUs | FAST best | per-rail, whole pairs | per-rail, best chunks | scale-up FAST | scale-up whole pairs | port FAST | port whole pairs |\n"
              "|---|---|---|---|---|---|---|---|---|\n");
  for (int servers : {8, 40, 128, 512}) {
    if (servers > max_servers) break;
    for (const char* workload : {"zipf(0.8)", "zipf(1.0)", "zipf(1.2)", "hotspot", "megatron (tiled)"}) {
      const rank_t n = servers * G;
      const traffic_matrix t = grid_traffic(workload, servers, trace);
      if (t.size() == 0) continue;
      const server_matrix m = rail_matrix(t, servers, granule);
      const double lb_alpha = static_cast<double>(max_line_sum(m)) / net.bandwidth + (servers - 1) * net.alpha_s;
      const double fast = best_decomposition(m, net).first;
      long double between = 0, intra = 0;
      for (rank_t i = 0; i < n; ++i)
        for (rank_t j = 0; j < n; ++j) (i / G != j / G ? between : intra) += static_cast<long double>(i != j ? t(i, j) : 0);
      const per_rail_outcome whole = per_rail_schedule(t, servers, 1, granule, net);
      per_rail_outcome best = whole;
      int best_chunks = 1;
      for (int chunks : {2, 4, 8})
        if (const per_rail_outcome o = per_rail_schedule(t, servers, chunks, granule, net); o.time < best.time)
          best = o, best_chunks = chunks;
      char fast_up[32] = "-", fast_port[32] = "-";
      const double up_bw = h200_links.scaleup_bandwidth;
      if (servers <= 40) {
        const fixed_topology<8> topo = h200_cluster(servers);
        planner<fixed_topology<8>, factorized_decomposer> pl(topo, {.granule = granule},
                                                            factorized_decomposer(net).split_pairs(true));
        const plan p = pl.make(t); // its scale-up bytes count the intra-server messages too
        std::snprintf(fast_up, sizeof fast_up, "%.3f", static_cast<double>((p.scaleup_bytes - intra) / between));
        std::vector<long double> tx(static_cast<std::size_t>(n), 0), rx(tx);
        for (const piece& pc : p.pieces)
          for (const hop& h : p.route_of(pc))
            if (h.kind == hop_kind::intra || h.kind == hop_kind::balance || h.kind == hop_kind::redistribute)
              tx[h.from] += static_cast<long double>(pc.bytes), rx[h.to] += static_cast<long double>(pc.bytes);
        // Over this plan's own scale-out time (factorized split: FAST best on the Megatron cells).
        std::snprintf(fast_port, sizeof fast_port, "%.3f",
                      static_cast<double>(busiest(tx, rx) / up_bw / net.stages_time(p.stage_weight)));
      }
      std::printf("| %s | %d | %.3f | **%.3f** [%zu, %zu-%zu] | %.3f (%d) [%zu, %zu-%zu] | %s | %.3f | %s | %.3f |\n",
                  workload, n, fast / lb_alpha, whole.time / lb_alpha, whole.stages, whole.min_stages,
                  whole.max_stages, best.time / lb_alpha, best_chunks, best.stages, best.min_stages,
                  best.max_stages, fast_up, static_cast<double>(whole.scaleup / between), fast_port,
                  static_cast<double>(whole.busiest_gpu / up_bw / whole.time));
      std::fflush(stdout);
    }
  }
}

std::string size_name(bytes_t b) {
  return b >= (bytes_t{1} << 20) ? std::to_string(b >> 20) + " MiB" : std::to_string(b >> 10) + " KiB";
}

} // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "--counts") {
    std::printf("# stages of the exact decomposers, min / median / max; k = non-zeros of the server matrix M;\n"
                "# the Birkhoff bounds S^2 - 2S + 2 and k - 2S + 2 count permutations of a padded matrix (slack pads\n"
                "# stage by stage, so they do not bound it). The FAST authors' scheduler: Megatron 6 / 8 / 9, Zipf 43 / 46 / 48.\n");
    std::printf("| workload | matrices | k | S^2-2S+2 | k-2S+2 | Birkhoff | bottleneck | slack |\n|---|---|---|---|---|---|---|---|\n");
    if (std::filesystem::exists(megatron)) counts_table("Megatron 4 x 8 (unit 8192)", read_trace(megatron, 32, 8192), 4, 1);
    else std::printf("| Megatron: %s not found | | | | | | | |\n", megatron.c_str());
    std::vector<traffic_matrix> z;
    for (std::uint64_t seed = 1; seed <= 32; ++seed) z.push_back(zipf_traffic(64, 1.0, bytes_t{64} << 20, seed));
    counts_table("Zipf(1.0) 8 x 8, 64 MiB/GPU, seeds 1-32", z, 8, 1);
    return 0;
  }
  if (argc > 1 && std::string(argv[1]) == "--dump") {
    const int servers = argc > 2 ? std::atoi(argv[2]) : 40;
    if (servers < 2 || !std::filesystem::exists(megatron)) {
      std::fprintf(stderr, "bench_stages --dump: needs at least 2 servers and %s\n", megatron.c_str());
      return 2;
    }
    const server_matrix m = rail_matrix(megatron_tiled(read_trace(megatron, 32, 1), servers, bytes_t{64} << 20), servers, 8192);
    const scaleout_model net{10e-6, scaleout_model{}.bandwidth};
    std::printf("# rail matrix, %d x %d, per-rail bytes\n", servers, servers);
    for (int i = 0; i < servers; ++i)
      for (int j = 0; j < servers; ++j) std::printf("%llu%c", static_cast<unsigned long long>(m(i, j)), j + 1 < servers ? ' ' : '\n');
    for (bool split : {false, true}) {
      stage_list out;
      factorized_decomposer(net).split_pairs(split).decompose(m, out);
      std::printf("# factorized%s: %zu stages, weight then permutation (i -> perm[i]; -1 or i: idle)\n",
                  split ? " split" : "", out.size());
      for (std::size_t k = 0; k < out.size(); ++k) {
        std::printf("%llu", static_cast<unsigned long long>(out.weights[k]));
        for (int i = 0; i < servers; ++i) std::printf(" %d", out.perm(k)[i]);
        std::printf("\n");
      }
    }
    return 0;
  }
  const bool lb_alpha = argc > 1 && std::string(argv[1]) == "--lb-alpha";
  const bool per_rail = argc > 1 && std::string(argv[1]) == "--per-rail";
  const bool rails = argc > 1 && std::string(argv[1]) == "--rails";
  const int flag = lb_alpha || per_rail || rails; // the arguments after the mode's flag
  const int max_servers = argc > 1 + flag ? std::atoi(argv[1 + flag]) : 512;
  const double bout = scaleout_model{}.bandwidth; // one 400 Gb/s NIC, the default
  std::vector<traffic_matrix> trace;
  if (std::filesystem::exists(megatron)) trace = read_trace(megatron, 32, 1);
  if (lb_alpha) {
    lb_alpha_table(trace, max_servers);
    return 0;
  }
  if (rails) {
    planned_rails_table(trace, max_servers, argc > 3 ? argv[3] : "best");
    return 0;
  }
  if (per_rail) {
    per_rail_table(trace, max_servers, argc > 3 ? std::atof(argv[3]) : 10.0);
    return 0;
  }
  std::printf("# scale-out phase, alpha-beta MODEL: sum over stages of (alpha + weight / 50 GB/s), as a ratio to LB_out;\n"
              "# stages; and decomposition wall time on this machine. q = the quantised decomposer's quantum (closed form).\n");
  std::printf("| workload | GPUs | bytes/GPU | alpha | stages: Birkhoff / bottleneck / slack / quantised (q) | model / LB_out: Birkhoff | bottleneck | slack | quantised | direct | best | slack / LB_alpha | decompose ms: B / b / s / q |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (int servers : {8, 40, 128, 512}) {
    if (servers > max_servers) break;
    for (const char* workload : {"zipf(0.8)", "zipf(1.2)", "hotspot", "megatron"}) {
      for (bytes_t per_gpu : {bytes_t{64} << 10, bytes_t{4} << 20, bytes_t{256} << 20}) {
        const rank_t n = servers * 8;
        const bytes_t granule = std::min<bytes_t>(8192, per_gpu / 64);
        traffic_matrix t;
        const std::string w = workload;
        if (w == "zipf(0.8)") t = zipf_traffic(n, 0.8, per_gpu, 1, granule);
        else if (w == "zipf(1.2)") t = zipf_traffic(n, 1.2, per_gpu, 1, granule);
        else if (w == "hotspot") t = hotspot_traffic(n, std::max(1, n / 16), 0.5, per_gpu, 1, granule);
        else if (!trace.empty()) t = megatron_tiled(trace, servers, per_gpu);
        else continue;
        const server_matrix m = rail_matrix(t, servers, granule);
        const double lb = static_cast<double>(max_line_sum(m)) / bout;
        // Direct sending, fluid model: the busiest NIC's own inter-server bytes, out or in.
        std::vector<bytes_t> nic(2 * static_cast<std::size_t>(n), 0);
        for (rank_t i = 0; i < n; ++i)
          for (rank_t j = 0; j < n; ++j)
            if (i / 8 != j / 8) {
              nic[i] += t(i, j);
              nic[n + j] += t(i, j);
            }
        const bytes_t busiest_nic = *std::max_element(nic.begin(), nic.end());
        const outcome b = run(birkhoff_decomposer{}, m);
        const outcome bn = run(bottleneck_decomposer{}, m);
        const outcome sl = run(slack_decomposer{}, m);
        for (double alpha : {0.0, 5e-6, 20e-6}) {
          const scaleout_model net{alpha, bout};
          const outcome q = run(quantized_decomposer(net, quantum_rule::formula), m);
          const bytes_t quantum = quantized_decomposer::formula_quantum(m, net);
          auto ratio = [&](const outcome& o) { return lb > 0 ? net.phase_time(o.weight, o.stages) / lb : 0.0; };
          const double direct = lb > 0 ? net.stage_time(busiest_nic) / lb : 0.0;
          const double all[] = {ratio(b), ratio(bn), ratio(sl), ratio(q), direct};
          const char* names[] = {"Birkhoff", "bottleneck", "slack", "quantised", "direct"};
          const int best = static_cast<int>(std::min_element(all, all + 5) - all);
          // The stage-aware bound: LB_out plus S - 1 stages' alpha (no one-to-one schedule of a
          // matrix whose server pairs all carry traffic has fewer stages).
          const double lb_alpha = lb + (servers - 1) * alpha;
          const double slack_alpha = lb_alpha > 0 ? net.phase_time(sl.weight, sl.stages) / lb_alpha : 0.0;
          std::printf("| %s | %d | %s | %g us | %zu / %zu / %zu / %zu (%s) | %.3f | %.3f | %.3f | %.3f | %.3f | %s | %.3f | %.1f / %.1f / %.1f / %.1f |\n",
                      workload, n, size_name(per_gpu).c_str(), alpha * 1e6, b.stages, bn.stages, sl.stages, q.stages,
                      quantum >= 1024 ? size_name(quantum).c_str() : (std::to_string(quantum) + " B").c_str(),
                      all[0], all[1], all[2], all[3], all[4], names[best], slack_alpha, b.ms, bn.ms, sl.ms, q.ms);
          std::fflush(stdout);
        }
      }
    }
  }
}
