// fasta2a CLI: what `fasta2a run` does alike on every transport: the engine's options, checking
// received bytes, and the fields every report line starts with.
#pragma once

#include "commands.hpp"
#include "options.hpp"
#include "report.hpp"

#include <fasta2a/engine.hpp>
#include <fasta2a/json_writer.hpp>
#include <fasta2a/pattern.hpp>

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

/// The memory this process may use: the machine's physical memory, or less where the address space
/// is limited (ulimit -v).
inline long double memory_limit_bytes() {
  long double limit = std::numeric_limits<std::ptrdiff_t>::max(); // what a vector can address
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  if (pages > 0 && page > 0) limit = std::min(limit, static_cast<long double>(pages) * page);
  rlimit as{};
  if (getrlimit(RLIMIT_AS, &as) == 0 && as.rlim_cur != RLIM_INFINITY)
    limit = std::min(limit, static_cast<long double>(as.rlim_cur));
  return limit;
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
inline void check_run_memory(const fa::traffic_matrix& t, rank_t first, rank_t ranks_here,
                             long double engine_per_rank, const char* where) {
  const long double limit = memory_limit_bytes();
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
