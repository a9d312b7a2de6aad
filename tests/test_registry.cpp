// Tests for fasta2a/registry.hpp: decomposer names become the right types, configured from
// decomposer_params, and a wrong name or parameter is a clear error.
#include <doctest/doctest.h>

#include <fasta2a/planner.hpp>
#include <fasta2a/registry.hpp>
#include <fasta2a/topology.hpp>
#include <fasta2a/traffic.hpp>
#include <fasta2a/verify.hpp>

#include <cmath>
#include <cstddef>
#include <limits>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

using namespace fasta2a;

namespace {

/// The position of T in registered_decomposers, or its size if T is not there.
template <class T, std::size_t I = 0>
constexpr std::size_t registered_index() {
  if constexpr (I == std::tuple_size_v<registered_decomposers>) return I;
  else if constexpr (std::is_same_v<T, std::tuple_element_t<I, registered_decomposers>>) return I;
  else return registered_index<T, I + 1>();
}

/// A server matrix with a zero diagonal and uneven entries, the same for every seed.
server_matrix sample_servers(int S, std::uint64_t seed) {
  detail::splitmix64 rng(seed);
  server_matrix m = server_matrix::Zero(S, S);
  for (int s = 0; s < S; ++s)
    for (int d = 0; d < S; ++d)
      if (s != d) m(s, d) = 1 + rng.below(1u << 20);
  return m;
}

} // namespace

TEST_CASE("registry.names.are_one_fixed_list") {
  const std::vector<std::string_view> want{"birkhoff", "bottleneck", "quantized", "spread-out",
                                           "direct",   "best",       "slack",     "factorized"};
  CHECK(std::vector<std::string_view>(decomposer_names().begin(), decomposer_names().end()) == want);
  CHECK(decomposer_names_text() == "birkhoff, bottleneck, quantized, spread-out, direct, best, slack, factorized");
  CHECK(decomposer_names_text(" | ") == "birkhoff | bottleneck | quantized | spread-out | direct | best | slack | factorized");
  for (std::string_view n : want) CHECK(is_decomposer_name(n));
  // Names are exact: no other spelling, and not the type's own name for best ("best-of").
  for (std::string_view n : {"", "Birkhoff", "best-of", "spread_out", "fast", "birkhoff "}) {
    CAPTURE(n);
    CHECK_FALSE(is_decomposer_name(n));
  }
}

TEST_CASE("registry.every_name_dispatches_to_its_type") {
  // The i-th name makes the i-th registered type, as a fresh value (a prvalue).
  for (std::size_t i = 0; i < decomposer_names().size(); ++i) {
    const std::string_view name = decomposer_names()[i];
    CAPTURE(name);
    const std::size_t got = with_decomposer(name, {}, [](auto&& dec) {
      static_assert(std::is_rvalue_reference_v<decltype(dec)>, "f receives a prvalue");
      return registered_index<std::remove_cvref_t<decltype(dec)>>();
    });
    CHECK(got == i);
  }
  // And by name, the types a reader of the documentation expects.
  auto is = [](std::string_view name, auto tag) {
    using want = typename decltype(tag)::type;
    return with_decomposer(name, {}, [](auto dec) { return std::is_same_v<decltype(dec), want>; });
  };
  CHECK(is("birkhoff", std::type_identity<birkhoff_decomposer>{}));
  CHECK(is("bottleneck", std::type_identity<bottleneck_decomposer>{}));
  CHECK(is("quantized", std::type_identity<quantized_decomposer>{}));
  CHECK(is("spread-out", std::type_identity<spread_out_decomposer>{}));
  CHECK(is("direct", std::type_identity<direct_decomposer>{}));
  CHECK(is("best", std::type_identity<best_decomposer>{}));
  CHECK(is("slack", std::type_identity<slack_decomposer>{}));
  CHECK(is("factorized", std::type_identity<factorized_decomposer>{}));
  // f may return nothing.
  int calls = 0;
  with_decomposer("direct", {}, [&](auto) { ++calls; });
  CHECK(calls == 1);
}

