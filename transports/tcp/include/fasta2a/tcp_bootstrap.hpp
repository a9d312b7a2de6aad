// fasta2a: a Bootstrap over plain TCP sockets, for programs started without MPI (torchrun, a
// Kubernetes job, a shell loop). Rank 0 listens; every other rank connects to it. Started from
// the environment a launcher sets (torchrun's MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, or the
// same names prefixed FASTA2A_), from a "host:port" id that rank 0 hands out (as NCCL's unique
// id), or from explicit options. POSIX sockets only; every wait is bounded by a timeout.
//
// Who gets in: every connection proves that it holds the job's secret (FASTA2A_JOB_SECRET, or
// tcp_bootstrap_options::secret) with a challenge-response over both sides' nonces (HMAC-SHA256,
// OpenSSL's libcrypto) before the root takes its rank or sends it a byte of the job's data, and
// the root proves it to every rank the same way. A connection that does not prove it is dropped
// and logged; only proven members can fail the job. Without a secret the bootstrap runs only on
// loopback, or where the user opts out (FASTA2A_INSECURE_BOOTSTRAP=1).
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <future>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "fasta2a/common.hpp"
#include "fasta2a/tcp_roll_call.hpp"
#include "fasta2a/tcp_wire.hpp"
#include "fasta2a/transport.hpp"

namespace fasta2a {

/// How a tcp_bootstrap finds its peers.
struct tcp_bootstrap_options {
  /// Host name or address of rank 0 (MASTER_ADDR). Rank 0 itself listens on every address.
  std::string root_address = "127.0.0.1";
  /// Rank 0's port (MASTER_PORT). 0 lets rank 0 pick one, which only a tcp_listener made before
  /// the bootstrap can tell the others (tests with ranks as threads).
  std::uint16_t port = 0;
  /// A "host:port" id (rank 0's tcp_listener::id(), NCCL-unique-id style). When not empty it
  /// replaces root_address and port.
  std::string id;
  rank_t rank = 0;  ///< this process's rank, in [0, size)
  rank_t size = 1;  ///< the number of ranks (WORLD_SIZE)
  /// The longest any step waits: connecting to the root (with retries), the root waiting for
  /// every rank to arrive, one allgather waiting for a peer. A rank that is not the root waits
  /// for the root's answer up to timeout + grace(), so that it hears why the root gave up.
  std::chrono::milliseconds timeout{60000};
  /// The job's secret, the same bytes on every rank (at least 16; e.g. `openssl rand -hex 32`).
  /// Every connection proves it holds it, without sending it. Empty: no proof, which is refused
  /// unless the bootstrap stays on loopback or `insecure` says so.
  std::string secret;
  /// Names the job in the handshake (FASTA2A_JOB_ID, else torchrun's TORCHELASTIC_RUN_ID): ranks
  /// with another job id cannot join, even with the same secret.
  std::string job_id;
  /// Allows a bootstrap without a secret across machines (FASTA2A_INSECURE_BOOTSTRAP=1): anyone
  /// who reaches the root's port can then take a rank.
  bool insecure = false;
  /// Where rank 0 listens when the bootstrap makes its own listener: an address of this machine
  /// (from_env(): FASTA2A_LISTEN_ADDRESS, else MASTER_ADDR); empty for every interface.
  std::string listen_address;

  /// What a non-root rank waits beyond the timeout for the root's verdict: half the timeout, at
  /// most 5 s.
  std::chrono::milliseconds grace() const noexcept { return std::min<std::chrono::milliseconds>(timeout / 2, std::chrono::seconds(5)); }

  /// Options from the environment. Each value is read from FASTA2A_<NAME> if set, else <NAME>:
  /// MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE; FASTA2A_BOOTSTRAP_ID ("host:port", replaces
  /// MASTER_ADDR and MASTER_PORT); FASTA2A_BOOTSTRAP_TIMEOUT (seconds, default 60);
  /// FASTA2A_JOB_SECRET, FASTA2A_JOB_ID (else TORCHELASTIC_RUN_ID), FASTA2A_INSECURE_BOOTSTRAP
  /// (1 or 0), FASTA2A_LISTEN_ADDRESS (rank 0; default MASTER_ADDR). Throws fasta2a::error
  /// naming the variable that is missing or malformed.
  static tcp_bootstrap_options from_env();
};

namespace detail {

/// A verdict sent by the root: magic, status (0 ok, 1 error), message length, message.
inline std::vector<std::byte> tcp_verdict(std::uint32_t magic, const std::string& failure) {
  std::vector<std::byte> v;
  tcp_put(v, magic, 4);
  tcp_put(v, failure.empty() ? 0 : 1, 4);
  const std::string m = failure.substr(0, tcp_max_message);
  tcp_put(v, m.size(), 4);
  for (char c : m) v.push_back(static_cast<std::byte>(c));
  return v;
}

/// The root's side of one connection's handshake, without its socket (so that it can be fuzzed:
/// tests/fuzz/fuzz_bootstrap_handshake.cpp): the bytes wanted next, the challenge to send, and the
/// outcome. A connection reads: hello (magic, version, nonce); then the root sends its challenge
/// (its nonce and its proof); then the claim (magic, rank, size, name length, name, proof). A
/// claim is `claimed` only when its proof checks under the secret and the job id.
class tcp_root_handshake {
public:
  enum class state { reading, claimed, dropped };

  /// `root_nonce` replaces the fresh random nonce (the fuzz target's determinism; never in a job).
  tcp_root_handshake(const std::string& secret, const std::string& job_id, const tcp_nonce* root_nonce = nullptr)
      : secret_(&secret), job_id_(&job_id) {
    if (root_nonce != nullptr) {
      my_nonce_ = *root_nonce;
      fixed_nonce_ = true;
    }
  }

  /// Where the next bytes received go (empty once the claim is complete or the connection dropped).
  std::span<std::byte> want() noexcept {
    return state_ == state::reading ? std::span<std::byte>(in_).subspan(got_) : std::span<std::byte>();
  }
  /// Notes `k` bytes received into want(), and acts on every complete part.
  state received(std::size_t k) {
    got_ += k;
    while (state_ == state::reading && got_ == in_.size()) step();
    return state_;
  }
  state status() const noexcept { return state_; }
  /// What to send: the challenge once the hello is in, or the version refusal (then dropped).
  const std::vector<std::byte>& out() const noexcept { return out_; }
  std::size_t& sent() noexcept { return sent_; }
  /// Why it was dropped.
  const std::string& why() const noexcept { return why_; }
  /// The claim (once claimed): rank, world size, name as the peer sent it (unescaped).
  std::int32_t rank() const noexcept { return rank_; }
  std::int32_t size() const noexcept { return size_; }
  const std::string& name() const noexcept { return name_; }

  /// The claim's fields that the rank's proof covers: rank, size, name.
  static std::vector<std::byte> claim_fields(std::int64_t rank, std::int64_t size, std::string_view name) {
    std::vector<std::byte> f;
    tcp_put(f, static_cast<std::uint32_t>(rank), 4);
    tcp_put(f, static_cast<std::uint32_t>(size), 4);
    tcp_put(f, name.size(), 2);
    for (char c : name) f.push_back(static_cast<std::byte>(c));
    return f;
  }

private:
  void drop(std::string why) {
    state_ = state::dropped;
    why_ = std::move(why);
  }

  void step() {
    switch (stage_) {
    case 0: { // magic and version
      if (tcp_get(in_.data(), 4) != tcp_magic_hello) return drop("it does not speak tcp_bootstrap");
      const auto version = static_cast<std::uint32_t>(tcp_get(in_.data() + 4, 4));
      if (version != tcp_version) { // told why (nothing of the job), then dropped
        out_ = tcp_verdict(tcp_magic_welcome, "this process speaks tcp_bootstrap version " + std::to_string(version) +
                                                  ", the root version " + std::to_string(tcp_version));
        return drop("it speaks tcp_bootstrap version " + std::to_string(version) + ", this root " + std::to_string(tcp_version));
      }
      stage_ = 1;
      in_.resize(tcp_hello_bytes);
      return;
    }
    case 1: { // the nonce: the challenge goes out
      std::memcpy(their_nonce_.data(), in_.data() + 8, their_nonce_.size());
      if (!fixed_nonce_) my_nonce_ = tcp_random_nonce();
      const tcp_mac m = tcp_prove(*secret_, "root", their_nonce_, my_nonce_, *job_id_, {});
      out_.clear();
      tcp_put(out_, tcp_magic_challenge, 4);
      tcp_put(out_, tcp_version, 4);
      out_.insert(out_.end(), my_nonce_.begin(), my_nonce_.end());
      out_.insert(out_.end(), m.begin(), m.end());
      sent_ = 0;
      stage_ = 2;
      in_.assign(tcp_claim_prefix, std::byte{0});
      got_ = 0;
      return;
    }
    case 2: { // the claim's fixed part
      const std::size_t name = tcp_get(in_.data() + 12, 2);
      if (tcp_get(in_.data(), 4) != tcp_magic_claim || name > tcp_max_name) return drop("its claim is malformed");
      if (sent_ < out_.size()) return drop("it claimed before the challenge was sent"); // a member waits for it
      stage_ = 3;
      in_.resize(tcp_claim_prefix + name + tcp_mac_bytes);
      return;
    }
    default: { // a whole claim: proven, or dropped
      const auto r = static_cast<std::int32_t>(tcp_get(in_.data() + 4, 4));
      const auto n = static_cast<std::int32_t>(tcp_get(in_.data() + 8, 4));
      const std::size_t name_len = in_.size() - tcp_claim_prefix - tcp_mac_bytes;
      const std::string_view raw(reinterpret_cast<const char*>(in_.data()) + tcp_claim_prefix, name_len);
      const tcp_mac expect = tcp_prove(*secret_, "rank", my_nonce_, their_nonce_, *job_id_, claim_fields(r, n, raw));
      if (!tcp_mac_equal(in_.data() + tcp_claim_prefix + name_len, expect))
        return drop(std::string(secret_->empty() ? "its claim does not check" : "it did not prove the job secret") +
                    (job_id_->empty() ? "" : " and job id") + " (another job, or not a member of this one)");
      rank_ = r;
      size_ = n;
      name_.assign(raw);
      state_ = state::claimed;
      return;
    }
    }
  }

