// fasta2a: a decomposer with the fewest stages any schedule can have (or a few more where the
// scale-out model predicts that faster), each pair served whole.
//
// Where every server pair carries traffic, no schedule has fewer than S - 1 stages (a stage serves
// at most one peer of each server), so at a large alpha per stage the scale-out time is bounded by
// LB_alpha = L / b_out + (S - 1) alpha. The exact decomposers reach L but with many more stages;
// spread-out has S - 1 stages but weights set by fixed cyclic shifts. factorized_decomposer also
// has D stages (D: the most non-zeros in one row or column of M, S - 1 for a full matrix) but
// chooses which pairs share a stage so that the sum of the stages' largest entries is small: the
// weight of a stage is its largest entry, so pairs of similar size should share stages.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "fasta2a/common.hpp"
#include "fasta2a/decompose.hpp"

namespace fasta2a {

/// A proper edge colouring of M's non-zeros with D colours (a stage per colour), chosen so that
/// the sum of the stages' largest entries is small.
///
/// 1. Greedy, largest entries first: each entry goes to the first (heaviest) open stage in which
///    both its servers are free, so the large entries gather in the first stages. Where no open
///    stage is free at both ends, either a new stage is opened (its weight becomes this entry) or
///    an alternating path of two open stages a, b (a free at the sender, b at the receiver) is
///    swapped so that a becomes free at both (a Kempe swap, as in the proof of Koenig's edge
///    colouring theorem): whichever raises the sum of weights less (a swap may move an entry into
///    a lighter stage). Koenig's theorem guarantees D colours suffice: when all D stages are open
///    a swap always exists.
/// 2. Local search: for each stage (those whose largest entry stands furthest above their second
///    first, then the heaviest), its largest entry is moved to another stage b by swapping the
///    alternating cycle of the two stages through it, where that lowers the sum of the two
///    stages' weights most; repeated until no move helps or a work budget is spent (about
///    local_search_work steps of cycle walking per call). Walks that cannot beat the best move
///    found stop early, and pairs of stages unchanged since a fruitless scan are not walked again.
///
/// Promises: each stage a partial permutation (-1: idle); every pair (s, d) with M(s, d) > 0 is
/// served by exactly one stage, whose weight (its largest entry) is at least M(s, d) (in split
/// mode, below: by one or more stages, whose weights sum to at least M(s, d)); from D to D + spare
/// stages (exactly D with spare = 0), heaviest first; the same matrix and model give the same
/// stages (no randomness; ties broken by index). Not exact: the weights sum to at least L, and
/// (outside split mode) to at least the "unsplit bound" (the sum over k of the largest k-th entry
/// of any line). Cost: a radix sort of the S^2 entries (packed
/// 64-bit keys: value above pair), O(S / 64) words per entry placed (bit rows of free stages), plus
/// the swaps and the capped local search, for each colouring made (below); measured in
/// bench_stages --lb-alpha. Scratch (about 56 bytes per server pair) is reused across calls.
///
/// Spare colours (issue 13): the same colouring is also run with extra_stages more colours than D
/// (the greedy opens one only where every Kempe swap would raise the weights by more than the
/// entry: no pair is split, each stays in one stage). The spare stages give the greedy and the
/// local search room that a colouring with exactly D stages (a 1-factorisation, where every pair
/// of a full matrix carries traffic) does not have; on tiled Megatron (bench_stages --lb-alpha)
/// that lowers the weights by more than the extra stages' alpha: 1.112 -> 1.093 of LB_alpha at
/// 320 GPUs, 1.069 -> 1.049 at 4096. It can also be worse (1.048 -> 1.051 at 1024), so where
/// S <= compare_servers both colourings are made and the one the scale-out model (the
/// constructor's: alpha per stage and NIC bandwidth) predicts faster is kept, the D-colour one on a
/// tie: the result is then never slower in the model than the D-colour colouring, at twice the
/// cost, except where the D-colour colouring's weights already sum to the unsplit bound's envelope
/// (envelope_total): no colouring with spare colours can then be faster, so it is not made (the
/// same result at the cost of one colouring; on the 8-server rows of bench_stages --lb-alpha
/// every workload is such a matrix). Above compare_servers (where one colouring costs 10-20 ms)
/// only the spare-colour one is made, so that the cost stays that of one colouring: it may then
/// be slower in the model than the D-colour colouring would have been (by at most extra_stages
/// alpha where the weights gain nothing, as with tiny messages).
class factorized_decomposer {
public:
  static constexpr const char* name = "factorized";
  static constexpr bool staged = true;
  static constexpr bool exact = false;
  /// The sort keys and the radix sort's buffer (16 bytes), the stage of each pair in both
  /// directions (8) and by pair (4), its value by stage (8), the stages' sorted entries (16)
  /// (planner_scratch_bytes), and in split mode the stages serving each pair (2).
  static constexpr std::size_t scratch_bytes_per_server_pair = 58;
  /// Colours beyond D that the spare-colour colouring may open by default (measured on the lb-alpha grid:
  /// 1 to 4 gain about as much at 320 GPUs, 4 most at 4096, 8 less).
  static constexpr int extra_stages = 4;
  /// Up to this many servers both colourings are made and the faster in the model kept.
  static constexpr int compare_servers = 256;

