// The conformance suite (tests/conformance/) on the worked example of transports/README.md: what
// a new transport's author writes to check it. A World says how the suite starts ranks, here
// threads of this process with fasta2a's host bootstrap; the suite then runs every case on it,
// without and with random delays before the transport's operations.
#include <doctest/doctest.h>

#include <string>
#include <thread>
#include <vector>

#include <fasta2a/host.hpp> // host_bootstrap: the allgather among thread-ranks

#include "conformance/conformance.hpp"
#include "minimal_transport.hpp"

namespace {

template <int DelayUs>
struct minimal_world_of_threads {
  static constexpr const char* name = DelayUs > 0 ? "minimal transport, random delays" : "minimal transport";
  using bootstrap = fasta2a::host_bootstrap;
  using transport = example::minimal_transport;
  static fasta2a::rank_t ranks(fasta2a::rank_t preferred) { return preferred; }
  static std::size_t chunk_limit() { return 0; } // no largest message
  static std::chrono::microseconds max_delay() { return std::chrono::microseconds(DelayUs); }

  // Runs f on n thread-ranks; every rank's error text, "" where it succeeded.
  template <class F>
  static std::vector<std::string> run(fasta2a::rank_t n, F&& f, std::chrono::milliseconds timeout) {
    fasta2a::host_fabric fabric(n, timeout); // the bootstrap's shared state
    example::minimal_world world(n);          // the transport's
    std::vector<std::string> errors(static_cast<std::size_t>(n));
    std::vector<std::thread> threads;
    for (fasta2a::rank_t r = 0; r < n; ++r)
      threads.emplace_back([&, r] {
        try {
          fasta2a::host_bootstrap boot(fabric, r);
          example::minimal_transport base(world, r);
          auto pr = fasta2a::testing::delaying_probe(max_delay(), static_cast<std::uint64_t>(r) + 1);
          fasta2a::testing::probed_transport<example::minimal_transport> tr(base, pr);
          f(r, boot, tr, pr);
        } catch (const std::exception& e) {
          errors[static_cast<std::size_t>(r)] = e.what()[0] ? e.what() : "(empty error)";
        }
      });
    for (auto& t : threads) t.join();
    return errors;
  }
};

} // namespace

TEST_CASE_TEMPLATE_INVOKE(fasta2a_conformance, minimal_world_of_threads<0>, minimal_world_of_threads<300>);
