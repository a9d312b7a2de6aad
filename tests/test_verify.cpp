// The verifier: every kind of broken plan it exists to catch is caught, and named.
#include <doctest/doctest.h>

#include "checks.hpp"

#include <algorithm>
#include <map>
#include <random>
#include <string>
#include <tuple>

#include "fasta2a/planner.hpp"
#include "fasta2a/verify.hpp"

using namespace fasta2a;
using fasta2a::testing::check_plan;

TEST_CASE("verify.catches_broken_plans") {
  const auto t = zipf_traffic(32, 1.0, 1 << 16, 5);
  const plan good = make_plan(h200_cluster(4), t);
  check_plan(good, t, true);
  auto broken = [&](auto&& edit, const char* what) {
    plan p = good;
    edit(p);
    const verify_result r = verify(p, t, {.exact_lower_bound = true});
    INFO(std::string(what), " <- ", r.error);
    CHECK_FALSE(r.ok);
    CHECK(r.error.find(what) != std::string::npos);
  };
  const std::size_t inter = static_cast<std::size_t>(
      std::find_if(good.pieces.begin(), good.pieces.end(), [](const piece& p) { return p.rail >= 0 && p.bytes > 1; }) -
      good.pieces.begin());
  broken([&](plan& p) { p.pieces[inter].bytes -= 1; }, "the matrix says");
  std::size_t split = 0; // first piece of a message with several pieces
  while (split + 1 < good.pieces.size() &&
         !(good.pieces[split].src == good.pieces[split + 1].src && good.pieces[split].dst == good.pieces[split + 1].dst))
    ++split;
  REQUIRE(split + 1 < good.pieces.size());
  broken([&](plan& p) { p.pieces[split].bytes -= 1; }, "gap");
  broken([&](plan& p) {
    auto perm = p.stage_perm.begin();
    for (int a = 0; a < p.servers; ++a)
      for (int b = 0; b < p.servers; ++b)
        if (a != b && perm[a] >= 0 && perm[a] != b && perm[b] != perm[a]) {
          perm[b] = perm[a];
          return;
        }
  }, "receives from two");
  broken([&](plan& p) { p.stage_weight[0] -= 1; }, "carries");
  broken([&](plan& p) { p.pieces[inter].stage = (p.pieces[inter].stage + 1) % static_cast<int>(p.stages()); }, "in which server");
  broken([&](plan& p) { p.stage_weight.back() += 1 << 20; }, "above the lower bound");
  broken([&](plan& p) { p.op_list.pop_back(); p.op_offsets.back() -= 1; }, "op index");
  broken([&](plan& p) {
    p.op_list.pop_back(); // the last op of the last non-empty bucket
    std::size_t k = p.op_offsets.size() - 1;
    while (p.op_offsets[k] > p.op_list.size()) p.op_offsets[k--] = static_cast<std::uint32_t>(p.op_list.size());
  }, "missing ops");
  broken([&](plan& p) { p.staging_bytes[p.rail_target(p.pieces[inter])] = 0; }, "staging region ends at");
  broken([&](plan& p) { p.message_count.back() += 1; }, "indexes past the pieces");
}

TEST_CASE("verify.granules_whose_products_pass_64_bits_plan_and_verify") {
  // G x granule and S x granule wrap modulo 2^64 for these granules: the planner once divided by
  // the wrapped 0 (SIGFPE) and the verifier once called its own exact plans wrong (issue 12, 1-2).
  struct shape {
    int S, G;
    bytes_t granule;
  };
  for (const shape c : {shape{2, 2, bytes_t{1} << 63}, shape{2, 8, bytes_t{1} << 61}, shape{4, 2, bytes_t{1} << 62},
                        shape{3, 4, ~bytes_t{0}}, shape{2, 2, (bytes_t{1} << 63) + 1}}) {
    CAPTURE(c.S);
    CAPTURE(c.G);
    CAPTURE(c.granule);
    const rank_t n = c.S * c.G;
    traffic_matrix t = traffic_matrix::Constant(n, n, 1);
    t(0, n - 1) = 1000; // one message that is not a multiple of anything here
    planner<two_tier_topology> pl(two_tier_topology(c.S, c.G), {.granule = c.granule});
    const plan p = pl.make(t);
    const verify_result r = verify(p, t, {.exact_lower_bound = true});
    CHECK_MESSAGE(r.ok, r.error);
  }
}

