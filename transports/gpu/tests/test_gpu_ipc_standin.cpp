// The GPU IPC transport and the GPU memory space over the stand-in GPU runtime (streams as
// threads, device memory in POSIX shared memory, random delays per stream operation): the
// conformance suite on ranks as threads, and the engine byte-exact on device buffers. These check
// ordering and bookkeeping, never performance.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <fasta2a/gpu_ipc.hpp>
#include <fasta2a/gpu_memory.hpp>
#include <fasta2a/host.hpp>

#include "conformance/conformance.hpp"

namespace {

using fasta2a::rank_t;
using ipc = fasta2a::gpu_ipc_transport<fasta2a::host_bootstrap>;
static_assert(fasta2a::Transport<ipc>);
static_assert(fasta2a::MemorySpace<fasta2a::gpu_memory>);
static_assert(ipc::can_register(fasta2a::memory_kind::cuda_device));
// GPU IPC cannot revoke an opened mapping (transport.hpp, RevokesLateWrites); the GPU memory
// space bounces through pinned host memory and runs stream-ordered calls.
static_assert(!fasta2a::RevokesLateWrites<ipc>);
static_assert(fasta2a::PinnedHostAllocation<fasta2a::gpu_memory> && fasta2a::StreamMemorySpace<fasta2a::gpu_memory>);

/// Sets the stand-in's delays (and in-process host handles) for one scope.
struct standin_settings {
  explicit standin_settings(std::uint32_t delay_us, std::uint64_t seed = 1, bool host_pointers = true) {
    auto& c = fasta2a::gpu_standin::settings();
    old = c;
    c.max_delay_us = delay_us;
    c.seed = seed;
    c.host_pointers_in_process = host_pointers;
  }
  ~standin_settings() { fasta2a::gpu_standin::settings() = old; }
  fasta2a::gpu_standin::config old;
};

/// Ranks as threads, each with a gpu_ipc_transport over the stand-in; DelayUs > 0 delays stream
/// operations (and, through the probe, transport calls) by up to DelayUs. The suite's buffers are
/// std::vectors: they register through the stand-in's in-process host handles (no real runtime
/// can), while the flags are stand-in device memory opened through its shared-memory IPC.
template <int DelayUs>
struct gpu_world {
  static constexpr const char* name = DelayUs > 0 ? "GPU IPC over the stand-in, random delays" : "GPU IPC over the stand-in";
  using bootstrap = fasta2a::host_bootstrap;
  using transport = ipc;
  static rank_t ranks(rank_t preferred) { return preferred; }
  static std::size_t chunk_limit() { return 0; }
  static std::chrono::microseconds max_delay() { return std::chrono::microseconds(DelayUs); }

