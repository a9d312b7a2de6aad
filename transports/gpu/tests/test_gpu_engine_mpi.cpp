// The engine with the GPU IPC transport for scale-up and the MPI transport for scale-out, one
// process per rank, on the stand-in GPU runtime (device memory in POSIX shared memory, so IPC
// handles open across processes; streams as threads with random delays): stream-ordered
// all-to-allvs from device buffers, byte-exact against MPI_Alltoallv on the same data. MPI is not
// CUDA-aware, so rail data bounces through host mirrors. Checks ordering and bookkeeping, never
// performance.
//
//   mpirun -np N test_gpu_engine_mpi GPUS_PER_SERVER SEEDS [FIRST_SEED]
//   mpirun -np N test_gpu_engine_mpi GPUS_PER_SERVER bench [MAX_BYTES_PER_PAIR]   (timings)
//
// Built without FASTA2A_GPU_STANDIN (gpu_engine_mpi_cuda) the same source runs on the real CUDA
// runtime: every rank a process on one GPU, scale-up through CUDA IPC.
//
// Each seed: a skewed matrix, the stand-in's delays (0 to 400 us per stream operation), a
// decomposer (staged or direct), three calls queued on the caller's stream before it is
// synchronised, the second into the same receive buffer as the first (its bytes copied out in
// stream order in between, so a peer that writes too early is caught). Exit 0: all correct; 1: a
// wrong byte or an error; 77: MPI gives no MPI_THREAD_MULTIPLE (the engine's proxy thread calls
// MPI while the caller's thread exchanges counts).
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include <fasta2a/engine.hpp>
#include <fasta2a/gpu_ipc.hpp>
#include <fasta2a/gpu_memory.hpp>
#include <fasta2a/mpi.hpp>

#include "conformance/engine_checks.hpp"