TEST_CASE("verify.rail_imbalance_past_one_granule_is_refused") {
  // Plans made with granule 2g balance each server pair's rails to within 2g; verified as plans of
  // granule g they must be refused exactly when some pair's rails differ by more than g, as counted
  // here from the pieces (independently of the verifier). Differences of exactly 2g must occur, so
  // that a verifier accepting two granules of imbalance fails (issue 12's surviving mutant).
  std::mt19937_64 rng(99);
  int refused = 0, accepted = 0, by_two = 0;
  for (int iter = 0; iter < 300; ++iter) {
    const int S = 2 + static_cast<int>(rng() % 4), G = 2 + static_cast<int>(rng() % 6);
    const bytes_t g = 1 + rng() % 8;
    const auto t = zipf_traffic(S * G, 1.0, (rng() % 64 + 1) * 2 * g, rng(), 2 * g);
    plan p = make_plan(two_tier_topology(S, G), t, {.granule = 2 * g});
    std::map<std::tuple<int, int>, std::vector<bytes_t>> rails;
    for (const piece& pc : p.pieces)
      if (pc.rail >= 0) {
        auto& r = rails[{pc.src / G, pc.dst / G}];
        r.resize(static_cast<std::size_t>(G), 0);
        r[static_cast<std::size_t>(pc.rail)] += pc.bytes;
      }
    bytes_t worst = 0;
    for (const auto& [pair, r] : rails) {
      const auto [lo, hi] = std::minmax_element(r.begin(), r.end());
      worst = std::max(worst, *hi - *lo);
    }
    REQUIRE(worst <= 2 * g);
    p.granule = g;
    const verify_result r = verify(p, t);
    CAPTURE(iter);
    CAPTURE(worst);
    if (worst > g) {
      ++refused;
      by_two += worst == 2 * g;
      CHECK_FALSE(r.ok);
      CHECK(r.error.find("more than one granule (" + std::to_string(g) + ") apart") != std::string::npos);
    } else {
      ++accepted;
      CHECK_MESSAGE(r.ok, r.error);
    }
  }
  CHECK(by_two > 10);
  CHECK(accepted > 10);
  MESSAGE(refused << " refused, " << accepted << " accepted, " << by_two << " with exactly two granules");
}

