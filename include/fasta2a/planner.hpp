// fasta2a: the FAST planner. Phase 1 (intra-server reshaping onto rails), phase 2 (a Decomposer's
// stages), and the flat plan an executor walks.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fasta2a/common.hpp"
#include "fasta2a/decompose.hpp"
#include "fasta2a/plan.hpp"
#include "fasta2a/topology.hpp"
#include "fasta2a/traffic.hpp"

namespace fasta2a {

/// How the rails of a server are scheduled between servers (plan_options::rails).
enum class rail_schedule : std::uint8_t {
  /// FAST's phase 2: every server pair's bytes spread evenly over the rails, and every rail of a
  /// server in step, following server-level stages (one-to-one permutations of servers).
  shared,
  /// Each server pair's bytes on one rail (pairs largest first, each on the rail where the larger of
  /// its two servers' loads grows least, ties to the rail whose GPU sends or receives most of the
  /// pair), and each rail's matrix decomposed on its own: a rail's NIC still sends to one NIC and
  /// receives from one per stage (no incast), but it switches when its own stages say. A rail then
  /// carries about (S - 1) / G pairs per server instead of S - 1, so from a few dozen servers on
  /// it needs far fewer stages; the price is scale-up traffic (most bytes take two scale-up hops,
  /// against about one in FAST) and, with few servers, rails that whole pairs cannot balance.
  per_rail,
  /// Whichever of the two the topology's scale-out model (scaleout_of) predicts faster, per call:
  /// both are decomposed (G + 1 decompositions).
  automatic,
};

inline const char* to_string(rail_schedule r) noexcept {
  return r == rail_schedule::shared ? "shared" : r == rail_schedule::per_rail ? "per-rail" : "auto";
}

/// Options of the planner.
struct plan_options {
  /// Rail loads of a server pair are equal to within one granule, and splits fall on granule
  /// boundaries of the message where the message sizes allow: use the token size so that tokens
  /// are not cut. Must be at least 1.
  bytes_t granule = 1;
  /// The planner throws plan_too_large instead of building a plan larger than this (stages,
  /// pieces and the per-rank op index together), and instead of allocating more scratch than this
  /// (planner_scratch_bytes: checked before anything of that size is allocated, on every call).
  std::size_t max_plan_bytes = std::size_t{2} << 30;
  /// When set (seconds per stage), the planner also predicts direct sending against the staged
  /// plan's scale-out phase in the topology's scale-out model with this alpha
  /// (scaleout_model::direct_time of the busiest NIC's inter-server bytes against stages_time of
  /// the stages), and builds the direct plan when that is faster: small messages, where stage
  /// synchronisations cost more than the skew. plan::choice says why.
  std::optional<double> direct_if_faster_alpha{};
  /// Staging memory per rank, in bytes, that a staged plan may use; 0: no limit. Where the plan's
  /// own layout (every piece a slot of its own for the whole call) would need more than this on
  /// some rank, the plan shares staging across stages instead (plan::staging_ring): every rank's
  /// staging is two rings of staging_slots slots of W bytes, W the budget / (2 staging_slots)
  /// rounded down to the granule, and stages heavier than W are cut into chunks of at most W (same
  /// permutation, same sum of weights: the plan stays exact, with more stages). The executor
  /// reuses a slot once the stage before in the ring is done with it. Throws fasta2a::error where
  /// the budget cannot hold one granule per slot.
  bytes_t staging_budget = 0;
  /// Slots per ring where staging is shared (see staging_budget): stages that can be in flight at
  /// once on a rail rank. More slots: more overlap, smaller slots, so more stages. At least 1.
  /// Measured on the emulated cluster (docs/PERFORMANCE.md, "Staging within a budget"), Zipf(1.0) at a budget of
  /// 25%: 2 / 4 / 6 / 8 / 12 / 16 slots took 1.24 / 1.15 / 1.17 / 1.03 / 1.09 / 1.24x the time
  /// without a budget: the credits need stages in flight to hide their latency, and slots past
  /// that only add stages.
  std::uint32_t staging_slots = 8;
  /// Shared stages (FAST), per-rail schedules, or whichever the model predicts faster (rail_schedule).
  rail_schedule rails = rail_schedule::shared;
};

/// The engine's default floor of a call's staging budget (engine_options::staging_floor): 8 MiB,
/// two rings of 8 slots of 512 KiB. A slot of 512 KiB is about 10 us of a 50 GB/s NIC, one
/// stage's synchronisation (alpha): a budget that cuts stages into smaller chunks adds stages that
/// cost more time than the memory they save is worth. Without a floor, a call of 256 bytes per
/// rank pair on 2 x 4 ranks got a budget of 512 bytes at 25%: its one stage was cut into 32.
inline constexpr bytes_t default_staging_floor = bytes_t{8} << 20;

/// The staging budget of a call whose largest buffer (the most bytes any rank sends or receives)
/// is `largest`: `fraction` of it, at least `floor` and one granule per slot (2 x staging_slots
/// granules), and at most opt.staging_budget where that is set. What the engine plans each call
/// with (engine_options::staging_fraction, staging_floor) and `fasta2a plan --staging-fraction`
/// shows. A budget at least the plan's own staging shares nothing.
inline bytes_t staging_budget_for(bytes_t largest, double fraction, const plan_options& opt, bytes_t floor = 0) noexcept {
  const long double want = static_cast<long double>(largest) * static_cast<long double>(fraction);
  bytes_t b = want >= 1.8e19L ? ~bytes_t{0} : static_cast<bytes_t>(want);
  b = std::max(b, floor);
  b = std::max(b, 2 * static_cast<bytes_t>(opt.staging_slots) * opt.granule);
  if (opt.staging_budget > 0) b = std::min(b, opt.staging_budget);
  return b;
}

/// The largest buffer of a traffic matrix: the most bytes any rank sends or receives (wraps past
/// 2^64, which a matrix the planner accepts does not reach).
inline bytes_t largest_buffer(const traffic_view& t) {
  const auto n = static_cast<std::size_t>(t.rows());
  std::vector<bytes_t> in(n, 0);
  bytes_t most = 0;
  for (std::size_t i = 0; i < n; ++i) {
    bytes_t out = 0;
    const bytes_t* row = t.data() + i * static_cast<std::size_t>(t.outerStride());
    for (std::size_t j = 0; j < n; ++j) out += row[j], in[j] += row[j];
    most = std::max(most, out);
  }
  for (bytes_t x : in) most = std::max(most, x);
  return most;
}

/// Rail capacities of one server pair carrying V bytes over G rails: each rail gets the same
/// multiple of the granule, and the remainder goes one granule at a time (the last part smaller)
/// to the rails in order of their diagonal entry, largest first, ties to the lower rail: diag[k *
/// stride] is what GPU k sends GPU k of the other server, which rides rail k with no scale-up hop.
/// Returns the largest capacity.
/// SG, when not 0, is G known at compile time (it must equal gpus).
template <int SG = 0>
inline bytes_t rail_capacities(bytes_t v, int gpus, bytes_t granule, const bytes_t* diag, std::size_t stride,
                               bytes_t* cap) noexcept {
  if constexpr (SG > 0) gpus = SG;
  // G x granule past 64 bits is more than any v: every rail gets no whole granule then (the
  // product must not wrap, or a unit of 0 would divide by zero).
  bytes_t unit = 0;
  const bytes_t base = __builtin_mul_overflow(static_cast<bytes_t>(gpus), granule, &unit) ? 0 : (v / unit) * granule;
  const bytes_t rem = v - base * gpus; // < gpus * granule
  for (int k = 0; k < gpus; ++k) cap[k] = base;
  if (rem == 0) return base;
  // The rails that get more than the base are the first whole + 1 in that order (or whole, if
  // the division is exact): picked by repeated maximum, or by counting, for rail k, the rails
  // before it in the order, past 64 rails.
  const bytes_t whole = rem / granule, part = rem % granule;
  if constexpr (SG == 8) {
    // Eight rails (H200 and MI300X servers): the order by a sorting network (Batcher's odd-even
    // merge sort, 19 compare-exchanges), then the deal along it. Diagonals below 2^61 are sorted as
    // one key each, (diagonal, 7 - rail): keys are distinct, and a compare-exchange is a min and a
    // max, without the branches that data-dependent comparisons of (diagonal, rail) mispredict.
    auto network = [](auto&& cx) FASTA2A_INLINE {
      cx(0, 1), cx(2, 3), cx(4, 5), cx(6, 7), cx(0, 2), cx(1, 3), cx(4, 6), cx(5, 7), cx(1, 2), cx(5, 6);
      cx(0, 4), cx(1, 5), cx(2, 6), cx(3, 7), cx(2, 4), cx(3, 5), cx(1, 2), cx(3, 4), cx(5, 6);
    };
    int r[8]; // the rails in order
    bytes_t top = 0;
    for (int j = 0; j < 8; ++j) top |= diag[static_cast<std::size_t>(j) * stride];
    if (top >> 61 == 0) {
      bytes_t key[8];
      for (int j = 0; j < 8; ++j) key[j] = diag[static_cast<std::size_t>(j) * stride] << 3 | static_cast<bytes_t>(7 - j);
      network([&](int a, int b) FASTA2A_INLINE { // afterwards the larger key comes first
        const bytes_t ka = key[a], kb = key[b];
        const bytes_t hi = ka > kb ? ka : kb;
        key[a] = hi, key[b] = ka ^ kb ^ hi;
      });
      for (int k = 0; k < 8; ++k) r[k] = 7 - static_cast<int>(key[k] & 7);
    } else { // diagonals of 2^61 bytes or more: (diagonal, rail) pairs
      bytes_t d[8];
      for (int j = 0; j < 8; ++j) d[j] = diag[static_cast<std::size_t>(j) * stride], r[j] = j;
      network([&](int a, int b) { // afterwards (d[a], r[a]) comes first: larger diagonal, then lower rail
        const bool swap = d[b] > d[a] || (d[b] == d[a] && r[b] < r[a]);
        const bytes_t da = d[a], db = d[b];
        const int ra = r[a], rb = r[b];
        d[a] = swap ? db : da, d[b] = swap ? da : db;
        r[a] = swap ? rb : ra, r[b] = swap ? ra : rb;
      });
    }
    for (int k = 0; k < 8; ++k) {
      const bytes_t place = static_cast<bytes_t>(k);
      cap[r[k]] += (-static_cast<bytes_t>(place < whole) & granule) | (-static_cast<bytes_t>(place == whole) & part);
    }
  } else if (gpus <= 64) {
    bytes_t d[64];
    for (int j = 0; j < gpus; ++j) d[j] = diag[static_cast<std::size_t>(j) * stride];
    std::uint64_t taken = 0;
    for (bytes_t i = 0; i <= whole && i < static_cast<bytes_t>(gpus); ++i) {
      int best = -1;
      bytes_t top = 0;
      for (int j = 0; j < gpus; ++j) {
        const bytes_t dj = d[j];
        const bool better = !((taken >> j) & 1) && (best < 0 || dj > top);
        best = better ? j : best;
        top = better ? dj : top;
      }
      taken |= std::uint64_t{1} << best;
      cap[best] += i < whole ? granule : part;
    }
  } else {
    for (int k = 0; k < gpus; ++k) {
      const bytes_t dk = diag[static_cast<std::size_t>(k) * stride];
      bytes_t place = 0;
      for (int j = 0; j < gpus; ++j) {
        const bytes_t dj = diag[static_cast<std::size_t>(j) * stride];
        place += (dj > dk) | ((dj == dk) & (j < k));
      }
      cap[k] += place < whole ? granule : place == whole ? part : 0;
    }
  }
  return base + std::min(rem, granule);
}

/// The per-rail bytes from server s to server d in a FAST plan: the largest rail capacity of the
/// pair, which depends only on the pair's total bytes.
/// rail_capacities returns the same, without ordering the rails.
inline bytes_t per_rail_bytes(bytes_t v, int gpus, bytes_t granule) noexcept {
  bytes_t unit = 0; // G x granule past 64 bits: no rail gets a whole granule (as rail_capacities)
  const bytes_t base = __builtin_mul_overflow(static_cast<bytes_t>(gpus), granule, &unit) ? 0 : (v / unit) * granule;
  const bytes_t rem = v - base * static_cast<bytes_t>(gpus);
  return base + std::min(rem, granule); // the first rail's share of the remainder
}

namespace detail {
/// planner_scratch_bytes for a decomposer whose scratch per server pair is `per_pair` bytes.
inline long double planner_scratch_bytes(int servers, int gpus, bool whole_plan, std::size_t per_pair) noexcept {
  const long double S = servers, G = gpus, pairs = S * S, n = S * G;
  return pairs * (32.0L + static_cast<long double>(per_pair)) +
         (whole_plan ? pairs * G * 24.0L : 2.0L * S * G * 24.0L + n * 16.0L) + n * 40.0L +
         (whole_plan ? n * n * 8.0L : 0.0L);
}
} // namespace detail

/// What a planner with decomposer D allocates before its first piece, for S servers of G GPUs:
/// the server matrix, per-pair stage index and weights (32 bytes per server pair), the rail
/// capacities and the staging layout's two bases (24 bytes per server pair and rail; a rank's view
/// keeps them only for the 2 S pairs that touch its server, and sums per rank: 16 more per rank),
/// the decomposer's scratch (decomposer_scratch_per_pair), and, for a whole plan, the message
/// index (8 bytes per rank pair). An upper estimate, in long double so that it cannot wrap: the
/// planner refuses to plan when it passes plan_options::max_plan_bytes, before allocating any of it.
template <class D> long double planner_scratch_bytes(int servers, int gpus, bool whole_plan) noexcept {
  return detail::planner_scratch_bytes(servers, gpus, whole_plan, decomposer_scratch_per_pair<D>());
}

namespace detail {

/// A server pair with its bytes and whatever the caller carries along (planner::choose_rails: the
/// order in which the pair prefers its rails).
struct valued_pair {
  bytes_t value;
  std::uint64_t payload;
  std::uint32_t pair;
};

/// Sorts `items` by value, largest first, equal values keeping their order (as std::stable_sort
/// would): a least-significant-digit radix sort over the bits of (largest - value) that vary,
/// moving whole items so that the caller then reads them in order, not scattered over its arrays.
inline void sort_by_value_desc(std::vector<valued_pair>& items, std::vector<valued_pair>& tmp,
                               std::vector<std::size_t>& count) {
  bytes_t lo = ~bytes_t{0}, hi = 0;
  for (const valued_pair& x : items) lo = std::min(lo, x.value), hi = std::max(hi, x.value);
  int value_bits = 0;
  while (value_bits < 64 && ((hi - lo) >> value_bits) != 0) ++value_bits;
  if (items.size() < 1024 || value_bits > 44) { // small, or more than four passes
    std::stable_sort(items.begin(), items.end(),
                     [](const valued_pair& a, const valued_pair& b) { return a.value > b.value; });
    return;
  }
  constexpr int digit = 11;
  constexpr std::size_t buckets = std::size_t{1} << digit;
  tmp.resize(items.size());
  for (int shift = 0; shift < value_bits; shift += digit) {
    count.assign(buckets, 0);
    for (const valued_pair& x : items) ++count[((hi - x.value) >> shift) & (buckets - 1)];
    std::size_t at = 0;
    for (std::size_t& c : count) at += std::exchange(c, at);
    for (const valued_pair& x : items) tmp[count[((hi - x.value) >> shift) & (buckets - 1)]++] = x;
    items.swap(tmp);
  }
}

} // namespace detail

/// What a decomposer is to the planner (planner_core): its name and whether it stages, fixed
/// for its type (Decomposer); the rest through planner_core's virtual functions.
struct decomposer_traits {
  const char* name;
  bool staged;
  std::size_t scratch_per_pair; ///< decomposer_scratch_per_pair
  bool explains;                ///< it has chosen() and reason(): what it chose for the last matrix, and why
  template <Decomposer D> static constexpr decomposer_traits of() noexcept {
    return {D::name, D::staged, decomposer_scratch_per_pair<D>(), requires(const D& d) {
              d.chosen();
              d.reason();
            }};
  }
};

/// Everything of a planner but its decomposer (planner<Topo, D>, below, adds it): compiled once
/// per topology however many decomposers a program uses, the decomposer called through one
/// virtual call per decomposition.
template <Topology Topo>
class planner_core {
public:
  planner_core(const planner_core&) = default;
  planner_core(planner_core&&) = default;
  planner_core& operator=(const planner_core&) = default;
  planner_core& operator=(planner_core&&) = default;
  virtual ~planner_core() = default;

