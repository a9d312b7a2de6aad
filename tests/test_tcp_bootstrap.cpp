// The TCP bootstrap (include/fasta2a/tcp_bootstrap.hpp): allgathers between ranks as threads of
// one process (contents checked, many sizes), the engine started through it, and every start-up
// and allgather failure between real processes (fork): each must end on every rank with an error
// that names the problem, within the timeout (plus the grace a non-root rank waits for the root).
#include <doctest/doctest.h>

#include <fasta2a/engine.hpp>
#include <fasta2a/host.hpp>
#include <fasta2a/tcp_bootstrap.hpp>

#include <atomic>
#include <csignal>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include "conformance/engine_checks.hpp"

using namespace fasta2a;
using namespace std::chrono_literals;

namespace {

using clock_type = std::chrono::steady_clock;

/// The job secret of the tests' jobs (each process of a test holds it).
const std::string job_secret = "fasta2a-test-job-secret-6a1f0c";

tcp_bootstrap_options opts(rank_t rank, rank_t size, std::uint16_t port, std::chrono::milliseconds timeout = 10s) {
  tcp_bootstrap_options o;
  o.secret = job_secret;
  o.root_address = "127.0.0.1";
  o.port = port;
  o.rank = rank;
  o.size = size;
  o.timeout = timeout;
  return o;
}

/// Runs body(boot) on n threads, rank 0 on a listener bound to an ephemeral port; returns each
/// rank's error text (empty: none).
std::vector<std::string> on_threads(rank_t n, const std::function<void(tcp_bootstrap&)>& body,
                                    std::chrono::milliseconds timeout = 10s) {
  tcp_listener listener(0, "127.0.0.1");
  std::vector<std::string> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (rank_t r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        tcp_bootstrap boot = r == 0 ? tcp_bootstrap(listener, opts(0, n, 0, timeout))
                                    : tcp_bootstrap(opts(r, n, listener.port(), timeout));
        body(boot);
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

std::byte content(rank_t r, std::uint64_t call, std::size_t i) {
  return static_cast<std::byte>((static_cast<std::uint64_t>(r) * 131 + call * 31 + i * 7 + (i >> 8)) & 0xff);
}

// ---- processes ------------------------------------------------------------------------------

/// In a forked child: when the step under test began (the fork, unless the body says otherwise).
clock_type::time_point step_start;

/// A forked process running one rank: it writes "<ms> <error text>" (or "<ms> ok") to a pipe, the
/// milliseconds counted from step_start.
struct child {
  pid_t pid = -1;
  int out = -1;
  std::string text;
  double seconds = -1; // from step_start to the end of the body, measured by the child
  bool finished = false;
};

child spawn(const std::function<void()>& body) {
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  step_start = clock_type::now();
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::close(fds[0]);
    std::string msg;
    try {
      body();
      msg = "ok";
    } catch (const std::exception& e) {
      msg = e.what();
    }
    const long ms = std::chrono::duration_cast<std::chrono::milliseconds>(clock_type::now() - step_start).count();
    const std::string line = std::to_string(ms) + " " + msg;
    [[maybe_unused]] const auto w = ::write(fds[1], line.data(), line.size());
    ::_exit(0);
  }
  ::close(fds[1]);
  child c;
  c.pid = pid;
  c.out = fds[0];
  return c;
}

/// Reads every child's report, waiting at most `limit` (and no longer once every child but
/// `stopped` has reported); kills (by pid) and reaps those still running then.
void collect(std::vector<child>& cs, std::chrono::milliseconds limit, std::size_t stopped = SIZE_MAX) {
  const auto deadline = clock_type::now() + limit;
  for (;;) {
    std::vector<pollfd> fds;
    std::vector<child*> who;
    bool others = false;
    for (std::size_t k = 0; k < cs.size(); ++k)
      if (!cs[k].finished) {
        fds.push_back({cs[k].out, POLLIN, 0});
        who.push_back(&cs[k]);
        others = others || k != stopped;
      }
    if (fds.empty() || !others || clock_type::now() >= deadline) break;
    ::poll(fds.data(), fds.size(), 50);
    for (std::size_t i = 0; i < fds.size(); ++i) {
      if (!fds[i].revents) continue;
      char buf[4096];
      const ssize_t n = ::read(fds[i].fd, buf, sizeof buf);
      if (n > 0) who[i]->text.append(buf, static_cast<std::size_t>(n));
      else who[i]->finished = true;
    }
  }
  for (auto& c : cs) {
    if (!c.finished) ::kill(c.pid, SIGKILL);
    ::waitpid(c.pid, nullptr, 0);
    ::close(c.out);
    if (const auto sp = c.text.find(' '); sp != std::string::npos) {
      c.seconds = std::stod(c.text.substr(0, sp)) / 1000;
      c.text = c.text.substr(sp + 1);
    }
  }
}

/// A free port on loopback, closed again (a connection to it is refused).
std::uint16_t free_port() {
  tcp_listener l(0, "127.0.0.1");
  return l.port();
}

/// A port whose root process will listen on it: bound by a listener the child inherits.
struct root_port {
  tcp_listener listener{0, "127.0.0.1"};
  std::uint16_t port() const { return listener.port(); }
};

constexpr auto timeout = 2000ms;
constexpr double slack_s = 2.0; // scheduling on a loaded 2-core machine (load averages of 20-40 seen)

void check_in_time(const child& c, double limit_s) {
  MESSAGE("pid " << c.pid << " ended after " << c.seconds << " s: " << c.text);
  CHECK(c.finished);
  CHECK(c.seconds >= 0);
  CHECK(c.seconds <= limit_s);
}

} // namespace

// ---- ranks as threads -----------------------------------------------------------------------

TEST_CASE("tcp_bootstrap.threads.allgathers_deliver_every_rank_blob_in_rank_order") {
  for (rank_t n : {1, 2, 3, 5, 16}) {
    CAPTURE(n);
    constexpr int calls = 40;
    const auto errors = on_threads(n, [&](tcp_bootstrap& b) {
      std::mt19937_64 sizes(1234 + static_cast<unsigned>(n)); // the same sizes on every rank
      for (std::uint64_t call = 1; call <= calls; ++call) {
        const std::size_t len = sizes() % 5 == 0 ? 0 : sizes() % (call % 7 == 0 ? 70000 : 300);
        std::vector<std::byte> mine(len), all(len * static_cast<std::size_t>(n), std::byte{0xEE});
        for (std::size_t i = 0; i < len; ++i) mine[i] = content(b.rank(), call, i);
        b.allgather(mine, all);
        for (rank_t r = 0; r < n; ++r)
          for (std::size_t i = 0; i < len; ++i)
            if (all[static_cast<std::size_t>(r) * len + i] != content(r, call, i))
              throw error("call " + std::to_string(call) + ": byte " + std::to_string(i) + " of rank " + std::to_string(r) + " is wrong");
      }
    });
    for (rank_t r = 0; r < n; ++r) {
      INFO("rank " << r << ": " << errors[static_cast<std::size_t>(r)]);
      CHECK(errors[static_cast<std::size_t>(r)].empty());
    }
  }
}

TEST_CASE("tcp_bootstrap.threads.an_id_string_replaces_address_and_port") {
  tcp_listener l(0, "127.0.0.1");
  const std::string id = l.id("127.0.0.1");
  CHECK(id == "127.0.0.1:" + std::to_string(l.port()));
  std::string err1;
  std::thread t([&] {
    try {
      tcp_bootstrap_options o;
      o.id = id;
      o.secret = job_secret;
      o.rank = 1;
      o.size = 2;
      o.timeout = 5s;
      tcp_bootstrap b(o);
      std::vector<std::byte> mine{std::byte{1}}, all(2);
      b.allgather(mine, all);
      if (all[0] != std::byte{0} || all[1] != std::byte{1}) err1 = "wrong bytes";
    } catch (const std::exception& e) {
      err1 = e.what();
    }
  });
  tcp_bootstrap b(l, opts(0, 2, 0, 5s));
  std::vector<std::byte> mine{std::byte{0}}, all(2);
  b.allgather(mine, all);
  t.join();
  CHECK(err1.empty());
  CHECK(all[1] == std::byte{1});
}

TEST_CASE("tcp_bootstrap.threads.blobs_of_different_sizes_fail_on_every_rank_naming_the_rank") {
  const auto errors = on_threads(4, [](tcp_bootstrap& b) {
    const std::size_t len = b.rank() == 2 ? 5 : 4;
    std::vector<std::byte> mine(len), all(len * 4);
    b.allgather(mine, all);
  });
  for (const auto& e : errors) {
    INFO(e);
    CHECK(e.find("differ in size") != std::string::npos);
    CHECK(e.find("rank 2 (") != std::string::npos);
    CHECK(e.find("has 5 bytes") != std::string::npos);
    CHECK(e.find("has 4") != std::string::npos);
  }
  // And the bootstrap stays broken: the next call throws at once.
  const auto again = on_threads(2, [](tcp_bootstrap& b) {
    std::vector<std::byte> mine(b.rank() == 1 ? 2 : 1), all(mine.size() * 2);
    try {
      b.allgather(mine, all);
    } catch (const error&) {
    }
    std::vector<std::byte> m1(1), a1(2);
    b.allgather(m1, a1);
  });
  for (const auto& e : again) CHECK(e.find("unusable after an earlier failure") != std::string::npos);
}

TEST_CASE("tcp_bootstrap.options.bad_values_are_clear_errors") {
  CHECK_THROWS_WITH(tcp_bootstrap(opts(4, 4, 1234)), doctest::Contains("rank 4 is outside [0, 4)"));
  CHECK_THROWS_WITH(tcp_bootstrap(opts(-1, 4, 1234)), doctest::Contains("rank -1 is outside [0, 4)"));
  CHECK_THROWS_WITH(tcp_bootstrap(opts(0, 0, 1234)), doctest::Contains("world size must be at least 1"));
  CHECK_THROWS_WITH(tcp_bootstrap(opts(1, 2, 0)), doctest::Contains("port is 0"));
  tcp_bootstrap_options o = opts(1, 2, 0);
  o.id = "nohostport";
  CHECK_THROWS_WITH(tcp_bootstrap{o}, doctest::Contains("is not host:port"));
  o.id = "h:70000";
  CHECK_THROWS_WITH(tcp_bootstrap{o}, doctest::Contains("port must be 1..65535"));
  // A world of one needs nobody.
  tcp_bootstrap one(opts(0, 1, 0));
  std::vector<std::byte> mine{std::byte{9}}, all(1);
  one.allgather(mine, all);
  CHECK(all[0] == std::byte{9});
  CHECK_THROWS_WITH(one.allgather(mine, std::span<std::byte>()), doctest::Contains("the output holds 0 bytes"));
}

TEST_CASE("tcp_bootstrap.options.from_the_environment_with_fasta2a_overrides") {
  ::setenv("MASTER_ADDR", "10.1.2.3", 1);
  ::setenv("MASTER_PORT", "29500", 1);
  ::setenv("RANK", "3", 1);
  ::setenv("WORLD_SIZE", "8", 1);
  ::setenv("FASTA2A_RANK", "5", 1);
  ::setenv("FASTA2A_BOOTSTRAP_TIMEOUT", "2.5", 1);
  auto o = tcp_bootstrap_options::from_env();
  CHECK(o.root_address == "10.1.2.3");
  CHECK(o.port == 29500);
  CHECK(o.rank == 5);
  CHECK(o.size == 8);
  CHECK(o.timeout == 2500ms);
  ::setenv("FASTA2A_BOOTSTRAP_ID", "node7:4000", 1);
  o = tcp_bootstrap_options::from_env();
  CHECK(o.id == "node7:4000");
  ::setenv("WORLD_SIZE", "eight", 1);
  CHECK_THROWS_WITH(tcp_bootstrap_options::from_env(), doctest::Contains("WORLD_SIZE='eight' is not an integer"));
  ::setenv("WORLD_SIZE", "8", 1);
  ::setenv("FASTA2A_BOOTSTRAP_ID", "node7", 1);
  CHECK_THROWS_WITH(tcp_bootstrap_options::from_env(), doctest::Contains("FASTA2A_BOOTSTRAP_ID 'node7' is not host:port"));
  for (const char* v : {"MASTER_ADDR", "MASTER_PORT", "RANK", "FASTA2A_RANK", "FASTA2A_BOOTSTRAP_TIMEOUT", "FASTA2A_BOOTSTRAP_ID"})
    ::unsetenv(v);
  CHECK_THROWS_WITH(tcp_bootstrap_options::from_env(), doctest::Contains("RANK (or FASTA2A_RANK) is not set"));
  ::unsetenv("WORLD_SIZE");
}

TEST_CASE("tcp_bootstrap.threads.a_stray_connection_is_closed_and_the_ranks_still_start") {
  tcp_listener l(0, "127.0.0.1");
  // A stray client: garbage instead of the magic word.
  std::string stray_saw = "nothing";
  std::thread stray([&] {
    detail::tcp_fd fd(::socket(AF_INET, SOCK_STREAM, 0));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(l.port());
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) return;
    const char junk[] = "GET / HTTP/1.0\r\n\r\n";
    [[maybe_unused]] auto w = ::send(fd.get(), junk, sizeof junk, MSG_NOSIGNAL);
    char buf[16];
    pollfd p{fd.get(), POLLIN, 0};
    ::poll(&p, 1, 5000);
    // Closed by the root: an orderly end, or a reset since the root left the junk unread.
    const ssize_t n = ::recv(fd.get(), buf, sizeof buf, 0);
    stray_saw = n == 0 || (n < 0 && errno == ECONNRESET) ? "closed" : "data or another error";
  });
  std::string err1;
  std::thread one([&] {
    std::this_thread::sleep_for(100ms); // after the stray
    try {
      tcp_bootstrap b(opts(1, 2, l.port(), 5s));
      std::vector<std::byte> m(3), a(6);
      b.allgather(m, a);
    } catch (const std::exception& e) {
      err1 = e.what();
    }
  });
  tcp_bootstrap b(l, opts(0, 2, 0, 5s));
  std::vector<std::byte> m(3), a(6);
  b.allgather(m, a);
  one.join();
  stray.join();
  CHECK(err1.empty());
  CHECK(stray_saw == "closed");
}

