// The code one-sided RDMA transports share (include/fasta2a/rma.hpp): signal encodings round trip
// and refuse what does not fit, chunks cover a put exactly, watermarks and signal tracks agree
// with a plain model under completions in random orders, connection tables count signals apart
// (also for connections not made yet), handles round trip, puts out of bounds are refused, and the
// shared connection forwards to its transport (a stand-in with a simulated completion queue).
// Runs anywhere: no RDMA library is involved.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include <fasta2a/rma.hpp>

using namespace fasta2a;
using namespace fasta2a::rma;

TEST_CASE("code64: every field round trips, including the extremes, and out-of-range fields are refused") {
  std::mt19937_64 rng(11);
  std::vector<signal_fields> cases = {{0, 0, 0, 0},
                                      {static_cast<rank_t>(code64::max_ranks - 1), static_cast<std::uint32_t>(code64::max_connections - 1),
                                       static_cast<channel_id>(code64::max_channels - 1), 0}};
  for (int i = 0; i < 10000; ++i)
    cases.push_back({static_cast<rank_t>(rng() % code64::max_ranks), static_cast<std::uint32_t>(rng() % code64::max_connections),
                     static_cast<channel_id>(rng() % code64::max_channels), 0});
  for (const signal_fields& f : cases) {
    const std::uint64_t d = code64::encode(f.from, f.conn, f.ch);
    CHECK(code64::decode(d) == f);
  }
  // Distinct fields give distinct codes (no field bleeds into another).
  CHECK(code64::encode(1, 0, 0) != code64::encode(0, 1, 0));
  CHECK(code64::encode(0, 1, 0) != code64::encode(0, 0, 1));
  CHECK_THROWS_WITH_AS(code64::encode(static_cast<rank_t>(code64::max_ranks), 0, 0), doctest::Contains("rank"), error);
  CHECK_THROWS_WITH_AS(code64::encode(-1, 0, 0), doctest::Contains("rank"), error);
  CHECK_THROWS_WITH_AS(code64::encode(0, static_cast<std::uint32_t>(code64::max_connections), 0), doctest::Contains("connection"), error);
  CHECK_THROWS_WITH_AS(code64::encode(0, 0, static_cast<channel_id>(code64::max_channels)), doctest::Contains("channel"), error);
}

TEST_CASE("imm32: connection, channel and sequence round trip, the sequence wraps at 4096, limits are named") {
  std::mt19937_64 rng(12);
  for (int i = 0; i < 20000; ++i) {
    const auto conn = static_cast<std::uint32_t>(rng() % imm32::max_connections);
    const auto ch = static_cast<channel_id>(rng() % imm32::max_channels);
    const std::uint64_t count = rng() % 100000 + 1;
    const rank_t from = static_cast<rank_t>(rng() % 1000);
    const signal_fields f = imm32::decode(imm32::encode(conn, ch, count), from);
    CHECK(f.from == from);
    CHECK(f.conn == conn);
    CHECK(f.ch == ch);
    CHECK(f.seq == count % 4096);
    CHECK(f.seq == imm32::seq_of(count));
  }
  CHECK(imm32::encode(imm32::max_connections - 1, imm32::max_channels - 1, 4095) == 0xFFFFFFFFu);
  CHECK(imm32::encode(0, 0, 4096) == 0u);
  CHECK_THROWS_WITH_AS(imm32::encode(imm32::max_connections, 0, 1), doctest::Contains("4096 connections"), error);
  CHECK_THROWS_WITH_AS(imm32::encode(0, imm32::max_channels, 1), doctest::Contains("256 channels"), error);
}

TEST_CASE("chunks: every chunk but the last is full, lengths sum to the put, offsets are contiguous") {
  std::mt19937_64 rng(13);
  for (int i = 0; i < 5000; ++i) {
    const std::size_t max = 1 + rng() % (i % 2 ? 100 : 70000);
    const std::size_t n = rng() % (max * 9 + 3);
    std::size_t sum = 0, count = 0, expect_off = 0, last = 0;
    for_each_chunk(n, max, [&](std::size_t off, std::size_t len) {
      CHECK(off == expect_off);
      CHECK(len >= 1);
      CHECK(len <= max);
      if (last != 0) CHECK(last == max); // only the final chunk may be short
      last = len;
      expect_off += len;
      sum += len;
      ++count;
    });
    CHECK(sum == n);
    CHECK(count == chunk_count(n, max));
    CHECK(count == (n + max - 1) / max);
  }
  int calls = 0;
  for_each_chunk(0, 10, [&](std::size_t, std::size_t) { ++calls; });
  CHECK(calls == 0);
  CHECK_THROWS_WITH_AS(chunk_count(5, 0), doctest::Contains("0 bytes"), error);
  CHECK_THROWS_AS(for_each_chunk(5, 0, [](std::size_t, std::size_t) {}), error);
}

