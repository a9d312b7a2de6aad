// The conformance suite on the host transport (ranks as threads), without and with random delays
// injected before every transport operation.
#include <doctest/doctest.h>

#include <string>
#include <thread>
#include <vector>

#include <fasta2a/host.hpp>

#include "conformance/conformance.hpp"

namespace {

/// Ranks as threads of this process over one host_fabric; DelayUs > 0 pauses a random time below
/// it before half of the transport operations.
template <int DelayUs>
struct host_world {
  static constexpr const char* name = DelayUs > 0 ? "host transport, random delays" : "host transport";
  using bootstrap = fasta2a::host_bootstrap;
  using transport = fasta2a::host_transport;
  static fasta2a::rank_t ranks(fasta2a::rank_t preferred) { return preferred; }
  static std::size_t chunk_limit() { return 0; }
  static std::chrono::microseconds max_delay() { return std::chrono::microseconds(DelayUs); }

  template <class F>
  static std::vector<std::string> run(fasta2a::rank_t n, F&& f, std::chrono::milliseconds timeout) {
    fasta2a::host_fabric fabric(n, timeout);
    std::vector<std::string> errors(static_cast<std::size_t>(n));
    std::vector<std::thread> threads;
    for (fasta2a::rank_t r = 0; r < n; ++r)
      threads.emplace_back([&, r] {
        try {
          fasta2a::host_bootstrap boot(fabric, r);
          fasta2a::host_transport base(fabric, r);
          fasta2a::testing::probe pr = fasta2a::testing::delaying_probe(max_delay(), static_cast<std::uint64_t>(r) * 7919u + DelayUs);
          fasta2a::testing::probed_transport<fasta2a::host_transport> tr(base, pr);
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

} // namespace

TEST_CASE_TEMPLATE_INVOKE(fasta2a_conformance, host_world<0>, host_world<300>);
