// fasta2a CLI: what `fasta2a run` does alike on every transport: the engine's options, checking
// received bytes, and the fields every report line starts with.
#pragma once

#include "commands.hpp"
#include "options.hpp"
#include "report.hpp"
#include "workload.hpp"

#include <fasta2a/engine.hpp>
#include <fasta2a/json_writer.hpp>
#include <fasta2a/pattern.hpp>
#include <fasta2a/planner.hpp>

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>

namespace cli {

/// The engine's options from the command line: planning as `fasta2a plan` plans, and --rail-window.
inline fa::engine_options engine_options_of(const options& o) {
  fa::engine_options e;
  e.planning = planning_options(o);
  e.rail_window = o.rail_window;
  e.timeout = o.timeout;
  // The timed calls repeat one matrix, which the engine would plan once and then reuse: each call
  // plans, as where a runtime's matrix is new every call (engine_options::reuse_plans).
  e.reuse_plans = false;
  if (o.staging_fraction == 0) e.staging_fraction.reset();
  else if (o.staging_fraction > 0) e.staging_fraction = o.staging_fraction;
  e.staging_floor = o.staging_floor;
  return e;
}

/// What one rank's engine keeps between calls at n ranks of S servers x G GPUs, besides the
/// gathered counts (engine_counts_bytes): prefix sums of its server's messages (32 G n bytes),
/// signal counts and what it knows of each peer (about 500 n bytes), its plan and program, and the
/// allocator's and its thread's overhead: 2048 n bytes in all besides the prefix sums, calibrated
/// on the peak resident memory of `fasta2a run` at 16, 32 and 48 x 8 with 1 KiB per rank (39, 130
/// and 381 MB measured; 41, 170 and 393 MB estimated with the buffers); plus its planner's scratch
/// for a rank view (planner_scratch_bytes: S^2 server-pair work, O(S G) besides). An estimate for
/// refusing runs that cannot fit, stated here so that the check changes with the engine
/// (engine.hpp, "Memory"; issue 12, defect 7). Plans with far more stages than these (skewed
/// matrices, many servers) have larger programs.
template <class D> long double engine_bytes_per_rank(int servers, int gpus) {
  const long double n = static_cast<long double>(servers) * gpus;
  return (32.0L * gpus + 2048.0L) * n + fa::planner_scratch_bytes<D>(servers, gpus, false);
}

/// The engine's gathered counts at n ranks: n (n + 10) words, the traffic matrix and a header per
/// rank. Once per process: the host transport's thread-ranks share one copy, and an MPI process
/// holds one rank.
inline long double engine_counts_bytes(rank_t n) {
  const long double ranks = n;
  return 8.0L * ranks * (ranks + 10.0L);
}

/// Refuses, before anything is allocated, a run whose buffers or engine state cannot fit: a rank
/// whose send or receive bytes pass what a process can address or hold (naming the rank and its
/// largest message), or `ranks_here` ranks (all of them for the host transport, 1 under MPI) whose
/// buffers, staging (at most their send bytes again) and engine state (engine_per_rank each, and
/// the gathered counts once) pass memory_limit_bytes().
/// `engine_per_rank` is engine_bytes_per_rank of the decomposer used.
/// Returns the bytes the check counted (buffers, staging, engine state, gathered counts).
/// `sharing`: the job's processes on this machine (memory_limit_bytes).
inline long double check_run_memory(const fa::traffic_matrix& t, rank_t first, rank_t ranks_here,
                                    long double engine_per_rank, const char* where, int sharing = 1) {
  const long double limit = memory_limit_bytes(sharing);
  const rank_t n = static_cast<rank_t>(t.rows());
  const long double counts = engine_counts_bytes(n);
  long double all = counts;
  for (rank_t r = first; r < first + ranks_here; ++r) {
    long double send = 0, recv = 0;
    rank_t big_to = 0, big_from = 0;
    for (rank_t j = 0; j < n; ++j) {
      send += static_cast<long double>(t(r, j));
      recv += static_cast<long double>(t(j, r));
      if (t(r, j) > t(r, big_to)) big_to = j;
      if (t(j, r) > t(big_from, r)) big_from = j;
    }
    const long double need = 2 * send + recv; // send buffer, staging (at most the sends), receive buffer
    if (need > limit) {
      const bool sends = send >= recv;
      throw fa::error(strf("rank %d would %s %.0Lf bytes (its largest message: %llu bytes %s rank %d), and with its "
                           "%s and staging buffers needs %.0Lf bytes, more than %s can hold (%.0Lf bytes): give "
                           "smaller messages (--bytes-per-rank, --unit)",
                           r, sends ? "send" : "receive", sends ? send : recv,
                           static_cast<unsigned long long>(sends ? t(r, big_to) : t(big_from, r)),
                           sends ? "to" : "from", sends ? big_to : big_from, sends ? "receive" : "send", need, where,
                           limit));
    }
    all += need + engine_per_rank;
  }
  if (all > limit)
    throw fa::error(strf("%d ranks need about %.0Lf bytes here (buffers and staging, each rank's engine state of "
                         "about %.0Lf bytes, and %.0Lf bytes of gathered counts, which grows as ranks^2), more than "
                         "%s can hold (%.0Lf bytes): run fewer ranks or smaller messages",
                         ranks_here, all, engine_per_rank, counts, where, limit));
  return all;
}

/// What a rank's engine holds per byte of its plan (plan::memory_bytes, what the planner's limit
/// counts): the plan, its rank program and the planner's own copies. Calibrated on `fasta2a run
/// --servers 2 --gpus 2 --uniform --bytes-per-rank 4M --staging-floor 0` with --staging-budget
/// 4096, 1024 and 256: peak resident memory grew 21 times the busiest part's memory_bytes() over
/// the 4 thread ranks, about 5 per rank.
inline constexpr long double engine_bytes_per_plan_byte = 6;

/// The plan size limit of each of `ranks_here` ranks that plan and hold their own parts of a call
/// in one process (the host transport's thread ranks): --max-plan-bytes, or an equal share of the
/// memory left after their buffers and engine state (`others` bytes), over what an engine holds
/// per plan byte, where that is less.
inline std::size_t plan_limit_per_rank(const options& o, rank_t ranks_here, long double others, int sharing = 1) {
  const long double left = std::max(0.0L, memory_limit_bytes(sharing) - others) / std::max<rank_t>(ranks_here, 1);
  return static_cast<std::size_t>(std::min(static_cast<long double>(o.max_plan_bytes), left / engine_bytes_per_plan_byte));
}

/// Refuses, before any rank starts, a run whose ranks' plans cannot fit: plans the part of the
/// rank with the most traffic, with the engine's staging budget for `t`, within `limit` (the
/// planner refuses a staging budget whose pieces pass it before cutting a stage), and names the
/// budget and the ranks that share the memory.
/// `who` names the ranks that share the memory ("each of the 4 ranks of this process").
template <fa::Topology Topo, fa::Decomposer D>
void check_run_plans(const Topo& topo, const fa::traffic_matrix& t, const options& o, D dec, std::size_t limit,
                     const std::string& who, int sharing = 1) {
  const rank_t n = static_cast<rank_t>(t.rows());
  rank_t busiest = 0;
  long double most = -1;
  for (rank_t r = 0; r < n; ++r) {
    long double bytes = 0;
    for (rank_t j = 0; j < n; ++j) bytes += static_cast<long double>(t(r, j)) + static_cast<long double>(t(j, r));
    if (bytes > most) most = bytes, busiest = r;
  }
  const fa::engine_options eo = engine_options_of(o);
  fa::plan_options po = eo.planning;
  if (eo.staging_fraction) po.staging_budget = fa::staging_budget_for(fa::largest_buffer(t), *eo.staging_fraction, po, eo.staging_floor);
  po.max_plan_bytes = limit;
  // Planned only where the budget's slots may cut the busiest server's traffic into many pieces
  // (the planner's own lower bound, at an eighth of the limit): a few bytes of arithmetic per
  // matrix, not a plan, for ordinary budgets and long traces.
  if (po.staging_budget == 0) return;
  const bytes_t slot = po.staging_budget / (2 * static_cast<bytes_t>(std::max<std::uint32_t>(po.staging_slots, 1))) /
                       std::max<bytes_t>(po.granule, 1) * std::max<bytes_t>(po.granule, 1);
  if (slot > 0) {
    const int G = topo.gpus_per_server(), home = busiest / G;
    long double crossing = 0;
    for (rank_t a = 0; a < n; ++a)
      for (rank_t b = 0; b < n; ++b)
        if (a / G != b / G && (a / G == home || b / G == home)) crossing += static_cast<long double>(t(a, b));
    const long double at_least = crossing / static_cast<long double>(slot) * (sizeof(fa::piece) + 6 * sizeof(fa::rank_op));
    if (at_least * 8 < static_cast<long double>(limit)) return;
  }
  try {
    static_cast<void>(fa::planner<Topo, D>(topo, po, dec).make_rank(t, busiest));
  } catch (const fa::plan_too_large& e) {
    throw fa::error(strf("%s plans its part of the call and holds it, within %zu bytes (--max-plan-bytes %zu, or "
                         "where less its share of the %.0Lf bytes this process can hold, after the buffers, over "
                         "%.0Lf for the engine's copies); rank %d's part does not fit: %s",
                         who.c_str(), limit, o.max_plan_bytes, memory_limit_bytes(sharing), engine_bytes_per_plan_byte,
                         busiest, e.what()));
  }
}

/// For a process that holds one rank (MPI, the TCP bootstrap): refuses, before anything is
/// allocated, a run whose buffers or plans cannot fit this process's share of its machine (the
/// job's ranks on it, ranks_on_this_machine(), share its memory equally).
template <fa::Topology Topo>
void check_process_memory(const Topo& topo, const workload& w, const options& o, rank_t me) {
  const int local = ranks_on_this_machine();
  const fa::decomposer_params dp = decomposer_params_of(fa::scaleout_of(topo));
  fa::with_decomposer(o.decomposer, dp, [&](auto dec) {
    const long double engine = engine_bytes_per_rank<decltype(dec)>(topo.servers(), topo.gpus_per_server());
    const std::string where = local > 1 ? strf("this rank's share of its machine (%d ranks on it)", local) : "this rank's machine";
    for (const fa::traffic_matrix& t : w.matrices) {
      const long double others = check_run_memory(t, me, 1, engine, where.c_str(), local);
      check_run_plans(topo, t, o, dec, plan_limit_per_rank(o, 1, others, local),
                      local > 1 ? strf("each of the %d ranks on this machine", local) : std::string("this rank"), local);
    }
  });
}

/// Throws delivery_failure if any byte rank `me` received in call `call` differs from its
/// sender's pattern.
inline void check_delivery(const fa::packed_layout& l, std::span<const std::byte> recv, rank_t me, unsigned call) {
  rank_t from = -1;
  if (const auto bad = l.mismatches(recv, me, &from))
    throw delivery_failure("rank " + std::to_string(me) + ": " + std::to_string(bad) + " received bytes are wrong, the first from rank " +
                           std::to_string(from) + " (call " + std::to_string(call) + ")");
}

/// The fields every `fasta2a run` report line starts with (host and MPI transports alike), into an
/// open object: the caller adds its own fields and closes it.
template <class Topo>
void report_call_fields(fa::json_writer& out, std::size_t index, int ranks, const Topo& topo, bytes_t total,
                        std::size_t stages, bytes_t staging, double call_s, double direct_s,
                        const fa::call_stats& stats) {
  out.field("index", index)
      .field("ranks", ranks)
      .field("servers", topo.servers())
      .field("gpus", topo.gpus_per_server())
      .field("bytes", total)
      .field("stages", stages)
      .field("staging_bytes", staging)
      .field("call_s", call_s)
      .field("direct_call_s", direct_s)
      .field("speedup", ratio(direct_s, call_s))
      .field("plan_s", stats.plan_s)
      .field("exchange_s", stats.exchange_s)
      .field("execute_s", stats.execute_s);
}

} // namespace cli