TEST_CASE("watermark: completions in any order give the longest completed prefix, and bad completions are refused") {
  std::mt19937_64 rng(14);
  for (int trial = 0; trial < 300; ++trial) {
    watermark w;
    const int n = 1 + static_cast<int>(rng() % 200);
    for (int i = 0; i < n; ++i) CHECK(w.post() == static_cast<std::uint64_t>(i + 1));
    std::vector<std::uint64_t> order(static_cast<std::size_t>(n));
    std::iota(order.begin(), order.end(), 1u);
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<bool> done(static_cast<std::size_t>(n) + 1, false);
    std::uint64_t completed = 0;
    for (std::uint64_t s : order) {
      if (trial % 3 == 0 && rng() % 4 == 0) {
        // Cumulative (a verbs send queue): everything up to s.
        w.complete_upto(s);
        for (std::uint64_t k = 1; k <= s; ++k) done[k] = true;
      } else if (!done[s]) {
        w.complete(s);
        done[s] = true;
      } else {
        CHECK_THROWS_WITH_AS(w.complete(s), doctest::Contains("not of an operation in flight"), error);
      }
      std::uint64_t prefix = 0;
      while (prefix < static_cast<std::uint64_t>(n) && done[prefix + 1]) ++prefix;
      CHECK(w.done() == prefix);
      completed = static_cast<std::uint64_t>(std::count(done.begin() + 1, done.end(), true));
      CHECK(w.in_flight() == static_cast<std::uint64_t>(n) - completed);
    }
    CHECK(w.idle());
    CHECK(w.done() == static_cast<std::uint64_t>(n));
  }
  watermark w;
  CHECK_THROWS_AS(w.complete(1), error); // never posted
  w.post();
  CHECK_THROWS_AS(w.complete_upto(2), error);
  w.complete(1);
  CHECK_THROWS_AS(w.complete(1), error); // twice
  w.complete_upto(1);                    // cumulative repeats are harmless
  CHECK(w.done() == 1);
}

// A lane driven like a transport drives it: puts and signals interleaved, completions in random
// order, deferred signals posted only when due and sometimes refused (a busy endpoint). Checked
// against a model: sent_upto is the largest k such that signals 1..k are posted and every put
// before signal k has completed.
TEST_CASE("signal_track: sent_upto never runs ahead of the puts, deferred signals go out in order once due") {
  std::mt19937_64 rng(15);
  for (int trial = 0; trial < 400; ++trial) {
    const bool deferred_mode = trial % 2 == 0;
    watermark puts;
    signal_track sig;
    std::vector<std::uint64_t> need;        // need[i] = puts before signal i+1
    std::vector<bool> posted;               // signal i+1 handed to the network
    std::vector<std::uint64_t> in_flight;   // puts posted, not completed
    std::vector<bool> put_done(1, true);
    std::uint64_t posted_in_order = 0;      // model: signals posted (in order) in deferred mode
    auto model_sent = [&] {
      std::uint64_t k = 0;
      while (k < need.size() && posted[k] && need[k] <= puts.done()) ++k;
      return k;
    };
    for (int step = 0; step < 300; ++step) {
      const auto r = rng() % 10;
      if (r < 4) {
        puts.post();
        put_done.push_back(false);
        in_flight.push_back(puts.posted());
      } else if (r < 6) {
        need.push_back(puts.posted());
        posted.push_back(!deferred_mode);
        const std::uint64_t idx = sig.add(puts.posted(), !deferred_mode, puts.done());
        CHECK(idx == need.size());
      } else if (!in_flight.empty()) {
        const std::size_t i = rng() % in_flight.size();
        puts.complete(in_flight[i]);
        put_done[in_flight[i]] = true;
        in_flight.erase(in_flight.begin() + static_cast<std::ptrdiff_t>(i));
        sig.settle(puts.done());
      }
      if (deferred_mode) {
        const bool busy = rng() % 3 == 0;
        const std::uint64_t n = sig.post_due(puts.done(), [&](std::uint64_t index) {
          if (busy) return false;
          CHECK(index == posted_in_order + 1); // in order
          CHECK(need[index - 1] <= puts.done()); // never before its puts completed
          posted[index - 1] = true;
          ++posted_in_order;
          return true;
        });
        if (busy) CHECK(n == 0);
      }
      CHECK(sig.sent_upto() == model_sent());
      CHECK(sig.signals() == need.size());
    }
    for (std::uint64_t s : in_flight) puts.complete(s);
    sig.post_due(puts.done(), [&](std::uint64_t index) {
      posted[index - 1] = true;
      return true;
    });
    CHECK(sig.idle());
    CHECK(sig.deferred() == 0);
    CHECK(sig.sent_upto() == need.size());
  }
}