TEST_CASE("registry.params_reach_the_decomposers") {
  CHECK(decomposer_params{}.quantum == quantum_rule::formula); // one decomposition per call
  CHECK(decomposer_params{}.scaleout.alpha_s == scaleout_model::default_alpha_s);
  const server_matrix m = sample_servers(6, 3);
  for (const quantum_rule rule : {quantum_rule::formula, quantum_rule::search}) {
    for (const double alpha : {0.0, 5e-6, 1e-3}) {
      const decomposer_params p{.scaleout = {.alpha_s = alpha, .bandwidth = 25e9}, .quantum = rule};
      CAPTURE(alpha);
      CAPTURE(static_cast<int>(rule));
      // quantized picks the quantum a decomposer made directly with these numbers picks.
      quantized_decomposer direct_q(p.scaleout, rule);
      stage_list want;
      direct_q.decompose(m, want);
      with_decomposer("quantized", p, [&](auto dec) {
        if constexpr (std::is_same_v<decltype(dec), quantized_decomposer>) {
          stage_list got;
          dec.decompose(m, got);
          CHECK(dec.last_quantum() == direct_q.last_quantum());
          CHECK(got.weights == want.weights);
        } else {
          FAIL("quantized made another type");
        }
      });
      // best weighs its members with alpha and the bandwidth (its factorized member in split mode):
      // its reason (every member's stage count and modelled time) and its choice are those of a
      // best_decomposer made directly.
      best_decomposer direct_best(p.scaleout, birkhoff_decomposer{}, bottleneck_decomposer{}, slack_decomposer{},
                                  quantized_decomposer(p.scaleout, rule), spread_out_decomposer{},
                                  factorized_decomposer(p.scaleout).split_pairs(true));
      stage_list best_want;
      direct_best.decompose(m, best_want);
      with_decomposer("best", p, [&](auto dec) {
        if constexpr (std::is_same_v<decltype(dec), best_decomposer>) {
          stage_list got;
          dec.decompose(m, got);
          CHECK(dec.reason() == direct_best.reason());
          CHECK(std::string_view(dec.chosen()) == direct_best.chosen());
          CHECK(got.weights == best_want.weights);
        } else {
          FAIL("best made another type");
        }
      });
    }
  }
}

TEST_CASE("registry.unknown_name_is_an_error_listing_the_names") {
  int calls = 0;
  const auto f = [&](auto) { ++calls; };
  CHECK_THROWS_WITH_AS(with_decomposer("greedy", {}, f),
                       "unknown decomposer 'greedy' (the decomposers are birkhoff, bottleneck, quantized, "
                       "spread-out, direct, best, slack, factorized)",
                       error);
  CHECK_THROWS_WITH_AS(with_decomposer("Birkhoff", {}, f), doctest::Contains("unknown decomposer 'Birkhoff'"), error);
  CHECK_THROWS_WITH_AS(with_decomposer("", {}, f), doctest::Contains("unknown decomposer ''"), error);
  CHECK(calls == 0);
}

TEST_CASE("registry.parameters_that_are_no_network_are_errors") {
  int calls = 0;
  const auto f = [&](auto) { ++calls; };
  const double inf = std::numeric_limits<double>::infinity();
  for (const double alpha : {-1e-6, std::nan(""), inf}) {
    CAPTURE(alpha);
    CHECK_THROWS_WITH_AS(with_decomposer("birkhoff", {.scaleout = {.alpha_s = alpha}}, f), doctest::Contains("alpha"), error);
  }
  for (const double bw : {0.0, -1.0, std::nan(""), inf}) {
    CAPTURE(bw);
    CHECK_THROWS_WITH_AS(with_decomposer("quantized", {.scaleout = {.bandwidth = bw}}, f),
                         doctest::Contains("bandwidth"), error);
  }
  CHECK(calls == 0);
  // The name is checked first: an unknown name is reported as such whatever the parameters.
  CHECK_THROWS_WITH_AS(with_decomposer("nope", {.scaleout = {.alpha_s = -1}}, f), doctest::Contains("unknown decomposer"), error);
}

TEST_CASE("registry.every_decomposer_plans_verified_traffic") {
  // End to end: a planner built through the registry makes plans the verifier accepts, exact
  // decomposers on the lower bound.
  const two_tier_topology topo(3, 4);
  const decomposer_params p{.scaleout = {.alpha_s = 20e-6, .bandwidth = topo.scaleout_bandwidth()}};
  for (std::uint64_t seed = 0; seed < 5; ++seed) {
    const traffic_matrix t = zipf_traffic(12, 1.2, 1 << 16, seed);
    for (std::string_view name : decomposer_names()) {
      CAPTURE(name);
      CAPTURE(seed);
      const verify_result r = with_decomposer(name, p, [&](auto dec) {
        using D = decltype(dec);
        const plan pl = planner<two_tier_topology, D>(topo, {}, std::move(dec)).make(t);
        return verify(pl, t, {.exact_lower_bound = D::exact});
      });
      CHECK_MESSAGE(r.ok, r.error);
    }
  }
}
