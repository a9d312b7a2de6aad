// fasta2a: phase 2, turning the server-level matrix into stages (Decomposer policies).
#pragma once

#include <algorithm>
#include <bit>
#include <concepts>
#include <cstdio>
#include <tuple>
#include <span>
#include <string>
#include <vector>

#include <Eigen/Core>

#include "fasta2a/common.hpp"
#include "fasta2a/topology.hpp"

namespace fasta2a {

/// Per-rail bytes from server s to server d (zero diagonal). Row-major so that a row is a server's
/// sends, contiguous.
using server_matrix = Eigen::Matrix<bytes_t, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// The stages a decomposer produces: stage t sends up to `weights[t]` bytes per rail from server s
/// to server `perm(t)[s]`; a value of s itself (or -1) means s is idle in that stage. No two
/// servers send to the same server in one stage.
struct stage_list {
  int servers = 0;
  std::vector<bytes_t> weights;
  std::vector<std::int32_t> perms; ///< stages x servers
  std::size_t max_bytes = ~std::size_t{0}; ///< storage limit; `add` throws plan_too_large past it
  /// Bytes each stage will cost the plan beyond its own weight and permutation (the planner's
  /// per-rank op index), so that an oversized plan is refused while it is being decomposed.
  std::size_t extra_bytes_per_stage = 0;

