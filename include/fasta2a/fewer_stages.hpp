// fasta2a: decomposers that make fewer stages than exact Birkhoff. Every stage costs a
// synchronisation (alpha, 5-20 us on RDMA) and plan memory proportional to stages x ranks, so at
// equal bytes fewer stages is a faster and smaller plan.
//
// - bottleneck_decomposer: exact (weights sum to L), each stage a maximum-bottleneck perfect
//   matching of what is left, so every stage is as heavy as it can be.
// - quantized_decomposer: not exact; entries are rounded up to a quantum q and decomposed in units
//   of q, trading at most (S - 1)(q - 1) bytes of padding per rail for far fewer stages.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "fasta2a/common.hpp"
#include "fasta2a/decompose.hpp"

namespace fasta2a {
namespace detail {

/// Bottleneck Birkhoff-von Neumann peeling of a square matrix whose lines all sum to the same
/// value: each stage is a perfect matching of the support that maximises its smallest entry, and
/// is weighted by that entry. Shared by both decomposers of this header.
///
/// Why it is fast. Peeling only lowers entries, so the best bottleneck theta never rises from one
/// stage to the next: theta sweeps down once over the whole decomposition, and the matching
/// survives between stages. The graph of entries >= theta is kept as bit rows; entries below
/// theta wait in one max-heap per row and join the bit rows when theta falls to them (each entry
/// joins once per time it falls below theta, so this costs O(log S) per entry and stage touched).
/// After a stage only rows whose matched entry fell below theta are unmatched, and each is
/// re-matched by a breadth-first search on the bit rows (64 columns per word). When a search
/// fails, no perfect matching of entries >= theta exists (a perfect matching would contain an
/// augmenting path from every unmatched row, and every other matched entry is >= theta), so theta
/// drops to the largest waiting entry of the rows the search reached and the search resumes. So
/// when all rows are matched theta is the best bottleneck and the smallest matched entry equals it.
class bottleneck_peeler {
public:
  /// Pads m in units of `unit` (see pad_to_line_sum) and peels it into `out` with weights in bytes
  /// (units x unit). Weights are multiples of unit and sum to the padded line sum; each stage is a
  /// partial permutation (perm[s] = -1 where s is matched to itself, i.e. idle). Throws
  /// fasta2a::error if the padded line sum in bytes overflows 64 bits, plan_too_large from
  /// stage_list::add.
  void decompose(const server_matrix& m, bytes_t unit, stage_list& out) {
    n_ = static_cast<int>(m.rows());
    out.reset(n_);
    searches_ = 0;
    if (n_ == 0) return;
    const bytes_t line = pad_to_line_sum(m, unit, a_, row_, col_);
    if (line == 0) return;
    checked_mul(line, unit, "the quantised line sum"); // every weight is at most this
    const std::size_t n = static_cast<std::size_t>(n_);
    matching_.reset(n_); // no edges until the first search lowers theta
    heap_.resize(n * n);
    heap_size_.assign(n, 0);
    top_.assign(n, 0);
    for (std::size_t i = 0; i < n; ++i) {
      waiting* h = &heap_[i * n];
      std::size_t k = 0;
      for (std::size_t j = 0; j < n; ++j)
        if (const bytes_t v = a_[i * n + j]; v > 0) h[k++] = {v, static_cast<int>(j)};
      std::make_heap(h, h + k);
      heap_size_[i] = k;
      top_[i] = k > 0 ? h[0].value : 0;
    }
    perm_.resize(n);
    theta_ = ~bytes_t{0}; // nothing is in the graph until the first search lowers theta
    for (int r = 0; r < n_; ++r) rematch(r);
    bytes_t remaining = line;
    for (;;) {
      const bytes_t w = theta_;
      for (int i = 0; i < n_; ++i) perm_[i] = matching_.column(i) == i ? -1 : matching_.column(i);
      out.add(w * unit, perm_);
      remaining -= w;
      if (remaining == 0) break;
      free_.clear();
      for (int i = 0; i < n_; ++i) {
        const int j = matching_.column(i);
        bytes_t& e = at(i, j);
        e -= w;
        if (e >= theta_) continue;
        matching_.unmatch(i);
        matching_.toggle(i, j); // below theta: out of the graph
        free_.push_back(i);
        if (e > 0) push(i, {e, j});
      }
      for (int r : free_) rematch(r);
    }
  }

