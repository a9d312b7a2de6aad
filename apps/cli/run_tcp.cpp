// fasta2a CLI: `fasta2a run --bootstrap tcp --transport libfabric`, started without MPI. Every
// process is one rank, found through fasta2a::tcp_bootstrap from the variables a launcher sets
// (torchrun's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); scale-up and scale-out both move bytes
// with libfabric RMA. Every received byte of every call is checked against its sender's pattern.
// Built only where the libfabric transport is.
#include "commands.hpp"
#include "options.hpp"
#include "report.hpp"
#include "run.hpp"
#include "workload.hpp"

#include <fasta2a/decompose.hpp>
#include <fasta2a/engine.hpp>
#include <fasta2a/libfabric.hpp>
#include <fasta2a/pattern.hpp>
#include <fasta2a/registry.hpp>
#include <fasta2a/tcp_bootstrap.hpp>
#include <fasta2a/topology.hpp>
#include <fasta2a/traffic.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace cli {
namespace {

/// Collectives the report needs, over the bootstrap's allgather.
template <class T>
std::vector<T> gather(fa::tcp_bootstrap& boot, T x) {
  std::vector<T> all(static_cast<std::size_t>(boot.size()));
  boot.allgather(std::as_bytes(std::span<const T>(&x, 1)), std::as_writable_bytes(std::span<T>(all)));
  return all;
}
double slowest_rank(fa::tcp_bootstrap& boot, double s) {
  const auto all = gather(boot, s);
  return *std::max_element(all.begin(), all.end());
}
bytes_t sum_over_ranks(fa::tcp_bootstrap& boot, bytes_t x) {
  bytes_t s = 0;
  for (bytes_t v : gather(boot, x)) s += v;
  return s;
}
void barrier(fa::tcp_bootstrap& boot) { boot.allgather({}, {}); }

struct tcp_figures {
  double call_s = 0;      // median over calls of the slowest rank's time
  fa::call_stats stats{}; // rank 0's breakdown of that call
  bytes_t checked = 0;    // received bytes checked, all ranks and calls
  std::size_t stages = 0;
  bytes_t staging_max = 0;
};

using transport = fa::libfabric_transport;

/// One warm-up and o.iters timed calls of the engine with decomposer D, every received byte checked.
template <fa::Decomposer D>
tcp_figures run_tcp_engine(fa::tcp_bootstrap& boot, transport& tr, const fa::two_tier_topology& topo,
                           const fa::traffic_matrix& t, const options& o, D dec = D(), bool dump = false) {
  using clock = std::chrono::steady_clock;
  const rank_t me = boot.rank();
  fa::engine<fa::two_tier_topology, fa::tcp_bootstrap, transport, transport, D> eng(topo, boot, tr, tr,
                                                                                    engine_options_of(o), dec);
  const fa::packed_layout l(t, me);
  std::vector<std::byte> send(l.send_bytes), recv(l.recv_bytes);
  l.fill(send, me);
  tcp_figures f;
  std::vector<std::pair<double, fa::call_stats>> calls;
  bytes_t checked = 0;
  for (unsigned c = 0; c <= o.iters; ++c) { // call 0 is the warm-up
    std::fill(recv.begin(), recv.end(), std::byte{0});
    barrier(boot);
    const auto start = clock::now();
    // A timeout names the peer waited for; the roll call adds the ranks that are not there.
    fa::with_roll_call(boot, [&] { eng.alltoallv(send, l.send_counts, l.send_displs, recv, l.recv_counts, l.recv_displs); });
    const double s = slowest_rank(boot, std::chrono::duration<double>(clock::now() - start).count());
    if (c > 0) calls.emplace_back(s, eng.last_stats());
    if (dump && c == 0 && me == o.dump_program) eng.last_program().print(std::cout);
    check_delivery(l, recv, me, c);
    checked += l.recv_bytes;
  }
  std::sort(calls.begin(), calls.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  f.call_s = calls[calls.size() / 2].first;
  f.stats = calls[calls.size() / 2].second;
  f.checked = sum_over_ranks(boot, checked);
  f.stages = eng.last_plan().stages();
  const auto staging = gather(boot, static_cast<bytes_t>(eng.staging_bytes()));
  f.staging_max = *std::max_element(staging.begin(), staging.end());
  return f;
}

int run_tcp_command(const options& o, fa::tcp_bootstrap& boot) {
  const rank_t me = boot.rank(), n = boot.size();
  if (n % o.gpus != 0)
    throw fa::error("WORLD_SIZE " + std::to_string(n) + " is not a whole number of servers of --gpus " +
                    std::to_string(o.gpus));
  const fa::two_tier_topology topo(n / o.gpus, o.gpus, o.links);
  if (o.servers != 0 && o.servers != topo.servers())
    throw fa::error("--servers " + std::to_string(o.servers) + " does not match WORLD_SIZE " + std::to_string(n) +
                    " of " + std::to_string(o.gpus) + " GPUs per server (" + std::to_string(topo.servers()) +
                    " servers)");
  const workload w = load_workload(o, n); // every rank reads or generates the same matrices
  // This process holds one rank's buffers, engine and plan, in its share of the machine (the plans
  // checked are the busiest rank's, the same on every rank: all refuse together).
  check_process_memory(topo, w, o, me);
  // --timeout bounds the transport's waits too (a put's completion, a peer's signal).
  transport tr(boot, fa::libfabric_options{.provider = o.fi_provider, .timeout = o.timeout});
  std::ofstream report;
  if (me == 0 && !o.report_path.empty()) {
    report.open(o.report_path, std::ios::binary | std::ios::trunc);
    if (!report) throw fa::error("cannot open report file '" + o.report_path + "' for writing");
  }
  if (me == 0)
    std::cout << "# fasta2a run: " << topo.servers() << " servers x " << topo.gpus_per_server() << " GPUs as " << n
              << " processes without MPI (TCP bootstrap, root " << boot.root() << "; " << tr.describe()
              << "); decomposer " << o.decomposer << ", granule " << o.granule << " B\n"
              << "# input: " << input_description(o) << "\n"
              << "# call, direct: the slowest rank's wall time per all-to-allv (median of " << o.iters
              << " after a warm-up), every received byte checked\n"
              << strf("%5s %5s %5s %11s %6s %10s %10s %8s %9s %9s %9s %12s\n", "index", "ranks", "SxG", "bytes",
                      "stages", "call", "direct", "direct/", "plan", "exchange", "execute", "checked")
              << strf("%5s %5s %5s %11s %6s %10s %10s %8s %9s %9s %9s %12s\n", "", "", "", "MiB", "", "ms", "ms",
                      "call", "us", "us", "ms", "MiB")
              << std::flush; // a pipe sees the run start (tests/tcp_stop.py)
  const fa::decomposer_params dp = decomposer_params_of(fa::scaleout_of(topo));
  bytes_t all_checked = 0;
  for (std::size_t k = 0; k < w.matrices.size(); ++k) {
    const fa::traffic_matrix& t = w.matrices[k];
    const tcp_figures fast = fa::with_decomposer(o.decomposer, dp, [&](auto dec) {
      return run_tcp_engine(boot, tr, topo, t, o, dec, true);
    });
    const tcp_figures direct = run_tcp_engine<fa::direct_decomposer>(boot, tr, topo, t, o);
    all_checked += fast.checked + direct.checked;
    if (me != 0) continue;
    const std::string shape = std::to_string(topo.servers()) + "x" + std::to_string(topo.gpus_per_server());
    std::cout << strf("%5zu %5d %5s %11.2f %6zu %10.3f %10.3f %8.2f %9.1f %9.1f %9.3f %12.2f\n", w.first_index + k, n,
                      shape.c_str(), t.sum() / mib, fast.stages, fast.call_s * 1e3, direct.call_s * 1e3,
                      ratio(direct.call_s, fast.call_s), fast.stats.plan_s * 1e6, fast.stats.exchange_s * 1e6,
                      fast.stats.execute_s * 1e3, (fast.checked + direct.checked) / mib);
    if (report.is_open()) {
      std::string line;
      fa::json_writer j(line);
      j.begin_object();
      report_call_fields(j, w.first_index + k, n, topo, t.sum(), fast.stages, fast.staging_max, fast.call_s,
                         direct.call_s, fast.stats);
      j.field("bootstrap", "tcp").field("provider", tr.provider()).field("bytes_checked", fast.checked + direct.checked).end_object();
      report << line << '\n';
    }
  }
  if (report.is_open() && !report.flush()) throw fa::error("cannot write report file '" + o.report_path + "'");
  // Every rank's puts have completed before any rank closes its endpoint.
  tr.quiesce();
  barrier(boot);
  if (me == 0) {
    std::cout << "# every received byte checked: " << strf("%.2f MiB", all_checked / mib)
              << " against the senders' patterns, all correct\n";
    std::cout.flush();
  }
  return 0;
}

} // namespace

int run_tcp(const options& o) {
  // The rank is known only once the environment is read: until then errors name no rank.
  // --timeout bounds the bootstrap's waits as well, unless FASTA2A_BOOTSTRAP_TIMEOUT sets them.
  fa::tcp_bootstrap_options bo = fa::tcp_bootstrap_options::from_env();
  if (const char* t = std::getenv("FASTA2A_BOOTSTRAP_TIMEOUT"); t == nullptr || *t == '\0') bo.timeout = o.timeout;
  fa::tcp_bootstrap boot(bo);
  try {
    return run_tcp_command(o, boot);
  } catch (const delivery_failure& e) {
    say_error(std::string(e.what()) + " (this is a bug in fasta2a; please report it)");
    return 1;
  } catch (const std::exception& e) { // fasta2a::error and anything else
    say_error("rank " + std::to_string(boot.rank()) + ": " + e.what());
    return 2;
  }
}

} // namespace cli