  const Topo& topology() const noexcept { return topo_; }
  const plan_options& options() const noexcept { return opt_; }
  /// Sets plan_options::staging_budget for the plans made from now on (the engine sets it per call).
  void set_staging_budget(bytes_t b) noexcept { opt_.staging_budget = b; }
  /// M of the last plan: per-rail bytes between servers.
  const server_matrix& rail_matrix() const noexcept { return m_; }
  /// Per rank (server * G + rail), the bytes of the last plan's staging that the rank's balance
  /// regions take: its buffer holds them first, then its receive regions (detail::staging_layout).
  /// What transposing a per-rail plan reads besides the plan (transpose_into); all 0 where the last
  /// plan stages nothing. Like rail_matrix(), it describes the last plan made, whole or a view.
  std::vector<bytes_t> balance_bytes() const {
    const int S = topo_.servers(), G = gpus();
    const std::size_t SG = static_cast<std::size_t>(S) * static_cast<std::size_t>(G);
    std::vector<bytes_t> b(SG, 0);
    if (!last_staged_) return b;
    if (last_view_) { // rail_layout summed them for every rank
      std::copy_n(out_sum_.begin(), SG, b.begin());
      return b;
    }
    for (int s = 0; s < S; ++s)
      for (int d = 0; d < S; ++d) {
        if (s == d) continue;
        for (int k = 0; k < G; ++k) // a per-rail plan's region is its stream, a shared plan's M(s, d)
          b[static_cast<std::size_t>(s) * G + k] +=
              rails_ ? caps_[(static_cast<std::size_t>(s) * S + d) * G + k] : m_(s, d);
      }
    return b;
  }

  /// The plan for traffic matrix t (ranks x ranks bytes; a traffic_matrix, or a view of rows that
  /// lie apart, read in place). Throws fasta2a::error on a matrix that does not fit the topology or
  /// whose sums overflow, plan_too_large past max_plan_bytes.
  plan make(const traffic_view& t) {
    plan p;
    make_into(t, p);
    return p;
  }

  /// As `make`, reusing p's storage.
  void make_into(const traffic_view& t, plan& p) { build(t, p, -1); }

  /// Rank r's part of the plan: the stages, every piece rank r sends, receives or carries on its
  /// rail, and r's ops; nothing of other ranks. The pieces and ops are exactly those of the whole
  /// plan for r (same values, same order), at a fraction of the cost: phase 1 runs only for the
  /// server pairs that touch r's server. This is what each rank computes per call.
  plan make_rank(const traffic_view& t, rank_t r) {
    plan p;
    make_rank_into(t, r, p);
    return p;
  }

  /// As `make_rank`, reusing p's storage.
  void make_rank_into(const traffic_view& t, rank_t r, plan& p) {
    if (r < 0 || r >= topo_.ranks())
      throw error("rank " + std::to_string(r) + " is not in a topology of " + std::to_string(topo_.ranks()) +
                  " ranks");
    build(t, p, r);
  }

protected:
  planner_core(Topo topo, plan_options opt, decomposer_traits dec)
      : topo_(std::move(topo)), opt_(opt), dec_traits_(dec) {
    if (opt_.granule == 0) throw error("plan_options::granule must be at least 1 byte");
    if (opt_.direct_if_faster_alpha) fallback_model().check("plan_options::direct_if_faster_alpha");
  }
  /// The decomposer's work (planner<Topo, D>): D::decompose, and D's chosen() and reason() where
  /// it has them (decomposer_traits).
  virtual void decompose(const server_matrix& m, stage_list& out) = 0;
  virtual std::string chosen() const = 0;
  virtual std::string reason() const = 0;

private:
  void build(const traffic_view& t, plan& p, rank_t view) {
    const rank_t n = topo_.ranks();
    const int S = topo_.servers();
    const int G = gpus();
    if (t.rows() != n || t.cols() != n) check_traffic(t, n); // throws, naming both shapes
    check_scratch(view < 0);
    p.decomposer = dec_traits_.name;
    p.servers = S;
    p.gpus_per_server = G;
    p.granule = opt_.granule;
    p.staged = dec_traits_.staged;
    p.view = view;
    p.scaleup_bytes = 0;
    p.choice.clear();

    stages_.max_bytes = opt_.max_plan_bytes;
    stages_.extra_bytes_per_stage =
        (view < 0 ? static_cast<std::size_t>(n) : std::size_t{1}) * sizeof(std::uint32_t) + S * 4;
    // Per-rail schedules (plan_options::rails) are chosen, and their rails decomposed, before
    // phase 1: they decide each pair's rail capacities.
    rails_ = false;
    bool decomposed = false;
    if (dec_traits_.staged && G > 1 && opt_.rails != rail_schedule::shared) {
      rails_ = choose_rails(t, p);
      decomposed = !rails_; // automatic: the shared stages are made already
    }
    // Phase 1's rail capacities depend only on each pair's total and diagonal, so every rank can
    // compute all of them cheaply: they give M (phase 2's input) and the staging layout.
    rail_layout(t, p);
    if (rails_) {
      p.rail_load = 0;
      // Each rail matrix's line sums are the rail's loads per server (choose_rails).
      for (bytes_t x : load_out_) p.rail_load = std::max(p.rail_load, x);
      for (bytes_t x : load_in_) p.rail_load = std::max(p.rail_load, x);
      combine_rails();
    } else {
      p.rail_load = max_line_sum(m_);
      if (!decomposed) {
        decompose(m_, stages_);
        if (dec_traits_.explains) {
          p.decomposer = chosen();
          p.choice = reason() + p.choice;
        }
      }
    }
    ring_ = 0;
    slot_ = 0;
    if (dec_traits_.staged && opt_.staging_budget > 0) share_staging(p);
    p.staging_ring = ring_;
    p.staging_slot = slot_;
    if (dec_traits_.staged && opt_.direct_if_faster_alpha) choose_direct(p);
    if (!p.staged) {
      stages_.reset(S);
      rails_ = false;
    }
    last_view_ = view >= 0;
    last_staged_ = p.staged;
    p.stage_weight.assign(stages_.weights.begin(), stages_.weights.end());
    p.stage_perm.assign(stages_.perms.begin(), stages_.perms.end());
    if (rails_) {
      p.rail_weight = rail_weight_;
      p.rail_perm = rail_perm_;
    } else {
      p.rail_weight.clear();
      p.rail_perm.clear();
    }
    const std::size_t T = p.stages();
    const std::size_t views = view < 0 ? static_cast<std::size_t>(n) : 1;
    const std::size_t op_slots = views * (T == 0 ? 1 : T) + 1;
    check_size(T * (S * 4 + 8) + op_slots * 4 + (view < 0 ? 2 * static_cast<std::size_t>(n) * n * 4 : 0),
               "stages and index");
    if (rails_) index_rail_stages(p);
    else index_pair_stages(p);
    index_.begin(p);

    // Phase 1 and the pieces, one server pair at a time; a rank's view needs only the pairs that
    // touch its server, in the same order as the whole plan.
    p.pieces.clear();
    if (view < 0) {
      p.message_first.assign(static_cast<std::size_t>(n) * n, 0);
      p.message_count.assign(static_cast<std::size_t>(n) * n, 0);
    } else {
      p.message_first.clear();
      p.message_count.clear();
    }
    const int home = view < 0 ? -1 : view / G;
    for (int s = 0; s < S; ++s)
      for (int d = 0; d < S; ++d) {
        if (view >= 0 && s != home && d != home) continue;
        if (s == d || !p.staged) emit_unstaged_pair(t, p, s, d);
        else emit_pair(t, p, s, d);
        check_size(p.pieces.size() * (sizeof(piece) + 6 * sizeof(rank_op)), "pieces");
      }
    index_.finish();
  }