  /// Augmenting-path searches of the last decompose (for measurement).
  std::size_t searches() const noexcept { return searches_; }

private:
  struct waiting {
    bytes_t value;
    int col;
    friend bool operator<(const waiting& x, const waiting& y) noexcept {
      return x.value != y.value ? x.value < y.value : x.col > y.col; // ties: lower column first
    }
  };

  bytes_t& at(int i, int j) noexcept { return a_[static_cast<std::size_t>(i) * n_ + j]; }

  void push(int i, waiting x) {
    waiting* h = &heap_[static_cast<std::size_t>(i) * n_];
    h[heap_size_[i]++] = x;
    std::push_heap(h, h + heap_size_[i]);
    top_[i] = h[0].value;
  }

  // Lowers theta to v: every waiting entry >= v joins the graph. The heap tops are kept in one
  // contiguous array so that rows with nothing to add cost one compare.
  void lower(bytes_t v) {
    theta_ = v;
    for (int i = 0; i < n_; ++i) {
      if (top_[i] < v) continue;
      waiting* h = &heap_[static_cast<std::size_t>(i) * n_];
      std::size_t& k = heap_size_[i];
      while (k > 0 && h[0].value >= v) {
        matching_.toggle(i, h[0].col);
        std::pop_heap(h, h + k);
        --k;
      }
      top_[i] = k > 0 ? h[0].value : 0;
    }
  }

  // Matches free row r, lowering theta as far as it must. Most rows find a free column in their
  // own row of the graph: no search needed.
  void rematch(int r) {
    if (matching_.take_free(r)) return;
    for (;;) {
      ++searches_;
      if (matching_.augment(r)) return;
      bytes_t next = 0;
      for (int q : matching_.reached()) next = std::max(next, top_[static_cast<std::size_t>(q)]);
      if (next == 0)
        throw error("internal error: bottleneck decomposition found no perfect matching "
                    "(the padded matrix is not doubly stochastic)");
      lower(next);
    }
  }

  int n_ = 0;
  bytes_t theta_ = 0;
  std::size_t searches_ = 0;
  std::vector<bytes_t> a_, row_, col_, top_;
  detail::bit_matching matching_; // over the entries >= theta
  std::vector<waiting> heap_;
  std::vector<std::size_t> heap_size_;
  std::vector<int> free_;
  std::vector<std::int32_t> perm_;
};

} // namespace detail

/// Exact bottleneck Birkhoff-von Neumann decomposition. Pads M so every line sums to L (the same
/// padding as birkhoff_decomposer), then repeatedly takes a perfect matching of what is left whose
/// smallest entry is as large as possible, weighted by that entry. Promises: weights sum to exactly
/// L; at most S^2 - 2S + 2 stages; each stage a partial permutation (idle servers are -1); every
/// pair (s, d) gets at least M(s, d) bytes of stages in which s sends to d; the same matrix gives
/// the same stages. Heavy stages use up the large entries (the padding of idle servers, the hot
/// pairs) together instead of one at a time, so skewed traffic needs far fewer stages than with
/// arbitrary matchings (Zipf(1.0): 385 instead of 1521 at S = 40). It is a heuristic for the
/// fewest stages (finding those is NP-hard): on a few matrices a tie broken differently costs a
/// stage more than birkhoff_decomposer, and a matrix of distinct random values needs about
/// S^2 - 2S + 2 stages whatever the method. Storage (about 24 S^2 bytes) is reused across calls.
class bottleneck_decomposer {
public:
  static constexpr const char* name = "bottleneck";
  static constexpr bool staged = true;
  static constexpr bool exact = true;

  /// Decomposes m into out (out's size limit applies; plan_too_large past it).
  void decompose(const server_matrix& m, stage_list& out) { peel_.decompose(m, 1, out); }

