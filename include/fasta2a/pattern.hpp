// fasta2a: a deterministic byte pattern for messages, to fill send buffers and check every
// received byte, and the packed all-to-allv layout of a traffic matrix (tests, the CLI's `run`,
// benchmarks).
#pragma once

#include <cstddef>
#include <cstdint>
#include <bit>
#include <cstring>
#include <span>
#include <vector>

#include "fasta2a/common.hpp"

namespace fasta2a {

namespace detail {
inline std::uint64_t pattern_word(rank_t src, rank_t dst, std::uint64_t word) noexcept {
  std::uint64_t x = (static_cast<std::uint64_t>(static_cast<std::uint32_t>(src)) << 32 |
                     static_cast<std::uint32_t>(dst)) * 0x9e3779b97f4a7c15ull ^ word;
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
} // namespace detail

/// Byte `offset` of the message src -> dst. Two different messages, or two offsets of one
/// message, agree only by chance (1 in 256), so a byte delivered to the wrong place is caught.
inline std::byte pattern_byte(rank_t src, rank_t dst, std::uint64_t offset) noexcept {
  return static_cast<std::byte>(detail::pattern_word(src, dst, offset / 8) >> (8 * (offset % 8)));
}

/// Fills buf with bytes [offset, offset + buf.size()) of the message src -> dst.
inline void fill_pattern(std::span<std::byte> buf, rank_t src, rank_t dst, std::uint64_t offset = 0) noexcept {
  std::size_t i = 0;
  for (; i < buf.size() && (offset + i) % 8 != 0; ++i) buf[i] = pattern_byte(src, dst, offset + i);
  for (; i + 8 <= buf.size(); i += 8) {
    const std::uint64_t w = detail::pattern_word(src, dst, (offset + i) / 8);
    std::memcpy(buf.data() + i, &w, 8); // little-endian hosts: byte k of the word is offset k
  }
  for (; i < buf.size(); ++i) buf[i] = pattern_byte(src, dst, offset + i);
}

/// Bytes of buf that differ from bytes [0, buf.size()) of the message src -> dst.
inline std::uint64_t pattern_mismatches(std::span<const std::byte> buf, rank_t src, rank_t dst) noexcept {
  std::uint64_t bad = 0;
  std::size_t i = 0;
  for (; i + 8 <= buf.size(); i += 8) {
    const std::uint64_t w = detail::pattern_word(src, dst, i / 8);
    if (std::memcmp(buf.data() + i, &w, 8) != 0)
      for (std::size_t k = 0; k < 8; ++k) bad += buf[i + k] != pattern_byte(src, dst, i + k);
  }
  for (; i < buf.size(); ++i) bad += buf[i] != pattern_byte(src, dst, i);
  return bad;
}

/// One rank's all-to-allv arguments for a traffic matrix (bytes), messages packed in rank order:
/// what MPI_Alltoallv takes, in bytes.
struct packed_layout {
  std::vector<std::uint64_t> send_counts, send_displs, recv_counts, recv_displs;
  bytes_t send_bytes = 0, recv_bytes = 0;

  /// Rank r's layout: it sends row r of t and receives column r. T is any matrix type with
  /// rows() and operator()(i, j) giving bytes (traffic_matrix).
  template <class T>
  packed_layout(const T& t, rank_t r) {
    const auto n = static_cast<rank_t>(t.rows());
    for (rank_t j = 0; j < n; ++j) {
      send_displs.push_back(send_bytes);
      send_counts.push_back(t(r, j));
      send_bytes += t(r, j);
      recv_displs.push_back(recv_bytes);
      recv_counts.push_back(t(j, r));
      recv_bytes += t(j, r);
    }
  }

  /// Fills rank `me`'s send buffer (send_bytes long) with every message's pattern.
  void fill(std::span<std::byte> send, rank_t me) const noexcept {
    for (std::size_t j = 0; j < send_counts.size(); ++j)
      fill_pattern(send.subspan(send_displs[j], send_counts[j]), me, static_cast<rank_t>(j));
  }

  /// Received bytes of rank `me` that differ from their senders' patterns; `first_bad` (if given)
  /// is set to the first sender with a wrong byte, or -1.
  std::uint64_t mismatches(std::span<const std::byte> recv, rank_t me, rank_t* first_bad = nullptr) const noexcept {
    std::uint64_t bad = 0;
    if (first_bad) *first_bad = -1;
    for (std::size_t i = 0; i < recv_counts.size(); ++i) {
      const std::uint64_t b = pattern_mismatches(recv.subspan(recv_displs[i], recv_counts[i]), static_cast<rank_t>(i), me);
      if (b && first_bad && *first_bad < 0) *first_bad = static_cast<rank_t>(i);
      bad += b;
    }
    return bad;
  }
};

static_assert(std::endian::native == std::endian::little, "fill_pattern assumes a little-endian host");

} // namespace fasta2a