  int gpus() const noexcept {
    if constexpr (static_gpus_v<Topo> > 0) return static_gpus_v<Topo>;
    else return topo_.gpus_per_server();
  }

  // Refuses, before allocating it, scratch past the limit (planner_scratch_bytes).
  void check_scratch(bool whole_plan) const {
    const long double need =
        detail::planner_scratch_bytes(topo_.servers(), gpus(), whole_plan, dec_traits_.scratch_per_pair);
    if (need > static_cast<long double>(opt_.max_plan_bytes)) {
      char b[64];
      std::snprintf(b, sizeof b, "%.0Lf", need);
      throw plan_too_large("planning " + std::to_string(topo_.servers()) + " servers x " + std::to_string(gpus()) +
                           " GPUs needs about " + b + " bytes of scratch and index (S^2 x G rail capacities and "
                           "staging layout, S^2 decomposer work" + (whole_plan ? ", ranks^2 message index" : "") +
                           "), past the plan size limit of " + std::to_string(opt_.max_plan_bytes) +
                           " bytes; raise plan_options::max_plan_bytes");
    }
  }

  // Room for more pieces, never past the plan size limit: a vector that doubles would otherwise
  // allocate up to twice the limit before the check after the server pair (issue 50: a staging
  // budget of a few bytes cuts a call into tens of millions of pieces).
  void grow_pieces(plan& p) const {
    constexpr std::size_t per = sizeof(piece) + 6 * sizeof(rank_op); // as check_size counts them
    const std::size_t most = opt_.max_plan_bytes / per;
    if (p.pieces.size() >= most) check_size((p.pieces.size() + 1) * per, "pieces"); // throws
    p.pieces.reserve(std::min(most, std::max<std::size_t>(64, 2 * p.pieces.size())));
  }

  void check_size(std::size_t bytes, const char* what) const {
    if (bytes / (sizeof(piece) + 6 * sizeof(rank_op)) >= (std::size_t{1} << 32) / 8)
      throw plan_too_large(std::string("plan has too many ") + what + " to index");
    if (bytes > opt_.max_plan_bytes)
      throw plan_too_large("plan exceeds its size limit of " + std::to_string(opt_.max_plan_bytes) +
                           " bytes (" + what + " alone need " + std::to_string(bytes) +
                           "); raise plan_options::max_plan_bytes");
  }

  // Where a server pair's rail capacities and staging bases are kept: every pair's for a whole
  // plan; for a rank's view only the 2 S - 1 pairs that touch its server (the only ones it makes
  // pieces of), so that a view's scratch grows as S G, not S^2 G.
  static std::size_t pair_slot(const plan& p, int S, int G, int s, int d) noexcept {
    if (p.view < 0) return static_cast<std::size_t>(s) * S + d;
    const int home = p.view / G;
    return s == home ? static_cast<std::size_t>(d) : static_cast<std::size_t>(S) + s;
  }

  // Rail capacities of every server pair (phase 1's loads), M, and the staging layout
  // (detail::staging_layout): a rail's capacity is exactly the bytes its stream will carry, so the
  // layout is known before any piece is made, and a rank's view places its pieces in the same
  // slots as the whole plan. A view keeps the capacities and bases of the pairs that touch its
  // server only, summing the others' region sizes as it goes (the same sums, in the same order):
  // M(s, d) in a shared plan, so of those pairs it needs each one's total only.
  void rail_layout(const traffic_view& t, plan& p) {
    const int S = topo_.servers(), G = gpus();
    const std::size_t SG = static_cast<std::size_t>(S) * G, SSG = SG * S;
    const bool view = p.view >= 0;
    const int home = view ? p.view / G : -1;
    m_.setZero(S, S);
    caps_.assign(view ? 2 * SG : SSG, 0);
    if (view) {
      other_caps_.assign(static_cast<std::size_t>(G), 0);
      view_out_.assign(2 * SG, 0);
      view_in_.assign(2 * SG, 0);
      out_sum_.assign(SG, 0);
      in_sum_.assign(SG, 0);
    }
    const std::size_t ld = static_cast<std::size_t>(t.outerStride());
    const bool nic = dec_traits_.staged && opt_.direct_if_faster_alpha.has_value();
    if (nic) nic_.assign(2 * SG, 0);
    // One pass over the matrix. Entries are non-negative, so if the total fits in 64 bits every
    // row, column and block sum does too: only the total needs an overflow check.
    bool overflow = false;
    bytes_t total = 0;
    for (int s = 0; s < S; ++s)
      for (int d = 0; d < S; ++d) {
        const bytes_t* blk = t.data() + static_cast<std::size_t>(s * G) * ld + d * G;
        // Per-rail schedules summed every other pair already (choose_rails): their capacities
        // need no more of the block, so the matrix is read again only for the diagonal blocks.
        const bytes_t v = rails_ && !nic && s != d ? pair_bytes_[static_cast<std::size_t>(s) * S + d]
                                                   : block_sum(blk, ld, G, overflow);
        overflow |= __builtin_add_overflow(total, v, &total);
        if (s == d) continue;
        if (nic) // the busiest NIC under direct sending: each GPU's own inter-server bytes
          for (int a = 0; a < G; ++a)
            for (int b = 0; b < G; ++b) {
              nic_[s * G + a] += blk[a * ld + b];
              nic_[SG + d * G + b] += blk[a * ld + b];
            }
        // Extra granules go to the rails with the most traffic that needs no scale-up hop.
        const bool kept = !view || s == home || d == home;
        bytes_t* cap = kept ? caps_.data() + pair_slot(p, S, G, s, d) * G : other_caps_.data();
        if (rails_) { // the whole pair on its rail
          std::fill_n(cap, G, bytes_t{0});
          cap[rail_of_[static_cast<std::size_t>(s) * S + d]] = v;
          m_(s, d) = v;
        } else if (kept) {
          m_(s, d) = rail_capacities<static_gpus_v<Topo>>(v, G, opt_.granule, blk, ld + 1, cap);
        } else {
          // A view makes no piece of this pair, and a shared plan's staging regions are sized by
          // M alone (staging_layout): the pair's rails need no order.
          m_(s, d) = per_rail_bytes(v, G, opt_.granule);
        }
        if (view && dec_traits_.staged) { // staging_layout::build's two passes, summed in one
          // The destination's balance regions come before its receive regions: added below.
          const std::size_t slot = kept ? pair_slot(p, S, G, s, d) * G : 0;
          if (rails_) { // each region its stream
            for (int k = 0; k < G; ++k) {
              bytes_t& out = out_sum_[static_cast<std::size_t>(s) * G + k];
              bytes_t& in = in_sum_[static_cast<std::size_t>(d) * G + k];
              if (kept) view_out_[slot + k] = out, view_in_[slot + k] = in;
              out += cap[k];
              in += cap[k];
            }
          } else { // every rail's region is M(s, d): the sums of a server's rails are one, kept in rail 0's
            bytes_t& out = out_sum_[static_cast<std::size_t>(s) * G];
            bytes_t& in = in_sum_[static_cast<std::size_t>(d) * G];
            if (kept) {
              std::fill_n(view_out_.data() + slot, G, out);
              std::fill_n(view_in_.data() + slot, G, in);
            }
            out += m_(s, d);
            in += m_(s, d);
          }
        }
      }
    if (view && dec_traits_.staged && !rails_)
      for (std::size_t r = 0; r < SG; ++r) {
        out_sum_[r] = out_sum_[r - r % G];
        in_sum_[r] = in_sum_[r - r % G];
      }
    if (overflow) check_traffic(t, topo_.ranks()); // throws, naming the row or column
    p.total_bytes = total;
    // Direct sending stages nothing.
    if (!dec_traits_.staged) {
      p.staging_bytes.assign(SG, 0);
    } else if (!view) {
      layout_.build(S, G, caps_.data(), p.staging_bytes, rails_);
    } else {
      p.staging_bytes.assign(SG, 0);
      for (std::size_t r = 0; r < SG; ++r) p.staging_bytes[r] = out_sum_[r] + in_sum_[r];
      for (int x = 0; x < S; ++x) { // the kept pairs: (home, x), and (x, home) for x != home
        const std::size_t a = static_cast<std::size_t>(x), b = static_cast<std::size_t>(S) + x;
        for (int k = 0; k < G; ++k) {
          view_in_[a * G + k] += out_sum_[a * G + k];
          if (x != home) view_in_[b * G + k] += out_sum_[static_cast<std::size_t>(home) * G + k];
        }
      }
    }
  }

  // Eight entries of a row as four vectors of two (block_sum, rail_preference).
  template <class V> static FASTA2A_INLINE void load_row8(const bytes_t* row, V& r0, V& r1, V& r2, V& r3) noexcept {
    std::memcpy(&r0, row, sizeof r0);
    std::memcpy(&r1, row + 2, sizeof r1);
    std::memcpy(&r2, row + 4, sizeof r2);
    std::memcpy(&r3, row + 6, sizeof r3);
  }