  /// Augmenting-path searches of the last call (for measurement).
  std::size_t searches() const noexcept { return peel_.searches(); }

private:
  detail::bottleneck_peeler peel_;
};

/// Quantised bottleneck decomposition. Every entry of M is rounded up to a multiple of the quantum
/// q, the result is padded to equal line sums L_q and decomposed in units of q with the bottleneck
/// rule. Promises: weights are multiples of q (at least q each) and sum to L_q; L <= L_q <= L +
/// (S - 1)(q - 1) and L_q is a multiple of q (a row gains less than q per entry it rounds, and a
/// server has at most S - 1 peers); at most min(S^2 - 2S + 2, L_q / q) stages; each stage a partial
/// permutation; every pair (s, d) gets at least M(s, d) bytes of its stages. L_q is also the least
/// any decomposition with weights in multiples of q can reach, since pair (s, d) needs a multiple
/// of q of at least M(s, d).
///
/// The quantum is fixed (constructor with q >= 1), or chosen per matrix from a scale-out model, its
/// per-stage cost alpha and NIC bandwidth (q = 0: the default model; or the scaleout_model
/// constructor, given the topology's, scaleout_of);
/// choosing decomposes up to ten candidates, so it costs a few times one exact decomposition (the
/// winner's stages are kept, not recomputed).
/// How quantized_decomposer picks a quantum per matrix.
enum class quantum_rule {
  search,  ///< try a ladder of quanta, decomposing each: best model time, costs several decompositions
  formula, ///< closed form q = sqrt(alpha b_out L / (S - 1)): one decomposition, for per-call planning
};

class quantized_decomposer {
public:
  static constexpr const char* name = "quantized";
  static constexpr bool staged = true;
  static constexpr bool exact = false;

  /// choose_quantum counts a candidate's stages by decomposing it when S <= exact_count_servers,
  /// or when its stage bound L_q / q times S^2 is at most exact_count_work (a decomposition costs
  /// about S^2 per stage, so this caps the time spent counting); otherwise the count is taken as
  /// its upper bound min(S^2 - 2S + 2, L_q / q), which is close for coarse quanta (most of their
  /// stages are one unit) and pessimistic for fine ones.
  static constexpr int exact_count_servers = 64;
  static constexpr double exact_count_work = 67108864.0; // 2^26

  /// Fixed quantum q bytes; q = 0 chooses per matrix in the default scale-out model
  /// (scaleout_model{}: an H200 NIC, 10 us per stage), by the closed-form rule (one decomposition
  /// per call).
  explicit quantized_decomposer(bytes_t quantum = 0) : quantum_(quantum), rule_(quantum_rule::formula) {}

  /// Chooses the quantum per matrix in scale-out model `net` (the topology's: scaleout_of).
  /// Throws fasta2a::error unless its alpha >= 0 and its bandwidth > 0, both finite.
  /// What configures it, folded into one word: ranks whose engines compare digests must agree on it.
  std::uint64_t digest() const noexcept {
    return detail::fold_words({quantum_, std::bit_cast<std::uint64_t>(net_.alpha_s), std::bit_cast<std::uint64_t>(net_.bandwidth),
                               static_cast<std::uint64_t>(rule_)});
  }

  explicit quantized_decomposer(scaleout_model net, quantum_rule rule = quantum_rule::search)
      : quantum_(0), net_(net), rule_(rule) {
    check_costs(net);
  }

  /// The closed-form quantum in model `net`: with at most (S - 1)(q - 1) bytes of padding per rail
  /// and at most about L / q stages, the modelled scale-out time (L + (S - 1) q) / b_out +
  /// alpha L / q is smallest at q = sqrt(alpha b_out L / (S - 1)); rounded down to a power of two
  /// (so that a power-of-two granule divides it), at least 1.
  static bytes_t formula_quantum(const server_matrix& m, const scaleout_model& net) {
    check_costs(net);
    const auto n = static_cast<double>(m.rows());
    const double L = static_cast<double>(max_line_sum(m));
    if (n < 2 || L == 0 || net.alpha_s == 0) return 1;
    const double q = std::sqrt(net.alpha_s * net.bandwidth * L / (n - 1));
    return q < 2 ? 1 : floor_pow2(static_cast<bytes_t>(std::min(q, 9.2e18)));
  }

  /// The fixed quantum, or 0 when it is chosen per matrix.
  bytes_t quantum() const noexcept { return quantum_; }
  /// The quantum the last decompose used (0 before the first call).
  bytes_t last_quantum() const noexcept { return last_quantum_; }