TEST_CASE("verify.every_check_fires_with_its_own_message") {
  // One corruption per check of verify() (include/fasta2a/verify.hpp, in its order), each required
  // to change the plan, each expected to be reported by that check's own words. Not reachable by
  // editing a plan alone (listed so that a new check is added here too): "below the lower bound"
  // (rail loads cover the matrix, so their weights cannot fall below it without "carries ... weight
  // is" first) and "scale-up bytes overflow" (needs pieces past 2^64 bytes in all).
  const int S = 4, G = 4;
  const auto t = zipf_traffic(S * G, 1.0, 1 << 16, 11);
  const plan good = make_plan(two_tier_topology(S, G), t);
  REQUIRE(verify(good, t, {.exact_lower_bound = true}).ok);
  const std::size_t n = static_cast<std::size_t>(S * G), P = good.pieces.size(), T = good.stages();
  REQUIRE(T >= 2);
  // Pieces of each kind, and messages with pieces.
  std::size_t inter = P, intra = P, split = P, balanced = P, redistributed = P;
  for (std::size_t i = 0; i < P; ++i) {
    const piece& pc = good.pieces[i];
    const bool rail = pc.rail >= 0;
    if (rail && inter == P) inter = i;
    if (!rail && pc.src != pc.dst && pc.src / G == pc.dst / G && intra == P) intra = i;
    if (rail && pc.stage_out != no_staging && balanced == P) balanced = i;
    if (rail && pc.stage_in != no_staging && redistributed == P) redistributed = i;
    if (i + 1 < P && split == P && pc.src == good.pieces[i + 1].src && pc.dst == good.pieces[i + 1].dst) split = i;
  }
  REQUIRE(inter < P);
  REQUIRE(intra < P);
  REQUIRE(split < P);
  REQUIRE(balanced < P);
  REQUIRE(redistributed < P);
  std::vector<std::size_t> messages; // with at least one piece
  for (std::size_t m = 0; m < n * n; ++m)
    if (good.message_count[m] > 0) messages.push_back(m);
  REQUIRE(messages.size() >= 2);
  const std::size_t m1 = messages.front(), m2 = messages.back();
  int idle = -1, busy = -1; // a server that sends in stage 0
  for (int s = 0; s < S; ++s)
    if (good.perm(0)[s] >= 0) busy = s;
    else idle = s;
  REQUIRE(busy >= 0);
  (void)idle;

  const auto same = [](const plan& a, const plan& b) {
    return a.servers == b.servers && a.gpus_per_server == b.gpus_per_server && a.view == b.view &&
           a.staged == b.staged && a.granule == b.granule && a.scaleup_bytes == b.scaleup_bytes &&
           a.stage_weight == b.stage_weight && a.stage_perm == b.stage_perm && a.pieces == b.pieces &&
           a.message_first == b.message_first && a.message_count == b.message_count &&
           a.staging_bytes == b.staging_bytes && a.op_offsets == b.op_offsets && a.op_list == b.op_list;
  };
  REQUIRE(same(good, good));
  int checked = 0;
  const auto broken = [&](const std::string& what, auto&& edit) {
    plan p = good;
    edit(p);
    INFO(what);
    REQUIRE_FALSE(same(p, good)); // the corruption changed something
    const verify_result r = verify(p, t, {.exact_lower_bound = true});
    INFO(r.error);
    CHECK_FALSE(r.ok);
    CHECK(r.error.find(what) != std::string::npos);
    ++checked;
  };
  broken("plan has no servers or no GPUs", [](plan& p) { p.gpus_per_server = 0; });
  broken("verify checks whole plans", [](plan& p) { p.view = 3; });
  {
    const verify_result r = verify(good, zipf_traffic(S * G + 1, 1.0, 1 << 16, 11));
    CHECK(r.error.find("matrix is 17 x 17, plan has") != std::string::npos);
  }
  broken("stage permutations do not match stage count", [](plan& p) { p.stage_perm.pop_back(); });
  broken("an unstaged plan has stages", [](plan& p) { p.staged = false; });
  broken("message index is not ranks x ranks", [](plan& p) { p.message_first.pop_back(); });
  broken("staging sizes missing", [](plan& p) { p.staging_bytes.pop_back(); });
  broken("stage 1 has weight 0", [](plan& p) { p.stage_weight[1] = 0; });
  broken("stage 0 sends server " + std::to_string(busy) + " to " + std::to_string(busy),
         [&](plan& p) { p.stage_perm[static_cast<std::size_t>(busy)] = busy; });
  broken("stage 0 sends server " + std::to_string(busy) + " to " + std::to_string(S),
         [&](plan& p) { p.stage_perm[static_cast<std::size_t>(busy)] = S; });
  broken("indexes past the pieces", [&](plan& p) { p.message_first[m2] = static_cast<std::uint32_t>(P); });
  broken("belongs to two messages", [&](plan& p) {
    p.message_first[m2] = p.message_first[m1];
    p.message_count[m2] = p.message_count[m1];
  });
  broken("is filed under another message", [&](plan& p) {
    std::swap(p.message_first[m1], p.message_first[m2]);
    std::swap(p.message_count[m1], p.message_count[m2]);
  });
  broken(" is empty", [&](plan& p) { p.pieces[good.message_first[m1]].bytes = 0; });
  broken("leaves a gap or overlaps: expected offset", [&](plan& p) { p.pieces[split + 1].offset += 1; });
  broken(" overflows", [&](plan& p) {
    p.pieces[split].bytes = ~bytes_t{0} - p.pieces[split].offset;
    p.pieces[split + 1].offset = ~bytes_t{0};
  });
  broken("rides a rail but needs none", [&](plan& p) { p.pieces[intra].rail = 0; });
  broken("has a stage but needs none", [&](plan& p) { p.pieces[intra].stage = 1; });
  broken("has no valid rail", [&](plan& p) { p.pieces[inter].rail = G; });
  broken("has stage " + std::to_string(T) + " of " + std::to_string(T),
         [&](plan& p) { p.pieces[inter].stage = static_cast<std::int32_t>(T); });
  broken("has a staging slot at its rail sender iff it needs a balance hop",
         [&](plan& p) { p.pieces[balanced].stage_out = no_staging; });
  broken("has a staging slot at its rail receiver iff it needs a redistribute hop",
         [&](plan& p) { p.pieces[redistributed].stage_in = no_staging; });
  broken("bytes in pieces, the matrix says", [&](plan& p) { p.pieces[good.message_first[m2] + good.message_count[m2] - 1].bytes += 1; });
  broken("belongs to no message", [&](plan& p) { p.pieces.push_back(p.pieces[inter]); });
  broken("bytes over scale-up, its routes move", [](plan& p) { p.scaleup_bytes += 1; });
  broken("weight is", [&](plan& p) { p.stage_weight[static_cast<std::size_t>(p.pieces[inter].stage)] = 1; });
  broken("above the lower bound", [](plan& p) { p.stage_weight.back() += 1 << 20; });
  broken("staging region ends at", [&](plan& p) { p.staging_bytes[p.rail_source(p.pieces[balanced])] = 0; });
  broken("staging regions overlap at", [&](plan& p) {
    // Two regions of one rank at one place: the smaller piece moved onto the larger one's slot.
    for (std::size_t i = 0; i < P; ++i)
      if (i != balanced && p.pieces[i].rail >= 0 && p.pieces[i].stage_out != no_staging &&
          p.rail_source(p.pieces[i]) == p.rail_source(p.pieces[balanced])) {
        piece& small = p.pieces[i].bytes <= p.pieces[balanced].bytes ? p.pieces[i] : p.pieces[balanced];
        const piece& large = &small == &p.pieces[i] ? p.pieces[balanced] : p.pieces[i];
        small.stage_out = large.stage_out;
        return;
      }
    FAIL("no second balanced piece on the same rail sender");
  });
  broken("op index has the wrong size", [](plan& p) { p.op_offsets.pop_back(); });
  broken("op index offsets decrease at slot 2", [](plan& p) { p.op_offsets[1] = p.op_offsets[2] + 1; });
  broken("op index names a piece that does not exist", [&](plan& p) { p.op_list[0].piece = static_cast<std::uint32_t>(P); });
  broken("appears twice in the op index", [](plan& p) { p.op_list[1] = p.op_list[0]; });
  broken("for an op its route does not make", [](plan& p) {
    rank_op& op = p.op_list[0]; // the first op visited, now of a kind its piece's route lacks
    op.kind = op.kind == op_kind::self_copy ? op_kind::intra_send : op_kind::self_copy;
  });
  broken("is missing ops in the per-rank index", [](plan& p) {
    p.op_list.pop_back();
    std::size_t k = p.op_offsets.size() - 1;
    while (p.op_offsets[k] > p.op_list.size()) p.op_offsets[k--] = static_cast<std::uint32_t>(p.op_list.size());
  });
  CHECK(checked == 34);
}

