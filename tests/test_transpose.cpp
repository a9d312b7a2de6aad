// The plan of the transposed matrix made from a plan (include/fasta2a/transpose.hpp): an MoE
// layer's combine after its dispatch. Built after test_planner.cpp, in the same translation unit
// (test_planner_and_decomposers, a unity build: tests/CMakeLists.txt), whose random_case it uses.
#include <doctest/doctest.h>

#include "checks.hpp"
#include "workloads.hpp"

#include <random>

#include "fasta2a/factorized.hpp"
#include "fasta2a/fewer_stages.hpp"
#include "fasta2a/planner.hpp"
#include "fasta2a/transpose.hpp"

using namespace fasta2a;
using fasta2a::testing::check_plan;
using fasta2a::testing::rank_work;

namespace {

// The staging offsets the planner's layout gives p's pieces (detail::assign_staging, as for a plan
// read back from a file): a transposed plan whose regions or positions are off differs from these.
std::vector<std::pair<bytes_t, bytes_t>> laid_out(plan p) {
  detail::assign_staging(p);
  std::vector<std::pair<bytes_t, bytes_t>> v;
  for (const piece& pc : p.pieces) v.push_back({pc.stage_out, pc.stage_in});
  return v;
}
// p's op index built as the planner builds it, from its pieces.
plan reindexed(plan p) {
  detail::index_builder<> index;
  index.begin(p);
  for (const piece& pc : p.pieces) index.add(pc);
  index.finish();
  return p;
}
std::vector<std::pair<bytes_t, bytes_t>> offsets(const plan& p) {
  std::vector<std::pair<bytes_t, bytes_t>> v;
  for (const piece& pc : p.pieces) v.push_back({pc.stage_out, pc.stage_in});
  return v;
}

// Whole plans and every rank's view of t, transposed, against the plans of t's transpose: checked
// with the verifier (exact where the decomposer is), the layout of read-back plans, the views
// against the transposed whole plan, and transposing back.
// The balance bytes of q, the transpose of a plan whose are `b`: each rank's receive part.
std::vector<bytes_t> flipped(const plan& q, const std::vector<bytes_t>& b) {
  std::vector<bytes_t> f(b.size());
  for (std::size_t r = 0; r < b.size(); ++r) f[r] = q.staging_bytes[r] - b[r];
  return f;
}

template <class Planner>
void check_transposes(Planner pl, const traffic_matrix& t, std::size_t& ring_plans, std::size_t& rail_plans) {
  const traffic_matrix tt = t.transpose();
  const plan p = pl.make(t);
  const server_matrix m = pl.rail_matrix();
  const std::vector<bytes_t> bal = pl.balance_bytes();
  const plan q = transposed(p, m, bal);
  // What p passes, q passes: the weights sum to the bound where p's do (exact decomposers).
  check_plan(q, tt, verify(p, t, {.exact_lower_bound = true}).ok);
  CHECK(q.stage_weight == p.stage_weight);
  CHECK(q.staging_bytes == p.staging_bytes);
  CHECK(q.scaleup_bytes == p.scaleup_bytes);
  CHECK(q.pieces.size() == p.pieces.size());
  if (p.staged && p.staging_ring == 0) CHECK(offsets(q) == laid_out(q));
  const plan qi = reindexed(q);
  CHECK(q.op_offsets == qi.op_offsets);
  CHECK(q.op_list == qi.op_list);
  ring_plans += p.staging_ring > 0;
  rail_plans += p.per_rail() && p.staging_ring == 0;
  if (p.per_rail()) { // each rail's t-th permutation inverted
    const auto S = static_cast<std::size_t>(p.servers);
    for (std::size_t i = 0; i < p.rail_perm.size(); ++i)
      if (p.rail_perm[i] >= 0) CHECK(q.rail_perm[i - i % S + static_cast<std::size_t>(p.rail_perm[i])] == static_cast<std::int32_t>(i % S));
  }
  // Transposing back gives p, op for op.
  fasta2a::testing::check_same_plan(transposed(q, server_matrix(m.transpose()), flipped(q, bal)), p);
  // Each rank's view transposes to the transposed whole plan's view: what every rank of a call
  // computes on its own fits together.
  const rank_t n = p.ranks();
  plan v, w;
  for (rank_t r = 0; r < n; ++r) {
    pl.make_rank_into(t, r, v);
    CHECK(pl.balance_bytes() == bal); // a view's balance bytes are the whole plan's
    transpose_into(v, pl.rail_matrix(), w, pl.balance_bytes());
    CHECK(w.view == r);
    CHECK(w.stage_perm == q.stage_perm);
    CHECK(w.staging_bytes == q.staging_bytes);
    CHECK(w.op_list == reindexed(w).op_list);
    CHECK(rank_work(w, r) == rank_work(q, r));
    const verify_result vr = verify_rank_view(w, tt);
    INFO(vr.error);
    CHECK(vr.ok);
  }
}

} // namespace

