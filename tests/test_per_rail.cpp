// Per-rail schedules (plan_options::rails): each server pair's bytes on one rail, each rail's
// matrix decomposed on its own. Plans verified whole and as rank views on many seeded matrices,
// views equal to the whole plan for their rank, the automatic choice the faster one in the model,
// and the verifier's per-rail checks able to fail.
#include <doctest/doctest.h>

#include "checks.hpp"
#include "workloads.hpp"

#include <algorithm>
#include <random>

#include "fasta2a/cost_model.hpp"
#include "fasta2a/planner.hpp"
#include "fasta2a/registry.hpp"
#include "fasta2a/verify.hpp"

using namespace fasta2a;
using fasta2a::testing::rank_work;

namespace {

// A seeded matrix of one of a few shapes, zero rows and single entries among them.
traffic_matrix some_matrix(std::mt19937_64& rng, rank_t n) {
  const std::uint64_t seed = rng();
  const bytes_t per_rank = (rng() % 4096 + 1) * 64;
  switch (rng() % 7) {
  case 0: return uniform_traffic(n, per_rank, seed);
  case 1: return zipf_traffic(n, 0.5 + (rng() % 100) / 50.0, per_rank, seed);
  case 2: return hotspot_traffic(n, 1 + static_cast<rank_t>(rng() % n), 0.7, per_rank, seed);
  case 3: return lognormal_traffic(n, 1.5, per_rank, seed);
  case 4: return traffic_matrix::Zero(n, n);
  case 5: {
    traffic_matrix m = traffic_matrix::Zero(n, n);
    m(static_cast<rank_t>(rng() % n), static_cast<rank_t>(rng() % n)) = rng() % 100000 + 1;
    return m;
  }
  default: {
    traffic_matrix m = zipf_traffic(n, 1.0, per_rank, seed);
    for (rank_t i = 0; i < n; ++i)
      if (rng() % 3 == 0) m.row(i).setZero();
    return m;
  }
  }
}

// Every property a per-rail plan of t must have, whole and as every rank's view.
template <class Planner>
void check_per_rail(Planner& pl, const traffic_matrix& t, bool exact) {
  const plan whole = pl.make(t);
  const verify_result v = verify(whole, t, {.exact_lower_bound = exact});
  INFO(v.error);
  REQUIRE(v.ok);
  const int S = whole.servers, G = whole.gpus_per_server;
  // Each pair's bytes on one rail, and the rails' stages are the plan's.
  if (whole.stages() > 0) {
    REQUIRE(whole.per_rail());
    for (std::size_t st = 0; st < whole.stages(); ++st) {
      bytes_t most = 0;
      for (int k = 0; k < G; ++k) most = std::max(most, whole.weight(st, k));
      CHECK(whole.stage_weight[st] == most);
    }
  }
  std::vector<int> rail_of(static_cast<std::size_t>(S) * S, -1);
  for (const piece& pc : whole.pieces) {
    if (pc.rail < 0) continue;
    int& r = rail_of[static_cast<std::size_t>(pc.src / G) * S + pc.dst / G];
    if (r < 0) r = pc.rail;
    CHECK(r == pc.rail);
  }
  // Rank views: the same stages and the same work as the whole plan, and they verify.
  plan view;
  for (rank_t r = 0; r < S * G; ++r) {
    pl.make_rank_into(t, r, view);
    CHECK(view.rail_weight == whole.rail_weight);
    CHECK(view.rail_perm == whole.rail_perm);
    CHECK(view.stage_weight == whole.stage_weight);
    CHECK(view.staging_bytes == whole.staging_bytes);
    CHECK(rank_work(view, r) == rank_work(whole, r));
    const verify_result vr = verify_rank_view(view, t);
    INFO(vr.error);
    CHECK(vr.ok);
  }
  // Planning again gives the same plan.
  const plan again = pl.make(t);
  CHECK(again.pieces == whole.pieces);
  CHECK(again.rail_perm == whole.rail_perm);
}
} // namespace