TEST_CASE("tcp_bootstrap.threads.another_protocol_version_is_told_why") {
  tcp_listener l(0, "127.0.0.1");
  std::string reply;
  std::thread other([&] {
    detail::tcp_fd fd(::socket(AF_INET, SOCK_STREAM, 0));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(l.port());
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) return;
    std::vector<std::byte> hello;
    detail::tcp_put(hello, detail::tcp_magic_hello, 4);
    detail::tcp_put(hello, 99, 4); // version
    detail::tcp_put(hello, 1, 4);  // rank
    detail::tcp_put(hello, 2, 4);  // size
    detail::tcp_put(hello, 0, 2);  // no name
    [[maybe_unused]] auto w = ::send(fd.get(), hello.data(), hello.size(), MSG_NOSIGNAL);
    char buf[512];
    ssize_t n = 0, k = 0;
    while ((k = ::recv(fd.get(), buf + n, sizeof buf - static_cast<std::size_t>(n), 0)) > 0) n += k;
    if (n > 12) reply.assign(buf + 12, static_cast<std::size_t>(n - 12));
  });
  CHECK_THROWS_WITH(tcp_bootstrap(l, opts(0, 2, 0, 1500ms)), doctest::Contains("rank 1 of 2 did not arrive within 1.5 s"));
  other.join();
  CHECK(reply.find("version 99") != std::string::npos);
}

