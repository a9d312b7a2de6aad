// bench_mpi: the fasta2a engine (FAST plan, Birkhoff stages) over the MPI transport against
// MPI_Alltoallv, on the same processes, buffers and traffic. Run under mpirun; rank 0 prints.
//
//   mpirun -np 16 bench_mpi --gpus 4 [--iters 5] [--min-bytes 4K] [--max-bytes 16M] [--max-sleep-us 200]
//
// Sizes are per-pair means: every rank sends size x ranks bytes in all, spread uniformly or with
// Zipf(1.0) popularity. Times are wall time per call, the slowest rank's, median of --iters calls
// after one warm-up (whose received bytes are checked). MPI_Ialltoallv (polled) is MPI's own
// all-to-allv waited on as the engine waits (poll, then sleep): Open MPI's blocking collectives
// spin, which on few cores shared by many ranks slows everyone down.
#include <fasta2a/engine.hpp>
#include <fasta2a/mpi.hpp>
#include <fasta2a/pattern.hpp>
#include <fasta2a/traffic.hpp>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <string_view>
#include <vector>

namespace {

namespace fa = fasta2a;
using clock_type = std::chrono::steady_clock;

struct bench_options {
  int gpus = 0; // 0: 4 if it divides the process count, else the whole count on one server
  int iters = 5;
  std::uint64_t min_bytes = 4096;
  std::uint64_t max_bytes = std::uint64_t{16} << 20;
  fa::wait_policy waiting{};
};

std::uint64_t parse_size(std::string_view flag, std::string_view text) {
  const std::uint64_t v = fa::parse_bytes(text, flag);
  if (v == 0) throw fa::error(std::string(flag) + " expects a positive size such as 4K or 16M, got '" + std::string(text) + "'");
  return v;
}

bench_options parse(int argc, char** argv) {
  bench_options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    const auto value = [&]() -> std::string_view {
      if (i + 1 >= argc) throw fa::error("option " + std::string(a) + " needs a value");
      return argv[++i];
    };
    if (a == "--gpus") o.gpus = static_cast<int>(parse_size(a, value()));
    else if (a == "--iters") o.iters = static_cast<int>(parse_size(a, value()));
    else if (a == "--min-bytes") o.min_bytes = parse_size(a, value());
    else if (a == "--max-bytes") o.max_bytes = parse_size(a, value());
    else if (a == "--max-sleep-us") o.waiting.max_sleep = std::chrono::microseconds(parse_size(a, value()));
    else if (a == "--help" || a == "-h") {
      std::puts("usage: mpirun -np N bench_mpi [--gpus G] [--iters N] [--min-bytes 4K] [--max-bytes 16M] [--max-sleep-us 200]");
      std::exit(0);
    } else throw fa::error("unknown option '" + std::string(a) + "'");
  }
  return o;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

/// The slowest rank's value.
double max_over_ranks(double x) {
  double m = 0;
  MPI_Allreduce(&x, &m, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return m;
}

/// One rank's buffers and counts for a traffic matrix of bytes, messages packed in rank order
/// (fasta2a::packed_layout), with the int arrays MPI's interface takes.
struct buffers : fa::packed_layout {
  std::vector<int> isc, isd, irc, ird;
  std::vector<std::byte> send, recv;
  bool fits_int = true;
  buffers(const fa::traffic_matrix& t, int me) : fa::packed_layout(t, me), send(send_bytes), recv(recv_bytes) {
    fits_int = send_bytes <= INT_MAX && recv_bytes <= INT_MAX;
    for (std::size_t j = 0; j < send_counts.size() && fits_int; ++j) {
      isc.push_back(static_cast<int>(send_counts[j]));
      isd.push_back(static_cast<int>(send_displs[j]));
      irc.push_back(static_cast<int>(recv_counts[j]));
      ird.push_back(static_cast<int>(recv_displs[j]));
    }
    fill(send, me);
  }
};

/// Throws unless every received byte is what its sender's pattern says (checked on every rank).
void check_received(const buffers& b, int me, const char* who) {
  std::uint64_t bad = b.mismatches(b.recv, me), all = 0;
  MPI_Allreduce(&bad, &all, 1, MPI_UINT64_T, MPI_SUM, MPI_COMM_WORLD);
  if (all != 0) throw fa::error(std::string(who) + " delivered " + std::to_string(all) + " wrong bytes");
}

/// Median (over iterations after a warm-up) of the slowest rank's time for `call`; the warm-up's
/// bytes are checked.
template <class Call>
double time_calls(buffers& b, int me, int iters, const char* who, Call&& call, std::vector<double>* shares = nullptr) {
  std::fill(b.recv.begin(), b.recv.end(), std::byte{0});
  call();
  check_received(b, me, who);
  std::vector<double> times;
  for (int k = 0; k < iters; ++k) {
    MPI_Barrier(MPI_COMM_WORLD);
    const auto t0 = clock_type::now();
    const double share = call();
    const double s = std::chrono::duration<double>(clock_type::now() - t0).count();
    times.push_back(max_over_ranks(s));
    if (shares) shares->push_back(share);
  }
  return median(times);
}

using mpi_engine = fa::engine<fa::two_tier_topology, fa::mpi_bootstrap, fa::mpi_transport, fa::mpi_transport>;

int run(int argc, char** argv) {
  const bench_options o = parse(argc, argv);
  int me = 0, n = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  const int G = o.gpus > 0 ? o.gpus : (n % 4 == 0 ? 4 : n);
  const fa::two_tier_topology topo = fa::mpi_world_topology(G);
  fa::mpi_bootstrap boot(MPI_COMM_WORLD, {.timeout = std::chrono::minutes(2), .waiting = o.waiting});
  fa::mpi_transport tr(MPI_COMM_WORLD, {.waiting = o.waiting, .flush_timeout = std::chrono::minutes(2)});
  mpi_engine eng(topo, boot, tr, tr, {.timeout = std::chrono::minutes(2)});
  const fa::wait_policy waiting = o.waiting;

  if (me == 0) {
    std::printf("# bench_mpi: %d ranks as %d servers x %d (engine: FAST, birkhoff; one mpi_transport for "
                "scale-up and scale-out)\n",
                n, topo.servers(), G);
    std::printf("# times: slowest rank's wall time per call, median of %d after a warm-up whose bytes are "
                "checked; GB/s = all bytes of the matrix / time\n",
                o.iters);
    std::printf("# overhead = (plan_s + exchange_s) / total_s of the engine, mean over ranks, median over calls; "
                "waiting sleeps up to %lld us\n",
                static_cast<long long>(o.waiting.max_sleep.count()));
    std::printf("# plan: rank 0's planning time; exchange: the two allgathers, least and mean over ranks (the "
                "mean includes waiting for late ranks)\n");
    std::printf("%9s %8s %10s %10s %10s %8s %8s %8s %7s %9s %9s %9s\n", "per pair", "traffic", "engine", "Alltoallv",
                "Ialltoallv", "engine/", "engine", "MPI", "plan", "exchange", "exchange", "overhead");
    std::printf("%9s %8s %10s %10s %10s %8s %8s %8s %7s %9s %9s %9s\n", "", "", "ms", "ms", "polled ms", "Alltoallv",
                "GB/s", "GB/s", "us", "least us", "mean us", "");
  }
  for (std::uint64_t size = o.min_bytes; size <= o.max_bytes; size *= 4) {
    for (const char* workload : {"uniform", "zipf1.0"}) {
      const std::uint64_t per_rank = size * static_cast<std::uint64_t>(n);
      const fa::traffic_matrix t = std::string_view(workload) == "uniform" ? fa::uniform_traffic(n, per_rank, 0)
                                                                             : fa::zipf_traffic(n, 1.0, per_rank, 7);
      buffers b(t, me);
      std::vector<double> shares, plan_us, exchange_us;
      const double engine_s = time_calls(b, me, o.iters, "the engine", [&] {
        eng.alltoallv(b.send, b.send_counts, b.send_displs, b.recv, b.recv_counts, b.recv_displs);
        const fa::call_stats& st = eng.last_stats();
        plan_us.push_back(st.plan_s * 1e6);
        exchange_us.push_back(st.exchange_s * 1e6);
        return st.total_s > 0 ? (st.plan_s + st.exchange_s) / st.total_s : 0.0;
      }, &shares);
      plan_us.erase(plan_us.begin()); // the warm-up (which also grows the staging buffer)
      exchange_us.erase(exchange_us.begin());
      // Mean over ranks of each call's overhead share, then the median over calls.
      std::vector<double> share_mean(shares.size());
      MPI_Allreduce(shares.data(), share_mean.data(), static_cast<int>(shares.size()), MPI_DOUBLE, MPI_SUM,
                    MPI_COMM_WORLD);
      for (double& s : share_mean) s /= n;
      // A rank's exchange time includes waiting for the last rank to arrive (ranks leave the
      // barrier before the call up to milliseconds apart when they share few cores); the rank that
      // waits least shows what the two allgathers themselves cost.
      std::vector<double> exchange_min(exchange_us.size());
      MPI_Allreduce(exchange_us.data(), exchange_min.data(), static_cast<int>(exchange_us.size()), MPI_DOUBLE,
                    MPI_MIN, MPI_COMM_WORLD);
      std::vector<double> exchange_mean(exchange_us.size());
      MPI_Allreduce(exchange_us.data(), exchange_mean.data(), static_cast<int>(exchange_us.size()), MPI_DOUBLE,
                    MPI_SUM, MPI_COMM_WORLD);
      for (double& x : exchange_mean) x /= n;

      // A count past INT_MAX is beyond MPI_Alltoallv's int interface: those rows show no MPI time.
      int fits = b.fits_int ? 1 : 0, all_fit = 0;
      MPI_Allreduce(&fits, &all_fit, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
      double mpi_s = 0, impi_s = 0;
      if (all_fit) {
        mpi_s = time_calls(b, me, o.iters, "MPI_Alltoallv", [&] {
          MPI_Alltoallv(b.send.data(), b.isc.data(), b.isd.data(), MPI_BYTE, b.recv.data(), b.irc.data(),
                        b.ird.data(), MPI_BYTE, MPI_COMM_WORLD);
          return 0.0;
        });
        impi_s = time_calls(b, me, o.iters, "MPI_Ialltoallv", [&] {
          MPI_Request req;
          MPI_Ialltoallv(b.send.data(), b.isc.data(), b.isd.data(), MPI_BYTE, b.recv.data(), b.irc.data(),
                         b.ird.data(), MPI_BYTE, MPI_COMM_WORLD, &req);
          fa::detail::poll_until(
              [&] {
                int flag = 0;
                MPI_Test(&req, &flag, MPI_STATUS_IGNORE);
                return flag != 0;
              },
              waiting, std::chrono::minutes(10));
          return 0.0;
        });
      }
      if (me == 0) {
        const double total = static_cast<double>(t.sum());
        const std::string label = size >= (1u << 20) ? std::to_string(size >> 20) + " MiB"
                                                     : std::to_string(size >> 10) + " KiB";
        std::printf("%9s %8s %10.3f %10.3f %10.3f %8.2f %8.2f %8.2f %7.1f %9.1f %9.1f %8.1f%%\n", label.c_str(),
                    workload, engine_s * 1e3, mpi_s * 1e3, impi_s * 1e3, mpi_s > 0 ? engine_s / mpi_s : 0.0,
                    total / engine_s / 1e9, mpi_s > 0 ? total / mpi_s / 1e9 : 0.0, median(plan_us),
                    median(exchange_min), median(exchange_mean), 100 * median(share_mean));
        std::fflush(stdout);
      }
    }
  }
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  return fasta2a::run_mpi_program(argc, argv, "bench_mpi", [&] { return run(argc, argv); });
}