  // The sum of a G x G block, setting `overflow` if it passes 64 bits. The high and low 32 bits of
  // the entries are summed apart, which cannot wrap for fewer than 2^32 entries: one overflow test
  // per block instead of one per entry.
  static bytes_t block_sum(const bytes_t* blk, std::size_t ld, int G, bool& overflow) noexcept {
    if constexpr (static_gpus_v<Topo> > 0) G = static_gpus_v<Topo>;
    if (static_cast<std::uint64_t>(G) * static_cast<std::uint64_t>(G) >= (std::uint64_t{1} << 32)) {
      bytes_t v = 0;
      for (int a = 0; a < G; ++a)
        for (int b = 0; b < G; ++b) overflow |= __builtin_add_overflow(v, blk[a * ld + b], &v);
      return v;
    }
    // Entries below 2^57 cannot wrap a sum of at most 64 of them: one OR per entry finds the
    // blocks that need the split sum below.
    if (G == 8) { // two entries a vector, as rail_preference
      typedef bytes_t pair_v __attribute__((vector_size(16)));
      pair_v sum = {}, any = {};
      for (int a = 0; a < 8; ++a) {
        // Four loads into four vectors, not one memcpy into an array of them: GCC kept the
        // array on the stack, so every entry was stored and loaded again (2.0 -> 1.4 us of a
        // 64-GPU rank's part).
        pair_v r0, r1, r2, r3;
        load_row8(blk + static_cast<std::size_t>(a) * ld, r0, r1, r2, r3);
        sum += (r0 + r1) + (r2 + r3);
        any |= (r0 | r1) | (r2 | r3);
      }
      if (((any[0] | any[1]) >> 57) == 0) return sum[0] + sum[1];
    } else if (G <= 8) {
      bytes_t v = 0, any = 0;
      for (int a = 0; a < G; ++a) {
        const bytes_t* row = blk + a * ld;
        for (int b = 0; b < G; ++b) {
          v += row[b];
          any |= row[b];
        }
      }
      if ((any >> 57) == 0) return v;
    }
    bytes_t lo = 0, hi = 0;
    for (int a = 0; a < G; ++a) {
      const bytes_t* row = blk + a * ld;
      for (int b = 0; b < G; ++b) {
        lo += row[b] & 0xffffffffu;
        hi += row[b] >> 32;
      }
    }
    // v = hi 2^32 + lo, where hi < 2^32 is needed for the product to fit.
    bytes_t v = 0;
    overflow |= (hi >> 32) != 0 || __builtin_add_overflow(hi << 32, lo, &v);
    return v;
  }

  // Staging within plan_options::staging_budget: where the plan's own layout needs more on some
  // rank, every stage heavier than a slot is cut into chunks of one slot (the last one smaller),
  // and every rank's staging becomes two rings of slots (plan::staging_ring). Every rank of a view
  // knows every rank's staging size (rail_layout), so views and whole plans agree.
  void share_staging(plan& p) {
    bytes_t most = 0;
    for (bytes_t b : p.staging_bytes) most = std::max(most, b);
    // One GPU per server stages nothing (every rail hop is its own source's and destination's).
    if (most <= opt_.staging_budget || stages_.size() == 0 || p.gpus_per_server == 1) return;
    const bytes_t K = opt_.staging_slots, g = opt_.granule;
    if (K == 0) throw error("plan_options::staging_slots must be at least 1");
    bytes_t w = opt_.staging_budget / (2 * K) / g * g;
    if (w == 0)
      throw error("staging budget of " + std::to_string(opt_.staging_budget) + " bytes per rank cannot hold " +
                  std::to_string(2 * K) + " slots (2 rings of " + std::to_string(K) + ") of one granule (" +
                  std::to_string(g) + " bytes) each; the plan's own layout needs " + std::to_string(most) +
                  " bytes on the busiest rank");
    bytes_t heaviest = 0;
    for (bytes_t x : stages_.weights) heaviest = std::max(heaviest, x);
    w = std::min(w, heaviest);
    // Every piece of a rail hop fits in one slot, so the pieces number at least the bytes that
    // cross between servers (at least one rail's share of each pair; for a rank's view, the pairs
    // of its server) over the slot: refused here, before the stages are cut, where they alone pass
    // the limit.
    {
      const int S = static_cast<int>(m_.rows()), home = p.view < 0 ? -1 : p.view / p.gpus_per_server;
      long double crossing = 0;
      for (int a = 0; a < S; ++a)
        for (int b = 0; b < S; ++b)
          if (a != b && (home < 0 || a == home || b == home)) crossing += static_cast<long double>(m_(a, b));
      const long double pieces = crossing / static_cast<long double>(w);
      if (pieces * static_cast<long double>(sizeof(piece) + 6 * sizeof(rank_op)) > static_cast<long double>(opt_.max_plan_bytes)) {
        char c[32];
        std::snprintf(c, sizeof c, "%.4Lg", pieces);
        throw plan_too_large("a staging budget of " + std::to_string(opt_.staging_budget) + " bytes per rank (slots of " +
                             std::to_string(w) + " bytes) cuts the traffic between servers into at least " + c +
                             " pieces, past the plan size limit of " + std::to_string(opt_.max_plan_bytes) +
                             " bytes; raise the staging budget (or fraction) or plan_options::max_plan_bytes");
      }
    }
    if (rails_) { // each rail's stages cut apart, then aligned again
      for (stage_list& list : rail_stages_) cut_into_slots(list, w);
      combine_rails();
    } else {
      cut_into_slots(stages_, w);
    }
    ring_ = static_cast<std::uint32_t>(std::min<std::size_t>(K, stages_.size()));
    slot_ = w;
    for (bytes_t& b : p.staging_bytes) b = b == 0 ? 0 : 2 * static_cast<bytes_t>(ring_) * w; // 0: stages nothing
  }

  // Every stage of `list` heavier than w cut into stages of w (the last one smaller), in order.
  void cut_into_slots(stage_list& list, bytes_t w) {
    // How many stages the cut makes, and what they will cost, before any is stored: a budget of a
    // few bytes cuts a call of megabytes into millions of stages (issue 50: 4.3 GB resident and
    // 16 s before the limit was noticed stage by stage).
    const long double per_stage = static_cast<long double>(list.servers) * sizeof(std::int32_t) + sizeof(bytes_t) +
                                  static_cast<long double>(list.extra_bytes_per_stage);
    long double count = 0;
    for (std::size_t t = 0; t < list.size(); ++t) count += std::ceil(static_cast<long double>(list.weights[t]) / w);
    if (count * per_stage > static_cast<long double>(list.max_bytes)) {
      char c[32];
      std::snprintf(c, sizeof c, "%.4Lg", count);
      throw plan_too_large("a staging budget of " + std::to_string(opt_.staging_budget) + " bytes per rank (slots of " +
                           std::to_string(w) + " bytes) cuts the plan's " + std::to_string(list.size()) + " stages into " + c +
                           ", past the plan size limit of " + std::to_string(list.max_bytes) +
                           " bytes; raise the staging budget (or fraction) or plan_options::max_plan_bytes");
    }
    split_.reset(list.servers);
    split_.max_bytes = list.max_bytes;
    split_.extra_bytes_per_stage = list.extra_bytes_per_stage;
    split_.weights.reserve(static_cast<std::size_t>(count));
    split_.perms.reserve(static_cast<std::size_t>(count) * static_cast<std::size_t>(list.servers));
    for (std::size_t t = 0; t < list.size(); ++t)
      for (bytes_t left = list.weights[t]; left > 0;) {
        const bytes_t x = std::min(left, w);
        split_.add(x, list.perm(t));
        left -= x;
      }
    std::swap(list, split_);
  }

  // The model the direct fallback compares in: the topology's, at the option's alpha.
  scaleout_model fallback_model() const {
    scaleout_model net = scaleout_of(topo_);
    net.alpha_s = *opt_.direct_if_faster_alpha;
    return net;
  }

  // Direct sending instead of the stages, if the model says it is faster (plan_options).
  void choose_direct(plan& p) {
    const scaleout_model net = fallback_model();
    const double staged = rails_ ? rails_time(net) : net.stages_time(stages_.weights);
    const bytes_t nic = nic_.empty() ? 0 : *std::max_element(nic_.begin(), nic_.end());
    const double direct = net.direct_time(nic);
    auto ms = [](double sec) {
      char b[32];
      std::snprintf(b, sizeof b, "%.4g ms", sec * 1e3);
      return std::string(b);
    };
    char a[32];
    std::snprintf(a, sizeof a, "%.3g", net.alpha_s * 1e6);
    p.choice += (p.choice.empty() ? "" : "; ") + std::string("direct ") + ms(direct) + " vs " + p.decomposer + " " +
                std::to_string(stages_.size()) + " stages " + ms(staged) + " (scale-out model, alpha " + a + " us)";
    if (direct < staged) {
      p.staged = false;
      p.decomposer = direct_decomposer::name;
      p.choice += ": direct is faster";
      std::fill(p.staging_bytes.begin(), p.staging_bytes.end(), 0);
      p.staging_ring = ring_ = 0;
      p.staging_slot = slot_ = 0;
      rails_ = false;
    }
  }

  // The slowest rail's modelled time (per-rail schedules): each rail's stages, alpha each.
  double rails_time(const scaleout_model& net) const {
    double most = 0;
    for (const stage_list& list : rail_stages_) most = std::max(most, net.stages_time(list.weights));
    return most;
  }

  // A server pair's bytes (block_sum), and its rails (at most 16) in the order it prefers them
  // where their loads tie (`pref`, 4 bits a rail, the first in the lowest): by the bytes GPU k
  // sends or receives in the block (its row and column, the diagonal twice: that needs no hop at
  // all), most first, then the lower rail.
  static bytes_t rail_preference(const bytes_t* blk, std::size_t ld, int G, bool& overflow, std::uint64_t& pref) noexcept {
    if constexpr (static_gpus_v<Topo> > 0) G = static_gpus_v<Topo>;
    bytes_t own[16], col[16] = {}, v = 0, any = 0; // own: row sums first (rows and columns apart: they vectorise)
    if (G == 8) {
      // Two entries a vector (SSE2 at least, which every x86-64 has; GCC and Clang vector
      // extensions elsewhere): the loop over the matrix, not the sort below, was the pass's cost
      // (14 -> 8 ms over a 4096-rank matrix here).
      typedef bytes_t pair_v __attribute__((vector_size(16)));
      pair_v c[4] = {}, o = {};
      for (int a = 0; a < 8; ++a) {
        pair_v r0, r1, r2, r3; // four vectors, not an array (block_sum)
        load_row8(blk + static_cast<std::size_t>(a) * ld, r0, r1, r2, r3);
        c[0] += r0, c[1] += r1, c[2] += r2, c[3] += r3;
        o |= (r0 | r1) | (r2 | r3);
        const pair_v sum = (r0 + r1) + (r2 + r3);
        own[a] = sum[0] + sum[1];
        v += own[a];
      }
      for (int i = 0; i < 4; ++i) col[2 * i] = c[i][0], col[2 * i + 1] = c[i][1];
      any = o[0] | o[1];
    } else {
      for (int a = 0; a < G; ++a) {
        const bytes_t* row = blk + static_cast<std::size_t>(a) * ld;
        bytes_t sum = 0;
        for (int b = 0; b < G; ++b) {
          sum += row[b];
          col[b] += row[b];
          any |= row[b];
        }
        own[a] = sum;
        v += sum;
      }
    }
    for (int k = 0; k < G; ++k) own[k] += col[k];
    // Entries below 2^56 cannot wrap a sum of at most 256 of them; past that, block_sum's checked sum.
    if (any >> 56 != 0) v = block_sum(blk, ld, G, overflow);
    pref = 0;
    bytes_t top = 0;
    for (int k = 0; k < G; ++k) top |= own[k];
    if (G == 8 && top >> 61 == 0) {
      // One key a rail, (bytes, 7 - rail), sorted by a network of 19 compare-exchanges without
      // the branches that data-dependent comparisons mispredict (as rail_capacities).
      bytes_t key[8];
      for (int k = 0; k < 8; ++k) key[k] = own[k] << 3 | static_cast<bytes_t>(7 - k);
      auto cx = [&](int a, int b) FASTA2A_INLINE { // afterwards the larger key comes first
        const bytes_t ka = key[a], kb = key[b];
        const bytes_t hi = ka > kb ? ka : kb;
        key[a] = hi, key[b] = ka ^ kb ^ hi;
      };
      cx(0, 1), cx(2, 3), cx(4, 5), cx(6, 7), cx(0, 2), cx(1, 3), cx(4, 6), cx(5, 7), cx(1, 2), cx(5, 6);
      cx(0, 4), cx(1, 5), cx(2, 6), cx(3, 7), cx(2, 4), cx(3, 5), cx(1, 2), cx(3, 4), cx(5, 6);
      for (int i = 0; i < 8; ++i) pref |= static_cast<std::uint64_t>(7 - (key[i] & 7)) << (4 * i);
      return v;
    }
    int r[16]; // insertion sort: most bytes first, ties in rail order
    for (int k = 0; k < G; ++k) {
      int i = k;
      for (; i > 0 && own[r[i - 1]] < own[k]; --i) r[i] = r[i - 1];
      r[i] = k;
    }
    for (int i = 0; i < G; ++i) pref |= static_cast<std::uint64_t>(r[i]) << (4 * i);
    return v;
  }

