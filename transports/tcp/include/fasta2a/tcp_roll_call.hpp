// fasta2a: the TCP bootstrap's roll call. When a rank has waited for a peer past its timeout, the
// peer it waited for may itself be waiting for a third rank that stopped: the rank to name is the
// one that is not there. Every rank of a tcp_bootstrap answers roll calls from a thread of its
// own, on a UDP port published to the job at the start, so it answers whatever its main thread is
// doing (in the engine, in another collective, in user code); a stopped (SIGSTOP) or dead process
// does not. Asking takes one datagram per rank, resent a few times, for at most a second.
//
// Only the job's ranks can ask or answer: a question carries an HMAC-SHA256 under the job secret
// over a fresh nonce, the job id and both ranks, and an answer one over the same nonce (the
// labels differ), so an answer cannot be forged or replayed to make a stopped rank look alive,
// and a stranger's datagram gets nothing back. POSIX sockets only; Linux's eventfd stops the thread.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "fasta2a/common.hpp"
#include "fasta2a/tcp_wire.hpp"

namespace fasta2a::detail {

inline constexpr std::uint32_t tcp_magic_ping = 0x50324146; // "FA2P": a question
inline constexpr std::uint32_t tcp_magic_here = 0x48324146; // "FA2H": its answer
/// A question or an answer: magic(4) version(4) sender's rank(4) the other rank(4) nonce(32) mac(32).
inline constexpr std::size_t tcp_roll_bytes = 16 + tcp_nonce_bytes + tcp_mac_bytes;
/// A published address: family(2: 4 or 6; 0 where the rank has no roll call) port(2, network
/// order) address(16).
inline constexpr std::size_t tcp_roll_address_bytes = 20;
using tcp_roll_address = std::array<std::byte, tcp_roll_address_bytes>;

/// A socket address as published (IPv4-mapped IPv6 addresses become IPv4); all zero if the
/// family is neither.
inline tcp_roll_address tcp_roll_encode(const sockaddr_storage& a) {
  tcp_roll_address out{};
  if (a.ss_family == AF_INET6) {
    const auto& s6 = reinterpret_cast<const sockaddr_in6&>(a);
    if (IN6_IS_ADDR_V4MAPPED(&s6.sin6_addr)) {
      out[0] = std::byte{4};
      std::memcpy(out.data() + 2, &s6.sin6_port, 2);
      std::memcpy(out.data() + 4, s6.sin6_addr.s6_addr + 12, 4);
    } else {
      out[0] = std::byte{6};
      std::memcpy(out.data() + 2, &s6.sin6_port, 2);
      std::memcpy(out.data() + 4, &s6.sin6_addr, 16);
    }
  } else if (a.ss_family == AF_INET) {
    const auto& s4 = reinterpret_cast<const sockaddr_in&>(a);
    out[0] = std::byte{4};
    std::memcpy(out.data() + 2, &s4.sin_port, 2);
    std::memcpy(out.data() + 4, &s4.sin_addr, 4);
  }
  return out;
}

/// The socket address a published one names (family AF_UNSPEC where it names none).
inline sockaddr_storage tcp_roll_decode(std::span<const std::byte> p, socklen_t& len) {
  sockaddr_storage a{};
  len = 0;
  if (p.size() < tcp_roll_address_bytes) return a;
  if (p[0] == std::byte{4}) {
    auto& s4 = reinterpret_cast<sockaddr_in&>(a);
    s4.sin_family = AF_INET;
    std::memcpy(&s4.sin_port, p.data() + 2, 2);
    std::memcpy(&s4.sin_addr, p.data() + 4, 4);
    len = sizeof s4;
  } else if (p[0] == std::byte{6}) {
    auto& s6 = reinterpret_cast<sockaddr_in6&>(a);
    s6.sin6_family = AF_INET6;
    std::memcpy(&s6.sin6_port, p.data() + 2, 2);
    std::memcpy(&s6.sin6_addr, p.data() + 4, 16);
    len = sizeof s6;
  }
  return a;
}

/// One rank's side of the roll call: a thread that answers the job's questions on a UDP port, and
/// `missing`, which asks. Non-copyable, non-movable (the thread holds `this`); hold it by pointer.
class tcp_roll_call {
public:
  /// Answers for `rank` of the job (`secret`, `job_id`) on a UDP port of `local`'s address (the
  /// address this rank's bootstrap connection uses, so that the job's other ranks can reach it).
  /// Where no socket can be made, it answers nothing and publishes an empty address: the others
  /// then cannot ask this rank, and never name it.
  tcp_roll_call(std::string secret, std::string job_id, rank_t rank, sockaddr_storage local)
      : secret_(std::move(secret)), job_id_(std::move(job_id)), rank_(rank) {
    if (local.ss_family == AF_INET6 && IN6_IS_ADDR_V4MAPPED(&reinterpret_cast<sockaddr_in6&>(local).sin6_addr)) {
      socklen_t l = 0; // bind the IPv4 address itself: a peer asks over IPv4
      local = tcp_roll_decode(tcp_roll_encode(local), l);
    }
    if (local.ss_family != AF_INET && local.ss_family != AF_INET6) return;
    tcp_fd s(::socket(local.ss_family, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    tcp_fd stop(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!s || !stop) return;
    if (local.ss_family == AF_INET) reinterpret_cast<sockaddr_in&>(local).sin_port = 0;
    else reinterpret_cast<sockaddr_in6&>(local).sin6_port = 0;
    const socklen_t len = local.ss_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    if (::bind(s.get(), reinterpret_cast<const sockaddr*>(&local), len) != 0) return;
    sockaddr_storage bound{};
    socklen_t blen = sizeof bound;
    if (::getsockname(s.get(), reinterpret_cast<sockaddr*>(&bound), &blen) != 0) return;
    address_ = tcp_roll_encode(bound);
    sock_ = std::move(s);
    stop_ = std::move(stop);
    thread_ = std::thread([this] { serve(); });
  }
  ~tcp_roll_call() {
    if (thread_.joinable()) {
      const std::uint64_t one = 1;
      [[maybe_unused]] const auto w = ::write(stop_.get(), &one, sizeof one);
      thread_.join();
    }
  }
  tcp_roll_call(const tcp_roll_call&) = delete;
  tcp_roll_call& operator=(const tcp_roll_call&) = delete;

  /// Where this rank answers, as published (all zero: nowhere).
  const tcp_roll_address& address() const noexcept { return address_; }
  /// Every rank's published address, in rank order (from the start's exchange).
  void set_peers(std::span<const std::byte> table) { peers_.assign(table.begin(), table.end()); }
  /// The number of ranks whose addresses are known (0 before set_peers).
  std::size_t ranks() const noexcept { return peers_.size() / tcp_roll_address_bytes; }

  /// Asks `ranks` (this rank and ranks without an address are skipped) whether they are there,
  /// for at most `within`, resending to those that have not answered; returns those that did not
  /// answer, in the order given. std::nullopt where no question could be sent (no addresses yet,
  /// no socket). Never throws.
  std::optional<std::vector<rank_t>> missing(std::span<const rank_t> ranks, std::chrono::milliseconds within) const noexcept {
    try {
      if (ranks.empty()) return std::vector<rank_t>{};
      const std::size_t n = this->ranks();
      if (n == 0) return std::nullopt;
      const tcp_nonce nonce = tcp_random_nonce();
      struct target {
        rank_t rank;
        sockaddr_storage addr;
        socklen_t len;
        std::vector<std::byte> question;
        bool answered = false;
      };
      std::vector<target> ts;
      std::vector<int> index(n, -1);
      for (rank_t r : ranks) {
        if (r < 0 || static_cast<std::size_t>(r) >= n || r == rank_ || index[static_cast<std::size_t>(r)] >= 0) continue;
        socklen_t len = 0;
        const sockaddr_storage a = tcp_roll_decode(std::span(peers_).subspan(static_cast<std::size_t>(r) * tcp_roll_address_bytes), len);
        if (len == 0) continue;
        index[static_cast<std::size_t>(r)] = static_cast<int>(ts.size());
        ts.push_back({r, a, len, message(tcp_magic_ping, "ping", nonce, rank_, r)});
      }
      if (ts.empty()) return std::vector<rank_t>{};
      tcp_fd v4(::socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
      tcp_fd v6(::socket(AF_INET6, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
      const auto socket_for = [&](const target& t) { return t.addr.ss_family == AF_INET ? v4.get() : v6.get(); };
      const auto deadline = tcp_clock::now() + within;
      auto next_send = tcp_clock::now();
      auto pause = std::chrono::milliseconds(20);
      std::size_t answered = 0;
      bool sent_any = false;
      std::array<std::byte, tcp_roll_bytes + 1> buf{};
      while (answered < ts.size()) {
        const auto now = tcp_clock::now();
        if (now >= next_send) {
          for (const target& t : ts)
            if (!t.answered && socket_for(t) >= 0 &&
                ::sendto(socket_for(t), t.question.data(), t.question.size(), 0, reinterpret_cast<const sockaddr*>(&t.addr), t.len) ==
                    static_cast<ssize_t>(t.question.size()))
              sent_any = true;
          next_send = now + pause;
          pause = std::min(pause * 2, std::chrono::milliseconds(200));
        }
        if (!sent_any) return std::nullopt;
        if (now >= deadline) break;
        std::array<pollfd, 2> fds{{{v4.get(), POLLIN, 0}, {v6.get(), POLLIN, 0}}};
        ::poll(fds.data(), fds.size(), tcp_poll_ms(std::min(next_send, deadline)));
        for (const pollfd& f : fds) {
          if (f.fd < 0) continue;
          for (;;) {
            const ssize_t k = ::recv(f.fd, buf.data(), buf.size(), MSG_DONTWAIT);
            if (k < 0) break;
            if (static_cast<std::size_t>(k) != tcp_roll_bytes || tcp_get(buf.data(), 4) != tcp_magic_here ||
                tcp_get(buf.data() + 4, 4) != tcp_version || static_cast<std::int32_t>(tcp_get(buf.data() + 12, 4)) != rank_ ||
                std::memcmp(buf.data() + 16, nonce.data(), nonce.size()) != 0)
              continue;
            const auto from = static_cast<std::int32_t>(tcp_get(buf.data() + 8, 4));
            if (from < 0 || static_cast<std::size_t>(from) >= n || index[static_cast<std::size_t>(from)] < 0) continue;
            target& t = ts[static_cast<std::size_t>(index[static_cast<std::size_t>(from)])];
            if (t.answered || !tcp_mac_equal(buf.data() + 16 + tcp_nonce_bytes, proof("here", nonce, from, rank_))) continue;
            t.answered = true;
            ++answered;
          }
        }
      }
      std::vector<rank_t> out;
      for (const target& t : ts)
        if (!t.answered) out.push_back(t.rank);
      return out;
    } catch (...) {
      return std::nullopt;
    }
  }

private:
  tcp_mac proof(std::string_view label, const tcp_nonce& nonce, rank_t sender, rank_t other) const {
    std::vector<std::byte> fields;
    tcp_put(fields, static_cast<std::uint32_t>(sender), 4);
    tcp_put(fields, static_cast<std::uint32_t>(other), 4);
    return tcp_prove(secret_, label, nonce, tcp_nonce{}, job_id_, fields);
  }
  std::vector<std::byte> message(std::uint32_t magic, std::string_view label, const tcp_nonce& nonce, rank_t sender, rank_t other) const {
    std::vector<std::byte> m;
    tcp_put(m, magic, 4);
    tcp_put(m, tcp_version, 4);
    tcp_put(m, static_cast<std::uint32_t>(sender), 4);
    tcp_put(m, static_cast<std::uint32_t>(other), 4);
    m.insert(m.end(), nonce.begin(), nonce.end());
    const tcp_mac p = proof(label, nonce, sender, other);
    m.insert(m.end(), p.begin(), p.end());
    return m;
  }

  // The answering thread: a question for this rank whose proof checks gets an answer, anything
  // else nothing (an answer is no larger than its question: no use as a reflector).
  void serve() noexcept {
    std::array<std::byte, tcp_roll_bytes + 1> buf{};
    for (;;) {
      std::array<pollfd, 2> fds{{{sock_.get(), POLLIN, 0}, {stop_.get(), POLLIN, 0}}};
      if (::poll(fds.data(), fds.size(), -1) < 0) {
        if (errno == EINTR) continue;
        return;
      }
      if (fds[1].revents != 0) return;
      for (;;) {
        sockaddr_storage from{};
        socklen_t flen = sizeof from;
        const ssize_t k = ::recvfrom(sock_.get(), buf.data(), buf.size(), MSG_DONTWAIT, reinterpret_cast<sockaddr*>(&from), &flen);
        if (k < 0) break;
        try {
          if (static_cast<std::size_t>(k) != tcp_roll_bytes || tcp_get(buf.data(), 4) != tcp_magic_ping ||
              tcp_get(buf.data() + 4, 4) != tcp_version || static_cast<std::int32_t>(tcp_get(buf.data() + 12, 4)) != rank_)
            continue;
          const auto asker = static_cast<std::int32_t>(tcp_get(buf.data() + 8, 4));
          tcp_nonce nonce{};
          std::memcpy(nonce.data(), buf.data() + 16, nonce.size());
          if (!tcp_mac_equal(buf.data() + 16 + tcp_nonce_bytes, proof("ping", nonce, asker, rank_))) continue;
          const std::vector<std::byte> answer = message(tcp_magic_here, "here", nonce, rank_, asker);
          ::sendto(sock_.get(), answer.data(), answer.size(), 0, reinterpret_cast<const sockaddr*>(&from), flen);
        } catch (...) { // OpenSSL failed: no answer, as from a rank that is not there
        }
      }
    }
  }

  std::string secret_, job_id_;
  rank_t rank_;
  tcp_roll_address address_{};
  std::vector<std::byte> peers_;
  tcp_fd sock_, stop_;
  std::thread thread_;
};

/// Ranks as text: "3", "2, 5", or "0, 1, ... (40 in all)" past 16.
inline std::string tcp_rank_list(std::span<const rank_t> ranks) {
  std::string s;
  for (std::size_t k = 0; k < ranks.size() && k < 16; ++k) s += (k ? ", " : "") + std::to_string(ranks[k]);
  if (ranks.size() > 16) s += ", ... (" + std::to_string(ranks.size()) + " in all)";
  return s;
}

} // namespace fasta2a::detail