// ---- the engine, started through the TCP bootstrap --------------------------------------------

TEST_CASE("tcp_bootstrap.engine.host_transport_byte_exact") {
  const two_tier_topology topo(3, 2);
  const rank_t n = topo.ranks();
  std::mt19937_64 rng(77);
  std::vector<traffic_matrix> calls;
  for (int c = 0; c < 4; ++c) calls.push_back(testing::skewed_traffic(n, rng, 4));
  host_fabric fabric(n, 20s);
  std::atomic<long long> checked{0};
  const auto errors = on_threads(n, [&](tcp_bootstrap& boot) {
    host_transport tr(fabric, boot.rank());
    engine<two_tier_topology, tcp_bootstrap, host_transport, host_transport> eng(topo, boot, tr, tr);
    for (const auto& t : calls) {
      testing::engine_call_checked(eng, t, boot.rank(), 4);
      checked += static_cast<long long>(t.col(boot.rank()).sum());
    }
  }, 20s);
  long long expected = 0;
  for (const auto& t : calls) expected += static_cast<long long>(t.sum());
  CHECK(expected > 0);
  CHECK(checked.load() == expected);
  for (const auto& e : errors) {
    INFO(e);
    CHECK(e.empty());
  }
}

// ---- start-up failures between processes --------------------------------------------------------