  // Per-rail schedules (plan_options::rails): assigns every server pair to a rail, decomposes each
  // rail's matrix with the planner's decomposer, and, for rail_schedule::automatic, also the shared
  // stages (into stages_), keeping whichever the topology's scale-out model predicts faster. Returns
  // whether the rails are per-rail; p.choice says why.
  bool choose_rails(const traffic_view& t, plan& p) {
    const int S = topo_.servers(), G = gpus();
    const std::size_t SS = static_cast<std::size_t>(S) * S, ld = static_cast<std::size_t>(t.outerStride());
    pair_bytes_.assign(SS, 0);
    order_.clear();
    // One pass over the matrix in memory order: each pair's bytes and, up to 16 rails, the order
    // in which the pair prefers its rails where their loads tie (below): the rail whose GPU sends
    // or receives most of the pair first. The assignment then visits pairs largest first, which
    // is no order of the matrix's memory: the pairs carry both through the sort, so it reads no
    // block again (it did, and at 4096 ranks that cost more than the rest of the plan).
    const bool packed = G <= 16;
    bool overflow = false;
    for (int s = 0; s < S; ++s)
      for (int d = 0; d < S; ++d) {
        if (s == d) continue;
        const bytes_t* blk = t.data() + static_cast<std::size_t>(s * G) * ld + d * G;
        const std::size_t pr = static_cast<std::size_t>(s) * S + d;
        std::uint64_t pref = 0;
        const bytes_t v = packed ? rail_preference(blk, ld, G, overflow, pref) : block_sum(blk, ld, G, overflow);
        pair_bytes_[pr] = v;
        if (v > 0) order_.push_back({v, pref, static_cast<std::uint32_t>(pr)});
      }
    if (overflow) check_traffic(t, topo_.ranks()); // throws, naming the row or column
    detail::sort_by_value_desc(order_, sort_tmp_, sort_count_);
    // Largest pairs first, each on the rail where the larger of its servers' loads grows least;
    // among those, the rail whose GPU sends or receives most of the pair (fewest scale-up hops),
    // then the lowest rail.
    rail_of_.assign(SS, 0);
    load_out_.assign(static_cast<std::size_t>(G) * S, 0); // server x rail
    load_in_.assign(static_cast<std::size_t>(G) * S, 0);
    for (const detail::valued_pair& x : order_) {
      const std::uint32_t pr = x.pair;
      const int s = static_cast<int>(pr / S), d = static_cast<int>(pr % S);
      const bytes_t v = x.value;
      const bytes_t* out = load_out_.data() + static_cast<std::size_t>(s) * G;
      const bytes_t* in = load_in_.data() + static_cast<std::size_t>(d) * G;
      int best = -1;
      if (packed) {
        bytes_t top[16], least = ~bytes_t{0};
        for (int k = 0; k < G; ++k) {
          top[k] = std::max(out[k], in[k]);
          least = std::min(least, top[k]);
        }
        for (std::uint64_t pref = x.payload;; pref >>= 4)
          if (const int k = static_cast<int>(pref & 15); top[k] == least) {
            best = k;
            break;
          }
      } else {
        const bytes_t* blk = t.data() + static_cast<std::size_t>(s * G) * ld + d * G;
        bytes_t best_top = 0, best_own = 0;
        for (int k = 0; k < G; ++k) {
          const bytes_t top = std::max(out[k], in[k]);
          if (best >= 0 && top > best_top) continue;
          bytes_t own = 0; // GPU k's row and column of the block (the diagonal twice: it needs no hop at all)
          for (int o = 0; o < G; ++o) own += blk[static_cast<std::size_t>(k) * ld + o] + blk[static_cast<std::size_t>(o) * ld + k];
          if (best < 0 || top < best_top || own > best_own) best = k, best_top = top, best_own = own;
        }
      }
      rail_of_[pr] = static_cast<std::uint32_t>(best);
      load_out_[static_cast<std::size_t>(s) * G + best] += v;
      load_in_[static_cast<std::size_t>(d) * G + best] += v;
    }
    // Each rail's matrix, written in memory order: written in the order above (largest pairs
    // first), every entry was a store to a random place of G matrices of S^2 words, which at 512
    // servers (16 MB) missed the caches on most pairs and took about as long as reading the matrix.
    rail_m_.resize(static_cast<std::size_t>(G));
    for (server_matrix& mk : rail_m_) mk.setZero(S, S);
    for (std::size_t pr = 0; pr < SS; ++pr)
      if (const bytes_t v = pair_bytes_[pr]; v > 0) rail_m_[rail_of_[pr]].data()[pr] = v;
    rail_stages_.resize(static_cast<std::size_t>(G));
    // The stage lists' size limits count the rail arrays too (G permutations and weights a stage).
    const std::size_t extra = stages_.extra_bytes_per_stage + static_cast<std::size_t>(G) * (S * 4 + 8);
    std::string names; // what the decomposer chose on each rail, each once
    for (int k = 0; k < G; ++k) {
      stage_list& list = rail_stages_[static_cast<std::size_t>(k)];
      list.reset(S);
      list.max_bytes = opt_.max_plan_bytes;
      list.extra_bytes_per_stage = extra;
      decompose(rail_m_[static_cast<std::size_t>(k)], list);
      const std::string c = chosen(); // D::name where D chooses nothing
      if (names.empty()) names = c;
      else if (names != c && names.find(c) == std::string::npos) names += "/" + c;
    }
    p.decomposer = names;
    const scaleout_model net = scaleout_of(topo_);
    // Compared as cost_model.hpp's rails_choice_time: the scale-out phase and the two ends' scale-up
    // work no stage hides (per-rail plans gather whole pairs onto a rail, so theirs weigh more).
    auto ends = [&](const std::vector<bytes_t>& weights) {
      bytes_t heaviest = 0;
      for (bytes_t w : weights) heaviest = std::max(heaviest, w);
      return 2 * gather_time(topo_, heaviest);
    };
    const double mine_out = rails_time(net);
    double mine = mine_out;
    {
      double e = 0;
      for (const stage_list& list : rail_stages_) e = std::max(e, ends(list.weights));
      mine += e;
    }
    std::size_t most = 0;
    for (const stage_list& list : rail_stages_) most = std::max(most, list.size());
    auto ms = [](double sec) {
      char b[32];
      std::snprintf(b, sizeof b, "%.4g ms", sec * 1e3);
      return std::string(b);
    };
    p.choice = "per-rail schedules, slowest rail " + ms(mine_out) + " in " + std::to_string(most) + " stages";
    if (opt_.rails == rail_schedule::per_rail) return true;
    // Automatic: the shared stages of the same matrix (phase 1's M depends on each pair's total only).
    // No shared schedule of M beats the scale-out model's bound for it: every stage serves at most
    // one entry of a line, so there are at least as many stages as a line has entries, and their
    // weights sum to at least the line's sum. Where the per-rail plan, ends and all, is faster than
    // that, the shared stages are not made (the same choice, without a second decomposition).
    m_.setZero(S, S);
    line_.assign(4 * static_cast<std::size_t>(S), 0); // each row's and column's sum, then entries
    bytes_t* line = line_.data();
    for (int s = 0; s < S; ++s) // in memory order, as the rails' matrices above
      for (int d = 0; d < S; ++d) {
        const bytes_t v = pair_bytes_[static_cast<std::size_t>(s) * S + d];
        if (v == 0) continue;
        const bytes_t e = per_rail_bytes(v, G, opt_.granule);
        m_(s, d) = e;
        line[s] += e, line[S + d] += e, ++line[2 * S + s], ++line[3 * S + d];
      }
    const bytes_t most_bytes = *std::max_element(line, line + 2 * S), most_entries = *std::max_element(line + 2 * S, line + 4 * S);
    const double bound = net.phase_time(most_bytes, most_entries);
    if (mine < bound * (1 - 1e-9)) { // the margin: sums of doubles round
      p.choice += ", " + ms(mine) + " with its ends' scale-up; shared at least " + ms(bound) + " (" +
                  std::to_string(most_entries) + " stages or more, scale-out model): per-rail is faster";
      return true;
    }
    decompose(m_, stages_);
    const std::string shared_name = chosen();
    const double theirs_out = net.stages_time(stages_.weights), theirs = theirs_out + ends(stages_.weights);
    const std::string why = p.choice + ", " + ms(mine) + " with its ends' scale-up; shared " + shared_name + " " +
                            std::to_string(stages_.size()) + " stages " + ms(theirs_out) + ", " + ms(theirs) +
                            " with its ends' (scale-out model)";
    if (mine < theirs) {
      p.choice = why + ": per-rail is faster";
      return true;
    }
    p.decomposer = shared_name;
    p.choice = why + ": shared is faster";
    return false;
  }

  // The per-rail stage lists as the plan's stages: each rail's heaviest first, rail k's i-th in
  // stage i (rail_weight_, rail_perm_), and stages_ with each stage's heaviest rail and no
  // server-level permutation.
  void combine_rails() {
    const int S = topo_.servers(), G = gpus();
    std::size_t T = 0;
    for (const stage_list& list : rail_stages_) T = std::max(T, list.size());
    rail_weight_.assign(static_cast<std::size_t>(G) * T, 0);
    rail_perm_.assign(T * G * S, -1);
    for (int k = 0; k < G; ++k) {
      const stage_list& list = rail_stages_[static_cast<std::size_t>(k)];
      rank_order_.resize(list.size());
      for (std::size_t i = 0; i < list.size(); ++i) rank_order_[i] = static_cast<std::uint32_t>(i);
      std::stable_sort(rank_order_.begin(), rank_order_.end(),
                       [&](std::uint32_t a, std::uint32_t b) { return list.weights[a] > list.weights[b]; });
      for (std::size_t i = 0; i < list.size(); ++i) {
        const std::uint32_t from = rank_order_[i];
        rail_weight_[static_cast<std::size_t>(k) * T + i] = list.weights[from];
        std::int32_t* perm = rail_perm_.data() + (i * G + k) * S;
        const auto src = list.perm(from);
        for (int s = 0; s < S; ++s) perm[s] = src[s] == s ? -1 : src[s];
      }
    }
    stages_.reset(S);
    neg_.assign(static_cast<std::size_t>(S), -1);
    for (std::size_t i = 0; i < T; ++i) {
      bytes_t most = 0;
      for (int k = 0; k < G; ++k) most = std::max(most, rail_weight_[static_cast<std::size_t>(k) * T + i]);
      stages_.add(most, neg_);
    }
  }