TEST_CASE("per_rail.plans_verify_and_views_match_on_random_matrices") {
  std::mt19937_64 rng(20261204);
  for (int iter = 0; iter < 160; ++iter) {
    const int S = 2 + static_cast<int>(rng() % 9), G = 2 + static_cast<int>(rng() % 5);
    const traffic_matrix t = some_matrix(rng, S * G);
    const two_tier_topology topo(S, G);
    CAPTURE(iter);
    CAPTURE(S);
    CAPTURE(G);
    plan_options opt{.rails = rail_schedule::per_rail};
    if (iter % 3 == 1) opt.staging_budget = staging_budget_for(largest_buffer(t), 0.1, opt);
    planner<two_tier_topology, birkhoff_decomposer> exact(topo, opt);
    check_per_rail(exact, t, true);
    if (iter % 4 == 0) {
      planner<two_tier_topology, slack_decomposer> slack(topo, opt);
      check_per_rail(slack, t, true);
      with_decomposer("best", {.scaleout = scaleout_of(topo)}, [&](auto dec) {
        planner<two_tier_topology, decltype(dec)> best(topo, opt, std::move(dec));
        check_per_rail(best, t, false);
      });
    }
  }
}

TEST_CASE("per_rail.fixed_topology_of_8_rails_on_tiled_megatron_and_zipf") {
  // The specialised 8-GPU planner (phase 1's 8-rail search) with per-rail capacities.
  std::mt19937_64 rng(88);
  for (int iter = 0; iter < 12; ++iter) {
    const int S = 3 + static_cast<int>(rng() % 10);
    const traffic_matrix t = iter % 2 == 0 ? zipf_traffic(S * 8, 1.0, 64 << 20, rng())
                                           : hotspot_traffic(S * 8, 1 + static_cast<rank_t>(rng() % 8), 0.5, 16 << 20, rng());
    CAPTURE(iter);
    planner<fixed_topology<8>, birkhoff_decomposer> pl(h200_cluster(S), {.rails = rail_schedule::per_rail});
    check_per_rail(pl, t, true);
  }
}

TEST_CASE("per_rail.automatic_keeps_what_the_model_predicts_faster") {
  // At 40 servers per-rail schedules need far fewer stages than S - 1 and win in the model; at 4
  // servers of uniform traffic the shared stages do. Either way the automatic plan is the faster
  // of the two, and says so.
  int per_rail_won = 0, shared_won = 0;
  for (const int S : {4, 6, 24, 40}) {
    const auto topo = h200_cluster(S);
    const scaleout_model net = scaleout_of(topo);
    for (std::uint64_t seed = 1; seed <= 3; ++seed) {
      // hot-spot at 40 servers: a twentieth of the ranks receive half of every rank's bytes (the
      // grid's hot-spot), where the slowest rail's 9 stages gain more than its ends' scale-up costs
      const traffic_matrix t = S <= 6                 ? uniform_traffic(S * 8, 64 << 20, seed)
                               : S == 40 && seed != 1 ? hotspot_traffic(S * 8, S * 8 / 16, 0.5, 64 << 20, seed)
                                                      : zipf_traffic(S * 8, 1.0, 64 << 20, seed);
      CAPTURE(S);
      CAPTURE(seed);
      auto make = [&](rail_schedule r) {
        return with_decomposer("best", {.scaleout = net}, [&](auto dec) {
          return planner<fixed_topology<8>, decltype(dec)>(topo, {.rails = r}, std::move(dec)).make(t);
        });
      };
      const plan shared = make(rail_schedule::shared), rails = make(rail_schedule::per_rail),
                 chosen = make(rail_schedule::automatic);
      CHECK_FALSE(shared.per_rail());
      CHECK(rails.per_rail());
      // compared with the scale-up work at both ends that no stage hides (rails_choice_time)
      const double a = rails_choice_time(topo, shared, net), b = rails_choice_time(topo, rails, net);
      CHECK(rails_choice_time(topo, chosen, net) == doctest::Approx(std::min(a, b)));
      CHECK(a > scaleout_time(shared, net));
      CHECK(b - scaleout_time(rails, net) > a - scaleout_time(shared, net)); // whole pairs gathered: heavier ends
      CHECK(chosen.per_rail() == (b < a));
      CHECK(chosen.choice.find(b < a ? "per-rail is faster" : "shared is faster") != std::string::npos);
      (b < a ? per_rail_won : shared_won) += 1;
      const verify_result v = verify(chosen, t);
      INFO(v.error);
      CHECK(v.ok);
      if (S == 40) { // far fewer stages on the slowest rail than any shared schedule can have
        std::size_t most = 0;
        for (int k = 0; k < 8; ++k) {
          std::size_t n = 0;
          for (std::size_t st = 0; st < rails.stages(); ++st) n += rails.weight(st, k) > 0;
          most = std::max(most, n);
        }
        CHECK(most < static_cast<std::size_t>(S - 1));
        CHECK(scaleout_time(rails, net) < scaleout_time(shared, net));
      }
    }
  }
  CHECK(per_rail_won > 0);
  CHECK(shared_won > 0);
}