  void reset(int s) {
    servers = s;
    weights.clear();
    perms.clear();
  }
  std::size_t size() const noexcept { return weights.size(); }
  std::span<const std::int32_t> perm(std::size_t t) const noexcept {
    return {perms.data() + t * servers, static_cast<std::size_t>(servers)};
  }
  void add(bytes_t w, std::span<const std::int32_t> p) {
    if ((size() + 1) * (servers * sizeof(std::int32_t) + sizeof(bytes_t) + extra_bytes_per_stage) >
        max_bytes)
      throw plan_too_large("plan exceeds its size limit of " + std::to_string(max_bytes) +
                           " bytes after " + std::to_string(size()) + " stages of " +
                           std::to_string(servers) + " servers (raise plan_options::max_plan_bytes "
                           "or use a decomposer with fewer stages)");
    weights.push_back(w);
    perms.insert(perms.end(), p.begin(), p.end());
  }
};

/// A Decomposer turns a server matrix into weighted partial-permutation stages. `staged` is false
/// for a decomposer that schedules nothing (the direct baseline: the plan then routes every
/// message straight to its destination). `exact` is true when the stage weights always sum to L,
/// the largest line sum, which is the scale-out lower bound.
template <class D>
concept Decomposer = requires(D& d, const server_matrix& m, stage_list& out) {
  { D::name } -> std::convertible_to<const char*>;
  { D::staged } -> std::convertible_to<bool>;
  { D::exact } -> std::convertible_to<bool>;
  d.decompose(m, out);
};

/// Scratch bytes a decomposer needs per server pair (its padded matrix and work lists): the
/// decomposer's own `scratch_bytes_per_server_pair` where it states one, else 32 (a padded entry
/// and a heap entry per pair, rounded up).
template <class D> constexpr std::size_t decomposer_scratch_per_pair() noexcept {
  if constexpr (requires { D::scratch_bytes_per_server_pair; }) return D::scratch_bytes_per_server_pair;
  else return 32;
}


namespace detail {

/// ceil(v / unit) for unit >= 1.
inline bytes_t units_of(bytes_t v, bytes_t unit) noexcept {
  return unit == 1 ? v : v / unit + (v % unit != 0);
}

/// Fills `a` (n x n, row-major) with ceil(m(i, j) / unit) plus padding so that every row and every
/// column sums to the same value, the largest line sum of the rounded matrix, which it returns (in
/// units). With unit = 1 this is exactly birkhoff_decomposer's padding: padding goes on the
/// diagonal first (a server idle in a stage costs nothing), then north-west corner over what is
/// left. `row` and `col` are scratch. Throws fasta2a::error if a line sum overflows 64 bits.
inline bytes_t pad_to_line_sum(const server_matrix& m, bytes_t unit, std::vector<bytes_t>& a,
                               std::vector<bytes_t>& row, std::vector<bytes_t>& col) {
  const int n = static_cast<int>(m.rows());
  const std::size_t nn = static_cast<std::size_t>(n) * n;
  a.resize(nn);
  row.assign(n, 0);
  col.assign(n, 0);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j) {
      const bytes_t v = units_of(m(i, j), unit);
      a[static_cast<std::size_t>(i) * n + j] = v;
      row[i] = checked_add(row[i], v, "a row sum of the server matrix");
      col[j] = checked_add(col[j], v, "a column sum of the server matrix");
    }
  bytes_t line = 0;
  for (int i = 0; i < n; ++i) line = std::max({line, row[i], col[i]});
  for (int i = 0; i < n; ++i) {
    row[i] = line - row[i];
    col[i] = line - col[i];
    const bytes_t d = std::min(row[i], col[i]);
    a[static_cast<std::size_t>(i) * n + i] += d;
    row[i] -= d;
    col[i] -= d;
  }
  // Row and column deficits now have equal totals, so the corner walk ends with both exhausted.
  for (int i = 0, j = 0; i < n && j < n;) {
    const bytes_t d = std::min(row[i], col[j]);
    a[static_cast<std::size_t>(i) * n + j] += d;
    row[i] -= d;
    col[j] -= d;
    if (row[i] == 0) ++i;
    else ++j;
  }
  return line;
}

/// A matching of n rows to n columns in a bipartite graph kept as bit sets, a word of 64 columns at
/// a time: each row's edges and the free columns. Grown by Kuhn's breadth-first augmenting paths
/// (birkhoff_decomposer, bottleneck_peeler), which take a row's columns in increasing order and
/// end at the first free one: where a row's fresh columns include a free one the search takes the
/// lowest (the columns before it would only have queued their rows), else it queues the rows of
/// all of them in order.
class bit_matching {
public:
  /// n rows and columns, no edges, nothing matched.
  void reset(int n) {
    n_ = n;
    const std::size_t N = static_cast<std::size_t>(n);
    words_ = (N + 63) / 64;
    edges_.assign(N * words_, 0);
    free_.assign(words_, 0);
    for (int j = 0; j < n; ++j) flip_bit(free_.data(), j);
    seen_.resize(words_);
    match_.assign(N, -1);
    owner_.assign(N, -1);
    parent_.resize(N);
    queue_.resize(N);
    reached_ = 0;
  }
  /// Adds edge (i, j) where it is absent, removes it where it is present.
  void toggle(int i, int j) noexcept { flip_bit(&edges_[static_cast<std::size_t>(i) * words_], j); }
  /// Row i's column; -1 where row i is free.
  int column(int i) const noexcept { return match_[static_cast<std::size_t>(i)]; }
  /// Frees row i (matched) and its column.
  void unmatch(int i) noexcept {
    const int j = match_[static_cast<std::size_t>(i)];
    owner_[static_cast<std::size_t>(j)] = -1;
    match_[static_cast<std::size_t>(i)] = -1;
    flip_bit(free_.data(), j);
  }
  /// Matches free row r to the lowest free column among its own edges, if it has one.
  bool take_free(int r) noexcept {
    const std::uint64_t* row = &edges_[static_cast<std::size_t>(r) * words_];
    for (std::size_t wd = 0; wd < words_; ++wd)
      if (const std::uint64_t hit = row[wd] & free_[wd]; hit != 0) {
        const int j = static_cast<int>(wd * 64) + std::countr_zero(hit);
        match_[static_cast<std::size_t>(r)] = j;
        owner_[static_cast<std::size_t>(j)] = r;
        flip_bit(free_.data(), j);
        return true;
      }
    return false;
  }
  /// Matches free row r through an augmenting path. False if there is none: reached() then holds
  /// the rows the search reached (each once; r first).
  bool augment(int r) noexcept {
    const std::size_t W = words_;
    std::uint64_t* seen = seen_.data();
    std::fill_n(seen, W, 0);
    int* queue = queue_.data();
    std::size_t tail = 0;
    queue[tail++] = r;
    for (std::size_t q = 0; q < tail; ++q) {
      const int i = queue[q];
      const std::uint64_t* row = &edges_[static_cast<std::size_t>(i) * W];
      for (std::size_t wd = 0; wd < W; ++wd) {
        std::uint64_t fresh = row[wd] & ~seen[wd];
        if (const std::uint64_t hit = fresh & free_[wd]; hit != 0) {
          int j = static_cast<int>(wd * 64) + std::countr_zero(hit);
          parent_[static_cast<std::size_t>(j)] = i;
          flip_bit(free_.data(), j);
          while (j != -1) { // flip the path back to r
            const int pi = parent_[static_cast<std::size_t>(j)], next = match_[static_cast<std::size_t>(pi)];
            match_[static_cast<std::size_t>(pi)] = j;
            owner_[static_cast<std::size_t>(j)] = pi;
            j = pi == r ? -1 : next;
          }
          return true;
        }
        seen[wd] |= fresh;
        for (; fresh != 0; fresh &= fresh - 1) {
          const int j = static_cast<int>(wd * 64) + std::countr_zero(fresh);
          parent_[static_cast<std::size_t>(j)] = i;
          queue[tail++] = owner_[static_cast<std::size_t>(j)];
        }
      }
    }
    reached_ = tail;
    return false;
  }
  /// The rows the last failed augment reached.
  std::span<const int> reached() const noexcept { return {queue_.data(), reached_}; }

private:
  static void flip_bit(std::uint64_t* w, int j) noexcept {
    w[static_cast<unsigned>(j) / 64] ^= std::uint64_t{1} << (static_cast<unsigned>(j) % 64);
  }