  /// Decomposes m into out (out's size limit applies; plan_too_large past it).
  void decompose(const server_matrix& m, stage_list& out) {
    if (quantum_ != 0) {
      last_quantum_ = quantum_;
      peel_.decompose(m, quantum_, out);
      return;
    }
    if (rule_ == quantum_rule::formula) {
      last_quantum_ = formula_quantum(m, net_);
      peel_.decompose(m, last_quantum_, out);
      return;
    }
    const bool counted = choose(m, net_);
    last_quantum_ = chosen_;
    if (!counted) {
      peel_.decompose(m, chosen_, out);
      return;
    }
    out.reset(static_cast<int>(m.rows()));
    for (std::size_t t = 0; t < best_.size(); ++t) out.add(best_.weights[t], best_.perm(t));
  }

  /// L_q: the largest line sum of m with every entry rounded up to a multiple of q (q >= 1), which
  /// is what the stage weights of quantum q sum to. Throws fasta2a::error if q is 0 or L_q
  /// overflows 64 bits.
  static bytes_t padded_line_sum(const server_matrix& m, bytes_t q) {
    if (q == 0) throw error("quantized_decomposer: the quantum must be at least 1 byte");
    std::vector<bytes_t> col;
    return detail::checked_mul(line_units(m, q, col), q, "the quantised line sum");
  }

  /// The quantum for m that minimises the modelled scale-out time L_q / b_out + alpha x stages(q)
  /// (scaleout_model::phase_time in model `net`) over a ladder of candidates: q = 1 (exact) and
  /// L / 2^k for k = 2..10, each rounded down to a power of two (so that a power-of-two granule
  /// divides it). That is the balance the padding
  /// strikes: a coarser q pays padding (at most (S - 1)(q - 1) bytes per rail, L_q / b_out) to
  /// save stages (alpha each). Stages are counted by decomposing the candidate, or bounded for
  /// large S (see exact_count_servers); a candidate whose lower bound
  /// (L_q / b_out + alpha x the most non-zero entries in a line) cannot beat the best so far is
  /// skipped. Ties go to the coarser quantum. Returns 1 for a zero matrix. Throws fasta2a::error
  /// unless net's alpha >= 0 and its bandwidth > 0, both finite.
  static bytes_t choose_quantum(const server_matrix& m, const scaleout_model& net) {
    quantized_decomposer d(net);
    d.choose(m, net);
    return d.chosen_;
  }

  /// The model the quantum is chosen in when it is not fixed.
  const scaleout_model& model() const noexcept { return net_; }

private:
  static void check_costs(const scaleout_model& net) { net.check("quantized_decomposer"); }

  // Largest line sum of ceil(m / q), in units of q; `col` is scratch.
  static bytes_t line_units(const server_matrix& m, bytes_t q, std::vector<bytes_t>& col) {
    const int n = static_cast<int>(m.rows());
    col.assign(n, 0);
    bytes_t line = 0;
    for (int i = 0; i < n; ++i) {
      bytes_t row = 0;
      for (int j = 0; j < n; ++j) {
        const bytes_t v = detail::units_of(m(i, j), q);
        row = detail::checked_add(row, v, "a row sum of the server matrix");
        col[j] = detail::checked_add(col[j], v, "a column sum of the server matrix");
      }
      line = std::max(line, row);
    }
    for (int j = 0; j < n; ++j) line = std::max(line, col[j]);
    return line;
  }

  static bytes_t floor_pow2(bytes_t v) noexcept {
    return v == 0 ? 0 : bytes_t{1} << (63 - __builtin_clzll(v));
  }