  /// Compares colourings in scale-out model `net` (the topology's: scaleout_of; default: 10 us per
  /// stage, 50 GB/s), the second with `spare` colours beyond D (0: the D-colour colouring alone,
  /// exactly D stages, as before issue 13). Throws fasta2a::error unless the model's alpha >= 0 and
  /// its bandwidth > 0, both finite, and 0 <= spare <= 64.
  /// `skip_when_tight` (default on) skips the spare-colour colouring where the D-colour one's
  /// weights already sum to the unsplit bound's envelope (envelope_total): the spare one cannot be
  /// faster there, so the result is the same, at the cost of one colouring; likewise the local
  /// search where the greedy colouring already reaches the envelope (no move can gain). Off: both
  /// colourings are always made up to compare_servers, each with its local search (for tests that
  /// check the skips change nothing).
  explicit factorized_decomposer(scaleout_model net = {}, int spare = extra_stages, bool skip_when_tight = true)
      : net_(net), spare_(spare), skip_when_tight_(skip_when_tight) {
    net_.check("factorized_decomposer");
    if (spare < 0 || spare > 64) throw error("factorized_decomposer: spare colours must be in [0, 64]");
  }
  /// Split mode (off by default; the registry's "best" turns it on for its factorized member):
  /// after each colouring, a pass that splits pairs into idle slots (split_pass below), so a pair
  /// may then be served in several stages, its bytes in pieces that sum to M(s, d), each stage
  /// weighing its largest piece. Only moves that lower the sum of the weights are made, the stage
  /// count is unchanged, so the result is never slower in the model than without it. In split
  /// mode the spare-colour colouring is skipped only where the D-colour one's weights sum to L
  /// (a split schedule can go below the envelope, never below L).
  factorized_decomposer& split_pairs(bool on) noexcept {
    split_ = on;
    return *this;
  }
  /// Whether split mode is on.
  bool splits_pairs() const noexcept { return split_; }
  /// The model the colourings are compared in.
  const scaleout_model& model() const noexcept { return net_; }
  /// Colours beyond D of the second colouring.
  int spare() const noexcept { return spare_; }
  /// What configures it, folded into one word: ranks whose engines compare digests must agree on it.
  std::uint64_t digest() const noexcept {
    const std::uint64_t d = detail::fold_words({std::bit_cast<std::uint64_t>(net_.alpha_s),
                                                std::bit_cast<std::uint64_t>(net_.bandwidth),
                                                static_cast<std::uint64_t>(spare_)});
    return split_ ? detail::fold_words({d, 0x5b1175u}) : d;
  }
  /// Cycle-walking steps the local search may take per call: local_search_work / S, so the
  /// search is thorough where the greedy colouring is cheap (2^20 steps at S = 128) and short
  /// where it is not (2^18 at S = 512). Measured: 10-20 ns a step.
  static constexpr std::size_t local_search_work = std::size_t{1} << 27;

  void decompose(const server_matrix& m, stage_list& out) {
    n_ = static_cast<int>(m.rows());
    out.reset(n_);
    if (n_ == 0) return;
    m_ = &m;
    envelope_known_ = false;
    if (spare_ == 0) {
      run(0, out);
      return;
    }
    const bool both = n_ <= compare_servers;
    if (both) {
      // The D-colour colouring first: if it exceeds the size limit, the other (no fewer stages) does too.
      plain_.max_bytes = out.max_bytes;
      plain_.extra_bytes_per_stage = out.extra_bytes_per_stage;
      plain_.reset(n_);
      run(0, plain_);
      // The D-colour colouring's weights reach the unsplit bound's envelope: the spare-colour
      // colouring (at least D stages, weights at least the envelope) cannot be faster, and a tie
      // keeps the D-colour one.
      // In split mode the envelope does not bound the other colouring (its pieces may be split),
      // but L, the largest line sum, bounds every schedule's weights, and every schedule has at
      // least D stages.
      if (skip_when_tight_ && k_ > 0 && weights_sum(plain_) == (split_ ? max_line_sum(*m_) : envelope()))
        return keep_plain(out);
    }
    bool fits = true;
    try {
      run(spare_, out);
    } catch (const plan_too_large&) {
      if (!both) throw;
      fits = false;
    }
    if (both && (!fits || net_.stages_time(plain_.weights) <= net_.stages_time(out.weights))) keep_plain(out);
  }

