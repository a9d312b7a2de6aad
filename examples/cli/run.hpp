// fasta2a CLI: what `fasta2a run` does alike on every transport: the engine's options, checking
// received bytes, and the fields every report line starts with.
#pragma once

#include "commands.hpp"
#include "options.hpp"
#include "report.hpp"

#include <fasta2a/engine.hpp>
#include <fasta2a/json_writer.hpp>
#include <fasta2a/pattern.hpp>

#include <cstddef>
#include <span>
#include <string>

namespace cli {

/// The engine's options from the command line: planning as `fasta2a plan` plans, and --rail-window.
inline fa::engine_options engine_options_of(const options& o) {
  fa::engine_options e;
  e.planning = planning_options(o);
  e.rail_window = o.rail_window;
  return e;
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
