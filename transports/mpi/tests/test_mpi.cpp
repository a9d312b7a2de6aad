// Tests of the MPI bootstrap and transport (and of the engine over them, byte for byte against
// MPI_Alltoallv). Every rank runs every test case; the process fails if any rank fails.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "mpi_doctest_main.hpp"
#include "workloads.hpp"

#include <fasta2a/engine.hpp>
#include <fasta2a/mpi.hpp>
#include <fasta2a/pattern.hpp>
#include <fasta2a/traffic.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace fa = fasta2a;
using namespace std::chrono_literals;

namespace {

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

/// The message of the fasta2a::error f throws, or "" (and a failed check) if it throws none.
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const fa::error& e) {
    return e.what();
  }
  FAIL_CHECK("expected a fasta2a::error");
  return {};
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }


/// The ring neighbours of this rank (itself when alone).
struct ring {
  int me = world_rank();
  int n = world_size();
  int right = (me + 1) % n;
  int left = (me + n - 1) % n;
};

/// Exchanges handles as the engine does: every rank's serialized handle through the bootstrap.
template <class Boot>
fa::mpi_transport::remote remote_of(Boot& boot, fa::mpi_transport& tr, const fa::mpi_transport::memory& mine,
                                    int peer) {
  const std::vector<std::byte> h = tr.serialize(mine);
  std::vector<std::byte> all(h.size() * static_cast<std::size_t>(boot.size()));
  boot.allgather(h, all);
  return tr.deserialize(peer, std::span<const std::byte>(all).subspan(static_cast<std::size_t>(peer) * h.size(), h.size()));
}

/// One transport per rank with equal send and receive buffers of `bytes`, the send buffer holding
/// the pattern of (this rank, its right neighbour), both registered, and the right neighbour's
/// receive buffer known as `rem`. Collective: every rank makes one.
struct ring_link {
  ring g;
  fa::mpi_bootstrap boot{MPI_COMM_WORLD};
  fa::mpi_transport tr;
  fa::mpi_transport::connection t; ///< the connection the tests move bytes on
  std::vector<std::byte> send, recv;
  fa::mpi_transport::memory src, dst;
  fa::mpi_transport::remote rem;

  explicit ring_link(std::size_t bytes, fa::mpi_transport_options opt = {})
      : tr(MPI_COMM_WORLD, opt), t(tr.connect(4)), send(bytes), recv(bytes) {
    for (std::size_t i = 0; i < send.size(); ++i) send[i] = fa::pattern_byte(g.me, g.right, i);
    src = tr.register_memory(send.data(), send.size());
    dst = tr.register_memory(recv.data(), recv.size());
    rem = remote_of(boot, tr, dst, g.right);
  }
};

} // namespace

// ---------------------------------------------------------------------------------------------
// Bootstrap
// ---------------------------------------------------------------------------------------------

TEST_CASE("mpi_bootstrap.rank and size are the communicator's") {
  fa::mpi_bootstrap boot(MPI_COMM_WORLD);
  CHECK(boot.rank() == world_rank());
  CHECK(boot.size() == world_size());
  static_assert(fa::Bootstrap<fa::mpi_bootstrap>);
}

TEST_CASE("mpi_bootstrap.allgather gives every rank's blob in rank order, in pieces too") {
  for (std::size_t piece : {fa::detail::mpi_int_max, std::size_t{1}, std::size_t{3}}) {
    CAPTURE(piece);
    fa::mpi_bootstrap boot(MPI_COMM_WORLD, {.timeout = 10s, .max_message_bytes = piece});
    const int n = boot.size();
    const std::size_t len = 7;
    std::vector<std::byte> mine(len), all(len * static_cast<std::size_t>(n), std::byte{0xee});
    for (std::size_t i = 0; i < len; ++i) mine[i] = static_cast<std::byte>(boot.rank() * 16 + static_cast<int>(i));
    boot.allgather(mine, all);
    bool same = true;
    for (int r = 0; r < n; ++r)
      for (std::size_t i = 0; i < len; ++i)
        same = same && all[static_cast<std::size_t>(r) * len + i] == static_cast<std::byte>(r * 16 + static_cast<int>(i));
    CHECK(same);
  }
  fa::mpi_bootstrap boot(MPI_COMM_WORLD);
  boot.allgather({}, {}); // empty blobs are a plain synchronisation
  fa::mpi_bootstrap unchecked(MPI_COMM_WORLD, {.check_lengths = false});
  std::vector<std::byte> mine(3, static_cast<std::byte>(boot.rank())), all(3 * static_cast<std::size_t>(boot.size()));
  unchecked.allgather(mine, all);
  CHECK(all.back() == static_cast<std::byte>(boot.size() - 1));
  unchecked.allgather({}, {});
  CHECK(contains(error_of([] { fa::mpi_bootstrap bad(MPI_COMM_WORLD, {.max_message_bytes = 0}); }),
                 "max_message_bytes"));
}

TEST_CASE("mpi_bootstrap.allgather reports blobs of unequal length on every rank") {
  fa::mpi_bootstrap boot(MPI_COMM_WORLD);
  const int n = boot.size();
  std::vector<std::byte> wrong(5), out(3 * static_cast<std::size_t>(n) + 1);
  CHECK(contains(error_of([&] { boot.allgather(wrong, out); }), "output holds"));
  if (n < 2) return;
  const std::size_t len = boot.rank() == 0 ? 4 : 3;
  std::vector<std::byte> mine(len), all(len * static_cast<std::size_t>(n));
  const std::string msg = error_of([&] { boot.allgather(mine, all); });
  CHECK(contains(msg, "differ in length"));
  CHECK(contains(msg, "from 3 to 4 bytes"));
}