  /// The unsplit bound's envelope of the last matrix decomposed: the sum over k of the largest
  /// k-th largest entry of any line (row or column). The k-th heaviest stage of a schedule that
  /// serves each pair in one stage weighs at least the k-th largest entry of every line (a line's
  /// k largest entries lie in k distinct stages), so the weights of any such schedule sum to at
  /// least this. From the entries already sorted for the colouring: O(non-zeros).
  bytes_t envelope_total() {
    if (n_ == 0 || k_ == 0) return 0;
    row_rank_.assign(n_, 0);
    col_rank_.assign(n_, 0);
    bytes_t total = 0;
    int reached = 0; // ranks whose largest entry is known: entries come largest first
    for (const std::uint64_t key : keys_) {
      const int r = std::max(row_rank_[key_row(key)]++, col_rank_[key_col(key)]++);
      if (r == reached) {
        total += key_value(key);
        ++reached;
      }
    }
    return total;
  }

private:
  // Gains and rises of the weights in bytes: differences of sums of up to four entries, each up
  // to 2^64 - 1, so signed 128 bits (entries near 2^63 overflowed 64 bits: found by fuzz_planner).
  __extension__ typedef __int128 gain_t;

  // envelope_total() of the matrix being decomposed, computed once per call (both colourings sort
  // the same entries).
  bytes_t envelope() {
    if (!envelope_known_) envelope_ = envelope_total(), envelope_known_ = true;
    return envelope_;
  }

  // The result is the D-colour colouring.
  void keep_plain(stage_list& out) {
    out.reset(n_);
    out.weights.swap(plain_.weights);
    out.perms.swap(plain_.perms);
  }

  static bytes_t weights_sum(std::span<const bytes_t> w) noexcept {
    bytes_t t = 0;
    for (bytes_t x : w) t += x;
    return t;
  }
  static bytes_t weights_sum(const stage_list& l) noexcept { return weights_sum(l.weights); }

  void run(int extra, stage_list& out) {
    colour(*m_, extra);
    if (k_ == 0) return;
    improve();
    if (split_ && n_ <= compare_servers) split_pass();
    emit(out);
  }

  // Split mode: lowers a stage a to the level h of one of its next-largest pieces, moving each
  // larger piece's excess (piece - h) of pair (s, d) to another stage b where the pair already has
  // a piece or where s and d are both idle (an idle slot: only a colouring with more than D stages,
  // or a sparse matrix, has them), choosing for each piece the b whose weight rises least (first
  // such b by index); the level (among a's split_levels next-largest pieces) where the drop of w_a
  // exceeds the rises by most is taken, if any. Stages are visited in index order, repeatedly,
  // until a round moves nothing or split_rounds rounds. Each move lowers the sum of the weights by
  // at least one byte and leaves every pair's pieces summing to M(s, d), each stage a partial
  // permutation (pieces of one stage never share a row or column, so two of them never compete for
  // the same idle slot). Cost: up to split_levels^2 / 2 scans of the stages per stage and round;
  // a piece whose row or column has no idle slot, and that has no other piece, is not scanned.
  // Made only up to compare_servers servers (measured: 12.6 -> 25 ms at 512 servers on tiled
  // Megatron for 1.0494 -> 1.0488 of LB_alpha).
  static constexpr int split_levels = 10;
  static constexpr int split_rounds = 32;

  void split_pass() {
    const std::size_t n = static_cast<std::size_t>(n_);
    pieces_.assign(n * n, 0);
    int live = 0; // stages opened (a spare colour never used weighs 0 and is no stage)
    for (int c = 0; c < k_; ++c) live += w_[c] > 0;
    row_idle_.assign(n_, live);
    col_idle_.assign(n_, live);
    bool any_idle = false;
    for (int c = 0; c < k_; ++c)
      for (int s = 0; s < n_ && w_[c] > 0; ++s)
        if (const int d = rc(s, c); d != none) {
          ++pieces_[s * n + d];
          --row_idle_[s];
          --col_idle_[d];
        }
    for (int s = 0; s < n_ && !any_idle; ++s) any_idle = row_idle_[s] > 0;
    if (!any_idle) return;
    for (int round = 0; round < split_rounds; ++round) {
      bool moved = false;
      for (int a = 0; a < k_; ++a) {
        if (w_[a] == 0) continue;
        tops_.clear();
        for (int s = 0; s < n_; ++s)
          if (rc(s, a) != none) tops_.push_back({rv(s, a), s});
        const std::size_t keep = std::min<std::size_t>(tops_.size(), split_levels + 1);
        std::partial_sort(tops_.begin(), tops_.begin() + static_cast<std::ptrdiff_t>(keep), tops_.end(),
                          [](const ranked& x, const ranked& y) { return x.value != y.value ? x.value > y.value : x.row < y.row; });
        gain_t best_gain = 0;
        int best_cut = 0;
        for (std::size_t k = 1; k < keep; ++k) {
          if (tops_[k].value == tops_[k - 1].value) continue; // this level was tried at its first piece
          const bytes_t h = tops_[k].value;
          const bytes_t rise = split_to(a, static_cast<int>(k), h, false);
          if (rise == ~bytes_t{0}) break; // a piece that cannot move: no lower level can either
          const gain_t gain = gain_t{w_[a]} - h - rise;
          if (gain > best_gain) {
            best_gain = gain;
            best_cut = static_cast<int>(k);
          }
        }
        if (best_cut > 0) {
          split_to(a, best_cut, tops_[best_cut].value, true);
          moved = true;
        }
      }
      if (!moved) break;
    }
  }

