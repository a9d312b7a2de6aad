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

// --- the CLI's own collectives between calls, each with a deadline (issue 12, defect 3) ---------
//
// A rank that stops, dies or was given other options must not leave the others in MPI_Barrier
// forever, each spinning a core: every barrier and reduction of the CLI is non-blocking, polled
// under a back-off (spin, yield, then sleep up to 10 ms) until a deadline, and an error naming
// the operation (and, for barriers, the ranks that did not arrive) when it passes. MPI cannot
// cancel a started collective: after such an error the program reports and calls MPI_Abort.

/// Barriers and reductions over MPI_COMM_WORLD with a deadline. Barriers are gathers to rank 0 on
/// a duplicate communicator (rank 0 knows who is missing), then a release from rank 0.
class guarded_world {
public:
  explicit guarded_world(std::chrono::milliseconds timeout) : timeout_(timeout) {
    MPI_Comm_rank(MPI_COMM_WORLD, &me_);
    MPI_Comm_size(MPI_COMM_WORLD, &n_);
    MPI_Comm_dup(MPI_COMM_WORLD, &comm_);
    MPI_Comm_dup(MPI_COMM_WORLD, &roll_); // the roll call after a timeout (fa::detail::mpi_roll_call)
  }
  guarded_world(const guarded_world&) = delete;
  guarded_world& operator=(const guarded_world&) = delete;
  ~guarded_world() {
    if (!failed_) MPI_Comm_free(&comm_); // after a timeout a request may still use it: MPI_Abort follows
    if (!failed_) MPI_Comm_free(&roll_);
  }

  std::chrono::milliseconds timeout() const noexcept { return timeout_; }

  /// Every rank reaches `what`, or an error within the timeout: on rank 0 naming the ranks that did
  /// not arrive, elsewhere saying that rank 0 did not release the barrier.
  void barrier(const std::string& what) {
    const int tag = static_cast<int>(++epoch_ % 32768);
    int token = 0;
    if (me_ == 0) {
      std::vector<MPI_Request> arrived(static_cast<std::size_t>(n_ > 1 ? n_ - 1 : 0));
      std::vector<int> tokens(arrived.size());
      for (int r = 1; r < n_; ++r) MPI_Irecv(&tokens[r - 1], 1, MPI_INT, r, tag, comm_, &arrived[r - 1]);
      if (!wait_all(arrived)) {
        std::string missing;
        int count = 0;
        for (int r = 1; r < n_; ++r)
          if (arrived[r - 1] != MPI_REQUEST_NULL) {
            missing += (count++ ? ", " : "") + std::to_string(r);
          }
        failed_ = true;
        throw fa::error(std::string(count == 1 ? "rank " : "ranks ") + missing + " did not reach " + what +
                        " within " + std::to_string(timeout_.count()) +
                        " ms (stopped, dead, or given other options than rank 0)");
      }
      std::vector<MPI_Request> release(arrived.size());
      for (int r = 1; r < n_; ++r) MPI_Isend(&token, 1, MPI_INT, r, tag, comm_, &release[r - 1]);
      if (!wait_all(release)) {
        failed_ = true;
        throw fa::error("rank 0 could not release " + what + " within " + std::to_string(timeout_.count()) + " ms");
      }
    } else {
      std::vector<MPI_Request> req(2);
      MPI_Isend(&token, 1, MPI_INT, 0, tag, comm_, &req[0]);
      int release = 0;
      MPI_Irecv(&release, 1, MPI_INT, 0, tag, comm_, &req[1]);
      // Two seconds longer than rank 0, which names the missing ranks: its error is the one printed.
      if (!wait_all(req, std::chrono::milliseconds(2000))) {
        failed_ = true;
        throw fa::error("rank 0 did not release " + what + " within " + std::to_string(timeout_.count()) + " ms" + absent());
      }
    }
  }

