// The engine on the host transport (ranks as threads): every received byte is checked against a
// reference computed directly from the traffic matrix.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include "workloads.hpp"

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <mutex>
#include <random>
#include <thread>
#include <type_traits>

#include <fasta2a/engine.hpp>
#include <fasta2a/fewer_stages.hpp>
#include <fasta2a/host.hpp>
#include <fasta2a/pattern.hpp>

#include "conformance/engine_checks.hpp"
#include "conformance/wrappers.hpp"

using namespace fasta2a;

namespace {

using layout = testing::engine_layout;
constexpr auto layout_of = testing::engine_layout_of;

// Runs one engine per thread for every matrix in `calls` (the same engines across calls) and
// checks every byte of every receive buffer, including that the gaps stay untouched.
template <class D = birkhoff_decomposer, class Topo>
void run_and_check(const Topo& topo, const std::vector<traffic_matrix>& calls, std::size_t elem = 1,
                   engine_options opt = {}) {
  const rank_t n = topo.ranks();
  host_fabric fabric(n, opt.timeout);
  std::vector<std::string> errors(n);
  std::atomic<long> checked{0};
  std::vector<std::thread> threads;
  for (rank_t r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        host_bootstrap boot(fabric, r);
        host_transport tr(fabric, r);
        engine<Topo, host_bootstrap, host_transport, host_transport, D> eng(topo, boot, tr, tr, opt);
        for (const traffic_matrix& t : calls) {
          testing::engine_call_checked(eng, t, r, elem);
          checked += static_cast<long>(t.col(r).sum());
        }
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& th : threads) th.join();
  for (rank_t r = 0; r < n; ++r) {
    INFO(errors[r]);
    CHECK(errors[r].empty());
  }
  long expected = 0;
  for (const auto& t : calls) expected += static_cast<long>(t.sum());
  CHECK(checked.load() == expected);
}

traffic_matrix skewed(rank_t n, std::mt19937_64& rng, bytes_t elem) { return testing::skewed_traffic(n, rng, elem); }

} // namespace

TEST_CASE("engine.host.every_rail_window_delivers_the_same_bytes") {
  std::mt19937_64 rng(31);
  for (std::size_t window : {std::size_t{1}, std::size_t{2}, std::size_t{3}, std::size_t{1000}}) {
    CAPTURE(window);
    engine_options opt;
    opt.rail_window = window;
    std::vector<traffic_matrix> calls;
    for (int c = 0; c < 3; ++c) calls.push_back(skewed(12, rng, 1));
    run_and_check(two_tier_topology(4, 3), calls, 1, opt);
  }
  host_fabric fabric(1);
  host_bootstrap boot(fabric, 0);
  host_transport tr(fabric, 0);
  engine_options zero;
  zero.rail_window = 0;
  CHECK_THROWS_WITH_AS((engine<two_tier_topology, host_bootstrap, host_transport, host_transport>(
                           two_tier_topology(1, 1), boot, tr, tr, zero)),
                       doctest::Contains("rail_window"), error);
}

TEST_CASE("engine.host.baselines_and_shapes") {
  std::mt19937_64 rng(7);
  const std::vector<traffic_matrix> calls = {skewed(16, rng, 1), traffic_matrix::Zero(16, 16), skewed(16, rng, 1)};
  run_and_check<spread_out_decomposer>(two_tier_topology(4, 4), calls);
  run_and_check<direct_decomposer>(two_tier_topology(4, 4), calls);
  run_and_check(two_tier_topology(1, 6), {skewed(6, rng, 1)});   // one server: intra only
  run_and_check(two_tier_topology(6, 1), {skewed(6, rng, 1)});   // one GPU per server: rails only
  run_and_check(fixed_topology<4>(3), {skewed(12, rng, 2)}, 2);  // compile-time sized
}

TEST_CASE("engine.host.megatron_trace_4x8") {
  const std::string path = std::string(FASTA2A_WORKLOADS_DIR) + "/megatron-4n-32gpu.txt";
  if (!testing::have_workload(path)) return;
  // Tokens of 64 bytes keep the test fast; the routing is the trace's.
  std::vector<traffic_matrix> calls;
  for (std::size_t k : {0, 1, 599}) calls.push_back(read_matrix(path, 32, k, 64));
  run_and_check(h200_cluster(4), calls, 64, {.planning = {.granule = 64}});
}

