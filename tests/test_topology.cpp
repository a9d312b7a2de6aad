// The topologies (rank mapping, link figures, presets) and the scale-out model they carry.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "fasta2a/topology.hpp"

using namespace fasta2a;

namespace {

// Negative fixture for the concept check: a cluster that says nothing of its rails.
struct no_rails {
  int servers() const { return 1; }
};

// A topology written outside the library: anything with these members is one.
struct custom_topology {
  int servers() const { return 2; }
  int gpus_per_server() const { return 2; }
  rank_t ranks() const { return 4; }
  int server_of(rank_t r) const { return r / 2; }
  int local_of(rank_t r) const { return r % 2; }
  rank_t rank_of(int s, int k) const { return s * 2 + k; }
  scaleup_kind scaleup() const { return scaleup_kind::mesh; }
  double scaleup_bandwidth() const { return 1e9; }
  double scaleout_bandwidth() const { return 2e9; }
  double scaleout_alpha() const { return 3e-6; }
};

} // namespace

TEST_CASE("topology.concept_and_presets") {
  static_assert(Topology<two_tier_topology>);
  static_assert(Topology<fixed_topology<4>>);
  static_assert(Topology<custom_topology>);
  static_assert(!Topology<no_rails>);
  static_assert(!Topology<int>);
  static_assert(static_gpus_v<fixed_topology<8>> == 8 && static_gpus_v<two_tier_topology> == 0);
  CHECK(h200_cluster(2).scaleup() == scaleup_kind::switch_fabric);
  CHECK(mi300x_cluster(2).scaleup() == scaleup_kind::mesh);
  CHECK(h200_cluster(3).ranks() == 24);
}

TEST_CASE("topology.rank_mapping_is_server_major") {
  two_tier_topology t(5, 3);
  for (rank_t r = 0; r < t.ranks(); ++r) {
    CHECK(t.rank_of(t.server_of(r), t.local_of(r)) == r);
    CHECK(t.local_of(r) == r % 3);
  }
  CHECK_THROWS_WITH_AS(two_tier_topology(0, 8), doctest::Contains("at least one server"), error);
  CHECK_THROWS_WITH_AS(two_tier_topology(4, 0), doctest::Contains("at least one GPU"), error);
  CHECK_THROWS_WITH_AS(fixed_topology<8>(0), doctest::Contains("at least one server"), error);
  CHECK_THROWS_WITH_AS(two_tier_topology(2, 2, link_model{scaleup_kind::mesh, 0, 1}),
                       doctest::Contains("bandwidths"), error);
}

TEST_CASE("topology.carries_one_scaleout_model") {
  // The defaults exist once, in scaleout_model: presets and link_model{} take them from there.
  const scaleout_model def{};
  CHECK(def.alpha_s == 10e-6);
  CHECK(def.bandwidth == 50e9);
  for (const link_model& l : {link_model{}, h200_links, mi300x_links}) {
    CHECK(l.scaleout_alpha == def.alpha_s);
    CHECK(l.scaleout_bandwidth == def.bandwidth);
  }
  CHECK(h200_links.scaleup_bandwidth == 450e9);
  CHECK(mi300x_links.scaleup_bandwidth == 64e9);

  // A topology's model is its link figures, whichever template holds them.
  const link_model slow{scaleup_kind::switch_fabric, 450e9, 12.5e9, 25e-6};
  for (const scaleout_model net :
       {scaleout_of(two_tier_topology(3, 4, slow)), scaleout_of(fixed_topology<8>(2, slow))}) {
    CHECK(net.alpha_s == 25e-6);
    CHECK(net.bandwidth == 12.5e9);
  }
  CHECK(two_tier_topology(3, 4, slow).scaleout_alpha() == 25e-6);
  CHECK(scaleout_of(h200_cluster(2)).alpha_s == def.alpha_s);
  CHECK(scaleout_of(custom_topology{}).alpha_s == 3e-6);
  CHECK(scaleout_of(custom_topology{}).bandwidth == 2e9);

  // A negative or non-finite alpha is refused where the topology is made.
  CHECK_THROWS_WITH_AS(two_tier_topology(2, 2, link_model{scaleup_kind::switch_fabric, 450e9, 50e9, -1e-6}),
                       doctest::Contains("alpha"), error);
  CHECK_THROWS_WITH_AS(fixed_topology<8>(2, link_model{scaleup_kind::switch_fabric, 450e9, 50e9, std::nan("")}),
                       doctest::Contains("alpha"), error);
  CHECK_NOTHROW(two_tier_topology(2, 2, link_model{scaleup_kind::switch_fabric, 450e9, 50e9, 0.0}));
}

TEST_CASE("scaleout_model.formulas") {
  const scaleout_model net{5e-6, 25e9};
  CHECK(net.transfer_time(25'000'000) == doctest::Approx(1e-3));
  CHECK(net.stage_time(0) == 5e-6);
  CHECK(net.stage_time(25'000'000) == doctest::Approx(1e-3 + 5e-6));
  // Direct sending pays one synchronisation, and nothing at all when no byte crosses.
  CHECK(net.direct_time(0) == 0.0);
  CHECK(net.direct_time(25'000'000) == net.stage_time(25'000'000));
  CHECK(net.direct_time(25'000'000) == doctest::Approx(1e-3 + 5e-6)); // by hand: 25 MB at 25 GB/s, plus alpha
  // The phase of a staged plan: stage_time summed in order, bit for bit.
  const std::vector<bytes_t> weights{4096, 1 << 20, 12345, 0, 7};
  double sum = 0;
  for (bytes_t w : weights) sum += net.stage_time(w);
  CHECK(net.stages_time(weights) == sum);
  CHECK(net.stages_time({}) == 0.0);
  // From totals: the same figure up to rounding.
  bytes_t total = 0;
  for (bytes_t w : weights) total += w;
  CHECK(net.phase_time(total, weights.size()) == doctest::Approx(sum).epsilon(1e-12));
  CHECK(net.phase_time(total, weights.size()) == net.transfer_time(total) + 5e-6 * 5);

  CHECK_NOTHROW(net.check("x"));
  CHECK_NOTHROW((scaleout_model{0.0, 1.0}.check("x")));
  CHECK_THROWS_WITH_AS((scaleout_model{-1e-6, 50e9}.check("who")), doctest::Contains("who: alpha"), error);
  CHECK_THROWS_WITH_AS((scaleout_model{1e-6, 0.0}.check("who")), doctest::Contains("bandwidth"), error);
  CHECK_THROWS_WITH_AS((scaleout_model{1e-6, std::numeric_limits<double>::infinity()}.check("who")),
                       doctest::Contains("bandwidth"), error);
}