  int n_ = 0;
  std::size_t words_ = 0, reached_ = 0;
  std::vector<std::uint64_t> edges_, free_, seen_;
  std::vector<int> match_, owner_, parent_, queue_;
};

/// Puts a decomposer's stages heaviest first, ties in decomposition order (a stable sort), with
/// its buffers reused across calls: an executor keeps a window of stages in flight, and a light
/// stage between heavy ones leaves the busiest server's NICs idle (measured on the emulated
/// cluster). The order changes neither the weights' sum nor the pairs' coverage.
class heaviest_first {
public:
  void operator()(stage_list& out) {
    const std::size_t T = out.size(), S = static_cast<std::size_t>(out.servers);
    order_.resize(T);
    for (std::size_t t = 0; t < T; ++t) order_[t] = t;
    const bytes_t* weight = out.weights.data();
    if (T <= 32) { // an insertion sort (stable: it passes only lighter stages): no buffer to allocate
      for (std::size_t t = 1; t < T; ++t) {
        const std::size_t x = order_[t];
        std::size_t i = t;
        for (; i > 0 && weight[order_[i - 1]] < weight[x]; --i) order_[i] = order_[i - 1];
        order_[i] = x;
      }
    } else {
      std::stable_sort(order_.begin(), order_.end(),
                       [weight](std::size_t a, std::size_t b) { return weight[a] > weight[b]; });
    }
    w_.resize(T);
    p_.resize(T * S);
    for (std::size_t t = 0; t < T; ++t) {
      w_[t] = out.weights[order_[t]];
      std::copy_n(out.perms.begin() + order_[t] * S, S, p_.begin() + t * S);
    }
    out.weights.swap(w_);
    out.perms.swap(p_);
  }

private:
  std::vector<std::size_t> order_;
  std::vector<bytes_t> w_;
  std::vector<std::int32_t> p_;
};

} // namespace detail

/// Largest row or column sum of a server matrix: L, the per-rail bytes of the busiest server.
inline bytes_t max_line_sum(const server_matrix& m) {
  bytes_t l = 0;
  for (Eigen::Index i = 0; i < m.rows(); ++i) l = std::max(l, m.row(i).sum());
  for (Eigen::Index j = 0; j < m.cols(); ++j) l = std::max(l, m.col(j).sum());
  return l;
}

/// Exact Birkhoff-von Neumann decomposition (the FAST paper): pad the matrix so every row and
/// column sums to L, then peel off perfect matchings of its support, each weighted by its smallest
/// entry. Weights sum to exactly L; at most S^2 - 2S + 2 stages, heaviest first. The matching of
/// one stage is repaired for the next (only rows whose entry ran out are re-matched), not recomputed.
class birkhoff_decomposer {
public:
  static constexpr const char* name = "birkhoff";
  static constexpr bool staged = true;
  static constexpr bool exact = true;
  /// The padded matrix (planner_scratch_bytes).
  static constexpr std::size_t scratch_bytes_per_server_pair = sizeof(bytes_t);

