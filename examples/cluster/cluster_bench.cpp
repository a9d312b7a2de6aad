// fasta2a: the emulated cluster's benchmark driver. Every MPI process is one rank; on one traffic
// matrix it runs MPI_Alltoallv and the fasta2a engine with direct sending, spread-out and FAST
// (exact Birkhoff), all on the same send and receive buffers, checks every received byte of every
// call against the senders' pattern, and prints one JSON object per method (rank 0, stdout).
//
//   mpirun -np N cluster_bench --gpus G --workload zipf --bytes-per-rank 16MiB --rate-mbit 200
//
// Waiting: 16 ranks share 2 cores here, and a rank that spins while it waits takes the CPU from the
// ranks that are moving bytes. MPI_Alltoallv is therefore run as MPI_Ialltoallv polled under the
// same wait_policy (spin, yield, then sleep up to 200 us) as the engine's MPI transport, and every
// barrier and reduction of the driver is a non-blocking collective polled the same way.
//
// NIC bytes: where the cluster script started the rank (FASTA2A_NIC names its NIC), each rank reads
// its NIC's kernel counters (/sys/class/net/NIC/statistics) before the first and after the last
// timed call of a method; the JSON holds the per-call bytes of every NIC.
#include <mpi.h>

#include "cluster_workload.hpp"

#include <fasta2a/cost_model.hpp>
#include <fasta2a/decompose.hpp>
#include <fasta2a/engine.hpp>
#include <fasta2a/fewer_stages.hpp>
#include <fasta2a/json_writer.hpp>
#include <fasta2a/mpi.hpp>
#ifdef FASTA2A_HAVE_LIBFABRIC
#include <fasta2a/coupled_progress.hpp>
#include <fasta2a/libfabric.hpp>
#endif
#include <fasta2a/pattern.hpp>
#include <fasta2a/registry.hpp>
#include <fasta2a/traffic.hpp>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

namespace fa = fasta2a;
using fa::bytes_t;
using fa::rank_t;

