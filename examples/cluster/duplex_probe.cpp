// fasta2a: a diagnostic of the emulated cluster's network, no engine involved. Every rank (s, k)
// sends B bytes along its rail, to rank k of another server, in one of two patterns with the same
// bytes per NIC in each direction:
//   swap   server s <-> server s ^ 1: both directions of each flow share one TCP connection
//   cycle  server s -> server s + 1: every connection carries one direction only
// and, where the servers are a multiple of 4, each of them as two concurrent half-size flows. It shows what a staged
// schedule pays on this network for a stage whose permutation pairs servers both ways (Birkhoff's
// stages on uniform traffic are such involutions): Open MPI's TCP transport uses one connection
// per pair of processes, both directions.
//
//   cluster.sh run -- duplex_probe --gpus 4 [--bytes 8MiB] [--iters 4] [--rate-mbit 200]
//
// Prints one line per pattern: the median time, and its ratio to B / rate (the NIC's bound).
// Every received byte is checked against the sender's pattern.
#include <mpi.h>

#include <fasta2a/common.hpp>
#include <fasta2a/mpi.hpp>
#include <fasta2a/pattern.hpp>
#include <fasta2a/transport.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

namespace fa = fasta2a;

namespace {

struct options {
  int gpus = 0;
  std::size_t bytes = std::size_t{8} << 20;
  int iters = 4;
  double rate_mbit = 200;
};

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view flag = argv[i];
    if (i + 1 >= argc) throw fa::error("option " + std::string(flag) + " needs a value");
    const std::string v = argv[++i];
    if (flag == "--gpus") o.gpus = std::stoi(v);
    else if (flag == "--bytes") o.bytes = fa::parse_bytes(v, flag);
    else if (flag == "--iters") o.iters = std::stoi(v);
    else if (flag == "--rate-mbit") o.rate_mbit = std::stod(v);
    else throw fa::error("unknown option '" + std::string(flag) + "'");
  }
  if (o.gpus < 1) throw fa::error("--gpus G is required (ranks per server)");
  if (o.iters < 1) throw fa::error("--iters must be at least 1");
  if (o.bytes < 2 || o.bytes > static_cast<std::size_t>(1) << 30) throw fa::error("--bytes must be 2 bytes to 1 GiB");
  return o;
}

int run(int argc, char** argv) {
  const options o = parse(argc, argv);
  int me = 0, n = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  const int G = o.gpus, S = n / G, s = me / G, k = me % G;
  if (n % G != 0 || S < 2 || S % 2 != 0)
    throw fa::error("needs an even number of servers, at least 2 (" + std::to_string(n) + " ranks, --gpus " +
                    std::to_string(G) + ")");
  const std::size_t B = o.bytes, half = B / 2;
  std::vector<std::byte> send(B), recv(B);
  const fa::wait_policy waiting{};
  struct pattern {
    const char* name;
    int to[2], from[2]; // servers; to[1] < 0: one flow of B bytes
  };
  std::vector<pattern> patterns = {
      {"swap", {s ^ 1, -1}, {s ^ 1, -1}},
      {"cycle", {(s + 1) % S, -1}, {(s + S - 1) % S, -1}},
  };
  if (S % 4 == 0) { // two distinct partners each way
    patterns.push_back({"two swaps", {s ^ 1, s ^ 2}, {s ^ 1, s ^ 2}});
    patterns.push_back({"two cycles", {(s + 1) % S, (s + 2) % S}, {(s + S - 1) % S, (s + S - 2) % S}});
  }
  for (const pattern& p : patterns) {
    const int flows = p.to[1] < 0 ? 1 : 2;
    const std::size_t len[2] = {flows == 1 ? B : half, B - half};
    std::vector<double> times;
    std::uint64_t wrong = 0;
    for (int it = 0; it <= o.iters; ++it) { // iteration 0 warms up
      for (int f = 0; f < flows; ++f) {
        const int dst = p.to[f] * G + k;
        fa::fill_pattern(std::span(send).subspan(f ? half : 0, len[f]), me, dst);
      }
      std::fill(recv.begin(), recv.end(), std::byte{0});
      MPI_Barrier(MPI_COMM_WORLD);
      const auto t0 = std::chrono::steady_clock::now();
      std::vector<MPI_Request> req(2 * flows, MPI_REQUEST_NULL);
      for (int f = 0; f < flows; ++f)
        MPI_Irecv(recv.data() + (f ? half : 0), static_cast<int>(len[f]), MPI_BYTE, p.from[f] * G + k, f, MPI_COMM_WORLD, &req[f]);
      for (int f = 0; f < flows; ++f)
        MPI_Isend(send.data() + (f ? half : 0), static_cast<int>(len[f]), MPI_BYTE, p.to[f] * G + k, f, MPI_COMM_WORLD,
                  &req[flows + f]);
      fa::detail::poll_until(
          [&] {
            int done = 0;
            MPI_Testall(static_cast<int>(req.size()), req.data(), &done, MPI_STATUSES_IGNORE);
            return done != 0;
          },
          waiting, std::chrono::minutes(10));
      double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), slowest = 0;
      MPI_Allreduce(&t, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      for (int f = 0; f < flows; ++f)
        wrong += fa::pattern_mismatches(std::span<const std::byte>(recv).subspan(f ? half : 0, len[f]), p.from[f] * G + k, me);
      if (it > 0) times.push_back(slowest);
    }
    std::uint64_t all_wrong = 0;
    MPI_Allreduce(&wrong, &all_wrong, 1, MPI_UINT64_T, MPI_SUM, MPI_COMM_WORLD);
    std::sort(times.begin(), times.end());
    const double median = times[times.size() / 2], bound = static_cast<double>(B) * 8 / (o.rate_mbit * 1e6);
    if (me == 0)
      std::printf("duplex_probe: %-10s %d flow(s) per NIC, %zu bytes each way: median %.3f s = %.2fx the NIC bound, "
                  "%llu wrong bytes\n",
                  p.name, flows, B, median, median / bound, static_cast<unsigned long long>(all_wrong));
    if (all_wrong != 0) return 1;
  }
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  return fasta2a::run_mpi_program(argc, argv, "duplex_probe", [&] { return run(argc, argv); });
}