  // The rise of the other stages' weights if a's `cut` largest pieces (tops_) are cut to h, each
  // excess placed where it raises a weight least; ~0 where some piece has nowhere to go. With
  // `apply`, makes those moves.
  bytes_t split_to(int a, int cut, bytes_t h, bool apply) {
    raised_.clear();
    auto weight = [&](int b) {
      for (const auto& [c, w] : raised_)
        if (c == b) return w;
      return w_[b];
    };
    bytes_t rise = 0;
    const std::size_t n = static_cast<std::size_t>(n_);
    for (int i = 0; i < cut; ++i) {
      const int s = tops_[i].row, d = rc(s, a);
      const bytes_t ex = tops_[i].value - h;
      const bool alone = pieces_[s * n + d] == 1;
      if (alone && (row_idle_[s] == 0 || col_idle_[d] == 0)) return ~bytes_t{0};
      int best_b = none;
      bytes_t best_up = ~bytes_t{0}, best_cur = 0;
      for (int b = 0; b < k_; ++b) {
        if (b == a || w_[b] == 0) continue; // an unopened colour would cost a stage
        bytes_t cur = 0;
        if (const int db = rc(s, b); db == d) cur = rv(s, b);
        else if (db != none || cc(d, b) != none) continue;
        const bytes_t wb = weight(b);
        const bytes_t up = cur + ex > wb ? cur + ex - wb : 0;
        if (up < best_up) {
          best_up = up;
          best_b = b;
          best_cur = cur;
          if (up == 0) break;
        }
      }
      if (best_b == none) return ~bytes_t{0};
      rise += best_up;
      if (best_up > 0) {
        bool found = false;
        for (auto& [c, w] : raised_)
          if (c == best_b) w = best_cur + ex, found = true;
        if (!found) raised_.push_back({best_b, best_cur + ex});
      }
      if (apply) {
        rv(s, a) = h;
        if (best_cur > 0) {
          rv(s, best_b) = best_cur + ex;
          w_[best_b] = std::max(w_[best_b], best_cur + ex);
        } else {
          put(s, d, best_b, ex);
          ++pieces_[s * n + d];
          --row_idle_[s];
          --col_idle_[d];
        }
      }
    }
    if (apply) w_[a] = h;
    return rise;
  }

  static constexpr int none = -1;

  bytes_t val(int s, int d) const noexcept { return (*m_)(s, d); }
  // Stage-major: a walk along two stages' alternating path stays within two rows of each.
  int& rc(int s, int c) noexcept { return rc_[static_cast<std::size_t>(c) * n_ + s]; }
  int& cc(int d, int c) noexcept { return cc_[static_cast<std::size_t>(c) * n_ + d]; }
  // The value of row s's entry in stage c (stale where s is idle in c).
  bytes_t& rv(int s, int c) noexcept { return rv_[static_cast<std::size_t>(c) * n_ + s]; }
  std::uint64_t* row_free(int s) noexcept { return &row_free_[static_cast<std::size_t>(s) * words_]; }
  std::uint64_t* col_free(int d) noexcept { return &col_free_[static_cast<std::size_t>(d) * words_]; }
  static void set_bit(std::uint64_t* w, int c, bool on) noexcept {
    const std::uint64_t bit = std::uint64_t{1} << (c % 64);
    if (on) w[c / 64] |= bit;
    else w[c / 64] &= ~bit;
  }
  static bool bit(const std::uint64_t* w, int c) noexcept { return (w[c / 64] >> (c % 64)) & 1; }

  void put(int s, int d, int c, bytes_t v) {
    rc(s, c) = d;
    rv(s, c) = v;
    cc(d, c) = s;
    set_bit(row_free(s), c, false);
    set_bit(col_free(d), c, false);
    w_[c] = std::max(w_[c], v);
  }
  void take(int s, int d, int c) {
    rc(s, c) = none;
    cc(d, c) = none;
    set_bit(row_free(s), c, true);
    set_bit(col_free(d), c, true);
  }