namespace {

constexpr const char* usage = R"(usage: mpirun -np N cluster_bench --gpus G [options]
  --gpus G               ranks per server (servers = N / G, consecutive ranks)
  --workload W           uniform | zipf | hotspot | megatron (default zipf)
  --bytes-per-rank B     bytes each rank sends (uniform, zipf, hotspot; default 16MiB)
  --zipf S               Zipf exponent (default 1.0)
  --hot K --share X      hot-spot: K hot ranks receive share X of every sender's bytes (1, 0.5)
  --matrix FILE          megatron: the trace (32 x 32 matrices); reduced to N x N by summing
  --index K              f x f blocks, f = 32 / N (default index 0)
  --unit U               megatron: bytes per token (default 4096)
  --seed S               generator seed (default 1)
  --granule B            the engine's granule (default 4096: one token of the trace at --unit 4096)
  --methods LIST         comma-separated methods (default mpi,direct,spread-out,fast): mpi
                         (MPI_Alltoallv), or the engine with a decomposer: birkhoff, bottleneck
                         (exact, heaviest stages first: fewer stages), quantized (stages in
                         multiples of a quantum chosen for --alpha-ms), spread-out, direct, best;
                         also written fast-NAME (fast-bottleneck, fast-quantized), and fast for
                         birkhoff, as the recorded results name them;
                         diagnostics: isend (MPI_Irecv/MPI_Isend to every peer, posted in rank
                         order 0..N-1, as the engine's direct plan posts them) and isend-rotated
                         (posted from rank me+1 on, so that senders start on different receivers)
                         fast-adaptive (exact Birkhoff, but direct sending wherever the engine's
                         model predicts it faster: plan_options::direct_if_faster_alpha);
                         any engine method with the suffix -fi (fast-fi, fast-adaptive-fi) runs the
                         same engine with the libfabric transport as scale-out (provider from
                         FASTA2A_FI_PROVIDER, default tcp;ofi_rxm; the cluster script pins each
                         rank's tcp provider to its NIC with FI_TCP_IFACE), scale-up still over MPI;
                         -fi-wfc forces the signal ordering "wait for the puts' completions"
                         (where -fi takes the provider's order when it offers one); -cut (fast-cut) has
                         the MPI transport cut its messages below Open MPI's TCP "put" pipeline where
                         that is on (mpi_transport_options::avoid_tcp_put_pipeline); -stagingP
                         (fast-staging10) sets the engine's staging budget to P% of the largest
                         buffer (engine_options::staging_fraction; -staging0: no budget, staging as
                         large as the plan's own layout); without it the engine's default, 25%;
                         -slotsK after it (fast-staging25-slots2) sets plan_options::staging_slots
  --alpha-ms A           quantized, best, fast-adaptive: the cost of one stage on this network
                         (default 5)
  --rail-window W        the engine's rail_window: stages in flight per sender (default 5)
  --engine-spin N        the engine's wait_policy: N polls and N yields before it sleeps
                         (default: wait_policy's, 64 and 64)
  --iters N              timed calls per method after one warm-up (default 5)
  --rate-mbit R          NIC rate, for the lower bounds (default 200)
  --label TEXT           the workload's name in the JSON (default: derived)
Sizes take K, M, G or KiB, MiB, GiB (powers of 1024).
)";

// The workload's fields (workload, bytes_per_rank, zipf, hot, share, matrix, index, unit, seed,
// granule) are cluster_workload.hpp's, which cluster_model shares.
struct options : fa::cluster::workload_spec {
  int gpus = 0;
  std::vector<std::string> methods{"mpi", "direct", "spread-out", "fast"};
  unsigned iters = 5;
  double rate_mbit = 200;
  double alpha_s = 5e-3; // --alpha-ms is given in milliseconds; parse converts it, once
  std::size_t rail_window = fa::engine_options{}.rail_window;
  int engine_spin = -1; // --engine-spin N: the engine's wait_policy spin and yields (-1: its defaults)
  std::string label;
};

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string part; std::getline(in, part, sep);)
    if (!part.empty()) out.push_back(part);
  return out;
}

using fa::cluster::engine_method;
using fa::cluster::engine_method_of;

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::fputs(usage, stdout);
      std::exit(0);
    }
    if (i + 1 >= argc) throw fa::error("option " + std::string(flag) + " needs a value");
    const std::string v = argv[++i];
    if (flag == "--gpus") o.gpus = std::stoi(v);
    else if (flag == "--workload") o.workload = v;
    else if (flag == "--bytes-per-rank") o.bytes_per_rank = fa::parse_bytes(v, flag);
    else if (flag == "--zipf") o.zipf = std::stod(v);
    else if (flag == "--hot") o.hot = std::stoi(v);
    else if (flag == "--share") o.share = std::stod(v);
    else if (flag == "--matrix") o.matrix = v;
    else if (flag == "--index") o.index = std::stoul(v);
    else if (flag == "--unit") o.unit = fa::parse_bytes(v, flag);
    else if (flag == "--seed") o.seed = std::stoull(v);
    else if (flag == "--granule") o.granule = fa::parse_bytes(v, flag);
    else if (flag == "--methods") o.methods = split(v, ',');
    else if (flag == "--iters") o.iters = static_cast<unsigned>(std::stoul(v));
    else if (flag == "--rate-mbit") o.rate_mbit = std::stod(v);
    else if (flag == "--rail-window") o.rail_window = std::stoul(v);
    else if (flag == "--engine-spin") o.engine_spin = std::stoi(v);
    else if (flag == "--label") o.label = v;
    else if (flag == "--alpha-ms") o.alpha_s = std::stod(v) * 1e-3;
    else throw fa::error("unknown option '" + std::string(flag) + "' (try --help)");
  }
  if (o.gpus < 1) throw fa::error("--gpus G is required (ranks per server)");
  if (o.iters < 1) throw fa::error("--iters must be at least 1");
  if (o.granule < 1) throw fa::error("--granule must be at least 1");
  if (!(o.rate_mbit > 0)) throw fa::error("--rate-mbit must be positive");
  for (const std::string& m : o.methods)
    if (m != "mpi" && m != "isend" && m != "isend-rotated" && !engine_method_of(m))
      throw fa::error("--methods: unknown method '" + m + "' (mpi, isend, isend-rotated, fast, fast-adaptive, or a " +
                      "decomposer, possibly as fast-NAME: " + fa::decomposer_names_text() + "; any of these engine " +
                      "methods with -fi or -fi-wfc for libfabric scale-out)");
#ifndef FASTA2A_HAVE_LIBFABRIC
  for (const std::string& m : o.methods)
    if (const auto e = engine_method_of(m); e && e->fi)
      throw fa::error("--methods: " + m + " needs the libfabric transport, which this cluster_bench is built without");
#endif
  if (o.workload == "megatron" && o.matrix.empty()) throw fa::error("--workload megatron needs --matrix FILE");
  if (o.label.empty()) {
    if (o.workload == "megatron") o.label = "megatron[" + std::to_string(o.index) + "]";
    else if (o.workload == "zipf") o.label = "zipf(" + std::to_string(o.zipf).substr(0, 4) + ")";
    else o.label = o.workload;
  }
  return o;
}