TEST_CASE("connection_table: counts apart per connection, peer and channel, keeps early signals, names limits") {
  std::mt19937_64 rng(16);
  const rank_t ranks = 5;
  connection_table<> t("test_transport", ranks, 8, 16);
  // Signals for connections 0..3 arrive in random order, before and after the connections exist.
  std::vector<std::uint64_t> expect(4 * ranks * 3, 0);
  for (int i = 0; i < 3000; ++i) {
    if (i == 1000) CHECK(t.make(3) == 0u);
    if (i == 2000) {
      CHECK(t.make(3) == 1u);
      CHECK(t.make(3) == 2u);
    }
    const auto id = static_cast<std::uint32_t>(rng() % 4);
    const auto from = static_cast<rank_t>(rng() % ranks);
    const auto ch = static_cast<channel_id>(rng() % 3);
    const std::size_t k = (id * ranks + static_cast<std::size_t>(from)) * 3 + ch;
    CHECK(t.arrive(id, from, ch) == ++expect[k]);
  }
  CHECK(t.make(3) == 3u);
  for (std::uint32_t id = 0; id < 4; ++id)
    for (rank_t p = 0; p < ranks; ++p)
      for (channel_id c = 0; c < 3; ++c) CHECK(t.arrived(id, p, c) == expect[(id * ranks + static_cast<std::size_t>(p)) * 3 + c]);
  CHECK(t.arrived(7, 0, 0) == 0u); // nothing known
  CHECK(t.made() == 4u);
  // Lanes are per (peer, channel).
  t.lane_of(2, 4, 2).puts.post();
  CHECK(t.lane_of(2, 4, 2).puts.posted() == 1u);
  CHECK(t.lane_of(2, 4, 1).puts.posted() == 0u);
  CHECK(t.lane_of(1, 4, 2).puts.posted() == 0u);
  // Errors name what is wrong.
  CHECK_THROWS_WITH_AS(t.check(0, 5, 0, "put"), doctest::Contains("test_transport: put to rank 5"), error);
  CHECK_THROWS_WITH_AS(t.check(0, 0, 3, "signal"), doctest::Contains("3 channels"), error);
  CHECK_THROWS_WITH_AS(t.check(6, 0, 0, "wait"), doctest::Contains("connection 6"), error);
  CHECK_NOTHROW(t.check(3, 4, 2, "put"));
  CHECK_THROWS_WITH_AS(t.arrive(0, ranks, 0), doctest::Contains("from rank 5 of 5"), error);
  CHECK_THROWS_WITH_AS(t.arrive(8, 0, 0), doctest::Contains("beyond the limits"), error);
  CHECK_THROWS_WITH_AS(t.make(0), doctest::Contains("from 1 to 16"), error);
  CHECK_THROWS_WITH_AS(t.make(17), doctest::Contains("from 1 to 16"), error);
  for (int i = 0; i < 4; ++i) t.make(1);
  CHECK_THROWS_WITH_AS(t.make(1), doctest::Contains("more than 8 connections"), error);
}