  static bytes_t at(const traffic_view& t, rank_t i, rank_t j) noexcept {
    return t.data()[static_cast<std::size_t>(i) * static_cast<std::size_t>(t.outerStride()) + j];
  }

  // For every server pair (s, d), the stages in which s sends to d (CSR; a rank's view keeps only
  // the pairs that touch its server, the only ones it makes pieces of), and -1 in the plan's
  // permutation where a stage only carries padding for s.
  void index_pair_stages(plan& p) {
    const int S = p.servers;
    const std::size_t T = p.stages();
    begin_pair_index(p);
    for (std::size_t t = 0; t < T; ++t) {
      std::int32_t* perm = p.stage_perm.data() + t * S;
      for (int s = 0; s < S; ++s) {
        const int d = perm[s];
        if (d == s) perm[s] = -1;
        if (d == s || d < 0) continue;
        // Rails of (s, d) fill stages in order, so a stage that starts past M(s, d) is padding.
        stage_of_pair(p, perm[s], s, d, p.stage_weight[t], t);
      }
    }
    end_pair_index(p, nullptr);
  }

  // index_pair_stages for per-rail plans: a pair's stages are those of its rail in which its
  // source sends to its destination; any other rail's entry for the pair is padding.
  void index_rail_stages(plan& p) {
    const int S = p.servers, G = p.gpus_per_server;
    const std::size_t T = p.stages();
    begin_pair_index(p);
    for (std::size_t t = 0; t < T; ++t)
      for (int k = 0; k < G; ++k) {
        std::int32_t* perm = p.rail_perm.data() + (t * G + k) * S;
        const bytes_t w = p.rail_weight[static_cast<std::size_t>(k) * T + t];
        for (int s = 0; s < S; ++s) {
          const int d = perm[s];
          if (d < 0) continue;
          if (rail_of_[static_cast<std::size_t>(s) * S + d] != static_cast<std::uint32_t>(k)) {
            perm[s] = -1;
            continue;
          }
          stage_of_pair(p, perm[s], s, d, w, t); // padding past the pair's bytes
        }
      }
    end_pair_index(p, rail_of_.data());
  }

  // The pair index in one pass over the stages: stage_of_pair counts each pair's stages and keeps
  // them (those a view needs) in stage order, end_pair_index lays them out by pair.
  struct pair_hit {
    std::size_t pair;
    std::int32_t stage;
  };
  void begin_pair_index(const plan& p) {
    const std::size_t SS = static_cast<std::size_t>(p.servers) * p.servers;
    pair_first_.assign(SS + 1, 0);
    pair_weight_.assign(SS, 0);
    hits_.clear();
    index_home_ = p.view < 0 ? -1 : p.view / p.gpus_per_server;
  }
  FASTA2A_INLINE void stage_of_pair(const plan& p, std::int32_t& entry, int s, int d, bytes_t w, std::size_t t) {
    const std::size_t pr = static_cast<std::size_t>(s) * p.servers + d;
    if (pair_weight_[pr] >= m_(s, d)) entry = -1;
    pair_weight_[pr] += w;
    if (index_home_ < 0 || s == index_home_ || d == index_home_) {
      ++pair_first_[pr + 1];
      hits_.push_back({pr, static_cast<std::int32_t>(t)});
    }
  }
  void end_pair_index(const plan& p, const std::uint32_t* rail_of) {
    const int S = p.servers;
    for (std::size_t i = 1; i < pair_first_.size(); ++i) pair_first_[i] += pair_first_[i - 1];
    pair_stages_.resize(pair_first_.back());
    fill_.assign(pair_first_.begin(), pair_first_.end() - 1);
    for (const pair_hit& h : hits_) pair_stages_[fill_[h.pair]++] = h.stage;
    for (int s = 0; s < S; ++s)
      for (int d = 0; d < S; ++d) {
        const std::size_t pr = static_cast<std::size_t>(s) * S + d;
        if (s == d || !p.staged || pair_weight_[pr] >= m_(s, d)) continue;
        throw error(std::string("decomposer '") + dec_traits_.name + "' gave server pair (" + std::to_string(s) + ", " +
                    std::to_string(d) + ") " +
                    (rail_of ? "on rail " + std::to_string(rail_of[pr]) + " " : std::string()) +
                    std::to_string(pair_weight_[pr]) + (rail_of ? " bytes of stages" : " per-rail bytes of stages") +
                    "; it needs " + std::to_string(m_(s, d)));
      }
  }

  void open_message(plan& p, rank_t src, rank_t dst) {
    if (p.view >= 0) return;
    std::size_t m = static_cast<std::size_t>(src) * topo_.ranks() + dst;
    p.message_first[m] = static_cast<std::uint32_t>(p.pieces.size());
  }
  void close_message(plan& p, rank_t src, rank_t dst) {
    if (p.view >= 0) return;
    std::size_t m = static_cast<std::size_t>(src) * topo_.ranks() + dst;
    p.message_count[m] = static_cast<std::uint32_t>(p.pieces.size() - p.message_first[m]);
  }

  // Same-server traffic (self copies and direct scale-up), and every message of the direct
  // baseline: one piece each, no rail.
  void emit_unstaged_pair(const traffic_view& t, plan& p, int s, int d) {
    const int G = gpus();
    auto message = [&](int a, int b) FASTA2A_INLINE {
      const rank_t src = s * G + a, dst = d * G + b;
      const bytes_t v = at(t, src, dst);
      open_message(p, src, dst);
      if (v > 0) {
        piece pc{src, dst, 0, v, 0, -1, no_staging, no_staging};
        index_.add(pc);
        p.pieces.push_back(pc);
        if (s == d && a != b)
          p.scaleup_bytes = detail::checked_add(p.scaleup_bytes, v, "the plan's scale-up bytes");
      }
      close_message(p, src, dst);
    };
    if (p.view < 0) {
      for (int a = 0; a < G; ++a)
        for (int b = 0; b < G; ++b) message(a, b);
      return;
    }
    // A view's messages of the block, in the whole plan's order: its row where it sends (s is its
    // server), its column where it receives (d is).
    const int m = p.view % G;
    const bool sends = s == p.view / G, receives = d == p.view / G;
    for (int a = 0; a < G; ++a)
      if (sends && a == m)
        for (int b = 0; b < G; ++b) message(a, b);
      else if (receives)
        message(a, m);
  }

  // Phase 1 for server pair (s, d), then the pieces, each rail filling the pair's stages in order.
  void emit_pair(const traffic_view& t, plan& p, int s, int d) {
    const int G = gpus();
    const int S = p.servers;
    const std::size_t GG = static_cast<std::size_t>(G) * G;
    if (cap_.size() < static_cast<std::size_t>(G)) {
      cap_.resize(G);
      res_.resize(G);
      used_.resize(G);
      cursor_.resize(G);
      railpos_.resize(G);
      spilled_.resize(G);
      parent_.resize(G);
      fits_.resize(G);
      bfs_.resize(G);
    }
    if (y_.size() < GG) y_.resize(GG);
    const std::size_t ld = static_cast<std::size_t>(t.outerStride());
    const bytes_t* blk = t.data() + static_cast<std::size_t>(s * G) * ld + d * G;
    auto B = [&](int a, int b) { return blk[a * ld + b]; };

    const std::size_t pr = static_cast<std::size_t>(s) * S + d, slot = pair_slot(p, S, G, s, d);
    std::copy_n(caps_.data() + slot * G, G, cap_.data());

    // 1. A byte from GPU k to GPU k stays on rail k: no scale-up hop at all.
    bytes_t* __restrict res = res_.data();
    bytes_t* __restrict y = y_.data();
    for (int k = 0; k < G; ++k) res[k] = cap_[k] - std::min(B(k, k), cap_[k]);
    // A view walks only the messages that can give it pieces: those of its rail's row and column,
    // and those with bytes left for other rails (spills), which it marks here, by row: the
    // diagonal past its rail's capacity, and both messages of a pair that phase 1 cannot place.
    const std::size_t W = words();
    const bool view = p.view >= 0;
    if (view) {
      if (over_.size() < static_cast<std::size_t>(G) * W) over_.resize(static_cast<std::size_t>(G) * W);
      std::fill_n(over_.begin(), static_cast<std::size_t>(G) * W, 0);
      for (int k = 0; k < G; ++k)
        if (B(k, k) > cap_[k]) set_bit(over_, static_cast<std::size_t>(k), k);
    }
    // 2. A byte from GPU u to GPU v != u costs one hop on rail u or rail v, two elsewhere.
    //    Maximise the bytes placed on one of their own two rails: a max flow from the pair
    //    {u, v} to rails u and v, started greedily and finished with augmenting paths.
    //    A rail whose pairs' bytes all fit in it (its row and column of the block, the
    //    diagonal aside, at most its capacity left) can take every pair it is in: some max flow
    //    puts each such pair wholly there (moving a pair's bytes onto it never takes room another
    //    pair could use). So those pairs are placed at once (on the sender's rail when both rails
    //    can take them), and the flow is searched only among the rails that cannot: the
    //    augmenting search never reaches a rail that fits (no pair's bytes can move onto it from
    //    a rail that does not), so its bit sets are kept for the others only.
    bool all_fit = true;
    for (int k = 0; k < G; ++k) {
      bytes_t v = 0;
      for (int o = 0; o < G; ++o) v += B(k, o) + B(o, k);
      fits_[k] = v - 2 * B(k, k) <= res[k];
      all_fit &= fits_[k] != 0;
    }
    if (all_fit) { // every pair on its sender's rail
      for (int u = 0; u < G; ++u) {
        bytes_t out = 0;
        for (int w = 0; w < G; ++w) {
          y[u * G + w] = B(u, w);
          out += w == u ? 0 : B(u, w);
        }
        res[u] -= out;
      }
    } else {
      if (nz_.size() < static_cast<std::size_t>(G) * W) {
        nz_.resize(static_cast<std::size_t>(G) * W);
        room_.resize(W);
        seen_.resize(W);
      }
      std::fill_n(nz_.begin(), static_cast<std::size_t>(G) * W, 0);
      for (int u = 0; u < G; ++u) {
        // Rail u's room and, up to 64 rails, its row of nz_ stay in registers through its pairs,
        // written back before a search (which reads and changes them) and at the end: updated in
        // memory, every pair waited for the store of the pair before it.
        bytes_t ru = res[u];
        std::uint64_t nzu = 0;
        for (int w = u + 1; w < G; ++w) {
          const bytes_t uw = B(u, w), wu = B(w, u);
          if (fits_[u] || fits_[w]) {
            const bool both = fits_[u] && fits_[w];
            const bytes_t on_u = both ? uw : fits_[u] ? uw + wu : 0;
            y[u * G + w] = on_u;
            y[w * G + u] = uw + wu - on_u;
            ru -= on_u;
            res[w] -= uw + wu - on_u;
            continue;
          }
          // Each message on its sender's rail, then what is left of u -> w on w's rail and of the
          // pair on u's: four amounts x1 = min(uw, ru), x2 = min(wu, rw), x3 = min(uw + wu - x1
          // - x2, rw - x2), x4 = min(what is left, ru - x1), placed as two, which sum to the three
          // minima below (x2 + x3 = min(uw + wu - x1, rw), x1 + x4 = min(uw + wu - that, ru)):
          // fewer steps for rail u's room to wait on from one pair to the next. The pair's first
          // placement sets y(u, w) and y(w, u), and nz_ where they are not 0, without branches.
          const bytes_t sum = uw + wu, x1 = bmin(uw, ru);
          const bytes_t on_w = bmin(sum - x1, res[w]);
          const bytes_t on_u = bmin(sum - on_w, ru);
          bytes_t left = sum - on_w - on_u;
          y[u * G + w] = on_u;
          y[w * G + u] = on_w;
          ru -= on_u;
          res[w] -= on_w;
          const auto uu = static_cast<unsigned>(u), uv = static_cast<unsigned>(w);
          nz_[uv * W + uu / bits] |= static_cast<std::uint64_t>(on_w != 0) << (uu % bits);
          if (W == 1) nzu |= static_cast<std::uint64_t>(on_u != 0) << uv;
          else nz_[uu * W + uv / bits] |= static_cast<std::uint64_t>(on_u != 0) << (uv % bits);
          if (left > 0) {
            res[u] = ru;
            nz_[uu * W] |= std::exchange(nzu, 0); // 0 past one word
            augment(u, w, left, G);
            ru = res[u];
          }
          if (left > 0 && view) {
            set_bit(over_, static_cast<std::size_t>(u), w);
            set_bit(over_, static_cast<std::size_t>(w), u);
          }
        }
        res[u] = ru;
        nz_[static_cast<std::size_t>(u) * W] |= nzu;
      }
    }

    // Pieces, message by message; each rail's position advances through the pair's stages.
    pair_cursor c;
    c.stages = pair_stages_.data() + pair_first_[pr];
    c.nstages = pair_first_[pr + 1] - pair_first_[pr];
    c.weight = rails_ ? p.rail_weight.data() + static_cast<std::size_t>(rail_of_[pr]) * p.stages() : p.stage_weight.data();
    c.out_base = p.view < 0 ? layout_.out_base(pr * G) : view_out_.data() + slot * G;
    c.in_base = p.view < 0 ? layout_.in_base(pr * G) : view_in_.data() + slot * G;
    c.s = s;
    c.d = d;
    for (int k = 0; k < G; ++k) {
      cursor_[k] = 0;
      used_[k] = 0;
      railpos_[k] = 0;
    }
    // Rail a's bytes of message a -> b, and rail b's. Pair {a, b} holds y(a, b) bytes on rail a
    // and y(b, a) on rail b, for both directions: a -> b takes rail a first (the sender's own
    // NIC), and b -> a (which prefers rail b) gets the rest. The diagonal rides its own rail up to
    // its capacity.
    auto split = [&](int a, int b, bytes_t& mine_a, bytes_t& mine_b) FASTA2A_INLINE {
      const bytes_t v = B(a, b);
      if (a == b) {
        mine_a = std::min(v, cap_[a]);
        mine_b = 0;
      } else {
        const bytes_t on_a = y[a * G + b], on_b = y[b * G + a];
        mine_a = bmin(v, on_a);
        mine_b = bmin(v - mine_a, on_b - bmin(B(b, a), on_b));
      }
    };
    // Rails with capacity left take what did not fit on a message's own rails (two hops).
    int spill = 0;
    auto next_spill = [&](bytes_t left, int& k) FASTA2A_INLINE { // the rail and the bytes
      while (spill < G && res_[spill] == 0) ++spill;
      if (spill == G) pair_overflow(s, d);
      const bytes_t x = std::min(left, res_[spill]);
      res_[spill] -= x;
      k = spill;
      return x;
    };
    if (view) {
      emit_view_pair(p, c, B, split, next_spill);
      return;
    }
    for (int a = 0; a < G; ++a)
      for (int b = 0; b < G; ++b) {
        bytes_t mine_a, mine_b;
        split(a, b, mine_a, mine_b);
        bytes_t left = B(a, b) - mine_a - mine_b;
        const rank_t src = s * G + a, dst = d * G + b;
        bytes_t off = 0;
        open_message(p, src, dst);
        emit(p, c, src, dst, a, mine_a, off, true);
        if (a != b) emit(p, c, src, dst, b, mine_b, off, true);
        while (left > 0) {
          int k;
          const bytes_t x = next_spill(left, k);
          emit(p, c, src, dst, k, x, off, true);
          left -= x;
        }
        close_message(p, src, dst);
      }
  }