  void decompose(const server_matrix& m, stage_list& out) {
    const int n = static_cast<int>(m.rows());
    out.reset(n);
    if (n == 0) return;
    pad(m);
    for (int i = 0; i < n; ++i) matching_.augment(i);
    bytes_t remaining = line_;
    while (remaining > 0) {
      bytes_t w = ~bytes_t{0};
      for (int i = 0; i < n; ++i) w = std::min(w, a_[idx(i, matching_.column(i))]);
      for (int i = 0; i < n; ++i) perm_[i] = matching_.column(i) == i ? -1 : matching_.column(i);
      out.add(w, perm_);
      remaining -= w;
      if (remaining == 0) break;
      // Drop the matched entries that ran out, then repair the matching around them.
      broken_.clear();
      for (int i = 0; i < n; ++i) {
        bytes_t& e = a_[idx(i, matching_.column(i))];
        e -= w;
        if (e == 0) {
          matching_.toggle(i, matching_.column(i)); // the entry leaves the support
          matching_.unmatch(i);
          broken_.push_back(i);
        }
      }
      for (int i : broken_)
        if (!matching_.augment(i))
          throw error("internal error: Birkhoff decomposition found no perfect matching "
                      "(the padded matrix is not doubly stochastic)");
    }
    heaviest_first_(out);
  }

private:
  std::size_t idx(int i, int j) const noexcept { return static_cast<std::size_t>(i) * n_ + j; }

  // a_ = m + padding, every line summing to L (diagonal first: a server idle in a stage costs
  // nothing).
  void pad(const server_matrix& m) {
    n_ = static_cast<int>(m.rows());
    line_ = detail::pad_to_line_sum(m, 1, a_, row_, col_);
    perm_.assign(n_, -1);
    matching_.reset(n_); // the support of a_: its non-zero entries
    for (int i = 0; i < n_; ++i)
      for (int j = 0; j < n_; ++j)
        if (a_[idx(i, j)] != 0) matching_.toggle(i, j);
  }

  int n_ = 0;
  bytes_t line_ = 0;
  std::vector<bytes_t> a_, row_, col_;
  // The matching over a_'s support, repaired by Kuhn's breadth-first search (so that the repair
  // touches few rows) between stages.
  detail::bit_matching matching_;
  std::vector<int> broken_;
  std::vector<std::int32_t> perm_;
  detail::heaviest_first heaviest_first_;
};

/// Spread-out baseline: S - 1 shift permutations, stage t sending s -> (s + t) mod S with the
/// largest entry of that shift as its weight. Incast-free, but a shift waits for its slowest pair.
class spread_out_decomposer {
public:
  static constexpr const char* name = "spread-out";
  static constexpr std::size_t scratch_bytes_per_server_pair = 0;
  static constexpr bool staged = true;
  static constexpr bool exact = false;

  void decompose(const server_matrix& m, stage_list& out) {
    const int n = static_cast<int>(m.rows());
    out.reset(n);
    perm_.assign(n, -1);
    for (int t = 1; t < n; ++t) {
      bytes_t w = 0;
      for (int s = 0; s < n; ++s) w = std::max(w, m(s, (s + t) % n));
      if (w == 0) continue;
      for (int s = 0; s < n; ++s) perm_[s] = m(s, (s + t) % n) > 0 ? (s + t) % n : -1;
      out.add(w, perm_);
    }
  }

private:
  std::vector<std::int32_t> perm_;
};

/// Direct baseline: no stages; every message goes straight from its source GPU to its destination
/// GPU at once, as NCCL's grouped send/receive and MPI_Alltoallv do.
class direct_decomposer {
public:
  static constexpr const char* name = "direct";
  static constexpr std::size_t scratch_bytes_per_server_pair = 0;
  static constexpr bool staged = false;
  static constexpr bool exact = false;
  void decompose(const server_matrix& m, stage_list& out) { out.reset(static_cast<int>(m.rows())); }
};

static_assert(Decomposer<birkhoff_decomposer>);
static_assert(Decomposer<spread_out_decomposer>);
static_assert(Decomposer<direct_decomposer>);

/// Runs every decomposer Ds on the server matrix and keeps the stages that the alpha-beta model
/// predicts fastest for the scale-out phase: scaleout_model::stages_time, the sum over stages of
/// alpha + weight / b_out. So a
/// plan with a few more bytes of padding but far fewer stages wins where stages are expensive
/// (small messages, large alpha), and exact Birkhoff wins where bytes dominate. `chosen()` and
/// `reason()` say which won and why; the planner copies them into the plan.
namespace detail {

/// A decomposer's name and configuration folded into one word: its `digest()` where it has one
/// (decomposers with parameters), its name alone otherwise.
template <class D>
std::uint64_t decomposer_digest(const D& d) noexcept {
  std::uint64_t h = 0;
  for (const char* c = D::name; *c; ++c) h = fold_words({h, static_cast<unsigned char>(*c)});
  if constexpr (requires { d.digest(); }) h = fold_words({h, static_cast<std::uint64_t>(d.digest())});
  return h;
}

} // namespace detail