  /// MPI_Allreduce of `count` values in place, or an error naming `what` after the timeout.
  void allreduce(void* values, int count, MPI_Datatype type, MPI_Op op, const std::string& what) {
    std::vector<MPI_Request> req(1);
    MPI_Iallreduce(MPI_IN_PLACE, values, count, type, op, comm_, &req[0]);
    if (!wait_all(req)) {
      failed_ = true;
      throw fa::error(what + ": the reduction over " + std::to_string(n_) + " ranks did not complete within " +
                      std::to_string(timeout_.count()) + " ms" + absent());
    }
  }

  /// Every rank's `mine` (the same number of words everywhere), in rank order.
  std::vector<std::uint64_t> allgather(const std::vector<std::uint64_t>& mine, const std::string& what) {
    std::vector<std::uint64_t> all(mine.size() * static_cast<std::size_t>(n_));
    std::vector<MPI_Request> req(1);
    MPI_Iallgather(mine.data(), static_cast<int>(mine.size()), MPI_UINT64_T, all.data(), static_cast<int>(mine.size()),
                   MPI_UINT64_T, comm_, &req[0]);
    if (!wait_all(req)) {
      failed_ = true;
      throw fa::error(what + ": the allgather over " + std::to_string(n_) + " ranks did not complete within " +
                      std::to_string(timeout_.count()) + " ms" + absent());
    }
    return all;
  }

  /// After the engine timed out waiting for a peer, which may itself be waiting for another: the
  /// ranks that do not answer a roll call of the ranks that timed out, named ("; rank 5 did not
  /// answer ..."), or "" if every rank answered. The ranks stuck behind one stopped rank time out
  /// within a moment of each other, so every survivor's error names the stopped one, whichever of
  /// them reaches MPI_Abort first.
  std::string absent_after_engine_timeout() {
    failed_ = true; // the engine's requests may still use the world's communicators: MPI_Abort follows
    const std::string missing = fa::detail::mpi_roll_call(roll_, me_, n_, timeout_, fa::wait_policy{});
    if (missing.empty()) return "";
    return std::string("; rank") + (missing.find(',') == std::string::npos ? " " : "s ") + missing +
           " did not answer a roll call of the ranks that timed out (stopped, dead, or waiting elsewhere)";
  }

private:
  // After a timeout: the ranks that do not answer a roll call, named.
  std::string absent() {
    const std::string missing = fa::detail::mpi_roll_call(roll_, me_, n_, timeout_, fa::wait_policy{});
    if (missing.empty()) return " (every rank answered a roll call: a rank was given other options?)";
    return std::string(": rank") + (missing.find(',') == std::string::npos ? " " : "s ") + missing +
           " did not answer a roll call (stopped, dead, or given other options)";
  }

  // Polls the requests until all complete (true) or the deadline passes (false; the finished ones
  // are then MPI_REQUEST_NULL). Sleeps up to 10 ms between polls: no core spins while it waits.
  bool wait_all(std::vector<MPI_Request>& req, std::chrono::milliseconds extra = std::chrono::milliseconds(0)) {
    static const fa::wait_policy polling{.spin = 16, .yields = 16, .min_sleep = std::chrono::microseconds(20),
                                         .max_sleep = std::chrono::microseconds(10000)};
    const auto deadline = std::chrono::steady_clock::now() + timeout_ + extra;
    fa::detail::backoff b(polling);
    while (true) {
      int done = 0;
      MPI_Testall(static_cast<int>(req.size()), req.data(), &done, MPI_STATUSES_IGNORE);
      if (done) return true;
      if (std::chrono::steady_clock::now() >= deadline) {
        for (auto& r : req) { // MPI_Testall leaves every request as it was when not all are done
          int one = 0;
          if (r != MPI_REQUEST_NULL) MPI_Test(&r, &one, MPI_STATUS_IGNORE);
        }
        return false;
      }
      b.pause();
    }
  }