TEST_CASE("transpose.transposed_plans_verify_match_every_view_and_transpose_back") {
  std::mt19937_64 rng(1313);
  std::size_t ring_plans = 0, rail_plans = 0;
  for (int iter = 0; iter < 200; ++iter) {
    const int S = 1 + static_cast<int>(rng() % 6), G = 1 + static_cast<int>(rng() % 5);
    const bytes_t granule = 1 + rng() % 3;
    const traffic_matrix t = random_case(rng, S * G, G, granule);
    const two_tier_topology topo(S, G);
    plan_options opt{.granule = granule};
    if (iter % 2 == 1) // a budget below what most of these plans lay out: staging shared across stages
      opt.staging_budget = staging_budget_for(largest_buffer(t), 0.05 + static_cast<double>(rng() % 40) / 100, opt);
    if (iter % 5 == 2) opt.direct_if_faster_alpha = 1e-3; // small matrices: the direct plan wins
    // Per-rail schedules, without a budget (their regions are their streams) and with one.
    if (iter % 4 == 0) opt.rails = rail_schedule::per_rail;
    if (iter % 4 == 3) opt.rails = iter % 8 == 3 ? rail_schedule::per_rail : rail_schedule::automatic;
    CAPTURE(iter);
    CAPTURE(S);
    CAPTURE(G);
    check_transposes(planner<two_tier_topology>(topo, opt), t, ring_plans, rail_plans);
    if (iter % 3 == 0) {
      check_transposes(planner<two_tier_topology, slack_decomposer>(topo, opt), t, ring_plans, rail_plans);
      check_transposes(planner<two_tier_topology, quantized_decomposer>(topo, opt), t, ring_plans, rail_plans);
      check_transposes(planner<two_tier_topology, direct_decomposer>(topo, opt), t, ring_plans, rail_plans);
    }
  }
  MESSAGE(ring_plans << " plans shared staging across stages, " << rail_plans << " per-rail plans did not");
  CHECK(ring_plans >= 15);
  CHECK(rail_plans >= 15);
}

TEST_CASE("transpose.the_megatron_trace_and_zipf_at_8_gpus_per_server") {
  // The compile-time topology of 8 GPUs (transpose_into<8>), the trace's matrices (4 x 8) and Zipf at
  // 8 x 8, factorized and slack: the plans of a dispatch, transposed, are plans of its combine.
  std::vector<traffic_matrix> in;
  if (testing::have_megatron()) {
    const auto trace = read_trace(testing::megatron, 32, 8192);
    for (std::size_t k = 0; k < trace.size(); k += 75) in.push_back(trace[k]);
  }
  for (int k = 0; k < 4; ++k) in.push_back(zipf_traffic(64, 1.0, bytes_t{64} << 20, 40 + k, 8192));
  REQUIRE(in.size() >= 4);
  for (const traffic_matrix& t : in) {
    const int S = static_cast<int>(t.rows() / 8);
    auto go = [&](auto pl) {
      const plan p = pl.make(t);
      const plan q = transposed<8>(p, pl.rail_matrix(), pl.balance_bytes());
      check_plan(q, t.transpose(), verify(p, t, {.exact_lower_bound = true}).ok);
      CHECK(q.stages() == p.stages());
      plan v;
      const rank_t r = static_cast<rank_t>(t.rows()) - 3;
      pl.make_rank_into(t, r, v);
      CHECK(rank_work(transposed<8>(v, pl.rail_matrix(), pl.balance_bytes()), r) == rank_work(q, r));
    };
    go(planner<fixed_topology<8>, slack_decomposer>(h200_cluster(S), {.granule = 8192}));
    go(planner<fixed_topology<8>, factorized_decomposer>(h200_cluster(S), {.granule = 8192}));
    go(planner<fixed_topology<8>, factorized_decomposer>(h200_cluster(S),
                                                         {.granule = 8192, .rails = rail_schedule::per_rail}));
  }
}

TEST_CASE("transpose.refuses_a_server_matrix_of_another_shape_and_a_per_rail_plan_without_its_balance_bytes") {
  const traffic_matrix t = zipf_traffic(16, 1.0, 1 << 20, 3, 64);
  planner<two_tier_topology> shared(two_tier_topology(4, 4), {.granule = 64});
  const plan p = shared.make(t);
  CHECK_THROWS_WITH_AS(transposed(p, server_matrix::Zero(3, 4)), doctest::Contains("server matrix is 3 x 4"), error);
  CHECK_THROWS_WITH_AS(transposed<8>(p, shared.rail_matrix()), doctest::Contains("4 GPUs per server"), error);
  planner<two_tier_topology> rails(two_tier_topology(4, 4), {.granule = 64, .rails = rail_schedule::per_rail});
  const plan r = rails.make(t);
  REQUIRE(r.per_rail());
  CHECK_THROWS_WITH_AS(transposed(r, rails.rail_matrix()), doctest::Contains("needs every rank's balance bytes"), error);
  std::vector<bytes_t> bal = rails.balance_bytes();
  REQUIRE(bal.size() == 16);
  CHECK_NOTHROW(transposed(r, rails.rail_matrix(), bal));
  bal[5] = r.staging_bytes[5] + 1;
  CHECK_THROWS_WITH_AS(transposed(r, rails.rail_matrix(), bal), doctest::Contains("rank 5's balance bytes"), error);
  // In place.
  plan q = p;
  transpose_into(q, shared.rail_matrix(), q);
  CHECK(q.pieces == transposed(p, shared.rail_matrix()).pieces);
}