  // Sets chosen_. Returns true when best_ holds the stages of chosen_ (they were counted by
  // decomposing), so decompose need not run again.
  bool choose(const server_matrix& m, const scaleout_model& net) {
    const int n = static_cast<int>(m.rows());
    const bytes_t L = max_line_sum(m);
    chosen_ = 1;
    best_.reset(n);
    if (L == 0) return true;
    // Every stage serves at most one entry of a line, so the busiest line's non-zero count bounds
    // the stages of any quantum from below.
    std::size_t min_stages = 1;
    col_nz_.assign(n, 0);
    for (int i = 0; i < n; ++i) {
      std::size_t nz = 0;
      for (int j = 0; j < n; ++j)
        if (i != j && m(i, j) != 0) {
          ++nz;
          ++col_nz_[j];
        }
      min_stages = std::max(min_stages, nz);
    }
    for (int j = 0; j < n; ++j) min_stages = std::max(min_stages, col_nz_[j]);
    const std::size_t max_stages = static_cast<std::size_t>(n) * n - 2 * static_cast<std::size_t>(n) + 2;

    // Coarse first: coarse candidates are cheap to decompose and their cost prunes the fine ones.
    ladder_.clear();
    for (int k = 2; k <= 10; ++k)
      if (const bytes_t q = floor_pow2(L >> k); q > 1 && (ladder_.empty() || ladder_.back() != q))
        ladder_.push_back(q);
    ladder_.push_back(1);

    double best_cost = 0;
    bool have = false, counted = false;
    for (const bytes_t q : ladder_) {
      const bytes_t lq = detail::checked_mul(line_units(m, q, col_), q, "the quantised line sum");
      if (have && net.phase_time(lq, min_stages) >= best_cost) continue;
      std::size_t stages;
      const bool count = n <= exact_count_servers ||
                         static_cast<double>(lq / q) * n * n <= exact_count_work;
      if (count) {
        // Unlimited scratch list: the caller's size limit applies when the winner is copied out.
        trial_.max_bytes = ~std::size_t{0};
        peel_.decompose(m, q, trial_);
        stages = trial_.size();
      } else {
        stages = std::min<std::size_t>(max_stages, lq / q);
      }
      const double cost = net.phase_time(lq, stages);
      if (!have || cost < best_cost) {
        have = true;
        best_cost = cost;
        chosen_ = q;
        counted = count;
        if (count) std::swap(best_, trial_);
      }
    }
    return counted;
  }

  bytes_t quantum_;
  scaleout_model net_;
  quantum_rule rule_ = quantum_rule::search;
  bytes_t last_quantum_ = 0;
  bytes_t chosen_ = 1;
  detail::bottleneck_peeler peel_;
  stage_list best_, trial_;
  std::vector<bytes_t> col_, ladder_;
  std::vector<std::size_t> col_nz_;
};

static_assert(Decomposer<bottleneck_decomposer>);
static_assert(Decomposer<quantized_decomposer>);

/// Exact decomposition that pads as it goes: the fewest stages of the exact decomposers here.
///
/// Birkhoff-style decompositions pad M to equal line sums first, then peel permutations off the
/// padded matrix; a stage ends a pair only when the pair's padded entry runs out, so nearly every
/// stage ends exactly one pair and a matrix with k non-zeros (padding included) needs about
/// k - S + 1 stages. Here padding is never placed in advance. With L' the stage budget left (L
/// minus the weights so far) and r_s, c_d the bytes server s has left to send and d to receive,
/// a server's slack is L' - r_s (or L' - c_d): what it can spend idle or half-busy without
/// lengthening the phase. A stage of weight w may give a pair fewer than w bytes (all it has left)
/// as long as both its servers' slack covers the shortfall, and may leave a server idle if its
/// slack is at least w. So the capacity of pair (s, d) in a stage is R(s, d) + min(slack_s,
/// slack_d), and a stage as heavy as its weakest pair's capacity finishes every pair it serves
/// whose bytes fit: several per stage.
///
/// Two phases. First the S - 1 cyclic shifts s -> s + t, each weighted by its weakest capacity:
/// where every pair carries traffic this takes most bytes in S - 1 stages, the fewest any
/// one-to-one schedule can have. Then maximum-bottleneck stages over the capacities finish the
/// rest: a perfect matching of rows plus one "idle" node per column against columns plus one
/// "idle" node per row (row s to its idle node at slack_s, column d's idle node to d at slack_d,
/// idle to idle unbounded). Capacities only fall, so the bottleneck sweeps down once and the
/// matching is repaired between stages, as in bottleneck_peeler; every such stage finishes a pair,
/// makes a server's slack zero, or is the last: at most S - 1 + k + 2S stages (k: non-zeros of M).
/// Measured (bench_stages --counts): Megatron 4 x 8, 600 matrices, 3 / 3 / 7 stages (min / median /
/// max) where Birkhoff makes 9 on every one; Zipf(1.0) 8 x 8, 64 MiB per GPU, seeds 1-32, 7 / 7 / 13
/// where Birkhoff makes 49.
///
/// Promises, as every exact decomposer: weights sum to L, the largest line sum of M; every pair
/// (s, d) is served by stages whose weights sum to at least M(s, d); each stage a partial
/// permutation (-1: idle); heaviest first. Cost O(S^2) per repaired pair of the second phase;
/// scratch 8 S^2 bytes (what each pair has left) plus O(S), reused across calls.
class slack_decomposer {
public:
  static constexpr const char* name = "slack";
  static constexpr bool staged = true;
  static constexpr bool exact = true;
  /// What each pair has left (planner_scratch_bytes).
  static constexpr std::size_t scratch_bytes_per_server_pair = sizeof(bytes_t);