TEST_CASE("engine.host.bad_arguments_fail_on_every_rank_before_anything_moves") {
  const rank_t n = 4;
  const two_tier_topology topo(2, 2);
  auto run = [&](std::function<void(rank_t, layout&, std::size_t&)> spoil) {
    host_fabric fabric(n, std::chrono::milliseconds(5000));
    std::vector<std::string> errors(n);
    std::vector<std::thread> threads;
    const traffic_matrix t = uniform_traffic(n, 64, 1);
    for (rank_t r = 0; r < n; ++r)
      threads.emplace_back([&, r] {
        try {
          host_bootstrap boot(fabric, r);
          host_transport tr(fabric, r);
          engine<two_tier_topology, host_bootstrap, host_transport, host_transport> eng(topo, boot, tr, tr);
          layout l = layout_of(t, r, 1, 0);
          std::size_t recv_size = l.recv_elems;
          spoil(r, l, recv_size);
          std::vector<std::byte> send(l.send_elems), recv(recv_size);
          eng.alltoallv(send, l.send_counts, l.send_displs, recv, l.recv_counts, l.recv_displs);
        } catch (const std::exception& e) {
          errors[r] = e.what();
        }
      });
    for (auto& th : threads) th.join();
    return errors;
  };
  // A receive buffer too small on rank 2: rank 2 names the problem, every other rank names rank 2.
  auto errs = run([](rank_t r, layout&, std::size_t& recv_size) {
    if (r == 2) recv_size -= 1;
  });
  CHECK(errs[2].find("past the receive buffer") != std::string::npos);
  for (rank_t r : {0, 1, 3}) CHECK(errs[r].find("rank 2 refused") != std::string::npos);
  // Counts that disagree: rank 1 expects more from rank 3 than rank 3 sends.
  errs = run([](rank_t r, layout& l, std::size_t& recv_size) {
    if (r == 1) {
      l.recv_counts[3] += 1;
      recv_size += 1;
    }
  });
  for (rank_t r = 0; r < n; ++r) CHECK(errs[r].find("rank 1 expects 17 bytes from rank 3, which sends 16") != std::string::npos);
  // Wrong number of counts.
  errs = run([](rank_t r, layout& l, std::size_t&) {
    if (r == 0) l.send_counts.pop_back();
  });
  CHECK(errs[0].find("entries each") != std::string::npos);
}

TEST_CASE("engine.host.ranks_with_other_options_are_refused_before_anything_moves") {
  // Rank 3 plans with another granule: the options digests differ, and every rank says so.
  const rank_t n = 4;
  host_fabric fabric(n, std::chrono::milliseconds(5000));
  std::vector<std::string> errors(n);
  std::vector<std::thread> threads;
  const traffic_matrix t = zipf_traffic(n, 1.0, 4096, 3);
  for (rank_t r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        host_bootstrap boot(fabric, r);
        host_transport tr(fabric, r);
        engine_options opt;
        opt.planning.granule = r == 3 ? 512 : 1;
        engine<two_tier_topology, host_bootstrap, host_transport, host_transport> eng(two_tier_topology(2, 2), boot, tr, tr, opt);
        layout l = layout_of(t, r, 1, 0);
        std::vector<std::byte> send(l.send_elems), recv(l.recv_elems);
        eng.alltoallv(send, l.send_counts, l.send_displs, recv, l.recv_counts, l.recv_displs);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& th : threads) th.join();
  for (rank_t r = 0; r < n; ++r) {
    INFO(errors[r]);
    CHECK(errors[r].find(r == 3 ? "rank 0 was made with other options" : "rank 3 was made with other options") != std::string::npos);
  }
}

TEST_CASE("engine.host.ranks_with_another_decomposer_configuration_are_refused") {
  // Same decomposer type, another alpha on rank 1: the quantum (and so the plan) could differ.
  const rank_t n = 4;
  host_fabric fabric(n, std::chrono::milliseconds(5000));
  std::vector<std::string> errors(n);
  std::vector<std::thread> threads;
  const traffic_matrix t = zipf_traffic(n, 1.0, 4096, 3);
  for (rank_t r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        host_bootstrap boot(fabric, r);
        host_transport tr(fabric, r);
        const quantized_decomposer dec(scaleout_model{.alpha_s = r == 1 ? 20e-6 : 10e-6}, quantum_rule::formula);
        engine<two_tier_topology, host_bootstrap, host_transport, host_transport, quantized_decomposer> eng(
            two_tier_topology(2, 2), boot, tr, tr, {}, dec);
        layout l = layout_of(t, r, 1, 0);
        std::vector<std::byte> send(l.send_elems), recv(l.recv_elems);
        eng.alltoallv(send, l.send_counts, l.send_displs, recv, l.recv_counts, l.recv_displs);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& th : threads) th.join();
  for (rank_t r = 0; r < n; ++r) {
    INFO(errors[r]);
    CHECK(errors[r].find("was made with other options") != std::string::npos);
  }
}