  const std::string* secret_;
  const std::string* job_id_;
  state state_ = state::reading;
  int stage_ = 0; // 0: magic and version, 1: nonce, 2: claim prefix, 3: name and proof
  std::vector<std::byte> in_ = std::vector<std::byte>(8);
  std::size_t got_ = 0;
  std::vector<std::byte> out_;
  std::size_t sent_ = 0;
  tcp_nonce their_nonce_{}, my_nonce_{};
  bool fixed_nonce_ = false;
  std::int32_t rank_ = -1, size_ = 0;
  std::string name_;
  std::string why_;
};

/// One address a name resolved to (what connect() or bind() needs of an addrinfo).
struct tcp_address {
  int family = 0, socktype = 0, protocol = 0;
  sockaddr_storage addr{};
  socklen_t len = 0;
};

/// getaddrinfo's status and the addresses it gave.
struct tcp_lookup_result {
  int rc = 0;
  std::vector<tcp_address> addresses;
};

/// A name lookup bounded in time: getaddrinfo runs on a thread of its own (a resolver that does
/// not answer can hold it for the resolver's own timeouts, 10 s and more), and the caller waits
/// for it until a deadline. A lookup still running then is left to finish on its thread, which
/// holds all it uses; wait() on the same tcp_lookup later picks it up again.
class tcp_lookup {
public:
  tcp_lookup(std::string host, std::string service, int flags) : host_(std::move(host)), service_(std::move(service)), flags_(flags) {}

  /// The result by `deadline`, or nothing (the lookup is still running).
  std::optional<tcp_lookup_result> wait(std::chrono::steady_clock::time_point deadline) {
    if (!running_) start();
    if (result_.wait_until(deadline) != std::future_status::ready) return std::nullopt;
    running_ = false;
    return result_.get();
  }
  const std::string& host() const noexcept { return host_; }

private:
  static tcp_lookup_result resolve(const std::string& host, const std::string& service, int flags) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = flags;
    addrinfo* res = nullptr;
    tcp_lookup_result r;
    r.rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &res);
    if (r.rc == 0) {
      for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
        tcp_address t;
        t.family = a->ai_family;
        t.socktype = a->ai_socktype;
        t.protocol = a->ai_protocol;
        t.len = static_cast<socklen_t>(std::min<std::size_t>(a->ai_addrlen, sizeof t.addr));
        std::memcpy(&t.addr, a->ai_addr, t.len);
        r.addresses.push_back(t);
      }
      ::freeaddrinfo(res);
    }
    return r;
  }
  /// Whether `host` is a numeric address (or empty: every address), which needs no resolver.
  static bool numeric(const std::string& host) {
    in6_addr a6{};
    in_addr a4{};
    return host.empty() || ::inet_pton(AF_INET, host.c_str(), &a4) == 1 || ::inet_pton(AF_INET6, host.c_str(), &a6) == 1;
  }
  void start() {
    auto promise = std::make_shared<std::promise<tcp_lookup_result>>();
    result_ = promise->get_future();
    running_ = true;
    if (numeric(host_)) { // at once, without a thread (a process that forks later stays single-threaded)
      promise->set_value(resolve(host_, service_, flags_ | AI_NUMERICHOST));
      return;
    }
    std::thread([promise, host = host_, service = service_, flags = flags_] { promise->set_value(resolve(host, service, flags)); })
        .detach();
  }

  std::string host_, service_;
  int flags_;
  bool running_ = false;
  std::future<tcp_lookup_result> result_;
};

/// "a:b" -> (a, b), or an error naming `what`.
inline std::pair<std::string, std::uint16_t> tcp_split_id(std::string_view id, const std::string& what) {
  const auto colon = id.rfind(':');
  if (colon == std::string_view::npos || colon == 0 || colon + 1 == id.size())
    throw error("tcp_bootstrap: " + what + " '" + std::string(id) + "' is not host:port");
  std::string_view host = id.substr(0, colon), port = id.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  unsigned v = 0;
  const auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), v);
  if (ec != std::errc() || end != port.data() + port.size() || v == 0 || v > 65535)
    throw error("tcp_bootstrap: " + what + " '" + std::string(id) + "': the port must be 1..65535");
  return {std::string(host), static_cast<std::uint16_t>(v)};
}

inline const char* tcp_env(const char* name, std::string* which) {
  const std::string pre = std::string("FASTA2A_") + name;
  if (const char* v = std::getenv(pre.c_str()); v != nullptr && *v != '\0') {
    *which = pre;
    return v;
  }
  *which = name;
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

inline long long tcp_env_int(const char* name, long long lo, long long hi, bool required, long long fallback) {
  std::string which;
  const char* v = tcp_env(name, &which);
  if (v == nullptr) {
    if (required)
      throw error(std::string("tcp_bootstrap: ") + name + " (or FASTA2A_" + name +
                  ") is not set: a launcher such as torchrun sets it, or set it yourself");
    return fallback;
  }
  long long x = 0;
  const std::string_view s(v);
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), x);
  if (ec != std::errc() || end != s.data() + s.size() || x < lo || x > hi)
    throw error("tcp_bootstrap: " + which + "='" + std::string(s) + "' is not an integer in [" + std::to_string(lo) +
                ", " + std::to_string(hi) + "]");
  return x;
}

} // namespace detail

inline tcp_bootstrap_options tcp_bootstrap_options::from_env() {
  tcp_bootstrap_options o;
  o.size = static_cast<rank_t>(detail::tcp_env_int("WORLD_SIZE", 1, 1 << 24, true, 1));
  o.rank = static_cast<rank_t>(detail::tcp_env_int("RANK", -(1LL << 31), (1LL << 31) - 1, true, 0));
  std::string which;
  if (const char* id = detail::tcp_env("BOOTSTRAP_ID", &which)) {
    o.id = id;
    detail::tcp_split_id(o.id, which); // fails now, naming the variable
  } else {
    const char* addr = detail::tcp_env("MASTER_ADDR", &which);
    if (addr == nullptr && o.size > 1)
      throw error("tcp_bootstrap: MASTER_ADDR (or FASTA2A_MASTER_ADDR, or FASTA2A_BOOTSTRAP_ID=host:port) is not set");
    if (addr != nullptr) o.root_address = addr;
    o.port = static_cast<std::uint16_t>(detail::tcp_env_int("MASTER_PORT", o.rank == 0 ? 0 : 1, 65535, o.size > 1, 0));
  }
  if (const char* t = detail::tcp_env("BOOTSTRAP_TIMEOUT", &which)) {
    char* end = nullptr;
    const double s = std::strtod(t, &end);
    if (end == t || *end != '\0' || !(s > 0) || s > 1e6)
      throw error("tcp_bootstrap: " + which + "='" + t + "' is not a positive number of seconds");
    o.timeout = std::chrono::milliseconds(static_cast<long long>(s * 1000 + 0.5));
  }
  if (const char* v = std::getenv("FASTA2A_JOB_SECRET"); v != nullptr && *v != '\0') o.secret = v;
  if (const char* v = std::getenv("FASTA2A_JOB_ID"); v != nullptr && *v != '\0') o.job_id = v;
  else if (const char* t = std::getenv("TORCHELASTIC_RUN_ID"); t != nullptr) o.job_id = t;
  if (const char* v = std::getenv("FASTA2A_INSECURE_BOOTSTRAP"); v != nullptr && *v != '\0') {
    const std::string_view x(v);
    if (x != "0" && x != "1")
      throw error("tcp_bootstrap: FASTA2A_INSECURE_BOOTSTRAP='" + detail::printable(x) + "' is not 0 or 1");
    o.insecure = x == "1";
  }
  if (const char* v = std::getenv("FASTA2A_LISTEN_ADDRESS"); v != nullptr && *v != '\0') o.listen_address = v;
  else if (!o.id.empty()) o.listen_address = detail::tcp_split_id(o.id, "FASTA2A_BOOTSTRAP_ID").first;
  else if (o.size > 1) o.listen_address = o.root_address;
  if (o.listen_address == "*") o.listen_address.clear();
  return o;
}

