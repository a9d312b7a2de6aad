// fasta2a: the TCP bootstrap's wire format and socket helpers (fasta2a/tcp_bootstrap.hpp,
// fasta2a/tcp_roll_call.hpp): descriptors, non-blocking sends and receives bounded by deadlines,
// fixed-width little-endian fields, the messages' magic words and sizes, and the proofs of the job
// secret (HMAC-SHA256, OpenSSL's libcrypto). POSIX sockets only.
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
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fasta2a/common.hpp"

namespace fasta2a::detail {

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

inline constexpr std::uint32_t tcp_magic_hello = 0x42324146;     // "FA2B"
inline constexpr std::uint32_t tcp_magic_challenge = 0x43324146; // "FA2C"
inline constexpr std::uint32_t tcp_magic_claim = 0x4b324146;     // "FA2K"
inline constexpr std::uint32_t tcp_magic_welcome = 0x57324146;   // "FA2W"
inline constexpr std::uint32_t tcp_magic_gather = 0x47324146;    // "FA2G"
inline constexpr std::uint32_t tcp_magic_result = 0x52324146;    // "FA2R"
/// 3: after the start, every rank's roll-call address is gathered (fasta2a/tcp_roll_call.hpp).
/// 2: the authenticated handshake (hello with a nonce, challenge, claim). 1 had no proof.
inline constexpr std::uint32_t tcp_version = 3;
inline constexpr std::size_t tcp_nonce_bytes = 32;
inline constexpr std::size_t tcp_mac_bytes = 32; // HMAC-SHA256
inline constexpr std::size_t tcp_min_secret = 16;
/// hello: magic(4) version(4) nonce(32)
inline constexpr std::size_t tcp_hello_bytes = 8 + tcp_nonce_bytes;
/// challenge: magic(4) version(4) nonce(32) mac(32)
inline constexpr std::size_t tcp_challenge_bytes = 8 + tcp_nonce_bytes + tcp_mac_bytes;
/// claim: magic(4) rank(4) size(4) name length(2), then the name and the mac(32)
inline constexpr std::size_t tcp_claim_prefix = 14;
inline constexpr std::size_t tcp_max_name = 255;
inline constexpr std::size_t tcp_max_message = 1 << 16;
inline constexpr std::size_t tcp_gather_header = 24; // magic, status, call, length

using tcp_nonce = std::array<std::byte, tcp_nonce_bytes>;
using tcp_mac = std::array<std::byte, tcp_mac_bytes>;

/// Fresh random bytes from OpenSSL's generator.
inline tcp_nonce tcp_random_nonce() {
  tcp_nonce n{};
  if (RAND_bytes(reinterpret_cast<unsigned char*>(n.data()), static_cast<int>(n.size())) != 1)
    throw error("tcp_bootstrap: OpenSSL's RAND_bytes failed: no random nonce");
  return n;
}

/// The handshake's message authentication code: HMAC-SHA256 under the job secret of a label (who
/// proves: "root" or "rank", so that one side's answer never passes for the other's), the two
/// nonces (the prover's peer's first), the job id and `fields`. Without a secret the key is a
/// fixed string: the handshake then checks only that both sides speak it and agree on the job id.
inline tcp_mac tcp_prove(const std::string& secret, std::string_view label, const tcp_nonce& first, const tcp_nonce& second,
                         const std::string& job_id, std::span<const std::byte> fields) {
  std::vector<std::byte> msg;
  for (char c : label) msg.push_back(static_cast<std::byte>(c));
  msg.push_back(std::byte{0});
  msg.insert(msg.end(), first.begin(), first.end());
  msg.insert(msg.end(), second.begin(), second.end());
  tcp_put(msg, job_id.size(), 4);
  for (char c : job_id) msg.push_back(static_cast<std::byte>(c));
  msg.insert(msg.end(), fields.begin(), fields.end());
  static constexpr std::string_view no_secret = "fasta2a tcp_bootstrap without a job secret";
  const std::string_view key = secret.empty() ? no_secret : std::string_view(secret);
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), reinterpret_cast<const unsigned char*>(msg.data()),
           msg.size(), md, &len) == nullptr ||
      len != tcp_mac_bytes)
    throw error("tcp_bootstrap: OpenSSL's HMAC-SHA256 failed");
  tcp_mac m{};
  std::memcpy(m.data(), md, m.size());
  return m;
}

/// Equal MACs, compared in constant time.
inline bool tcp_mac_equal(const std::byte* a, const tcp_mac& b) { return CRYPTO_memcmp(a, b.data(), b.size()) == 0; }

/// Whether `host` names this machine's loopback (localhost, 127.0.0.0/8, ::1): only processes of
/// this machine can reach a socket there. Names other than "localhost" are not looked up.
inline bool tcp_is_loopback(std::string_view host) {
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  if (host == "localhost" || host == "ip6-localhost" || host == "localhost6") return true;
  const std::string h(host);
  in_addr a4{};
  if (::inet_pton(AF_INET, h.c_str(), &a4) == 1) return (ntohl(a4.s_addr) >> 24) == 127;
  in6_addr a6{};
  if (::inet_pton(AF_INET6, h.c_str(), &a6) == 1) {
    if (IN6_IS_ADDR_LOOPBACK(&a6)) return true;
    if (IN6_IS_ADDR_V4MAPPED(&a6)) return a6.s6_addr[12] == 127;
  }
  return false;
}

} // namespace fasta2a::detail
