// fasta2a: the plan of one all-to-allv, in the flat form an executor walks.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "fasta2a/common.hpp"

namespace fasta2a {

/// The kinds of hop a byte range takes (docs/DESIGN.md section 5). `direct` exists only in plans of the
/// direct baseline, which sends every message straight to its destination as NCCL and MPI do.
enum class hop_kind : std::uint8_t { self, intra, balance, rail, redistribute, direct };

inline const char* to_string(hop_kind k) noexcept {
  switch (k) {
  case hop_kind::self: return "self";
  case hop_kind::intra: return "intra";
  case hop_kind::balance: return "balance";
  case hop_kind::rail: return "rail";
  case hop_kind::redistribute: return "redistribute";
  case hop_kind::direct: return "direct";
  }
  return "?";
}

/// One hop of a piece: bytes move from rank `from` to rank `to` during `stage` (the stage of the
/// piece's rail hop; 0 for self, intra and direct).
struct hop {
  hop_kind kind;
  rank_t from;
  rank_t to;
  std::int32_t stage;
  friend bool operator==(const hop&, const hop&) = default;
};

/// Up to three hops, in order.
struct route {
  std::array<hop, 3> hops{};
  int size = 0;
  const hop* begin() const noexcept { return hops.data(); }
  const hop* end() const noexcept { return hops.data() + size; }
};

/// Marks a staging offset that is not used (the piece needs no staging at that rank).
inline constexpr bytes_t no_staging = ~bytes_t{0};

/// A contiguous byte range [offset, offset + bytes) of the message src -> dst, and how it travels.
/// Inter-server pieces ride rail `rail` in stage `stage`: balance src -> (server(src), rail) if
/// that is another rank, rail hop to (server(dst), rail), redistribute to dst if that is another
/// rank. Staging offsets say where the piece waits in the staging buffer of the rail ranks.
struct piece {
  rank_t src = 0;
  rank_t dst = 0;
  bytes_t offset = 0;
  bytes_t bytes = 0;
  std::int32_t stage = 0; ///< stage of the rail hop (0 for self, intra and direct pieces)
  std::int32_t rail = -1; ///< local index of the rail, or -1 for self, intra and direct pieces
  bytes_t stage_out = no_staging; ///< offset in the sending rail rank's staging buffer
  bytes_t stage_in = no_staging;  ///< offset in the receiving rail rank's staging buffer
  friend bool operator==(const piece&, const piece&) = default;
};

/// What a rank does with a piece. Sends and receives both appear, so that a rank knows what to
/// post and what to wait for without looking at any other rank's list.
enum class op_kind : std::uint8_t {
  self_copy,         ///< src == dst: copy send buffer -> receive buffer
  intra_send,        ///< same server: write into dst's receive buffer over scale-up
  intra_recv,        ///< ... and dst expects it
  balance_send,      ///< src writes into its rail rank's staging buffer (stage_out)
  balance_recv,      ///< ... and the rail rank expects it
  rail_send,         ///< rail rank sends to the peer rail rank (staging or receive buffer)
  rail_recv,         ///< ... and the peer rail rank expects it
  redistribute_send, ///< receiving rail rank writes from staging (stage_in) into dst's buffer
  redistribute_recv, ///< ... and dst expects it
  direct_send,       ///< direct baseline: src writes straight into dst's receive buffer
  direct_recv,
};

/// One entry of a rank's work list: which piece, in which stage, doing what.
struct rank_op {
  std::uint32_t piece;
  op_kind kind;
  friend bool operator==(const rank_op&, const rank_op&) = default;
};

/// The complete plan of one all-to-allv. Every rank computes the same plan from the same matrix,
/// topology and options, bit for bit, so plans are never broadcast.
///
/// Layout: `stage_weight[t]` and `perm(t)[s]` (the server s sends to in stage t, -1 when idle);
/// `pieces` grouped by message (all pieces of src -> dst are contiguous and ordered by offset,
/// found with `message_pieces`); per rank and stage the ops that rank performs (`ops`), where
/// stage index `stages()` holds nothing and the self and intra copies sit in stage 0.
struct plan {
  std::string decomposer;  ///< name of the decomposer that made the stages ("birkhoff", ...)
  std::string choice;      ///< why this schedule, where the planner chose (best-of, direct fallback)
  int servers = 0;
  int gpus_per_server = 0;
  bytes_t granule = 1;
  bool staged = true;      ///< false for the direct baseline (no stages, no rails)
  /// -1 for a whole plan; r for rank r's view (`planner::make_rank`): only the pieces r sends,
  /// receives or carries, only r's ops, and no message index.
  rank_t view = -1;
  bytes_t rail_load = 0;   ///< L: per-rail bytes of the busiest server, before padding
  bytes_t total_bytes = 0; ///< sum of the traffic matrix
  bytes_t scaleup_bytes = 0; ///< bytes moved over scale-up: intra + balance + redistribute

