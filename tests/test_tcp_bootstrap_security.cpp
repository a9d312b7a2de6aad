// The TCP bootstrap as an attacker on the same network would try it (issue 50): impostors before
// and after the real rank, a fake root, two jobs on one port, the one-packet abort, idle and
// garbage connections, a peer's terminal escapes, the file-descriptor limit. Each job must go on
// with its own ranks (or fail naming the intruder), and no stranger may receive a byte of the
// job's data. Included after test_tcp_bootstrap.cpp (its helpers: opts, on_threads, spawn,
// collect, job_secret).

#include <net/if.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/resource.h>

namespace {

/// A raw client of the root's port: what a stranger on the network can do.
struct raw_client {
  detail::tcp_fd fd;
  explicit raw_client(std::uint16_t port) : fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::connect(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  }
  void send(const std::vector<std::byte>& b) const {
    [[maybe_unused]] auto w = ::send(fd.get(), b.data(), b.size(), MSG_NOSIGNAL);
  }
  /// What it receives until the root closes the connection, `limit` passes, or `n` bytes are in.
  std::vector<std::byte> read_n(std::size_t n, std::chrono::milliseconds limit) const {
    std::vector<std::byte> got;
    const auto until = clock_type::now() + limit;
    while (got.size() < n && clock_type::now() < until) {
      pollfd p{fd.get(), POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      std::byte buf[4096];
      const ssize_t k = ::recv(fd.get(), buf, std::min(sizeof buf, n - got.size()), 0);
      if (k <= 0) break;
      got.insert(got.end(), buf, buf + k);
    }
    return got;
  }
  /// Everything it receives until the root closes the connection or `limit` passes.
  std::vector<std::byte> read_all(std::chrono::milliseconds limit) const { return read_n(SIZE_MAX, limit); }
};

std::vector<std::byte> hello_v2(const detail::tcp_nonce& nonce) {
  std::vector<std::byte> h;
  detail::tcp_put(h, detail::tcp_magic_hello, 4);
  detail::tcp_put(h, detail::tcp_version, 4);
  h.insert(h.end(), nonce.begin(), nonce.end());
  return h;
}

/// A claim of `rank` of `size` named `name`, proved with `secret` over the nonces (the root's
/// challenge `challenge`), as a member would send it.
std::vector<std::byte> claim(const std::string& secret, const detail::tcp_nonce& mine, const std::vector<std::byte>& challenge,
                             std::int64_t rank, std::int64_t size, const std::string& name) {
  detail::tcp_nonce theirs{};
  REQUIRE(challenge.size() == detail::tcp_challenge_bytes);
  std::memcpy(theirs.data(), challenge.data() + 8, theirs.size());
  std::vector<std::byte> fields;
  detail::tcp_put(fields, static_cast<std::uint32_t>(rank), 4);
  detail::tcp_put(fields, static_cast<std::uint32_t>(size), 4);
  detail::tcp_put(fields, name.size(), 2);
  for (char c : name) fields.push_back(static_cast<std::byte>(c));
  std::vector<std::byte> c;
  detail::tcp_put(c, detail::tcp_magic_claim, 4);
  c.insert(c.end(), fields.begin(), fields.end());
  const detail::tcp_mac m = detail::tcp_prove(secret, "rank", theirs, mine, "", fields);
  c.insert(c.end(), m.begin(), m.end());
  return c;
}

/// A 2-rank job (rank 0 on `l`, rank 1 started after `delay`) doing one allgather of 64 bytes;
/// returns both ranks' errors and whether rank 1 received rank 0's blob intact.
struct small_job {
  std::string err0, err1;
  bool blobs_ok = false;
};
small_job run_small_job(tcp_listener& l, std::chrono::milliseconds delay, tcp_bootstrap_options o0 = opts(0, 2, 0, 5s),
                        tcp_bootstrap_options o1 = {}) {
  small_job j;
  if (o1.size == 1) o1 = opts(1, 2, l.port(), 5s);
  std::thread one([&] {
    std::this_thread::sleep_for(delay);
    try {
      tcp_bootstrap b(o1);
      std::vector<std::byte> m(64, std::byte{0x11}), a(128);
      b.allgather(m, a);
      j.blobs_ok = std::all_of(a.begin(), a.begin() + 64, [](std::byte x) { return x == std::byte{0x22}; }) &&
                   std::all_of(a.begin() + 64, a.end(), [](std::byte x) { return x == std::byte{0x11}; });
    } catch (const std::exception& e) {
      j.err1 = e.what();
    }
  });
  try {
    tcp_bootstrap b(l, o0);
    std::vector<std::byte> m(64, std::byte{0x22}), a(128);
    b.allgather(m, a);
  } catch (const std::exception& e) {
    j.err0 = e.what();
  }
  one.join();
  return j;
}

} // namespace

TEST_CASE("tcp_bootstrap.security.an_impostor_before_the_real_rank_is_dropped_and_gets_no_byte_of_the_job") {
  // A stranger who does not hold the secret claims rank 1 before the real rank 1 starts: its
  // claim's MAC fails, it is dropped, and the real rank 1 joins. (Without a secret anyone could
  // take a free rank first: which is why a bootstrap off loopback needs one.)
  tcp_listener l(0, "127.0.0.1");
  std::vector<std::byte> after_claim, challenge;
  std::thread impostor([&] {
    raw_client c(l.port());
    const auto nonce = detail::tcp_random_nonce();
    c.send(hello_v2(nonce));
    challenge = c.read_n(detail::tcp_challenge_bytes, 3s);
    if (challenge.size() != detail::tcp_challenge_bytes) return;
    c.send(claim("not the job's secret, guessed", nonce, challenge, 1, 2, "impostor"));
    after_claim = c.read_all(3s);
  });
  const small_job j = run_small_job(l, 300ms);
  impostor.join();
  INFO(j.err0 << " | " << j.err1);
  CHECK(j.err0.empty());
  CHECK(j.err1.empty());
  CHECK(j.blobs_ok);
  CHECK(challenge.size() == detail::tcp_challenge_bytes); // a nonce and a MAC: nothing of the job
  CHECK(after_claim.empty());                              // dropped without a word
}

TEST_CASE("tcp_bootstrap.security.an_impostor_after_the_real_rank_is_dropped_and_the_job_goes_on") {
  // Usually the root has stopped listening by then (its start-up is done); on a loaded machine it
  // may still be in it, and then the impostor gets a challenge and is dropped at its claim.
  tcp_listener l(0, "127.0.0.1");
  std::vector<std::byte> challenge, after_claim;
  std::thread impostor([&] {
    std::this_thread::sleep_for(200ms);
    try {
      raw_client c(l.port());
      const auto nonce = detail::tcp_random_nonce();
      c.send(hello_v2(nonce));
      challenge = c.read_n(detail::tcp_challenge_bytes, 2s);
      if (challenge.size() == detail::tcp_challenge_bytes) {
        c.send(claim("not the job's secret, guessed", nonce, challenge, 1, 2, "impostor"));
        after_claim = c.read_all(2s);
      }
    } catch (...) {
    }
  });
  const small_job j = run_small_job(l, 0ms);
  impostor.join();
  CHECK(j.err0.empty());
  CHECK(j.err1.empty());
  CHECK(j.blobs_ok);
  CHECK((challenge.empty() || challenge.size() == detail::tcp_challenge_bytes));
  CHECK(after_claim.empty()); // no verdict, no data
}

TEST_CASE("tcp_bootstrap.security.a_rank_with_another_secret_is_told_the_root_is_not_its_job_and_sends_nothing") {
  // A fake root (it holds another secret, or none) has the port: the rank refuses it at once,
  // before it claims a rank, and the fake root never learns anything but a nonce.
  for (const std::string& root_secret : {std::string("another job's secret, 16+ bytes"), std::string()}) {
    tcp_listener l(0, "127.0.0.1");
    tcp_bootstrap_options fake = opts(0, 2, 0, 2s);
    fake.secret = root_secret;
    std::string root_err;
    std::thread root([&] {
      try {
        tcp_bootstrap b(l, fake);
      } catch (const std::exception& e) {
        root_err = e.what();
      }
    });
    const auto t0 = clock_type::now();
    std::string err;
    try {
      tcp_bootstrap b(opts(1, 2, l.port(), 5s));
    } catch (const std::exception& e) {
      err = e.what();
    }
    const double s = std::chrono::duration<double>(clock_type::now() - t0).count();
    root.join();
    INFO(err);
    CHECK(err.find("is not this job's root") != std::string::npos);
    CHECK(err.find("nothing of this job was sent to it") != std::string::npos);
    CHECK(s < 4.0); // at once (milliseconds on an idle machine), not after the 5 s timeout
    INFO(root_err);
    CHECK(root_err.find("rank 1 of 2 did not arrive") != std::string::npos);
    CHECK(root_err.find("closed the connection in the handshake") != std::string::npos);
  }
}

TEST_CASE("tcp_bootstrap.security.two_jobs_on_one_port_each_keep_their_own_ranks") {
  // Job A (4 ranks) holds the port; job B's ranks 1..3 (another secret) reach it at the same
  // time. Job A completes with its own ranks' blobs; every rank of B fails naming the root.
  tcp_listener l(0, "127.0.0.1");
  const rank_t n = 4;
  std::vector<std::string> errs_a(n), errs_b(n);
  std::vector<int> ok_a(n, 0);
  std::vector<std::thread> ts;
  for (rank_t r = 1; r < n; ++r) {
    ts.emplace_back([&, r] {
      tcp_bootstrap_options o = opts(r, n, l.port(), 5s);
      o.secret = "job B's secret, nothing like A's";
      try {
        tcp_bootstrap b(o);
        errs_b[r] = "joined job A";
      } catch (const std::exception& e) {
        errs_b[r] = e.what();
      }
    });
    ts.emplace_back([&, r] {
      try {
        tcp_bootstrap b(opts(r, n, l.port(), 5s));
        std::vector<std::byte> m(8, static_cast<std::byte>(r)), a(8 * n);
        b.allgather(m, a);
        bool ok = true;
        for (rank_t q = 0; q < n; ++q)
          for (int i = 0; i < 8; ++i) ok = ok && a[static_cast<std::size_t>(q * 8 + i)] == static_cast<std::byte>(q);
        ok_a[r] = ok ? 1 : 0;
      } catch (const std::exception& e) {
        errs_a[r] = e.what();
      }
    });
  }
  try {
    tcp_bootstrap b(l, opts(0, n, 0, 5s));
    std::vector<std::byte> m(8, std::byte{0}), a(8 * n);
    b.allgather(m, a);
    ok_a[0] = 1;
  } catch (const std::exception& e) {
    errs_a[0] = e.what();
  }
  for (auto& t : ts) t.join();
  for (rank_t r = 0; r < n; ++r) {
    INFO("rank " << r << ": A: " << errs_a[r] << " | B: " << errs_b[r]);
    CHECK(errs_a[r].empty());
    CHECK(ok_a[r] == 1);
    // B's rank reached A's root in its start (refused), after it (nobody answers it), or while
    // A's root was closing its listener at the end of its start (the connection is reset in the
    // hello): never in A.
    if (r > 0)
      CHECK((errs_b[r].find("is not this job's root") != std::string::npos ||
             errs_b[r].find("did not answer the hello within") != std::string::npos ||
             errs_b[r].find("closed the connection during the hello") != std::string::npos));
  }
}

TEST_CASE("tcp_bootstrap.security.one_stray_packet_cannot_abort_the_job") {
  // The packets that aborted a waiting root before: an old-protocol hello for rank 7 of 2, a
  // world size of 2^31 - 1, a negative rank; claims of impossible or taken ranks with a wrong MAC;
  // and, without a secret (loopback), the same claims with the check that such a root accepts.
  for (const bool with_secret : {true, false}) {
    tcp_listener l(0, "127.0.0.1");
    std::thread strays([&] {
      auto old_hello = [](std::int64_t rank, std::int64_t size) {
        std::vector<std::byte> h;
        detail::tcp_put(h, detail::tcp_magic_hello, 4);
        detail::tcp_put(h, 1, 4);
        detail::tcp_put(h, static_cast<std::uint32_t>(rank), 4);
        detail::tcp_put(h, static_cast<std::uint32_t>(size), 4);
        detail::tcp_put(h, 0, 2);
        return h;
      };
      for (const auto& [rank, size] : std::vector<std::pair<std::int64_t, std::int64_t>>{{7, 2}, {1, 2147483647}, {-5, 2}})
        raw_client(l.port()).send(old_hello(rank, size));
      const std::string key = with_secret ? std::string("a guess that is wrong....") : std::string();
      for (const auto& [rank, size] : std::vector<std::pair<std::int64_t, std::int64_t>>{{7, 2}, {1, 2147483647}, {-5, 2}, {0, 2}}) {
        raw_client c(l.port());
        const auto nonce = detail::tcp_random_nonce();
        c.send(hello_v2(nonce));
        const auto ch = c.read_n(detail::tcp_challenge_bytes, 2s);
        if (ch.size() == detail::tcp_challenge_bytes) c.send(claim(key, nonce, ch, rank, size, "stray"));
        c.read_all(500ms);
      }
    });
    tcp_bootstrap_options o0 = opts(0, 2, 0, 5s), o1 = opts(1, 2, l.port(), 5s);
    if (!with_secret) o0.secret = o1.secret = "";
    const small_job j = run_small_job(l, 1500ms, o0, o1);
    strays.join();
    INFO((with_secret ? "secret: " : "no secret: ") << j.err0 << " | " << j.err1);
    CHECK(j.err0.empty());
    CHECK(j.err1.empty());
    CHECK(j.blobs_ok);
  }
}

TEST_CASE("tcp_bootstrap.security.idle_and_garbage_connections_do_not_stop_the_start") {
  // 200 connections that never speak and 20 that send garbage, all before the real rank: the job
  // starts as soon as rank 1 arrives, not after the idle ones are dropped.
  tcp_listener l(0, "127.0.0.1");
  std::vector<raw_client> idle;
  for (int i = 0; i < 200; ++i) idle.emplace_back(l.port());
  std::mt19937_64 rng(50);
  std::vector<raw_client> junk;
  for (int i = 0; i < 20; ++i) {
    junk.emplace_back(l.port());
    std::vector<std::byte> g(1 + rng() % 300);
    for (auto& b : g) b = static_cast<std::byte>(rng());
    junk.back().send(g);
  }
  const auto t0 = clock_type::now();
  const small_job j = run_small_job(l, 100ms);
  const double s = std::chrono::duration<double>(clock_type::now() - t0).count();
  CHECK(j.err0.empty());
  CHECK(j.err1.empty());
  CHECK(j.blobs_ok);
  CHECK(s < 8.0); // not the 10 s an idle connection may hold its place (0.1 s on an idle machine)
}

TEST_CASE("tcp_bootstrap.security.a_peers_terminal_escapes_are_printed_escaped") {
  // Without a secret a stranger's claim is checked only for form; its name (a newline and an
  // ANSI colour, a forged "all ranks finished OK" line) reaches the root's error escaped.
  tcp_listener l(0, "127.0.0.1");
  const std::string evil = "x\n\x1b[32mfasta2a: all ranks finished OK\x1b[0m";
  std::thread stray([&] {
    raw_client c(l.port());
    const auto nonce = detail::tcp_random_nonce();
    c.send(hello_v2(nonce));
    const auto ch = c.read_n(detail::tcp_challenge_bytes, 2s);
    if (ch.size() == detail::tcp_challenge_bytes) c.send(claim("", nonce, ch, 5, 2, evil));
    c.read_all(500ms);
  });
  tcp_bootstrap_options o = opts(0, 2, 0, 3s);
  o.secret = "";
  std::string err;
  try {
    tcp_bootstrap b(l, o);
  } catch (const std::exception& e) {
    err = e.what();
  }
  stray.join();
  INFO(err);
  CHECK(err.find("did not arrive") != std::string::npos);
  CHECK(err.find("x\\x0a\\x1b[32mfasta2a: all ranks finished OK\\x1b[0m") != std::string::npos);
  CHECK(err.find('\n') == std::string::npos);
  CHECK(err.find('\x1b') == std::string::npos);
}

TEST_CASE("tcp_bootstrap.security.without_a_secret_only_loopback_starts") {
  tcp_bootstrap_options o = opts(1, 2, 5000, 1s);
  o.secret = "";
  o.root_address = "no-such-host.invalid"; // not loopback (and never reached: no network needed)
  CHECK_THROWS_WITH(tcp_bootstrap{o}, doctest::Contains("no job secret"));
  o.insecure = true; // opted out: it tries (and finds no root)
  CHECK_THROWS_WITH(tcp_bootstrap{o}, doctest::Contains("could not reach the root"));
  o.insecure = false;
  o.secret = "short";
  CHECK_THROWS_WITH(tcp_bootstrap{o}, doctest::Contains("needs at least 16"));
  // Rank 0 listening on every address without a secret.
  tcp_listener any(0);
  tcp_bootstrap_options r0 = opts(0, 2, 0, 1s);
  r0.secret = "";
  CHECK_THROWS_WITH(tcp_bootstrap(any, r0), doctest::Contains("rank 0 listens on every address"));
}

TEST_CASE("tcp_bootstrap.security.out_of_file_descriptors_the_root_names_the_limit_and_does_not_spin") {
  // The root in a child whose hard limit of open files is 40; 60 connections arrive. It gives up
  // after its timeout naming the limit, having used little CPU meanwhile.
  root_port rp;
  std::vector<child> cs;
  cs.push_back(spawn([&] {
    rlimit rl{40, 40};
    if (::setrlimit(RLIMIT_NOFILE, &rl) != 0) throw std::runtime_error("setrlimit failed");
    rusage before{};
    ::getrusage(RUSAGE_SELF, &before);
    try {
      tcp_bootstrap b(rp.listener, opts(0, 64, 0, 2s));
    } catch (const std::exception& e) {
      rusage after{};
      ::getrusage(RUSAGE_SELF, &after);
      const double cpu = (after.ru_utime.tv_sec - before.ru_utime.tv_sec) + (after.ru_stime.tv_sec - before.ru_stime.tv_sec) +
                         1e-6 * ((after.ru_utime.tv_usec - before.ru_utime.tv_usec) + (after.ru_stime.tv_usec - before.ru_stime.tv_usec));
      throw std::runtime_error(std::string(e.what()) + " [cpu " + std::to_string(cpu) + " s]");
    }
  }));
  std::this_thread::sleep_for(200ms);
  std::vector<raw_client> conns;
  for (int i = 0; i < 60; ++i) conns.emplace_back(rp.port());
  collect(cs, 20s);
  INFO(cs[0].text);
  CHECK(cs[0].text.find("limit of open files (ulimit -n: soft 40, hard 40)") != std::string::npos);
  const auto at = cs[0].text.find("[cpu ");
  REQUIRE(at != std::string::npos);
  CHECK(std::stod(cs[0].text.substr(at + 5)) < 1.0); // 2 s of waiting, not 2 s of spinning
}

TEST_CASE("tcp_bootstrap.security.a_name_lookup_that_never_answers_is_bounded_by_the_timeout") {
  // A child in namespaces of its own (mount and network: root only) whose /etc/resolv.conf names a
  // resolver on its loopback that takes every query and never answers (glibc would wait 5 s per
  // try, twice). The rank's start, with a 1 s timeout, must end within it naming the lookup.
  root_port rp; // only for spawn's bookkeeping
  std::vector<child> cs;
  cs.push_back(spawn([&] {
    if (::unshare(CLONE_NEWNS | CLONE_NEWNET) != 0) throw std::runtime_error("skip: unshare: " + detail::errno_text(errno));
    if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) throw std::runtime_error("skip: mount private failed");
    { // loopback up in the new network namespace
      detail::tcp_fd s(::socket(AF_INET, SOCK_DGRAM, 0));
      ifreq ifr{};
      std::strcpy(ifr.ifr_name, "lo");
      if (::ioctl(s.get(), SIOCGIFFLAGS, &ifr) != 0) throw std::runtime_error("skip: SIOCGIFFLAGS failed");
      ifr.ifr_flags = static_cast<short>(ifr.ifr_flags | IFF_UP);
      if (::ioctl(s.get(), SIOCSIFFLAGS, &ifr) != 0) throw std::runtime_error("skip: cannot bring lo up");
    }
    detail::tcp_fd silent(::socket(AF_INET, SOCK_DGRAM, 0)); // the resolver that never answers
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(53);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::bind(silent.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) throw std::runtime_error("skip: bind :53 failed");
    char dir[] = "/tmp/fasta2a-resolv-XXXXXX";
    if (::mkdtemp(dir) == nullptr) throw std::runtime_error("skip: mkdtemp failed");
    const std::string conf = std::string(dir) + "/resolv.conf";
    if (FILE* f = std::fopen(conf.c_str(), "w")) {
      std::fputs("nameserver 127.0.0.1\noptions timeout:5 attempts:2\n", f);
      std::fclose(f);
    }
    const int bound = ::mount(conf.c_str(), "/etc/resolv.conf", nullptr, MS_BIND, nullptr);
    ::unlink(conf.c_str());
    ::rmdir(dir);
    if (bound != 0) throw std::runtime_error("skip: cannot bind-mount /etc/resolv.conf");
    step_start = clock_type::now();
    tcp_bootstrap_options o = opts(1, 2, 29500, 1s);
    o.root_address = "fasta2a-root.example.com"; // in no /etc/hosts: asked of the silent resolver
    tcp_bootstrap b(o);
  }));
  collect(cs, 30s);
  INFO(cs[0].text);
  if (cs[0].text.starts_with("skip:")) {
    MESSAGE("skipped: this test needs root (namespaces): " << cs[0].text);
    return;
  }
  CHECK(cs[0].text.find("could not reach the root at fasta2a-root.example.com:29500 within 1 s") != std::string::npos);
  CHECK(cs[0].text.find("name lookup of 'fasta2a-root.example.com' did not finish") != std::string::npos);
  check_in_time(cs[0], 1 + slack_s);
}
