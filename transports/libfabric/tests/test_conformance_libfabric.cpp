// The conformance suite (tests/conformance/) on the libfabric transport. Ranks are threads of this
// process, each with its own libfabric endpoint (so every byte really goes through the provider),
// exchanging addresses through a host_bootstrap. One world per run, chosen on the command line:
//
//   test_conformance_libfabric --world=tcp|tcp_delayed|shm|shm_delayed|tcp_completion [doctest options]
//
// tcp is "tcp;ofi_rxm" (signals ordered by the provider's write-after-write order), shm orders
// signals after the puts' local completions, tcp_completion forces that on tcp (with
// FI_DELIVERY_COMPLETE). Exits 77 (ctest: skipped)
// when the world's provider cannot be used here, saying why.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <fasta2a/host.hpp>
#include <fasta2a/libfabric.hpp>

#include "conformance/conformance.hpp"

namespace {

/// The world this run tests (set by main from --world before any case runs).
struct world_config {
  std::string key = "tcp";
  std::string provider = "tcp;ofi_rxm";
  fasta2a::fi_signal_ordering ordering = fasta2a::fi_signal_ordering::automatic;
  bool delivery_complete = false;
  int delay_us = 0;
  std::string label = "libfabric tcp;ofi_rxm";
};

world_config& config() {
  static world_config c;
  return c;
}

/// Puts are cut at this size (not a multiple of anything) so that chunking is exercised.
constexpr std::size_t chunk = 40009;

/// Ranks as threads, each with its own libfabric_transport over the configured provider.
struct libfabric_world {
  static inline std::string name = "libfabric";
  using bootstrap = fasta2a::host_bootstrap;
  using transport = fasta2a::libfabric_transport;
  static fasta2a::rank_t ranks(fasta2a::rank_t preferred) { return preferred; }
  static std::size_t chunk_limit() { return chunk; }
  static std::chrono::microseconds max_delay() { return std::chrono::microseconds(config().delay_us); }

  static fasta2a::libfabric_options options(std::chrono::milliseconds timeout) {
    fasta2a::libfabric_options o;
    o.provider = config().provider;
    o.ordering = config().ordering;
    o.delivery_complete = config().delivery_complete;
    o.timeout = timeout;
    o.max_put_bytes = chunk;
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
          fasta2a::libfabric_transport base(boot, options(timeout));
          fasta2a::testing::probe pr = fasta2a::testing::delaying_probe(
              max_delay(), static_cast<std::uint64_t>(r) * 7919u + static_cast<std::uint64_t>(config().delay_us));
          fasta2a::testing::probed_transport<fasta2a::libfabric_transport> tr(base, pr);
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

bool choose_world(const std::string& key) {
  world_config& c = config();
  c.key = key;
  if (key == "tcp" || key == "tcp_delayed" || key == "tcp_completion") c.provider = "tcp;ofi_rxm";
  else if (key == "shm" || key == "shm_delayed") c.provider = "shm";
  else return false;
  c.delay_us = key.ends_with("_delayed") ? 300 : 0;
  if (key == "tcp_completion") {
    c.ordering = fasta2a::fi_signal_ordering::wait_for_completion;
    c.delivery_complete = true;
  }
  c.label = "libfabric " + c.provider + (c.delay_us ? ", random delays" : "") +
            (key == "tcp_completion" ? ", signals after delivery-complete puts" : "");
  return true;
}

} // namespace

TEST_CASE_TEMPLATE_INVOKE(fasta2a_conformance, libfabric_world);

int main(int argc, char** argv) {
  std::vector<char*> rest;
  std::string key = "tcp";
  for (int i = 0; i < argc; ++i) {
    if (std::strncmp(argv[i], "--world=", 8) == 0) key = argv[i] + 8;
    else rest.push_back(argv[i]);
  }
  if (!choose_world(key)) {
    std::fprintf(stderr, "test_conformance_libfabric: unknown --world=%s (tcp, tcp_delayed, shm, shm_delayed, tcp_completion)\n",
                 key.c_str());
    return 2;
  }
  libfabric_world::name = config().label;
  std::string why;
  if (!fasta2a::libfabric_transport::available(config().provider, &why)) {
    std::printf("SKIPPED: libfabric provider \"%s\" is not usable here: %s\n", config().provider.c_str(), why.c_str());
    return 77;
  }
  // Say what is being tested: one rank alone opens the endpoint and describes it.
  try {
    fasta2a::host_fabric one(1);
    fasta2a::host_bootstrap boot(one, 0);
    fasta2a::libfabric_transport t(boot, libfabric_world::options(std::chrono::milliseconds(5000)));
    std::printf("world %s: %s\n", config().key.c_str(), t.describe().c_str());
  } catch (const std::exception& e) {
    std::printf("SKIPPED: libfabric provider \"%s\" cannot open an endpoint here: %s\n", config().provider.c_str(), e.what());
    return 77;
  }
  std::fflush(stdout);
  doctest::Context ctx(static_cast<int>(rest.size()), rest.data());
  return ctx.run();
}