  void decompose(const server_matrix& m, stage_list& out) {
    n_ = static_cast<int>(m.rows());
    out.reset(n_);
    if (n_ == 0) return;
    const std::size_t n = static_cast<std::size_t>(n_);
    R_.assign(n * n, 0);
    r_.assign(n, 0);
    c_.assign(n, 0);
    for (int i = 0; i < n_; ++i)
      for (int j = 0; j < n_; ++j) {
        const bytes_t v = m(i, j);
        R_[idx(i, j)] = v;
        r_[i] = detail::checked_add(r_[i], v, "a row sum of the server matrix");
        c_[j] = detail::checked_add(c_[j], v, "a column sum of the server matrix");
      }
    left_ = 0;
    for (int i = 0; i < n_; ++i) left_ = std::max({left_, r_[i], c_[i]});
    if (left_ == 0) return;
    // Left nodes: rows 0..n-1, then the idle node of each column (n + d). Right nodes: columns
    // 0..n-1, then the idle node of each row (n + s).
    mate_l_.assign(2 * n, -1);
    mate_r_.assign(2 * n, -1);
    parent_.resize(2 * n);
    queue_.resize(2 * n);
    reached_.resize((2 * n + 63) / 64);
    idle_.assign(reached_.size(), 0); // the idle row nodes n ... 2 n - 1
    for (std::size_t v = n; v < 2 * n; ++v) idle_[v / 64] |= std::uint64_t{1} << (v % 64);
    theta_ = left_;
    perm_.assign(n, -1);
    // First the S - 1 cyclic shifts s -> s + t, each as heavy as its weakest pair's capacity:
    // where every pair carries traffic they take most of it in the fewest stages any one-to-one
    // schedule can have (the stage-aware bound), and the bottleneck stages below finish the rest.
    {
      for (int t = 1; t < n_ && left_ > 0; ++t) {
        bytes_t w = left_;
        for (int s = 0; s < n_; ++s) {
          const int d = (s + t) % n_;
          w = std::min(w, R_[idx(s, d)] + std::min(slack_row(s), slack_col(d)));
        }
        if (w == 0) continue;
        for (int s = 0; s < n_; ++s) {
          const int d = (s + t) % n_;
          bytes_t& e = R_[idx(s, d)];
          const bytes_t x = std::min(w, e);
          perm_[s] = x > 0 ? d : -1;
          e -= x;
          r_[s] -= x;
          c_[d] -= x;
        }
        out.add(w, perm_);
        left_ -= w;
      }
      theta_ = left_;
    }
    if (left_ > 0) refresh();
    while (left_ > 0) {
      for (int u = 0; u < 2 * n_; ++u)
        if (mate_l_[u] < 0) {
          if (n_ <= small) match<true>(u);
          else match<false>(u);
        }
      // The stage's weight: its weakest matched capacity (the bottleneck), at most what is left.
      bytes_t w = left_;
      for (int u = 0; u < 2 * n_; ++u) w = std::min(w, cap(u, mate_l_[u]));
      for (int s = 0; s < n_; ++s) {
        const int d = mate_l_[s];
        perm_[s] = d < n_ ? d : -1;
        if (d < n_) {
          bytes_t& e = R_[idx(s, d)];
          const bytes_t x = std::min(w, e);
          e -= x;
          r_[s] -= x;
          c_[d] -= x;
        }
      }
      out.add(w, perm_);
      left_ -= w;
      if (left_ == 0) break;
      refresh();
      // Capacities fell: the next bottleneck is at most w. Unmatch what no longer reaches it.
      theta_ = w;
      for (int u = 0; u < 2 * n_; ++u) {
        const int v = mate_l_[u];
        if (cap(u, v) < theta_) {
          mate_l_[u] = -1;
          mate_r_[v] = -1;
        }
      }
    }
    heaviest_first_(out);
  }

private:
  static constexpr bytes_t unbounded = ~bytes_t{0};
  static constexpr int small = 16; // servers up to which match<true> is used
  std::size_t idx(int i, int j) const noexcept { return static_cast<std::size_t>(i) * n_ + j; }
  bytes_t slack_row(int s) const noexcept { return left_ - r_[s]; }
  bytes_t slack_col(int d) const noexcept { return left_ - c_[d]; }