  std::vector<bytes_t> stage_weight;  ///< per stage: per-rail bytes at most
  std::vector<std::int32_t> stage_perm; ///< stages x servers
  std::vector<piece> pieces;
  std::vector<std::uint32_t> message_first; ///< ranks^2: first piece of message src*N+dst
  std::vector<std::uint32_t> message_count; ///< ranks^2: its number of pieces
  std::vector<bytes_t> staging_bytes;     ///< per rank: staging buffer bytes it needs
  /// Staging shared across stages (plan_options::staging_budget): 0 where every piece has a slot of
  /// its own for the whole call; K > 0 where each rail rank's staging is two rings of K slots of
  /// `staging_slot` bytes (stage t's balance bytes in slot t mod K of the first ring, its arriving
  /// bytes in slot t mod K of the second), so that stage t + K reuses stage t's slots once stage t
  /// is done with them: the executor orders the two with credits (rank_program's release and credit
  /// sections). Every stage weighs at most staging_slot bytes then.
  std::uint32_t staging_ring = 0;
  bytes_t staging_slot = 0;
  /// Per-rail schedules (plan_options::rails): empty where every rail of a server follows the
  /// server-level stages above. Otherwise each rail has stages of its own, and stage t means each
  /// rail's t-th: rail k of server s sends to rail k of server rail_perm[(t * G + k) * S + s] in
  /// stage t (-1: idle), and rail k's stage t weighs rail_weight[k * T + t] (0 where rail k has fewer
  /// than t + 1 stages); stage_weight[t] is the largest of them, and stage_perm is all -1. Each
  /// server pair's bytes ride one rail. Rails switch on their own, so no rail waits for another's
  /// stages: the scale-out phase lasts as long as the slowest rail (rail_time).
  std::vector<std::int32_t> rail_perm;  ///< stages x G x servers, per-rail plans only
  std::vector<bytes_t> rail_weight;     ///< G x stages (rail-major), per-rail plans only
  std::vector<std::uint32_t> op_offsets;  ///< CSR over (rank, stage): ranks (or 1 in a view) * op_stages() + 1
  std::vector<rank_op> op_list;

  rank_t ranks() const noexcept { return servers * gpus_per_server; }
  std::size_t stages() const noexcept { return stage_weight.size(); }
  std::span<const std::int32_t> perm(std::size_t t) const noexcept {
    return {stage_perm.data() + t * servers, static_cast<std::size_t>(servers)};
  }
  /// Whether the rails follow schedules of their own (rail_perm, rail_weight).
  bool per_rail() const noexcept { return !rail_weight.empty(); }
  /// Rail k's permutation in stage t: the server each server's rail k sends to, -1 when idle
  /// (per-rail plans; in others, the stage's server-level permutation).
  std::span<const std::int32_t> perm(std::size_t t, int k) const noexcept {
    if (!per_rail()) return perm(t);
    return {rail_perm.data() + (t * gpus_per_server + k) * servers, static_cast<std::size_t>(servers)};
  }
  /// Rail k's weight in stage t: per-rail bytes at most (the stage's weight in plans that are not per-rail).
  bytes_t weight(std::size_t t, int k) const noexcept {
    return per_rail() ? rail_weight[static_cast<std::size_t>(k) * stages() + t] : stage_weight[t];
  }
  /// Sum of the stage weights: the per-rail bytes a server can send in the time the plan takes.
  bytes_t total_weight() const noexcept {
    bytes_t w = 0;
    for (bytes_t x : stage_weight) w += x;
    return w;
  }
  /// The pieces of message src -> dst, in offset order (whole plans only).
  std::span<const piece> message_pieces(rank_t src, rank_t dst) const noexcept {
    std::size_t m = static_cast<std::size_t>(src) * ranks() + dst;
    return {pieces.data() + message_first[m], message_count[m]};
  }
  /// The ops rank r performs for stage t (t < op_stages()); empty for other ranks than a view's.
  std::span<const rank_op> ops(rank_t r, std::size_t t) const noexcept {
    if (view >= 0 && r != view) return {};
    std::size_t k = static_cast<std::size_t>(view >= 0 ? 0 : r) * op_stages() + t;
    return {op_list.data() + op_offsets[k], op_offsets[k + 1] - op_offsets[k]};
  }
  /// Number of stage slots in the op index: at least one, for the copies.
  std::size_t op_stages() const noexcept { return stages() == 0 ? 1 : stages(); }