  std::chrono::milliseconds timeout_;
  MPI_Comm comm_ = MPI_COMM_NULL, roll_ = MPI_COMM_NULL;
  int me_ = 0, n_ = 1;
  unsigned epoch_ = 0;
  bool failed_ = false;
};

/// The options every rank must be given alike, each as text: ranks that differ (say in --iters or
/// --compare-mpi) would wait in different collectives. Rank 0 alone writes --report.
std::vector<std::pair<const char*, std::string>> agreed_options(const options& o) {
  const auto num = [](auto v) { return std::to_string(v); };
  return {{"--servers", num(o.servers)},
          {"--gpus", num(o.gpus)},
          {"--scaleup", strf("%d %a %a", static_cast<int>(o.links.kind), o.links.scaleup_bandwidth,
                            o.links.scaleout_bandwidth)},
          {"--decomposer", o.decomposer},
          {"--adaptive", num(o.adaptive)},
          {"--granule", num(o.granule)},
          {"--alpha", strf("%a", o.alpha_s)},
          {"--max-plan-bytes", num(o.max_plan_bytes)},
          {"the input", o.input_flag},
          {"--matrix", o.matrix_path},
          {"--index", num(o.index)},
          {"--all", num(o.all)},
          {"--unit", num(o.unit)},
          {"--zipf", strf("%a", o.zipf_s)},
          {"--hotspot", num(o.hot)},
          {"--hot-share", strf("%a", o.hot_share)},
          {"--lognormal", strf("%a", o.sigma)},
          {"--bytes-per-rank", num(o.bytes_per_rank)},
          {"--seed", num(o.seed)},
          {"--transport", o.transport},
          {"--fi-provider", o.fi_provider},
          {"--iters", num(o.iters)},
          {"--timeout", num(o.timeout.count())},
          {"--rail-window", num(o.rail_window)},
          {"--staging-budget", num(o.staging_budget)},
          {"--staging-fraction", strf("%a", o.staging_fraction)},
          {"--staging-floor", num(o.staging_floor)},
          {"--staging-slots", num(o.staging_slots)},
          {"--rails", fa::to_string(o.rails)},
          {"--compare-mpi", num(o.compare_mpi)},
          {"--dump-program", num(o.dump_program)}};
}

/// FNV-1a of a text: a digest for comparing options across ranks.
std::uint64_t digest_of(const std::string& text) {
  std::uint64_t h = 14695981039346656037ull;
  for (char c : text) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ull;
  }
  return h;
}

/// Agrees on the options before anything else: an allgather of one digest per option; every rank
/// throws the same error, naming the ranks whose options differ from rank 0's and the options.
void agree_on_options(guarded_world& world, const options& o) {
  const auto fields = agreed_options(o);
  std::vector<std::uint64_t> mine;
  for (const auto& f : fields) mine.push_back(digest_of(f.second));
  const std::vector<std::uint64_t> all = world.allgather(mine, "agreeing on the options");
  const std::size_t k = fields.size(), n = all.size() / k;
  std::string ranks, which;
  std::vector<bool> differs(k, false);
  for (std::size_t r = 1; r < n; ++r) {
    bool rank_differs = false;
    for (std::size_t f = 0; f < k; ++f)
      if (all[r * k + f] != all[f]) rank_differs = differs[f] = true;
    if (rank_differs) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  }
  if (ranks.empty()) return;
  for (std::size_t f = 0; f < k; ++f)
    if (differs[f]) which += (which.empty() ? "" : ", ") + std::string(fields[f].first);
  const bool one = ranks.find(',') == std::string::npos;
  throw fa::error("every rank must be given the same options: " + std::string(one ? "rank " : "ranks ") + ranks +
                  (one ? " differs" : " differ") + " from rank 0 in " + which);
}

double slowest_rank(guarded_world& world, double seconds) {
  world.allreduce(&seconds, 1, MPI_DOUBLE, MPI_MAX, "the slowest rank's time");
  return seconds;
}

