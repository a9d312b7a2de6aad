// The cost model: lower bounds, predictions, and the one scale-out model (scaleout_model) that
// predictions, the planner's direct fallback and the decomposers all price stages with.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "fasta2a/cost_model.hpp"
#include "fasta2a/fewer_stages.hpp"
#include "fasta2a/planner.hpp"

using namespace fasta2a;

TEST_CASE("cost_model.bounds_and_predictions_are_consistent") {
  std::mt19937_64 rng(17);
  for (int iter = 0; iter < 100; ++iter) {
    const int S = 2 + static_cast<int>(rng() % 6);
    const auto topo = iter % 2 ? h200_cluster(S) : mi300x_cluster(S);
    const auto t = zipf_traffic(S * 8, 1.2, 1 << 24, rng(), 4096);
    const lower_bounds lb = lower_bound(topo, t);
    const prediction f = predict(topo, make_plan(topo, t, {.granule = 4096}), {.alpha = 10e-6});
    const prediction s = predict(topo, make_plan<spread_out_decomposer>(topo, t, {.granule = 4096}), {.alpha = 10e-6});
    const prediction d = predict(topo, make_plan<direct_decomposer>(topo, t), {.alpha = 10e-6});
    CHECK(f.total_s >= lb.overall_s());
    CHECK(s.total_s >= lb.overall_s());
    CHECK(d.total_s >= lb.scaleout_s);
    // FAST's scale-out phase is the lower bound plus one alpha per stage (within rounding).
    CHECK(f.scaleout_s == doctest::Approx(lb.scaleout_s + f.stages * 10e-6).epsilon(1e-6));
    // Spread-out's shifts each wait for their largest pair: never better than exact Birkhoff.
    CHECK(s.scaleout_s - s.stages * 10e-6 >= f.scaleout_s - f.stages * 10e-6 - 1e-12);
    // With alpha = 0, modelled time is monotone in alpha.
    CHECK(predict(topo, make_plan(topo, t), {.alpha = 0}).total_s <= predict(topo, make_plan(topo, t), {.alpha = 1e-5}).total_s);
  }
}

TEST_CASE("cost_model.predictions_match_hand_computed_figures") {
  // Values worked out by hand, not by the model's own functions (issue 12: tests that compared two
  // predictions of one model let alpha vanish from direct sending unnoticed).
  // 2 servers x 1 GPU, 50 GB/s NICs, alpha 10 us: rank 0 sends 50 MB to rank 1, rank 1 sends 20 MB to 0.
  traffic_matrix t = traffic_matrix::Zero(2, 2);
  t(0, 1) = 50'000'000;
  t(1, 0) = 20'000'000;
  const two_tier_topology topo(2, 1);
  REQUIRE(topo.scaleout_bandwidth() == 50e9);
  // Direct: the busiest NIC moves 50 MB (1 ms) after one synchronisation: 1.010 ms.
  const prediction d = predict(topo, make_plan<direct_decomposer>(topo, t), {.alpha = 10e-6});
  CHECK(d.scaleout_s == doctest::Approx(1.010e-3).epsilon(1e-9));
  CHECK(d.total_s == doctest::Approx(1.010e-3).epsilon(1e-9));
  // FAST: the pair swaps in one stage of 50 MB per rail (both directions at once): 1.010 ms too;
  // with alpha 0 exactly the lower bound, 1 ms.
  const prediction f = predict(topo, make_plan(topo, t), {.alpha = 10e-6});
  CHECK(f.stages == 1);
  CHECK(f.scaleout_s == doctest::Approx(1.010e-3).epsilon(1e-9));
  CHECK(predict(topo, make_plan(topo, t), {.alpha = 0}).scaleout_s == doctest::Approx(1e-3).epsilon(1e-9));
  CHECK(lower_bound(topo, t).scaleout_s == doctest::Approx(1e-3).epsilon(1e-9));
  // No byte crosses servers: direct costs nothing at all, not one alpha.
  traffic_matrix self = traffic_matrix::Zero(2, 2);
  self(0, 0) = 1000;
  CHECK(predict(topo, make_plan<direct_decomposer>(topo, self), {.alpha = 10e-6}).scaleout_s == 0.0);
  // Scale-up only: 1 server x 2 GPUs, 450 MB from GPU 0 to GPU 1 over 450 GB/s ports: 1 ms of
  // scale-up, no scale-out. The overall bound and direct's total are the larger phase, 1 ms.
  const two_tier_topology one(1, 2);
  REQUIRE(one.scaleup_bandwidth() == 450e9);
  traffic_matrix up = traffic_matrix::Zero(2, 2);
  up(0, 1) = 450'000'000;
  CHECK(lower_bound(one, up).scaleout_s == 0.0);
  CHECK(lower_bound(one, up).scaleup_s == doctest::Approx(1e-3).epsilon(1e-9));
  CHECK(lower_bound(one, up).overall_s() == doctest::Approx(1e-3).epsilon(1e-9));
  const prediction du = predict(one, make_plan<direct_decomposer>(one, up), {.alpha = 10e-6});
  CHECK(du.scaleout_s == 0.0);
  CHECK(du.total_s == doctest::Approx(1e-3).epsilon(1e-9));
}