  int server_of(rank_t r) const noexcept { return r / gpus_per_server; }
  int local_of(rank_t r) const noexcept { return r % gpus_per_server; }
  rank_t rail_source(const piece& p) const noexcept {
    return server_of(p.src) * gpus_per_server + p.rail;
  }
  rank_t rail_target(const piece& p) const noexcept {
    return server_of(p.dst) * gpus_per_server + p.rail;
  }

  /// The hops of a piece, in order (docs/DESIGN.md section 5 routes).
  route route_of(const piece& p) const noexcept {
    route r;
    if (p.src == p.dst) {
      r.hops[r.size++] = {hop_kind::self, p.src, p.dst, 0};
    } else if (p.rail < 0) {
      hop_kind k = server_of(p.src) == server_of(p.dst) ? hop_kind::intra : hop_kind::direct;
      r.hops[r.size++] = {k, p.src, p.dst, 0};
    } else {
      rank_t a = rail_source(p), b = rail_target(p);
      if (a != p.src) r.hops[r.size++] = {hop_kind::balance, p.src, a, p.stage};
      r.hops[r.size++] = {hop_kind::rail, a, b, p.stage};
      if (b != p.dst) r.hops[r.size++] = {hop_kind::redistribute, b, p.dst, p.stage};
    }
    return r;
  }