bytes_t sum_over_ranks(guarded_world& world, bytes_t x) {
  world.allreduce(&x, 1, MPI_UINT64_T, MPI_SUM, "summing the checked bytes");
  return x;
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
mpi_figures run_engine_on(guarded_world& world, const fa::two_tier_topology& topo, const fa::traffic_matrix& t,
                          const options& o, bool compare, D dec, bool dump, fa::mpi_bootstrap& boot, Up& up,
                          Out& out) {
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
    world.barrier("the barrier before call " + std::to_string(c));
    const auto start = clock::now();
    try {
      eng.alltoallv(send, l.send_counts, l.send_displs, recv, l.recv_counts, l.recv_displs);
    } catch (const fa::timeout_error& e) {
      // The engine names the peer it waited for; that peer may be waiting for a stopped rank.
      const std::string what = e.what();
      if (what.find("roll call") != std::string::npos) throw; // mpi_bootstrap's allgather asked already
      throw fa::timeout_error(what + world.absent_after_engine_timeout());
    }
    const double mine = std::chrono::duration<double>(clock::now() - start).count();
    world.barrier("the end of call " + std::to_string(c)); // outside the timed region; names a missing rank
    const double s = slowest_rank(world, mine);
    if (c > 0) calls.emplace_back(s, eng.last_stats());
    if (dump && c == 0 && me == o.dump_program) eng.last_program().print(std::cout);
    check_delivery(l, recv, me, c);
    checked += l.recv_bytes;
  }
  std::sort(calls.begin(), calls.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  f.call_s = calls[calls.size() / 2].first;
  f.stats = calls[calls.size() / 2].second;
  f.checked = sum_over_ranks(world, checked);
  f.stages = eng.last_plan().stages();
  bytes_t staging = eng.staging_bytes();
  world.allreduce(&staging, 1, MPI_UINT64_T, MPI_MAX, "the largest staging buffer");
  f.staging_max = staging;

  if (compare) {
    // MPI_Alltoallv counts in int: a larger matrix cannot be compared (every rank must agree).
    int fits = l.send_bytes <= INT_MAX && l.recv_bytes <= INT_MAX ? 1 : 0;
    world.allreduce(&fits, 1, MPI_INT, MPI_MIN, "--compare-mpi's size check");
    if (!fits) throw fa::error("--compare-mpi: a rank's buffer passes INT_MAX bytes, beyond MPI_Alltoallv's int counts");
    const auto ints = [](const std::vector<std::uint64_t>& v) { return std::vector<int>(v.begin(), v.end()); };
    const std::vector<int> sc = ints(l.send_counts), sd = ints(l.send_displs), rc = ints(l.recv_counts),
                           rd = ints(l.recv_displs);
    std::vector<std::byte> ref(recv.size());
    std::vector<double> times;
    for (unsigned c = 0; c <= o.iters; ++c) {
      world.barrier("the barrier before MPI_Alltoallv call " + std::to_string(c));
      const auto start = clock::now();
      MPI_Alltoallv(send.data(), sc.data(), sd.data(), MPI_BYTE, ref.data(), rc.data(), rd.data(), MPI_BYTE,
                    MPI_COMM_WORLD);
      const double s = slowest_rank(world, std::chrono::duration<double>(clock::now() - start).count());
      if (c > 0) times.push_back(s);
    }
    std::sort(times.begin(), times.end());
    f.mpi_s = times[times.size() / 2];
    bytes_t differ = 0;
    for (std::size_t k = 0; k < recv.size(); ++k) differ += recv[k] != ref[k];
    if (differ != 0)
      throw delivery_failure("rank " + std::to_string(me) + ": " + std::to_string(differ) + " of " +
                             std::to_string(recv.size()) + " received bytes differ from MPI_Alltoallv's");
    f.compared = sum_over_ranks(world, recv.size());
  }
  return f;
}

/// run_engine_on with a fresh MPI transport for scale-up, and for scale-out unless `fab` is given
/// (the command's libfabric transport: its connections count signals apart, engine by engine).
template <fa::Decomposer D>
mpi_figures run_mpi_engine(guarded_world& world, const fa::two_tier_topology& topo, const fa::traffic_matrix& t,
                           const options& o, bool compare, fabric* fab, D dec = D(), bool dump = false) {
  // --timeout bounds every wait of the call: the engine's, its per-call allgathers, the sends' flush.
  fa::mpi_bootstrap boot(MPI_COMM_WORLD, {.timeout = o.timeout});
  fa::mpi_transport tr(MPI_COMM_WORLD, {.flush_timeout = o.timeout});
#ifdef FASTA2A_HAVE_LIBFABRIC
  if (fab != nullptr) {
    // Both tiers need this rank's progress (MPI's shared memory: the receiver copies; tcp;ofi_rxm:
    // manual progress): while the engine blocks in the MPI transport, libfabric is driven too.
    auto pump = fab->connect(1);
    fa::progress_coupled<fa::mpi_transport> up(tr, boot.size(), [&] {
      pump.test(boot.rank(), 0, std::numeric_limits<std::uint64_t>::max());
    });
    return run_engine_on(world, topo, t, o, compare, std::move(dec), dump, boot, up, *fab);
  }
#else
  static_cast<void>(fab);
#endif
  return run_engine_on(world, topo, t, o, compare, std::move(dec), dump, boot, tr, tr);
}

/// `fasta2a run --transport mpi`: this process is one rank of MPI_COMM_WORLD.
int run_mpi_command(const options& o) {
  int me = 0, n = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  guarded_world world(engine_options_of(o).timeout);
  agree_on_options(world, o); // before anything that ranks given other options would do differently
  const fa::two_tier_topology topo = fa::mpi_world_topology(o.gpus, MPI_COMM_WORLD, o.links);
  if (o.servers != 0 && o.servers != topo.servers())
    throw fa::error("--servers " + std::to_string(o.servers) + " does not match " + std::to_string(n) +
                    " MPI ranks of " + std::to_string(o.gpus) + " GPUs per server (" +
                    std::to_string(topo.servers()) + " servers)");
  const workload w = load_workload(o, n); // every rank reads or generates the same matrices
  // This process holds one rank's buffers, engine and plan, in its share of the machine (a failure
  // here aborts every rank; the plans checked are the busiest rank's, the same on every rank).
  check_process_memory(topo, w, o, me);
  // --transport libfabric: one libfabric transport for the whole command (collective: endpoint
  // names are allgathered over MPI), the provider from --fi-provider or FASTA2A_FI_PROVIDER.
  fa::mpi_bootstrap fab_boot(MPI_COMM_WORLD, {.timeout = o.timeout});
  std::unique_ptr<fabric> fab;
  std::string scaleout = "MPI transport";
#ifdef FASTA2A_HAVE_LIBFABRIC
  if (o.transport == "libfabric") {
    fab = std::make_unique<fabric>(fab_boot, fa::libfabric_options{.provider = o.fi_provider, .timeout = o.timeout});
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
      return run_mpi_engine(world, topo, t, o, o.compare_mpi, fab.get(), dec, true);
    });
    const mpi_figures direct = run_mpi_engine<fa::direct_decomposer>(world, topo, t, o, false, fab.get());
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
    world.barrier("closing the libfabric endpoints"); // and every rank's, before any endpoint closes
  }
#endif
  return 0;
}

/// `message` under "rank N: ", unless it already starts so (the engine names its rank itself).
std::string with_rank(int me, const std::string& message) {
  const std::string prefix = "rank " + std::to_string(me) + ": ";
  return message.starts_with(prefix) ? message : prefix + message; // not "rank 7: rank 7: ..."
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
    say_error(std::string(e.what()) + " (this is a bug in fasta2a; please report it)");
    code = 1;
  } catch (const std::exception& e) { // fasta2a::error and anything else
    say_error(with_rank(me, e.what()));
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
