// The verbs transport where no RDMA device may be: every member of fasta2a/verbs.hpp is
// instantiated here (built with -Wall -Wextra -Wpedantic -Werror), and what needs no device is
// checked: the no-device error of available() and of the constructor, and bad settings. Where a
// device is present, one rank also puts to itself, signals, waits and flushes (a smoke test; the
// conformance suite is test_conformance_verbs).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include <fasta2a/host.hpp>
#include <fasta2a/verbs.hpp>

namespace {

using namespace fasta2a;

/// Calls every public member of verbs_transport and of its connection (on one rank: puts to itself).
void exercise(verbs_transport& t) {
  std::vector<std::byte> buf(4096, std::byte{0});
  verbs_transport::memory mem = t.register_memory(buf.data(), buf.size());
  verbs_transport::memory none = t.register_memory(nullptr, 0, memory_kind::host);
  verbs_transport::remote self = t.deserialize(0, t.serialize(mem));
  auto c = t.connect(2);
  auto moved = std::move(c);
  c = std::move(moved);
  for (std::size_t i = 0; i < 2048; ++i) buf[i] = static_cast<std::byte>(i * 7 + 1);
  c.expect(0, mem, 2048, 2048, 1);
  c.put(0, mem, 0, self, 2048, 2048, 1);
  c.signal(0, 1);
  CHECK(c.wait(0, 1, 1, std::chrono::milliseconds(5000)));
  CHECK_FALSE(c.test(0, 1, 2));
  c.flush();
  CHECK(c.sent(0, 1, 1));
  CHECK(c.id() == 0u);
  for (std::size_t i = 0; i < 2048; ++i) CHECK(buf[2048 + i] == buf[i]);
  CHECK(t.registers(memory_kind::host));
  MESSAGE(t.describe() << "; CUDA memory " << (t.registers(memory_kind::cuda_device) ? "registered directly" : "bounced"));
  CHECK(t.max_put_bytes() > 0);
  CHECK(t.rank() == 0);
  CHECK(t.size() == 1);
  CHECK_FALSE(t.device().empty());
  CHECK(t.port() >= 1);
  if (!t.registers(memory_kind::cuda_device)) {
    CHECK_THROWS_WITH_AS(t.register_memory(buf.data(), 64, memory_kind::cuda_device, 0), doctest::Contains("bounce"), error);
  }
  // Not a dma-buf fd: the registration fails, saying so.
  CHECK_THROWS_WITH_AS(t.register_dmabuf(buf.data(), 64, -1, 0), doctest::Contains("ibv_reg_dmabuf_mr"), error);
  CHECK_THROWS_WITH_AS(c.put(0, mem, 4000, self, 0, 200, 0), doctest::Contains("out of bounds"), error);
  CHECK_THROWS_WITH_AS(c.signal(0, 2), doctest::Contains("2 channels"), error);
  t.forget(self);
  t.deregister(mem);
  t.deregister(none);
  t.quiesce();
}

} // namespace

static_assert(Transport<verbs_transport>);
static_assert(verbs_transport::can_register(memory_kind::host) && verbs_transport::can_register(memory_kind::cuda_device));

TEST_CASE("verbs: without a device, available() and the constructor say so; with one, a rank talks to itself") {
  std::string why;
  const bool present = verbs_transport::available(&why);
  host_fabric one(1);
  host_bootstrap boot(one, 0);
  if (!present) {
    INFO(why);
    MESSAGE("no RDMA device here: " << why);
    // The message the issue asks for where ibv_get_device_list finds nothing, or one naming
    // the port or device that is missing.
    const bool named = why.find("no RDMA device found (ibv_get_device_list: ") == 0 || why.find("no active port") == 0;
    CHECK(named);
    verbs_options o;
    o.timeout = std::chrono::milliseconds(2000);
    try {
      verbs_transport t(boot, o);
      FAIL("a verbs transport was made where available() says there is no device");
    } catch (const error& e) {
      CHECK(std::string(e.what()) == "verbs_transport: " + why);
    }
    return;
  }
  verbs_options o;
  o.max_put_bytes = 1000; // chunked
  o.signal_every = 3;
  verbs_transport t(boot, o);
  exercise(t);
  // Instantiated either way: the compiler checks every member without a device.
}

TEST_CASE("verbs: settings that are not numbers are named; an unknown device is named or no device is found") {
  ::setenv("FASTA2A_IB_PORT", "first", 1);
  std::string why;
  CHECK_FALSE(verbs_transport::available(&why));
  ::unsetenv("FASTA2A_IB_PORT");
  CHECK(why.find("FASTA2A_IB_PORT=\"first\" is not a non-negative integer") != std::string::npos);

  ::setenv("FASTA2A_IB_DEVICE", "no_such_hca", 1);
  why.clear();
  CHECK_FALSE(verbs_transport::available(&why));
  ::unsetenv("FASTA2A_IB_DEVICE");
  INFO(why);
  const bool named = why.find("RDMA device \"no_such_hca\" not found") == 0 || why.find("no RDMA device found") == 0;
  CHECK(named);
}

// Instantiates what only runs with a device, so that it is compiled (and warned about) here too.
[[maybe_unused]] static void (*const instantiate_exercise)(verbs_transport&) = &exercise;