TEST_CASE("handles: address, key and size round trip at the extremes; a wrong rank or size is refused, naming the transport") {
  constexpr std::uint64_t top = std::numeric_limits<std::uint64_t>::max();
  const std::vector<remote> cases = {{0, 0, 0, 0},
                                     {top, top, std::numeric_limits<std::size_t>::max(), 3},
                                     {0x7f00deadbeef0000ull, 0xffffffffull, 4096, 1},
                                     {1, std::uint64_t{1} << 32, 1, 2}};
  for (const remote& r : cases) {
    const std::vector<std::byte> blob = serialize_handle(r.addr, r.key, r.size);
    REQUIRE(blob.size() == handle_bytes);
    const remote back = deserialize_handle("test_transport", r.peer, 4, blob);
    CHECK(back.addr == r.addr);
    CHECK(back.key == r.key);
    CHECK(back.size == r.size);
    CHECK(back.peer == r.peer);
  }
  // Fields do not bleed into each other.
  CHECK(serialize_handle(1, 0, 0) != serialize_handle(0, 1, 0));
  CHECK(serialize_handle(0, 1, 0) != serialize_handle(0, 0, 1));
  const std::vector<std::byte> blob = serialize_handle(8, 9, 10);
  CHECK_THROWS_WITH_AS(deserialize_handle("test_transport", 4, 4, blob),
                       doctest::Contains("test_transport::deserialize: rank 4 is not among 4"), error);
  CHECK_THROWS_WITH_AS(deserialize_handle("test_transport", -1, 4, blob), doctest::Contains("rank -1 is not among 4"), error);
  CHECK_THROWS_WITH_AS(deserialize_handle("test_transport", 1, 4, std::span(blob).first(23)),
                       doctest::Contains("rank 1's handle has 23 bytes, expected 24"), error);
  std::vector<std::byte> longer = blob;
  longer.push_back(std::byte{0});
  CHECK_THROWS_WITH_AS(deserialize_handle("test_transport", 1, 4, longer), doctest::Contains("has 25 bytes"), error);
  // A memory handle keeps what it is given.
  int reg = 0;
  memory<int, void*> m{nullptr, 5, &reg, &reg, 7};
  CHECK(m.mr == &reg);
  CHECK(m.local == static_cast<void*>(&reg));
  CHECK(m.key == 7u);
  CHECK(memory<int, std::uint32_t>{}.local == 0u);
}

TEST_CASE("check_put_bounds: a put that fits on both sides passes, one past either end or overflowing is refused") {
  CHECK_NOTHROW(check_put_bounds("t", 1, 0, 10, 0, 10, 10));
  CHECK_NOTHROW(check_put_bounds("t", 1, 10, 10, 10, 10, 0)); // empty, at the very end
  CHECK_NOTHROW(check_put_bounds("t", 1, 4, 10, 2, 6, 4));
  CHECK_THROWS_WITH_AS(check_put_bounds("test_transport", 3, 4, 10, 0, 10, 7),
                       doctest::Contains("test_transport: put of 7 bytes from offset 4 (of 10) to rank 3 at offset 0 (of 10) is out of bounds"),
                       error);
  CHECK_THROWS_AS(check_put_bounds("t", 1, 0, 10, 5, 10, 6), error);
  CHECK_THROWS_AS(check_put_bounds("t", 1, 11, 10, 0, 10, 0), error);
  CHECK_THROWS_AS(check_put_bounds("t", 1, 0, 10, 11, 10, 0), error);
  constexpr std::size_t huge = std::numeric_limits<std::size_t>::max();
  CHECK_THROWS_AS(check_put_bounds("t", 1, 2, 10, 0, 10, huge), error); // off + n wraps around
  CHECK_THROWS_AS(check_put_bounds("t", 1, 0, 10, 2, 10, huge - 1), error);
}

namespace {
/// A stand-in transport for rma::connection: signals arrive when progress() reads a simulated
/// completion queue; puts and signals are recorded.
class fake_rma_transport {
public:
  using memory = rma::memory<int, void*>;
  using remote = rma::remote;
  using connection = rma::connection<fake_rma_transport>;
  explicit fake_rma_transport(rank_t ranks) : conns_("fake_rma_transport", ranks, 8, 4) {}
  connection connect(channel_id channels) { return connection(this, conns_.make(channels)); }