  // Phase 1: the greedy colouring with Kempe swaps, with `extra` colours beyond D.
  void colour(const server_matrix& m, int extra) {
    k_ = 0;
    std::vector<int>& deg = queue_; // scratch: column degrees
    deg.assign(n_, 0);
    d_bits_ = 0;
    while ((1 << d_bits_) < n_) ++d_bits_;
    keys_.resize(static_cast<std::size_t>(n_) * n_);
    std::size_t nz = 0;
    bytes_t lo = ~bytes_t{0}, hi = 0;
    for (int s = 0; s < n_; ++s) {
      int row = 0;
      const std::uint64_t base = static_cast<std::uint64_t>(s) << d_bits_;
      for (int d = 0; d < n_; ++d)
        if (const bytes_t v = m(s, d); v > 0 && s != d) {
          keys_[nz++] = base | static_cast<std::uint64_t>(d);
          lo = std::min(lo, v);
          hi = std::max(hi, v);
          ++row;
          ++deg[d];
        }
      k_ = std::max(k_, row);
    }
    keys_.resize(nz);
    for (int d = 0; d < n_; ++d) k_ = std::max(k_, deg[d]);
    if (k_ == 0) return;
    k_ += extra;
    sort_entries(lo, hi);
    const std::size_t n = static_cast<std::size_t>(n_);
    words_ = (static_cast<std::size_t>(k_) + 63) / 64;
    rc_.assign(n * k_, none);
    cc_.assign(n * k_, none);
    rv_.resize(n * k_);
    row_free_.resize(n * words_);
    for (std::size_t wd = 0; wd < words_; ++wd) {
      const int left = k_ - static_cast<int>(wd * 64);
      row_free_[wd] = left >= 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << left) - 1;
    }
    for (std::size_t i = 1; i < n; ++i)
      std::copy_n(row_free_.begin(), words_, row_free_.begin() + static_cast<std::ptrdiff_t>(i * words_));
    col_free_ = row_free_;
    w_.assign(k_, 0);
    open_ = 0;
    for (const std::uint64_t key : keys_) place(key_row(key), key_col(key), key_value(key));
  }

  // A key: the pair (s << d_bits_ | d) in its low pair_bits_ bits, (hi_ - value) above them where
  // they fit 64 bits together (packed_), else the pair alone.
  int key_row(std::uint64_t key) const noexcept { return static_cast<int>((key & pair_mask_) >> d_bits_); }
  int key_col(std::uint64_t key) const noexcept {
    return static_cast<int>(key & ((std::uint64_t{1} << d_bits_) - 1));
  }
  bytes_t key_value(std::uint64_t key) const noexcept {
    return packed_ ? hi_ - static_cast<bytes_t>(key >> pair_bits_) : val(key_row(key), key_col(key));
  }