TEST_CASE("engine.host.rail_sends_that_never_leave_time_out_naming_the_stage") {
  // Rank 0's transport never reports its sends as gone: with one stage in flight it cannot start
  // stage 1, and must say so within the timeout; the others must name rank 0 as the one missing.
  engine_options opt;
  opt.timeout = std::chrono::milliseconds(300);
  opt.rail_window = 1;
  // 3 servers x 1 GPU, uniform: two rail stages.
  const rank_t n = 3;
  host_fabric fabric(n, std::chrono::milliseconds(5000));
  std::vector<std::string> errors(n);
  std::vector<std::thread> threads;
  const traffic_matrix t = uniform_traffic(n, 4096, 1);
  for (rank_t r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        host_bootstrap boot(fabric, r);
        host_transport base(fabric, r);
        testing::probe pr;
        pr.stuck = r == 0;
        testing::probed_transport<host_transport> tr(base, pr);
        engine<two_tier_topology, host_bootstrap, decltype(tr), decltype(tr)> eng(two_tier_topology(3, 1), boot, tr, tr, opt);
        const layout l = layout_of(t, r, 1, 0);
        std::vector<std::byte> send(l.send_elems), recv(l.recv_elems);
        eng.alltoallv(send, l.send_counts, l.send_displs, recv, l.recv_counts, l.recv_displs);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& th : threads) th.join();
  INFO(errors[0]);
  CHECK(errors[0].find("rail sends of stage 0") != std::string::npos);
  CHECK(errors[0].find("did not leave within 300 ms") != std::string::npos);
  int named = 0;
  for (rank_t r = 1; r < 3; ++r) named += errors[r].find("from rank 0 in stage 1") != std::string::npos;
  CHECK(named >= 1);
}

TEST_CASE("engine.host.staging_is_allocated_once_and_reused") {
  const rank_t n = 8;
  host_fabric fabric(n);
  std::vector<bytes_t> first(n), later(n);
  std::vector<std::thread> threads;
  for (rank_t r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      host_bootstrap boot(fabric, r);
      host_transport tr(fabric, r);
      engine<two_tier_topology, host_bootstrap, host_transport, host_transport> eng(two_tier_topology(2, 4), boot, tr, tr);
      for (int call = 0; call < 4; ++call) {
        const traffic_matrix t = zipf_traffic(n, 1.0, call == 0 ? 1 << 16 : 1 << 12, 5 + call);
        layout l = layout_of(t, r, 1, 0);
        std::vector<std::byte> send(l.send_elems), recv(l.recv_elems);
        eng.alltoallv(send, l.send_counts, l.send_displs, recv, l.recv_counts, l.recv_displs);
        CHECK(eng.staging_bytes() >= eng.last_plan().staging_bytes[r]);
        (call == 0 ? first : later)[r] = eng.staging_bytes();
      }
    });
  for (auto& th : threads) th.join();
  CHECK(first == later); // smaller calls reuse the buffer the first call grew
}

namespace {

/// Resident memory of this process, in bytes (Linux /proc/self/statm).
std::size_t resident_bytes() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (!f) return 0;
  unsigned long size = 0, resident = 0;
  const int got = std::fscanf(f, "%lu %lu", &size, &resident);
  std::fclose(f);
  return got == 2 ? resident * 4096ul : 0;
}

/// Send and receive buffers of one call, filled and checkable.
struct buffer_set {
  layout l;
  std::vector<std::byte> send, recv;
  buffer_set(const traffic_matrix& t, rank_t r) : l(layout_of(t, r, 1, 0)), send(l.send_elems), recv(l.recv_elems) {
    for (rank_t j = 0; j < static_cast<rank_t>(t.rows()); ++j)
      fill_pattern(std::span(send).subspan(l.send_displs[j], t(r, j)), r, j);
  }
  bool received(const traffic_matrix& t, rank_t r) const {
    for (rank_t i = 0; i < static_cast<rank_t>(t.rows()); ++i)
      for (std::uint64_t b = 0; b < t(i, r); ++b)
        if (recv[l.recv_displs[i] + b] != pattern_byte(i, r, b)) return false;
    return true;
  }
};

using counted_engine = engine<two_tier_topology, testing::counting_bootstrap<host_bootstrap>,
                              testing::probed_transport<host_transport>, testing::probed_transport<host_transport>>;