TEST_CASE("per_rail.the_step_synchronous_model_lets_each_rail_run_its_own_stages") {
  // predict's total for a per-rail plan: each rail's own steps, not every rail held to the
  // heaviest rail of each stage. It is at least the slowest rail's scale-out phase and every port's
  // scale-up work, at most the figure with the rails in step (the same plan read as a shared plan
  // whose stages weigh their heaviest rail), and below it where the rails' stages differ.
  std::mt19937_64 rng(77);
  int below = 0;
  for (int iter = 0; iter < 24; ++iter) {
    const int S = 3 + static_cast<int>(rng() % 10), G = 2 + static_cast<int>(rng() % 4);
    const two_tier_topology topo(S, G);
    const traffic_matrix t = some_matrix(rng, S * G);
    const plan p = planner<two_tier_topology, slack_decomposer>(topo, {.rails = rail_schedule::per_rail}).make(t);
    if (!p.per_rail()) continue; // nothing between servers
    CAPTURE(iter);
    const scaleout_model net = scaleout_of(topo);
    const prediction own = predict(topo, p);
    plan in_step = p;
    in_step.rail_perm.clear();
    in_step.rail_weight.clear();
    const prediction lock = predict(topo, in_step);
    CHECK(own.total_s >= scaleout_time(p, net) * (1 - 1e-12));
    CHECK(own.total_s >= own.scaleup_s);
    CHECK(own.total_s <= lock.total_s * (1 + 1e-12));
    below += own.total_s < lock.total_s * (1 - 1e-9);
  }
  CHECK(below > 0);
}

TEST_CASE("per_rail.the_verifier_finds_broken_per_rail_plans") {
  const auto topo = two_tier_topology(6, 4);
  const traffic_matrix t = zipf_traffic(24, 1.0, 1 << 20, 5);
  const plan good = planner<two_tier_topology, birkhoff_decomposer>(topo, {.rails = rail_schedule::per_rail}).make(t);
  REQUIRE(verify(good, t).ok);
  REQUIRE(good.per_rail());
  auto broken = [&](const char* what, auto&& change) {
    plan p = good;
    change(p);
    const verify_result v = verify(p, t);
    const std::string said = std::string(what) + " in: " + v.error;
    INFO(said);
    CHECK_FALSE(v.ok);
    CHECK(v.error.find(what) != std::string::npos);
  };
  const std::size_t T = good.stages();
  const int S = 6, G = 4;
  // An inter-server piece and its rail.
  std::size_t inter = 0;
  while (good.pieces[inter].rail < 0) ++inter;
  const piece pc = good.pieces[inter];
  broken("sends to", [&](plan& p) { // its rail's permutation no longer sends its server there
    p.rail_perm[(static_cast<std::size_t>(pc.stage) * G + pc.rail) * S + pc.src / G] = -1;
  });
  broken("weight is", [&](plan& p) { // the stage's weight still its heaviest rail's
    p.rail_weight[static_cast<std::size_t>(pc.rail) * T + pc.stage] = 1;
    bytes_t most = 0;
    for (int k = 0; k < G; ++k) most = std::max(most, p.weight(pc.stage, k));
    p.stage_weight[pc.stage] = most;
  });
  broken("heaviest rail", [&](plan& p) { p.stage_weight[0] += 1; });
  broken("server-level permutation", [&](plan& p) { p.stage_perm[0] = 1; });
  broken("do not match", [&](plan& p) { p.rail_perm.pop_back(); });
  broken("receives from two", [&](plan& p) { // two senders to one server on one rail
    std::int32_t* perm = p.rail_perm.data() + (static_cast<std::size_t>(pc.stage) * G + pc.rail) * S;
    const int s = pc.src / G, other = (s + 1) % S == perm[s] ? (s + 2) % S : (s + 1) % S;
    perm[other] = perm[s];
  });
  broken("rides 2 rails", [&](plan& p) { // a piece moved to another rail, its stage following
    piece& q = p.pieces[inter];
    const int k = (q.rail + 1) % G;
    // Its staging slots and the plan's scale-up count as the new route needs (checked first).
    q.stage_out = q.src / G * G + k == q.src ? no_staging : 0;
    q.stage_in = q.dst / G * G + k == q.dst ? no_staging : 0;
    const int before = (q.src % G != q.rail) + (q.dst % G != q.rail), after = (q.src % G != k) + (q.dst % G != k);
    p.scaleup_bytes = p.scaleup_bytes - static_cast<bytes_t>(before) * q.bytes + static_cast<bytes_t>(after) * q.bytes;
    for (std::size_t st = 0; st < T; ++st)
      if (p.rail_perm[(st * G + k) * S + q.src / G] == q.dst / G) {
        q.rail = k;
        q.stage = static_cast<std::int32_t>(st);
        return;
      }
    // No stage of rail k sends there: open one in the lightest stage of rail k where both are free.
    q.rail = k;
    q.stage = 0;
    p.rail_perm[(0 * G + k) * S + q.src / G] = q.dst / G;
  });
}