// --- polled collectives -----------------------------------------------------------------------

const fa::wait_policy waiting{};
constexpr std::chrono::milliseconds call_timeout{600000};

void complete(MPI_Request& r, const char* what) {
  const bool done = fa::detail::poll_until(
      [&] {
        int flag = 0;
        MPI_Test(&r, &flag, MPI_STATUS_IGNORE);
        return flag != 0;
      },
      waiting, call_timeout);
  if (!done) throw fa::error(std::string(what) + " did not complete within 10 minutes");
}

void barrier() {
  MPI_Request r;
  MPI_Ibarrier(MPI_COMM_WORLD, &r);
  complete(r, "MPI_Ibarrier");
}

template <class T>
void allreduce(T* values, int count, MPI_Datatype type, MPI_Op op) {
  MPI_Request r;
  MPI_Iallreduce(MPI_IN_PLACE, values, count, type, op, MPI_COMM_WORLD, &r);
  complete(r, "MPI_Iallreduce");
}

double now_s() { // CLOCK_MONOTONIC: one clock for every rank of the machine, and for the sampler
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// --- this rank's buffers ----------------------------------------------------------------------

using layout = fa::packed_layout;

/// The kernel's byte counters of this rank's NIC (when the cluster script named it).
struct nic_counters {
  bool known = false;
  bytes_t tx = 0, rx = 0;
};

nic_counters read_nic() {
  nic_counters c;
  const char* nic = std::getenv("FASTA2A_NIC");
  if (!nic) return c;
  const std::string base = std::string("/sys/class/net/") + nic + "/statistics/";
  std::ifstream tx(base + "tx_bytes"), rx(base + "rx_bytes");
  if (tx >> c.tx && rx >> c.rx) c.known = true;
  return c;
}

/// What one method measured.
struct result {
  std::string method;
  std::vector<double> times;                        // per timed call: last rank's end - first rank's start
  std::vector<std::pair<double, double>> windows;   // per timed call: [start, end], CLOCK_MONOTONIC
  double median = 0;
  std::size_t stages = 0;
  bytes_t checked = 0;                              // received bytes checked, all ranks and calls
  bool nic_known = false;
  std::vector<double> nic_tx, nic_rx;               // per rank, bytes per timed call
  fa::call_stats stats{};                           // rank 0's breakdown of the last call
  std::string executed;                             // the plan that ran: its decomposer ("direct" if adaptive chose it)
  std::string transport = "mpi";                    // the scale-out transport (libfabric: its describe())
};

class bench {
public:
  bench(const options& o, const fa::traffic_matrix& t, rank_t me, rank_t n)
      : o_(o), t_(t), me_(me), n_(n), l_(t, me), send_(l_.send_bytes), recv_(l_.recv_bytes) {
    l_.fill(send_, me);
  }

  /// One warm-up and o.iters timed calls of `call`, each received byte of each call checked.
  result measure(const std::string& method, const std::function<void()>& call,
                 const std::function<std::size_t()>& stages = {}, const std::function<fa::call_stats()>& stats = {}) {
    result r;
    r.method = method;
    nic_counters before{}, after{};
    bytes_t checked = 0;
    for (unsigned c = 0; c <= o_.iters; ++c) { // call 0 is the warm-up
      std::fill(recv_.begin(), recv_.end(), std::byte{0});
      barrier();
      if (c == 1) before = read_nic();
      double span[2] = {-now_s(), 0};
      call();
      span[1] = now_s();
      allreduce(span, 2, MPI_DOUBLE, MPI_MAX); // -(earliest start), latest end
      if (c > 0) {
        r.times.push_back(span[1] + span[0]);
        r.windows.emplace_back(-span[0], span[1]);
      }
      bytes_t bad = l_.mismatches(recv_, me_);
      allreduce(&bad, 1, MPI_UINT64_T, MPI_SUM);
      if (bad != 0) {
        if (me_ == 0)
          std::fprintf(stderr, "cluster_bench: error: %s delivered %llu wrong bytes in call %u\n", method.c_str(),
                       static_cast<unsigned long long>(bad), c);
        std::fflush(stderr);
        MPI_Abort(MPI_COMM_WORLD, 1);
      }
      checked += l_.recv_bytes;
    }
    barrier();
    after = read_nic();
    std::vector<double> times = r.times;
    std::sort(times.begin(), times.end());
    r.median = times.size() % 2 ? times[times.size() / 2]
                                : (times[times.size() / 2 - 1] + times[times.size() / 2]) / 2;
    allreduce(&checked, 1, MPI_UINT64_T, MPI_SUM);
    r.checked = checked;
    if (stages) r.stages = stages();
    if (stats) r.stats = stats();
    int known = before.known && after.known ? 1 : 0;
    allreduce(&known, 1, MPI_INT, MPI_MIN);
    r.nic_known = known != 0;
    if (r.nic_known) {
      std::vector<double> tx(n_, 0), rx(n_, 0);
      tx[me_] = static_cast<double>(after.tx - before.tx) / o_.iters;
      rx[me_] = static_cast<double>(after.rx - before.rx) / o_.iters;
      allreduce(tx.data(), n_, MPI_DOUBLE, MPI_SUM);
      allreduce(rx.data(), n_, MPI_DOUBLE, MPI_SUM);
      r.nic_tx = tx;
      r.nic_rx = rx;
    }
    return r;
  }

  result run_mpi() {
    const auto ints = [](const std::vector<std::uint64_t>& v) {
      std::vector<int> out;
      for (std::uint64_t x : v) {
        if (x > static_cast<std::uint64_t>(INT_MAX)) throw fa::error("MPI_Alltoallv: a count or displacement passes INT_MAX");
        out.push_back(static_cast<int>(x));
      }
      return out;
    };
    const std::vector<int> sc = ints(l_.send_counts), sd = ints(l_.send_displs), rc = ints(l_.recv_counts),
                           rd = ints(l_.recv_displs);
    return measure("mpi_alltoallv", [&] {
      MPI_Request req;
      MPI_Ialltoallv(send_.data(), sc.data(), sd.data(), MPI_BYTE, recv_.data(), rc.data(), rd.data(), MPI_BYTE,
                     MPI_COMM_WORLD, &req);
      complete(req, "MPI_Ialltoallv");
    });
  }

  /// Point-to-point all-to-allv, every request polled to completion: posted in rank order, or
  /// rotated (rank me+1 first), to tell the effect of the order in which transfers are posted.
  result run_isend(bool rotated) {
    std::vector<MPI_Request> reqs(2 * static_cast<std::size_t>(n_));
    return measure(rotated ? "isend-rotated" : "isend", [&] {
      for (rank_t k = 0; k < n_; ++k) {
        const rank_t i = rotated ? (me_ + n_ - 1 - k) % n_ : k;
        MPI_Irecv(recv_.data() + l_.recv_displs[i], static_cast<int>(l_.recv_counts[i]), MPI_BYTE, i, 7,
                  MPI_COMM_WORLD, &reqs[k]);
      }
      for (rank_t k = 0; k < n_; ++k) {
        const rank_t j = rotated ? (me_ + 1 + k) % n_ : k;
        MPI_Isend(send_.data() + l_.send_displs[j], static_cast<int>(l_.send_counts[j]), MPI_BYTE, j, 7,
                  MPI_COMM_WORLD, &reqs[n_ + k]);
      }
      const bool done = fa::detail::poll_until(
          [&] {
            int flag = 0;
            MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &flag, MPI_STATUSES_IGNORE);
            return flag != 0;
          },
          waiting, call_timeout);
      if (!done) throw fa::error("point-to-point all-to-allv did not complete within 10 minutes");
    });
  }

  /// The engine with decomposer D: scale-up over the MPI transport, scale-out over the MPI
  /// transport or (fi) the libfabric transport.
  template <fa::Decomposer D>
  result run_engine(const std::string& method, D dec, std::optional<double> direct_if_faster_alpha, bool fi, bool wfc,
                    bool cut, const engine_method& em) {
    staging_ = em.staging_given ? em.staging_fraction : fa::engine_options{}.staging_fraction;
    slots_ = em.staging_slots ? em.staging_slots : fa::plan_options{}.staging_slots;
    fa::mpi_bootstrap boot(MPI_COMM_WORLD);
    fa::mpi_transport tr(MPI_COMM_WORLD, {.avoid_tcp_put_pipeline = cut});
    if (me_ == 0 && tr.max_message_bytes() < (std::size_t{1} << 30))
      std::fprintf(stderr, "cluster_bench: %s: the MPI transport cuts its messages at %zu bytes\n", method.c_str(),
                   tr.max_message_bytes());
    if (!fi) return run_engine_on(method, std::move(dec), direct_if_faster_alpha, boot, tr, tr);
#ifdef FASTA2A_HAVE_LIBFABRIC
    fa::libfabric_options fo;
    if (wfc) fo.ordering = fa::fi_signal_ordering::wait_for_completion;
    fo.timeout = call_timeout;
    fa::libfabric_transport fab(boot, fo);
    if (me_ == 0) std::fprintf(stderr, "cluster_bench: %s: scale-out over %s\n", method.c_str(), fab.describe().c_str());
    // Both tiers need this rank's progress (MPI's shared memory: the receiver copies; tcp;ofi_rxm:
    // manual progress): while the engine blocks in the MPI transport, libfabric is driven too.
    auto pump = fab.connect(1);
    fa::progress_coupled<fa::mpi_transport> up(
        tr, n_, [&] { pump.test(me_, 0, std::numeric_limits<std::uint64_t>::max()); }, fa::wait_policy{}, call_timeout);
    result r = run_engine_on(method, std::move(dec), direct_if_faster_alpha, boot, up, fab);
    r.transport = fab.describe();
    fab.quiesce();
    barrier(); // every rank has drained its endpoint before any closes it
    return r;
#else
    static_cast<void>(wfc);
    throw fa::error(method + ": built without the libfabric transport");
#endif
  }

  fa::wait_policy engine_waiting() const {
    fa::wait_policy w;
    if (o_.engine_spin >= 0) w.spin = w.yields = o_.engine_spin;
    return w;
  }

  template <fa::Decomposer D, class Up, class Out>
  result run_engine_on(const std::string& method, D dec, std::optional<double> direct_if_faster_alpha,
                       fa::mpi_bootstrap& boot, Up& tr, Out& out) {
    // The engine's model sees this network: the shaped NIC rate (what best-of and adaptive
    // choices weigh), scale-up left at the H200 default (shared memory is far faster than a NIC).
    const double b_out = o_.rate_mbit * 1e6 / 8;
    const fa::two_tier_topology topo(n_ / o_.gpus, o_.gpus, fa::link_model{fa::scaleup_kind::switch_fabric, 450e9, b_out});
    // Each engine has its own transports (run_engine makes them): a transport counts signals over
    // its lifetime, an engine over its own calls.
    fa::engine<fa::two_tier_topology, fa::mpi_bootstrap, Up, Out, D> eng(
        topo, boot, tr, out,
        {.planning = {.granule = o_.granule, .direct_if_faster_alpha = direct_if_faster_alpha, .staging_slots = slots_},
         .timeout = call_timeout,
         .rail_window = o_.rail_window,
         .waiting = engine_waiting(),
         .staging_fraction = staging_,
         // The timed calls repeat one matrix: each plans, as a runtime's new matrix would
         // (engine_options::reuse_plans would plan the first and reuse it).
         .reuse_plans = false},
        std::move(dec));
    result r = measure(
        method,
        [&] {
          eng.alltoallv(std::span<const std::byte>(send_), l_.send_counts, l_.send_displs, std::span<std::byte>(recv_),
                        l_.recv_counts, l_.recv_displs);
        },
        [&] { return eng.last_plan().stages(); }, [&] { return eng.last_stats(); });
    r.executed = eng.last_plan().decomposer;
    barrier(); // nobody frees its transport while a peer may still flush towards it
    return r;
  }

private:
  const options& o_;
  const fa::traffic_matrix& t_;
  rank_t me_, n_;
  layout l_;
  std::vector<std::byte> send_, recv_;
  std::optional<double> staging_; // the engine's staging_fraction for the method being run
  std::uint32_t slots_ = 4;       // and its plan_options::staging_slots
};