/// Rank 0's listening socket, bound before the bootstrap is made so that its port (and id) can be
/// handed to the other ranks first: port 0 picks a free one. SO_REUSEADDR. On every address
/// (IPv6 and IPv4 where the machine has IPv6, IPv4 only otherwise), or on the one address
/// `host` names (a numeric address or a name of this machine; "" for every address), whose name
/// lookup may take at most `lookup_limit`.
class tcp_listener {
public:
  explicit tcp_listener(std::uint16_t port = 0, const std::string& host = {},
                        std::chrono::milliseconds lookup_limit = std::chrono::seconds(30)) {
    if (!host.empty()) {
      listen_on(port, host, lookup_limit);
      return;
    }
    std::string why;
    for (const int family : {AF_INET6, AF_INET}) {
      detail::tcp_fd fd(::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0));
      if (!fd) {
        why = "socket: " + detail::errno_text(errno);
        continue;
      }
      const int one = 1, zero = 0;
      ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
      sockaddr_storage a{};
      socklen_t len = 0;
      if (family == AF_INET6) {
        ::setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
        auto* a6 = reinterpret_cast<sockaddr_in6*>(&a);
        a6->sin6_family = AF_INET6;
        a6->sin6_addr = in6addr_any;
        a6->sin6_port = htons(port);
        len = sizeof(sockaddr_in6);
      } else {
        auto* a4 = reinterpret_cast<sockaddr_in*>(&a);
        a4->sin_family = AF_INET;
        a4->sin_addr.s_addr = htonl(INADDR_ANY);
        a4->sin_port = htons(port);
        len = sizeof(sockaddr_in);
      }
      if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), len) != 0) {
        why = "bind to port " + std::to_string(port) + ": " + detail::errno_text(errno);
        if (errno == EADDRINUSE) break; // IPv4 would fail the same way
        continue;
      }
      if (::listen(fd.get(), 1024) != 0) {
        why = "listen: " + detail::errno_text(errno);
        continue;
      }
      len = sizeof a;
      if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&a), &len) != 0) {
        why = "getsockname: " + detail::errno_text(errno);
        continue;
      }
      port_ = ntohs(family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&a)->sin6_port
                                       : reinterpret_cast<sockaddr_in*>(&a)->sin_port);
      detail::tcp_nonblocking(fd.get());
      fd_ = std::move(fd);
      return;
    }
    throw error("tcp_bootstrap: rank 0 cannot listen: " + why);
  }
  /// The port it listens on (the one picked, if it was made with 0).
  std::uint16_t port() const noexcept { return port_; }
  /// "host:port" with this machine's host name: what the other ranks pass as
  /// tcp_bootstrap_options::id (or FASTA2A_BOOTSTRAP_ID). `host` replaces the host name.
  std::string id(std::string host = {}) const {
    if (host.empty()) {
      char h[256] = {};
      if (::gethostname(h, sizeof h - 1) != 0) std::strcpy(h, "localhost");
      host = h;
    }
    return host + ":" + std::to_string(port_);
  }
  int fd() const noexcept { return fd_.get(); }
  /// The address it listens on ("" for every address).
  const std::string& address() const noexcept { return address_; }
  /// Whether only this machine's processes can reach it (it listens on a loopback address).
  bool loopback_only() const noexcept { return loopback_; }

private:
  void listen_on(std::uint16_t port, const std::string& host, std::chrono::milliseconds lookup_limit) {
    detail::tcp_lookup lookup(host, std::to_string(port), AI_PASSIVE | AI_NUMERICSERV);
    const auto found = lookup.wait(std::chrono::steady_clock::now() + lookup_limit);
    if (!found)
      throw timeout_error("tcp_bootstrap: rank 0 cannot listen on '" + detail::printable(host) + "': its name lookup did not finish within " +
                          detail::tcp_seconds(lookup_limit) + " (is the resolver in /etc/resolv.conf answering?)");
    if (found->rc != 0)
      throw error("tcp_bootstrap: rank 0 cannot listen on '" + detail::printable(host) + "': " + gai_strerror(found->rc));
    std::string why = "no address";
    for (const detail::tcp_address& a : found->addresses) {
      detail::tcp_fd fd(::socket(a.family, a.socktype | SOCK_CLOEXEC, a.protocol));
      if (!fd) {
        why = "socket: " + detail::errno_text(errno);
        continue;
      }
      const int one = 1;
      ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
      if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&a.addr), a.len) != 0) {
        const int e = errno;
        why = "bind: " + detail::errno_text(e) +
              (e == EADDRNOTAVAIL ? " (it is not an address of this machine: set FASTA2A_LISTEN_ADDRESS to one, or '*' for every address)" : "");
        continue;
      }
      if (::listen(fd.get(), 1024) != 0) {
        why = "listen: " + detail::errno_text(errno);
        continue;
      }
      sockaddr_storage b{};
      socklen_t len = sizeof b;
      if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&b), &len) != 0) {
        why = "getsockname: " + detail::errno_text(errno);
        continue;
      }
      char name[NI_MAXHOST];
      if (::getnameinfo(reinterpret_cast<sockaddr*>(&b), len, name, sizeof name, nullptr, 0, NI_NUMERICHOST) != 0)
        std::strcpy(name, "?");
      address_ = name;
      loopback_ = detail::tcp_is_loopback(address_);
      port_ = ntohs(b.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&b)->sin6_port
                                            : reinterpret_cast<sockaddr_in*>(&b)->sin_port);
      detail::tcp_nonblocking(fd.get());
      fd_ = std::move(fd);
      return;
    }
    throw error("tcp_bootstrap: rank 0 cannot listen on " + detail::printable(host) + " port " + std::to_string(port) + ": " + why);
  }

  detail::tcp_fd fd_;
  std::uint16_t port_ = 0;
  std::string address_;
  bool loopback_ = false;
};

/// A Bootstrap over TCP: a star through rank 0. The constructor is collective: rank 0 waits until
/// every rank has connected and proved itself, then answers every rank with the verdict; the
/// others connect with retries until the timeout. The handshake of each connection: the rank's
/// hello (magic, version, a fresh nonce); the root's challenge (its own nonce and its proof, an
/// HMAC-SHA256 under the job secret over both nonces and the job id), which the rank checks
/// before it sends anything else; the rank's claim (its rank, world size, host name and pid, and
/// its proof over both nonces, the job id and those fields). A connection that fails a proof,
/// sends something else, or takes longer than 10 s (or the timeout) is dropped and logged on
/// stderr, and the job goes on: it never gets a byte of the job's data. Without a secret the
/// proofs check only the job id, and a claim that would fail the job (a taken or impossible rank,
/// another world size) is dropped instead, since anyone can make it. An allgather sends each rank's blob to rank 0, which checks sizes
/// and call numbers and sends everything back: 2 (n - 1) messages per call, all through rank 0
/// (its cost grows as O(n) messages and O(n^2 * blob) bytes at the root, fine for the engine's
/// small blobs and tens to hundreds of ranks).
///
/// Errors, each a fasta2a::error within the timeout (timeout + grace() on ranks other than 0):
/// ranks that disagree on the world size (every rank that arrived is told both sizes), one rank
/// claimed by two proven processes (both hosts named), a root that does not prove the secret, a root that cannot be reached, ranks that never
/// arrive (rank 0 names them; the others are told it gave up), a rank outside [0, size), and in
/// an allgather a peer that closes its connection, stops sending, or brings a blob of another
/// size or another call (named by rank and host). Text that came from a peer is escaped
/// (detail::printable) before it is printed. After an allgather fails, the bootstrap is unusable: the
/// next call throws at once.
///
/// Non-copyable, movable; one thread at a time.
class tcp_bootstrap {
public:
  /// Connects as `opt` says. Rank 0 listens on opt.port (tcp_listener).
  explicit tcp_bootstrap(const tcp_bootstrap_options& opt) : opt_(opt) {
    check_options();
    if (opt_.rank == 0 && opt_.size > 1) {
      tcp_listener l(opt_.port, opt_.listen_address, opt_.timeout);
      start_root(l);
    } else if (opt_.rank != 0) {
      start_peer();
    }
    if (opt_.size > 1) start_roll_call();
  }
  /// Rank 0 with a listener bound beforehand (its port given to the others); `opt.rank` must be 0.
  tcp_bootstrap(tcp_listener& listener, const tcp_bootstrap_options& opt) : opt_(opt) {
    check_options();
    if (opt_.rank != 0)
      throw error("tcp_bootstrap: a listener is rank 0's, but this rank is " + std::to_string(opt_.rank));
    if (opt_.size > 1) {
      start_root(listener);
      start_roll_call();
    }
  }
  /// From the environment (tcp_bootstrap_options::from_env()).
  static tcp_bootstrap from_env() { return tcp_bootstrap(tcp_bootstrap_options::from_env()); }