TEST_CASE("verify.rank_views_pass_verify_rank_view") {
  // Every rank's view of plans of several decomposers, topologies and granules passes; a whole
  // plan is not a view.
  std::mt19937_64 rng(515);
  for (int iter = 0; iter < 40; ++iter) {
    const int S = 1 + static_cast<int>(rng() % 6), G = 1 + static_cast<int>(rng() % 4);
    const bytes_t granule = 1 + rng() % 4096;
    const auto t = zipf_traffic(S * G, 0.5 + static_cast<double>(rng() % 100) / 100, 1 << 16, rng(), granule);
    const two_tier_topology topo(S, G);
    CAPTURE(iter);
    auto all_views = [&](auto pl, bool exact) {
      plan v;
      for (rank_t r = 0; r < S * G; ++r) {
        pl.make_rank_into(t, r, v);
        const verify_result res = verify_rank_view(v, t, {.exact_lower_bound = exact});
        INFO("rank ", r, ": ", res.error);
        CHECK(res.ok);
      }
    };
    all_views(planner<two_tier_topology>(topo, {.granule = granule}), true);
    all_views(planner<two_tier_topology, spread_out_decomposer>(topo, {.granule = granule}), false);
    all_views(planner<two_tier_topology, direct_decomposer>(topo), false);
  }
  const auto t = zipf_traffic(32, 1.0, 1 << 16, 5);
  CHECK_FALSE(verify_rank_view(make_plan(h200_cluster(4), t), t).ok);
}