TEST_CASE("tcp_bootstrap.process.ranks_that_disagree_on_the_world_size_all_fail_naming_both_sizes") {
  root_port rp;
  std::vector<child> cs;
  cs.push_back(spawn([&] { tcp_bootstrap b(rp.listener, opts(0, 3, 0, timeout)); }));
  cs.push_back(spawn([&] { tcp_bootstrap b(opts(1, 3, rp.port(), timeout)); }));
  cs.push_back(spawn([&] { tcp_bootstrap b(opts(2, 4, rp.port(), timeout)); }));
  collect(cs, 20s);
  for (const auto& c : cs) {
    INFO(c.text);
    CHECK(c.text.find("disagree on the world size") != std::string::npos);
    CHECK(c.text.find("rank 2 (") != std::string::npos);
    CHECK(c.text.find("says 4 ranks") != std::string::npos);
    CHECK(c.text.find("says 3") != std::string::npos);
    check_in_time(c, 2 + slack_s);
  }
}

TEST_CASE("tcp_bootstrap.process.a_rank_claimed_twice_fails_naming_the_rank_and_both_processes") {
  root_port rp;
  std::vector<child> cs;
  cs.push_back(spawn([&] { tcp_bootstrap b(rp.listener, opts(0, 3, 0, timeout)); }));
  cs.push_back(spawn([&] { tcp_bootstrap b(opts(1, 3, rp.port(), timeout)); }));
  cs.push_back(spawn([&] { tcp_bootstrap b(opts(1, 3, rp.port(), timeout)); }));
  collect(cs, 20s);
  for (const auto& c : cs) {
    INFO(c.text);
    CHECK(c.text.find("rank 1 was claimed twice") != std::string::npos);
    CHECK(c.text.find("(pid " + std::to_string(cs[1].pid) + ")") != std::string::npos);
    CHECK(c.text.find("(pid " + std::to_string(cs[2].pid) + ")") != std::string::npos);
    check_in_time(c, 2 + slack_s);
  }
}