template <Decomposer... Ds>
class best_of_decomposer {
  static_assert(sizeof...(Ds) >= 1, "best_of_decomposer needs at least one decomposer");
  static_assert((Ds::staged && ...), "best_of_decomposer chooses among staged decomposers");

public:
  static constexpr const char* name = "best-of";
  static constexpr bool staged = true;
  static constexpr bool exact = (Ds::exact && ...);
  /// Every member keeps its own scratch.
  static constexpr std::size_t scratch_bytes_per_server_pair = (decomposer_scratch_per_pair<Ds>() + ...);

  /// Compares the members' stages in scale-out model `net`: the topology's (scaleout_of) where
  /// the plans are for one. Throws fasta2a::error unless alpha >= 0 and the bandwidth > 0, both
  /// finite.
  explicit best_of_decomposer(scaleout_model net = {}) : best_of_decomposer(net, Ds{}...) {}
  /// As above, with configured members (a quantised decomposer's quantum, say).
  best_of_decomposer(scaleout_model net, Ds... ds) : net_(net), members_(std::move(ds)...) {
    net_.check("best_of_decomposer");
  }

  /// The model the members' stages are compared in.
  const scaleout_model& model() const noexcept { return net_; }
  /// The model and every member's own digest, folded into one word (see quantized_decomposer::digest).
  std::uint64_t digest() const noexcept {
    std::uint64_t h = detail::fold_words({std::bit_cast<std::uint64_t>(net_.alpha_s), std::bit_cast<std::uint64_t>(net_.bandwidth)});
    std::apply([&](const auto&... d) { ((h = detail::fold_words({h, detail::decomposer_digest(d)})), ...); }, members_);
    return h;
  }

  void decompose(const server_matrix& m, stage_list& out) {
    best_ = -1;
    reason_.clear();
    double best_time = 0;
    int i = 0;
    auto try_one = [&](auto& dec) {
      stage_list& mine = candidates_[i];
      mine.max_bytes = out.max_bytes;
      mine.extra_bytes_per_stage = out.extra_bytes_per_stage;
      bool fits = true;
      try {
        dec.decompose(m, mine);
      } catch (const plan_too_large&) {
        fits = false; // another member may stay within the limit
      }
      double time = 0;
      if (fits) {
        time = net_.stages_time(mine.weights);
        if (best_ < 0 || time < best_time) {
          best_ = i;
          best_time = time;
        }
      }
      char buf[160];
      if (fits)
        std::snprintf(buf, sizeof buf, "%s%s %zu stages %.4g ms", reason_.empty() ? "" : ", ",
                      std::remove_cvref_t<decltype(dec)>::name, mine.size(), time * 1e3);
      else
        std::snprintf(buf, sizeof buf, "%s%s over the size limit", reason_.empty() ? "" : ", ",
                      std::remove_cvref_t<decltype(dec)>::name);
      reason_ += buf;
      names_[i] = std::remove_cvref_t<decltype(dec)>::name;
      ++i;
    };
    std::apply([&](auto&... dec) { (try_one(dec), ...); }, members_);
    if (best_ < 0)
      throw plan_too_large("every decomposer of best-of exceeds the plan size limit (" + reason_ + ")");
    reason_ = std::string("scale-out model (alpha ") + std::to_string(net_.alpha_s * 1e6).substr(0, 5) +
              " us per stage): " + reason_;
    out.reset(m.rows());
    std::swap(out.weights, candidates_[best_].weights);
    std::swap(out.perms, candidates_[best_].perms);
  }

  /// Name of the decomposer whose stages the last call kept.
  const char* chosen() const noexcept { return best_ < 0 ? name : names_[best_]; }
  /// Why: every member's stage count and modelled scale-out time.
  const std::string& reason() const noexcept { return reason_; }

private:
  scaleout_model net_;
  std::tuple<Ds...> members_;
  stage_list candidates_[sizeof...(Ds)];
  const char* names_[sizeof...(Ds)] = {};
  int best_ = -1;
  std::string reason_;
};

static_assert(Decomposer<best_of_decomposer<birkhoff_decomposer, spread_out_decomposer>>);

} // namespace fasta2a
