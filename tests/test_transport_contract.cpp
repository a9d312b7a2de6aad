// The transport contract in one place (transport.hpp, memory.hpp): every optional capability a
// transport, a connection or a memory space may offer is a named concept. Each is checked on a
// type that has it, on one that lacks it, and on one that has something close but not it (another
// signature, a flag that says false); the engine's use of two of them (progress, abandon) is
// checked by running calls over a host transport that offers them.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include <fasta2a/engine.hpp>
#include <fasta2a/host.hpp>
#include <fasta2a/traffic.hpp>

#include "conformance/engine_checks.hpp"
#include "conformance/wrappers.hpp"

using namespace fasta2a;

namespace {

// Minimal types, one member each.
struct bare {};
struct progresses {
  void progress() {}
};
struct progress_takes_an_argument {
  void progress(int) {}
};
struct gates_puts {
  static constexpr bool expects_gate_puts = true;
};
struct says_puts_are_not_gated {
  static constexpr bool expects_gate_puts = false;
};
struct abandons {
  void abandon() noexcept {}
};
struct revokes {
  static constexpr bool late_writes_revoked = true;
};
struct says_it_does_not_revoke {
  static constexpr bool late_writes_revoked = false;
};
struct does_not_survive {
  static constexpr bool survives_revoked_writes = false;
};
struct says_it_survives {
  static constexpr bool survives_revoked_writes = true;
};
struct answers_at_run_time {
  static constexpr bool can_register(memory_kind) noexcept { return true; }
  bool registers(memory_kind k) const { return k == memory_kind::host; }
};
struct answers_only_when_not_const {
  bool registers(memory_kind) { return true; }
};
struct registers_device {
  struct memory {};
  memory register_memory(void*, std::size_t, memory_kind, int) { return {}; }
};
struct registers_device_into_something_else {
  struct memory {};
  int register_memory(void*, std::size_t, memory_kind, int) { return 0; }
};
struct never_registers_device {
  static constexpr bool can_register(memory_kind k) noexcept { return k == memory_kind::host; }
};
struct pinned_host {
  struct host_buffer {};
  host_buffer allocate_host(std::size_t) const { return {}; }
};
struct pinned_host_without_its_type {
  int allocate_host(std::size_t) const { return 0; }
};
struct on_device_3 {
  int device() const { return 3; }
};

} // namespace

TEST_CASE("transport_contract.each_capability_is_recognised_where_present_and_only_there") {
  // Connections.
  static_assert(DrivesProgress<progresses> && !DrivesProgress<bare> && !DrivesProgress<progress_takes_an_argument>);
  static_assert(ExpectsGatePuts<gates_puts> && !ExpectsGatePuts<bare> && !ExpectsGatePuts<says_puts_are_not_gated>);
  static_assert(Abandonable<abandons> && !Abandonable<bare>);
  // Transports.
  static_assert(RevokesLateWrites<revokes> && !RevokesLateWrites<bare> && !RevokesLateWrites<says_it_does_not_revoke>);
  static_assert(late_writes_revoked<revokes>() && !late_writes_revoked<bare>());
  static_assert(SurvivesRevokedWrites<bare> && SurvivesRevokedWrites<says_it_survives> &&
                !SurvivesRevokedWrites<does_not_survive>);
  static_assert(RegistersAtRunTime<answers_at_run_time> && !RegistersAtRunTime<bare> &&
                !RegistersAtRunTime<answers_only_when_not_const>);
  static_assert(RegistersDevice<registers_device> && !RegistersDevice<bare> &&
                !RegistersDevice<registers_device_into_something_else>);
  // Memory spaces.
  static_assert(PinnedHostAllocation<pinned_host> && !PinnedHostAllocation<host_memory> &&
                !PinnedHostAllocation<pinned_host_without_its_type>);
  static_assert(DeviceOrdinal<on_device_3> && !DeviceOrdinal<host_memory>);
  static_assert(MemorySpace<host_memory> && !StreamMemorySpace<host_memory>);
  static_assert(std::same_as<detail::host_buffer_of<host_memory>::type, host_memory::buffer>);
  static_assert(std::same_as<detail::host_buffer_of<pinned_host>::type, pinned_host::host_buffer>);

  // What the engine decides from them at run time: direct registration needs the static and, where
  // the transport answers at run time, the run-time yes.
  const answers_at_run_time a;
  CHECK(registers_directly(a, memory_kind::host));
  CHECK_FALSE(registers_directly(a, memory_kind::cuda_device)); // can_register says yes, registers no
  const never_registers_device s;
  CHECK(registers_directly(s, memory_kind::host));
  CHECK_FALSE(registers_directly(s, memory_kind::hip_device));
}