TEST_CASE("tcp_bootstrap.process.a_root_that_is_not_there_is_named_with_its_address") {
  const std::uint16_t port = free_port();
  std::vector<child> cs;
  cs.push_back(spawn([&] { tcp_bootstrap b(opts(1, 2, port, timeout)); }));
  cs.push_back(spawn([&] {
    tcp_bootstrap_options o = opts(1, 2, port, timeout);
    o.root_address = "no-such-host.invalid";
    tcp_bootstrap b(o);
  }));
  collect(cs, 20s);
  INFO(cs[0].text);
  CHECK(cs[0].text.find("could not reach the root at 127.0.0.1:" + std::to_string(port) + " within 2 s") != std::string::npos);
  CHECK(cs[0].text.find("Connection refused") != std::string::npos);
  CHECK(cs[0].seconds >= 1.9);
  check_in_time(cs[0], 2 + slack_s);
  INFO(cs[1].text);
  CHECK(cs[1].text.find("could not reach the root at no-such-host.invalid:") != std::string::npos);
  CHECK(cs[1].text.find("cannot resolve") != std::string::npos);
  check_in_time(cs[1], 2 + slack_s);
}

TEST_CASE("tcp_bootstrap.process.ranks_that_never_arrive_are_named_by_the_root_and_the_others_told") {
  root_port rp;
  std::vector<child> cs;
  cs.push_back(spawn([&] { tcp_bootstrap b(rp.listener, opts(0, 4, 0, timeout)); }));
  cs.push_back(spawn([&] { tcp_bootstrap b(opts(2, 4, rp.port(), timeout)); }));
  collect(cs, 20s);
  INFO(cs[0].text);
  CHECK(cs[0].text.find("ranks 1, 3 of 4 did not arrive within 2 s") != std::string::npos);
  CHECK(cs[0].seconds >= 1.9);
  check_in_time(cs[0], 2 + 1 + slack_s); // the timeout, then the grace for late ranks
  INFO(cs[1].text);
  CHECK(cs[1].text.find("gave up: ranks 1, 3 of 4 did not arrive") != std::string::npos);
  check_in_time(cs[1], 2 + slack_s); // told at once, not after the root's grace
}