  tcp_bootstrap(tcp_bootstrap&&) noexcept = default;
  tcp_bootstrap& operator=(tcp_bootstrap&&) noexcept = default;

  rank_t rank() const noexcept { return opt_.rank; }
  rank_t size() const noexcept { return opt_.size; }
  /// "host:port" of rank 0, as this rank reached it (rank 0: the port it listens on).
  const std::string& root() const noexcept { return root_name_; }
  const tcp_bootstrap_options& options() const noexcept { return opt_; }

  /// A roll call, for a rank that waited for a peer past its timeout (the engine names the peer it
  /// waited for, which may itself wait for a rank that stopped): the job's ranks that do not
  /// answer within `within`, in rank order. Every rank answers from a thread of its own, whatever
  /// it is doing, so the ranks named are stopped (SIGSTOP), dead or unreachable, not waiting
  /// elsewhere. std::nullopt where none could be held (a world of one, no UDP socket). Only the
  /// job's ranks can ask or answer (detail::tcp_roll_call). Usable after a failure too.
  std::optional<std::vector<rank_t>> roll_call(std::chrono::milliseconds within = std::chrono::seconds(1)) const {
    if (!roll_ || !roll_asks_) return std::nullopt;
    std::vector<rank_t> all;
    for (rank_t r = 0; r < opt_.size; ++r)
      if (r != opt_.rank) all.push_back(r);
    return roll_->missing(all, within);
  }
  /// roll_call() as a clause to append to a timeout's message: "; rank 3 does not answer a roll
  /// call (stopped, dead or unreachable)", "; every rank answers a roll call (...)", or "" where
  /// none could be held. At most a second, and at most the timeout.
  std::string roll_call_clause() const {
    const auto missing = roll_call(std::min<std::chrono::milliseconds>(opt_.timeout, std::chrono::seconds(1)));
    if (!missing) return {};
    if (missing->empty())
      return "; every rank answers a roll call (none is stopped or dead: a rank waits elsewhere, e.g. in another "
             "collective, or was given other options)";
    if (opt_.size > 2 && missing->size() + 1 == static_cast<std::size_t>(opt_.size))
      return "; no other rank answers a roll call (all stopped or dead, or this rank is cut off from them)";
    return std::string("; rank") + (missing->size() == 1 ? " " : "s ") + detail::tcp_rank_list(*missing) +
           (missing->size() == 1 ? " does" : " do") + " not answer a roll call (stopped, dead or unreachable)";
  }

  /// Every rank's `mine` in rank order into `all` (size() * mine.size() bytes). Collective; calls
  /// are numbered, so a rank one call ahead or behind is an error, not a mix-up.
  void allgather(std::span<const std::byte> mine, std::span<std::byte> all) {
    if (!broken_.empty())
      throw error("tcp_bootstrap::allgather: rank " + std::to_string(opt_.rank) +
                  ": the bootstrap is unusable after an earlier failure (" + broken_ + ")");
    const std::size_t len = mine.size();
    if (all.size() != len * static_cast<std::size_t>(opt_.size))
      throw error("tcp_bootstrap::allgather: the output holds " + std::to_string(all.size()) + " bytes, not " +
                  std::to_string(opt_.size) + " ranks x " + std::to_string(len) + " bytes");
    ++calls_;
    try {
      if (opt_.size == 1) std::copy(mine.begin(), mine.end(), all.begin());
      else if (opt_.rank == 0) gather_root(mine, all);
      else gather_peer(mine, all);
    } catch (const error& e) {
      broken_ = e.what();
      close_all();
      throw;
    }
  }

private:
  using clock = detail::tcp_clock;
  static constexpr std::uint32_t ok = 0;

  struct member {
    detail::tcp_fd fd;
    std::string name; // "host (pid N) at addr:port"
  };

  std::string who() const { return "tcp_bootstrap: rank " + std::to_string(opt_.rank); }
  std::string member_name(rank_t r) const {
    return "rank " + std::to_string(r) + " (" + (static_cast<std::size_t>(r) < members_.size() ? members_[r].name : "?") + ")";
  }

  void check_options() {
    if (opt_.size < 1) throw error("tcp_bootstrap: the world size must be at least 1, got " + std::to_string(opt_.size));
    if (opt_.rank < 0 || opt_.rank >= opt_.size)
      throw error("tcp_bootstrap: rank " + std::to_string(opt_.rank) + " is outside [0, " + std::to_string(opt_.size) +
                  ") (world size " + std::to_string(opt_.size) + ")");
    if (opt_.timeout.count() <= 0) throw error("tcp_bootstrap: the timeout must be positive");
    if (!opt_.secret.empty() && opt_.secret.size() < detail::tcp_min_secret)
      throw error("tcp_bootstrap: the job secret (FASTA2A_JOB_SECRET) has " + std::to_string(opt_.secret.size()) +
                  " bytes; it needs at least " + std::to_string(detail::tcp_min_secret) + " (e.g. `openssl rand -hex 32`)");
    if (opt_.job_id.size() > detail::tcp_max_name)
      throw error("tcp_bootstrap: the job id has " + std::to_string(opt_.job_id.size()) + " bytes; at most " +
                  std::to_string(detail::tcp_max_name));
    if (!opt_.id.empty()) {
      auto [h, p] = detail::tcp_split_id(opt_.id, "id");
      opt_.root_address = std::move(h);
      opt_.port = p;
    }
    if (opt_.rank != 0 && opt_.port == 0)
      throw error(who() + ": the root's port is 0 (set MASTER_PORT, or give rank 0's tcp_listener port or id)");
    if (opt_.rank != 0 && opt_.root_address.empty()) throw error(who() + ": no root address (MASTER_ADDR)");
    if (opt_.rank != 0 && opt_.size > 1 && !detail::tcp_is_loopback(opt_.root_address)) require_secret("the root at " + detail::printable(opt_.root_address));
  }

  /// Without a secret, a bootstrap that other machines can reach needs the user's explicit opt-out.
  void require_secret(const std::string& where) const {
    if (opt_.secret.empty() && !opt_.insecure)
      throw error(who() + ": no job secret, and " + where +
                  " is reachable from other machines: set FASTA2A_JOB_SECRET to the same random value on every rank "
                  "(e.g. `openssl rand -hex 32`; tcp_bootstrap_options::secret), so that only the job's processes can "
                  "join, or FASTA2A_INSECURE_BOOTSTRAP=1 to let anyone who reaches the port take a rank");
  }

  /// Whether this bootstrap's members proved the job secret (false: no secret was configured).
  bool proven() const noexcept { return !opt_.secret.empty(); }

  void close_all() {
    for (auto& m : members_) m.fd.reset();
    root_fd_.reset();
  }

  // ---- start-up, rank 0 -------------------------------------------------------------------

  /// A connection in the handshake (detail::tcp_root_handshake), dropped when it takes longer
  /// than the handshake may (handshake_limit()).
  struct pending {
    detail::tcp_fd fd;
    std::string addr;
    clock::time_point until;
    detail::tcp_root_handshake hs;
  };

  /// How long a connection may take to complete its handshake: a rank sends it as soon as it
  /// connects, so only a stray or an attacker takes long.
  std::chrono::milliseconds handshake_limit() const { return std::min<std::chrono::milliseconds>(opt_.timeout, std::chrono::seconds(10)); }

  /// The most connections in the handshake at once; the oldest is dropped for a new one.
  static constexpr std::size_t max_pending = 4096;

  /// Notes a dropped connection on stderr: the first few, then one line a few seconds with the count.
  void log_drop(const std::string& addr, const std::string& why) {
    ++dropped_;
    if (dropped_reasons_.size() < 4) dropped_reasons_.push_back(detail::printable(addr) + ": " + why);
    const auto now = clock::now();
    if (dropped_ <= 3 || now - last_log_ >= std::chrono::seconds(5)) {
      last_log_ = now;
      std::fprintf(stderr, "fasta2a: tcp_bootstrap: rank 0: dropped a connection from %s: %s (%llu dropped so far)\n",
                   detail::printable(addr).c_str(), why.c_str(), static_cast<unsigned long long>(dropped_));
    }
  }

