// The cost model: lower bounds, predictions, and the one scale-out model (scaleout_model) that
// predictions, the planner's direct fallback and the decomposers all price stages with.
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

// The pipelined model (cost_params::rail_window, prediction::pipelined_s): figures worked out by
// hand on 3 servers x 1 GPU (no scale-up hops), 50 GB/s NICs, alpha 10 us.
TEST_CASE("cost_model.pipelined_model_matches_hand_computed_figures") {
  const two_tier_topology topo(3, 1);
  const double a = 10e-6;
  SUBCASE("two shifts, every rail of a stage equal: window 1 is the step-synchronous figure, window 2 saves one alpha") {
    // Shift 1 carries 30 MB on every rail, shift 2 10 MB.
    traffic_matrix t = traffic_matrix::Zero(3, 3);
    for (rank_t i = 0; i < 3; ++i) {
      t(i, (i + 1) % 3) = 30'000'000;
      t(i, (i + 2) % 3) = 10'000'000;
    }
    const plan p = make_plan<spread_out_decomposer>(topo, t);
    REQUIRE(p.stages() == 2);
    // Step-synchronous: 2 alpha + 40 MB / 50 GB/s = 0.82 ms.
    const prediction w1 = predict(topo, p, {.alpha = a, .rail_window = 1});
    CHECK(w1.step_synchronous_s() == doctest::Approx(0.82e-3).epsilon(1e-9));
    REQUIRE(w1.pipelined_s);
    CHECK(*w1.pipelined_s == doctest::Approx(0.82e-3).epsilon(1e-9));
    // Window 2: both stages posted at once, alive after one alpha; every NIC carries two flows at
    // b/2 until the 10 MB one ends (0.4 ms), then the 30 MB one's last 20 MB at b (0.4 ms): 0.81 ms.
    const prediction w2 = predict(topo, p, {.alpha = a, .rail_window = 2});
    CHECK(*w2.pipelined_s == doctest::Approx(0.81e-3).epsilon(1e-9));
    CHECK(w2.total_s == doctest::Approx(0.82e-3).epsilon(1e-9)); // the step-synchronous figure is unchanged
    // Without a window (0, the default) nothing but the step-synchronous model runs.
    CHECK_FALSE(predict(topo, p, {.alpha = a}).pipelined_s);
    CHECK_FALSE(predict(topo, p, {.alpha = a, .rail_window = 0}).pipelined_s);
  }
  SUBCASE("unequal rails: each rank paces itself, so window 1 beats lock step") {
    // Stage 0 (shift 1): 0->1 30 MB, 1->2 10 MB, 2->0 10 MB; stage 1 (shift 2): 0->2 10 MB,
    // 1->0 30 MB, 2->1 10 MB. Lock step: 2 alpha + 30 + 30 MB = 1.22 ms. Window 1 (times in ms,
    // a = 0.01): the 10 MB flows 1->2 and 2->0 end at 0.21; rank 1's 30 MB to rank 0 then runs
    // alone 0.22 - 0.82; rank 2's 10 MB to rank 1 starts at 0.22 and shares rank 1's receiver with
    // 0->1 (10.5 MB sent, 19.5 MB left): both at b/2 until 2->1 ends at 0.62, 0->1's last 9.5 MB
    // at b ends at 0.81; rank 0's 10 MB to rank 2 then starts at 0.82 and ends at 1.02.
    traffic_matrix t = traffic_matrix::Zero(3, 3);
    t(0, 1) = 30'000'000, t(1, 2) = 10'000'000, t(2, 0) = 10'000'000;
    t(0, 2) = 10'000'000, t(1, 0) = 30'000'000, t(2, 1) = 10'000'000;
    const plan p = make_plan<spread_out_decomposer>(topo, t);
    REQUIRE(p.stages() == 2);
    bool shift1_first = false;
    for (const piece& pc : p.pieces)
      if (pc.src == 0 && pc.dst == 1) shift1_first = pc.stage == 0;
    REQUIRE(shift1_first);
    const prediction w1 = predict(topo, p, {.alpha = a, .rail_window = 1});
    CHECK(w1.total_s == doctest::Approx(1.22e-3).epsilon(1e-9));
    CHECK(*w1.pipelined_s == doctest::Approx(1.02e-3).epsilon(1e-9));
  }
}

// Properties of the pipelined model on many skewed matrices: it never beats the NICs (every rail
// byte of the busiest NIC at b_out, plus one alpha), and with every stage in flight on 2 servers
// (one peer per rail) and alpha 0 it is exactly the busiest NIC's time. It is NOT always below lock
// step: a rank that runs ahead shares a receiver with a stage that is late, and fair sharing can
// slow the later one more than lock step would (seen here at window 1 on 3 and 4 servers).
TEST_CASE("cost_model.pipelined_model_between_the_nic_bound_and_lock_step") {
  std::mt19937_64 rng(29);
  for (int iter = 0; iter < 60; ++iter) {
    const int S = 2 + static_cast<int>(rng() % 5), G = 1 + static_cast<int>(rng() % 4);
    const double alpha = iter % 3 == 0 ? 0.0 : 20e-6;
    // Scale-up far faster than the NICs, so that the scale-out figures can be checked alone.
    const two_tier_topology topo(S, G, link_model{scaleup_kind::switch_fabric, 1e15, 50e9, alpha});
    const traffic_matrix t = zipf_traffic(S * G, 0.6 + 0.2 * (iter % 4), 1 << 24, rng(), 4096);
    const plan p = iter % 2 ? make_plan(topo, t, {.granule = 4096})
                            : make_plan<bottleneck_decomposer>(topo, t, {.granule = 4096});
    std::vector<double> tx(S * G, 0), rx(S * G, 0);
    for (const piece& pc : p.pieces)
      for (const hop& h : p.route_of(pc))
        if (h.kind == hop_kind::rail) tx[h.from] += pc.bytes, rx[h.to] += pc.bytes;
    const double nic = std::max(*std::max_element(tx.begin(), tx.end()), *std::max_element(rx.begin(), rx.end())) / 50e9;
    const prediction lock = predict(topo, p);
    double before = 0;
    for (std::size_t W : {std::size_t{1}, std::size_t{2}, std::size_t{5}, p.stages() + 1}) {
      const double pipe = *predict(topo, p, {.rail_window = W}).pipelined_s;
      INFO("iter " << iter << " S " << S << " G " << G << " W " << W << " stages " << p.stages());
      CHECK(pipe >= nic + (nic > 0 ? alpha : 0) - 1e-12);
      if (W > p.stages()) CHECK(pipe <= lock.total_s + lock.scaleup_s + 1e-12);
      if (W == p.stages() + 1 && S == 2 && alpha == 0) CHECK(pipe == doctest::Approx(nic).epsilon(1e-6));
      before = pipe;
    }
    static_cast<void>(before);
  }
}