  /// Bytes of plan storage (what `plan_options::max_plan_bytes` limits).
  std::size_t memory_bytes() const noexcept {
    return stage_weight.capacity() * sizeof(bytes_t) + stage_perm.capacity() * 4 +
           pieces.capacity() * sizeof(piece) + message_first.capacity() * 4 +
           message_count.capacity() * 4 + staging_bytes.capacity() * sizeof(bytes_t) +
           op_offsets.capacity() * 4 + op_list.capacity() * sizeof(rank_op) + rail_perm.capacity() * 4 +
           rail_weight.capacity() * sizeof(bytes_t);
  }
};

namespace detail {

/// Calls f(rank, stage, op_kind) for every op the piece's route makes (sender and receiver side).
/// SG is the number of GPUs per server when known at compile time (0: read it from the plan),
/// which turns the rank arithmetic into shifts on the planner's hot path.
template <int SG = 0, class F>
FASTA2A_INLINE inline void for_each_op(const plan& p, const piece& pc, F&& f) {
  // Ranks are not negative: unsigned division by G is a shift where G is a power of two.
  const auto G = static_cast<std::uint32_t>(SG > 0 ? SG : p.gpus_per_server);
  const auto src = static_cast<std::uint32_t>(pc.src), dst = static_cast<std::uint32_t>(pc.dst);
  if (pc.src == pc.dst) {
    f(pc.src, std::size_t{0}, op_kind::self_copy);
  } else if (pc.rail < 0) {
    const bool intra = src / G == dst / G;
    f(pc.src, std::size_t{0}, intra ? op_kind::intra_send : op_kind::direct_send);
    f(pc.dst, std::size_t{0}, intra ? op_kind::intra_recv : op_kind::direct_recv);
  } else {
    const auto a = static_cast<rank_t>(src / G * G + static_cast<std::uint32_t>(pc.rail));
    const auto b = static_cast<rank_t>(dst / G * G + static_cast<std::uint32_t>(pc.rail));
    const std::size_t t = static_cast<std::size_t>(pc.stage);
    if (a != pc.src) {
      f(pc.src, t, op_kind::balance_send);
      f(a, t, op_kind::balance_recv);
    }
    f(a, t, op_kind::rail_send);
    f(b, t, op_kind::rail_recv);
    if (b != pc.dst) {
      f(b, t, op_kind::redistribute_send);
      f(pc.dst, t, op_kind::redistribute_recv);
    }
  }
}

/// The per-(rank, stage) op index of a plan, built piece by piece so that the planner can do it
/// while it makes each piece, in one pass: a counting sort, linear in the pieces. In a rank's
/// view only that rank's ops are kept.
template <int SG = 0>
class index_builder {
public:
  /// Starts the index of p, whose stages (and view) are final.
  void begin(plan& p) {
    p_ = &p;
    slots_ = p.op_stages();
    const std::size_t ranks = p.view >= 0 ? 1 : static_cast<std::size_t>(p.ranks());
    p.op_offsets.assign(ranks * slots_ + 1, 0);
  }
  /// Counts the ops of piece pc (about to be, or already, stored in p.pieces).
  FASTA2A_INLINE void add(const piece& pc) {
    std::uint32_t* count = p_->op_offsets.data() + 1;
    const rank_t view = p_->view;
    for_each_op<SG>(*p_, pc, [&](rank_t r, std::size_t t, op_kind) FASTA2A_INLINE {
      if (view < 0) ++count[static_cast<std::size_t>(r) * slots_ + t];
      else if (r == view) ++count[t];
    });
  }
  /// Fills the op index.
  void finish() {
    plan& p = *p_;
    for (std::size_t i = 1; i < p.op_offsets.size(); ++i) p.op_offsets[i] += p.op_offsets[i - 1];
    p.op_list.resize(p.op_offsets.back());
    std::uint32_t* cursor = p.op_offsets.data();
    rank_op* ops = p.op_list.data();
    const piece* pieces = p.pieces.data();
    const rank_t view = p.view;
    for (std::size_t i = 0, np = p.pieces.size(); i < np; ++i)
      for_each_op<SG>(p, pieces[i], [&](rank_t r, std::size_t t, op_kind k) FASTA2A_INLINE {
        if (view < 0) ops[cursor[static_cast<std::size_t>(r) * slots_ + t]++] = rank_op{static_cast<std::uint32_t>(i), k};
        else if (r == view) ops[cursor[t]++] = rank_op{static_cast<std::uint32_t>(i), k};
      });
    // Every cursor now points at the start of the next bucket: shift back by one bucket.
    for (std::size_t i = p.op_offsets.size() - 1; i > 0; --i) p.op_offsets[i] = p.op_offsets[i - 1];
    p.op_offsets[0] = 0;
  }

private:
  plan* p_ = nullptr;
  std::size_t slots_ = 1;
};

/// The staging layout of a plan: the one place it is computed, for the planner (whole plans and
/// rank views alike) and for plans read back from their pieces (assign_staging).
///
/// A rail stream (s, d, k) is what rail k carries from server s to server d, in piece order. Rank
/// (s, k)'s staging buffer holds, per destination server d in order, a region for stream (s, d, k)
/// (its balance region: bytes gathered before they leave on the rail), then per source server s'
/// in order, one for stream (s', s, k) (its receive region: bytes that arrived and wait to be
/// redistributed). Byte position `pos` of a stream sits at its region's base plus pos.
///
/// Each region is as large as its stream's bound: in a shared plan the pair's largest stream,
/// which is M(s, d), the per-rail bytes of the pair (per_rail_bytes: it depends only on the pair's
/// total), the same for every rail; in a per-rail plan the stream itself (the pair rides one
/// rail). So in a shared plan every base is a prefix sum of M, and any rank finds any piece's slot
/// from the pairs' totals alone, without any other pair's rail capacities or phase 1: a rank's
/// view orders the rails of the server pairs that touch its server only. A region holds at most
/// one granule more than its stream (rail capacities of a pair differ by at most one granule), so
/// a rank's buffer holds at most 2 (S - 1) granules more than its streams.
class staging_layout {
public:
  /// Lays out S x S x G streams whose sizes are load[(s * S + d) * G + k] and sets staging (one
  /// size per rank, S * G) to what each rank's buffer needs. `per_rail`: the plan has per-rail
  /// schedules (each region as large as its stream); otherwise each region is as large as its
  /// pair's largest stream.
  void build(int S, int G, const bytes_t* load, std::vector<bytes_t>& staging, bool per_rail) {
    const std::size_t SG = static_cast<std::size_t>(S) * G, SSG = SG * S;
    // Every base is written below, so resizing is enough: no need to clear them first.
    out_base_.resize(SSG);
    in_base_.resize(SSG);
    staging.assign(SG, 0);
    // Balance regions first, in destination order; then receive regions, in source order. The
    // streams are visited in index order, so each loop is one linear pass.
    for (int pass = 0; pass < 2; ++pass)
      for (int s = 0; s < S; ++s)
        for (int d = 0; d < S; ++d) {
          const std::size_t i = (static_cast<std::size_t>(s) * S + d) * G;
          bytes_t most = 0; // a region's size: the stream's, or the pair's largest stream's
          if (!per_rail)
            for (int k = 0; k < G; ++k) most = std::max(most, load[i + k]);
          bytes_t* size = staging.data() + static_cast<std::size_t>(pass == 0 ? s : d) * G;
          bytes_t* base = (pass == 0 ? out_base_.data() : in_base_.data()) + i;
          for (int k = 0; k < G; ++k) {
            base[k] = size[k];
            size[k] += per_rail ? load[i + k] : most;
          }
        }
  }