TEST_CASE("mpi_bootstrap.allgather throws at its timeout when a rank does not arrive") {
  const int me = world_rank(), n = world_size();
  if (n < 2) return;
  MPI_Comm comm;
  MPI_Comm_dup(MPI_COMM_WORLD, &comm);
  fa::mpi_bootstrap boot(comm, {.timeout = 300ms});
  std::vector<std::byte> mine(8), all(8 * static_cast<std::size_t>(n));
  if (me != 0) {
    const auto start = std::chrono::steady_clock::now();
    const std::string msg = error_of([&] { boot.allgather(mine, all); });
    const auto took = std::chrono::steady_clock::now() - start;
    CHECK(contains(msg, "rank " + std::to_string(me) + " timed out after 300 ms checking the blob lengths"));
    CHECK(took >= 300ms);
    CHECK(took < 2000ms);
    CHECK(contains(error_of([&] { boot.allgather(mine, all); }), "earlier allgather on rank"));
  } else {
    // Rank 0 arrives once the others have given up, and completes the length check they left
    // pending (they keep MPI progressing in the barrier), so that nothing stays in flight.
    std::this_thread::sleep_for(1000ms);
    // Non-blocking, as theirs was: MPI never matches a blocking collective with a non-blocking one.
    long long lengths[2] = {8, -8}, extremes[2];
    MPI_Request req;
    MPI_Iallreduce(lengths, extremes, 2, MPI_LONG_LONG, MPI_MAX, comm, &req);
    MPI_Wait(&req, MPI_STATUS_IGNORE);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  // Not freed: the others' abandoned request may still be in flight on it, and Open MPI does not
  // survive a communicator freed under a pending non-blocking collective.
}

TEST_CASE("mpi_world_topology makes servers of consecutive ranks") {
  const int n = world_size();
  const fa::two_tier_topology t = fa::mpi_world_topology(1);
  CHECK(t.servers() == n);
  CHECK(t.gpus_per_server() == 1);
  CHECK(fa::mpi_world_topology(n).servers() == 1);
  CHECK(contains(error_of([&] { fa::mpi_world_topology(n + 1); }), "not a whole number of servers"));
  CHECK(contains(error_of([&] { fa::mpi_world_topology(0); }), "at least 1"));
}

// ---------------------------------------------------------------------------------------------
// Transport
// ---------------------------------------------------------------------------------------------

TEST_CASE("mpi_transport.handles are 16 bytes and checked on the way in") {
  static_assert(fa::Transport<fa::mpi_transport>);
  fa::mpi_transport tr(MPI_COMM_WORLD);
  auto t = tr.connect(4);
  std::vector<std::byte> buf(100);
  const auto mem = tr.register_memory(buf.data(), buf.size());
  const std::vector<std::byte> h = tr.serialize(mem);
  CHECK(h.size() == fa::mpi_transport::handle_bytes);
  const auto rem = tr.deserialize(world_rank(), h);
  CHECK(rem.rank == world_rank());
  CHECK(rem.size == 100);
  CHECK(contains(error_of([&] { tr.deserialize(0, std::span<const std::byte>(h).first(15)); }), "15 bytes, expected 16"));
  CHECK(contains(error_of([&] { tr.deserialize(world_size(), h); }), "not a rank"));
  CHECK(contains(error_of([&] { tr.register_memory(nullptr, 8); }), "null pointer"));
  CHECK_NOTHROW(tr.register_memory(nullptr, 0));
  CHECK(contains(error_of([] { fa::mpi_transport bad(MPI_COMM_WORLD, {.max_message_bytes = 0}); }),
                 "max_message_bytes"));
}

TEST_CASE("mpi_transport.a message is cut into ceil(n / limit) contiguous pieces, none empty unless n is 0") {
  // Sender and receiver cut alike, so an extra empty piece would still match: only the cut itself
  // shows it (one more MPI message per put whose length is a multiple of the limit). Limits near
  // the edges, lengths at and around multiples of them; fixed seed.
  std::mt19937_64 rng(29);
  for (int iter = 0; iter < 20000; ++iter) {
    const std::size_t limit = iter % 4 == 0 ? fa::detail::mpi_int_max : 1 + rng() % 64;
    const std::size_t k = rng() % 9;
    const std::size_t n = iter % 3 == 0 ? k * limit : iter % 3 == 1 ? k * limit + 1 + rng() % limit : rng() % 600;
    CAPTURE(limit);
    CAPTURE(n);
    std::size_t pieces = 0, at = 0;
    bool ok = true;
    fa::detail::for_each_chunk(n, limit, [&](std::size_t off, std::size_t len) {
      ok = ok && off == at && len <= limit && (len > 0 || n == 0);
      at += len;
      ++pieces;
    });
    const std::size_t want = n == 0 ? 1 : n / limit + (n % limit != 0);
    REQUIRE(ok);
    REQUIRE(at == n);
    REQUIRE(pieces == want);
    REQUIRE(fa::detail::mpi_chunks(n, limit) == want);
  }
}

TEST_CASE("mpi.max_message_bytes is refused past INT_MAX, the largest count MPI can take, and taken at it") {
  const std::size_t over = fa::detail::mpi_int_max + 1;
  CHECK(contains(error_of([&] { fa::mpi_transport bad(MPI_COMM_WORLD, {.max_message_bytes = over}); }),
                 "max_message_bytes must be in [1, INT_MAX], got 2147483648"));
  CHECK(contains(error_of([&] { fa::mpi_bootstrap bad(MPI_COMM_WORLD, {.max_message_bytes = over}); }),
                 "max_message_bytes must be in [1, INT_MAX], got 2147483648"));
  const fa::mpi_transport at_max(MPI_COMM_WORLD, {.max_message_bytes = fa::detail::mpi_int_max});
  CHECK(at_max.max_message_bytes() == fa::detail::mpi_int_max);
}

TEST_CASE("mpi_transport.messages are cut below Open MPI's TCP put pipeline exactly where it is on") {
  // btl_tcp_flags as this job's launcher set it (Open MPI's default includes put): with
  // avoid_tcp_put_pipeline the cut follows what MPI_T reads, an explicit max_message_bytes wins,
  // and by default messages stay whole.
  const std::optional<fa::mpi_tcp_settings> tcp = fa::mpi_btl_tcp_settings();
  CAPTURE(tcp.has_value());
  const fa::mpi_transport automatic(MPI_COMM_WORLD, {.avoid_tcp_put_pipeline = true});
  if (tcp && tcp->put) {
    CHECK(tcp->rdma_pipeline_bytes >= 65536);
    CHECK(automatic.max_message_bytes() == tcp->rdma_pipeline_bytes - 1);
    CHECK(fa::mpi_transport_setting_note().find("put") != std::string::npos);
  } else {
    CHECK(automatic.max_message_bytes() == fa::detail::mpi_int_max);
    CHECK(fa::mpi_transport_setting_note().empty());
  }
  const fa::mpi_transport whole(MPI_COMM_WORLD);
  CHECK(whole.max_message_bytes() == fa::detail::mpi_int_max);
  const fa::mpi_transport chosen(MPI_COMM_WORLD, {.max_message_bytes = 5000, .avoid_tcp_put_pipeline = true});
  CHECK(chosen.max_message_bytes() == 5000);
}

TEST_CASE("mpi_transport.puts land real bytes at their offsets, large, small, zero-byte and split") {
  const ring g;
  // Sizes straddle the eager limits of shared memory and TCP; one is empty.
  const std::vector<std::size_t> sizes = {1000, 0, 70000, 1, 300000};
  const std::size_t total = std::accumulate(sizes.begin(), sizes.end(), std::size_t{0});
  for (std::size_t max_message : {fa::detail::mpi_int_max, std::size_t{4096}, std::size_t{999}}) {
    CAPTURE(max_message);
    fa::mpi_bootstrap boot(MPI_COMM_WORLD);
    fa::mpi_transport tr(MPI_COMM_WORLD, {.max_message_bytes = max_message});
    auto t = tr.connect(4);
    std::vector<std::byte> send(total), recv(total + 2 * sizes.size() + 8, std::byte{0x5a});
    for (std::size_t i = 0; i < total; ++i) send[i] = fa::pattern_byte(g.me, g.right, i);
    const auto src = tr.register_memory(send.data(), send.size());
    const auto dst = tr.register_memory(recv.data(), recv.size());
    const auto rem = remote_of(boot, tr, dst, g.right);

    // Receive message k at its offset plus a two-byte gap per message: the gaps must stay untouched.
    std::size_t in = 0;
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      t.expect(g.left, dst, in + 2 * k, sizes[k], fa::channel_id{2});
      in += sizes[k];
    }
    std::size_t out = 0;
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      t.put(g.right, src, out, rem, out + 2 * k, sizes[k], fa::channel_id{2});
      out += sizes[k];
    }
    t.signal(g.right, fa::channel_id{2});
    REQUIRE(t.wait(g.left, fa::channel_id{2}, 1, 20s));
    t.flush();

    bool bytes_ok = true, gaps_ok = true;
    std::size_t pos = 0;
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      for (std::size_t i = 0; i < sizes[k]; ++i)
        bytes_ok = bytes_ok && recv[pos + 2 * k + i] == fa::pattern_byte(g.left, g.me, pos + i);
      pos += sizes[k];
      gaps_ok = gaps_ok && recv[pos + 2 * k] == std::byte{0x5a} && recv[pos + 2 * k + 1] == std::byte{0x5a};
    }
    CHECK(bytes_ok);
    CHECK(gaps_ok);
    MPI_Barrier(MPI_COMM_WORLD);
  }
}