TEST_CASE("cost_model.predict_reads_the_topology_scaleout_model") {
  std::mt19937_64 rng(23);
  for (int iter = 0; iter < 40; ++iter) {
    const int S = 2 + static_cast<int>(rng() % 6);
    const double alpha = (iter % 4) * 7e-6;
    const link_model links{scaleup_kind::switch_fabric, 450e9, 25e9, alpha};
    const fixed_topology<8> topo(S, links), plain(S, link_model{scaleup_kind::switch_fabric, 450e9, 25e9});
    const auto t = zipf_traffic(S * 8, 1.1, bytes_t{1} << (14 + rng() % 10), rng(), 64);
    const plan staged = make_plan(topo, t, {.granule = 64});
    const plan direct = make_plan<direct_decomposer>(topo, t);
    for (const plan* p : {&staged, &direct}) {
      // The topology's alpha, or the same alpha asked for on a topology without it: one figure.
      const prediction a = predict(topo, *p), b = predict(plain, *p, {.alpha = alpha});
      CHECK(a.total_s == b.total_s);
      CHECK(a.scaleout_s == b.scaleout_s);
      CHECK(a.scaleup_s == b.scaleup_s);
    }
    // The scale-out phase is exactly the model's: stage times summed, or one direct round.
    const scaleout_model net = scaleout_of(topo);
    CHECK(predict(topo, staged).scaleout_s == net.stages_time(staged.stage_weight));
    std::vector<bytes_t> send(S * 8, 0), recv(S * 8, 0);
    for (rank_t i = 0; i < S * 8; ++i)
      for (rank_t j = 0; j < S * 8; ++j)
        if (i / 8 != j / 8) {
          send[i] += t(i, j);
          recv[j] += t(i, j);
        }
    const bytes_t nic =
        std::max(*std::max_element(send.begin(), send.end()), *std::max_element(recv.begin(), recv.end()));
    CHECK(predict(topo, direct).scaleout_s == net.direct_time(nic));
  }
  const auto topo = h200_cluster(2);
  const plan p = make_plan(topo, uniform_traffic(16, 1 << 20, 1));
  CHECK_THROWS_WITH_AS(predict(topo, p, {.alpha = -1.0}), doctest::Contains("alpha"), error);
}

TEST_CASE("cost_model.direct_fallback_agrees_with_predict") {
  // The planner's fallback and predict price the scale-out phase with the same model, so the
  // fallback sends directly exactly where predict says direct's scale-out phase is shorter.
  std::mt19937_64 rng(77);
  int went_direct = 0, stayed = 0;
  for (int iter = 0; iter < 60; ++iter) {
    const int S = 2 + static_cast<int>(rng() % 7);
    const auto topo = iter % 2 ? h200_cluster(S) : mi300x_cluster(S);
    const auto t = zipf_traffic(S * 8, 1.2, bytes_t{1} << (10 + rng() % 18), rng(), 64);
    for (const double alpha : {2e-6, 20e-6}) {
      const plan adaptive = make_plan(topo, t, {.granule = 64, .direct_if_faster_alpha = alpha});
      const plan staged = make_plan(topo, t, {.granule = 64});
      const plan direct = make_plan<direct_decomposer>(topo, t);
      const double fast_s = predict(topo, staged, {.alpha = alpha}).scaleout_s;
      const double direct_s = predict(topo, direct, {.alpha = alpha}).scaleout_s;
      CAPTURE(iter);
      CAPTURE(alpha);
      CHECK(adaptive.staged == !(direct_s < fast_s));
      (adaptive.staged ? stayed : went_direct) += 1;
    }
  }
  // The sizes span both outcomes, so the agreement is tested on each side.
  CHECK(went_direct > 0);
  CHECK(stayed > 0);
  CHECK_THROWS_WITH_AS(planner<fixed_topology<8>>(h200_cluster(2), {.direct_if_faster_alpha = -1e-6}),
                       doctest::Contains("alpha"), error);
}

TEST_CASE("cost_model.lb_alpha_counts_server_peers_and_bounds_every_staged_plan") {
  std::mt19937_64 rng(808);
  for (int iter = 0; iter < 200; ++iter) {
    const int S = 1 + static_cast<int>(rng() % 8), G = 1 + static_cast<int>(rng() % 4);
    const rank_t n = S * G;
    traffic_matrix t = traffic_matrix::Zero(n, n);
    // Random sparse server pairs: a pair carries traffic on one random GPU pair or not at all.
    std::vector<int> out_deg(S, 0), in_deg(S, 0);
    for (int s = 0; s < S; ++s)
      for (int d = 0; d < S; ++d) {
        if (s == d || rng() % 3 == 0) continue;
        t(s * G + static_cast<rank_t>(rng() % G), d * G + static_cast<rank_t>(rng() % G)) = 1 + rng() % 100000;
        ++out_deg[s];
        ++in_deg[d];
      }
    for (rank_t i = 0; i < n; ++i) t(i, i) = rng() % 1000; // a rank's own bytes are not a peer
    const two_tier_topology topo(S, G);
    const lower_bounds lb = lower_bound(topo, t);
    int want = 0;
    for (int s = 0; s < S; ++s) want = std::max({want, out_deg[s], in_deg[s]});
    CAPTURE(iter);
    CHECK(lb.peer_degree == want);
    const double alpha = 1e-6 * static_cast<double>(rng() % 50);
    CHECK(lb.staged_s(alpha) == doctest::Approx(std::max(lb.scaleout_s + want * alpha, lb.scaleup_s)));
    CHECK(lb.staged_s(alpha) >= lb.overall_s());
    // Every exact staged plan pays at least one stage per peer: its model time is above LB_alpha.
    for (int which = 0; which < 2; ++which) {
      const plan p = which == 0 ? make_plan(topo, t) : make_plan<slack_decomposer>(topo, t);
      CHECK(p.stages() >= static_cast<std::size_t>(want));
      const prediction pr = predict(topo, p, {.alpha = alpha});
      CHECK(pr.total_s >= lb.staged_s(alpha) * (1 - 1e-9));
    }
  }
}