int run(int argc, char** argv) {
  int me = 0, n = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  const options o = parse(argc, argv);
  if (n % o.gpus != 0)
    throw fa::error(std::to_string(n) + " ranks are not a whole number of servers of " + std::to_string(o.gpus));
  const int S = n / o.gpus, G = o.gpus;
  const fa::traffic_matrix t = fa::cluster::make_traffic(o, n);

  // Lower bounds with the shaped NIC's rate (payload bytes; the wire also carries headers).
  const double b_out = o.rate_mbit * 1e6 / 8;
  const fa::two_tier_topology lb_topo(S, G, fa::link_model{fa::scaleup_kind::switch_fabric, 1e12, b_out});
  const double lb_server = fa::lower_bound(lb_topo, t).scaleout_s;
  bytes_t gpu_max = 0, inter = 0, total = 0;
  for (rank_t r = 0; r < n; ++r) {
    bytes_t out = 0, in = 0;
    for (rank_t j = 0; j < n; ++j) {
      total += t(r, j);
      if (r / G != j / G) {
        out += t(r, j);
        in += t(j, r);
        inter += t(r, j);
      }
    }
    gpu_max = std::max({gpu_max, out, in});
  }
  const double lb_gpu = static_cast<double>(gpu_max) / b_out;

  // The engine's decomposers model this network: the shaped NIC rate and --alpha-ms. quantized
  // searches for its quantum (several decompositions per plan), as in the recorded results: the
  // benchmark compares schedules, and reports planning time apart (plan_s).
  const fa::decomposer_params dp{.scaleout = {.alpha_s = o.alpha_s, .bandwidth = b_out}, .quantum = fa::quantum_rule::search};
  bench b(o, t, me, n);
  // Whether Open MPI's TCP transport runs its emulated-RDMA "put" pipeline (btl_tcp_flags), which
  // the MPI transport's sleeping receivers stall: said at start-up and kept in every JSON line.
  const std::optional<fa::mpi_tcp_settings> tcp = fa::mpi_btl_tcp_settings();
  const std::string tcp_put = !tcp ? "unknown" : tcp->put ? "yes" : "no";
  if (me == 0) {
    const std::string note = fa::mpi_transport_setting_note();
    if (!note.empty()) std::fprintf(stderr, "cluster_bench: note: %s\n", note.c_str());
  }
  std::vector<result> results;
  for (const std::string& m : o.methods) {
    if (me == 0) std::fprintf(stderr, "cluster_bench: %s: %s ...\n", o.label.c_str(), m.c_str());
    if (m == "mpi") results.push_back(b.run_mpi());
    else if (m == "isend" || m == "isend-rotated") results.push_back(b.run_isend(m == "isend-rotated"));
    else {
      const engine_method e = *engine_method_of(m); // parse checked every method
      const std::optional<double> direct_if_faster_alpha =
          e.adaptive ? std::optional<double>(dp.scaleout.alpha_s) : std::nullopt;
      results.push_back(fa::with_decomposer(e.decomposer, dp, [&](auto dec) {
        return b.run_engine(m, std::move(dec), direct_if_faster_alpha, e.fi, e.wfc, e.cut, e);
      }));
    }
  }
  if (me != 0) return 0;
  double mpi_median = NAN;
  for (const result& r : results)
    if (r.method == "mpi_alltoallv") mpi_median = r.median;
  for (const result& r : results) {
    // One JSON object per method: bench_cluster.sh and nic_svg.py read these lines.
    std::string line;
    fa::json_writer js(line);
    js.begin_object()
        .field("workload", o.label)
        .field("method", r.method)
        .field("servers", S)
        .field("gpus", G)
        .field("ranks", n)
        .field("rate_mbit", o.rate_mbit)
        .field("bytes", total)
        .field("inter_server_bytes", inter)
        .field("lb_server_s", lb_server)
        .field("lb_gpu_s", lb_gpu)
        .field("iters", o.iters)
        .field("median_s", r.median)
        .field("per_lb_server", r.median / lb_server)
        .field("per_lb_gpu", r.median / lb_gpu)
        .field("speedup_vs_mpi", mpi_median / r.median)
        .field("stages", r.stages)
        .field("bytes_checked", r.checked)
        .field("times_s", r.times);
    js.key("windows").begin_array();
    for (const auto& [start, end] : r.windows) js.begin_array().value(start).value(end).end_array();
    js.end_array();
    // Per NIC, bytes per call; null where the NICs' counters could not be read.
    using counts = std::optional<std::vector<double>>;
    js.field("nic_tx_bytes", r.nic_known ? counts(r.nic_tx) : std::nullopt)
        .field("nic_rx_bytes", r.nic_known ? counts(r.nic_rx) : std::nullopt)
        .field("plan_s", r.stats.plan_s)
        .field("exchange_s", r.stats.exchange_s)
        .field("execute_s", r.stats.execute_s)
        .field("credit_wait_rail_s", r.stats.credit_wait_rail_s)
        .field("credit_wait_balance_s", r.stats.credit_wait_balance_s)
        .field("executed", r.executed)
        .field("scaleout_transport", r.transport)
        .field("btl_tcp_put", tcp_put)
        .end_object();
    std::printf("%s\n", line.c_str());
    std::fprintf(stderr, "cluster_bench: %-14s %-14s median %8.3f s  %5.2fx LB_server  %5.2fx LB_gpu  %5.2fx vs MPI\n",
                 o.label.c_str(), r.method.c_str(), r.median, r.median / lb_server, r.median / lb_gpu,
                 mpi_median / r.median);
  }
  std::fflush(stdout);
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  return fasta2a::run_mpi_program(argc, argv, "cluster_bench", [&] { return run(argc, argv); });
}