  // Orders keys_ (pairs, ascending) by value, largest first, ties by pair: a stable
  // least-significant-digit radix sort over the bits of hi - value that vary keeps equal values in
  // pair order. Where value and pair do not fit 64 bits together, a comparison sort does the same.
  void sort_entries(bytes_t lo, bytes_t hi) {
    pair_bits_ = 2 * d_bits_;
    int value_bits = 0;
    while (value_bits < 64 && ((hi - lo) >> value_bits) != 0) ++value_bits;
    hi_ = hi;
    packed_ = pair_bits_ + value_bits <= 64;
    pair_mask_ = pair_bits_ >= 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << pair_bits_) - 1;
    if (!packed_) {
      std::sort(keys_.begin(), keys_.end(), [&](std::uint64_t x, std::uint64_t y) {
        const bytes_t vx = key_value(x), vy = key_value(y);
        return vx != vy ? vx > vy : x < y;
      });
      return;
    }
    for (std::uint64_t& key : keys_)
      key |= value_bits == 0 ? 0 : static_cast<std::uint64_t>(hi - val(key_row(key), key_col(key))) << pair_bits_;
    if (keys_.size() < 1024) { // a radix pass's counts cost more than a small sort
      std::sort(keys_.begin(), keys_.end());
      return;
    }
    constexpr int digit = 11;
    constexpr std::size_t buckets = std::size_t{1} << digit;
    tmp_.resize(keys_.size());
    for (int shift = pair_bits_; shift < pair_bits_ + value_bits; shift += digit) {
      count_.assign(buckets, 0);
      for (const std::uint64_t key : keys_) ++count_[(key >> shift) & (buckets - 1)];
      std::size_t at = 0;
      for (std::size_t& c : count_) at += std::exchange(c, at);
      for (const std::uint64_t key : keys_) tmp_[count_[(key >> shift) & (buckets - 1)]++] = key;
      keys_.swap(tmp_);
    }
  }

  void place(int s, int d, bytes_t v) {
    const std::uint64_t* fs = row_free(s);
    const std::uint64_t* fd = col_free(d);
    // The first open stage free at both ends: no cost (every open stage weighs at least v).
    for (std::size_t wd = 0; wd < words_; ++wd)
      if (std::uint64_t both = fs[wd] & fd[wd]; both != 0) {
        const int c = static_cast<int>(wd * 64) + __builtin_ctzll(both);
        if (c >= open_) break;
        put(s, d, c, v);
        return;
      }
    // Otherwise a Kempe swap of two open stages, or a new stage (cost v), whichever costs less.
    bytes_t best = open_ < k_ ? v : ~bytes_t{0};
    int best_a = none, best_b = none;
    int tried = 0;
    // Candidates a (free at s) and b (free at d) among the open stages, walked by set bits.
    for (std::size_t wa = 0; wa < words_ && best > 0 && tried < max_swap_trials; ++wa)
      for (std::uint64_t ma = fs[wa]; ma != 0 && best > 0 && tried < max_swap_trials; ma &= ma - 1) {
        const int a = static_cast<int>(wa * 64) + __builtin_ctzll(ma);
        if (a >= open_) break;
        for (std::size_t wb = 0; wb < words_ && best > 0 && tried < max_swap_trials; ++wb)
          for (std::uint64_t mb = fd[wb]; mb != 0; mb &= mb - 1) {
            const int b = static_cast<int>(wb * 64) + __builtin_ctzll(mb);
            if (b >= open_) break;
            if (b == a) continue;
            const bytes_t c = swap_cost(d, a, b, best);
            if (c < best) {
              best = c;
              best_a = a;
              best_b = b;
              if (c == 0) break;
            }
            if (++tried >= max_swap_trials) break;
          }
      }
    if (best_a == none) {
      put(s, d, open_++, v);
      return;
    }
    swap_path(d, best_a, best_b);
    put(s, d, best_a, v);
  }

  // How much the weights of a and b rise if the path from column d (a-edge, b-edge, ...) swaps;
  // stops once the rise reaches `limit` (a cost not below limit is all the caller needs to know).
  bytes_t swap_cost(int d, int a, int b, bytes_t limit) {
    const bytes_t wa = w_[a], wb = w_[b];
    bytes_t up_a = 0, up_b = 0; // the rises so far
    for (int col = d;;) {
      const int r = cc(col, a);
      if (r == none) break;
      if (const bytes_t v = rv(r, a); v > wb + up_b) {
        up_b = v - wb;
        if (up_a + up_b >= limit) break;
      }
      const int c2 = rc(r, b);
      if (c2 == none) break;
      if (const bytes_t v = rv(r, b); v > wa + up_a) {
        up_a = v - wa;
        if (up_a + up_b >= limit) break;
      }
      col = c2;
    }
    return up_a + up_b;
  }

  // Swaps the path from column d: afterwards stage a is free at d. The path cannot reach the
  // sender s (it is free in a and the path alternates), so s stays free in a.
  void swap_path(int d, int a, int b) {
    path_.clear();
    for (int col = d;;) {
      const int r = cc(col, a);
      if (r == none) break;
      path_.push_back({r, col, a, rv(r, a)});
      const int c2 = rc(r, b);
      if (c2 == none) break;
      path_.push_back({r, c2, b, rv(r, b)});
      col = c2;
    }
    for (const hop& h : path_) take(h.s, h.d, h.c);
    for (const hop& h : path_) put(h.s, h.d, h.c == a ? b : a, h.v);
  }

  // Phase 2: local search over alternating cycles.
  void improve() {
    const std::size_t budget = local_search_work / static_cast<std::size_t>(n_);
    std::size_t work = 0;
    // Stage weights are recomputed from the colouring (a swap in phase 1 may have left a stage
    // lighter than its recorded weight).
    rank_stages();
    stamp_.assign(n_, 0);
    epoch_ = 0;
    order_.resize(k_);
    // A scan of stage a that found no move stays valid until a or the other stage changes:
    // changed_[c] is the move count at c's last change, scanned_[a] the move count at a's last
    // fruitless scan (-1: none), and only pairs with a change since are walked again.
    changed_.assign(k_, 0);
    scanned_.assign(k_, -1);
    // Weights at the unsplit bound's envelope: no colouring weighs less, so no move can gain and
    // the search would only scan (skip_when_tight_ off: it scans, for the tests that compare).
    if (skip_when_tight_ && weights_sum(w_) == envelope()) return;
    long long moves = 0;
    while (work < budget) {
      for (int c = 0; c < k_; ++c) order_[c] = c;
      // Stages whose largest entry stands furthest above their second first (moving that entry
      // out can gain most), ties heaviest first.
      auto gap = [&](int c) { return len_[c] > 1 ? w_[c] - stage_sorted(c)[1].value : w_[c]; };
      std::stable_sort(order_.begin(), order_.end(), [&](int x, int y) {
        return gap(x) != gap(y) ? gap(x) > gap(y) : w_[x] > w_[y];
      });
      bool moved = false;
      for (int a : order_) {
        if (w_[a] == 0) continue;
        const long long since = changed_[a] > scanned_[a] ? -1 : scanned_[a];
        const int s = stage_sorted(a)[0].row; // the stage's largest entry
        gain_t best_gain = 0;
        int best_b = none;
        for (int b = 0; b < k_ && work < budget; ++b) {
          // The gain is at most w_b (stage b takes a's largest entry): no walk where that is
          // no better than the best so far, nor where neither stage changed since a fruitless scan.
          if (b == a || changed_[b] <= since || gain_t{w_[b]} <= best_gain) continue;
          const gain_t g = cycle_gain(s, a, b, work, best_gain);
          if (g > best_gain) {
            best_gain = g;
            best_b = b;
          }
        }
        if (work >= budget) break;
        if (best_b != none) {
          cycle_gain(s, a, best_b, work, -1); // marks the cycle's rows again
          swap_cycle(a, best_b);
          sort_stage(a);
          sort_stage(best_b);
          changed_[a] = changed_[best_b] = ++moves;
          moved = true;
        } else {
          scanned_[a] = moves;
        }
      }
      if (!moved) break;
    }
  }

  struct ranked {
    bytes_t value;
    int row;
  };
  // Stage c's entries, largest first (ties by row): len_[c] of them.
  std::span<ranked> stage_sorted(int c) noexcept {
    return {sorted_.data() + static_cast<std::size_t>(c) * n_, static_cast<std::size_t>(len_[c])};
  }
  // Every stage's entries in order and its weight, from keys_ (already in that order) without a
  // sort per stage.
  void rank_stages() {
    const std::size_t n = static_cast<std::size_t>(n_);
    sorted_.resize(n * k_);
    stage_of_.resize(n * n);
    len_.assign(k_, 0);
    for (int c = 0; c < k_; ++c)
      for (int s = 0; s < n_; ++s)
        if (const int d = rc(s, c); d != none) stage_of_[static_cast<std::size_t>(s) * n + d] = c;
    for (const std::uint64_t key : keys_) {
      const int s = key_row(key);
      const int c = stage_of_[static_cast<std::size_t>(s) * n + key_col(key)];
      sorted_[static_cast<std::size_t>(c) * n + len_[c]++] = {key_value(key), s};
    }
    for (int c = 0; c < k_; ++c) w_[c] = len_[c] > 0 ? sorted_[static_cast<std::size_t>(c) * n].value : 0;
  }
  // Stage c's order again after swap_cycle: only the rows of the swapped component (cyc_, stamped
  // with epoch_) changed, so the other entries keep their order and the component's new ones,
  // sorted, are merged in: the same order a sort of the whole stage gives (rows are distinct).
  void sort_stage(int c) {
    ranked* st = sorted_.data() + static_cast<std::size_t>(c) * n_;
    auto before = [](const ranked& x, const ranked& y) {
      return x.value != y.value ? x.value > y.value : x.row < y.row;
    };
    int kept = 0;
    for (int i = 0; i < len_[c]; ++i)
      if (stamp_[st[i].row] != epoch_) st[kept++] = st[i];
    fresh_.clear();
    for (int r : cyc_)
      if (rc(r, c) != none) fresh_.push_back({rv(r, c), r});
    std::sort(fresh_.begin(), fresh_.end(), before);
    const int len = kept + static_cast<int>(fresh_.size());
    for (int i = kept - 1, j = static_cast<int>(fresh_.size()) - 1, at = len - 1; j >= 0; --at)
      st[at] = i >= 0 && before(fresh_[static_cast<std::size_t>(j)], st[i]) ? st[i--] : fresh_[static_cast<std::size_t>(j--)];
    len_[c] = len;
    w_[c] = len > 0 ? st[0].value : 0;
  }

  // The drop in w_a + w_b if the component of stages {a, b} through row s's a-edge swaps its
  // colours; 0 or less where it would not help (the walk stops early once it cannot). Leaves the
  // component's rows in cyc_ and stamped with epoch_.
  gain_t cycle_gain(int s, int a, int b, std::size_t& work, gain_t beat) {
    ++epoch_;
    cyc_.clear();
    const bytes_t wa = w_[a];
    const gain_t both = gain_t{wa} + w_[b];
    bytes_t into_a = 0, into_b = 0;
    // na >= into_a and nb >= into_b, so the gain is at most both - into_a - into_b: the walk
    // stops once that cannot beat `beat` (the best gain found so far).
    auto hopeless = [&] { return both - into_a - into_b <= beat; };
    // Forward: s -a-> d -b-> r -a-> ...; then backward from s along b if it was a path.
    bool closed = false;
    for (int r = s;;) {
      ++work;
      cyc_.push_back(r);
      stamp_[r] = epoch_;
      const int d = rc(r, a);
      if (d == none) break;
      into_b = std::max(into_b, rv(r, a));
      const int next = cc(d, b);
      if (next == none) break;
      const bytes_t moved = rv(next, b);
      if (moved >= wa) return 0; // stage a would not get lighter
      into_a = std::max(into_a, moved);
      if (hopeless()) return 0;
      if (next == s) {
        closed = true;
        break;
      }
      r = next;
    }
    if (!closed) {
      for (int r = s;;) {
        ++work;
        const int d = rc(r, b);
        if (d == none) break;
        const bytes_t moved = rv(r, b);
        if (moved >= wa) return 0;
        into_a = std::max(into_a, moved);
        const int next = cc(d, a);
        if (next == none) break;
        into_b = std::max(into_b, rv(next, a));
        if (hopeless()) return 0;
        cyc_.push_back(next);
        stamp_[next] = epoch_;
        r = next;
      }
    }
    // What stays behind: each stage's largest entry outside the component.
    bytes_t rest_a = 0, rest_b = 0;
    for (const ranked& x : stage_sorted(a))
      if (stamp_[x.row] != epoch_) {
        rest_a = x.value;
        break;
      }
    for (const ranked& x : stage_sorted(b))
      if (stamp_[x.row] != epoch_) {
        rest_b = x.value;
        break;
      }
    const bytes_t na = std::max(rest_a, into_a), nb = std::max(rest_b, into_b);
    return both - na - nb;
  }

  // Swaps stages a and b on the rows of cyc_ (a component of the two stages).
  void swap_cycle(int a, int b) {
    path_.clear();
    for (int r : cyc_) {
      if (const int d = rc(r, a); d != none) path_.push_back({r, d, a, rv(r, a)});
      if (const int d = rc(r, b); d != none) path_.push_back({r, d, b, rv(r, b)});
    }
    for (const hop& h : path_) take(h.s, h.d, h.c);
    for (const hop& h : path_) put(h.s, h.d, h.c == a ? b : a, h.v);
  }

  void emit(stage_list& out) {
    for (int c = 0; c < k_; ++c) order_[c] = c;
    std::stable_sort(order_.begin(), order_.end(), [&](int x, int y) { return w_[x] > w_[y]; });
    perm_.resize(n_);
    for (int c : order_) {
      if (w_[c] == 0) continue;
      for (int s = 0; s < n_; ++s) perm_[s] = rc(s, c);
      out.add(w_[c], perm_);
    }
  }

  struct hop {
    int s, d, c;
    bytes_t v;
  };
  // Kempe swaps compared per placement at most (the first zero-cost one ends the search).
  static constexpr int max_swap_trials = 16;

  scaleout_model net_;
  int spare_ = extra_stages;
  bool skip_when_tight_ = true;
  bool split_ = false;
  std::vector<std::uint16_t> pieces_; // split mode: stages serving each pair
  std::vector<int> row_idle_, col_idle_;
  std::vector<std::pair<int, bytes_t>> raised_;
  std::vector<int> row_rank_, col_rank_; // envelope_total's scratch
  bytes_t envelope_ = 0;                 // envelope(): this call's envelope_total, once known
  bool envelope_known_ = false;
  stage_list plain_; // the D-colour colouring, while the other is made
  const server_matrix* m_ = nullptr;
  int n_ = 0, k_ = 0, open_ = 0;
  std::size_t words_ = 0;
  std::uint32_t epoch_ = 0;
  std::uint64_t pair_mask_ = 0;
  int d_bits_ = 0, pair_bits_ = 0;
  bytes_t hi_ = 0;
  bool packed_ = false;
  std::vector<std::uint64_t> keys_, tmp_;
  std::vector<std::size_t> count_;
  std::vector<int> rc_, cc_, queue_, cyc_, order_, stage_of_, len_;
  std::vector<std::uint64_t> row_free_, col_free_;
  std::vector<bytes_t> w_, rv_;
  std::vector<hop> path_;
  std::vector<ranked> sorted_, tops_, fresh_;
  std::vector<std::uint32_t> stamp_;
  std::vector<long long> changed_, scanned_;
  std::vector<std::int32_t> perm_;
};

static_assert(Decomposer<factorized_decomposer>);

} // namespace fasta2a