  struct arrival {
    std::uint32_t conn;
    rank_t from;
    channel_id ch;
  };
  std::vector<arrival> queue;  ///< the completion queue: arrivals progress() will count
  std::vector<std::string> log; ///< what the connection asked for
  int progressed = 0;
  std::uint64_t done = 0; ///< the puts' watermark every lane sees

private:
  friend connection;
  struct options {
    wait_policy waiting{};
  };
  void check(std::uint32_t id, rank_t peer, channel_id ch, const char* what) const { conns_.check(id, peer, ch, what); }
  void put(std::uint32_t id, rank_t peer, const memory& src, std::size_t src_off, const remote& dst, std::size_t dst_off,
           std::size_t n, channel_id ch) {
    check(id, peer, ch, "put");
    rma::check_put_bounds("fake_rma_transport", peer, src_off, src.size, dst_off, dst.size, n);
    conns_.lane_of(id, peer, ch).puts.post();
    log.push_back("put " + std::to_string(id) + " " + std::to_string(peer) + " " + std::to_string(n));
  }
  void signal(std::uint32_t id, rank_t peer, channel_id ch) {
    check(id, peer, ch, "signal");
    rma::lane& l = conns_.lane_of(id, peer, ch);
    l.signals.add(l.puts.posted(), true, l.puts.done());
    log.push_back("signal " + std::to_string(id) + " " + std::to_string(peer));
  }
  void flush(std::uint32_t id) { log.push_back("flush " + std::to_string(id)); }
  void progress() {
    ++progressed;
    for (const arrival& a : queue) conns_.arrive(a.conn, a.from, a.ch);
    queue.clear();
    for (std::uint32_t id = 0; id < conns_.made(); ++id)
      for (rma::lane& l : conns_.at(id).lanes) {
        while (l.puts.done() < std::min(done, l.puts.posted())) l.puts.complete(l.puts.done() + 1);
        l.signals.settle(l.puts.done());
      }
  }
  rma::connection_table<> conns_;
  options opt_;
};
} // namespace

static_assert(Connection<fake_rma_transport::connection, fake_rma_transport::memory, fake_rma_transport::remote>);
static_assert(DrivesProgress<fake_rma_transport::connection>);
static_assert(!std::is_copy_constructible_v<fake_rma_transport::connection>);
static_assert(std::is_nothrow_move_constructible_v<fake_rma_transport::connection>);

TEST_CASE("rma::connection: forwards to its transport, counts arrivals after a progress, waits, moves") {
  fake_rma_transport t(3);
  fake_rma_transport::connection a = t.connect(2);
  fake_rma_transport::connection b = t.connect(1);
  CHECK(a.id() == 0u);
  CHECK(b.id() == 1u);
  const fake_rma_transport::memory src{nullptr, 100};
  const fake_rma_transport::remote dst{0, 0, 100, 2};
  a.put(2, src, 0, dst, 0, 100, 1);
  a.signal(2, 1);
  b.flush();
  CHECK(t.log == std::vector<std::string>{"put 0 2 100", "signal 0 2", "flush 1"});
  CHECK_THROWS_WITH_AS(a.put(2, src, 1, dst, 0, 100, 1), doctest::Contains("out of bounds"), error);
  CHECK_THROWS_WITH_AS(a.expect(3, src, 0, 1, 0), doctest::Contains("fake_rma_transport: expect to rank 3"), error);
  CHECK_THROWS_WITH_AS(b.test(0, 1, 1), doctest::Contains("test to rank 0 on channel 1"), error);
  CHECK_THROWS_WITH_AS(b.wait(0, 1, 1, std::chrono::milliseconds(1)), doctest::Contains("wait to rank 0"), error);
  CHECK_THROWS_WITH_AS(b.sent(0, 1, 1), doctest::Contains("sent to rank 0"), error);
  CHECK_NOTHROW(a.expect(1, src, 0, 1, 1));

  // sent: the signal covers one put, complete only once the watermark reaches it.
  CHECK_FALSE(a.sent(2, 1, 1));
  t.done = 1;
  CHECK(a.sent(2, 1, 1));
  CHECK_FALSE(a.sent(2, 1, 2));

  // test reads the queue only when the count is not there yet; arrivals count per connection.
  t.queue = {{0, 1, 0}, {1, 1, 0}, {0, 1, 0}};
  const int before = t.progressed;
  CHECK(a.test(1, 0, 0)); // already there: no progress
  CHECK(t.progressed == before);
  CHECK(a.test(1, 0, 2));
  CHECK(t.progressed == before + 1);
  CHECK(b.test(1, 0, 1));
  CHECK_FALSE(b.test(1, 0, 2));
  CHECK_FALSE(a.wait(1, 0, 3, std::chrono::milliseconds(5)));
  t.queue = {{0, 1, 0}};
  CHECK(a.wait(1, 0, 3, std::chrono::milliseconds(1000)));
  const int p = t.progressed;
  a.progress();
  CHECK(t.progressed == p + 1);

  // A moved connection keeps its id and its transport.
  fake_rma_transport::connection c(std::move(a));
  CHECK(c.id() == 0u);
  CHECK(c.test(1, 0, 3));
  b = std::move(c);
  CHECK(b.id() == 0u);
  CHECK(b.test(1, 0, 3));
}