TEST_CASE("tcp_bootstrap.process.a_rank_arriving_after_the_root_gave_up_is_told_why_and_when") {
  // Rank 1 starts 0.5 s after the root gave up on it: within the root's grace it hears the
  // verdict, how long before it the root gave up, and at what time (not "Connection refused").
  root_port rp;
  std::vector<child> cs;
  cs.push_back(spawn([&] { tcp_bootstrap b(rp.listener, opts(0, 2, 0, timeout)); }));
  cs.push_back(spawn([&] {
    std::this_thread::sleep_for(timeout + 500ms);
    tcp_bootstrap b(opts(1, 2, rp.port(), timeout));
  }));
  collect(cs, 20s);
  INFO(cs[0].text);
  CHECK(cs[0].text.find("rank 1 of 2 did not arrive within 2 s") != std::string::npos);
  INFO(cs[1].text);
  CHECK(cs[1].text.find("gave up: it had given up 0.") != std::string::npos);
  CHECK(cs[1].text.find(" s before this rank arrived (at ") != std::string::npos);
  CHECK(cs[1].text.find("UTC): rank 1 of 2 did not arrive within 2 s") != std::string::npos);
  check_in_time(cs[1], 2.5 + slack_s);
}

// ---- allgather failures between processes ------------------------------------------------------

namespace {

constexpr auto gather_timeout = 3000ms; // grace 1.5 s

/// How the odd rank fails: it exits, sleeps (alive, elsewhere) or stops (SIGSTOP).
enum class odd_rank { dies, sleeps, stops };

/// Three processes start a bootstrap and do one good allgather; then rank `odd` exits, sleeps past
/// the timeout and the grace, or stops itself, while the others start a second allgather (the step
/// timed).
std::vector<child> fail_in_allgather(rank_t odd, odd_rank how) {
  root_port rp;
  std::vector<child> cs;
  for (rank_t r = 0; r < 3; ++r)
    cs.push_back(spawn([&, r] {
      tcp_bootstrap b = r == 0 ? tcp_bootstrap(rp.listener, opts(0, 3, 0, gather_timeout))
                               : tcp_bootstrap(opts(r, 3, rp.port(), gather_timeout));
      std::vector<std::byte> m(100, static_cast<std::byte>(r)), a(300);
      b.allgather(m, a);
      if (r == odd) {
        if (how == odd_rank::dies) ::_exit(3); // gone without a word, mid-collective for the others
        if (how == odd_rank::stops) ::raise(SIGSTOP); // killed by collect
        std::this_thread::sleep_for(gather_timeout * 2);
        return;
      }
      step_start = clock_type::now();
      b.allgather(m, a);
    }));
  collect(cs, 30s, how == odd_rank::stops ? static_cast<std::size_t>(odd) : SIZE_MAX);
  return cs;
}

} // namespace

TEST_CASE("tcp_bootstrap.process.a_rank_that_dies_mid_allgather_is_named_on_every_rank_at_once") {
  auto cs = fail_in_allgather(2, odd_rank::dies);
  for (rank_t r : {0, 1}) {
    const child& c = cs[static_cast<std::size_t>(r)];
    INFO(c.text);
    CHECK(c.text.find("allgather #2: rank 2 (") != std::string::npos);
    CHECK(c.text.find("closed its connection") != std::string::npos);
    check_in_time(c, 1.5); // a closed socket is seen at once, not at the 3 s timeout
  }
}

TEST_CASE("tcp_bootstrap.process.a_rank_that_stops_mid_allgather_is_named_within_the_timeout") {
  auto cs = fail_in_allgather(1, odd_rank::sleeps);
  for (rank_t r : {0, 2}) {
    const child& c = cs[static_cast<std::size_t>(r)];
    INFO(c.text);
    CHECK(c.text.find("allgather #2: rank 1 (") != std::string::npos);
    CHECK(c.text.find("did not send its blob within 3 s") != std::string::npos);
    CHECK(c.text.find("rank 1 answers a roll call (alive, waiting elsewhere)") != std::string::npos); // not blamed as dead
    CHECK(c.seconds >= 2.9);
    check_in_time(c, 3 + slack_s);
  }
}