TEST_CASE("verify.rank_view_catches_broken_views") {
  const auto t = zipf_traffic(32, 1.0, 1 << 16, 5);
  const rank_t R = 9;
  const plan good = planner<fixed_topology<8>>(h200_cluster(4)).make_rank(t, R);
  REQUIRE(verify_rank_view(good, t, {.exact_lower_bound = true}).ok);
  auto broken = [&](auto&& edit, const char* what) {
    plan p = good;
    edit(p);
    const verify_result r = verify_rank_view(p, t, {.exact_lower_bound = true});
    INFO(std::string(what), " <- ", r.error);
    CHECK_FALSE(r.ok);
    CHECK(r.error.find(what) != std::string::npos);
  };
  auto first = [&](auto&& pred) {
    const auto it = std::find_if(good.pieces.begin(), good.pieces.end(), pred);
    REQUIRE(it != good.pieces.end());
    return static_cast<std::size_t>(it - good.pieces.begin());
  };
  // A piece R sends over a rail, with more than one byte; one R only carries; a split message of R's.
  const std::size_t sent = first([&](const piece& p) { return p.src == R && p.rail >= 0 && p.bytes > 1; });
  const std::size_t carried = first([&](const piece& p) { return p.src != R && p.dst != R; });
  std::size_t split = 0;
  while (split + 1 < good.pieces.size() &&
         !(good.pieces[split].src == R && good.pieces[split + 1].src == R &&
           good.pieces[split].dst == good.pieces[split + 1].dst))
    ++split;
  REQUIRE(split + 1 < good.pieces.size());
  broken([&](plan& p) { p.pieces[sent].bytes -= 1; }, "the matrix says");
  broken([&](plan& p) { p.pieces[split].bytes -= 1; }, "gap");
  broken([&](plan& p) { p.pieces.erase(p.pieces.begin() + static_cast<std::ptrdiff_t>(sent)); }, "");
  broken([&](plan& p) { std::swap(p.pieces[split], p.pieces[split + 1]); }, "gap");
  broken([&](plan& p) { p.pieces[carried].rail = (p.pieces[carried].rail + 1) % 8; }, "not rank 9's");
  broken([&](plan& p) { p.pieces[sent].stage = (p.pieces[sent].stage + 1) % static_cast<int>(p.stages()); },
         "in which server");
  broken([&](plan& p) { p.stage_weight.back() += 1 << 20; }, "above the lower bound");
  broken([&](plan& p) { p.total_bytes += 1; }, "the matrix");
  broken([&](plan& p) { p.staging_bytes[R] = 0; }, "staging");
  broken([&](plan& p) { p.op_list.pop_back(); p.op_offsets.back() -= 1; }, "missing ops");
  broken([&](plan& p) { p.view = 32; }, "32 ranks");
  // A piece moved into another message that R sends (a message begun twice).
  broken([&](plan& p) {
    const std::size_t other = first([&](const piece& q) { return q.src == R && q.dst != good.pieces[split].dst; });
    p.pieces.insert(p.pieces.begin() + static_cast<std::ptrdiff_t>(other) + 1, p.pieces[split]);
  }, "");
}
