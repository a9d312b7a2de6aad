// fasta2a: a Bootstrap over plain TCP sockets, for programs started without MPI (torchrun, a
// Kubernetes job, a shell loop). Rank 0 listens; every other rank connects to it. Started from
// the environment a launcher sets (torchrun's MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, or the
// same names prefixed FASTA2A_), from a "host:port" id that rank 0 hands out (as NCCL's unique
// id), or from explicit options. POSIX sockets only; every wait is bounded by a timeout.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "fasta2a/common.hpp"
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

  /// What a non-root rank waits beyond the timeout for the root's verdict: half the timeout, at
  /// most 5 s.
  std::chrono::milliseconds grace() const noexcept { return std::min<std::chrono::milliseconds>(timeout / 2, std::chrono::seconds(5)); }

  /// Options from the environment. Each value is read from FASTA2A_<NAME> if set, else <NAME>:
  /// MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE; FASTA2A_BOOTSTRAP_ID ("host:port", replaces
  /// MASTER_ADDR and MASTER_PORT); FASTA2A_BOOTSTRAP_TIMEOUT (seconds, default 60). Throws
  /// fasta2a::error naming the variable that is missing or malformed.
  static tcp_bootstrap_options from_env();
};

namespace detail {

/// A socket descriptor, closed when it goes.
class tcp_fd {
public:
  tcp_fd() noexcept = default;
  explicit tcp_fd(int fd) noexcept : fd_(fd) {}
  tcp_fd(tcp_fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  tcp_fd& operator=(tcp_fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  tcp_fd(const tcp_fd&) = delete;
  tcp_fd& operator=(const tcp_fd&) = delete;
  ~tcp_fd() { reset(); }
  int get() const noexcept { return fd_; }
  explicit operator bool() const noexcept { return fd_ >= 0; }
  void reset() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

private:
  int fd_ = -1;
};

using tcp_clock = std::chrono::steady_clock;

inline std::string errno_text(int e) { return std::string(std::strerror(e)); }

inline void tcp_nonblocking(int fd) {
  const int fl = ::fcntl(fd, F_GETFL, 0);
  if (fl < 0 || ::fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0)
    throw error("tcp_bootstrap: fcntl(O_NONBLOCK) failed: " + errno_text(errno));
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one); // not fatal where it fails
}

/// Milliseconds left until `deadline` for poll(): at least 0, at most 1000 (so that callers
/// re-check their state now and then).
inline int tcp_poll_ms(tcp_clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - tcp_clock::now()).count();
  return static_cast<int>(std::clamp<long long>(left + 1, 0, 1000));
}

inline std::string tcp_seconds(std::chrono::milliseconds t) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", static_cast<double>(t.count()) / 1000.0);
  return std::string(buf) + " s";
}

inline std::string tcp_peer_address(int fd) {
  sockaddr_storage a{};
  socklen_t len = sizeof a;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) return "?";
  char host[NI_MAXHOST], serv[NI_MAXSERV];
  if (::getnameinfo(reinterpret_cast<sockaddr*>(&a), len, host, sizeof host, serv, sizeof serv,
                    NI_NUMERICHOST | NI_NUMERICSERV) != 0)
    return "?";
  std::string h = host;
  if (h.starts_with("::ffff:")) h = h.substr(7); // an IPv4 peer of a dual-stack listener
  return h + ":" + serv;
}

/// This process as peers name it in errors: "hostname (pid N)".
inline std::string tcp_self_name() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "?");
  return std::string(host) + " (pid " + std::to_string(::getpid()) + ")";
}

// Fixed-width little-endian fields of the wire format.
inline void tcp_put(std::vector<std::byte>& out, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<std::byte>((v >> (8 * i)) & 0xff));
}
inline std::uint64_t tcp_get(const std::byte* p, int bytes) {
  std::uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<std::uint64_t>(std::to_integer<unsigned>(p[i])) << (8 * i);
  return v;
}

/// Outcome of one non-blocking step on a socket.
enum class tcp_io { progress, would_block, closed };