TEST_CASE("per_rail.pairs_sort_by_bytes_as_a_stable_sort_does") {
  // choose_rails visits pairs largest first, equal ones in pair order, through a radix sort that
  // moves whole items: the same order std::stable_sort gives, whatever the spread of the values
  // (one digit, several, past its four passes) and however many ties.
  std::mt19937_64 rng(2026);
  std::vector<detail::valued_pair> tmp;
  std::vector<std::size_t> count;
  int radix = 0;
  for (int iter = 0; iter < 60; ++iter) {
    const std::size_t n = iter % 6 == 0 ? rng() % 1100 : 1000 + rng() % 40000;
    const int bits = 1 + static_cast<int>(rng() % 64);
    const bytes_t base = bits == 64 ? 0 : rng() >> bits; // values base + [0, 2^bits)
    std::vector<detail::valued_pair> items(n);
    for (std::size_t i = 0; i < n; ++i) {
      const bytes_t spread = bits == 64 ? rng() : rng() & ((bytes_t{1} << bits) - 1);
      items[i] = {base + (rng() % 4 == 0 ? 0 : spread), rng(), static_cast<std::uint32_t>(i)};
    }
    std::vector<detail::valued_pair> want = items;
    std::stable_sort(want.begin(), want.end(), [](const auto& a, const auto& b) { return a.value > b.value; });
    detail::sort_by_value_desc(items, tmp, count);
    CAPTURE(iter);
    CAPTURE(n);
    CAPTURE(bits);
    REQUIRE(items.size() == want.size());
    bool same = true;
    for (std::size_t i = 0; i < n; ++i)
      same &= items[i].value == want[i].value && items[i].pair == want[i].pair && items[i].payload == want[i].payload;
    CHECK(same);
    radix += n >= 1024 && bits <= 44;
  }
  CHECK(radix > 10);
}