  // Where one server pair's rail streams are: the pair's stages, and its staging bases per rail.
  struct pair_cursor {
    const std::int32_t* stages;
    std::size_t nstages;
    const bytes_t* weight;
    const bytes_t* out_base;
    const bytes_t* in_base;
    int s, d;
  };

  // The pieces of `bytes` bytes of message src -> dst on rail k at the rail stream's current
  // position: rail k's stream fills the pair's stages in order, so byte position P of the stream
  // rides the stage whose cumulative weight range holds P. `mine`: the piece is src's or dst's
  // (its scale-up hops count toward the plan's scale-up bytes), not only its rail's.
  FASTA2A_INLINE void emit(plan& p, const pair_cursor& c, rank_t src, rank_t dst, int k, bytes_t bytes,
                           bytes_t& off, bool mine) {
    if (bytes == 0) return;
    const int G = gpus();
    const rank_t rs = c.s * G + k, rd = c.d * G + k;
    bytes_t pos = railpos_[k];
    const bytes_t end = pos + bytes;
    railpos_[k] = end;
    // A byte may take two scale-up hops, so this can pass 2^64 where the matrix did not.
    // One test for the piece's 0, 1 or 2 hops, the error out of line.
    if (mine) {
      const auto hops = static_cast<bytes_t>((src != rs) + (rd != dst));
      bytes_t add = 0, sum = 0;
      if (__builtin_mul_overflow(bytes, hops, &add) || __builtin_add_overflow(p.scaleup_bytes, add, &sum))
        scaleup_overflow();
      p.scaleup_bytes = sum;
    }
    // The cumulative weight through the rail's current stage, and the stage: in registers, written
    // back at the end (a piece's stores could alias them, so in memory each piece reloaded them).
    bytes_t cum = used_[k];
    std::size_t cursor = cursor_[k];
    while (pos < end) {
      while (cum <= pos) {
        if (cursor >= c.nstages) rail_overflow(k, c.s, c.d);
        cum += c.weight[c.stages[cursor++]];
      }
      const std::int32_t st = c.stages[cursor - 1];
      const bytes_t x = std::min(end, cum) - pos;
      piece pc{src, dst, off, x, st, k};
      if (ring_ == 0) {
        detail::staging_layout::place(pc, rs, rd, c.out_base[k], c.in_base[k], pos);
      } else { // slot st mod ring of each ring; the stream's bytes of stage st start the slot
        const bytes_t at = static_cast<bytes_t>(static_cast<std::uint32_t>(st) % ring_) * slot_ + pos - (cum - c.weight[st]);
        detail::staging_layout::place(pc, rs, rd, 0, static_cast<bytes_t>(ring_) * slot_, at);
      }
      index_.add(pc);
      if (p.pieces.size() == p.pieces.capacity()) [[unlikely]] grow_pieces(p);
      p.pieces.push_back(pc);
      pos += x;
      off += x;
    }
    used_[k] = cum;
    cursor_[k] = cursor;
  }

  // A rank's view of server pair (s, d), which touches its server: the pieces of its own messages
  // (its rail m's row of the block where it sends, rail m's column where it receives), and the
  // pieces on rail m (of that row and column, and spills). Only those messages are walked, with
  // the ones that spill (over_: spill rails are taken in message order), in the whole plan's
  // order. Every byte on rail m comes from a walked message, so rail m's stream advances as in
  // the whole plan. Another rail's position, needed only for the view's own messages, is what the
  // messages before put on it: their bytes on their own rails (`before`, from phase 1's y) and the
  // spills walked so far. A rail's positions still come in stream order, as emit's stage search
  // needs.
  template <class Block, class Split, class Spill>
  FASTA2A_INLINE void emit_view_pair(plan& p, const pair_cursor& c, const Block& B, const Split& split,
                                     Spill& next_spill) {
    const int G = gpus();
    const std::size_t W = words();
    const int m = p.view % G, s = c.s, d = c.d;
    const bool sends = s == p.view / G; // else it receives: the pair's destination is its server
    const bytes_t* y = y_.data();
    bytes_t* railpos = railpos_.data();
    bytes_t* spilled = spilled_.data(); // spills onto each rail so far
    std::fill_n(spilled, G, 0);
    // Rail k's position just before message a -> b, spills aside, from row k alone. Message k -> o
    // puts min(B(k, o), y(k, o)) on rail k (the diagonal: up to the capacity), and o -> k its second
    // share (split), which is the rest of y(k, o): a pair never has more bytes on its two rails
    // than it holds, y(k, o) + y(o, k) <= B(k, o) + B(o, k), and then the two shares sum to y(k, o).
    // So a pair whose two messages both come first adds y(k, o), and one whose o -> k alone does
    // adds y(k, o) less k -> o's share (the sum wraps, exactly, where that share comes later).
    auto before = [&](int k, int a, int b) FASTA2A_INLINE {
      const bytes_t* yk = y + static_cast<std::size_t>(k) * G;
      // k -> o comes first where o < ko_end, o -> k where o < ok_end; summed without branches.
      const int ko_end = k < a ? G : k == a ? b : 0, ok_end = a + (k < b);
      bytes_t pos = k < ko_end ? bmin(B(k, k), cap_[k]) : 0; // the diagonal
      for (int o = 0; o < G; ++o) {
        const bytes_t own = bmin(B(k, o), yk[o]);
        const bytes_t ko = -static_cast<bytes_t>(o < ko_end), ok = -static_cast<bytes_t>(o < ok_end);
        pos += o == k ? 0 : (ok & yk[o]) + (ko & own) - (ok & own);
      }
      return pos;
    };
    for (int a = 0; a < G; ++a)
      for (std::size_t w = 0; w < W; ++w) {
        // This row's messages to walk: rail m's row, rail m's column, and the spills; of the first
        // two only those with bytes (an empty message puts nothing on any rail). Sparse traffic
        // (a quarter of tiled Megatron's entries are 0) otherwise sends an empty message through
        // every test below, each one a branch the data decide.
        const int first = static_cast<int>(w) * bits, in_word = std::min(G - first, bits);
        std::uint64_t todo = over_[static_cast<std::size_t>(a) * W + w];
        if (a == m) { // every spill of this row is a message with bytes, so among these
          todo = 0;
          for (int i = 0; i < in_word; ++i) todo |= static_cast<std::uint64_t>(B(a, first + i) != 0) << i;
        } else if (m >= first && m < first + in_word) {
          todo |= static_cast<std::uint64_t>(B(a, m) != 0) << (m - first);
        }
        for (; todo != 0; todo &= todo - 1) {
          const int b = first + std::countr_zero(todo);
          bytes_t mine_a, mine_b;
          split(a, b, mine_a, mine_b);
          bytes_t left = B(a, b) - mine_a - mine_b;
          const rank_t src = s * G + a, dst = d * G + b;
          const bool mine = sends ? a == m : b == m;
          bytes_t off = 0;
          auto chunk = [&](int k, bytes_t bytes) FASTA2A_INLINE {
            if (k == m) emit(p, c, src, dst, k, bytes, off, mine);
            else if (mine && bytes > 0) {
              // No earlier chunk of this message is on rail k: its own rails come first, and a
              // spill rail is neither of them (their room is used up) nor taken twice.
              railpos[k] = before(k, a, b) + spilled[k];
              emit(p, c, src, dst, k, bytes, off, mine);
            } else off += bytes;
          };
          chunk(a, mine_a);
          if (a != b) chunk(b, mine_b);
          while (left > 0) {
            int k;
            const bytes_t x = next_spill(left, k);
            chunk(k, x);
            if (k != m) spilled[k] += x;
            left -= x;
          }
        }
      }
  }