namespace {

using namespace fasta2a;
using ipc = gpu_ipc_transport<mpi_bootstrap>;
static_assert(StreamMemorySpace<gpu_memory>);
static_assert(!mpi_transport::can_register(memory_kind::cuda_device));

struct rank_data {
  std::vector<std::uint64_t> sc, sd, rc, rd; // elements
  std::vector<std::byte> send, expect;       // host: what this rank sends, what MPI_Alltoallv delivers
  std::size_t recv_bytes = 0;
};

// The counts of t for rank r with gaps, random send bytes, and the reference result of
// MPI_Alltoallv on them (the gaps of the reference hold the canary).
rank_data reference(const traffic_matrix& t, rank_t r, std::size_t elem, std::uint64_t seed) {
  const rank_t n = static_cast<rank_t>(t.rows());
  const testing::engine_layout l = testing::engine_layout_of(t, r, elem, 2);
  rank_data d;
  d.sc = l.send_counts, d.sd = l.send_displs, d.rc = l.recv_counts, d.rd = l.recv_displs;
  d.send.resize(l.send_elems * elem);
  std::mt19937_64 rng(seed * 1000003 + static_cast<std::uint64_t>(r));
  for (auto& b : d.send) b = static_cast<std::byte>(rng());
  d.recv_bytes = l.recv_elems * elem;
  d.expect.assign(d.recv_bytes, testing::canary);
  std::vector<int> sc(n), sd(n), rc(n), rd(n);
  for (rank_t j = 0; j < n; ++j) {
    sc[j] = static_cast<int>(d.sc[j] * elem), sd[j] = static_cast<int>(d.sd[j] * elem);
    rc[j] = static_cast<int>(d.rc[j] * elem), rd[j] = static_cast<int>(d.rd[j] * elem);
  }
  MPI_Alltoallv(d.send.data(), sc.data(), sd.data(), MPI_BYTE, d.expect.data(), rc.data(), rd.data(), MPI_BYTE, MPI_COMM_WORLD);
  return d;
}

// Host memory the caller's stream copies from or into: pageable or pinned.
struct host_area {
  std::vector<std::byte> vec;
  gpu::pinned_buffer pin;
  std::byte* p = nullptr;
};

std::size_t wrong_bytes(const host_area& got, const std::vector<std::byte>& want) {
  std::size_t wrong = 0;
  for (std::size_t k = 0; k < want.size(); ++k) wrong += got.p[k] != want[k];
  return wrong;
}

template <class D>
std::size_t run_seed(int G, std::uint64_t seed, std::uint32_t delay_us, std::size_t window) {
  int me = 0, n = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
#ifdef FASTA2A_GPU_STANDIN
  auto& cfg = gpu_standin::settings();
  cfg.max_delay_us = delay_us;
  cfg.seed = seed * 131 + static_cast<std::uint64_t>(me);
  cfg.host_pointers_in_process = false;
#else
  (void)delay_us;
#endif

  mpi_bootstrap boot(MPI_COMM_WORLD, mpi_bootstrap_options{.timeout = std::chrono::seconds(60)});
  gpu_memory mem;
  ipc up(boot, mem.shared_stream(), gpu_ipc_options{.node_ranks = G});
  mpi_transport out(MPI_COMM_WORLD);
  engine_options opt;
  opt.timeout = std::chrono::seconds(20);
  opt.rail_window = window;
  engine<two_tier_topology, mpi_bootstrap, ipc, mpi_transport, D, gpu_memory> eng(two_tier_topology(n / G, G), boot, up, out,
                                                                                   opt, D{}, mem);
  if (!eng.bounces()) throw error("the engine should bounce device memory through the host for MPI");

  std::mt19937_64 rng(seed);
  const std::size_t elem = seed % 3 == 0 ? 4 : 1;
  const traffic_matrix t1 = testing::skewed_traffic(n, rng, elem), t2 = testing::skewed_traffic(n, rng, elem);
  const rank_data a = reference(t1, me, elem, seed), b = reference(t2, me, elem, seed + 7);
  // Call 1 and 2 share the receive buffer R (sized for both); call 3 goes to its own.
  const std::size_t rbytes = std::max(a.recv_bytes, b.recv_bytes);
  gpu::device_buffer s1(a.send.size() + 1), s2(b.send.size() + 1), R(rbytes + 1), R3(a.recv_bytes + 1);
  gpu::stream caller;
  // The caller's host side of its copies: pageable (std::vector, as most callers have), or pinned
  // with FASTA2A_TEST_HOST=pinned. A copy into pageable memory blocks the calling thread until its
  // stream reaches it, i.e. until the engine's call before it has completed.
  const bool pinned = std::getenv("FASTA2A_TEST_HOST") && std::string(std::getenv("FASTA2A_TEST_HOST")) == "pinned";
  auto host = [&](std::size_t len, const std::byte* init) {
    host_area h;
    if (pinned) {
      h.pin = gpu::pinned_buffer(len);
      h.p = h.pin.data();
    } else {
      h.vec.resize(len);
      h.p = h.vec.data();
    }
    if (init) std::copy_n(init, len, h.p);
    else std::fill_n(h.p, len, testing::canary);
    return h;
  };
  const host_area send1 = host(a.send.size(), a.send.data()), send2 = host(b.send.size(), b.send.data());
  const host_area fill = host(rbytes + 1, nullptr);
  host_area got1 = host(a.recv_bytes, nullptr), got2 = host(b.recv_bytes, nullptr), got3 = host(a.recv_bytes, nullptr);
  auto c = [&](void* dst, const void* src, std::size_t len) { gpu::memcpy_async(dst, src, len, caller.get()); };
  c(s1.data(), send1.p, a.send.size());
  c(s2.data(), send2.p, b.send.size());
  c(R.data(), fill.p, rbytes + 1);
  c(R3.data(), fill.p, a.recv_bytes + 1);
  eng.alltoallv(std::span<const std::byte>(s1.data(), a.send.size()), a.sc, a.sd, std::span(R.data(), a.recv_bytes), a.rc, a.rd,
                caller.get(), elem);
  c(got1.p, R.data(), a.recv_bytes); // in stream order: call 2 must not write R before this
  c(R.data(), fill.p, rbytes + 1);
  eng.alltoallv(std::span<const std::byte>(s2.data(), b.send.size()), b.sc, b.sd, std::span(R.data(), b.recv_bytes), b.rc, b.rd,
                caller.get(), elem);
  c(got2.p, R.data(), b.recv_bytes);
  eng.alltoallv(std::span<const std::byte>(s1.data(), a.send.size()), a.sc, a.sd, std::span(R3.data(), a.recv_bytes), a.rc,
                a.rd, caller.get(), elem);
  c(got3.p, R3.data(), a.recv_bytes);
  caller.synchronize();
  eng.synchronize(); // raises an asynchronous error, if any
  const std::size_t wrong = wrong_bytes(got1, a.expect) + wrong_bytes(got2, b.expect) + wrong_bytes(got3, a.expect);
  boot.allgather({}, {}); // every rank is done with every peer's memory before it is freed
  return wrong;
}

// Timings: uniform traffic of `per_pair` bytes (256 B up to max_pair), the median over 10 calls
// (after 3) of the time from the call to its completion on the caller's stream, and the cudaMemcpy
// device-to-device rate of the same bytes on this rank's GPU for comparison. Pairs of 64 KiB and
// more go over MPI's rendezvous protocol: with Open MPI's btl_vader_single_copy_mechanism=none
// (or TCP) a rank's sends move only while it calls MPI, which the engine must keep doing while it
// waits on scale-up signals (the ctest gpu_standin.engine_mpi.progress runs this).
void bench(int G, std::size_t max_pair) {
  int me = 0, n = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  mpi_bootstrap boot(MPI_COMM_WORLD, mpi_bootstrap_options{.timeout = std::chrono::seconds(60)});
  gpu_memory mem;
  ipc up(boot, mem.shared_stream(), gpu_ipc_options{.node_ranks = G});
  mpi_transport out(MPI_COMM_WORLD);
  engine_options opt;
  opt.timeout = std::chrono::seconds(20);
  engine<two_tier_topology, mpi_bootstrap, ipc, mpi_transport, birkhoff_decomposer, gpu_memory> eng(two_tier_topology(n / G, G), boot,
                                                                                                    up, out, opt, {}, mem);
  gpu::stream caller;
  using clock = std::chrono::steady_clock;
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  if (me == 0)
    std::printf("bench: %d ranks, %d per server, scale-up %s IPC, scale-out MPI%s%s\n"
                "bytes/pair  call-to-stream-completion_us  engine_recv_GBps_per_rank  memcpy_D2D_GBps  ratio\n",
                n, G, gpu::runtime_name, eng.bounces() ? " (bounced through host)" : " (direct)",
#ifdef FASTA2A_GPU_STANDIN
                "  [STAND-IN RUNTIME: these are not GPU figures]"
#else
                ""
#endif
    );
  for (std::size_t per_pair : {std::size_t{256}, std::size_t{4096}, std::size_t{65536}, std::size_t{1} << 20, std::size_t{8} << 20}) {
    if (per_pair > max_pair) break;
    const std::size_t total = per_pair * static_cast<std::size_t>(n);
    gpu::device_buffer s(total), r(total), d(total);
    std::vector<std::uint64_t> counts(static_cast<std::size_t>(n), per_pair), displs(static_cast<std::size_t>(n));
    for (int j = 0; j < n; ++j) displs[static_cast<std::size_t>(j)] = per_pair * static_cast<std::size_t>(j);
    std::vector<double> call, copy;
#ifdef FASTA2A_GPU_STANDIN
    std::uint64_t syncs = 0, reads = 0, queries = 0, enq = 0;
#endif
    for (int it = 0; it < 13; ++it) {
      boot.allgather({}, {});
#ifdef FASTA2A_GPU_STANDIN
      auto& cc = gpu_standin::counts();
      const std::uint64_t s0 = cc.synchronize, r0 = cc.read_value, q0 = cc.query, e0 = cc.enqueued;
#endif
      const auto t0 = clock::now();
      eng.alltoallv(std::span<const std::byte>(s.data(), total), counts, displs, std::span(r.data(), total), counts, displs,
                    caller.get());
      caller.synchronize();
      const auto t1 = clock::now();
#ifdef FASTA2A_GPU_STANDIN
      if (it >= 3) syncs += cc.synchronize - s0 - 1, reads += cc.read_value - r0, queries += cc.query - q0, enq += cc.enqueued - e0;
#endif
      gpu::memcpy_async(d.data(), s.data(), total, caller.get());
      caller.synchronize();
      const auto t2 = clock::now();
      if (it >= 3) {
        call.push_back(std::chrono::duration<double>(t1 - t0).count());
        copy.push_back(std::chrono::duration<double>(t2 - t1).count());
      }
    }
    eng.synchronize();
    double c = median(call), m = median(copy), cmax = 0;
    MPI_Allreduce(&c, &cmax, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (me == 0)
      std::printf("%10zu  %12.1f  %10.3f  %10.3f  %8.4f\n", per_pair, cmax * 1e6, static_cast<double>(total) / cmax / 1e9,
                  static_cast<double>(total) / m / 1e9, (static_cast<double>(total) / cmax) / (static_cast<double>(total) / m));
#ifdef FASTA2A_GPU_STANDIN
    if (me == 0)
      std::printf("  rank 0, per call: %.1f stream synchronizes, %.1f flag reads, %.1f event queries, %.1f operations enqueued\n",
                  syncs / 10.0, reads / 10.0, queries / 10.0, enq / 10.0);
#endif
    std::fflush(stdout);
    boot.allgather({}, {});
    eng.forget_buffer(s.data());
    eng.forget_buffer(r.data());
  }
}

} // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int me = 0, n = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  if (provided < MPI_THREAD_MULTIPLE) {
    if (me == 0) std::printf("SKIP: MPI gives no MPI_THREAD_MULTIPLE (the engine's proxy thread calls MPI)\n");
    MPI_Finalize();
    return 77;
  }
  const int G = argc > 1 ? std::atoi(argv[1]) : 2;
  if (argc > 2 && std::string(argv[2]) == "bench") {
    int rc = 0;
    try {
      bench(G, argc > 3 ? std::strtoull(argv[3], nullptr, 10) : std::size_t{8} << 20);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank %d: bench: error: %s\n", me, e.what());
      rc = 1;
    }
    MPI_Finalize();
    return rc;
  }
  const int seeds = argc > 2 ? std::atoi(argv[2]) : 10;
  const std::uint64_t first = argc > 3 ? std::strtoull(argv[3], nullptr, 10) : 1;
  if (G < 1 || n % G != 0) {
    if (me == 0) std::fprintf(stderr, "error: %d ranks are not a whole number of servers of %d\n", n, G);
    MPI_Finalize();
    return 2;
  }
  std::size_t wrong_total = 0;
  int errors = 0, seeds_wrong = 0, ran = 0;
  const std::uint32_t delays[] = {0, 50, 200, 400};
  for (int k = 0; k < seeds; ++k) {
    const std::uint64_t seed = first + static_cast<std::uint64_t>(k);
    const std::uint32_t delay = delays[seed % 4];
    const std::size_t window = 1 + seed % 3;
    std::size_t wrong = 0;
    std::string err;
    try {
      wrong = seed % 2 ? run_seed<birkhoff_decomposer>(G, seed, delay, window) : run_seed<direct_decomposer>(G, seed, delay, window);
    } catch (const std::exception& e) {
      err = e.what();
    }
    unsigned long long w = wrong, wsum = 0;
    int e = err.empty() ? 0 : 1, esum = 0;
    MPI_Allreduce(&w, &wsum, 1, MPI_UNSIGNED_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
    MPI_Allreduce(&e, &esum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (!err.empty()) std::fprintf(stderr, "rank %d seed %llu: error: %s\n", me, static_cast<unsigned long long>(seed), err.c_str());
    if (me == 0)
      std::printf("seed %llu (%s, delays up to %u us, window %zu): %llu bytes wrong, %d ranks with errors\n",
                  static_cast<unsigned long long>(seed), seed % 2 ? "birkhoff, staged" : "direct", delay, window, wsum, esum);
    std::fflush(stdout); // through mpirun's pipe: seen even if a later seed hangs and is killed
    wrong_total += wsum;
    errors += esum;
    seeds_wrong += wsum > 0;
    ++ran;
    if (esum) break; // an engine error leaves MPI state behind: stop here
  }
  if (me == 0)
    std::printf("%s: %d ranks, %d per server, %d seeds from %llu: %zu bytes wrong (under %d of %d seeds), %d errors\n",
                wrong_total == 0 && errors == 0 ? "OK" : "FAIL", n, G, ran, static_cast<unsigned long long>(first), wrong_total,
                seeds_wrong, ran, errors);
  std::fflush(stdout);
  MPI_Finalize();
  return wrong_total == 0 && errors == 0 ? 0 : 1;
}