/// Runs body(rank, engine, counting bootstrap, probe) on every rank of a 2 x 4 host fabric.
template <class Body>
std::vector<std::string> on_counted_ranks(const two_tier_topology& topo, engine_options opt, Body&& body) {
  const rank_t n = topo.ranks();
  host_fabric fabric(n, std::chrono::milliseconds(20000));
  std::vector<std::string> errors(n);
  std::vector<std::thread> threads;
  for (rank_t r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        host_bootstrap base_boot(fabric, r);
        testing::counting_bootstrap<host_bootstrap> boot(base_boot);
        host_transport base(fabric, r);
        testing::probe pr;
        testing::probed_transport<host_transport> tr(base, pr);
        counted_engine eng(topo, boot, tr, tr, opt);
        body(r, eng, boot, pr);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& th : threads) th.join();
  return errors;
}

} // namespace

TEST_CASE("engine.host.unchanged_buffers_cost_one_exchange_and_no_registration_per_call") {
  const two_tier_topology topo(2, 4);
  const traffic_matrix big = zipf_traffic(8, 1.0, 1 << 14, 3), small = zipf_traffic(8, 1.2, 1 << 10, 4);
  const auto errors = on_counted_ranks(topo, {}, [&](rank_t r, counted_engine& eng, auto& boot, testing::probe& pr) {
    buffer_set b(big, r);
    auto call = [&](const traffic_matrix& t) { eng.alltoallv(b.send, b.l.send_counts, b.l.send_displs, b.recv, b.l.recv_counts, b.l.recv_displs); (void)t; };
    call(big); // first call: registers send and receive (and staging), exchanges handles
    if (eng.last_stats().exchanges != 2) throw error("first call: " + std::to_string(eng.last_stats().exchanges) + " exchanges");
    if (!b.received(big, r)) throw error("first call: wrong bytes");
    for (int k = 0; k < 20; ++k) {
      const long ex = boot.exchanges, reg = pr.registrations;
      call(big);
      if (boot.exchanges - ex != 1) throw error("call " + std::to_string(k) + ": " + std::to_string(boot.exchanges - ex) + " exchanges");
      if (pr.registrations != reg) throw error("call " + std::to_string(k) + ": registered again");
      if (eng.last_stats().exchanges != 1 || eng.last_stats().registrations != 0) throw error("stats disagree with the counts");
      if (!b.received(big, r)) throw error("wrong bytes in call " + std::to_string(k));
    }
    // Fewer bytes in the same buffers: staging is big enough, nothing new to exchange.
    buffer_set s(small, r);
    std::copy(s.send.begin(), s.send.end(), b.send.begin());
    const long ex = boot.exchanges;
    eng.alltoallv(std::span(b.send).first(s.send.size()), s.l.send_counts, s.l.send_displs, std::span(b.recv).first(s.recv.size()),
                  s.l.recv_counts, s.l.recv_displs);
    if (boot.exchanges - ex != 1) throw error("a sub-span of registered buffers cost " + std::to_string(boot.exchanges - ex) + " exchanges");
    std::copy_n(b.recv.begin(), s.recv.size(), s.recv.begin());
    if (!s.received(small, r)) throw error("wrong bytes in the smaller call");
  });
  for (rank_t r = 0; r < 8; ++r) {
    INFO(errors[r]);
    CHECK(errors[r].empty());
  }
}

TEST_CASE("engine.host.ten_thousand_calls_over_three_buffer_sets_keep_registrations_bounded_and_memory_flat") {
  const two_tier_topology topo(2, 2);
  const traffic_matrix t = zipf_traffic(4, 1.0, 4096, 8);
  for (std::size_t cache : {std::size_t{8}, std::size_t{2}}) {
    CAPTURE(cache);
    engine_options opt;
    opt.registration_cache = cache;
    std::atomic<std::size_t> rss_early{0}, rss_late{0};
    std::vector<long> regs(4), deregs(4), exchanges(4);
    const auto errors = on_counted_ranks(topo, opt, [&](rank_t r, counted_engine& eng, auto& boot, testing::probe& pr) {
      std::vector<buffer_set> sets;
      for (int k = 0; k < 3; ++k) sets.emplace_back(t, r);
      for (int call = 0; call < 10000; ++call) {
        buffer_set& b = sets[static_cast<std::size_t>(call % 3)];
        std::fill(b.recv.begin(), b.recv.end(), std::byte{0});
        eng.alltoallv(b.send, b.l.send_counts, b.l.send_displs, b.recv, b.l.recv_counts, b.l.recv_displs);
        if (call % 997 == 0 && !b.received(t, r)) throw error("wrong bytes in call " + std::to_string(call));
        if (eng.registered_buffers() > cache) throw error("more registrations than the cache holds");
        if (r == 0 && call == 300) rss_early = resident_bytes();
      }
      if (r == 0) rss_late = resident_bytes();
      regs[r] = pr.registrations;
      deregs[r] = pr.deregistrations;
      exchanges[r] = boot.exchanges;
    });
    for (rank_t r = 0; r < 4; ++r) {
      INFO(errors[r]);
      CHECK(errors[r].empty());
    }
    const double grown = static_cast<double>(rss_late.load()) - static_cast<double>(rss_early.load());
    MESSAGE("cache " << cache << ": rank 0 made " << regs[0] << " registrations and " << deregs[0] << " deregistrations and "
                     << exchanges[0] << " exchanges in 10000 calls; resident memory " << rss_early.load() / 1024 << " KiB after 300 calls, "
                     << rss_late.load() / 1024 << " KiB after 10000");
    CHECK(grown < 1024.0 * 1024.0); // flat: less than 1 MiB over 9,700 calls
    if (cache >= 6) {
      // Three sets of two buffers fit: registered once each (plus staging), exchanged once each.
      CHECK(regs[0] <= 3 * 2 * 2 + 2); // each buffer with both transports (here one wrapper twice), plus staging
      CHECK(exchanges[0] <= 10000 + 3);
    } else {
      // Two cached buffers for three sets: every call registers, and deregisters as many.
      CHECK(regs[0] - deregs[0] <= static_cast<long>(cache) * 2 + 2);
    }
  }
}