/// Sends what it can of out[done..]; `err` gets errno on failure (closed).
inline tcp_io tcp_send_some(int fd, std::span<const std::byte> out, std::size_t& done, int& err) {
  while (done < out.size()) {
    const ssize_t n = ::send(fd, out.data() + done, out.size() - done, MSG_NOSIGNAL);
    if (n > 0) {
      done += static_cast<std::size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return tcp_io::would_block;
    err = n < 0 ? errno : 0;
    return tcp_io::closed;
  }
  return tcp_io::progress;
}

/// Receives what it can into in[done..]; closed on end of stream or an error (`err`: errno or 0).
inline tcp_io tcp_recv_some(int fd, std::span<std::byte> in, std::size_t& done, int& err) {
  while (done < in.size()) {
    const ssize_t n = ::recv(fd, in.data() + done, in.size() - done, 0);
    if (n > 0) {
      done += static_cast<std::size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return tcp_io::would_block;
    err = n < 0 ? errno : 0;
    return tcp_io::closed;
  }
  return tcp_io::progress;
}

/// Sends all of `out` by `deadline`; false if the peer went away or the deadline passed.
inline bool tcp_send_all(int fd, std::span<const std::byte> out, tcp_clock::time_point deadline) {
  std::size_t done = 0;
  int err = 0;
  for (;;) {
    const tcp_io r = tcp_send_some(fd, out, done, err);
    if (r == tcp_io::progress) return true;
    if (r == tcp_io::closed || tcp_clock::now() >= deadline) return false;
    pollfd p{fd, POLLOUT, 0};
    ::poll(&p, 1, tcp_poll_ms(deadline));
  }
}

inline constexpr std::uint32_t tcp_magic_hello = 0x42324146;   // "FA2B"
inline constexpr std::uint32_t tcp_magic_welcome = 0x57324146; // "FA2W"
inline constexpr std::uint32_t tcp_magic_gather = 0x47324146;  // "FA2G"
inline constexpr std::uint32_t tcp_magic_result = 0x52324146;  // "FA2R"
inline constexpr std::uint32_t tcp_version = 1;
inline constexpr std::size_t tcp_max_name = 255;
inline constexpr std::size_t tcp_max_message = 1 << 16;
inline constexpr std::size_t tcp_gather_header = 24; // magic, status, call, length

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
  return o;
}

/// Rank 0's listening socket, bound before the bootstrap is made so that its port (and id) can be
/// handed to the other ranks first: port 0 picks a free one. SO_REUSEADDR, every address,
/// IPv6 and IPv4 where the machine has IPv6, IPv4 only otherwise.
class tcp_listener {
public:
  explicit tcp_listener(std::uint16_t port = 0) {
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

private:
  detail::tcp_fd fd_;
  std::uint16_t port_ = 0;
};

/// A Bootstrap over TCP: a star through rank 0. The constructor is collective: rank 0 waits until
/// every rank has connected and said hello (magic and version word, its rank, its world size,
/// its host name and pid), then answers every rank with the verdict; the others connect with
/// retries until the timeout. An allgather sends each rank's blob to rank 0, which checks sizes
/// and call numbers and sends everything back: 2 (n - 1) messages per call, all through rank 0
/// (its cost grows as O(n) messages and O(n^2 * blob) bytes at the root, fine for the engine's
/// small blobs and tens to hundreds of ranks).
///
/// Errors, each a fasta2a::error within the timeout (timeout + grace() on ranks other than 0):
/// ranks that disagree on the world size (every rank that arrived is told both sizes), one rank
/// claimed by two processes (both hosts named), a root that cannot be reached, ranks that never
/// arrive (rank 0 names them; the others are told it gave up), a rank outside [0, size), and in
/// an allgather a peer that closes its connection, stops sending, or brings a blob of another
/// size or another call (named by rank and host). A connection that does not open with the
/// magic word is closed and ignored. After an allgather fails, the bootstrap is unusable: the
/// next call throws at once.
///
/// Non-copyable, movable; one thread at a time.
class tcp_bootstrap {
public:
  /// Connects as `opt` says. Rank 0 listens on opt.port (tcp_listener).
  explicit tcp_bootstrap(const tcp_bootstrap_options& opt) : opt_(opt) {
    check_options();
    if (opt_.rank == 0 && opt_.size > 1) {
      tcp_listener l(opt_.port);
      start_root(l);
    } else if (opt_.rank != 0) {
      start_peer();
    }
  }
  /// Rank 0 with a listener bound beforehand (its port given to the others); `opt.rank` must be 0.
  tcp_bootstrap(tcp_listener& listener, const tcp_bootstrap_options& opt) : opt_(opt) {
    check_options();
    if (opt_.rank != 0)
      throw error("tcp_bootstrap: a listener is rank 0's, but this rank is " + std::to_string(opt_.rank));
    if (opt_.size > 1) start_root(listener);
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
    if (!opt_.id.empty()) {
      auto [h, p] = detail::tcp_split_id(opt_.id, "id");
      opt_.root_address = std::move(h);
      opt_.port = p;
    }
    if (opt_.rank != 0 && opt_.port == 0)
      throw error(who() + ": the root's port is 0 (set MASTER_PORT, or give rank 0's tcp_listener port or id)");
    if (opt_.rank != 0 && opt_.root_address.empty()) throw error(who() + ": no root address (MASTER_ADDR)");
  }

  void close_all() {
    for (auto& m : members_) m.fd.reset();
    root_fd_.reset();
  }

  // ---- start-up, rank 0 -------------------------------------------------------------------

  /// A hello: magic(4) version(4) rank(4) world size(4) name length(2), then the name.
  static constexpr std::size_t hello_prefix = 18;

  struct pending {
    detail::tcp_fd fd;
    std::string addr;
    std::vector<std::byte> in = std::vector<std::byte>(hello_prefix);
    std::size_t got = 0;
    bool have_prefix = false;
  };

  void start_root(tcp_listener& l) {
    root_name_ = "port " + std::to_string(l.port());
    const auto deadline = clock::now() + opt_.timeout;
    const std::size_t n = static_cast<std::size_t>(opt_.size);
    members_.resize(n);
    members_[0].name = detail::tcp_self_name();
    std::vector<pending> waiting;
    std::vector<member> refused;      // connections that get the failure (duplicates, wrong size)
    std::vector<member> wrong_version; // told why, then closed
    std::string failure;
    std::size_t arrived = 0, strays = 0;
    while (arrived + refused.size() < n - 1 && clock::now() < deadline) {
      std::vector<pollfd> fds{{l.fd(), POLLIN, 0}};
      for (auto& p : waiting) fds.push_back({p.fd.get(), POLLIN, 0});
      ::poll(fds.data(), fds.size(), detail::tcp_poll_ms(deadline));
      if (fds[0].revents & POLLIN)
        for (;;) {
          const int c = ::accept4(l.fd(), nullptr, nullptr, SOCK_CLOEXEC);
          if (c < 0) break;
          pending p;
          p.fd = detail::tcp_fd(c);
          detail::tcp_nonblocking(c);
          p.addr = detail::tcp_peer_address(c);
          waiting.push_back(std::move(p));
        }
      for (std::size_t i = 0; i < waiting.size();) {
        pending& p = waiting[i];
        int err = 0;
        const detail::tcp_io r = detail::tcp_recv_some(p.fd.get(), p.in, p.got, err);
        bool drop = r == detail::tcp_io::closed;
        if (!drop && p.got >= 4 && detail::tcp_get(p.in.data(), 4) != detail::tcp_magic_hello) drop = true; // a stray
        if (drop) {
          ++strays;
          waiting.erase(waiting.begin() + static_cast<std::ptrdiff_t>(i));
          continue;
        }
        if (p.got < p.in.size()) {
          ++i;
          continue;
        }
        if (!p.have_prefix) { // the name follows the fixed part
          p.have_prefix = true;
          const std::size_t name = detail::tcp_get(p.in.data() + 16, 2);
          if (name > detail::tcp_max_name) {
            ++strays;
            waiting.erase(waiting.begin() + static_cast<std::ptrdiff_t>(i));
            continue;
          }
          p.in.resize(hello_prefix + name);
          if (name > 0) continue; // read the name next round (same index)
        }
        // A whole hello.
        const auto version = static_cast<std::uint32_t>(detail::tcp_get(p.in.data() + 4, 4));
        const auto r_rank = static_cast<std::int32_t>(detail::tcp_get(p.in.data() + 8, 4));
        const auto size_field = static_cast<std::int32_t>(detail::tcp_get(p.in.data() + 12, 4));
        member m{std::move(p.fd), std::string(reinterpret_cast<const char*>(p.in.data()) + hello_prefix, p.in.size() - hello_prefix) +
                                      " at " + p.addr};
        waiting.erase(waiting.begin() + static_cast<std::ptrdiff_t>(i));
        if (version != detail::tcp_version) {
          const std::string why = "rank " + std::to_string(r_rank) + " (" + m.name + ") speaks tcp_bootstrap version " +
                                  std::to_string(version) + ", the root (" + members_[0].name + ") version " +
                                  std::to_string(detail::tcp_version);
          detail::tcp_send_all(m.fd.get(), detail::tcp_verdict(detail::tcp_magic_welcome, why), clock::now() + std::chrono::milliseconds(200));
          wrong_version.push_back(std::move(m));
          continue;
        }
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
          if (failure.empty()) failure = why;
          refused.push_back(std::move(m));
          continue;
        }
        members_[static_cast<std::size_t>(r_rank)] = std::move(m);
        ++arrived;
      }
    }
    if (failure.empty() && arrived < n - 1) {
      std::string missing;
      std::size_t count = 0;
      for (std::size_t r = 1; r < n; ++r)
        if (!members_[r].fd) {
          if (count < 16) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
          ++count;
        }
      if (count > 16) missing += ", ... (" + std::to_string(count) + " in all)";
      failure = (count == 1 ? "rank " : "ranks ") + missing + " of " + std::to_string(n) + " did not arrive within " +
                detail::tcp_seconds(opt_.timeout) + " (the root listens on port " + std::to_string(l.port()) + ")" +
                (strays > 0 ? "; " + std::to_string(strays) + " stray connection(s) ignored" : "");
    }
    // The verdict, to everyone that arrived: they wait up to timeout + grace for it.
    const auto send_by = clock::now() + std::min<std::chrono::milliseconds>(opt_.grace(), std::chrono::seconds(2));
    const auto verdict = detail::tcp_verdict(detail::tcp_magic_welcome, failure);
    for (auto& m : members_)
      if (m.fd) detail::tcp_send_all(m.fd.get(), verdict, send_by);
    for (auto& m : refused) detail::tcp_send_all(m.fd.get(), verdict, send_by);
    if (!failure.empty()) {
      close_all();
      throw error("tcp_bootstrap: rank 0 (the root): " + failure);
    }
  }

  // ---- start-up, other ranks --------------------------------------------------------------

  void start_peer() {
    root_name_ = opt_.root_address + ":" + std::to_string(opt_.port);
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
    // The hello, then the verdict. The root gave itself at most `timeout` from before this
    // connection was accepted, so waiting timeout + grace from now hears its verdict.
    std::vector<std::byte> hello;
    detail::tcp_put(hello, detail::tcp_magic_hello, 4);
    detail::tcp_put(hello, detail::tcp_version, 4);
    detail::tcp_put(hello, static_cast<std::uint32_t>(opt_.rank), 4);
    detail::tcp_put(hello, static_cast<std::uint32_t>(opt_.size), 4);
    const std::string me = detail::tcp_self_name().substr(0, detail::tcp_max_name);
    detail::tcp_put(hello, me.size(), 2);
    for (char c : me) hello.push_back(static_cast<std::byte>(c));
    const auto wait_until = clock::now() + opt_.timeout + opt_.grace();
    if (!detail::tcp_send_all(root_fd_.get(), hello, wait_until))
      throw error(who() + ": the root at " + root_name_ + " closed the connection before the start");
    read_verdict(wait_until, "the start");
  }

  detail::tcp_fd try_connect(clock::time_point deadline, std::string& last) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    const std::string port = std::to_string(opt_.port);
    if (const int rc = ::getaddrinfo(opt_.root_address.c_str(), port.c_str(), &hints, &res); rc != 0) {
      last = std::string("cannot resolve '") + opt_.root_address + "': " + gai_strerror(rc);
      return {};
    }
    detail::tcp_fd out;
    for (addrinfo* a = res; a != nullptr && !out; a = a->ai_next) {
      detail::tcp_fd fd(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
      if (!fd) {
        last = "socket: " + detail::errno_text(errno);
        continue;
      }
      detail::tcp_nonblocking(fd.get());
      if (::connect(fd.get(), a->ai_addr, a->ai_addrlen) != 0) {
        if (errno != EINPROGRESS) {
          last = detail::errno_text(errno);
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
          last = detail::errno_text(err != 0 ? err : errno);
          continue;
        }
      }
      out = std::move(fd);
    }
    ::freeaddrinfo(res);
    return out;
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
      throw error(who() + ": the root at " + root_name_ + " gave up: " + std::string(reinterpret_cast<const char*>(msg.data()), msg.size()));
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

  std::string call_name() const { return "allgather #" + std::to_string(calls_); }

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
    const auto until = clock::now() + opt_.timeout + opt_.grace();
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
            throw error(who() + ": " + std::string(reinterpret_cast<const char*>(text.data()), text.size()) + " (reported by the root at " + root_name_ + ")");
          if (sending) throw error(who() + ": " + what + ": the root answered before it had this rank's blob");
          return;
        }
      }
      if (io == detail::tcp_io::closed)
        throw error(who() + ": the root (rank 0 at " + root_name_ + ") closed the connection during " + what +
                    (err != 0 ? " (" + detail::errno_text(err) + ")" : "") + ": it failed or exited");
      if (clock::now() >= until)
        throw timeout_error(who() + ": the root (rank 0 at " + root_name_ + ") did not answer " + what + " within " +
                    detail::tcp_seconds(std::chrono::duration_cast<std::chrono::milliseconds>(opt_.timeout + opt_.grace())) +
                    (sending ? " (it did not take this rank's blob either: is it stopped?)" : ""));
      pollfd p{root_fd_.get(), static_cast<short>(POLLIN | (sending ? POLLOUT : 0)), 0};
      ::poll(&p, 1, detail::tcp_poll_ms(until));
    }
  }

  tcp_bootstrap_options opt_;
  std::vector<member> members_; // rank 0: one per rank (0 is itself, without a socket)
  detail::tcp_fd root_fd_;      // other ranks: the connection to rank 0
  std::string root_name_;
  std::uint64_t calls_ = 0;
  std::string broken_;
};

static_assert(Bootstrap<tcp_bootstrap>);

} // namespace fasta2a