  /// Base of stream i's balance region in its sending rail rank's buffer (i as in `build`); the
  /// streams of one server pair are contiguous, so out_base(pair * G) + k is rail k's.
  const bytes_t* out_base(std::size_t i) const noexcept { return out_base_.data() + i; }
  /// Base of stream i's receive region in its receiving rail rank's buffer.
  const bytes_t* in_base(std::size_t i) const noexcept { return in_base_.data() + i; }

  /// Sets pc's staging offsets for byte position `pos` of its rail stream, whose region bases are
  /// out_base and in_base: a rank that already holds the piece (the rail source is its source, or
  /// the rail target its destination) stages none of it.
  FASTA2A_INLINE static void place(piece& pc, rank_t rail_source, rank_t rail_target, bytes_t out_base,
                                   bytes_t in_base, bytes_t pos) noexcept {
    pc.stage_out = rail_source == pc.src ? no_staging : out_base + pos;
    pc.stage_in = rail_target == pc.dst ? no_staging : in_base + pos;
  }

private:
  std::vector<bytes_t> out_base_, in_base_; // per stream
};

/// Staging slots of a whole plan whose pieces are set (a plan read back from a document, say), in
/// the planner's layout (staging_layout): stream sizes are summed from the pieces, and a piece
/// sits at its position in its stream. Pieces that need no staging get none.
inline void assign_staging(plan& p) {
  const int S = p.servers, G = p.gpus_per_server;
  const std::size_t SSG = static_cast<std::size_t>(S) * S * G;
  std::vector<bytes_t> load(SSG, 0);
  auto key = [&](const piece& pc) {
    return (static_cast<std::size_t>(pc.src / G) * S + pc.dst / G) * G + pc.rail;
  };
  for (const piece& pc : p.pieces)
    if (pc.rail >= 0) load[key(pc)] += pc.bytes;
  staging_layout layout;
  layout.build(S, G, load.data(), p.staging_bytes, p.per_rail());
  std::fill(load.begin(), load.end(), 0); // now: position in each rail stream
  for (piece& pc : p.pieces) {
    if (pc.rail < 0) {
      pc.stage_out = pc.stage_in = no_staging;
      continue;
    }
    const std::size_t i = key(pc);
    staging_layout::place(pc, p.rail_source(pc), p.rail_target(pc), *layout.out_base(i), *layout.in_base(i),
                          load[i]);
    load[i] += pc.bytes;
  }
}

/// Fills the executor's view of a whole plan whose pieces are set: staging slots and op index.
template <int SG = 0>
void build_index(plan& p) {
  assign_staging(p);
  index_builder<SG> ib;
  ib.begin(p);
  for (const piece& pc : p.pieces) ib.add(pc);
  ib.finish();
}

} // namespace detail

} // namespace fasta2a
