// fasta2a: an independent checker of plans against their traffic matrix.
#pragma once

#include <algorithm>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "fasta2a/plan.hpp"
#include "fasta2a/traffic.hpp"

namespace fasta2a {

/// What `verify` found: `ok`, or the first violation in words.
struct verify_result {
  bool ok = true;
  std::string error;
  explicit operator bool() const noexcept { return ok; }
};

/// Options of the verifier.
struct verify_options {
  /// Require the stage weights to sum to the scale-out lower bound: the largest per-server
  /// traffic (out or in) divided by G, plus at most one granule of rounding per server pair
  /// (exact decomposers). Off, the sum need only reach that bound.
  bool exact_lower_bound = false;
};

namespace detail {

/// Where staging is shared (plan::staging_ring K > 0): why the plan's ring is malformed (no slot,
/// a stage heavier than a slot), or "".
inline std::string ring_problem(const plan& p) {
  if (p.staging_ring == 0) return {};
  if (p.staging_slot == 0) return "staging is shared in a ring of " + std::to_string(p.staging_ring) + " slots of 0 bytes";
  for (std::size_t t = 0; t < p.stages(); ++t)
    if (p.stage_weight[t] > p.staging_slot)
      return "stage " + std::to_string(t) + " weighs " + std::to_string(p.stage_weight[t]) +
             " bytes, more than a staging slot (" + std::to_string(p.staging_slot) + ")";
  return {};
}

/// Where staging is shared: why the staging region [begin, end) of stage t at a rail rank (its
/// balance ring where !arriving, else its arrival ring) is outside that stage's slot, or "". A
/// region inside its slot can overlap only regions of its own stage or of stages K, 2K, ...
/// apart on the same ring, which the executor orders with credits.
inline std::string ring_slot_problem(const plan& p, rank_t at, bool arriving, std::int32_t t, bytes_t begin, bytes_t end) {
  if (p.staging_ring == 0) return {};
  const bytes_t K = p.staging_ring, w = p.staging_slot;
  const bytes_t lo = (arriving ? K * w : 0) + static_cast<bytes_t>(static_cast<std::uint32_t>(t) % p.staging_ring) * w;
  if (begin >= lo && end <= lo + w && begin <= end) return {};
  return "rank " + std::to_string(at) + ": staging region [" + std::to_string(begin) + ", " + std::to_string(end) +
         ") of stage " + std::to_string(t) + " lies outside its slot [" + std::to_string(lo) + ", " +
         std::to_string(lo + w) + ") of the " + (arriving ? "arrival" : "balance") + " ring";
}

/// Why the stages of p are malformed, or "": each stage has a positive weight and is a partial
/// permutation of servers (no server sends to two or receives from two, none to itself); in a
/// per-rail plan (plan::per_rail) each rail's stages are, the stage weight is its heaviest rail's,
/// and the server-level permutations are empty (all -1).
inline std::string stage_problem(const plan& p) {
  using std::to_string;
  const int S = p.servers, G = p.gpus_per_server;
  const std::size_t T = p.stages();
  if (p.stage_perm.size() != T * S) return "stage permutations do not match stage count";
  std::vector<int> seen(S);
  auto partial = [&](std::span<const std::int32_t> perm, const std::string& where) -> std::string {
    std::fill(seen.begin(), seen.end(), 0);
    for (int s = 0; s < S; ++s) {
      const int d = perm[s];
      if (d == -1) continue;
      if (d < 0 || d >= S || d == s) return where + " sends server " + to_string(s) + " to " + to_string(d);
      if (seen[d]++) return "server " + to_string(d) + " receives from two servers in " + where;
    }
    return {};
  };
  if (!p.per_rail()) {
    if (!p.rail_perm.empty()) return "rail permutations without rail weights";
    for (std::size_t st = 0; st < T; ++st) {
      if (p.stage_weight[st] == 0) return "stage " + to_string(st) + " has weight 0";
      if (std::string why = partial(p.perm(st), "stage " + to_string(st)); !why.empty()) return why;
    }
    return {};
  }
  if (p.rail_weight.size() != T * G || p.rail_perm.size() != T * G * S)
    return "per-rail stages do not match stage count (" + to_string(T) + " stages x " + to_string(G) + " rails)";
  for (std::size_t st = 0; st < T; ++st) {
    bytes_t most = 0;
    for (int k = 0; k < G; ++k) {
      most = std::max(most, p.weight(st, k));
      const std::string where = "stage " + to_string(st) + " of rail " + to_string(k);
      if (std::string why = partial(p.perm(st, k), where); !why.empty()) return why;
      if (p.weight(st, k) == 0)
        for (int s = 0; s < S; ++s)
          if (p.perm(st, k)[s] >= 0) return where + " has weight 0 but sends server " + to_string(s);
    }
    if (most == 0) return "stage " + to_string(st) + " has weight 0 on every rail";
    if (p.stage_weight[st] != most)
      return "stage " + to_string(st) + " weighs " + to_string(p.stage_weight[st]) + ", its heaviest rail " + to_string(most);
    for (int s = 0; s < S; ++s)
      if (p.perm(st)[s] != -1) return "stage " + to_string(st) + " of a per-rail plan has a server-level permutation";
  }
  return {};
}

/// What verify and verify_rank_view check first, alike: the plan's shape against the matrix (N x N
/// with N = servers x gpus_per_server), its stage permutations' and staging sizes' lengths, and that
/// the stages are partial permutations with positive weights. "" where all hold.
inline std::string shape_problem(const plan& p, const traffic_matrix& t) {
  using std::to_string;
  const int S = p.servers, G = p.gpus_per_server;
  if (S < 1 || G < 1) return "plan has no servers or no GPUs";
  const rank_t n = S * G;
  if (t.rows() != n || t.cols() != n)
    return "matrix is " + to_string(t.rows()) + " x " + to_string(t.cols()) + ", plan has " + to_string(n) + " ranks";
  const std::size_t T = p.stages();
  if (p.stage_perm.size() != T * static_cast<std::size_t>(S)) return "stage permutations do not match stage count";
  if (!p.staged && T != 0) return "an unstaged plan has stages";
  if (p.staging_bytes.size() != static_cast<std::size_t>(n)) return "staging sizes missing";
  return stage_problem(p);
}

/// Whether piece pc (of server s to server d, described by `where`) takes the hops its kind allows:
/// none on a rail where it needs none (itself, inside a server, an unstaged plan); else a valid rail
/// and stage whose permutation sends s to d, and a staging slot at its rail sender (receiver) iff
/// it needs a balance (redistribute) hop. "" where it does.
inline std::string hop_problem(const plan& p, const piece& pc, int s, int d, const std::string& where) {
  using std::to_string;
  if (pc.src == pc.dst || s == d || !p.staged) {
    if (pc.rail != -1) return where + " rides a rail but needs none";
    if (pc.stage != 0) return where + " has a stage but needs none";
    return {};
  }
  if (pc.rail < 0 || pc.rail >= p.gpus_per_server) return where + " has no valid rail";
  if (pc.stage < 0 || static_cast<std::size_t>(pc.stage) >= p.stages())
    return where + " has stage " + to_string(pc.stage) + " of " + to_string(p.stages());
  if (p.perm(pc.stage, pc.rail)[s] != d)
    return where + " rides stage " + to_string(pc.stage) + (p.per_rail() ? " of rail " + to_string(pc.rail) : "") +
           ", in which server " + to_string(s) + " sends to " + to_string(p.perm(pc.stage, pc.rail)[s]);
  if ((p.rail_source(pc) == pc.src) != (pc.stage_out == no_staging))
    return where + " has a staging slot at its rail sender iff it needs a balance hop: violated";
  if ((p.rail_target(pc) == pc.dst) != (pc.stage_in == no_staging))
    return where + " has a staging slot at its rail receiver iff it needs a redistribute hop: violated";
  return {};
}

/// The first failure of a check: `fail(msg)` keeps the first message and returns the result.
struct first_failure {
  verify_result res;
  verify_result operator()(std::string msg) {
    if (res.ok) {
      res.ok = false;
      res.error = std::move(msg);
    }
    return res;
  }
};

} // namespace detail

/// Checks plan p against traffic matrix t without trusting the planner:
/// - the shape fits (N x N with N = servers x gpus_per_server);
/// - every message is tiled exactly by its pieces (no gap, no overlap, nothing extra), and every
///   piece belongs to exactly one message;
/// - every hop is legal for its kind (self, intra, balance / rail / redistribute on rail k between
///   servers, direct only in unstaged plans);
/// - each stage is a partial permutation: no server sends to two or receives from two; a piece's
///   rail hop goes where its stage's permutation sends its server;
/// - per stage, server and rail, the bytes are at most the stage weight; per server pair the rail
///   loads differ by at most one granule (phase 1 balance);
/// - in a per-rail plan (plan::per_rail) the same per rail: each rail's stages are partial
///   permutations, a piece's rail hop goes where its rail's permutation sends its server, the
///   bytes per stage, server and rail are at most that rail's weight, and each server pair's bytes
///   ride one rail (instead of being balanced over all); each rail's weights sum to at least the
///   busiest line of what that rail carries (exactly, within rounding, if asked);
/// - the weights sum to at least the scale-out lower bound (exactly, within rounding, if asked);
/// - staging regions lie inside each rank's staging size and never overlap; where staging is
///   shared (plan::staging_ring), every stage fits a slot, every region lies in its stage's slot,
///   and regions of one stage never overlap;
/// - the plan's scale-up byte count is what its routes move;
/// - the per-rank op index lists every hop of every piece exactly once, at the right rank and stage.
inline verify_result verify(const plan& p, const traffic_matrix& t, verify_options opt = {}) {
  detail::first_failure fail;
  verify_result& res = fail.res;
  using std::to_string;
  if (p.view >= 0 && p.servers >= 1 && p.gpus_per_server >= 1)
    return fail("verify checks whole plans; this is rank " + to_string(p.view) + "'s view (planner::make_rank)");
  // The shape, and stages that are partial permutations with positive weights (per rail, in a
  // per-rail plan).
  if (std::string why = detail::shape_problem(p, t); !why.empty()) return fail(why);
  const int S = p.servers, G = p.gpus_per_server;
  const rank_t n = S * G;
  const std::size_t T = p.stages();
  const std::size_t nn = static_cast<std::size_t>(n) * n;
  if (p.message_first.size() != nn || p.message_count.size() != nn)
    return fail("message index is not ranks x ranks");

  // Messages are tiled by their pieces; pieces are legal.
  std::vector<unsigned char> owned(p.pieces.size(), 0);
  struct load {
    std::size_t key;
    bytes_t bytes;
  };
  std::vector<load> rail_loads, pair_loads;
  for (rank_t src = 0; src < n; ++src)
    for (rank_t dst = 0; dst < n; ++dst) {
      const std::size_t m = static_cast<std::size_t>(src) * n + dst;
      const std::size_t first = p.message_first[m], count = p.message_count[m];
      if (first + count > p.pieces.size() || first + count < first)
        return fail("message " + to_string(src) + "->" + to_string(dst) + " indexes past the pieces");
      bytes_t off = 0;
      const int s = src / G, d = dst / G;
      for (std::size_t i = first; i < first + count; ++i) {
        const piece& pc = p.pieces[i];
        const std::string where = "piece " + to_string(i) + " (" + to_string(src) + "->" +
                                  to_string(dst) + ", offset " + to_string(pc.offset) + ")";
        if (owned[i]++) return fail(where + " belongs to two messages");
        if (pc.src != src || pc.dst != dst) return fail(where + " is filed under another message");
        if (pc.bytes == 0) return fail(where + " is empty");
        if (pc.offset != off) return fail(where + " leaves a gap or overlaps: expected offset " + to_string(off));
        if (pc.offset + pc.bytes < pc.offset) return fail(where + " overflows");
        off = pc.offset + pc.bytes;
        if (std::string why = detail::hop_problem(p, pc, s, d, where); !why.empty()) return fail(why);
        if (src == dst || s == d || !p.staged) continue;
        rail_loads.push_back({(static_cast<std::size_t>(pc.stage) * S + s) * G + pc.rail, pc.bytes});
        pair_loads.push_back({(static_cast<std::size_t>(s) * S + d) * G + pc.rail, pc.bytes});
      }
      if (off != t(src, dst))
        return fail("message " + to_string(src) + "->" + to_string(dst) + " has " + to_string(off) +
                    " bytes in pieces, the matrix says " + to_string(t(src, dst)));
    }
  for (std::size_t i = 0; i < owned.size(); ++i)
    if (!owned[i]) return fail("piece " + to_string(i) + " belongs to no message");

  // The plan's scale-up figure is what its routes move (intra, balance, redistribute hops).
  {
    bytes_t up = 0;
    for (const piece& pc : p.pieces)
      for (const hop& h : p.route_of(pc))
        if ((h.kind == hop_kind::intra || h.kind == hop_kind::balance ||
             h.kind == hop_kind::redistribute) &&
            __builtin_add_overflow(up, pc.bytes, &up))
          return fail("the plan's scale-up bytes overflow 64 bits");
    if (up != p.scaleup_bytes)
      return fail("the plan says it moves " + to_string(p.scaleup_bytes) +
                  " bytes over scale-up, its routes move " + to_string(up));
  }

  // Rail loads within stage weights; rail loads of a server pair balanced to one granule.
  auto by_key = [](const load& x, const load& y) { return x.key < y.key; };
  std::sort(rail_loads.begin(), rail_loads.end(), by_key);
  for (std::size_t i = 0; i < rail_loads.size();) {
    bytes_t sum = 0;
    std::size_t k = rail_loads[i].key;
    for (; i < rail_loads.size() && rail_loads[i].key == k; ++i) sum += rail_loads[i].bytes;
    const std::size_t st = k / (static_cast<std::size_t>(S) * G);
    if (sum > p.weight(st, static_cast<int>(k % G)))
      return fail("stage " + to_string(st) + ": server " + to_string(k / G % S) + " rail " +
                  to_string(k % G) + " carries " + to_string(sum) + " bytes, weight is " +
                  to_string(p.weight(st, static_cast<int>(k % G))));
  }
  if (p.staged && p.per_rail()) {
    // Each pair on one rail; each rail's weights reach the busiest line of what it carries.
    std::vector<bytes_t> per_rail(static_cast<std::size_t>(S) * S * G, 0);
    for (const load& l : pair_loads) per_rail[l.key] += l.bytes;
    std::vector<bytes_t> out(static_cast<std::size_t>(G) * S, 0), in(out);
    for (std::size_t pr = 0; pr < static_cast<std::size_t>(S) * S; ++pr) {
      int rails = 0;
      for (int k = 0; k < G; ++k)
        if (const bytes_t b = per_rail[pr * G + k]; b > 0) {
          ++rails;
          out[static_cast<std::size_t>(k) * S + pr / S] += b;
          in[static_cast<std::size_t>(k) * S + pr % S] += b;
        }
      if (rails > 1)
        return fail("server pair (" + to_string(pr / S) + ", " + to_string(pr % S) + ") rides " + to_string(rails) +
                    " rails in a per-rail plan, which gives each pair one");
    }
    for (int k = 0; k < G; ++k) {
      bytes_t busiest = 0, sum = 0;
      for (int s = 0; s < S; ++s)
        busiest = std::max({busiest, out[static_cast<std::size_t>(k) * S + s], in[static_cast<std::size_t>(k) * S + s]});
      for (std::size_t st = 0; st < T; ++st) sum += p.weight(st, k);
      if (sum < busiest)
        return fail("rail " + to_string(k) + "'s stage weights sum to " + to_string(sum) +
                    ", below the busiest server's bytes on that rail, " + to_string(busiest));
      bytes_t slack = 0, limit = 0;
      const bool unbounded = __builtin_mul_overflow(static_cast<bytes_t>(S), p.granule, &slack) ||
                             __builtin_add_overflow(busiest, slack, &limit);
      if (opt.exact_lower_bound && !unbounded && sum > limit)
        return fail("rail " + to_string(k) + "'s stage weights sum to " + to_string(sum) +
                    ", above the busiest server's bytes on that rail, " + to_string(busiest) + ", plus rounding " +
                    to_string(slack));
    }
  } else if (p.staged) {
    std::vector<bytes_t> per_rail(static_cast<std::size_t>(S) * S * G, 0);
    for (const load& l : pair_loads) per_rail[l.key] += l.bytes;
    for (std::size_t pr = 0; pr < static_cast<std::size_t>(S) * S; ++pr) {
      const auto [lo, hi] = std::minmax_element(per_rail.begin() + pr * G, per_rail.begin() + (pr + 1) * G);
      if (*hi - *lo > p.granule)
        return fail("server pair (" + to_string(pr / S) + ", " + to_string(pr % S) +
                    "): rail loads range from " + to_string(*lo) + " to " + to_string(*hi) +
                    " bytes, more than one granule (" + to_string(p.granule) + ") apart");
    }
  }

  // Stage weights against the scale-out lower bound, computed here from the matrix alone (a
  // per-rail plan's rails are checked one by one above).
  if (p.staged && S > 1 && !p.per_rail()) {
    std::vector<bytes_t> out(S, 0), in(S, 0);
    for (rank_t i = 0; i < n; ++i)
      for (rank_t j = 0; j < n; ++j)
        if (i / G != j / G) {
          out[i / G] += t(i, j);
          in[j / G] += t(i, j);
        }
    bytes_t busiest = 0;
    for (int s = 0; s < S; ++s) busiest = std::max({busiest, out[s], in[s]});
    const bytes_t bound = (busiest + G - 1) / G;
    const bytes_t total = p.total_weight();
    if (total < bound)
      return fail("stage weights sum to " + to_string(total) + ", below the lower bound " +
                  to_string(bound) + " per rail");
    // S granules of rounding at most; a product or sum past 64 bits means no bound at all.
    bytes_t slack = 0, limit = 0;
    const bool unbounded = __builtin_mul_overflow(static_cast<bytes_t>(S), p.granule, &slack) ||
                           __builtin_add_overflow(bound, slack, &limit);
    if (opt.exact_lower_bound && !unbounded && total > limit)
      return fail("stage weights sum to " + to_string(total) + ", above the lower bound " +
                  to_string(bound) + " plus rounding " + to_string(slack));
  }

  // Staging regions: inside each rank's buffer, disjoint (where staging is shared: inside their
  // stage's slot, and disjoint within a stage).
  if (std::string why = detail::ring_problem(p); !why.empty()) return fail(why);
  struct region {
    rank_t rank;
    std::int32_t stage; // 0 unless staging is shared
    bytes_t begin, end;
  };
  std::vector<region> regions;
  const bool ring = p.staging_ring > 0;
  for (const piece& pc : p.pieces) {
    if (pc.rail < 0) continue;
    const std::int32_t st = ring ? pc.stage : 0;
    if (pc.stage_out != no_staging) regions.push_back({p.rail_source(pc), st, pc.stage_out, pc.stage_out + pc.bytes});
    if (pc.stage_in != no_staging) regions.push_back({p.rail_target(pc), st, pc.stage_in, pc.stage_in + pc.bytes});
    if (std::string why = pc.stage_out == no_staging ? std::string()
                          : detail::ring_slot_problem(p, p.rail_source(pc), false, pc.stage, pc.stage_out, pc.stage_out + pc.bytes);
        !why.empty())
      return fail(why);
    if (std::string why = pc.stage_in == no_staging ? std::string()
                          : detail::ring_slot_problem(p, p.rail_target(pc), true, pc.stage, pc.stage_in, pc.stage_in + pc.bytes);
        !why.empty())
      return fail(why);
  }
  std::sort(regions.begin(), regions.end(), [](const region& x, const region& y) {
    return std::tie(x.rank, x.stage, x.begin) < std::tie(y.rank, y.stage, y.begin);
  });
  for (std::size_t i = 0; i < regions.size(); ++i) {
    const region& r = regions[i];
    if (r.end > p.staging_bytes[r.rank])
      return fail("rank " + to_string(r.rank) + ": staging region ends at " + to_string(r.end) +
                  ", past its staging size " + to_string(p.staging_bytes[r.rank]));
    if (i > 0 && regions[i - 1].rank == r.rank && regions[i - 1].stage == r.stage && regions[i - 1].end > r.begin)
      return fail("rank " + to_string(r.rank) + ": staging regions overlap at " + to_string(r.begin) +
                  (ring ? " in stage " + to_string(r.stage) : std::string()));
  }

  // The op index: every hop of every piece at both ends, once, at the right rank and stage.
  const std::size_t slots = p.op_stages();
  if (p.op_offsets.size() != static_cast<std::size_t>(n) * slots + 1 ||
      p.op_offsets.back() != p.op_list.size())
    return fail("op index has the wrong size");
  for (std::size_t k = 1; k < p.op_offsets.size(); ++k)
    if (p.op_offsets[k] < p.op_offsets[k - 1]) return fail("op index offsets decrease at slot " + to_string(k));
  std::vector<std::uint16_t> marks(p.pieces.size(), 0);
  for (rank_t r = 0; r < n; ++r)
    for (std::size_t st = 0; st < slots; ++st)
      for (const rank_op& op : p.ops(r, st)) {
        if (op.piece >= p.pieces.size()) return fail("op index names a piece that does not exist");
        const piece& pc = p.pieces[op.piece];
        const std::uint16_t bit = static_cast<std::uint16_t>(1u << static_cast<unsigned>(op.kind));
        if (marks[op.piece] & bit)
          return fail("piece " + to_string(op.piece) + " appears twice in the op index as " +
                      to_string(static_cast<int>(op.kind)));
        marks[op.piece] |= bit;
        bool right = false;
        const std::size_t ps = pc.rail < 0 ? 0 : static_cast<std::size_t>(pc.stage);
        detail::for_each_op(p, pc, [&](rank_t rr, std::size_t tt, op_kind kk) {
          right |= rr == r && tt == st && kk == op.kind && tt == ps;
        });
        if (!right)
          return fail("rank " + to_string(r) + " stage " + to_string(st) + " lists piece " +
                      to_string(op.piece) + " for an op its route does not make");
      }
  for (std::size_t i = 0; i < p.pieces.size(); ++i) {
    std::uint16_t want = 0;
    detail::for_each_op(p, p.pieces[i], [&](rank_t, std::size_t, op_kind k) {
      want |= static_cast<std::uint16_t>(1u << static_cast<unsigned>(k));
    });
    if (marks[i] != want)
      return fail("piece " + to_string(i) + " is missing ops in the per-rank index");
  }
  return res;
}

/// Checks rank r's view of a plan (planner::make_rank: p.view == r) against traffic matrix t
/// without the whole plan and without trusting the planner, as far as one rank's part allows:
/// - the shape fits, and the stages are partial permutations with positive weights;
/// - every piece is r's: r sends it, receives it, or carries it on its rail (rail sender or
///   receiver); every hop is legal for its kind, and a piece's rail hop goes where its stage's
///   permutation sends its server;
/// - r's own messages, sent and received, are tiled exactly by their pieces: each message's pieces
///   are contiguous in the list, their offsets run from 0 without gap or overlap, and their bytes
///   sum to the matrix entry (no pieces where the entry is 0);
/// - per stage, what r's rail sends and receives is at most the stage weight (its rail's, in a
///   per-rail plan, whose rails' weights together must hold the busiest server's bytes);
/// - the weights sum to at least the scale-out lower bound (exactly, within rounding, if asked);
/// - r's staging regions lie inside r's staging size and never overlap (where staging is shared:
///   within a stage, and each inside its stage's slot), and the slots its pieces take in other
///   ranks' buffers lie inside those buffers;
/// - the plan's total is the matrix's;
/// - r's op index lists every op r makes for every piece exactly once, at the right stage.
/// What only the other ranks' parts show (their messages, other rails' loads, phase 1's balance
/// across rails, the scale-up byte count) is verify's, on the whole plan. O(ranks^2) time for the
/// matrix sums, O(servers + ranks + pieces) memory.
inline verify_result verify_rank_view(const plan& p, const traffic_matrix& t, verify_options opt = {}) {
  detail::first_failure fail;
  verify_result& res = fail.res;
  using std::to_string;
  const int S = p.servers, G = p.gpus_per_server;
  const rank_t n = S * G;
  const rank_t r = p.view;
  if (S >= 1 && G >= 1) {
    if (r < 0) return fail("verify_rank_view checks a rank's view (planner::make_rank); this is a whole plan");
    if (r >= n) return fail("the view is of rank " + to_string(r) + ", the plan has " + to_string(n) + " ranks");
  }
  if (std::string why = detail::shape_problem(p, t); !why.empty()) return fail(why);
  const std::size_t T = p.stages();

  // Pieces: r's, legal; r's messages tiled; r's rail within the stage weights; staging slots.
  std::vector<bytes_t> sent(n, 0), received(n, 0);           // next offset of r -> x and x -> r
  std::vector<unsigned char> sent_open(n, 0), received_open(n, 0); // 1: begun, 2: closed
  std::vector<bytes_t> rail_out(T, 0), rail_in(T, 0);
  struct region {
    std::int32_t stage; // 0 unless staging is shared
    bytes_t begin, end;
  };
  std::vector<region> mine;
  if (std::string why = detail::ring_problem(p); !why.empty()) return fail(why);
  const bool ring = p.staging_ring > 0;
  const int home = r / G, my_rail = r % G;
  for (std::size_t i = 0; i < p.pieces.size(); ++i) {
    const piece& pc = p.pieces[i];
    const std::string where = "piece " + to_string(i) + " (" + to_string(pc.src) + "->" + to_string(pc.dst) +
                              ", offset " + to_string(pc.offset) + ")";
    if (pc.src < 0 || pc.src >= n || pc.dst < 0 || pc.dst >= n) return fail(where + " names a rank out of range");
    if (pc.bytes == 0) return fail(where + " is empty");
    if (pc.offset + pc.bytes < pc.offset) return fail(where + " overflows");
    const int s = pc.src / G, d = pc.dst / G;
    const bool on_rail = pc.rail >= 0;
    const bool carries = on_rail && pc.rail == my_rail && (s == home || d == home);
    if (pc.src != r && pc.dst != r && !carries)
      return fail(where + " is not rank " + to_string(r) + "'s: it neither sends, receives nor carries it");
    if (std::string why = detail::hop_problem(p, pc, s, d, where); !why.empty()) return fail(why);
    if (!(pc.src == pc.dst || s == d || !p.staged)) {
      const rank_t a = p.rail_source(pc), b = p.rail_target(pc);
      const std::size_t st = static_cast<std::size_t>(pc.stage);
      if (a == r) rail_out[st] += pc.bytes;
      if (b == r) rail_in[st] += pc.bytes;
      if (pc.stage_out != no_staging) {
        if (pc.stage_out + pc.bytes > p.staging_bytes[a] || pc.stage_out + pc.bytes < pc.stage_out)
          return fail(where + ": its staging slot at rank " + to_string(a) + " ends past that rank's staging size " +
                      to_string(p.staging_bytes[a]));
        if (a == r) mine.push_back({ring ? pc.stage : 0, pc.stage_out, pc.stage_out + pc.bytes});
        if (std::string why = detail::ring_slot_problem(p, a, false, pc.stage, pc.stage_out, pc.stage_out + pc.bytes);
            !why.empty())
          return fail(why);
      }
      if (pc.stage_in != no_staging) {
        if (pc.stage_in + pc.bytes > p.staging_bytes[b] || pc.stage_in + pc.bytes < pc.stage_in)
          return fail(where + ": its staging slot at rank " + to_string(b) + " ends past that rank's staging size " +
                      to_string(p.staging_bytes[b]));
        if (b == r) mine.push_back({ring ? pc.stage : 0, pc.stage_in, pc.stage_in + pc.bytes});
        if (std::string why = detail::ring_slot_problem(p, b, true, pc.stage, pc.stage_in, pc.stage_in + pc.bytes);
            !why.empty())
          return fail(why);
      }
    }
    // r's messages: contiguous in the list, offsets from 0 without gap or overlap.
    const bool continues = i > 0 && p.pieces[i - 1].src == pc.src && p.pieces[i - 1].dst == pc.dst;
    const auto tile = [&](std::vector<bytes_t>& next, std::vector<unsigned char>& open, rank_t peer) {
      if (!continues) {
        if (open[peer]) return false;
        open[peer] = 1;
      }
      if (pc.offset != next[peer]) return false;
      next[peer] = pc.offset + pc.bytes;
      return true;
    };
    if (pc.src == r && !tile(sent, sent_open, pc.dst))
      return fail(where + " leaves a gap, overlaps, or is apart from the rest of its message: expected offset " +
                  to_string(sent[pc.dst]));
    if (pc.dst == r && !tile(received, received_open, pc.src))
      return fail(where + " leaves a gap, overlaps, or is apart from the rest of its message: expected offset " +
                  to_string(received[pc.src]));
  }
  for (rank_t x = 0; x < n; ++x) {
    if (sent[x] != t(r, x))
      return fail("message " + to_string(r) + "->" + to_string(x) + " has " + to_string(sent[x]) +
                  " bytes in pieces, the matrix says " + to_string(t(r, x)));
    if (received[x] != t(x, r))
      return fail("message " + to_string(x) + "->" + to_string(r) + " has " + to_string(received[x]) +
                  " bytes in pieces, the matrix says " + to_string(t(x, r)));
  }
  for (std::size_t st = 0; st < T; ++st)
    if (rail_out[st] > p.weight(st, my_rail) || rail_in[st] > p.weight(st, my_rail))
      return fail("stage " + to_string(st) + ": rank " + to_string(r) + "'s rail carries " +
                  to_string(std::max(rail_out[st], rail_in[st])) + " bytes, weight is " +
                  to_string(p.weight(st, my_rail)));
  std::sort(mine.begin(), mine.end(),
            [](const region& x, const region& y) { return std::tie(x.stage, x.begin) < std::tie(y.stage, y.begin); });
  for (std::size_t i = 1; i < mine.size(); ++i)
    if (mine[i - 1].stage == mine[i].stage && mine[i - 1].end > mine[i].begin)
      return fail("rank " + to_string(r) + ": staging regions overlap at " + to_string(mine[i].begin) +
                  (ring ? " in stage " + to_string(mine[i].stage) : std::string()));

  // The total, and the stage weights against the scale-out lower bound, from the matrix alone.
  {
    std::vector<bytes_t> out(S, 0), in(S, 0);
    bytes_t total = 0;
    bool overflow = false;
    for (rank_t i = 0; i < n; ++i)
      for (rank_t j = 0; j < n; ++j) {
        overflow |= __builtin_add_overflow(total, t(i, j), &total);
        if (i / G != j / G) {
          out[i / G] += t(i, j);
          in[j / G] += t(i, j);
        }
      }
    if (overflow) return fail("the matrix's total overflows 64 bits");
    if (total != p.total_bytes)
      return fail("the plan says it moves " + to_string(p.total_bytes) + " bytes, the matrix " + to_string(total));
    if (p.staged && S > 1 && p.per_rail()) {
      // The busiest server's bytes must fit in its rails' stages, all rails together (which
      // rail carries how much is the other ranks' to show).
      bytes_t busiest = 0, sum = 0;
      for (int s = 0; s < S; ++s) busiest = std::max({busiest, out[s], in[s]});
      for (bytes_t w : p.rail_weight) sum += w;
      if (sum < busiest)
        return fail("the rails' stage weights sum to " + to_string(sum) + ", below the busiest server's bytes " +
                    to_string(busiest));
    } else if (p.staged && S > 1) {
      bytes_t busiest = 0;
      for (int s = 0; s < S; ++s) busiest = std::max({busiest, out[s], in[s]});
      const bytes_t bound = (busiest + G - 1) / G;
      const bytes_t sum = p.total_weight();
      if (sum < bound)
        return fail("stage weights sum to " + to_string(sum) + ", below the lower bound " + to_string(bound) +
                    " per rail");
      bytes_t slack = 0, limit = 0;
      const bool unbounded = __builtin_mul_overflow(static_cast<bytes_t>(S), p.granule, &slack) ||
                             __builtin_add_overflow(bound, slack, &limit);
      if (opt.exact_lower_bound && !unbounded && sum > limit)
        return fail("stage weights sum to " + to_string(sum) + ", above the lower bound " + to_string(bound) +
                    " plus rounding " + to_string(slack));
    }
  }

  // r's op index: every op r makes for every piece, once, at the right stage.
  const std::size_t slots = p.op_stages();
  if (p.op_offsets.size() != slots + 1 || p.op_offsets.back() != p.op_list.size())
    return fail("op index has the wrong size for one rank's view");
  for (std::size_t k = 1; k < p.op_offsets.size(); ++k)
    if (p.op_offsets[k] < p.op_offsets[k - 1]) return fail("op index offsets decrease at slot " + to_string(k));
  std::vector<std::uint16_t> marks(p.pieces.size(), 0);
  for (std::size_t st = 0; st < slots; ++st)
    for (const rank_op& op : p.ops(r, st)) {
      if (op.piece >= p.pieces.size()) return fail("op index names a piece that does not exist");
      const piece& pc = p.pieces[op.piece];
      const std::uint16_t bit = static_cast<std::uint16_t>(1u << static_cast<unsigned>(op.kind));
      if (marks[op.piece] & bit)
        return fail("piece " + to_string(op.piece) + " appears twice in the op index as " +
                    to_string(static_cast<int>(op.kind)));
      marks[op.piece] |= bit;
      bool right = false;
      detail::for_each_op(p, pc, [&](rank_t rr, std::size_t tt, op_kind kk) {
        right |= rr == r && tt == st && kk == op.kind;
      });
      if (!right)
        return fail("rank " + to_string(r) + " stage " + to_string(st) + " lists piece " + to_string(op.piece) +
                    " for an op its route does not make");
    }
  for (std::size_t i = 0; i < p.pieces.size(); ++i) {
    std::uint16_t want = 0;
    detail::for_each_op(p, p.pieces[i], [&](rank_t rr, std::size_t, op_kind k) {
      if (rr == r) want |= static_cast<std::uint16_t>(1u << static_cast<unsigned>(k));
    });
    if (marks[i] != want) return fail("piece " + to_string(i) + " is missing ops in rank " + to_string(r) + "'s index");
  }
  return res;
}

} // namespace fasta2a