TEST_CASE("mpi_transport.channels are matched separately, whatever order the receiver goes in") {
  constexpr std::size_t per = 5000; // each channel's two puts: per and per / 2 bytes
  ring_link link(8 * per);
  auto& [g, boot, tr, t, send, recv, src, dst, rem] = link;
  const fa::channel_id order[] = {fa::channel_id{0}, fa::channel_id{1}, fa::channel_id{2}, fa::channel_id{3}};
  const auto base = [](fa::channel_id c) { return 2 * per * static_cast<std::size_t>(c); };

  // Receiver: channels in reverse order. Sender: interleaved across channels, signals at the end.
  for (int k = 3; k >= 0; --k) {
    t.expect(g.left, dst, base(order[k]), per, order[k]);
    t.expect(g.left, dst, base(order[k]) + per, per / 2, order[k]);
  }
  for (fa::channel_id c : order) t.put(g.right, src, base(c), rem, base(c), per, c);
  for (fa::channel_id c : order) t.put(g.right, src, base(c) + per, rem, base(c) + per, per / 2, c);
  for (fa::channel_id c : {fa::channel_id{2}, fa::channel_id{0}, fa::channel_id{3}, fa::channel_id{1}})
    t.signal(g.right, c);
  for (int k = 3; k >= 0; --k) CHECK(t.wait(g.left, order[k], 1, 20s));
  t.flush();
  bool ok = true;
  for (fa::channel_id c : order)
    for (std::size_t i = 0; i < per + per / 2; ++i) ok = ok && recv[base(c) + i] == fa::pattern_byte(g.left, g.me, base(c) + i);
  CHECK(ok);
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("mpi_transport.a signal covers the puts before it, not expects of later stages") {
  // All expects are posted up front, as the engine does; the second put happens only after the
  // receiver has seen the first signal, so a wait that needed every expect would never return.
  ring_link link(20000);
  auto& [g, boot, tr, t, send, recv, src, dst, rem] = link;
  t.expect(g.left, dst, 0, 10000, fa::channel_id{2});
  t.expect(g.left, dst, 10000, 10000, fa::channel_id{2});
  t.put(g.right, src, 0, rem, 0, 10000, fa::channel_id{2});
  t.signal(g.right, fa::channel_id{2});
  REQUIRE(t.wait(g.left, fa::channel_id{2}, 1, 20s));
  bool first = true;
  for (std::size_t i = 0; i < 10000; ++i) first = first && recv[i] == fa::pattern_byte(g.left, g.me, i);
  CHECK(first);
  t.signal(g.left, fa::channel_id{0}); // "go on" to the rank that sent it
  REQUIRE(t.wait(g.right, fa::channel_id{0}, 1, 20s));
  t.put(g.right, src, 10000, rem, 10000, 10000, fa::channel_id{2});
  t.signal(g.right, fa::channel_id{2});
  REQUIRE(t.wait(g.left, fa::channel_id{2}, 2, 20s)); // counts are cumulative
  t.flush();
  bool second = true;
  for (std::size_t i = 10000; i < 20000; ++i) second = second && recv[i] == fa::pattern_byte(g.left, g.me, i);
  CHECK(second);
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("mpi_transport.sent says when a signal's puts have left; test polls wait once") {
  constexpr std::size_t big = 1 << 20, small = 100; // past every eager limit, and under them
  ring_link link(big + small);
  auto& [g, boot, tr, t, send, recv, src, dst, rem] = link;

  t.expect(g.left, dst, 0, big, fa::channel_id{2});
  t.expect(g.left, dst, big, small, fa::channel_id{2});
  CHECK(t.sent(g.right, fa::channel_id{2}, 0)); // nothing signalled: nothing to wait for
  t.put(g.right, src, 0, rem, 0, big, fa::channel_id{2});
  t.signal(g.right, fa::channel_id{2});
  t.put(g.right, src, big, rem, big, small, fa::channel_id{2});
  t.signal(g.right, fa::channel_id{2});
  CHECK(contains(error_of([&, &t = t, &g = g] { t.sent(g.right, fa::channel_id{2}, 3); }), "2 times"));
  CHECK(contains(error_of([&, &t = t] { t.sent(world_size(), fa::channel_id{2}, 1); }), "not a rank"));
  // Polling test() until it holds is wait(): the bytes it vouches for have landed.
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (!t.test(g.left, fa::channel_id{2}, 2) && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
  REQUIRE(t.test(g.left, fa::channel_id{2}, 2));
  CHECK(fa::pattern_mismatches(std::span<const std::byte>(recv), g.left, g.me) == 0);
  // Once the peer has everything, both of this rank's sends complete; sent() sees it by polling.
  while (!t.sent(g.right, fa::channel_id{2}, 2) && std::chrono::steady_clock::now() < deadline) {
    int flag = 0;
    MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD, &flag, MPI_STATUS_IGNORE); // progress
    std::this_thread::yield();
  }
  CHECK(t.sent(g.right, fa::channel_id{2}, 1));
  CHECK(t.sent(g.right, fa::channel_id{2}, 2));
  t.flush();
  CHECK(t.sent(g.right, fa::channel_id{2}, 2)); // flushed counts stay sent
  CHECK_FALSE(t.test(g.left, fa::channel_id{2}, 3));
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("mpi_transport.progress moves a peer's large put while a message this rank has not taken waits") {
  // The engine calls progress() on one tier while it waits on the other. A receiver with a signal
  // it has not waited for yet (queued as unexpected) must still let a peer's rendezvous finish:
  // a probe that matched that signal returned at once, without MPI's progress, and the peer's
  // send never completed (seen as a deadlock on the emulated cluster).
  constexpr std::size_t big = 4 << 20; // past every eager limit
  constexpr fa::channel_id data{2}, other{3};
  ring_link link(big);
  auto& [g, boot, tr, t, send, recv, src, dst, rem] = link;
  if (g.n < 2) return;
  if (g.me == 1) t.expect(g.left, dst, 0, big, data);
  if (g.me == 0) t.signal(g.right, other); // rank 1 takes it only at the end
  MPI_Barrier(MPI_COMM_WORLD);             // rank 1 has it queued before the put starts
  bool left = false;
  if (g.me == 0) {
    t.put(g.right, src, 0, rem, 0, big, data);
    t.signal(g.right, data);
    const auto deadline = std::chrono::steady_clock::now() + 3s;
    while (!(left = t.sent(g.right, data, 1)) && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
  }
  if (g.me == 1) { // only progress(): nothing else of this rank calls MPI meanwhile
    const auto until = std::chrono::steady_clock::now() + 3s;
    while (std::chrono::steady_clock::now() < until) t.progress();
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (g.me == 0) CHECK_MESSAGE(left, "rank 1 called progress() for 3 s and rank 0's 4 MiB put did not leave");
  if (g.me == 1) {
    CHECK(t.wait(g.left, other, 1, 20s));
    CHECK(t.wait(g.left, data, 1, 20s));
    CHECK(fa::pattern_mismatches(std::span<const std::byte>(recv), g.left, g.me) == 0);
  }
  t.flush();
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("mpi_transport.zero-byte puts pair with zero-byte expects") {
  const ring g;
  fa::mpi_bootstrap boot(MPI_COMM_WORLD);
  fa::mpi_transport tr(MPI_COMM_WORLD);
  auto t = tr.connect(4);
  std::vector<std::byte> buf(16, std::byte{1});
  const auto mem = tr.register_memory(buf.data(), buf.size());
  const auto rem = remote_of(boot, tr, mem, g.right);
  for (int k = 0; k < 3; ++k) t.expect(g.left, mem, 16, 0, fa::channel_id{1}); // at the very end: still in bounds
  for (int k = 0; k < 3; ++k) t.put(g.right, mem, 0, rem, 16, 0, fa::channel_id{1});
  t.signal(g.right, fa::channel_id{1});
  CHECK(t.wait(g.left, fa::channel_id{1}, 1, 20s));
  t.flush();
  CHECK(std::all_of(buf.begin(), buf.end(), [](std::byte b) { return b == std::byte{1}; }));
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("mpi_transport.wait returns false at its timeout when the peer never signals") {
  const ring g;
  fa::mpi_transport tr(MPI_COMM_WORLD);
  auto t = tr.connect(4);
  const auto start = std::chrono::steady_clock::now();
  const bool got = t.wait(g.left, fa::channel_id{3}, 1, 300ms);
  const auto took = std::chrono::steady_clock::now() - start;
  CHECK_FALSE(got);
  CHECK(took >= 300ms);
  CHECK(took < 2000ms); // polling sleeps at most 200 us at a time: no long overshoot
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("mpi_transport.a message to an abandoned connection never reaches a connection made after it") {
  // After a failed call the engine abandons its connections and destroys them with itself, while a
  // peer still inside the failed call may go on sending to them. Open MPI keeps messages that come
  // for a freed communicator's context id and hands them to the next communicator given that id:
  // a later engine's connection took them for its own (seen in the conformance suite after a call
  // failed on some ranks while another waited: the next engine's calls timed out, or the next
  // MPI_Comm_dup never returned). So an abandoned connection keeps its communicator for good.
  const ring g;
  if (g.n < 2) return; // rank 0 signals rank 1
  constexpr fa::channel_id ch{1};
  for (int round = 0; round < 3; ++round) {
    CAPTURE(round);
    std::optional<fa::mpi_transport> tr1(std::in_place, MPI_COMM_WORLD);
    std::optional<fa::mpi_transport::connection> c1(tr1->connect(4));
    MPI_Barrier(MPI_COMM_WORLD);
    if (g.me == 1) { // its call failed: it gives up and destroys its connection first
      c1->abandon();
      c1.reset();
    }
    MPI_Barrier(MPI_COMM_WORLD);
    if (g.me == 0) c1->signal(1, ch); // still in the call, rank 0 signals it
    MPI_Barrier(MPI_COMM_WORLD);
    if (c1) c1->abandon();
    c1.reset();
    tr1.reset();
    fa::mpi_transport tr2(MPI_COMM_WORLD);
    auto c2 = tr2.connect(4);
    MPI_Barrier(MPI_COMM_WORLD);
    if (g.me == 1) {
      const auto until = std::chrono::steady_clock::now() + 200ms;
      bool stale = false;
      while (!stale && std::chrono::steady_clock::now() < until) stale = c2.test(0, ch, 1);
      CHECK_FALSE(stale);
    }
    MPI_Barrier(MPI_COMM_WORLD); // rank 0 signals on the new connection only after rank 1 looked
    if (g.me == 0) c2.signal(1, ch);
    if (g.me == 1) {
      CHECK(c2.wait(0, ch, 1, 10s)); // the new connection's own signal arrives, once
      CHECK_FALSE(c2.test(0, ch, 2));
    }
    c2.flush();
    MPI_Barrier(MPI_COMM_WORLD);
  }
}

TEST_CASE("mpi_transport.out-of-bounds ranges, bad peers and bad channels are errors naming them") {
  fa::mpi_transport tr(MPI_COMM_WORLD);
  auto t = tr.connect(4);
  std::vector<std::byte> buf(100);
  const auto mem = tr.register_memory(buf.data(), buf.size());
  const fa::mpi_transport::remote rem{0, 50};
  const std::string e1 = error_of([&] { t.expect(0, mem, 90, 11, fa::channel_id{2}); });
  CHECK(contains(e1, "[90, 90 + 11)"));
  CHECK(contains(e1, "100 bytes"));
  const std::string e2 = error_of([&] { t.put(0, mem, 0, rem, 40, 11, fa::channel_id{2}); });
  CHECK(contains(e2, "destination bytes [40, 40 + 11)"));
  CHECK(contains(e2, "50 bytes"));
  CHECK(contains(error_of([&] { t.put(0, mem, 95, rem, 0, 6, fa::channel_id{2}); }), "source bytes [95, 95 + 6)"));
  CHECK(contains(error_of([&] { t.put(0, mem, 200, rem, 0, 0, fa::channel_id{2}); }), "source bytes [200"));
  CHECK(contains(error_of([&] { t.expect(0, mem, ~std::size_t{0}, 2, fa::channel_id{2}); }), "outside"));
  CHECK(contains(error_of([&] { t.signal(-1, fa::channel_id{2}); }), "peer -1 is not a rank"));
  CHECK(contains(error_of([&] { (void)t.wait(world_size(), fa::channel_id{2}, 1, 1ms); }), "not a rank"));
  CHECK(contains(error_of([&] { t.signal(0, fa::channel_id{7}); }), "channel 7"));
  if (world_size() > 1) {
    const fa::mpi_transport::remote other{1, 100};
    CHECK(contains(error_of([&] { t.put(0, mem, 0, other, 0, 1, fa::channel_id{2}); }), "belongs to rank 1"));
  }
  t.flush(); // nothing was started
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("mpi_transport.a peer that puts more than was expected is an error at wait, not a hang") {
  ring_link link(64);
  auto& [g, boot, tr, t, send, recv, src, dst, rem] = link;
  t.expect(g.left, dst, 0, 32, fa::channel_id{2});
  t.put(g.right, src, 0, rem, 0, 32, fa::channel_id{2});
  t.put(g.right, src, 32, rem, 32, 32, fa::channel_id{2});
  t.signal(g.right, fa::channel_id{2});
  const std::string msg = error_of([&, &t = t, &g = g] { (void)t.wait(g.left, fa::channel_id{2}, 1, 20s); });
  CHECK(contains(msg, "has put 2 messages on channel 2"));
  CHECK(contains(msg, "expects only 1"));
  // Posting the missing expect repairs it.
  t.expect(g.left, dst, 32, 32, fa::channel_id{2});
  CHECK(t.wait(g.left, fa::channel_id{2}, 1, 20s));
  t.flush();
  bool ok = true;
  for (std::size_t i = 0; i < recv.size(); ++i) ok = ok && recv[i] == fa::pattern_byte(g.left, g.me, i);
  CHECK(ok);
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("mpi_transport.flush names a peer that does not take its bytes in time") {
  ring_link link(1 << 20, {.flush_timeout = 300ms});
  auto& [g, boot, tr, t, send, recv, src, dst, rem] = link;
  // 1 MiB is past every eager limit: the send cannot complete before the receive is posted.
  t.put(g.right, src, 0, rem, 0, send.size(), fa::channel_id{2});
  t.signal(g.right, fa::channel_id{2});
  const std::string msg = error_of([&t = t] { t.flush(); });
  CHECK(contains(msg, "sends to rank " + std::to_string(g.right)));
  CHECK(contains(msg, "within 300 ms"));
  MPI_Barrier(MPI_COMM_WORLD);
  t.expect(g.left, dst, 0, recv.size(), fa::channel_id{2});
  CHECK(t.wait(g.left, fa::channel_id{2}, 1, 20s));
  CHECK_NOTHROW(t.flush());
  bool ok = true;
  for (std::size_t i = 0; i < recv.size(); ++i) ok = ok && recv[i] == fa::pattern_byte(g.left, g.me, i);
  CHECK(ok);
  MPI_Barrier(MPI_COMM_WORLD);
}

// ---------------------------------------------------------------------------------------------
// The engine over MPI, byte for byte against MPI_Alltoallv
// ---------------------------------------------------------------------------------------------

namespace {

/// One rank's counts and displacements (in elements) for a traffic matrix of element counts. Each
/// message is followed by a one-element gap, and the receive side is laid out in reverse rank
/// order, so displacements matter and stray writes land in gaps that are checked.
struct layout {
  std::vector<std::uint64_t> send_counts, send_displs, recv_counts, recv_displs;
  std::uint64_t send_elems = 0, recv_elems = 0;
};

layout layout_of(const fa::traffic_matrix& t, int me) {
  const auto n = static_cast<int>(t.rows());
  layout l;
  l.send_counts.resize(n);
  l.send_displs.resize(n);
  l.recv_counts.resize(n);
  l.recv_displs.resize(n);
  for (int j = 0; j < n; ++j) {
    l.send_counts[j] = t(me, j);
    l.send_displs[j] = l.send_elems;
    l.send_elems += t(me, j) + 1;
  }
  for (int i = n - 1; i >= 0; --i) {
    l.recv_counts[i] = t(i, me);
    l.recv_displs[i] = l.recv_elems;
    l.recv_elems += t(i, me) + 1;
  }
  return l;
}

/// What one checked call found, summed over all ranks.
struct call_check {
  std::uint64_t wrong = 0;      ///< received bytes that differ from the sender's pattern
  std::uint64_t vs_mpi = 0;     ///< bytes of the receive buffer (gaps included) unlike MPI_Alltoallv's
  std::uint64_t checked = 0;    ///< message bytes compared
};

/// Runs one all-to-allv of t (element counts, elements of `elem` bytes) on the engine and with
/// MPI_Alltoallv on the same send buffer, and compares every byte. Collective.
template <class Engine>
call_check check_call(Engine& eng, const fa::traffic_matrix& t, std::size_t elem) {
  const int me = world_rank(), n = world_size();
  const layout l = layout_of(t, me);
  std::vector<std::byte> send(l.send_elems * elem, std::byte{0xa5});
  std::vector<std::byte> recv(l.recv_elems * elem, std::byte{0x3c}), ref(recv.size(), std::byte{0x3c});
  for (int j = 0; j < n; ++j)
    fa::fill_pattern(std::span(send).subspan(l.send_displs[j] * elem, l.send_counts[j] * elem), me, j);
  eng.alltoallv(send, l.send_counts, l.send_displs, recv, l.recv_counts, l.recv_displs, elem);

  MPI_Datatype type;
  MPI_Type_contiguous(static_cast<int>(elem), MPI_BYTE, &type);
  MPI_Type_commit(&type);
  const auto as_int = [](const std::vector<std::uint64_t>& v) { return std::vector<int>(v.begin(), v.end()); };
  const std::vector<int> sc = as_int(l.send_counts), sd = as_int(l.send_displs), rc = as_int(l.recv_counts),
                         rd = as_int(l.recv_displs);
  MPI_Alltoallv(send.data(), sc.data(), sd.data(), type, ref.data(), rc.data(), rd.data(), type, MPI_COMM_WORLD);
  MPI_Type_free(&type);

  std::uint64_t mine[3] = {0, 0, 0};
  for (int i = 0; i < n; ++i) {
    const auto got = std::span<const std::byte>(recv).subspan(l.recv_displs[i] * elem, l.recv_counts[i] * elem);
    mine[0] += fa::pattern_mismatches(got, i, me);
    mine[2] += got.size();
  }
  for (std::size_t k = 0; k < recv.size(); ++k) mine[1] += recv[k] != ref[k];
  std::uint64_t all[3];
  MPI_Allreduce(mine, all, 3, MPI_UINT64_T, MPI_SUM, MPI_COMM_WORLD);
  return {all[0], all[1], all[2]};
}

/// Sums b x b blocks of a square matrix (a 32-rank trace seen by 32 / b ranks).
fa::traffic_matrix block_sums(const fa::traffic_matrix& t, int b) {
  const auto n = static_cast<int>(t.rows()) / b;
  fa::traffic_matrix s = fa::traffic_matrix::Zero(n, n);
  for (Eigen::Index i = 0; i < t.rows(); ++i)
    for (Eigen::Index j = 0; j < t.cols(); ++j) s(i / b, j / b) += t(i, j);
  return s;
}

/// Server sizes G that divide the process count, from 1 x n to (n / 4) x 4 and beyond.
std::vector<int> shapes() {
  std::vector<int> g;
  for (int k = world_size(); k >= 1; --k)
    if (world_size() % k == 0) g.push_back(k);
  return g;
}

/// The synthetic workloads (element counts), generated identically on every rank from one seed.
std::vector<std::pair<std::string, fa::traffic_matrix>> synthetic(int n, std::uint64_t per_rank, std::uint64_t seed) {
  std::vector<std::pair<std::string, fa::traffic_matrix>> w;
  w.emplace_back("zipf(1.0)", fa::zipf_traffic(n, 1.0, per_rank, seed));
  w.emplace_back("hotspot", fa::hotspot_traffic(n, std::max(1, n / 4), 0.6, per_rank, seed));
  w.emplace_back("lognormal(1.0)", fa::lognormal_traffic(n, 1.0, per_rank, seed));
  // Many empty messages, a rank that sends nothing and a rank that receives nothing.
  fa::traffic_matrix sparse = fa::zipf_traffic(n, 1.5, per_rank, seed + 1);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j)
      if ((i + 2 * j) % 3 == 0 || i == 0 || j == n - 1) sparse(i, j) = 0;
  w.emplace_back("sparse, rank 0 sends nothing, rank n-1 receives nothing", sparse);
  return w;
}

template <fa::Decomposer D>
using mpi_engine = fa::engine<fa::two_tier_topology, fa::mpi_bootstrap, fa::mpi_transport, fa::mpi_transport, D>;

/// Every shape and workload through an engine with decomposer D, checked against MPI_Alltoallv.
/// The engine's rail window goes round 1 (stages apart), 3 (the default) and 64 (every stage at
/// once) over the shapes.
template <fa::Decomposer D>
void engine_matches_alltoallv(const std::vector<int>& gpus, std::size_t elem) {
  const int n = world_size();
  const std::size_t windows[] = {1, 3, 64};
  for (std::size_t k = 0; k < gpus.size(); ++k) {
    const int G = gpus[k];
    const std::size_t window = windows[k % 3];
    CAPTURE(window);
    fa::mpi_bootstrap boot(MPI_COMM_WORLD);
    fa::mpi_transport tr(MPI_COMM_WORLD);
    mpi_engine<D> eng(fa::mpi_world_topology(G), boot, tr, tr, {.timeout = 20s, .rail_window = window});
    for (std::uint64_t seed : {1u, 2u})
      for (const auto& named : synthetic(n, 3000, seed)) {
        const auto& [name, t] = named;
        const auto& shape = name; // CAPTURE's lambda cannot capture a structured binding before Clang 16
        CAPTURE(D::name);
        CAPTURE(G);
        CAPTURE(shape);
        CAPTURE(seed);
        const call_check c = check_call(eng, t, elem);
        CHECK(c.wrong == 0);
        CHECK(c.vs_mpi == 0);
        CHECK(c.checked == static_cast<std::uint64_t>(t.sum()) * elem);
      }
  }
}

} // namespace

TEST_CASE("engine over MPI.FAST (birkhoff) delivers what MPI_Alltoallv does, every shape and skew") {
  engine_matches_alltoallv<fa::birkhoff_decomposer>(shapes(), 4);
}

TEST_CASE("engine over MPI.a window serves calls at offsets inside it, byte for byte, nothing outside written") {
  // Buffers inside one registered window, at offsets that change every call: every put and every
  // posted receive must add the buffer's offset in the window (MPI's expects name their own
  // destination, unlike the host transport's). Fixed seeds; the pool's bytes outside the call's
  // buffers must stay as they were.
  const int n = world_size(), me = world_rank();
  std::vector<int> g = shapes();
  if (g.size() > 3) g = {g.front(), g[g.size() / 2], g.back()};
  for (const int G : g) {
    CAPTURE(G);
    fa::mpi_bootstrap boot(MPI_COMM_WORLD);
    fa::mpi_transport tr(MPI_COMM_WORLD);
    mpi_engine<fa::birkhoff_decomposer> eng(fa::mpi_world_topology(G), boot, tr, tr, {.timeout = 20s});
    std::vector<std::byte> pool(std::size_t{1} << 20, std::byte{0xEE});
    auto w = eng.register_window(pool);
    for (std::uint64_t k = 0; k < 4; ++k) {
      CAPTURE(k);
      const fa::traffic_matrix t = fa::zipf_traffic(n, 1.0, 1500 + 500 * k, 40 + k);
      const layout l = layout_of(t, me);
      const std::size_t s_at = 8 + 333 * k, r_at = (std::size_t{1} << 19) + 3 + 777 * k;
      REQUIRE(s_at + l.send_elems <= r_at);
      REQUIRE(r_at + l.recv_elems <= pool.size());
      std::fill(pool.begin(), pool.end(), std::byte{0xEE});
      const auto send = std::span(pool).subspan(s_at, l.send_elems);
      const auto recv = std::span(pool).subspan(r_at, l.recv_elems);
      for (int j = 0; j < n; ++j) fa::fill_pattern(send.subspan(l.send_displs[j], l.send_counts[j]), me, j);
      eng.alltoallv(std::span<const std::byte>(send), l.send_counts, l.send_displs, recv, l.recv_counts, l.recv_displs);
      std::uint64_t mine[2] = {0, 0}, all[2];
      std::vector<char> message(recv.size(), 0);
      for (int i = 0; i < n; ++i) {
        mine[0] += fa::pattern_mismatches(recv.subspan(l.recv_displs[i], l.recv_counts[i]), i, me);
        std::fill_n(message.begin() + static_cast<std::ptrdiff_t>(l.recv_displs[i]), l.recv_counts[i], 1);
      }
      for (std::size_t b = 0; b < pool.size(); ++b) {
        const bool in_recv = b >= r_at && b < r_at + recv.size();
        const bool in_send = b >= s_at && b < s_at + send.size();
        if ((in_recv && !message[b - r_at] && pool[b] != std::byte{0xEE}) || (!in_recv && !in_send && pool[b] != std::byte{0xEE}))
          ++mine[1];
      }
      MPI_Allreduce(mine, all, 2, MPI_UINT64_T, MPI_SUM, MPI_COMM_WORLD);
      CHECK(all[0] == 0); // received bytes unlike the sender's pattern
      CHECK(all[1] == 0); // bytes written outside every message
    }
  }
}

TEST_CASE("engine over MPI.spread-out and direct plans deliver what MPI_Alltoallv does") {
  std::vector<int> g = shapes();
  // The first and last shapes (1 x n and n x 1) and one in between are enough for the baselines.
  if (g.size() > 3) g = {g.front(), g[g.size() / 2], g.back()};
  engine_matches_alltoallv<fa::spread_out_decomposer>(g, 4);
  engine_matches_alltoallv<fa::direct_decomposer>(g, 1);
}

TEST_CASE("engine over MPI.the Megatron trace, summed down to the process count, byte for byte") {
  const std::string path = FASTA2A_WORKLOADS_DIR "/megatron-4n-32gpu.txt";
  if (!fa::testing::have_workload(path)) return;
  const int n = world_size();
  if (32 % n != 0) {
    MESSAGE("skipped: " << n << " ranks do not divide the trace's 32");
    return;
  }
  // 16 four-byte elements per token: 64 bytes, so 16 ranks move about 1 MiB each.
  const fa::traffic_matrix tokens = block_sums(fa::read_matrix(path, 32, 0), 32 / n);
  const fa::traffic_matrix t = tokens * std::uint64_t{16};
  for (int G : shapes()) {
    fa::mpi_bootstrap boot(MPI_COMM_WORLD);
    fa::mpi_transport up(MPI_COMM_WORLD), out(MPI_COMM_WORLD); // scale-up and scale-out apart
    // A granule of one token: rail splits fall between tokens.
    mpi_engine<fa::birkhoff_decomposer> eng(fa::mpi_world_topology(G), boot, up, out,
                                            {.planning = {.granule = 64}, .timeout = 20s});
    CAPTURE(G);
    const call_check c = check_call(eng, t, 4);
    CHECK(c.wrong == 0);
    CHECK(c.vs_mpi == 0);
    CHECK(c.checked == static_cast<std::uint64_t>(t.sum()) * 4);
    // The transposed matrix (the combine that follows the dispatch) on the same engine.
    const fa::traffic_matrix back = t.transpose();
    const call_check d = check_call(eng, back, 4);
    CHECK(d.wrong == 0);
    CHECK(d.vs_mpi == 0);
  }
}

TEST_CASE("engine over MPI.receive counts that disagree with the senders are an error on every rank") {
  const int me = world_rank(), n = world_size();
  fa::mpi_bootstrap boot(MPI_COMM_WORLD);
  fa::mpi_transport tr(MPI_COMM_WORLD);
  mpi_engine<fa::birkhoff_decomposer> eng(fa::mpi_world_topology(1), boot, tr, tr, {.timeout = 20s});
  const fa::traffic_matrix t = fa::uniform_traffic(n, 100 * static_cast<std::uint64_t>(n), 0);
  layout l = layout_of(t, me);
  std::vector<std::byte> send(l.send_elems), recv(l.recv_elems + 8);
  // The last rank expects one byte more from rank 0 than rank 0 sends (its buffer has room).
  if (me == n - 1) l.recv_counts[0] += 1;
  const std::string msg = error_of([&] {
    eng.alltoallv(send, l.send_counts, l.send_displs, recv, l.recv_counts, l.recv_displs);
  });
  // The last rank names the sender and both counts; the others see that its receive counts
  // disagree (a check of them travels in its header: receive counts are not gathered).
  if (me == n - 1) CHECK(contains(msg, "rank " + std::to_string(n - 1) + " expects 101 bytes from rank 0, which sends 100"));
  else CHECK(contains(msg, "rank " + std::to_string(n - 1) + "'s receive counts disagree"));
  // A rank whose own arguments do not fit its buffers: it names them, the others name it.
  if (me == n - 1) l.recv_counts[0] -= 1;
  std::vector<std::byte> small(me == 0 ? 1 : recv.size());
  const std::string bad = error_of([&] {
    eng.alltoallv(send, l.send_counts, l.send_displs, small, l.recv_counts, l.recv_displs);
  });
  CHECK(contains(bad, me == 0 ? "past the receive buffer" : "rank 0 refused its all-to-allv arguments"));
  // Nothing was sent: the same engine then runs a correct call.
  const call_check c = check_call(eng, t, 1);
  CHECK(c.wrong == 0);
  CHECK(c.vs_mpi == 0);
}

// ---------------------------------------------------------------------------------------------
// main: MPI around doctest; the exit status is the worst of all ranks.
// ---------------------------------------------------------------------------------------------

int main(int argc, char** argv) { return run_doctest_under_mpi(argc, argv, "test_mpi"); }
