// fasta2a CLI: `fasta2a run --transport mpi`, under mpirun. Every process is one rank of
// MPI_COMM_WORLD and holds only its own buffers; optionally MPI_Alltoallv runs on the same buffers
// and its received bytes are compared with the engine's. Built only where the MPI transport is.
// `--transport libfabric` is the same run with the engine's scale-out over libfabric RMA
// (fasta2a::libfabric_transport, one for the whole command); MPI still bootstraps and carries
// scale-up inside a server (shared memory, as under --transport mpi).
#include "commands.hpp"
#include "options.hpp"
#include "report.hpp"
#include "run.hpp"
#include "workload.hpp"

#include <fasta2a/decompose.hpp>
#include <fasta2a/engine.hpp>
#include <fasta2a/mpi.hpp>
#ifdef FASTA2A_HAVE_LIBFABRIC
#include <fasta2a/coupled_progress.hpp>
#include <fasta2a/libfabric.hpp>
#endif
#include <fasta2a/pattern.hpp>
#include <fasta2a/registry.hpp>
#include <fasta2a/topology.hpp>
#include <fasta2a/traffic.hpp>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>
#include <exception>
#include <fstream>
#include <iostream>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace cli {
namespace {

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

#ifdef FASTA2A_HAVE_LIBFABRIC
using fabric = fa::libfabric_transport;
#else
struct fabric {}; // never made: --transport libfabric is refused where libfabric is not built
#endif

/// One warm-up and o.iters timed calls of the engine with decomposer D, scale-up over `up` (the
/// MPI transport), scale-out over `out` (the same, or libfabric), every received byte of every
/// call checked; with `compare`, MPI_Alltoallv too.
template <fa::Decomposer D, class Up, class Out>
mpi_figures run_engine_on(const fa::two_tier_topology& topo, const fa::traffic_matrix& t, const options& o,
                          bool compare, D dec, bool dump, fa::mpi_bootstrap& boot, Up& up, Out& out) {
  using clock = std::chrono::steady_clock;
  int me = 0, n = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  fa::engine<fa::two_tier_topology, fa::mpi_bootstrap, Up, Out, D> eng(
      topo, boot, up, out, engine_options_of(o), dec);
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
    if (dump && c == 0 && me == o.dump_program) eng.last_program().print(std::cout);
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

/// run_engine_on with a fresh MPI transport for scale-up, and for scale-out unless `fab` is given
/// (the command's libfabric transport: its connections count signals apart, engine by engine).
template <fa::Decomposer D>
mpi_figures run_mpi_engine(const fa::two_tier_topology& topo, const fa::traffic_matrix& t, const options& o,
                           bool compare, fabric* fab, D dec = D(), bool dump = false) {
  fa::mpi_bootstrap boot(MPI_COMM_WORLD);
  fa::mpi_transport tr(MPI_COMM_WORLD);
#ifdef FASTA2A_HAVE_LIBFABRIC
  if (fab != nullptr) {
    // Both tiers need this rank's progress (MPI's shared memory: the receiver copies; tcp;ofi_rxm:
    // manual progress): while the engine blocks in the MPI transport, libfabric is driven too.
    auto pump = fab->connect(1);
    fa::progress_coupled<fa::mpi_transport> up(tr, boot.size(), [&] {
      pump.test(boot.rank(), 0, std::numeric_limits<std::uint64_t>::max());
    });
    return run_engine_on(topo, t, o, compare, std::move(dec), dump, boot, up, *fab);
  }
#else
  static_cast<void>(fab);
#endif
  return run_engine_on(topo, t, o, compare, std::move(dec), dump, boot, tr, tr);
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
  // --transport libfabric: one libfabric transport for the whole command (collective: endpoint
  // names are allgathered over MPI), the provider from --fi-provider or FASTA2A_FI_PROVIDER.
  fa::mpi_bootstrap fab_boot(MPI_COMM_WORLD);
  std::unique_ptr<fabric> fab;
  std::string scaleout = "MPI transport";
#ifdef FASTA2A_HAVE_LIBFABRIC
  if (o.transport == "libfabric") {
    fab = std::make_unique<fabric>(fab_boot, fa::libfabric_options{.provider = o.fi_provider});
    scaleout = fab->describe();
  }
#endif
  // Said at start-up where the MPI transport's speed depends on Open MPI's btl_tcp_flags.
  const std::string note = o.transport == "mpi" ? fa::mpi_transport_setting_note() : std::string();
  std::ofstream report;
  if (me == 0 && !o.report_path.empty()) {
    report.open(o.report_path, std::ios::binary | std::ios::trunc);
    if (!report) throw fa::error("cannot open report file '" + o.report_path + "' for writing");
  }
  if (me == 0)
    std::cout << "# fasta2a run: " << topo.servers() << " servers x " << topo.gpus_per_server()
              << " GPUs as " << n << " MPI processes; scale-up: MPI transport; scale-out: " << scaleout
              << "\n# decomposer " << o.decomposer
              << ", granule " << o.granule << " B\n"
              << "# input: " << input_description(o) << "\n"
              << (note.empty() ? std::string() : "# note: " + note + "\n")
              << "# call, direct" << (o.compare_mpi ? ", MPI_Alltoallv" : "")
              << ": the slowest rank's wall time per all-to-allv (median of " << o.iters
              << " after a warm-up), every received byte checked\n"
              << strf("%5s %5s %5s %11s %6s %10s %10s %8s %10s %8s %9s %9s %9s %12s\n", "index", "ranks", "SxG",
                      "bytes", "stages", "call", "direct", "direct/", "Alltoallv", "MPI/", "plan", "exchange",
                      "execute", "checked")
              << strf("%5s %5s %5s %11s %6s %10s %10s %8s %10s %8s %9s %9s %9s %12s\n", "", "", "", "MiB", "", "ms",
                      "ms", "call", "ms", "call", "us", "us", "ms", "MiB");
  const fa::decomposer_params dp = decomposer_params_of(fa::scaleout_of(topo));
  bytes_t all_checked = 0, all_compared = 0;
  for (std::size_t k = 0; k < w.matrices.size(); ++k) {
    const fa::traffic_matrix& t = w.matrices[k];
    const mpi_figures fast = fa::with_decomposer(o.decomposer, dp, [&](auto dec) {
      return run_mpi_engine(topo, t, o, o.compare_mpi, fab.get(), dec, true);
    });
    const mpi_figures direct = run_mpi_engine<fa::direct_decomposer>(topo, t, o, false, fab.get());
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
      std::string line;
      fa::json_writer j(line);
      j.begin_object();
      report_call_fields(j, w.first_index + k, n, topo, total, fast.stages, fast.staging_max, fast.call_s,
                         direct.call_s, fast.stats);
      j.field("mpi_alltoallv_s", o.compare_mpi ? std::optional<double>(fast.mpi_s) : std::nullopt)
          .field("bytes_checked", fast.checked + direct.checked)
          .field("bytes_compared_mpi", fast.compared)
          .end_object();
      report << line << '\n';
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
#ifdef FASTA2A_HAVE_LIBFABRIC
  if (fab) {
    fab->quiesce();               // this rank's writes and signals have all completed
    MPI_Barrier(MPI_COMM_WORLD);  // and every rank's, before any endpoint closes
  }
#endif
  return 0;
}

} // namespace

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

} // namespace cli