TEST_CASE("per_rail.no_shared_schedule_beats_the_bound_automatic_compares_with") {
  // rail_schedule::automatic skips the shared decomposition where the per-rail plan is faster than
  // phase_time(largest line sum of M, most entries in a line of M): that must bound every
  // decomposer's shared schedule of M in the scale-out model. And where it skips, the plan is the
  // per-rail plan, bit for bit, and the shared plan is indeed slower.
  std::mt19937_64 rng(4242);
  int skipped = 0;
  for (int iter = 0; iter < 30; ++iter) {
    const int S = 2 + static_cast<int>(rng() % 12);
    const auto topo = h200_cluster(S);
    const scaleout_model net = scaleout_of(topo);
    const traffic_matrix t = some_matrix(rng, S * 8);
    server_matrix m = server_matrix::Zero(S, S);
    for (int s = 0; s < S; ++s)
      for (int d = 0; d < S; ++d)
        if (s != d) m(s, d) = per_rail_bytes(t.block(s * 8, d * 8, 8, 8).sum(), 8, 1);
    bytes_t most_bytes = 0, most_entries = 0;
    for (int i = 0; i < S; ++i) {
      most_bytes = std::max({most_bytes, m.row(i).sum(), m.col(i).sum()});
      most_entries = std::max<bytes_t>({most_entries, static_cast<bytes_t>((m.row(i).array() > 0).count()),
                                        static_cast<bytes_t>((m.col(i).array() > 0).count())});
    }
    const double bound = net.phase_time(most_bytes, most_entries);
    CAPTURE(iter);
    CAPTURE(S);
    for (const std::string_view name : decomposer_names()) {
      CAPTURE(name);
      with_decomposer(std::string(name), {.scaleout = net}, [&](auto dec) {
        using D = decltype(dec);
        if constexpr (D::staged) {
          const plan shared = planner<fixed_topology<8>, D>(topo, {}, dec).make(t);
          if (shared.staged) CHECK(scaleout_time(shared, net) >= bound * (1 - 1e-12));
        }
        return 0;
      });
    }
  }
  // Where per-rail wins by more than the bound (hot-spot at 40 servers, the grid's cell: a
  // sixteenth of the ranks receive half of every rank's bytes), the shared stages are skipped.
  for (std::uint64_t seed = 1; seed <= 3; ++seed) {
    const auto topo = h200_cluster(40);
    const scaleout_model net = scaleout_of(topo);
    const traffic_matrix t = hotspot_traffic(320, 20, 0.5, 64 << 20, seed, 8192);
    with_decomposer("best", {.scaleout = net}, [&](auto dec) {
      using D = decltype(dec);
      const plan_options opt{.granule = 8192};
      plan_options per_rail = opt, automatic = opt;
      per_rail.rails = rail_schedule::per_rail;
      automatic.rails = rail_schedule::automatic;
      const plan a = planner<fixed_topology<8>, D>(topo, automatic, dec).make(t);
      if (a.choice.find("shared at least") == std::string::npos) return 0;
      ++skipped;
      const plan b = planner<fixed_topology<8>, D>(topo, per_rail, dec).make(t);
      const plan c = planner<fixed_topology<8>, D>(topo, opt, dec).make(t);
      CHECK(a.per_rail());
      CHECK(a.pieces == b.pieces);
      CHECK(a.rail_perm == b.rail_perm);
      CHECK(a.rail_weight == b.rail_weight);
      CHECK(a.op_list == b.op_list);
      CHECK(rails_choice_time(topo, a, net) < rails_choice_time(topo, c, net));
      return 0;
    });
  }
  CHECK(skipped > 0);
}

TEST_CASE("per_rail.entries_past_2_to_the_56_are_summed_exactly_or_refused") {
  // choose_rails sums each 8 x 8 block two entries at a time and takes block_sum's checked sum
  // only where some entry reaches 2^56: blocks of such entries are still summed exactly, and a
  // matrix whose sums pass 64 bits is refused, naming the line.
  const auto topo = h200_cluster(3);
  traffic_matrix t = traffic_matrix::Zero(24, 24);
  t(0, 9) = bytes_t{1} << 58;
  t(1, 10) = (bytes_t{1} << 57) + 3;
  t(2, 17) = 5;
  planner<fixed_topology<8>, slack_decomposer> pl(topo, {.rails = rail_schedule::per_rail});
  const plan p = pl.make(t);
  const verify_result v = verify(p, t);
  INFO(v.error);
  CHECK(v.ok);
  CHECK(p.total_bytes == (bytes_t{1} << 58) + (bytes_t{1} << 57) + 8);
  t(3, 11) = ~bytes_t{0} - (bytes_t{1} << 58); // the block (0, 1) now sums past 2^64
  CHECK_THROWS_WITH_AS(pl.make(t), doctest::Contains("overflow"), error);
}