TEST_CASE("tcp_bootstrap.process.a_root_that_dies_mid_allgather_is_named") {
  auto cs = fail_in_allgather(0, odd_rank::dies);
  for (rank_t r : {1, 2}) {
    const child& c = cs[static_cast<std::size_t>(r)];
    INFO(c.text);
    CHECK(c.text.find("the root (rank 0 at 127.0.0.1:") != std::string::npos);
    CHECK(c.text.find("closed the connection during allgather #2") != std::string::npos);
    check_in_time(c, 1.5); // at once, not at the 3 s timeout
  }
}

TEST_CASE("tcp_bootstrap.process.a_root_that_stops_mid_allgather_is_named_after_timeout_and_grace") {
  auto cs = fail_in_allgather(0, odd_rank::sleeps);
  for (rank_t r : {1, 2}) {
    const child& c = cs[static_cast<std::size_t>(r)];
    INFO(c.text);
    CHECK(c.text.find("the root (rank 0 at 127.0.0.1:") != std::string::npos);
    CHECK(c.text.find("did not answer allgather #2 within 4.5 s") != std::string::npos);
    CHECK(c.seconds >= 4.4);
    check_in_time(c, 4.5 + slack_s);
  }
}

TEST_CASE("tcp_bootstrap.process.a_rank_stopped_mid_allgather_is_named_by_a_roll_call") {
  auto cs = fail_in_allgather(1, odd_rank::stops);
  for (rank_t r : {0, 2}) {
    const child& c = cs[static_cast<std::size_t>(r)];
    INFO(c.text);
    CHECK(c.text.find("allgather #2: rank 1 (") != std::string::npos);
    CHECK(c.text.find("rank 1 does not answer a roll call (stopped, dead or unreachable)") != std::string::npos);
    CHECK(c.seconds >= 2.9);
    check_in_time(c, 3 + 0.75 + slack_s); // the timeout, then a roll call of at most grace / 2
  }
}

TEST_CASE("tcp_bootstrap.process.a_root_stopped_mid_allgather_is_named_by_a_roll_call_before_the_grace") {
  auto cs = fail_in_allgather(0, odd_rank::stops);
  for (rank_t r : {1, 2}) {
    const child& c = cs[static_cast<std::size_t>(r)];
    INFO(c.text);
    CHECK(c.text.find("the root (rank 0 at 127.0.0.1:") != std::string::npos);
    CHECK(c.text.find("did not answer allgather #2 within 3 s, and rank 0 does not answer a roll call") != std::string::npos);
    CHECK(c.seconds >= 2.9);
    check_in_time(c, 3 + 0.75 + slack_s); // not the 4.5 s of timeout and grace a live root gets
  }
}

TEST_CASE("tcp_bootstrap.process.a_roll_call_names_exactly_the_stopped_and_dead_ranks") {
  // Five ranks; after two allgathers (and a roll call that names none) rank 2 stops and rank 4
  // dies: every survivor's roll call names exactly those two, after its whole second.
  root_port rp;
  std::vector<child> cs;
  for (rank_t r = 0; r < 5; ++r)
    cs.push_back(spawn([&, r] {
      tcp_bootstrap b = r == 0 ? tcp_bootstrap(rp.listener, opts(0, 5, 0, 5s)) : tcp_bootstrap(opts(r, 5, rp.port(), 5s));
      std::vector<std::byte> m(8, static_cast<std::byte>(r)), a(40);
      b.allgather(m, a);
      const auto all_here = b.roll_call(2s);
      if (!all_here || !all_here->empty()) throw error("before: the roll call named ranks");
      b.allgather(m, a); // every rank's first roll call is over
      if (r == 2) ::raise(SIGSTOP); // killed by collect
      if (r == 4) ::raise(SIGKILL); // dead at once (an _exit under TSan runs its finalisation first)
      std::this_thread::sleep_for(500ms); // rank 2 stopped, rank 4 gone
      const auto t0 = clock_type::now();
      const auto missing = b.roll_call(1s);
      const double took = std::chrono::duration<double>(clock_type::now() - t0).count();
      if (!missing) throw error("no roll call");
      std::string names;
      for (rank_t k : *missing) names += std::to_string(k) + " ";
      if (names != "2 4 ") throw error("the roll call named '" + names + "'");
      if (took < 0.9) throw error("the roll call ended before its second: " + std::to_string(took));
      const std::string clause = b.roll_call_clause();
      if (clause.find("; ranks 2, 4 do not answer a roll call (stopped, dead or unreachable)") == std::string::npos)
        throw error("the clause: " + clause);
    }));
  collect(cs, 20s, 2);
  for (rank_t r : {0, 1, 3}) {
    const child& c = cs[static_cast<std::size_t>(r)];
    INFO("rank " << r << ": " << c.text);
    CHECK(c.text == "ok");
  }
}

