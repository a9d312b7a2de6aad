// fasta2a: a deterministic byte pattern for messages, to fill send buffers and check every
// received byte (tests, the CLI's `run`, benchmarks).
#pragma once

#include <cstddef>
#include <cstdint>
#include <bit>
#include <cstring>
#include <span>

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

static_assert(std::endian::native == std::endian::little, "fill_pattern assumes a little-endian host");

} // namespace fasta2a
