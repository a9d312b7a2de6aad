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

#include <algorithm>
#include <cstdio>
#include <cstdlib>
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
    o.timeout = timeout / 2; // the transport gives up before the bootstrap: a rank blocked in it reports its own error
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
          std::string failed;
          try {
            f(r, boot, tr, pr);
          } catch (const std::exception& e) {
            failed = e.what();
            if (failed.empty()) failed = "(empty error)";
          }
          // No endpoint closes while a peer of this process may still touch it (see quiesce()):
          // everyone stops, completes what it started, and only then closes.
          try {
            boot.allgather({}, {});
            base.quiesce();
            boot.allgather({}, {});
          } catch (const std::exception& e) {
            if (failed.empty()) throw;
            failed += std::string(" (then, closing: ") + e.what() + ")"; // the first error is the one that matters
          }
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

bool choose_world(const std::string& key) {
  world_config& c = config();
  c.key = key;
  if (key == "tcp" || key == "tcp_delayed" || key == "tcp_completion") c.provider = "tcp;ofi_rxm";
  else if (key == "shm" || key == "shm_delayed" || key == "shm_order_delayed") c.provider = "shm";
  else return false;
  c.delay_us = key.ends_with("_delayed") ? 300 : 0;
  // Not a ctest world: shm forced to trust the write-after-write order it claims when asked
  // (a diagnostic; automatic never chooses it).
  if (key == "shm_order_delayed") c.ordering = fasta2a::fi_signal_ordering::provider_order;
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

// What the transport says when it cannot work, on every world (they need no second provider).
TEST_CASE("libfabric: errors name the provider and the libfabric call") {
  using namespace fasta2a;
  SUBCASE("a provider that does not exist") {
    std::string why;
    CHECK_FALSE(libfabric_transport::available("no-such-provider", &why));
    CHECK(why.find("fi_getinfo") != std::string::npos);
    host_fabric one(1);
    host_bootstrap boot(one, 0);
    libfabric_options o;
    o.provider = "no-such-provider";
    try {
      libfabric_transport t(boot, o);
      FAIL("a transport was made over a provider that does not exist");
    } catch (const error& e) {
      const std::string what = e.what();
      INFO(what);
      CHECK(what.find("\"no-such-provider\"") != std::string::npos);
      CHECK(what.find("fi_getinfo") != std::string::npos);
      CHECK(what.find("FASTA2A_FI_PROVIDER") != std::string::npos);
    }
  }
  SUBCASE("the environment chooses the provider when the options do not") {
    ::setenv("FASTA2A_FI_PROVIDER", "no-such-provider", 1);
    std::string why;
    const bool ok = libfabric_transport::available({}, &why);
    ::unsetenv("FASTA2A_FI_PROVIDER");
    CHECK_FALSE(ok);
    CHECK(why.find("no-such-provider") != std::string::npos);
  }
  // Needs provider order on one rank, which only tcp;ofi_rxm offers here.
  if (config().provider == "tcp;ofi_rxm") SUBCASE("ranks that chose different orderings fail together") {
    host_fabric two(2, std::chrono::milliseconds(10000));
    std::vector<std::string> errors(2);
    std::vector<std::thread> threads;
    for (rank_t r = 0; r < 2; ++r)
      threads.emplace_back([&, r] {
        try {
          host_bootstrap boot(two, r);
          libfabric_options o;
          o.provider = "tcp;ofi_rxm";
          o.ordering = r == 0 ? fi_signal_ordering::provider_order : fi_signal_ordering::wait_for_completion;
          libfabric_transport t(boot, o);
        } catch (const std::exception& e) {
          errors[static_cast<std::size_t>(r)] = e.what();
        }
      });
    for (auto& t : threads) t.join();
    for (const std::string& e : errors) {
      INFO(e);
      CHECK(e.find("every rank must use the same") != std::string::npos);
    }
  }
  SUBCASE("a put out of bounds or on a channel that is not there") {
    host_fabric one(1);
    host_bootstrap boot(one, 0);
    libfabric_options o = libfabric_world::options(std::chrono::milliseconds(5000));
    libfabric_transport t(boot, o);
    std::vector<std::byte> buf(64);
    auto mem = t.register_memory(buf.data(), buf.size());
    const auto self = t.deserialize(0, t.serialize(mem));
    auto c = t.connect(2);
    CHECK_THROWS_WITH_AS(c.put(0, mem, 32, self, 0, 64, 0), doctest::Contains("out of bounds"), error);
    CHECK_THROWS_WITH_AS(c.signal(0, 2), doctest::Contains("2 channels"), error);
    CHECK_THROWS_WITH_AS(c.put(1, mem, 0, self, 0, 1, 0), doctest::Contains("1 ranks"), error);
    // And a put to itself works, signalled and awaited like any other.
    std::fill(buf.begin(), buf.begin() + 32, std::byte{7});
    c.put(0, mem, 0, self, 32, 32, 1);
    c.signal(0, 1);
    CHECK(c.wait(0, 1, 1, std::chrono::milliseconds(5000)));
    CHECK(buf[63] == std::byte{7});
    c.flush();
    CHECK(c.sent(0, 1, 1));
    t.deregister(mem);
  }
  SUBCASE("device memory: registers() agrees with what the endpoint offers, and a refusal says bounce") {
    host_fabric one(1);
    host_bootstrap boot(one, 0);
    libfabric_transport t(boot, libfabric_world::options(std::chrono::milliseconds(5000)));
    const std::string d = t.describe();
    INFO(d);
    CHECK(t.registers(memory_kind::host));
    CHECK(t.registers(memory_kind::cuda_device) == (d.find("CUDA yes") != std::string::npos));
    CHECK(t.registers(memory_kind::hip_device) == (d.find("ROCr yes") != std::string::npos));
    MESSAGE("provider " << t.provider() << ": CUDA memory " << (t.registers(memory_kind::cuda_device) ? "registered directly" : "bounced")
                        << ", ROCr memory " << (t.registers(memory_kind::hip_device) ? "registered directly" : "bounced"));
    std::vector<std::byte> buf(64);
    if (!t.registers(memory_kind::cuda_device))
      CHECK_THROWS_WITH_AS(t.register_memory(buf.data(), buf.size(), memory_kind::cuda_device, 0), doctest::Contains("bounce"), error);
    // Host memory through the kind-taking overload is plain registration.
    auto mem = t.register_memory(buf.data(), buf.size(), memory_kind::host, 0);
    CHECK(mem.mr != nullptr);
    t.deregister(mem);
    libfabric_options off = libfabric_world::options(std::chrono::milliseconds(5000));
    off.hmem = false;
    libfabric_transport plain(boot, off);
    CHECK_FALSE(plain.registers(memory_kind::cuda_device));
    CHECK(plain.describe().find("no FI_HMEM") != std::string::npos);
  }
}

// What the transport offers of the contract's optional capabilities (transport.hpp), and the test
// wrapper passes registers() on only where the transport has it (the engine's rule).
static_assert(fasta2a::DrivesProgress<fasta2a::libfabric_transport::connection> &&
              !fasta2a::ExpectsGatePuts<fasta2a::libfabric_transport::connection> &&
              !fasta2a::Abandonable<fasta2a::libfabric_transport::connection>);
static_assert(fasta2a::RevokesLateWrites<fasta2a::libfabric_transport> &&
              !fasta2a::SurvivesRevokedWrites<fasta2a::libfabric_transport> &&
              fasta2a::RegistersAtRunTime<fasta2a::libfabric_transport> &&
              fasta2a::RegistersDevice<fasta2a::libfabric_transport>);
static_assert(fasta2a::RegistersAtRunTime<fasta2a::testing::probed_transport<fasta2a::libfabric_transport>>);
static_assert(!fasta2a::RegistersAtRunTime<fasta2a::testing::probed_transport<fasta2a::host_transport>>);

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
  // The tcp worlds but the plain one give rxm smaller buffers than the provider's defaults: 16
  // receive buffers per connection (FI_OFI_RXM_MSG_RX_SIZE, default 128) of 4 KiB
  // (FI_OFI_RXM_BUFFER_SIZE, its eager limit, default 16 KiB). Each world of up to 16 ranks connects
  // every pair, and zeroing the default pools in fi_enable and at each connection was most of these
  // worlds' time (perf: memset's page faults, 85% of the byte-exact case). The tcp world keeps the
  // defaults users get, as do the CLI's libfabric runs; with the small pools the provider's flow
  // control and its protocol past the eager limit work more, which these two worlds then test. An
  // explicit setting in the environment wins.
  if (key == "tcp_delayed" || key == "tcp_completion") {
    ::setenv("FI_OFI_RXM_MSG_RX_SIZE", "16", 0);
    ::setenv("FI_OFI_RXM_BUFFER_SIZE", "4096", 0);
    config().label += std::string(", rxm pools of ") + std::getenv("FI_OFI_RXM_MSG_RX_SIZE") + " x " +
                      std::getenv("FI_OFI_RXM_BUFFER_SIZE") + " bytes per connection";
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