  // The second phase's capacities, refreshed whenever R_, r_, c_ or left_ change (after each
  // stage): cap_ of pair (s, d) is R(s, d) + min(slack_s, slack_d) where R(s, d) > 0, else 0
  // (at most L', as R(s, d) + slack_s <= L'); srow_ and scol_ are the slacks, the capacities of
  // the edges to the idle nodes.
  void refresh() {
    const std::size_t n = static_cast<std::size_t>(n_);
    cap_.resize(n * n);
    srow_.resize(n);
    scol_.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      srow_[i] = left_ - r_[i];
      scol_[i] = left_ - c_[i];
    }
    for (std::size_t s = 0; s < n; ++s) {
      const bytes_t* e = R_.data() + s * n;
      bytes_t* c = cap_.data() + s * n;
      const bytes_t sr = srow_[s];
      for (std::size_t d = 0; d < n; ++d) { // without a branch: whether R(s, d) ran out is data
        const bytes_t sd = scol_[d], slack = sr < sd ? sr : sd;
        c[d] = (e[d] + slack) & -static_cast<bytes_t>(e[d] != 0);
      }
    }
  }

  // Capacity of the edge from left node u to right node v; 0 where there is no edge.
  bytes_t cap(int u, int v) const noexcept {
    if (u < n_) {
      if (v < n_) return cap_[idx(u, v)];
      return v - n_ == u ? srow_[static_cast<std::size_t>(u)] : 0;
    }
    if (v < n_) return u - n_ == v ? scol_[static_cast<std::size_t>(v)] : 0;
    return unbounded;
  }

