// fasta2a: decomposers by name. A runtime that takes its decomposer from configuration (a flag, an
// environment variable, a config file) turns the name into a type here, in one place, and then
// instantiates its planner or engine with that type: the rest of the program stays generic.
#pragma once

#include <array>
#include <cmath>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>

#include "fasta2a/common.hpp"
#include "fasta2a/decompose.hpp"
#include "fasta2a/factorized.hpp"
#include "fasta2a/fewer_stages.hpp"

namespace fasta2a {

/// What the decomposers that weigh stages against bytes need to know of the network. The others
/// (birkhoff, bottleneck, slack, spread-out, direct) ignore it.
struct decomposer_params {
  /// The scale-out network (alpha per stage, NIC bandwidth: scaleout_of(topology) gives a
  /// topology's): "quantized" chooses its quantum with it, "factorized" chooses between its two
  /// colourings with it, "best" prices its members' stages with it.
  scaleout_model scaleout{};
  /// How "quantized" (alone or as a member of "best") chooses its quantum per matrix. The default,
  /// the closed form, costs one decomposition, which suits planning on every call; search tries
  /// several quanta and costs several.
  quantum_rule quantum = quantum_rule::formula;
};

/// The decomposer named "best": whichever of birkhoff, bottleneck, slack, quantized, spread-out and
/// factorized the scale-out model predicts fastest for each matrix (best_of_decomposer). with_decomposer
/// makes its factorized member in split mode (factorized_decomposer::split_pairs): never slower in
/// the model than the plain factorized decomposer, pairs possibly served in several stages.
using best_decomposer = best_of_decomposer<birkhoff_decomposer, bottleneck_decomposer, slack_decomposer,
                                           quantized_decomposer, spread_out_decomposer, factorized_decomposer>;

/// Every decomposer with_decomposer can make, in the order of decomposer_names(): a runtime can
/// build a std::variant of its planners or engines over these types.
using registered_decomposers = std::tuple<birkhoff_decomposer, bottleneck_decomposer, quantized_decomposer,
                                          spread_out_decomposer, direct_decomposer, best_decomposer, slack_decomposer,
                                          factorized_decomposer>;

namespace detail {

inline constexpr std::array<std::string_view, 8> decomposer_name_table{"birkhoff", "bottleneck", "quantized",
                                                                       "spread-out", "direct",   "best",
                                                                       "slack",      "factorized"};
static_assert(decomposer_name_table.size() == std::tuple_size_v<registered_decomposers>,
              "every registered decomposer has one name, and every name one decomposer");

} // namespace detail

/// The names with_decomposer accepts, in a fixed order: "birkhoff" (exact, the paper's
/// decomposition), "bottleneck" (exact, fewer stages), "quantized" (weights in multiples of a
/// quantum: bounded padding, far fewer stages), "spread-out" and "direct" (the baselines), "best",
/// "slack" (exact, padding decided stage by stage: the fewest stages of the exact ones),
/// "factorized" (the fewest stages of any schedule, or a few more where the scale-out model predicts
/// that faster, each pair served in one stage, pairs of similar size sharing a stage).
/// The i-th name makes the i-th type of registered_decomposers.
inline std::span<const std::string_view> decomposer_names() noexcept { return detail::decomposer_name_table; }

/// The names joined by `separator` ("birkhoff, bottleneck, ..."): for help texts and messages.
inline std::string decomposer_names_text(std::string_view separator = ", ") {
  std::string s;
  for (std::string_view n : decomposer_names()) {
    if (!s.empty()) s += separator;
    s += n;
  }
  return s;
}

/// Whether `name` is one of decomposer_names() (exactly: names are case-sensitive).
inline bool is_decomposer_name(std::string_view name) noexcept {
  for (std::string_view n : decomposer_names())
    if (n == name) return true;
  return false;
}

/// Calls `f` once with the decomposer named `name`, a fresh value (a prvalue) configured from `p`,
/// and returns what `f` returns. `f` must accept every type of registered_decomposers and return
/// the same type for all of them (a generic lambda that builds a planner into a std::variant, say,
/// or that runs an engine and returns its figures):
///
///     const plan p = with_decomposer(name, {.scaleout = scaleout_of(topo)},
///         [&](auto dec) { return planner<Topo, decltype(dec)>(topo, {}, std::move(dec)).make(t); });
///
/// Throws fasta2a::error, before calling `f`, for a name that is not one of decomposer_names()
/// (the message lists them) and for a scale-out model that cannot be a network (scaleout_model::check).
template <class F>
decltype(auto) with_decomposer(std::string_view name, const decomposer_params& p, F&& f) {
  if (!is_decomposer_name(name))
    throw error("unknown decomposer '" + std::string(name) + "' (the decomposers are " + decomposer_names_text() +
                ")");
  p.scaleout.check("decomposer_params::scaleout");
  if (name == "birkhoff") return std::forward<F>(f)(birkhoff_decomposer{});
  if (name == "bottleneck") return std::forward<F>(f)(bottleneck_decomposer{});
  if (name == "slack") return std::forward<F>(f)(slack_decomposer{});
  if (name == "factorized") return std::forward<F>(f)(factorized_decomposer(p.scaleout));
  if (name == "spread-out") return std::forward<F>(f)(spread_out_decomposer{});
  if (name == "direct") return std::forward<F>(f)(direct_decomposer{});
  const auto quantized = [&] { return quantized_decomposer(p.scaleout, p.quantum); };
  if (name == "quantized") return std::forward<F>(f)(quantized());
  return std::forward<F>(f)(best_decomposer(p.scaleout, birkhoff_decomposer{}, bottleneck_decomposer{},
                                            slack_decomposer{}, quantized(), spread_out_decomposer{},
                                            factorized_decomposer(p.scaleout).split_pairs(true)));
}

} // namespace fasta2a