  template <class F>
  static std::vector<std::string> run(rank_t n, F&& f, std::chrono::milliseconds timeout) {
    standin_settings st(DelayUs, 7);
    fasta2a::host_fabric fabric(n, timeout);
    std::vector<std::string> errors(static_cast<std::size_t>(n));
    std::vector<std::thread> threads;
    for (rank_t r = 0; r < n; ++r)
      threads.emplace_back([&, r] {
        try {
          fasta2a::host_bootstrap boot(fabric, r);
          ipc base(boot);
          fasta2a::testing::probe pr = fasta2a::testing::delaying_probe(max_delay(), static_cast<std::uint64_t>(r) * 7919u + DelayUs);
          fasta2a::testing::probed_transport<ipc> tr(base, pr);
          f(r, boot, tr, pr);
        } catch (const std::exception& e) {
          errors[static_cast<std::size_t>(r)] = e.what();
          if (errors[static_cast<std::size_t>(r)].empty()) errors[static_cast<std::size_t>(r)] = "(empty error)";
        }
      });
    for (auto& t : threads) t.join();
    return errors;
  }
};

/// One all-to-allv of t on device buffers from gpu_memory, checked byte for byte (through copies
/// to the host, as on a real device).
/// The buffers are freed only after every rank has finished the call: a peer that has nothing to
/// put into a buffer may open its IPC handle after its owner has finished (an IPC handle of freed
/// memory does not open, on a real runtime as on the stand-in).
template <class Engine>
void device_call_checked(Engine& eng, fasta2a::host_bootstrap& boot, fasta2a::gpu_memory& mem, const fasta2a::traffic_matrix& t,
                         rank_t r, std::size_t elem, bool stream_form = false) {
  using namespace fasta2a;
  using namespace fasta2a::testing;
  const rank_t n = static_cast<rank_t>(t.rows());
  const engine_layout l = engine_layout_of(t, r, elem, 3);
  std::vector<std::byte> send(l.send_elems * elem), recv(l.recv_elems * elem, canary);
  for (rank_t j = 0; j < n; ++j) fill_pattern(std::span(send).subspan(l.send_displs[j] * elem, t(r, j)), r, j);
  auto dsend = mem.allocate(send.size()), drecv = mem.allocate(recv.size());
  gpu::memcpy_async(dsend.data(), send.data(), send.size(), mem.stream());
  gpu::memcpy_async(drecv.data(), recv.data(), recv.size(), mem.stream());
  mem.synchronize();
  if (stream_form) {
    // Stream-ordered: the bytes are written on the caller's stream before the call and read on it
    // after; nothing else synchronises.
    gpu::stream caller;
    const std::vector<std::byte> stale(send.size(), std::byte{0x5A}); // what the engine must not send
    gpu::memcpy_async(dsend.data(), stale.data(), send.size(), caller.get());
    caller.synchronize();
    gpu::memcpy_async(dsend.data(), send.data(), send.size(), caller.get());
    eng.alltoallv(std::span<const std::byte>(dsend.data(), send.size()), l.send_counts, l.send_displs,
                  std::span(drecv.data(), recv.size()), l.recv_counts, l.recv_displs, caller.get(), elem);
    // Read back into pinned memory: the ranks here are threads sharing one device's context, and
    // a copy into pageable memory would hold the driver's context lock until the call completes,
    // while another rank's thread may still be registering for the same call (opening handles,
    // making staging), which needs that lock: a hang on a real GPU, an error on the stand-in.
    gpu::pinned_buffer back(recv.size());
    gpu::memcpy_async(back.data(), drecv.data(), recv.size(), caller.get());
    caller.synchronize();
    std::copy_n(back.data(), recv.size(), recv.data());
    eng.synchronize();
  } else {
    eng.alltoallv(std::span(dsend.data(), send.size()), l.send_counts, l.send_displs, std::span(drecv.data(), recv.size()),
                  l.recv_counts, l.recv_displs, elem);
    gpu::memcpy_async(recv.data(), drecv.data(), recv.size(), mem.stream());
    mem.synchronize();
  }
  boot.allgather({}, {});
  eng.forget_buffer(dsend.data());
  eng.forget_buffer(drecv.data());
  std::vector<char> written(recv.size(), 0);
  for (rank_t i = 0; i < n; ++i)
    for (std::uint64_t b = 0; b < t(i, r); ++b) {
      const std::size_t at = l.recv_displs[i] * elem + b;
      written[at] = 1;
      if (recv[at] != pattern_byte(i, r, b))
        throw error("rank " + std::to_string(r) + ": byte " + std::to_string(b) + " from rank " + std::to_string(i) + " is wrong");
    }
  for (std::size_t k = 0; k < recv.size(); ++k)
    if (!written[k] && recv[k] != canary)
      throw error("rank " + std::to_string(r) + ": byte " + std::to_string(k) + " outside every message was written");
}

/// S x G ranks as threads; each runs an engine whose scale-up is a gpu_ipc_transport reaching its
/// server's G ranks and whose scale-out is a gpu_ipc_transport reaching every rank (one process),
/// both on the stream of the rank's gpu_memory; `calls` all-to-allvs on device buffers.
template <class D>
std::vector<std::string> run_device_engine(int S, int G, const std::vector<fasta2a::traffic_matrix>& calls, std::size_t elem,
                                           std::size_t rail_window, bool stream_form = false) {
  using namespace fasta2a;
  const rank_t n = S * G;
  host_fabric fabric(n, std::chrono::seconds(20));
  std::vector<std::string> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (rank_t r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        host_bootstrap boot(fabric, r);
        gpu_memory mem;
        ipc up(boot, mem.shared_stream(), gpu_ipc_options{.node_ranks = G});
        ipc out(boot, mem.shared_stream());
        engine_options opt;
        opt.rail_window = rail_window;
        engine<two_tier_topology, host_bootstrap, ipc, ipc, D, gpu_memory> eng(two_tier_topology(S, G), boot, up, out, opt, D{}, mem);
        for (const traffic_matrix& t : calls) device_call_checked(eng, boot, mem, t, r, elem, stream_form);
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

} // namespace

TEST_CASE_TEMPLATE_INVOKE(fasta2a_conformance, gpu_world<0>, gpu_world<300>);

TEST_CASE("gpu_ipc.engine: device buffers from gpu_memory, byte-exact over skewed shapes and decomposers") {
  using namespace fasta2a;
  for (std::uint32_t delay : {0u, 200u}) {
    standin_settings st(delay, 11, /*host_pointers=*/false); // every registration is real stand-in device memory
    std::mt19937_64 rng(424242 + delay);
    for (int iter = 0; iter < 8; ++iter) {
      const int S = 1 + static_cast<int>(rng() % 3), G = 1 + static_cast<int>(rng() % 3);
      const std::size_t elem = iter % 3 == 0 ? 4 : 1;
      std::vector<traffic_matrix> calls;
      for (int c = 0; c < 2; ++c) calls.push_back(testing::skewed_traffic(S * G, rng, elem));
      CAPTURE(delay);
      CAPTURE(S);
      CAPTURE(G);
      CAPTURE(iter);
      const std::size_t window = 1 + static_cast<std::size_t>(iter % 3);
      std::vector<std::string> errors;
      switch (iter % 4) {
      case 0: errors = run_device_engine<birkhoff_decomposer>(S, G, calls, elem, window); break;
      case 1: errors = run_device_engine<bottleneck_decomposer>(S, G, calls, elem, window); break;
      case 2: errors = run_device_engine<spread_out_decomposer>(S, G, calls, elem, window); break;
      default: errors = run_device_engine<direct_decomposer>(S, G, calls, elem, window); break;
      }
      testing::require_all_ok(errors);
    }
  }
}

TEST_CASE("gpu_ipc.engine: stream-ordered calls from device buffers, byte-exact, 12 seeds with random delays") {
  using namespace fasta2a;
  for (std::uint64_t seed = 1; seed <= 12; ++seed) {
    const std::uint32_t delay = seed % 3 == 0 ? 0u : seed % 3 == 1 ? 100u : 300u;
    standin_settings st(delay, seed, /*host_pointers=*/false);
    std::mt19937_64 rng(777 + seed);
    const int S = 1 + static_cast<int>(rng() % 3), G = 1 + static_cast<int>(rng() % 3);
    const std::size_t elem = seed % 4 == 0 ? 4 : 1;
    std::vector<traffic_matrix> calls;
    for (int c = 0; c < 3; ++c) calls.push_back(testing::skewed_traffic(S * G, rng, elem));
    CAPTURE(seed);
    CAPTURE(S);
    CAPTURE(G);
    const std::size_t window = 1 + seed % 3;
    testing::require_all_ok(seed % 2 ? run_device_engine<birkhoff_decomposer>(S, G, calls, elem, window, true)
                                     : run_device_engine<direct_decomposer>(S, G, calls, elem, window, true));
  }
}

TEST_CASE("gpu_ipc.engine: a stream that never reaches the call is an asynchronous error, every caller's stream is released, and the call after the raised error recovers") {
  using namespace fasta2a;
  standin_settings st(0, 5, false);
  const rank_t n = 2;
  host_fabric fabric(n, std::chrono::seconds(20));
  std::vector<std::string> errors(n), async(n), next(n), third(n);
  std::vector<std::thread> threads;
  for (rank_t r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        host_bootstrap boot(fabric, r);
        gpu_memory mem;
        ipc up(boot, mem.shared_stream());
        ipc out(boot, mem.shared_stream());
        engine_options opt;
        opt.timeout = std::chrono::milliseconds(400);
        engine<two_tier_topology, host_bootstrap, ipc, ipc, direct_decomposer, gpu_memory> eng(two_tier_topology(1, 2), boot, up, out,
                                                                                              opt, {}, mem);
        gpu::device_buffer s(64), d(64), gate(8);
        const std::uint64_t zero = 0, one = 1;
        gpu::memcpy_async(gate.data(), &zero, 8, mem.stream());
        mem.synchronize();
        gpu::stream caller;
        if (r == 1) gpu::wait_value64(caller.get(), reinterpret_cast<std::uint64_t*>(gate.data()), 1); // held back
        const std::vector<std::uint64_t> counts{16, 16}, displs{0, 16};
        eng.alltoallv(std::span<const std::byte>(s.data(), 64), counts, displs, std::span(d.data(), 64), counts, displs, caller.get());
        try {
          eng.synchronize();
        } catch (const error& e) {
          async[static_cast<std::size_t>(r)] = e.what();
        }
        CHECK(eng.async_error().empty()); // raised once (by synchronize), then cleared
        boot.allgather({}, {});
        if (r == 1) { // let the stream go: it must then pass the call (released despite the error)
          gpu::stream other;
          gpu::memcpy_async(gate.data(), &one, 8, other.get());
          other.synchronize();
        }
        caller.synchronize();
        // The next call recovers on every rank (new connections, handles again) and runs.
        try {
          eng.alltoallv(std::span<const std::byte>(s.data(), 64), counts, displs, std::span(d.data(), 64), counts, displs,
                        caller.get());
          if (!eng.last_stats().recovered) next[static_cast<std::size_t>(r)] = "the call after the error did not recover";
          eng.synchronize();
          caller.synchronize();
        } catch (const error& e) {
          next[static_cast<std::size_t>(r)] = e.what();
        }
        boot.allgather({}, {});
        // And the one after that is an ordinary call.
        try {
          eng.alltoallv(std::span<const std::byte>(s.data(), 64), counts, displs, std::span(d.data(), 64), counts, displs,
                        caller.get());
          if (eng.last_stats().recovered) third[static_cast<std::size_t>(r)] = "the call recovered again";
          eng.synchronize();
          caller.synchronize();
        } catch (const error& e) {
          third[static_cast<std::size_t>(r)] = e.what();
        }
        boot.allgather({}, {});
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  testing::require_all_ok(errors);
  CHECK(async[1].find("did not reach stream-ordered call 1") != std::string::npos);
  CHECK(async[1].find("an earlier stream-ordered all-to-allv failed") != std::string::npos);
  CHECK(async[0].find("rank 1 did not say it is ready") != std::string::npos);
  for (rank_t r = 0; r < n; ++r) {
    CAPTURE(next[static_cast<std::size_t>(r)]);
    CHECK(next[static_cast<std::size_t>(r)].empty());
    CAPTURE(third[static_cast<std::size_t>(r)]);
    CHECK(third[static_cast<std::size_t>(r)].empty());
  }
}

TEST_CASE("gpu_ipc.engine: a receive buffer freed right after its call (no barrier) is never opened by a peer that sends it nothing") {
  // Rank 0 receives nothing from its peers and frees its buffers as soon as its call returns;
  // peers that were slower must not try to open its handle (it would not open any more).
  using namespace fasta2a;
  standin_settings st(200, 9, false);
  const int S = 2, G = 2;
  const rank_t n = S * G;
  host_fabric fabric(n, std::chrono::seconds(20));
  std::vector<std::string> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (rank_t r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        host_bootstrap boot(fabric, r);
        gpu_memory mem;
        ipc up(boot, mem.shared_stream(), gpu_ipc_options{.node_ranks = G});
        ipc out(boot, mem.shared_stream());
        engine<two_tier_topology, host_bootstrap, ipc, ipc, direct_decomposer, gpu_memory> eng(two_tier_topology(S, G), boot, up, out,
                                                                                              {}, {}, mem);
        for (int it = 0; it < 25; ++it) {
          traffic_matrix t(n, n);
          t.setZero();
          for (rank_t i = 1; i < n; ++i)
            for (rank_t j = 1; j < n; ++j) t(i, j) = 100 + static_cast<bytes_t>(it * 7 + i + j);
          t(0, 0) = 64;
          const testing::engine_layout l = testing::engine_layout_of(t, r, 1, 1);
          gpu::device_buffer s(l.send_elems + 1), d(l.recv_elems + 1);
          eng.alltoallv(std::span<const std::byte>(s.data(), l.send_elems), l.send_counts, l.send_displs, std::span(d.data(), l.recv_elems),
                        l.recv_counts, l.recv_displs);
          eng.forget_buffer(s.data());
          eng.forget_buffer(d.data()); // then freed at once: no barrier
        }
        boot.allgather({}, {});
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  testing::require_all_ok(errors);
}

TEST_CASE("gpu_ipc.register: host memory without the stand-in's in-process handles is refused, naming why") {
  standin_settings st(0, 1, /*host_pointers=*/false);
  fasta2a::host_fabric fabric(1);
  fasta2a::host_bootstrap boot(fabric, 0);
  ipc t(boot);
  std::vector<std::byte> v(64);
  try {
    (void)t.register_memory(v.data(), v.size());
    FAIL("registered host memory");
  } catch (const fasta2a::error& e) {
    CHECK(std::string(e.what()).find("not device memory") != std::string::npos);
  }
  // Device memory: registers, and a sub-range of it carries its offset in the allocation.
  fasta2a::gpu_memory mem;
  auto b = mem.allocate(4096);
  const auto m = t.register_memory(b.data() + 100, 200);
  CHECK(m.offset == 100);
}

/// The conformance suite's ring on stand-in device memory (not the in-process host handles: after a
/// caught error a peer's copies may still be landing, into its own mapping of the segment, never
/// into freed heap): every rank puts `rounds` blocks of 1024 + 100 k bytes to the next rank, one
/// signal each, channels alternating; the next rank checks each block right after its wait, through
/// a copy to the host on a stream of its own.
static void device_ring(rank_t me, fasta2a::host_bootstrap& boot, ipc& t, std::size_t rounds, std::chrono::milliseconds timeout) {
  using namespace fasta2a;
  using namespace fasta2a::testing;
  const std::size_t slot = 4096;
  const channel_id channels = 2;
  const rank_t n = boot.size(), next = (me + 1) % n, prev = (me + n - 1) % n;
  auto len = [](std::size_t k) { return 1024 + k * 100; };
  gpu::device_buffer in(rounds * slot), out(rounds * slot);
  std::vector<std::byte> hin(rounds * slot, canary), hout(rounds * slot);
  for (std::size_t k = 0; k < rounds; ++k) fill_block(std::span(hout).subspan(k * slot, len(k)), me, next, k);
  gpu::memcpy_async(in.data(), hin.data(), hin.size(), t.stream());
  gpu::memcpy_async(out.data(), hout.data(), hout.size(), t.stream());
  gpu::stream_synchronize(t.stream());
  auto in_mem = t.register_memory(in.data(), in.size());
  auto out_mem = t.register_memory(out.data(), out.size());
  auto remotes = exchange_handles(boot, t, in_mem);
  auto conn = t.connect(channels);
  for (std::size_t k = 0; k < rounds; ++k) {
    conn.put(next, out_mem, k * slot, remotes[static_cast<std::size_t>(next)], k * slot, len(k), static_cast<channel_id>(k % channels));
    conn.signal(next, static_cast<channel_id>(k % channels));
  }
  gpu::stream check;
  std::vector<std::uint64_t> count(channels, 0);
  for (std::size_t k = 0; k < rounds; ++k) {
    const channel_id ch = static_cast<channel_id>(k % channels);
    if (!conn.wait(prev, ch, ++count[ch], timeout)) throw error("no signal " + std::to_string(count[ch]) + " from rank " + std::to_string(prev));
    gpu::memcpy_async(hin.data() + k * slot, in.data() + k * slot, slot, check.get());
    check.synchronize();
    check_block(std::span(hin).subspan(k * slot, len(k)), prev, me, k, "round " + std::to_string(k));
    check_canary(std::span(hin).subspan(k * slot + len(k), slot - len(k)), "past round " + std::to_string(k));
  }
  conn.flush();
  boot.allgather({}, {});
  for (auto& r : remotes) t.forget(r);
}

TEST_CASE("gpu_ipc.signal: a signal is not seen before the puts it covers, over many random delays") {
  // device_ring with up to 500 us before every stream operation, 10 seeds. In test_gpu_ipc_mutant
  // (a mutated copy of gpu_ipc.hpp: transports/gpu/CMakeLists.txt, cmake/mutants.cmake) the signal
  // goes out on a stream of its own, not after the puts, and this test must catch it; that target
  // defines FASTA2A_TEST_EXPECT_WRONG_STREAM_MUTANT.
  int caught = 0;
  const int seeds = 10;
  for (int seed = 1; seed <= seeds; ++seed) {
    standin_settings st(500, static_cast<std::uint64_t>(seed), /*host_pointers=*/false);
    fasta2a::host_fabric fabric(3, std::chrono::seconds(3)); // short: a caught rank leaves its peers waiting
    std::vector<std::string> errors(3);
    std::vector<std::thread> threads;
    for (rank_t r = 0; r < 3; ++r)
      threads.emplace_back([&, r] {
        try {
          fasta2a::host_bootstrap boot(fabric, r);
          ipc t(boot);
          device_ring(r, boot, t, 20, std::chrono::milliseconds(3000));
        } catch (const std::exception& e) {
          errors[static_cast<std::size_t>(r)] = e.what();
        }
      });
    for (auto& th : threads) th.join();
    // Caught: some rank saw a wrong byte (its peers then time out waiting for it, which alone
    // would not count).
    std::string wrong;
    for (const auto& e : errors)
      if (wrong.empty() && e.find(" is wrong") != std::string::npos) wrong = e;
    caught += !wrong.empty();
    if (!wrong.empty()) MESSAGE("seed " << seed << ": " << wrong);
    for (const auto& e : errors)
      if (wrong.empty() && !e.empty()) MESSAGE("seed " << seed << ": an error that is not a wrong byte: " << e);
  }
  MESSAGE("wrong bytes seen under " << caught << " of " << seeds << " seeds");
#ifdef FASTA2A_TEST_EXPECT_WRONG_STREAM_MUTANT
  CHECK(caught >= 1);
#else
  CHECK(caught == 0);
#endif
}

TEST_CASE("gpu_ipc.test: one read of the node's flags answers every flag that arrived, a flag seen is not read again, another node's rank never signals") {
  // On a device every read of the flags is a copy and a synchronize (a round trip); the stand-in
  // counts them. Two nodes of two ranks; rank 1 signals rank 0 on channels 0 to 2, twice on 2.
  for (std::uint32_t delay : {0u, 300u}) {
    standin_settings st(delay, 11, /*host_pointers=*/false);
    fasta2a::host_fabric fabric(4, std::chrono::seconds(20));
    std::vector<std::string> errors(4);
    std::vector<std::uint64_t> reads; // rank 0: reads made by each test below
    std::vector<int> answers;
    std::vector<std::thread> threads;
    for (rank_t r = 0; r < 4; ++r)
      threads.emplace_back([&, r] {
        try {
          fasta2a::host_bootstrap boot(fabric, r);
          ipc t(boot, nullptr, fasta2a::gpu_ipc_options{.node_ranks = 2});
          auto c = t.connect(4);
          if (r == 1) {
            for (fasta2a::channel_id ch : {0u, 1u, 2u, 2u}) c.signal(0, ch);
            c.flush(); // the flags are written
          }
          boot.allgather({}, {});
          if (r == 0) {
            auto& n = fasta2a::gpu_standin::counts().read_value;
            auto ask = [&](rank_t peer, fasta2a::channel_id ch, std::uint64_t count) {
              const std::uint64_t before = n.load();
              answers.push_back(c.test(peer, ch, count) ? 1 : 0);
              reads.push_back(n.load() - before);
            };
            ask(1, 0, 1); // read: all of rank 1's signals are there
            ask(1, 1, 1); // answered by that read
            ask(1, 2, 2);
            ask(1, 2, 1);
            ask(1, 3, 1); // never signalled: read again, not there
            ask(1, 0, 2); // one signal only
            ask(2, 0, 1); // another node: no read, never
            ask(2, 0, 0);
            CHECK(c.wait(1, 2, 2, std::chrono::milliseconds(100)));
            CHECK_FALSE(c.wait(1, 1, 2, std::chrono::milliseconds(20)));
          }
          boot.allgather({}, {});
        } catch (const std::exception& e) {
          errors[static_cast<std::size_t>(r)] = e.what();
        }
      });
    for (auto& th : threads) th.join();
    for (const auto& e : errors) CHECK_MESSAGE(e.empty(), e);
    CHECK(answers == std::vector<int>{1, 1, 1, 1, 0, 0, 0, 1});
    CHECK(reads == std::vector<std::uint64_t>{1, 0, 0, 0, 1, 1, 0, 0});
  }
}

TEST_CASE("gpu_standin.streams: a stream wait on a value and on an event holds back later work, in order") {
  namespace gpu = fasta2a::gpu;
  standin_settings st(200, 3, false);
  gpu::device_buffer b(4096);
  auto* flag = reinterpret_cast<std::uint64_t*>(b.data());
  std::byte* data = b.data() + 64;
  const std::vector<std::byte> zero(4096, std::byte{0}), ones(1024, std::byte{1});
  gpu::stream a, c;
  gpu::memcpy_async(b.data(), zero.data(), zero.size(), a.get());
  a.synchronize();
  // c waits for the flag a writes after its copy: c's copy back must see the copy.
  // (back is pinned: a copy into pageable memory would return only once complete, that is never,
  // since the flag is written after it is enqueued.)
  gpu::wait_value64(c.get(), flag, 1);
  gpu::pinned_buffer pinned_back(1024);
  std::span<std::byte> back(pinned_back.data(), pinned_back.size());
  std::fill(back.begin(), back.end(), std::byte{7});
  gpu::memcpy_async(back.data(), data, back.size(), c.get());
  gpu::memcpy_async(data, ones.data(), ones.size(), a.get());
  gpu::write_value64(a.get(), flag, 1);
  c.synchronize();
  CHECK(std::equal(back.begin(), back.end(), ones.begin(), ones.end()));
  // An event: c's copy after stream_wait_event sees a's later copy.
  const std::vector<std::byte> twos(1024, std::byte{2});
  gpu::memcpy_async(data, twos.data(), twos.size(), a.get());
  gpu::event e;
  e.record(a.get());
  gpu::stream_wait_event(c.get(), e.get());
  gpu::memcpy_async(back.data(), data, back.size(), c.get());
  c.synchronize();
  CHECK(e.done());
  CHECK(std::equal(back.begin(), back.end(), twos.begin(), twos.end()));
  gpu::pinned_buffer slot(sizeof(std::uint64_t));
  CHECK(gpu::read_value64(flag, c.get(), reinterpret_cast<std::uint64_t*>(slot.data())) == 1);
  std::uint64_t pageable = 0; // the host read of a device value lands in pinned memory only
  CHECK_THROWS_WITH_AS(gpu::read_value64(flag, c.get(), &pageable), doctest::Contains("not pinned"), fasta2a::error);
}

TEST_CASE("gpu_standin.pageable: a copy from device into pageable memory returns once complete; one from pageable memory reads it before returning") {
  namespace gpu = fasta2a::gpu;
  standin_settings st(300, 5, false);
  for (int round = 0; round < 20; ++round) {
    gpu::stream s;
    gpu::device_buffer d(4096);
    std::vector<std::byte> src(4096, static_cast<std::byte>(round + 1)), back(4096, std::byte{0});
    gpu::memcpy_async(d.data(), src.data(), src.size(), s.get());
    std::fill(src.begin(), src.end(), std::byte{0xEE}); // the source may be reused at once
    gpu::memcpy_async(back.data(), d.data(), back.size(), s.get());
    CHECK(back == std::vector<std::byte>(4096, static_cast<std::byte>(round + 1))); // no synchronize: complete on return
    gpu::pinned_buffer pin(4096);
    std::memset(pin.data(), 0, pin.size());
    gpu::memcpy_async(pin.data(), d.data(), pin.size(), s.get()); // into pinned memory: asynchronous
    s.synchronize();
    CHECK(static_cast<int>(pin.data()[4095]) == round + 1);
  }
}

TEST_CASE("gpu_standin.context_lock: gpu_memory hands out and takes back events while a pageable copy holds the driver's lock") {
  // The engine records its per-call events (gpu_memory::record) and drops them on its own thread
  // while the caller may be blocked in a copy into pageable memory, which holds the driver's
  // context lock until its stream reaches it. Creating or destroying a runtime event then waits
  // for that lock (a hang on a real GPU): the pool makes and frees none while calls run.
  namespace gpu = fasta2a::gpu;
  standin_settings st(0, 1, false);
  fasta2a::gpu_standin::settings().context_lock_wait_ms = 300; // would_hang after 300 ms
  fasta2a::gpu_memory mem;
  gpu::device_buffer b(4096);
  auto* flag = reinterpret_cast<std::uint64_t*>(b.data());
  const std::vector<std::byte> zero(4096, std::byte{0});
  mem.copy(b.data(), zero.data(), zero.size());
  mem.synchronize();
  gpu::stream c;
  gpu::wait_value64(c.get(), flag, 1);
  std::vector<std::byte> back(1024, std::byte{9}); // pageable: the copy returns once complete
  std::thread blocked([&] { gpu::memcpy_async(back.data(), b.data() + 64, back.size(), c.get()); });
  // Until the copy holds the lock (shared): an exclusive try fails from then on.
  auto& lock = fasta2a::gpu_standin::detail::context_lock();
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  bool held = false;
  while (!held && std::chrono::steady_clock::now() < give_up) {
    held = !lock.try_lock();
    if (!held) lock.unlock(), std::this_thread::yield();
  }
  std::string failure;
  try {
    for (int i = 0; i < 200; ++i) { // more than the pool holds at once, in waves of 50
      std::vector<fasta2a::gpu_memory::event_type> held;
      for (int k = 0; k < 50; ++k) held.push_back(mem.record(mem.stream()));
    }
  } catch (const fasta2a::error& e) {
    failure = e.what();
  }
  bool runtime_event_waits = false; // the control: the lock was held meanwhile
  try {
    gpu::event e;
  } catch (const fasta2a::error&) {
    runtime_event_waits = true;
  }
  mem.write_value(flag, 1);
  blocked.join();
  REQUIRE_MESSAGE(held, "the pageable copy never took the context lock");
  CHECK_MESSAGE(failure.empty(), failure);
  CHECK(runtime_event_waits);
  CHECK(std::all_of(back.begin(), back.end(), [](std::byte x) { return x == std::byte{0}; }));
}

TEST_CASE("gpu_standin.ipc: a device allocation's IPC handle opens in another process, at an offset") {
  namespace gpu = fasta2a::gpu;
  standin_settings st(0, 1, false);
  gpu::device_buffer b(8192);
  for (std::size_t i = 0; i < 8192; ++i) b.data()[i] = static_cast<std::byte>(i % 251);
  void* base = nullptr;
  std::size_t len = 0;
  REQUIRE(gpu::address_range(b.data() + 100, &base, &len));
  CHECK(base == b.data());
  const gpu::ipc_handle_t h = gpu::ipc_get_handle(base);
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    // Only async-signal-safe-ish work here: map, read, write, unmap, exit.
    void* p = nullptr;
    int rc = 0;
    if (fasta2a::gpu_standin::ipc_open_mem_handle(&p, h) != fasta2a::gpu_standin::status::success) _exit(2);
    auto* q = static_cast<std::byte*>(p);
    for (std::size_t i = 0; i < 8192; ++i)
      if (q[i] != static_cast<std::byte>(i % 251)) rc = 3;
    q[4000] = std::byte{0xAB};
    (void)fasta2a::gpu_standin::ipc_close_mem_handle(p);
    _exit(rc);
  }
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(b.data()[4000] == std::byte{0xAB});
}