  // Matches free left node u by breadth-first augmenting paths over edges of capacity >= theta_.
  // A row reaches every column and its own idle node; a column's idle node reaches its column and
  // every row's idle node: in both, the right nodes in increasing order, the first time each is
  // reached. Where no free right node is reachable, theta_ falls to the best capacity of an edge
  // from a reached left node to a right node left unreached, and the search starts again. That
  // value is at least the best bottleneck of any augmenting path (such a path leaves the reached
  // set by one of those edges), so theta_ ends at that bottleneck (or stays where it was, if a path
  // reaches it), and the path found is the first at that level.
  //
  // The right nodes reached are a bit set of W words; a left node's edges at theta_ are another,
  // made without branches from its row of capacities, and taken in increasing order.
  //
  // Few: at most `small` servers (one word of right nodes): the set is a register, and a row's
  // nodes are tested one by one, the search stopping at the first free one.
  template <bool Few> void match(int u) {
    const int n = n_, N = 2 * n;
    std::uint64_t one = 0;
    const std::size_t W = Few ? 1 : reached_.size();
    std::uint64_t* reached = Few ? &one : reached_.data();
    int* queue = queue_.data();
    auto bit = [](int v) {
      return std::uint64_t{1} << (Few ? static_cast<unsigned>(v) : static_cast<unsigned>(v) % 64);
    };
    auto word = [](int v) { return Few ? 0 : static_cast<std::size_t>(static_cast<unsigned>(v) / 64); };
    for (;;) {
      const bytes_t theta = theta_;
      std::fill_n(reached, W, 0);
      queue[0] = u;
      int tail = 1;
      // x reaches right node v: true where v is free (the path is flipped and the search ends),
      // else v's mate joins the queue.
      auto reach = [&](int x, int v) FASTA2A_INLINE {
        parent_[static_cast<std::size_t>(v)] = x;
        reached[word(v)] |= bit(v);
        if (mate_r_[static_cast<std::size_t>(v)] < 0) {
          flip(u, v);
          return true;
        }
        queue[tail++] = mate_r_[static_cast<std::size_t>(v)];
        return false;
      };
      for (int head = 0; head < tail; ++head) {
        const int x = queue[head];
        if constexpr (Few) {
          auto fresh = [&](int v) FASTA2A_INLINE { return (reached[word(v)] & bit(v)) == 0; };
          if (x < n) {
            const bytes_t* c = cap_.data() + idx(x, 0);
            for (int v = 0; v < n; ++v)
              if (fresh(v) && c[v] >= theta && reach(x, v)) return;
            if (fresh(n + x) && srow_[static_cast<std::size_t>(x)] >= theta && reach(x, n + x)) return;
          } else {
            const int j = x - n;
            if (fresh(j) && scol_[static_cast<std::size_t>(j)] >= theta && reach(x, j)) return;
            for (int v = n; v < N; ++v)
              if (fresh(v) && reach(x, v)) return;
          }
        } else {
          for (std::size_t k = 0; k < W; ++k) {
            // Right nodes 64 k ... 64 k + 63: columns below n, idle row nodes from n on.
            const int lo = static_cast<int>(k * 64), hi = std::min(N, lo + 64);
            std::uint64_t edges = 0;
            if (x < n) {
              const bytes_t* c = cap_.data() + idx(x, 0);
              for (int v = lo; v < std::min(hi, n); ++v)
                edges |= static_cast<std::uint64_t>(c[v] >= theta) << (v - lo);
              if (n + x >= lo && n + x < hi)
                edges |= static_cast<std::uint64_t>(srow_[static_cast<std::size_t>(x)] >= theta) << (n + x - lo);
            } else {
              const int j = x - n;
              if (j >= lo && j < hi)
                edges |= static_cast<std::uint64_t>(scol_[static_cast<std::size_t>(j)] >= theta) << (j - lo);
              edges |= idle_[k]; // unbounded
            }
            for (std::uint64_t todo = edges & ~reached[k]; todo != 0; todo &= todo - 1)
              if (reach(x, lo + std::countr_zero(todo))) return;
          }
        }
      }
      // Every edge at theta_ from a reached left node reaches its node: what is left unreached is
      // below theta_.
      bytes_t below = 0;
      auto unreached = [&](int v) { return (reached[word(v)] & bit(v)) == 0; };
      for (int h = 0; h < tail; ++h) {
        const int x = queue[h];
        if (x < n) {
          const bytes_t* c = cap_.data() + idx(x, 0);
          for (int v = 0; v < n; ++v)
            if (unreached(v)) below = std::max(below, c[v]);
          if (unreached(n + x)) below = std::max(below, srow_[static_cast<std::size_t>(x)]);
        } else if (unreached(x - n)) {
          below = std::max(below, scol_[static_cast<std::size_t>(x - n)]);
        }
      }
      if (below == 0)
        throw error("internal error: slack decomposition found no stage (the line sums are inconsistent)");
      theta_ = below;
    }
  }

  void flip(int root, int v) {
    while (v != -1) {
      const int x = parent_[v];
      const int next = mate_l_[x];
      mate_l_[x] = v;
      mate_r_[v] = x;
      v = x == root ? -1 : next;
    }
  }

  int n_ = 0;
  bytes_t left_ = 0, theta_ = 0;
  std::vector<bytes_t> R_, r_, c_, cap_, srow_, scol_;
  std::vector<int> mate_l_, mate_r_, parent_, queue_;
  std::vector<std::uint64_t> reached_, idle_; // match's right nodes reached; the idle row nodes
  std::vector<std::int32_t> perm_;
  detail::heaviest_first heaviest_first_;
};

static_assert(Decomposer<slack_decomposer>);

} // namespace fasta2a