TEST_CASE("engine.host.a_window_serves_calls_anywhere_inside_it_without_registering_again") {
  const two_tier_topology topo(2, 4);
  std::mt19937_64 rng(77);
  std::vector<traffic_matrix> calls;
  for (int k = 0; k < 6; ++k) calls.push_back(zipf_traffic(8, 1.0, 1 + rng() % 3000, rng()));
  const auto errors = on_counted_ranks(topo, {}, [&](rank_t r, counted_engine& eng, auto& boot, testing::probe& pr) {
    std::vector<std::byte> pool(1 << 20, std::byte{0xEE});
    auto w = eng.register_window(pool);
    std::vector<bytes_t> staged(8, 0); // every rank's staging capacity, as the engine tracks it
    const long regs = pr.registrations;
    for (std::size_t k = 0; k < calls.size(); ++k) {
      buffer_set b(calls[k], r);
      // Send from the front of the pool, receive at an offset that changes every call.
      const std::size_t at = 4096 + 777 * k;
      std::copy(b.send.begin(), b.send.end(), pool.begin());
      const long ex = boot.exchanges;
      eng.alltoallv(std::span(pool).first(b.send.size()), b.l.send_counts, b.l.send_displs, std::span(pool).subspan(at, b.recv.size()),
                    b.l.recv_counts, b.l.recv_displs);
      std::copy_n(pool.begin() + static_cast<std::ptrdiff_t>(at), b.recv.size(), b.recv.begin());
      if (!b.received(calls[k], r)) throw error("wrong bytes in call " + std::to_string(k));
      // The counted exchanges are the engine's own, and after the first call a second one happens
      // only where some rank's staging grew (the window's handles are known by then).
      const long made = boot.exchanges - ex;
      if (made != eng.last_stats().exchanges)
        throw error("call " + std::to_string(k) + ": " + std::to_string(made) + " exchanges, the engine says " +
                    std::to_string(eng.last_stats().exchanges));
      bool grew = false;
      for (rank_t q = 0; q < 8; ++q) grew |= eng.last_plan().staging_bytes[static_cast<std::size_t>(q)] > staged[static_cast<std::size_t>(q)];
      for (rank_t q = 0; q < 8; ++q)
        staged[static_cast<std::size_t>(q)] = std::max(staged[static_cast<std::size_t>(q)], eng.last_plan().staging_bytes[static_cast<std::size_t>(q)]);
      if (k > 0 && made != (grew ? 2 : 1))
        throw error("call " + std::to_string(k) + ": " + std::to_string(made) + " exchanges with staging " +
                    (grew ? "grown" : "unchanged"));
    }
    // No buffer of a call was registered: the window is the only registration (staging, which grows
    // with the plans, is not a user buffer).
    if (eng.registered_buffers() != 1) throw error(std::to_string(eng.registered_buffers()) + " registrations besides the window");
    (void)regs;
    const long before = pr.deregistrations;
    w.release();
    if (pr.deregistrations - before != 2) throw error("releasing the window deregistered " + std::to_string(pr.deregistrations - before) + " memories");
  });
  for (rank_t r = 0; r < 8; ++r) {
    INFO(errors[r]);
    CHECK(errors[r].empty());
  }
}
