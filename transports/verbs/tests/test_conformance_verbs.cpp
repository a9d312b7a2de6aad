// The conformance suite (tests/conformance/) on the verbs transport. Ranks are threads of this
// process, each with its own verbs_transport (its own queue pairs, one per rank, on one device),
// exchanging addresses through a host_bootstrap:
//
//   test_conformance_verbs --world=plain|delayed [doctest options]
//
// delayed pauses up to 300 us before half of the operations. Exits 77 (ctest: skipped) saying
// why when there is no RDMA device with an active port (FASTA2A_IB_DEVICE, FASTA2A_IB_PORT,
// FASTA2A_IB_GID_INDEX choose one). Never run on the project's machines (none has a device).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <fasta2a/host.hpp>
#include <fasta2a/verbs.hpp>

#include "conformance/conformance.hpp"

namespace {

int delay_us = 0;

/// Puts are cut at this size (not a multiple of anything) so that chunking is exercised.
constexpr std::size_t chunk = 40009;

/// Ranks as threads, each with its own verbs_transport.
struct verbs_world {
  static inline std::string name = "verbs";
  using bootstrap = fasta2a::host_bootstrap;
  using transport = fasta2a::verbs_transport;
  static fasta2a::rank_t ranks(fasta2a::rank_t preferred) { return preferred; }
  static std::size_t chunk_limit() { return chunk; }
  static std::chrono::microseconds max_delay() { return std::chrono::microseconds(delay_us); }

  static fasta2a::verbs_options options(std::chrono::milliseconds timeout) {
    fasta2a::verbs_options o;
    o.timeout = timeout;
    o.max_put_bytes = chunk;
    o.signal_every = 5; // small, so that selective signalling matters within a case
    o.send_depth = 64;  // small, so that a full send queue is met
    return o;
  }

  template <class F>
  static std::vector<std::string> run(fasta2a::rank_t n, F&& f, std::chrono::milliseconds timeout) {
    fasta2a::host_fabric fabric(n, timeout);
    std::vector<std::string> errors(static_cast<std::size_t>(n));
    std::vector<std::thread> threads;
    for (fasta2a::rank_t r = 0; r < n; ++r)
      threads.emplace_back([&, r] {
        try {
          fasta2a::host_bootstrap boot(fabric, r);
          fasta2a::verbs_transport base(boot, options(timeout));
          fasta2a::testing::probe pr = fasta2a::testing::delaying_probe(
              max_delay(), static_cast<std::uint64_t>(r) * 7919u + static_cast<std::uint64_t>(delay_us));
          fasta2a::testing::probed_transport<fasta2a::verbs_transport> tr(base, pr);
          std::string failed;
          try {
            f(r, boot, tr, pr);
          } catch (const std::exception& e) {
            failed = e.what();
            if (failed.empty()) failed = "(empty error)";
          }
          boot.allgather({}, {});
          base.quiesce();
          boot.allgather({}, {});
          if (!failed.empty()) throw fasta2a::error(failed);
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

TEST_CASE_TEMPLATE_INVOKE(fasta2a_conformance, verbs_world);

// What the transport offers of the contract's optional capabilities (transport.hpp). The engine
// learns from registers() whether device memory is registered directly; the test wrapper passes
// it on.
static_assert(fasta2a::DrivesProgress<fasta2a::verbs_transport::connection> &&
              !fasta2a::ExpectsGatePuts<fasta2a::verbs_transport::connection> &&
              fasta2a::RevokesLateWrites<fasta2a::verbs_transport> &&
              fasta2a::RegistersAtRunTime<fasta2a::verbs_transport> &&
              fasta2a::RegistersDevice<fasta2a::verbs_transport>);
static_assert(fasta2a::RegistersAtRunTime<fasta2a::testing::probed_transport<fasta2a::verbs_transport>>);

int main(int argc, char** argv) {
  std::vector<char*> rest;
  std::string key = "plain";
  for (int i = 0; i < argc; ++i) {
    if (std::strncmp(argv[i], "--world=", 8) == 0) key = argv[i] + 8;
    else rest.push_back(argv[i]);
  }
  if (key != "plain" && key != "delayed") {
    std::fprintf(stderr, "test_conformance_verbs: unknown --world=%s (plain, delayed)\n", key.c_str());
    return 2;
  }
  delay_us = key == "delayed" ? 300 : 0;
  verbs_world::name = delay_us ? "verbs, random delays" : "verbs";
  std::string why;
  if (!fasta2a::verbs_transport::available(&why)) {
    std::printf("SKIPPED: %s\n", why.c_str());
    return 77;
  }
  try {
    fasta2a::host_fabric one(1);
    fasta2a::host_bootstrap boot(one, 0);
    fasta2a::verbs_transport t(boot, verbs_world::options(std::chrono::milliseconds(5000)));
    std::printf("world %s: %s\n", key.c_str(), t.describe().c_str());
  } catch (const std::exception& e) {
    // A device is there, yet no transport: a failure, not a skip.
    std::printf("FAILED: a device is present but no verbs transport can be made: %s\n", e.what());
    return 1;
  }
  std::fflush(stdout);
  doctest::Context ctx(static_cast<int>(rest.size()), rest.data());
  return ctx.run();
}
