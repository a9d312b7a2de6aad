// fasta2a: the plan of the transposed matrix, made from a plan instead of planned again.
//
// An MoE layer's combine sends every token back to where its dispatch took it from: the combine's
// traffic matrix is the transpose of the dispatch's. The plan of the transpose is then the plan of
// the matrix with every piece reversed: the same stages (each permutation inverted), the same
// rails, the same stage of each piece, and a piece's balance hop becomes its redistribute hop and
// the other way round. It has the same stage weights, scale-up bytes and staging sizes, so it is
// exactly as good, and it costs one pass over the plan's pieces instead of phase 1 and a
// decomposition (the engine reuses plans so: engine_options::reuse_plans).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "fasta2a/common.hpp"
#include "fasta2a/decompose.hpp"
#include "fasta2a/plan.hpp"

namespace fasta2a {

namespace detail {

/// The op at the other end of the same hop: what a piece's op becomes when the piece is reversed.
constexpr op_kind reversed(op_kind k) noexcept {
  switch (k) {
  case op_kind::self_copy: return op_kind::self_copy;
  case op_kind::intra_send: return op_kind::intra_recv;
  case op_kind::intra_recv: return op_kind::intra_send;
  case op_kind::balance_send: return op_kind::redistribute_recv;
  case op_kind::balance_recv: return op_kind::redistribute_send;
  case op_kind::rail_send: return op_kind::rail_recv;
  case op_kind::rail_recv: return op_kind::rail_send;
  case op_kind::redistribute_send: return op_kind::balance_recv;
  case op_kind::redistribute_recv: return op_kind::balance_send;
  case op_kind::direct_send: return op_kind::direct_recv;
  case op_kind::direct_recv: return op_kind::direct_send;
  }
  return k;
}

} // namespace detail

/// Sets `out` to the plan of the transposed matrix (every message src -> dst becoming dst -> src),
/// made from p, the plan of the matrix: a whole plan gives the whole plan, rank r's view rank r's
/// view. Every piece keeps its bytes, offset, rail and stage with its source and destination
/// swapped, in the same order; stage t's permutation is p's inverted; the staging regions are laid
/// out as the planner lays out those of the transposed matrix (each pair's region sized by the
/// transposed M), and each piece sits at the same position of its rail stream, so every rank's
/// view transposes to the view of the same transposed whole plan. Transposing twice gives p back.
///
/// `m` is p's M, the per-rail bytes between servers (planner::rail_matrix() right after making p;
/// out's is its transpose); it places the staging of a staged shared plan that shares no staging
/// across stages, and is not read otherwise. A per-rail plan (plan::per_rail) places its staging
/// from `balance` instead: every rank's bytes of balance regions (planner::balance_bytes() right
/// after making p; out's is p's staging_bytes less it). Each rail's regions there are its own
/// streams, which a view does not hold for the pairs it does not touch; but a rank's balance
/// regions of the transposed plan are its receive regions of p, in the same order, and its receive
/// regions its balance regions, so each offset only moves by the size of the part it leaves.
/// SG: the GPUs per server when known at compile time (0: read from the plan). Throws
/// fasta2a::error for an `m` that is not servers x servers or a `balance` that is not one size per
/// rank (or exceeds a rank's staging) where it is read, or a stage permutation naming no server.
template <int SG = 0>
void transpose_into(const plan& p, const server_matrix& m, plan& out, std::span<const bytes_t> balance = {}) {
  if (&p == &out) {
    plan q;
    transpose_into<SG>(p, m, q, balance);
    out = std::move(q);
    return;
  }
  const int S = p.servers, G = p.gpus_per_server;
  if (S < 1 || G < 1) throw error("transpose: the plan has no servers or no GPUs");
  if (SG > 0 && G != SG)
    throw error("transpose: the plan has " + std::to_string(G) + " GPUs per server, this instance expects " +
                std::to_string(SG));
  const rank_t n = p.ranks();
  const bool ring = p.staging_ring > 0;
  const bool placed = p.staged && !ring; // staging offsets from the regions' bases
  const bool rails = p.per_rail();
  if (placed && rails) {
    if (balance.size() != static_cast<std::size_t>(n) || p.staging_bytes.size() != balance.size())
      throw error("transpose: a per-rail plan needs every rank's balance bytes (planner::balance_bytes()): " +
                  std::to_string(balance.size()) + " given, the plan has " + std::to_string(n) + " ranks");
    for (std::size_t r = 0; r < balance.size(); ++r)
      if (balance[r] > p.staging_bytes[r])
        throw error("transpose: rank " + std::to_string(r) + "'s balance bytes (" + std::to_string(balance[r]) +
                    ") exceed its staging (" + std::to_string(p.staging_bytes[r]) + ")");
  }
  if (placed && !rails && (m.rows() != S || m.cols() != S))
    throw error("transpose: the server matrix is " + std::to_string(m.rows()) + " x " + std::to_string(m.cols()) +
                ", the plan has " + std::to_string(S) + " servers");

  out.decomposer = p.decomposer;
  out.choice = p.choice;
  out.servers = S;
  out.gpus_per_server = G;
  out.granule = p.granule;
  out.staged = p.staged;
  out.view = p.view;
  out.rail_load = p.rail_load;     // the busiest line of M, a row or a column: the same in M^T
  out.total_bytes = p.total_bytes;
  out.scaleup_bytes = p.scaleup_bytes; // each piece takes its hops backwards
  out.stage_weight = p.stage_weight;
  // Stage permutations, and a per-rail plan's (each rail's t-th), inverted: runs of S entries,
  // -1 where a server is idle.
  auto invert = [S](const std::vector<std::int32_t>& from, std::vector<std::int32_t>& to, auto&& which) {
    const auto Sz = static_cast<std::size_t>(S);
    to.assign(from.size(), -1);
    for (std::size_t i = 0; i + Sz <= from.size(); i += Sz)
      for (int s = 0; s < S; ++s) {
        const std::int32_t d = from[i + static_cast<std::size_t>(s)];
        if (d < -1 || d >= S)
          throw error("transpose: " + which(i / Sz) + " sends server " + std::to_string(s) + " to " +
                      std::to_string(d) + ", which is no server");
        if (d >= 0) to[i + static_cast<std::size_t>(d)] = s;
      }
  };
  invert(p.stage_perm, out.stage_perm, [](std::size_t t) { return "stage " + std::to_string(t); });
  invert(p.rail_perm, out.rail_perm, [G](std::size_t i) { // i = t * G + k
    return "rail " + std::to_string(i % static_cast<std::size_t>(G)) + "'s stage " +
           std::to_string(i / static_cast<std::size_t>(G));
  });
  out.rail_weight = p.rail_weight;
  // Each rank's buffer holds its balance regions (one per destination server) and its receive
  // regions (one per source): reversed, they swap roles, so every rank needs what it needed.
  out.staging_bytes = p.staging_bytes;
  out.staging_ring = p.staging_ring;
  out.staging_slot = p.staging_slot;

  // The regions' bases (detail::staging_layout, where region (s, d) is M(s, d)): at rank (s, k) the
  // balance region of (s, d) starts at row(s, d) = sum of M(s, x < d); at rank (d, k) the receive
  // region of (s, d) at rowsum(d) + col(d, s), col(d, s) = sum of M(x < s, d). Of the transposed
  // pair (d, s): its balance region at rank (d, k) starts at col(d, s), its receive region at rank
  // (s, k) at colsum(s) + row(s, d). A whole plan keeps both for every pair (S^2 each); a view only
  // for the pairs that touch its server h (4 S words: each of its staged pieces goes from or to
  // h), which at 512 servers is the difference between a few microseconds and milliseconds spent
  // allocating and clearing the S^2 tables. One pass over M, row by row, either way.
  const auto SS = static_cast<std::size_t>(S) * static_cast<std::size_t>(S);
  const bool whole = p.view < 0;
  const auto h = static_cast<std::uint32_t>(whole ? 0 : p.view / G);
  std::vector<bytes_t> row, col, rowsum, colsum; // whole: [s * S + d]; view: [d] of (h, d), then [S + s] of (s, h)
  if (placed && !rails) {
    row.assign(whole ? SS : 2 * static_cast<std::size_t>(S), 0);
    col.assign(row.size(), 0);
    rowsum.assign(static_cast<std::size_t>(S), 0);
    colsum.assign(static_cast<std::size_t>(S), 0);
    for (int s = 0; s < S; ++s)
      for (int d = 0; d < S; ++d) {
        const auto ss = static_cast<std::size_t>(s), dd = static_cast<std::size_t>(d);
        if (whole) {
          row[ss * S + dd] = rowsum[ss];
          col[ss * S + dd] = colsum[dd];
        } else if (ss == h) {
          row[dd] = rowsum[ss];
          col[dd] = colsum[dd];
        } else if (dd == h) {
          row[S + ss] = rowsum[ss];
          col[S + ss] = colsum[dd];
        }
        if (s == d) continue; // a server's own pair stages nothing (rail_layout)
        rowsum[ss] += m(s, d);
        colsum[dd] += m(s, d);
      }
  }
  const bytes_t in_ring = static_cast<bytes_t>(p.staging_ring) * p.staging_slot; // the second ring's start
  const auto g = static_cast<std::uint32_t>(SG > 0 ? SG : G); // a shift where G is known and a power of two
  out.pieces.resize(p.pieces.size());
  for (std::size_t i = 0; i < p.pieces.size(); ++i) {
    const piece& a = p.pieces[i];
    piece& b = out.pieces[i];
    b = a;
    b.src = a.dst;
    b.dst = a.src;
    if (a.rail < 0) continue; // self, intra and direct pieces stage nothing
    // The rank that stages a piece before its rail hop (the rail source, where it is not the
    // source) stages it after the hop in the transposed plan, and the other way round.
    const bool out_was = a.stage_out != no_staging, in_was = a.stage_in != no_staging;
    if (!out_was && !in_was) continue; // rail rank to rail rank: staged by neither, either way
    const auto s = static_cast<std::uint32_t>(a.src) / g, d = static_cast<std::uint32_t>(a.dst) / g;
    const std::size_t sd = whole ? static_cast<std::size_t>(s) * S + d : s == h ? d : static_cast<std::size_t>(S) + s;
    if (ring) { // slot (stage mod K) of each ring, at the same place in the slot
      const bytes_t at = out_was ? a.stage_out : a.stage_in - in_ring;
      b.stage_out = in_was ? at : no_staging;
      b.stage_in = out_was ? in_ring + at : no_staging;
    } else if (rails) { // the rail target's receive part becomes its balance part, the source's the other way
      const auto k = static_cast<std::uint32_t>(a.rail);
      const std::size_t rs = static_cast<std::size_t>(s) * g + k, rd = static_cast<std::size_t>(d) * g + k;
      b.stage_out = in_was ? a.stage_in - balance[rd] : no_staging;
      b.stage_in = out_was ? a.stage_out + (p.staging_bytes[rs] - balance[rs]) : no_staging;
    } else { // the same position of the rail stream, in the transposed pair's regions
      const bytes_t pos = out_was ? a.stage_out - row[sd] : a.stage_in - (rowsum[d] + col[sd]);
      b.stage_out = in_was ? col[sd] + pos : no_staging;
      b.stage_in = out_was ? colsum[s] + row[sd] + pos : no_staging;
    }
  }
  if (p.view < 0 && p.message_first.size() == static_cast<std::size_t>(n) * static_cast<std::size_t>(n) &&
      p.message_count.size() == p.message_first.size()) {
    const auto nn = static_cast<std::size_t>(n);
    out.message_first.resize(nn * nn);
    out.message_count.resize(nn * nn);
    for (std::size_t a = 0; a < nn; ++a)
      for (std::size_t b = 0; b < nn; ++b) {
        out.message_first[b * nn + a] = p.message_first[a * nn + b];
        out.message_count[b * nn + a] = p.message_count[a * nn + b];
      }
  } else {
    out.message_first.clear();
    out.message_count.clear();
  }
  // The op index: each op stays at its rank and stage, as the other side of the same hop (a
  // balance send becomes the redistribute receive, a rail send the rail receive, ...). Where one
  // piece has two ops at one rank and stage (a rail rank's receive and send), they are listed in
  // the order of the piece's route, which is reversed: so they swap, and the index is the one the
  // planner builds for the transposed plan, op for op.
  out.op_offsets = p.op_offsets;
  out.op_list.resize(p.op_list.size());
  const rank_op* from = p.op_list.data();
  rank_op* to = out.op_list.data();
  // (Whether two ops pair up is data: taken as arithmetic, not as a branch to mispredict.)
  for (std::size_t b = 0; b + 1 < p.op_offsets.size(); ++b) {
    const std::uint32_t first = p.op_offsets[b], end = p.op_offsets[b + 1];
    for (std::uint32_t i = first; i < end; ++i) {
      const std::uint32_t next = i + 1 < end && from[i + 1].piece == from[i].piece;
      const std::uint32_t prev = i > first && from[i - 1].piece == from[i].piece;
      const rank_op& o = from[i + next - prev];
      to[i] = {o.piece, detail::reversed(o.kind)};
    }
  }
}

/// As transpose_into, returning the plan.
template <int SG = 0>
plan transposed(const plan& p, const server_matrix& m, std::span<const bytes_t> balance = {}) {
  plan q;
  transpose_into<SG>(p, m, q, balance);
  return q;
}

} // namespace fasta2a