  [[noreturn, gnu::cold, gnu::noinline]] static void rail_overflow(int k, int s, int d) {
    throw error("internal error: rail " + std::to_string(k) + " of server pair (" + std::to_string(s) + ", " +
                std::to_string(d) + ") ran out of stages");
  }
  [[noreturn, gnu::cold, gnu::noinline]] static void scaleup_overflow() {
    throw error("byte count overflows 64 bits: the plan's scale-up bytes"); // as detail::checked_add
  }
  [[noreturn, gnu::cold, gnu::noinline]] static void pair_overflow(int s, int d) {
    throw error("internal error: server pair (" + std::to_string(s) + ", " + std::to_string(d) +
                ") has more bytes than rail capacity");
  }

  // Phase 1's flow keeps, besides y and res, bit sets of G bits (W words each): nz_ row x has bit z
  // where y(x, z) > 0 (pair {x, z} has bytes on rail x that could move to rail z). Each search
  // makes the set of rails with capacity left (room_, or a register for 8 rails) from res: the
  // greedy placement changes res at every pair, and only a few pairs search. The augmenting search
  // then visits a rail's movable neighbours a word at a time instead of testing every rail.
  static constexpr int bits = 64;
  std::size_t words() const noexcept { return (static_cast<std::size_t>(gpus()) + bits - 1) / bits; }
  // (Rails are not negative: unsigned division by 64 is a shift, signed is not.)
  void set_bit(std::vector<std::uint64_t>& v, std::size_t row, int z) noexcept {
    const auto u = static_cast<unsigned>(z);
    v[row * words() + u / bits] |= std::uint64_t{1} << (u % bits);
  }
  void clear_bit(std::vector<std::uint64_t>& v, std::size_t row, int z) noexcept {
    const auto u = static_cast<unsigned>(z);
    v[row * words() + u / bits] &= ~(std::uint64_t{1} << (u % bits));
  }

  // The smaller of two byte counts without a branch: phase 1 compares bytes with room, which
  // goes either way with the data, and a compiler may branch on std::min.
  static FASTA2A_INLINE bytes_t bmin(bytes_t a, bytes_t b) noexcept {
    return b ^ ((a ^ b) & -static_cast<bytes_t>(a < b));
  }

  // Augmenting paths over rails for `left` bytes of pair {u, w} whose own rails are full: shift
  // bytes of other pairs off a full rail onto their other rail until one with room is reached.
  // Breadth-first from {u, w}, neighbours in increasing rail order.
  void augment(int u, int w, bytes_t& left, int G) {
    if constexpr (static_gpus_v<Topo> > 0 && static_gpus_v<Topo> <= 8) {
      augment_small(u, w, left, G);
      return;
    }
    const std::size_t W = words();
    while (left > 0) {
      std::fill(room_.begin(), room_.end(), 0);
      for (int k = 0; k < G; ++k)
        if (res_[k] > 0) set_bit(room_, 0, k);
      std::fill(seen_.begin(), seen_.end(), 0);
      set_bit(seen_, 0, u);
      set_bit(seen_, 0, w);
      parent_[u] = parent_[w] = -1;
      int head = 0, tail = 0, found = -1;
      bfs_[tail++] = u;
      bfs_[tail++] = w;
      while (head < tail && found < 0) {
        const int x = bfs_[head++];
        for (std::size_t k = 0; k < W && found < 0; ++k) {
          std::uint64_t next = nz_[static_cast<std::size_t>(x) * W + k] & ~seen_[k];
          if (const std::uint64_t hit = next & room_[k]) {
            found = static_cast<int>(k) * bits + std::countr_zero(hit);
            parent_[found] = x;
            break;
          }
          seen_[k] |= next;
          for (; next != 0; next &= next - 1) {
            const int z = static_cast<int>(k) * bits + std::countr_zero(next);
            parent_[z] = x;
            bfs_[tail++] = z;
          }
        }
      }
      if (found < 0) return; // the rest must ride rails that cost two hops
      bytes_t amt = std::min(left, res_[found]);
      int start = found;
      for (int z = found; parent_[z] >= 0; z = parent_[z]) {
        amt = std::min(amt, y_[parent_[z] * G + z]);
        start = parent_[z];
      }
      for (int z = found; parent_[z] >= 0; z = parent_[z]) {
        const int x = parent_[z];
        if ((y_[x * G + z] -= amt) == 0) clear_bit(nz_, static_cast<std::size_t>(x), z);
        y_[z * G + x] += amt;
        set_bit(nz_, static_cast<std::size_t>(z), x);
      }
      res_[found] -= amt;
      const int other = start == u ? w : u;
      y_[start * G + other] += amt;
      set_bit(nz_, static_cast<std::size_t>(start), other);
      left -= amt;
    }
  }

  // The rails of an 8-bit set in increasing order, 8 to an entry (the unused ones 0; `count` says
  // how many are used: without -mpopcnt, std::popcount is a library call): a breadth-first step
  // appends a rail's new neighbours with one copy instead of a loop over its bits, which
  // mispredicts where the neighbour count varies with the data.
  struct bit_list {
    std::uint8_t rail[256][8];
    std::uint8_t count[256];
    constexpr bit_list() : rail{}, count{} {
      for (int m = 0; m < 256; ++m)
        for (int b = 0; b < 8; ++b)
          if (m >> b & 1) rail[m][count[m]++] = static_cast<std::uint8_t>(b);
    }
  };
  static constexpr bit_list rails_of_{};
  // augment for at most 8 rails (one word of bits), with the same search and the same paths: the
  // queue holds each visited rail with the queue position of the rail it was reached from, so the
  // path is walked back through positions, and a rail's new neighbours are appended at once.
  FASTA2A_INLINE void augment_small(int u, int w, bytes_t& left, int G) {
    std::uint8_t q[24], from[24]; // every rail is queued at most once; a step writes 8 past tail
    while (left > 0) {
      std::uint64_t room = 0; // the rails with room left
      for (int k = 0; k < G; ++k) room |= static_cast<std::uint64_t>(res_[k] != 0) << k;
      std::uint64_t seen = (std::uint64_t{1} << u) | (std::uint64_t{1} << w);
      q[0] = static_cast<std::uint8_t>(u);
      q[1] = static_cast<std::uint8_t>(w);
      int head = 0, tail = 2, found = -1;
      for (; head < tail; ++head) {
        const int x = q[head];
        const std::uint64_t next = nz_[static_cast<std::size_t>(x)] & ~seen;
        if (const std::uint64_t hit = next & room) {
          found = std::countr_zero(hit);
          break;
        }
        seen |= next;
        std::memcpy(q + tail, rails_of_.rail[next], 8);
        std::memset(from + tail, head, 8);
        tail += rails_of_.count[next];
      }
      if (found < 0) return; // the rest must ride rails that cost two hops
      // The path found <- q[head] <- q[from[head]] <- ... <- q[0] or q[1] (u or w).
      bytes_t amt = std::min(left, res_[found]);
      for (int z = found, at = head;; z = q[at], at = from[at]) {
        amt = std::min(amt, y_[q[at] * G + z]);
        if (at < 2) break;
      }
      int start = u;
      for (int z = found, at = head;; z = q[at], at = from[at]) {
        const int x = q[at];
        if ((y_[x * G + z] -= amt) == 0) clear_bit(nz_, static_cast<std::size_t>(x), z);
        y_[z * G + x] += amt;
        set_bit(nz_, static_cast<std::size_t>(z), x);
        if (at < 2) {
          start = x;
          break;
        }
      }
      res_[found] -= amt;
      const int other = start == u ? w : u;
      y_[start * G + other] += amt;
      set_bit(nz_, static_cast<std::size_t>(start), other);
      left -= amt;
    }
  }

  Topo topo_;
  plan_options opt_;
  decomposer_traits dec_traits_;
  server_matrix m_;
  stage_list stages_, split_;
  std::uint32_t ring_ = 0; // plan::staging_ring and staging_slot of the plan being made
  // Per-rail schedules (plan_options::rails): whether the plan being made has them, each pair's
  // rail and bytes, each rail's matrix and stages, and the plan's rail arrays.
  bool rails_ = false;
  bool last_view_ = false, last_staged_ = false; // of the last plan made (balance_bytes)
  std::vector<std::uint32_t> rail_of_;
  std::vector<bytes_t> pair_bytes_, load_out_, load_in_, line_, rail_weight_;
  std::vector<detail::valued_pair> order_, sort_tmp_; // pairs with bytes, largest first (choose_rails)
  std::vector<std::uint32_t> rank_order_;
  std::vector<std::size_t> sort_count_;
  std::vector<server_matrix> rail_m_;
  std::vector<stage_list> rail_stages_;
  std::vector<std::int32_t> rail_perm_, neg_;
  bytes_t slot_ = 0;
  std::vector<std::size_t> pair_first_, fill_;
  std::vector<std::int32_t> pair_stages_;
  std::vector<bytes_t> pair_weight_;
  std::vector<pair_hit> hits_; // the pair index being built
  int index_home_ = -1;
  std::vector<bytes_t> cap_, res_, y_, used_, railpos_, spilled_;
  std::vector<bytes_t> caps_;                       // servers x servers x G: rail capacities (a view: pair_slot)
  detail::staging_layout layout_;                   // a whole plan's staging bases
  std::vector<bytes_t> other_caps_, view_out_, view_in_, out_sum_, in_sum_; // a view's (rail_layout)
  std::vector<bytes_t> nic_;                        // per rank: inter-server bytes out, then in
  std::vector<std::size_t> cursor_;
  std::vector<int> parent_, bfs_;
  std::vector<std::uint64_t> nz_, room_, seen_;     // phase 1's bit sets (augment)
  std::vector<std::uint64_t> over_;                 // a view's messages with bytes to spill, by row
  std::vector<char> fits_;                          // phase 1: rails that can take all their pairs
  detail::index_builder<static_gpus_v<Topo>> index_;
};

/// Builds plans for one topology with one decomposer. Keep a planner and call `make_into` with the
/// same plan object every iteration: its storage and the planner's scratch are reused.
template <Topology Topo, Decomposer D = birkhoff_decomposer>
class planner final : public planner_core<Topo> {
public:
  explicit planner(Topo topo, plan_options opt = {}, D dec = D())
      : planner_core<Topo>(std::move(topo), opt, decomposer_traits::of<D>()), dec_(std::move(dec)) {}

private:
  void decompose(const server_matrix& m, stage_list& out) override { dec_.decompose(m, out); }
  std::string chosen() const override {
    if constexpr (requires { dec_.chosen(); }) return dec_.chosen();
    else return D::name;
  }
  std::string reason() const override {
    if constexpr (requires { dec_.reason(); }) return dec_.reason();
    else return {};
  }

  D dec_;
};

/// Plans traffic matrix t on topology topo with decomposer D (exact Birkhoff by default).
template <Decomposer D = birkhoff_decomposer, Topology Topo>
plan make_plan(const Topo& topo, const traffic_matrix& t, plan_options opt = {}) {
  return planner<Topo, D>(topo, opt).make(t);
}

} // namespace fasta2a