  /// Raises the soft limit of open files towards the hard one where n ranks could exceed it.
  void raise_file_limit() const {
    rlimit rl{};
    if (::getrlimit(RLIMIT_NOFILE, &rl) != 0) return;
    const rlim_t want = static_cast<rlim_t>(opt_.size) + 256;
    if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < want && rl.rlim_cur < rl.rlim_max) {
      rl.rlim_cur = rl.rlim_max == RLIM_INFINITY ? want : std::min<rlim_t>(rl.rlim_max, std::max(want, rl.rlim_cur));
      ::setrlimit(RLIMIT_NOFILE, &rl);
    }
  }

  static std::string file_limit_text() {
    rlimit rl{};
    if (::getrlimit(RLIMIT_NOFILE, &rl) != 0) return "the limit of open files";
    const auto v = [](rlim_t x) { return x == RLIM_INFINITY ? std::string("unlimited") : std::to_string(x); };
    return "the limit of open files (ulimit -n: soft " + v(rl.rlim_cur) + ", hard " + v(rl.rlim_max) + ")";
  }

  /// Rank 0's connections in the handshake, and what accepting them ran into.
  struct admission {
    std::vector<pending> waiting;
    clock::time_point accept_again{}; // after EMFILE: accept again from then (no spinning)
    std::string fd_trouble;           // the last EMFILE/ENFILE, with the limit, for the failure
  };

  /// One round of rank 0's start-up: waits until a connection arrives or a handshake can go on (at
  /// most until `until`), accepts, moves every handshake on, drops the connections that fail or
  /// idle (logged), and hands each claim whose proof checks to `claimed(member, rank, size)`.
  template <class Claimed>
  void admit(tcp_listener& l, admission& a, clock::time_point until, std::size_t members, Claimed&& claimed) {
    const auto drop = [&](std::size_t i, const std::string& why) {
      log_drop(a.waiting[i].addr, why);
      a.waiting.erase(a.waiting.begin() + static_cast<std::ptrdiff_t>(i));
    };
    const bool accepting = clock::now() >= a.accept_again;
    std::vector<pollfd> fds{{accepting ? l.fd() : -1, POLLIN, 0}};
    for (auto& p : a.waiting) fds.push_back({p.fd.get(), static_cast<short>(POLLIN | (p.hs.sent() < p.hs.out().size() ? POLLOUT : 0)), 0});
    ::poll(fds.data(), fds.size(), accepting ? detail::tcp_poll_ms(until) : 50);
    if (accepting && (fds[0].revents & POLLIN))
      for (;;) {
        const int c = ::accept4(l.fd(), nullptr, nullptr, SOCK_CLOEXEC);
        if (c < 0) {
          if (errno == EMFILE || errno == ENFILE) { // stop accepting a while: no spinning
            a.accept_again = clock::now() + std::chrono::milliseconds(100);
            if (a.fd_trouble.empty())
              std::fprintf(stderr, "fasta2a: tcp_bootstrap: rank 0: cannot accept a connection: %s: %s\n",
                           detail::errno_text(errno).c_str(), file_limit_text().c_str());
            a.fd_trouble = detail::errno_text(errno) + " (" + file_limit_text() + "; " +
                           std::to_string(members + a.waiting.size()) + " connections open)";
          }
          break;
        }
        pending p{detail::tcp_fd(c), detail::tcp_peer_address(c), clock::now() + handshake_limit(),
                  detail::tcp_root_handshake(opt_.secret, opt_.job_id)};
        detail::tcp_nonblocking(c);
        if (a.waiting.size() >= max_pending) drop(0, "too many connections in the handshake at once");
        a.waiting.push_back(std::move(p));
      }
    for (std::size_t i = 0; i < a.waiting.size();) {
      pending& p = a.waiting[i];
      detail::tcp_root_handshake& hs = p.hs;
      int err = 0;
      if (hs.sent() < hs.out().size() && detail::tcp_send_some(p.fd.get(), hs.out(), hs.sent(), err) == detail::tcp_io::closed) {
        drop(i, "it closed the connection in the handshake");
        continue;
      }
      std::size_t got = 0;
      const std::span<std::byte> want = hs.want();
      const detail::tcp_io r = detail::tcp_recv_some(p.fd.get(), want, got, err);
      const auto st = hs.received(got);
      if (st == detail::tcp_root_handshake::state::dropped) {
        if (hs.sent() < hs.out().size()) // a refusal it may read (another protocol version)
          detail::tcp_send_all(p.fd.get(), hs.out(), clock::now() + std::chrono::milliseconds(200));
        drop(i, hs.why());
        continue;
      }
      if (st == detail::tcp_root_handshake::state::reading) {
        if (r == detail::tcp_io::closed) drop(i, "it closed the connection in the handshake");
        else if (got > 0) continue; // more may be there, and a challenge to send (same index)
        else if (clock::now() >= p.until) drop(i, "it did not complete the handshake within " + detail::tcp_seconds(handshake_limit()));
        else ++i;
        continue;
      }
      // A claim whose proof checks.
      const std::int32_t rank = hs.rank(), size = hs.size();
      member m{std::move(p.fd), detail::printable(hs.name()) + " at " + p.addr};
      a.waiting.erase(a.waiting.begin() + static_cast<std::ptrdiff_t>(i));
      claimed(std::move(m), rank, size);
    }
  }

  void start_root(tcp_listener& l) {
    root_name_ = "port " + std::to_string(l.port());
    if (!l.loopback_only()) require_secret("rank 0 listens on " + (l.address().empty() ? std::string("every address") : l.address()));
    raise_file_limit();
    const auto deadline = clock::now() + opt_.timeout;
    const std::size_t n = static_cast<std::size_t>(opt_.size);
    members_.resize(n);
    members_[0].name = detail::tcp_self_name();
    admission a;
    std::vector<member> refused; // proven members whose claim fails the job: told why
    std::string failure;
    std::size_t arrived = 0;
    while (arrived + refused.size() < n - 1 && clock::now() < deadline)
      admit(l, a, deadline, arrived, [&](member m, std::int32_t r_rank, std::int32_t size_field) {
        std::string why;
        if (size_field != opt_.size)
          why = "the ranks disagree on the world size: rank " + std::to_string(r_rank) + " (" + m.name + ") says " +
                std::to_string(size_field) + " ranks, rank 0 (" + members_[0].name + ", the root) says " +
                std::to_string(opt_.size);
        else if (r_rank < 0 || r_rank >= opt_.size)
          why = "rank " + std::to_string(r_rank) + " (" + m.name + ") is outside [0, " + std::to_string(opt_.size) + ")";
        else if (r_rank == 0 || members_[static_cast<std::size_t>(r_rank)].fd)
          why = "rank " + std::to_string(r_rank) + " was claimed twice: by " + members_[static_cast<std::size_t>(r_rank)].name +
                " and by " + m.name;
        if (!why.empty()) {
          if (!proven()) { // anyone can make such a claim without a secret: it cannot fail the job
            detail::tcp_send_all(m.fd.get(),
                                 detail::tcp_verdict(detail::tcp_magic_welcome, "it dropped this process's claim: " + why +
                                                                                    " (without a job secret such a claim cannot fail the job)"),
                                 clock::now() + std::chrono::milliseconds(200));
            log_drop(m.name, why);
            return;
          }
          if (failure.empty()) failure = why;
          refused.push_back(std::move(m));
          return;
        }
        members_[static_cast<std::size_t>(r_rank)] = std::move(m);
        ++arrived;
      });
    std::vector<char> late(n, 0); // ranks that did not arrive
    if (failure.empty() && arrived < n - 1) {
      std::vector<rank_t> missing;
      for (std::size_t r = 1; r < n; ++r)
        if (!members_[r].fd) {
          missing.push_back(static_cast<rank_t>(r));
          late[r] = 1;
        }
      failure = (missing.size() == 1 ? "rank " : "ranks ") + detail::tcp_rank_list(missing) + " of " + std::to_string(n) +
                " did not arrive within " + detail::tcp_seconds(opt_.timeout) + " (the root listens on port " +
                std::to_string(l.port()) + ")";
      if (!a.fd_trouble.empty()) failure += "; the root could not accept every connection: " + a.fd_trouble;
      if (dropped_ > 0) {
        failure += "; " + std::to_string(dropped_) + " connection(s) dropped, e.g. ";
        for (std::size_t k = 0; k < dropped_reasons_.size(); ++k) failure += (k ? "; " : "") + dropped_reasons_[k];
      }
    }
    // The verdict, to every proven member: they wait up to timeout + grace for it.
    const auto send_by = clock::now() + std::min<std::chrono::milliseconds>(opt_.grace(), std::chrono::seconds(2));
    const auto verdict = detail::tcp_verdict(detail::tcp_magic_welcome, failure);
    for (auto& m : members_)
      if (m.fd) detail::tcp_send_all(m.fd.get(), verdict, send_by);
    for (auto& m : refused) detail::tcp_send_all(m.fd.get(), verdict, send_by);
    if (failure.empty()) return;
    close_all();
    if (std::find(late.begin(), late.end(), 1) != late.end()) tell_late_ranks(l, a, late, failure);
    throw error("tcp_bootstrap: rank 0 (the root): " + failure);
  }

  /// After rank 0 gave up on ranks that did not arrive: it listens on a while (the grace, which the
  /// ranks that arrived wait beyond the timeout anyway), so that a late rank hears why and since
  /// when rather than "Connection refused". Each late rank that proves itself gets the verdict.
  void tell_late_ranks(tcp_listener& l, admission& a, std::vector<char>& late, const std::string& failure) {
    const auto gave_up = clock::now();
    const std::time_t wall = std::time(nullptr);
    std::tm utc{};
    char when[32] = "?";
    if (::gmtime_r(&wall, &utc) != nullptr) std::strftime(when, sizeof when, "%H:%M:%S UTC", &utc);
    const auto until = gave_up + opt_.grace();
    while (clock::now() < until && std::find(late.begin(), late.end(), 1) != late.end())
      admit(l, a, until, 0, [&](member m, std::int32_t r, std::int32_t) {
        const double after = std::chrono::duration<double>(clock::now() - gave_up).count();
        char text[96];
        std::snprintf(text, sizeof text, "it had given up %.1f s before this rank arrived (at %s): ", after, when);
        detail::tcp_send_all(m.fd.get(), detail::tcp_verdict(detail::tcp_magic_welcome, text + failure),
                             clock::now() + std::chrono::milliseconds(200));
        if (r > 0 && r < opt_.size) late[static_cast<std::size_t>(r)] = 0;
      });
  }

  // ---- start-up, other ranks --------------------------------------------------------------

  void start_peer() {
    root_name_ = detail::printable(opt_.root_address) + ":" + std::to_string(opt_.port);
    const auto start = clock::now();
    const auto deadline = start + opt_.timeout;
    std::string last = "no attempt";
    auto pause = std::chrono::milliseconds(20);
    while (!root_fd_) {
      if (clock::now() >= deadline)
        throw timeout_error(who() + " could not reach the root at " + root_name_ + " within " + detail::tcp_seconds(opt_.timeout) +
                    " (last error: " + last + ")");
      root_fd_ = try_connect(deadline, last);
      if (!root_fd_) {
        std::this_thread::sleep_for(std::min<clock::duration>(pause, std::max<clock::duration>(deadline - clock::now(), clock::duration::zero())));
        pause = std::min(pause * 2, std::chrono::milliseconds(500));
      }
    }
    // The hello, the root's proof, the claim, then the verdict. The root gave itself at most
    // `timeout` from before this connection was accepted, so waiting timeout + grace from now
    // hears its verdict.
    const auto wait_until = clock::now() + opt_.timeout + opt_.grace();
    const detail::tcp_nonce mine = detail::tcp_random_nonce();
    std::vector<std::byte> hello;
    detail::tcp_put(hello, detail::tcp_magic_hello, 4);
    detail::tcp_put(hello, detail::tcp_version, 4);
    hello.insert(hello.end(), mine.begin(), mine.end());
    if (!detail::tcp_send_all(root_fd_.get(), hello, wait_until))
      throw error(who() + ": the root at " + root_name_ + " closed the connection before the start");
    std::vector<std::byte> ch(detail::tcp_challenge_bytes);
    std::size_t got = 0;
    recv_from_root(std::span(ch).first(4), got, wait_until, "the hello");
    if (detail::tcp_get(ch.data(), 4) == detail::tcp_magic_welcome) { // refused before any proof
      got = 4;
      std::vector<std::byte> rest(8);
      std::size_t g = 0;
      recv_from_root(rest, g, wait_until, "the hello");
      const auto len = detail::tcp_get(rest.data() + 4, 4);
      std::vector<std::byte> msg(std::min<std::uint64_t>(len, detail::tcp_max_message));
      g = 0;
      recv_from_root(msg, g, wait_until, "the hello");
      throw error(who() + ": the process listening at " + root_name_ + " refused this rank: " +
                  detail::printable(std::string_view(reinterpret_cast<const char*>(msg.data()), msg.size())));
    }
    recv_from_root(ch, got, wait_until, "the hello");
    const std::string not_root = who() + ": the process listening at " + root_name_ + " is not this job's root: ";
    if (detail::tcp_get(ch.data(), 4) != detail::tcp_magic_challenge || detail::tcp_get(ch.data() + 4, 4) != detail::tcp_version)
      throw error(not_root + "it does not answer as a tcp_bootstrap root of version " + std::to_string(detail::tcp_version) + " would");
    detail::tcp_nonce theirs{};
    std::memcpy(theirs.data(), ch.data() + 8, theirs.size());
    const detail::tcp_mac expect = detail::tcp_prove(opt_.secret, "root", mine, theirs, opt_.job_id, {});
    if (!detail::tcp_mac_equal(ch.data() + 8 + detail::tcp_nonce_bytes, expect))
      throw error(not_root + "it did not prove " +
                  (proven() ? std::string("the job secret (FASTA2A_JOB_SECRET)") : std::string("that it runs without a secret")) +
                  (opt_.job_id.empty() ? std::string() : " and job id '" + detail::printable(opt_.job_id) + "'") +
                  " (another job on the same port, or an impostor); nothing of this job was sent to it");
    const std::string me = detail::tcp_self_name().substr(0, detail::tcp_max_name);
    std::vector<std::byte> claim;
    detail::tcp_put(claim, detail::tcp_magic_claim, 4);
    const std::vector<std::byte> fields = detail::tcp_root_handshake::claim_fields(opt_.rank, opt_.size, me);
    claim.insert(claim.end(), fields.begin(), fields.end());
    const detail::tcp_mac m = detail::tcp_prove(opt_.secret, "rank", theirs, mine, opt_.job_id, fields);
    claim.insert(claim.end(), m.begin(), m.end());
    if (!detail::tcp_send_all(root_fd_.get(), claim, wait_until))
      throw error(who() + ": the root at " + root_name_ + " closed the connection before the start");
    read_verdict(wait_until, "the start");
  }

  detail::tcp_fd try_connect(clock::time_point deadline, std::string& last) {
    if (!lookup_) lookup_ = std::make_unique<detail::tcp_lookup>(opt_.root_address, std::to_string(opt_.port), AI_NUMERICSERV);
    const auto found = lookup_->wait(deadline); // bounded: a resolver that does not answer cannot hold the start
    if (!found) {
      last = "the name lookup of '" + detail::printable(opt_.root_address) + "' did not finish (is the resolver in /etc/resolv.conf answering?)";
      return {};
    }
    if (found->rc != 0) {
      last = "cannot resolve '" + detail::printable(opt_.root_address) + "': " + gai_strerror(found->rc);
      return {};
    }
    detail::tcp_fd out;
    for (const detail::tcp_address& a : found->addresses) {
      if (out) break;
      detail::tcp_fd fd(::socket(a.family, a.socktype | SOCK_CLOEXEC, a.protocol));
      if (!fd) {
        last = "socket: " + detail::errno_text(errno);
        continue;
      }
      detail::tcp_nonblocking(fd.get());
      if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&a.addr), a.len) != 0) {
        if (errno != EINPROGRESS) {
          last = connect_error(errno);
          continue;
        }
        // At most a second per attempt, so that a lost SYN is retried.
        const auto until = std::min(deadline, clock::now() + std::chrono::seconds(1));
        pollfd p{fd.get(), POLLOUT, 0};
        while (::poll(&p, 1, detail::tcp_poll_ms(until)) == 0 && clock::now() < until) {
        }
        int err = 0;
        socklen_t len = sizeof err;
        if (!(p.revents & (POLLOUT | POLLERR | POLLHUP))) {
          last = "connection attempt timed out";
          continue;
        }
        if (::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0) {
          last = connect_error(err != 0 ? err : errno);
          continue;
        }
      }
      out = std::move(fd);
    }
    return out;
  }

  /// A failed connect's errno as text; a refusal says what it means here.
  static std::string connect_error(int e) {
    std::string t = detail::errno_text(e);
    if (e == ECONNREFUSED)
      t += ": nothing listens on that port (the root has not started yet, or it has stopped listening: "
           "its start-up ended, with the ranks it had or giving up)";
    return t;
  }

  /// Reads the root's verdict (magic `welcome`) by `until`; throws its failure, a closed
  /// connection or the timeout.
  void read_verdict(clock::time_point until, const char* what) {
    std::vector<std::byte> head(12);
    std::size_t got = 0;
    recv_from_root(head, got, until, what);
    if (detail::tcp_get(head.data(), 4) != detail::tcp_magic_welcome)
      throw error(who() + ": the root at " + root_name_ + " answered " + what + " with something that is not tcp_bootstrap");
    const auto status = detail::tcp_get(head.data() + 4, 4);
    const auto len = detail::tcp_get(head.data() + 8, 4);
    if (len > detail::tcp_max_message) throw error(who() + ": the root's answer is malformed");
    std::vector<std::byte> msg(len);
    got = 0;
    recv_from_root(msg, got, until, what);
    if (status != ok)
      throw error(who() + ": the root at " + root_name_ + " gave up: " +
                  detail::printable(std::string_view(reinterpret_cast<const char*>(msg.data()), msg.size()), false));
  }

  void recv_from_root(std::span<std::byte> buf, std::size_t& got, clock::time_point until, const std::string& what) {
    for (;;) {
      int err = 0;
      const detail::tcp_io r = detail::tcp_recv_some(root_fd_.get(), buf, got, err);
      if (r == detail::tcp_io::progress) return;
      if (r == detail::tcp_io::closed)
        throw error(who() + ": the root (rank 0 at " + root_name_ + ") closed the connection during " + what +
                    (err != 0 ? " (" + detail::errno_text(err) + ")" : "") + ": it failed or exited");
      if (clock::now() >= until)
        throw timeout_error(who() + ": the root (rank 0 at " + root_name_ + ") did not answer " + what + " within " +
                    detail::tcp_seconds(std::chrono::duration_cast<std::chrono::milliseconds>(opt_.timeout + opt_.grace())));
      pollfd p{root_fd_.get(), POLLIN, 0};
      ::poll(&p, 1, detail::tcp_poll_ms(until));
    }
  }

  // ---- allgather ----------------------------------------------------------------------------

  std::string call_name() const {
    return calls_ == 0 ? std::string("the start's exchange of roll-call addresses") : "allgather #" + std::to_string(calls_);
  }

  // ---- the roll call --------------------------------------------------------------------------

  /// After the start: this rank answers roll calls on a UDP port of the address its bootstrap
  /// connection uses, and every rank's port is gathered (as call 0; users' calls count from 1).
  void start_roll_call() {
    sockaddr_storage local{};
    socklen_t len = sizeof local;
    const int fd = opt_.rank == 0 ? members_[1].fd.get() : root_fd_.get();
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) != 0) local.ss_family = AF_UNSPEC;
    roll_ = std::make_unique<detail::tcp_roll_call>(opt_.secret, opt_.job_id, opt_.rank, local);
    std::vector<std::byte> all(detail::tcp_roll_address_bytes * static_cast<std::size_t>(opt_.size));
    try {
      if (opt_.rank == 0) gather_root(roll_->address(), all);
      else gather_peer(roll_->address(), all);
    } catch (const error&) {
      close_all();
      throw;
    }
    roll_->set_peers(all);
    // Whether questions and answers pass between the ranks (UDP may be filtered where TCP is not):
    // the next rank is asked once. Where it does not answer, this rank asks no roll calls (they
    // would name every rank), and says so; it still answers them.
    const std::vector<rank_t> next{(opt_.rank + 1) % opt_.size};
    const auto m = roll_->missing(next, std::min<std::chrono::milliseconds>(opt_.timeout, std::chrono::seconds(1)));
    roll_asks_ = m && m->empty();
    if (!roll_asks_)
      std::fprintf(stderr, "fasta2a: tcp_bootstrap: rank %d: rank %d does not answer a roll call over UDP: after a "
                           "timeout this rank names the peer it waited for, not the rank missing (is UDP between the "
                           "ranks filtered?)\n", opt_.rank, next[0]);
  }

  /// Which of `ranks` answer a roll call within `within`: "" if there is none to hold, else a
  /// clause naming those that do not and those that do; `*absent` says whether any does not.
  std::string ask(const std::vector<rank_t>& ranks, std::chrono::milliseconds within, bool* absent = nullptr) const {
    if (absent != nullptr) *absent = false;
    if (!roll_ || !roll_asks_ || roll_->ranks() == 0 || ranks.empty()) return {};
    const auto missing = roll_->missing(ranks, within);
    if (!missing) return {};
    if (absent != nullptr) *absent = !missing->empty();
    std::vector<rank_t> here;
    for (rank_t r : ranks)
      if (std::find(missing->begin(), missing->end(), r) == missing->end()) here.push_back(r);
    std::string s;
    if (!missing->empty())
      s = std::string("rank") + (missing->size() == 1 ? " " : "s ") + detail::tcp_rank_list(*missing) +
          (missing->size() == 1 ? " does" : " do") + " not answer a roll call (stopped, dead or unreachable)";
    if (!here.empty())
      s += (s.empty() ? "" : "; ") + std::string("rank") + (here.size() == 1 ? " " : "s ") + detail::tcp_rank_list(here) +
           (here.size() == 1 ? " answers" : " answer") + " a roll call (alive, waiting elsewhere)";
    return s;
  }

  static std::vector<std::byte> gather_header(std::uint32_t magic, std::uint32_t status, std::uint64_t call, std::uint64_t len) {
    std::vector<std::byte> h;
    detail::tcp_put(h, magic, 4);
    detail::tcp_put(h, status, 4);
    detail::tcp_put(h, call, 8);
    detail::tcp_put(h, len, 8);
    return h;
  }

  void gather_root(std::span<const std::byte> mine, std::span<std::byte> all) {
    const std::size_t n = static_cast<std::size_t>(opt_.size), len = mine.size();
    const auto deadline = clock::now() + opt_.timeout;
    std::copy(mine.begin(), mine.end(), all.begin());
    struct in_state {
      std::vector<std::byte> head = std::vector<std::byte>(detail::tcp_gather_header);
      std::size_t got = 0, body = 0;
      bool done = false, stopped = false;
      std::uint64_t their_len = 0;
    };
    std::vector<in_state> st(n);
    st[0].done = true;
    std::string failure;
    std::vector<std::string> size_errors;
    const auto open = [&] {
      for (std::size_t r = 1; r < n; ++r)
        if (!st[r].done && !st[r].stopped) return true;
      return false;
    };
    while (failure.empty() && open()) {
      if (clock::now() >= deadline) {
        std::string late;
        for (std::size_t r = 1; r < n; ++r)
          if (!st[r].done && !st[r].stopped) late += (late.empty() ? "" : ", ") + member_name(static_cast<rank_t>(r));
        failure = call_name() + ": " + late + " did not send its blob within " + detail::tcp_seconds(opt_.timeout);
        std::vector<rank_t> late_ranks;
        for (std::size_t r = 1; r < n; ++r)
          if (!st[r].done && !st[r].stopped) late_ranks.push_back(static_cast<rank_t>(r));
        // Within the grace the others wait for this verdict beyond the timeout.
        const std::string roll = ask(late_ranks, std::min<std::chrono::milliseconds>(opt_.grace() / 2, std::chrono::seconds(1)));
        if (!roll.empty()) failure += " (" + roll + ")";
        break;
      }
      std::vector<pollfd> fds;
      std::vector<std::size_t> which;
      for (std::size_t r = 1; r < n; ++r)
        if (!st[r].done && !st[r].stopped) {
          fds.push_back({members_[r].fd.get(), POLLIN, 0});
          which.push_back(r);
        }
      ::poll(fds.data(), fds.size(), detail::tcp_poll_ms(deadline));
      for (std::size_t i = 0; i < fds.size() && failure.empty(); ++i) {
        if (fds[i].revents == 0) continue;
        const std::size_t r = which[i];
        in_state& s = st[r];
        int err = 0;
        detail::tcp_io io = detail::tcp_io::progress;
        if (s.got < s.head.size()) {
          io = detail::tcp_recv_some(members_[r].fd.get(), s.head, s.got, err);
          if (io == detail::tcp_io::progress) {
            const auto magic = detail::tcp_get(s.head.data(), 4);
            const auto call = detail::tcp_get(s.head.data() + 8, 8);
            s.their_len = detail::tcp_get(s.head.data() + 16, 8);
            if (magic != detail::tcp_magic_gather) {
              failure = call_name() + ": " + member_name(static_cast<rank_t>(r)) + " sent something that is not an allgather";
              break;
            }
            if (call != calls_) {
              failure = call_name() + ": " + member_name(static_cast<rank_t>(r)) + " is at allgather #" + std::to_string(call) +
                        ", rank 0 at #" + std::to_string(calls_) + " (the ranks' calls are out of step)";
              break;
            }
            if (s.their_len != len) {
              size_errors.push_back(member_name(static_cast<rank_t>(r)) + " has " + std::to_string(s.their_len) + " bytes");
              s.stopped = true; // its blob is not read: the call fails once every header is in
              continue;
            }
          }
        }
        if (io == detail::tcp_io::progress && s.got == s.head.size()) {
          io = detail::tcp_recv_some(members_[r].fd.get(), all.subspan(r * len, len), s.body, err);
          if (io == detail::tcp_io::progress) s.done = true;
        }
        if (io == detail::tcp_io::closed)
          failure = call_name() + ": " + member_name(static_cast<rank_t>(r)) + " closed its connection" +
                    (err != 0 ? " (" + detail::errno_text(err) + ")" : "") + ": it failed or exited";
      }
    }
    if (failure.empty() && !size_errors.empty()) {
      failure = call_name() + ": the ranks' blobs differ in size: ";
      for (std::size_t k = 0; k < size_errors.size() && k < 8; ++k) failure += size_errors[k] + ", ";
      if (size_errors.size() > 8) failure += "... (" + std::to_string(size_errors.size()) + " ranks), ";
      failure += "rank 0 (" + members_[0].name + ", the root) has " + std::to_string(len);
    }
    // Everything, or the failure, back to every rank, written to all of them at once.
    const auto send_by = failure.empty() ? deadline + opt_.grace()
                                         : clock::now() + std::min<std::chrono::milliseconds>(opt_.grace(), std::chrono::seconds(2));
    std::vector<std::byte> head = failure.empty()
                                      ? gather_header(detail::tcp_magic_result, ok, calls_, all.size())
                                      : gather_header(detail::tcp_magic_result, 1, calls_, std::min(failure.size(), detail::tcp_max_message));
    std::vector<std::byte> text(std::min(failure.size(), detail::tcp_max_message));
    if (!text.empty()) std::memcpy(text.data(), failure.data(), text.size()); // no null pointer to memcpy (UBSan)
    std::span<const std::byte> body = failure.empty() ? std::span<const std::byte>(all.data(), all.size()) : std::span<const std::byte>(text);
    std::vector<std::size_t> sent_head(n, 0), sent_body(n, 0);
    std::vector<char> out(n, 1);
    out[0] = 0;
    std::string send_failure;
    for (;;) {
      std::vector<pollfd> fds;
      std::vector<std::size_t> which;
      for (std::size_t r = 1; r < n; ++r) {
        if (!out[r]) continue;
        int err = 0;
        detail::tcp_io io = detail::tcp_send_some(members_[r].fd.get(), head, sent_head[r], err);
        if (io == detail::tcp_io::progress) io = detail::tcp_send_some(members_[r].fd.get(), body, sent_body[r], err);
        if (io == detail::tcp_io::progress) out[r] = 0;
        else if (io == detail::tcp_io::closed) {
          out[r] = 0;
          if (send_failure.empty())
            send_failure = call_name() + ": " + member_name(static_cast<rank_t>(r)) + " closed its connection before it had the result";
        } else {
          fds.push_back({members_[r].fd.get(), POLLOUT, 0});
          which.push_back(r);
        }
      }
      if (fds.empty()) break;
      if (clock::now() >= send_by) {
        if (send_failure.empty())
          send_failure = call_name() + ": " + member_name(static_cast<rank_t>(which[0])) + " did not take the result within the timeout";
        break;
      }
      ::poll(fds.data(), fds.size(), detail::tcp_poll_ms(send_by));
    }
    if (!failure.empty()) throw error("tcp_bootstrap: rank 0 (the root): " + failure);
    if (!send_failure.empty()) throw error("tcp_bootstrap: rank 0 (the root): " + send_failure);
  }

  void gather_peer(std::span<const std::byte> mine, std::span<std::byte> all) {
    const auto start = clock::now();
    auto until = start + opt_.timeout + opt_.grace();
    bool asked = false;  // whether the root was asked, past the timeout, whether it is there
    std::string absent;  // the roll call's clause, where the root did not answer it
    const std::vector<std::byte> head = gather_header(detail::tcp_magic_gather, 0, calls_, mine.size());
    std::size_t sent_head = 0, sent_body = 0;
    std::vector<std::byte> reply(detail::tcp_gather_header);
    std::size_t got = 0, got_body = 0;
    std::vector<std::byte> text;
    bool sending = true, have_head = false;
    const std::string what = call_name();
    // Sending and reading in one loop: the root may answer (with a failure) before it has read
    // this rank's whole blob.
    for (;;) {
      int err = 0;
      if (sending) {
        detail::tcp_io io = detail::tcp_send_some(root_fd_.get(), head, sent_head, err);
        if (io == detail::tcp_io::progress) io = detail::tcp_send_some(root_fd_.get(), mine, sent_body, err);
        if (io == detail::tcp_io::progress) sending = false;
        else if (io == detail::tcp_io::closed) sending = false; // the read below says why
      }
      detail::tcp_io io = detail::tcp_io::progress;
      if (!have_head) {
        io = detail::tcp_recv_some(root_fd_.get(), reply, got, err);
        if (io == detail::tcp_io::progress) {
          have_head = true;
          if (detail::tcp_get(reply.data(), 4) != detail::tcp_magic_result || detail::tcp_get(reply.data() + 8, 8) != calls_)
            throw error(who() + ": the root at " + root_name_ + " answered " + what + " with something else");
          const auto status = detail::tcp_get(reply.data() + 4, 4);
          const auto blen = detail::tcp_get(reply.data() + 16, 8);
          if (status != ok) {
            if (blen > detail::tcp_max_message) throw error(who() + ": the root's answer is malformed");
            text.resize(blen);
          } else if (blen != all.size()) {
            throw error(who() + ": " + what + ": the root sent " + std::to_string(blen) + " bytes, expected " + std::to_string(all.size()));
          }
        }
      }
      if (io == detail::tcp_io::progress && have_head) {
        const bool failed = detail::tcp_get(reply.data() + 4, 4) != ok;
        io = detail::tcp_recv_some(root_fd_.get(), failed ? std::span<std::byte>(text) : all, got_body, err);
        if (io == detail::tcp_io::progress) {
          if (failed)
            throw error(who() + ": " + detail::printable(std::string_view(reinterpret_cast<const char*>(text.data()), text.size()), false) +
                        " (reported by the root at " + root_name_ + ")");
          if (sending) throw error(who() + ": " + what + ": the root answered before it had this rank's blob");
          return;
        }
      }
      if (io == detail::tcp_io::closed)
        throw error(who() + ": the root (rank 0 at " + root_name_ + ") closed the connection during " + what +
                    (err != 0 ? " (" + detail::errno_text(err) + ")" : "") + ": it failed or exited");
      // Past the timeout the root gives up and says why within the grace, unless it is stopped or
      // dead: a roll call tells which, and a root that does not answer it is named at once.
      // (Its verdict may have come during the roll call: the loop reads once more before that.)
      if (!absent.empty())
        throw timeout_error(who() + ": the root (rank 0 at " + root_name_ + ") did not answer " + what + " within " +
                            detail::tcp_seconds(opt_.timeout) + ", and " + absent);
      if (!asked && clock::now() >= start + opt_.timeout) {
        asked = true;
        bool gone = false;
        const std::string roll = ask({0}, std::min<std::chrono::milliseconds>(opt_.grace() / 2, std::chrono::seconds(1)), &gone);
        if (gone) absent = roll;
        continue; // it answers: its verdict follows (or the wait below ends)
      }
      if (clock::now() >= until)
        throw timeout_error(who() + ": the root (rank 0 at " + root_name_ + ") did not answer " + what + " within " +
                    detail::tcp_seconds(std::chrono::duration_cast<std::chrono::milliseconds>(opt_.timeout + opt_.grace())) +
                    (sending ? " (it did not take this rank's blob either: is it stopped?)" : ""));
      pollfd p{root_fd_.get(), static_cast<short>(POLLIN | (sending ? POLLOUT : 0)), 0};
      ::poll(&p, 1, detail::tcp_poll_ms(asked ? until : std::min(until, start + opt_.timeout)));
    }
  }

  tcp_bootstrap_options opt_;
  std::vector<member> members_; // rank 0: one per rank (0 is itself, without a socket)
  detail::tcp_fd root_fd_;      // other ranks: the connection to rank 0
  std::unique_ptr<detail::tcp_lookup> lookup_; // other ranks: the root's name, looked up
  std::string root_name_;
  std::uint64_t calls_ = 0;
  std::string broken_;
  std::unique_ptr<detail::tcp_roll_call> roll_; // answers roll calls; asks them (after the start)
  bool roll_asks_ = false;                      // whether a roll call reached the next rank at the start
  // rank 0's start-up: connections dropped, the first reasons, when it last logged one
  std::uint64_t dropped_ = 0;
  std::vector<std::string> dropped_reasons_;
  clock::time_point last_log_{};
};

static_assert(Bootstrap<tcp_bootstrap>);

/// Runs `f()` (an engine's call over `boot`, for example) and returns what it returns; a
/// timeout_error it throws gets `boot`'s roll call appended (tcp_bootstrap::roll_call_clause:
/// which ranks are stopped or dead), unless its message reports one already. The engine names the
/// peer it waited for, which may itself be waiting for the rank that stopped.
template <class F>
decltype(auto) with_roll_call(const tcp_bootstrap& boot, F&& f) {
  try {
    return std::forward<F>(f)();
  } catch (const timeout_error& e) {
    const std::string what = e.what();
    if (what.find("roll call") != std::string::npos) throw;
    throw timeout_error(what + boot.roll_call_clause());
  }
}

} // namespace fasta2a