TEST_CASE("tcp_bootstrap.threads.a_roll_call_of_ranks_that_are_all_there_names_none") {
  for (rank_t n : {2, 3, 5, 16}) {
    CAPTURE(n);
    const auto errors = on_threads(n, [&](tcp_bootstrap& b) {
      for (int k = 0; k < 3; ++k) { // while the others ask too, and between allgathers
        const auto missing = b.roll_call(5s);
        if (!missing) throw error("no roll call could be held");
        if (!missing->empty()) throw error("rank " + std::to_string((*missing)[0]) + " did not answer");
        b.allgather({}, {});
      }
      const std::string clause = b.roll_call_clause();
      b.allgather({}, {}); // no rank goes (and stops answering) before every rank's last roll call
      if (clause.find("every rank answers a roll call") == std::string::npos) throw error("the clause: " + clause);
    });
    for (rank_t r = 0; r < n; ++r) {
      INFO("rank " << r << ": " << errors[static_cast<std::size_t>(r)]);
      CHECK(errors[static_cast<std::size_t>(r)].empty());
    }
  }
}

TEST_CASE("tcp_bootstrap.roll_call.only_the_jobs_ranks_get_an_answer") {
  // A responder for rank 1 of a job; askers as rank 0 with the right secret and job id, another
  // secret, another job id; and a stranger's raw datagrams, which get nothing back.
  sockaddr_storage lo{};
  auto& lo4 = reinterpret_cast<sockaddr_in&>(lo);
  lo4.sin_family = AF_INET;
  lo4.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  detail::tcp_roll_call here(job_secret, "job-a", 1, lo);
  REQUIRE(here.address()[0] == std::byte{4});
  const auto asks = [&](const std::string& secret, const std::string& job) {
    detail::tcp_roll_call asker(secret, job, 0, lo);
    std::vector<std::byte> table(asker.address().begin(), asker.address().end());
    table.insert(table.end(), here.address().begin(), here.address().end());
    asker.set_peers(table);
    const std::vector<rank_t> one{1};
    const auto missing = asker.missing(one, 500ms);
    REQUIRE(missing.has_value());
    return missing->empty();
  };
  CHECK(asks(job_secret, "job-a"));
  CHECK_FALSE(asks("another-secret-of-16-bytes-or-more", "job-a"));
  CHECK_FALSE(asks(job_secret, "job-b"));
  // Raw datagrams: garbage, a question with a wrong proof, one for another rank: no answer.
  detail::tcp_fd u(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  socklen_t len = 0;
  const sockaddr_storage to = detail::tcp_roll_decode(here.address(), len);
  std::mt19937_64 rng(50);
  for (int k = 0; k < 64; ++k) {
    std::vector<std::byte> d(k % 4 == 0 ? detail::tcp_roll_bytes : rng() % 200);
    for (auto& b : d) b = static_cast<std::byte>(rng());
    if (d.size() == detail::tcp_roll_bytes) { // well formed but unproven: ping, version, asker 0, rank 1 or 2
      d.clear();
      detail::tcp_put(d, detail::tcp_magic_ping, 4);
      detail::tcp_put(d, detail::tcp_version, 4);
      detail::tcp_put(d, 0, 4);
      detail::tcp_put(d, k % 8 == 0 ? 1 : 2, 4);
      while (d.size() < detail::tcp_roll_bytes) d.push_back(static_cast<std::byte>(rng()));
    }
    ::sendto(u.get(), d.data(), d.size(), 0, reinterpret_cast<const sockaddr*>(&to), len);
  }
  pollfd p{u.get(), POLLIN, 0};
  CHECK(::poll(&p, 1, 300) == 0); // nothing came back
  CHECK(asks(job_secret, "job-a")); // and it still answers the job
}
