// The verifier: every kind of broken plan it exists to catch is caught, and named.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <algorithm>
#include <string>

#include "fasta2a/planner.hpp"
#include "fasta2a/verify.hpp"

using namespace fasta2a;

namespace {

void check_plan(const plan& p, const traffic_matrix& t, bool exact) {
  const verify_result r = verify(p, t, {.exact_lower_bound = exact});
  INFO(r.error);
  REQUIRE(r.ok);
}

} // namespace

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
  broken([&](plan& p) { p.stage_weight.back() += 1 << 20; p.stage_weight[0] += 0; }, "above the lower bound");
  broken([&](plan& p) { p.op_list.pop_back(); p.op_offsets.back() -= 1; }, "op index");
  broken([&](plan& p) {
    p.op_list.pop_back(); // the last op of the last non-empty bucket
    std::size_t k = p.op_offsets.size() - 1;
    while (p.op_offsets[k] > p.op_list.size()) p.op_offsets[k--] = static_cast<std::uint32_t>(p.op_list.size());
  }, "missing ops");
  broken([&](plan& p) { p.staging_bytes[p.rail_target(p.pieces[inter])] = 0; }, "staging");
  broken([&](plan& p) { p.message_count[1] += 1; }, "");
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
