// fasta2a: what the emulated cluster's benchmark runs, shared by cluster_bench (which measures it)
// and cluster_model (which predicts it): the workloads' traffic matrices and the engine methods
// the --methods names stand for. No MPI here.
#pragma once

#include <fasta2a/common.hpp>
#include <fasta2a/registry.hpp>
#include <fasta2a/traffic.hpp>

#include <charconv>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace fasta2a::cluster {

/// A workload of the benchmark and the engine's granule (cluster_bench's options of the same names).
struct workload_spec {
  std::string workload = "zipf";
  bytes_t bytes_per_rank = bytes_t{16} << 20;
  double zipf = 1.0;
  int hot = 1;
  double share = 0.5;
  std::string matrix;
  std::size_t index = 0;
  bytes_t unit = 4096;
  std::uint64_t seed = 1;
  bytes_t granule = 4096;
};

/// The workload's n x n matrix; every rank computes the same one.
inline traffic_matrix make_traffic(const workload_spec& o, rank_t n) {
  if (o.workload == "uniform") return uniform_traffic(n, o.bytes_per_rank, o.seed, o.granule);
  if (o.workload == "zipf") return zipf_traffic(n, o.zipf, o.bytes_per_rank, o.seed, o.granule);
  if (o.workload == "hotspot") return hotspot_traffic(n, o.hot, o.share, o.bytes_per_rank, o.seed, o.granule);
  if (o.workload != "megatron") throw error("--workload: unknown workload '" + o.workload + "'");
  // The trace has 32 ranks, server-major (rank = server * 8 + GPU): summing f x f blocks keeps
  // ranks of one server together whenever n's servers are unions of the trace's.
  constexpr rank_t trace_ranks = 32;
  if (trace_ranks % n != 0)
    throw error("megatron: " + std::to_string(n) + " ranks do not divide the trace's 32");
  const traffic_matrix full = read_matrix(o.matrix, trace_ranks, o.index, o.unit);
  const rank_t f = trace_ranks / n;
  traffic_matrix t = traffic_matrix::Zero(n, n);
  for (rank_t i = 0; i < trace_ranks; ++i)
    for (rank_t j = 0; j < trace_ranks; ++j) t(i / f, j / f) += full(i, j);
  return t;
}

/// What an engine method runs: a decomposer of the library's registry, and whether the engine may
/// send directly where its model predicts that faster (plan_options::direct_if_faster_alpha).
struct engine_method {
  std::string decomposer;
  bool adaptive = false;
  bool fi = false;  ///< scale-out over the libfabric transport (scale-up over MPI)
  bool wfc = false; ///< with fi: signal ordering wait_for_completion, whatever the provider offers
  bool cut = false; ///< the MPI transport cuts messages below Open MPI's TCP put pipeline (avoid_tcp_put_pipeline)
  /// -stagingP: engine_options::staging_fraction P / 100 (P = 0: none, staging unlimited as before
  /// issue 13); without the suffix the engine's default (0.25).
  std::optional<double> staging_fraction{};
  bool staging_given = false;
  std::uint32_t staging_slots = 0; ///< -slotsK: plan_options::staging_slots (0: the default)
};

/// The engine method a --methods entry names, or nothing if it names none (mpi, isend and
/// isend-rotated are not the engine's). The entry is a decomposer's name, or "fast-" and a name;
/// "fast" is birkhoff (the paper's FAST) and "fast-adaptive" birkhoff with direct sending where
/// faster. The "fast" forms are the method names of the recorded results and scripts.
inline std::optional<engine_method> engine_method_of(std::string_view m) {
  bool fi = false, wfc = false, cut = false, staging_given = false;
  std::optional<double> staging;
  std::uint32_t slots = 0;
  if (const auto at = m.rfind("-slots"); at != std::string_view::npos) {
    const std::string_view k = m.substr(at + 6);
    const auto [end, ec] = std::from_chars(k.data(), k.data() + k.size(), slots);
    if (ec != std::errc() || end != k.data() + k.size() || k.empty() || slots == 0) return std::nullopt;
    m = m.substr(0, at);
  }
  if (const auto at = m.rfind("-staging"); at != std::string_view::npos) {
    const std::string_view pct = m.substr(at + 8);
    unsigned p = 0;
    const auto [end, ec] = std::from_chars(pct.data(), pct.data() + pct.size(), p);
    if (ec != std::errc() || end != pct.data() + pct.size() || pct.empty()) return std::nullopt;
    staging_given = true;
    if (p > 0) staging = p / 100.0;
    m = m.substr(0, at);
  }
  if (m.ends_with("-cut")) {
    cut = true;
    m.remove_suffix(4);
  }
  if (m.ends_with("-fi-wfc")) {
    fi = wfc = true;
    m.remove_suffix(7);
  } else if (m.ends_with("-fi")) {
    fi = true;
    m.remove_suffix(3);
  }
  std::optional<engine_method> e;
  if (m == "fast") e = engine_method{"birkhoff"};
  else if (m == "fast-adaptive") e = engine_method{"birkhoff", true};
  else {
    if (m.starts_with("fast-")) m.remove_prefix(5);
    if (is_decomposer_name(m)) e = engine_method{std::string(m)};
  }
  if (e) {
    e->fi = fi;
    e->wfc = wfc;
    e->cut = cut;
    e->staging_fraction = staging;
    e->staging_given = staging_given;
    e->staging_slots = slots;
  }
  return e;
}

} // namespace fasta2a::cluster