TEST_CASE("transport_contract.the_host_transport_and_the_test_wrappers_declare_what_they_offer") {
  static_assert(Transport<host_transport> && SharedBootstrap<host_bootstrap>);
  static_assert(RevokesLateWrites<host_transport> && SurvivesRevokedWrites<host_transport>);
  static_assert(!DrivesProgress<host_transport::connection> && !ExpectsGatePuts<host_transport::connection> &&
                !Abandonable<host_transport::connection>);
  static_assert(!RegistersAtRunTime<host_transport> && !RegistersDevice<host_transport>);
  // The conformance suite's wrapper offers exactly what it wraps.
  using probed = testing::probed_transport<host_transport>;
  static_assert(Transport<probed> && RevokesLateWrites<probed>);
  static_assert(!DrivesProgress<probed::connection> && !Abandonable<probed::connection> &&
                !ExpectsGatePuts<probed::connection> && !RegistersAtRunTime<probed>);
  CHECK(late_writes_revoked<probed>());
}

namespace {

// The host transport with a connection that also offers progress() and abandon(), counting them.
struct hook_counts {
  std::atomic<long> progress{0}, abandon{0};
};

class host_with_hooks : public host_transport {
public:
  class connection : public host_transport::connection {
  public:
    connection(host_transport::connection c, hook_counts* k) : host_transport::connection(std::move(c)), k_(k) {}
    void progress() { k_->progress.fetch_add(1, std::memory_order_relaxed); }
    void abandon() noexcept { k_->abandon.fetch_add(1, std::memory_order_relaxed); }

  private:
    hook_counts* k_;
  };
  host_with_hooks(host_fabric& f, rank_t r, hook_counts& k) : host_transport(f, r), k_(&k) {}
  connection connect(channel_id channels) { return connection(host_transport::connect(channels), k_); }

private:
  hook_counts* k_;
};
static_assert(Transport<host_with_hooks> && DrivesProgress<host_with_hooks::connection> &&
              Abandonable<host_with_hooks::connection>);

// Runs f(rank, engine, probe) on every rank of a 2 x 2 world over host_with_hooks (wrapped by the
// conformance probe, which forwards both hooks), with random delays of up to 300 us.
template <class F>
std::vector<std::string> run_hooked(hook_counts& k, std::chrono::milliseconds timeout, F&& f) {
  const two_tier_topology topo(2, 2);
  const rank_t n = topo.ranks();
  host_fabric fabric(n, timeout);
  std::vector<std::string> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> ts;
  for (rank_t r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      try {
        host_bootstrap boot(fabric, r);
        host_with_hooks base(fabric, r, k);
        testing::probe pr = testing::delaying_probe(std::chrono::microseconds(300), 17u + static_cast<std::uint64_t>(r));
        testing::probed_transport<host_with_hooks> tr(base, pr);
        engine_options opt;
        opt.timeout = timeout;
        engine<two_tier_topology, host_bootstrap, testing::probed_transport<host_with_hooks>,
               testing::probed_transport<host_with_hooks>>
            eng(topo, boot, tr, tr, opt);
        f(r, eng, pr);
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  return errors;
}

} // namespace

TEST_CASE("transport_contract.the_engine_drives_the_progress_of_a_connection_that_offers_it") {
  // A skewed matrix per seed: while a rank waits on one tier, the engine pokes the other's
  // progress(); the bytes are right all the same.
  for (std::uint64_t seed : {1u, 2u, 3u}) {
    hook_counts k;
    const traffic_matrix t = zipf_traffic(4, 1.1, 64 * 1024, seed);
    const auto errors = run_hooked(k, std::chrono::milliseconds(5000), [&](rank_t r, auto& eng, testing::probe&) {
      testing::engine_call_checked(eng, t, r, 1);
    });
    for (std::size_t r = 0; r < errors.size(); ++r) {
      INFO("seed " << seed << ", rank " << r << ": " << errors[r]);
      CHECK(errors[r].empty());
    }
    INFO("seed " << seed);
    CHECK(k.progress.load() > 0);
    CHECK(k.abandon.load() == 0); // nothing failed: nothing abandoned
  }
}

TEST_CASE("transport_contract.the_engine_abandons_the_connections_of_a_failed_call") {
  // Rank 3's signals never go out: every rank that waits for them fails at the timeout, and the
  // engine retires the connections of the failed call through abandon().
  hook_counts k;
  const traffic_matrix t = zipf_traffic(4, 1.0, 16 * 1024, 7);
  const auto errors = run_hooked(k, std::chrono::milliseconds(300), [&](rank_t r, auto& eng, testing::probe& pr) {
    if (r == 3) pr.mute = true;
    testing::engine_call_checked(eng, t, r, 1);
  });
  int failed = 0;
  for (const auto& e : errors) failed += e.empty() ? 0 : 1;
  INFO("errors: " << errors[0] << " | " << errors[1] << " | " << errors[2] << " | " << errors[3]);
  CHECK(failed > 0);
  CHECK(k.abandon.load() > 0);
}
