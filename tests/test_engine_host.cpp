// The engine on the host transport (ranks as threads): every received byte is checked against a
// reference computed directly from the traffic matrix.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <atomic>
#include <filesystem>
#include <functional>
#include <mutex>
#include <random>
#include <thread>
#include <type_traits>

#include <fasta2a/engine.hpp>
#include <fasta2a/host.hpp>
#include <fasta2a/pattern.hpp>

#include "conformance/wrappers.hpp"

using namespace fasta2a;

namespace {

struct layout {
  std::vector<std::uint64_t> send_counts, send_displs, recv_counts, recv_displs;
  std::size_t send_elems = 0, recv_elems = 0;
};

// Rank r's counts and displacements (in elements) for traffic t (in bytes, multiples of elem).
// Gaps between messages make sure nothing is written where it should not be.
layout layout_of(const traffic_matrix& t, rank_t r, std::size_t elem, std::uint64_t gap) {
  const rank_t n = static_cast<rank_t>(t.rows());
  layout l;
  for (rank_t j = 0; j < n; ++j) {
    l.send_displs.push_back(l.send_elems);
    l.send_counts.push_back(t(r, j) / elem);
    l.send_elems += t(r, j) / elem + gap;
    l.recv_displs.push_back(l.recv_elems);
    l.recv_counts.push_back(t(j, r) / elem);
    l.recv_elems += t(j, r) / elem + gap;
  }
  return l;
}

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
          const layout l = layout_of(t, r, elem, 3);
          std::vector<std::byte> send(l.send_elems * elem), recv(l.recv_elems * elem, std::byte{0xEE});
          for (rank_t j = 0; j < n; ++j)
            fill_pattern(std::span(send).subspan(l.send_displs[j] * elem, t(r, j)), r, j);
          eng.alltoallv(send, l.send_counts, l.send_displs, recv, l.recv_counts, l.recv_displs, elem);
          std::vector<char> written(recv.size(), 0);
          for (rank_t i = 0; i < n; ++i)
            for (std::uint64_t b = 0; b < t(i, r); ++b) {
              const std::size_t at = l.recv_displs[i] * elem + b;
              written[at] = 1;
              if (recv[at] != pattern_byte(i, r, b)) {
                errors[r] = "rank " + std::to_string(r) + ": byte " + std::to_string(b) + " from rank " +
                            std::to_string(i) + " is wrong";
                return;
              }
            }
          for (std::size_t k = 0; k < recv.size(); ++k)
            if (!written[k] && recv[k] != std::byte{0xEE}) {
              errors[r] = "rank " + std::to_string(r) + ": byte " + std::to_string(k) + " outside every message was written";
              return;
            }
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

traffic_matrix skewed(rank_t n, std::mt19937_64& rng, bytes_t elem) {
  switch (rng() % 4) {
  case 0: return zipf_traffic(n, 1.2, elem * (1 + rng() % 2000), rng(), elem);
  case 1: return hotspot_traffic(n, 1 + static_cast<rank_t>(rng() % n), 0.8, elem * (1 + rng() % 2000), rng(), elem);
  case 2: return lognormal_traffic(n, 1.0, elem * (1 + rng() % 2000), rng(), elem);
  default: {
    traffic_matrix t = zipf_traffic(n, 0.8, elem * 512, rng(), elem);
    t.row(static_cast<rank_t>(rng() % n)).setZero(); // a rank that sends nothing
    t.col(static_cast<rank_t>(rng() % n)).setZero(); // a rank that receives nothing
    return t;
  }
  }
}

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
  if (!std::filesystem::exists(path)) {
    MESSAGE("skipped: " << path << " not found");
    return;
  }
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
