// Checks of the engine shared by the conformance suite and the engine's own tests: layouts with
// gaps between messages, one call with every received byte and every gap checked, skewed matrices.
#pragma once

#include <random>
#include <span>
#include <string>
#include <vector>

#include <fasta2a/common.hpp>
#include <fasta2a/pattern.hpp>
#include <fasta2a/traffic.hpp>

namespace fasta2a::testing {

/// What nothing may overwrite.
inline constexpr std::byte canary{0xEE};

struct engine_layout {
  std::vector<std::uint64_t> send_counts, send_displs, recv_counts, recv_displs;
  std::size_t send_elems = 0, recv_elems = 0;
};

/// Rank r's counts and displacements (in elements) for traffic t; `gap` elements between messages
/// make sure nothing is written where it should not be.
inline engine_layout engine_layout_of(const traffic_matrix& t, rank_t r, std::size_t elem, std::uint64_t gap) {
  const rank_t n = static_cast<rank_t>(t.rows());
  engine_layout l;
  for (rank_t j = 0; j < n; ++j) {
    l.send_displs.push_back(l.send_elems);
    l.send_counts.push_back(t(r, j) / elem);
    l.send_elems += t(r, j) / elem + gap;
    l.recv_displs.push_back(l.recv_elems);
    l.recv_counts.push_back(t(j, r) / elem);
    l.recv_elems += t(j, r) / elem + gap;
  }
  return l;
}

/// One all-to-allv of t by `eng` on rank r, every received byte and every gap checked.
template <class Engine>
void engine_call_checked(Engine& eng, const traffic_matrix& t, rank_t r, std::size_t elem) {
  const rank_t n = static_cast<rank_t>(t.rows());
  const engine_layout l = engine_layout_of(t, r, elem, 3);
  std::vector<std::byte> send(l.send_elems * elem), recv(l.recv_elems * elem, canary);
  for (rank_t j = 0; j < n; ++j) fill_pattern(std::span(send).subspan(l.send_displs[j] * elem, t(r, j)), r, j);
  eng.alltoallv(send, l.send_counts, l.send_displs, recv, l.recv_counts, l.recv_displs, elem);
  std::vector<char> written(recv.size(), 0);
  for (rank_t i = 0; i < n; ++i)
    for (std::uint64_t b = 0; b < t(i, r); ++b) {
      const std::size_t at = l.recv_displs[i] * elem + b;
      written[at] = 1;
      if (recv[at] != pattern_byte(i, r, b))
        throw error("rank " + std::to_string(r) + ": byte " + std::to_string(b) + " from rank " + std::to_string(i) + " is wrong");
    }
  for (std::size_t k = 0; k < recv.size(); ++k)
    if (!written[k] && recv[k] != canary)
      throw error("rank " + std::to_string(r) + ": byte " + std::to_string(k) + " outside every message was written");
}

/// A skewed matrix of one of four kinds (Zipf, hot-spot, log-normal, sparse with an idle sender
/// and an idle receiver), entries multiples of elem.
inline traffic_matrix skewed_traffic(rank_t n, std::mt19937_64& rng, bytes_t elem) {
  switch (rng() % 4) {
  case 0: return zipf_traffic(n, 1.2, elem * (1 + rng() % 2000), rng(), elem);
  case 1: return hotspot_traffic(n, 1 + static_cast<rank_t>(rng() % static_cast<std::uint64_t>(n)), 0.8, elem * (1 + rng() % 2000), rng(), elem);
  case 2: return lognormal_traffic(n, 1.0, elem * (1 + rng() % 2000), rng(), elem);
  default: {
    traffic_matrix t = zipf_traffic(n, 0.8, elem * 512, rng(), elem);
    t.row(static_cast<rank_t>(rng() % static_cast<std::uint64_t>(n))).setZero();
    t.col(static_cast<rank_t>(rng() % static_cast<std::uint64_t>(n))).setZero();
    return t;
  }
  }
}

} // namespace fasta2a::testing
