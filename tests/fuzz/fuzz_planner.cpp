// libFuzzer target: planner + verify. The input decodes into a shape of 1..8 servers x 1..8 GPUs,
// a decomposer (any of decomposer_names()), a granule (any 64-bit value, 0 included), the direct
// fallback on or off, and every entry of the traffic matrix (zero, small, multiples of the
// granule with or without a remainder, or any 64-bit value); short inputs end in zeros.
// Properties:
// - only fasta2a::error escapes (bad granule, sums past 64 bits, plan_too_large);
// - every plan the planner makes passes verify (with the exact lower bound for exact decomposers);
// - planning is deterministic: a fresh planner, and a planner reused after another matrix, make
//   the same plan, field for field;
// - a rank's view (make_rank_into) holds exactly that rank's part of the whole plan (every rank
//   up to 16 ranks, eight of them past that);
// - the plan's document reads back (read_plan_json) to a plan that verifies too;
// - the plan transposed (transpose_into, shared or per-rail stages) is a plan of the transposed
//   matrix that verifies, and transposing it back gives the plan, field for field.
// Bits 3 and 4 of the servers' byte pick the rail schedule: shared, shared, per-rail, automatic.
#include "fuzz_common.hpp"

#include <fasta2a/cost_model.hpp>
#include <fasta2a/json.hpp>
#include <fasta2a/planner.hpp>
#include <fasta2a/registry.hpp>
#include <fasta2a/topology.hpp>
#include <fasta2a/transpose.hpp>
#include <fasta2a/verify.hpp>

#include <utility>
#include <vector>

namespace fa = fasta2a;

namespace {

struct decoded {
  int servers = 1, gpus = 1;
  std::string_view decomposer;
  fa::quantum_rule rule = fa::quantum_rule::formula;
  bool fixed = false; // fixed_topology<8> (h200_cluster) where G is 8
  fa::plan_options options;
  fa::traffic_matrix traffic;
  std::uint64_t pick = 0; // which ranks' views to check on more than 16 ranks
};

decoded decode(fuzz::bytes& in) {
  decoded d;
  const std::uint8_t shape = in.u8();
  d.servers = 1 + shape % 8;
  const int rails = (shape >> 3) % 4;
  d.options.rails = rails == 2 ? fa::rail_schedule::per_rail
                  : rails == 3 ? fa::rail_schedule::automatic
                               : fa::rail_schedule::shared;
  d.gpus = 1 + in.u8() % 8;
  const std::uint8_t how = in.u8();
  const auto names = fa::decomposer_names();
  d.decomposer = names[how % names.size()];
  d.rule = (how / 8) % 4 == 0 ? fa::quantum_rule::search : fa::quantum_rule::formula;
  d.fixed = d.gpus == 8 && (how & 0x40) != 0;
  if (how & 0x80) d.options.direct_if_faster_alpha = (how & 0x20) ? 10e-6 : 1e-3;
  const std::uint8_t g = in.u8();
  d.options.granule = g < 112 ? 1 : g < 176 ? 1 + g % 64 : g < 240 ? fa::bytes_t{1} << (g - 176) : in.u64();
  const fa::bytes_t q = d.options.granule;
  const int n = d.servers * d.gpus;
  d.traffic = fa::traffic_matrix::Zero(n, n);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j) {
      const std::uint8_t m = in.u8();
      const fa::bytes_t low = m & 31u;
      fa::bytes_t v = 0;
      switch (m >> 5) {
      case 0: case 1: v = 0; break;
      case 2: v = low; break;
      case 3: v = q * low; break; // wraps for huge granules: any value will do
      case 4: v = q * low + in.u8(); break;
      case 5: v = in.u64(); break;
      case 6: v = fa::bytes_t{1} << (low * 2 % 64); break;
      default: v = in.u8() | fa::bytes_t{in.u8()} << 8; break;
      }
      d.traffic(i, j) = v;
    }
  d.pick = in.u64();
  return d;
}

// What rank r does in a plan: per stage, its ops with the content of each piece.
std::vector<std::pair<std::size_t, std::pair<fa::op_kind, fa::piece>>> rank_work(const fa::plan& p, fa::rank_t r) {
  std::vector<std::pair<std::size_t, std::pair<fa::op_kind, fa::piece>>> w;
  for (std::size_t t = 0; t < p.op_stages(); ++t)
    for (const fa::rank_op& op : p.ops(r, t)) w.push_back({t, {op.kind, p.pieces[op.piece]}});
  return w;
}

template <class Topo, class D>
void check(const Topo& topo, D dec, const decoded& d) {
  const fa::traffic_matrix& t = d.traffic;
  // Planning (a planner is cheap to build; the decomposer is copied into each).
  fa::plan whole;
  std::optional<fa::planner<Topo, D>> first;
  if (!fuzz::documented_errors_only("planner", [&] { first.emplace(topo, d.options, dec); })) return;
  if (!fuzz::documented_errors_only("planner::make_into", [&] { first->make_into(t, whole); })) return;

  const bool exact = D::exact && whole.staged;
  const fa::verify_result v = fa::verify(whole, t, {.exact_lower_bound = exact});
  FUZZ_CHECK(v.ok, "the planner's plan fails verify (" + std::string(D::name) + "): " + v.error);

  // Deterministic: a fresh planner, and one reused after another matrix into a used plan.
  fa::planner<Topo, D> second(topo, d.options, dec);
  fa::plan again;
  const fa::traffic_matrix other = t.transpose();
  fuzz::documented_errors_only("planner::make_into (transpose)", [&] { second.make_into(other, again); });
  const bool made = fuzz::documented_errors_only("planner::make_into (again)", [&] { second.make_into(t, again); });
  FUZZ_CHECK(made, "planning the same matrix a second time fails");
  FUZZ_CHECK(fuzz::plan_difference(whole, again).empty(),
             "planning is not deterministic: " + fuzz::plan_difference(whole, again));

  // Rank views are the whole plan's rank parts.
  // Every rank up to 16 ranks; past that (a rank view is still a fraction of a whole plan, and
  // 64 of them dominate the input's time) the first, the last and six others the input picks.
  std::vector<fa::rank_t> ranks;
  const fa::rank_t n = whole.ranks();
  if (n <= 16)
    for (fa::rank_t r = 0; r < n; ++r) ranks.push_back(r);
  else {
    ranks = {0, n - 1};
    for (int k = 0; k < 6; ++k) ranks.push_back(static_cast<fa::rank_t>((d.pick >> (8 * k)) % static_cast<unsigned>(n)));
  }
  fa::plan view;
  for (const fa::rank_t r : ranks) {
    const bool ok = fuzz::documented_errors_only("planner::make_rank_into", [&] { second.make_rank_into(t, r, view); });
    FUZZ_CHECK(ok, "make_rank_into fails where make_into succeeds, rank " + std::to_string(r));
    FUZZ_CHECK(view.view == r, "the view is not rank " + std::to_string(r) + "'s");
    FUZZ_CHECK(view.stage_weight == whole.stage_weight && view.stage_perm == whole.stage_perm,
               "rank " + std::to_string(r) + "'s view has other stages");
    FUZZ_CHECK(view.staging_bytes == whole.staging_bytes, "rank " + std::to_string(r) + "'s view has other staging");
    FUZZ_CHECK(rank_work(view, r) == rank_work(whole, r), "rank " + std::to_string(r) + "'s view has other work");
    FUZZ_CHECK(fa::verify(view, t).ok == false, "verify accepts a rank's view as a whole plan");
  }

  // The document of the plan reads back to a plan that verifies.
  fa::plan back;
  const bool read = fuzz::documented_errors_only("read_plan_json", [&] {
    back = fa::read_plan_json(fa::plan_to_json(whole), {.granule = d.options.granule});
  });
  FUZZ_CHECK(read, "the document of a planner's plan is refused");
  const fa::verify_result vb = fa::verify(back, t, {.exact_lower_bound = exact});
  FUZZ_CHECK(vb.ok, "the planner's plan read back from its document fails verify: " + vb.error);

  // The plan transposed is a plan of the transposed matrix, and transposes back to the plan.
  const fa::server_matrix m = first->rail_matrix();
  const std::vector<fa::bytes_t> balance = first->balance_bytes();
  fa::plan q, q2;
  const bool transposed = fuzz::documented_errors_only("transpose_into", [&] { fa::transpose_into(whole, m, q, balance); });
  FUZZ_CHECK(transposed, "transpose_into refuses a planner's plan");
  const fa::verify_result vt = fa::verify(q, other, {.exact_lower_bound = exact});
  FUZZ_CHECK(vt.ok, "the planner's plan transposed fails verify against the transposed matrix: " + vt.error);
  std::vector<fa::bytes_t> flipped(balance.size());
  for (std::size_t r = 0; r < balance.size(); ++r) flipped[r] = q.staging_bytes[r] - balance[r];
  const fa::server_matrix mt = m.transpose();
  fuzz::documented_errors_only("transpose_into (back)", [&] { fa::transpose_into(q, mt, q2, flipped); });
  FUZZ_CHECK(fuzz::plan_difference(whole, q2).empty(),
             "transposing twice does not give the plan back: " + fuzz::plan_difference(whole, q2));

  fuzz::documented_errors_only("predict", [&] { (void)fa::predict(topo, whole); });
}

template <class Topo>
void check_named(const Topo& topo, const decoded& d) {
  fuzz::documented_errors_only("with_decomposer", [&] {
    fa::with_decomposer(d.decomposer, {.scaleout = fa::scaleout_of(topo), .quantum = d.rule},
                        [&](auto dec) { check(topo, std::move(dec), d); });
  });
}

} // namespace

// The planners over fixed_topology<8> are compiled in a second translation unit: this file again,
// with FASTA2A_FUZZ_PLANNER_FIXED (the object library fuzz_planner_fixed, tests/fuzz/CMakeLists.txt):
// each half of the instantiations builds in about half the time, side by side (the whole took 75 s,
// the fuzz job's longest build step). It decodes the input again.
void fuzz_planner_fixed(const std::uint8_t* data, std::size_t size);

#ifdef FASTA2A_FUZZ_PLANNER_FIXED
void fuzz_planner_fixed(const std::uint8_t* data, std::size_t size) {
  fuzz::bytes in(data, size);
  const decoded d = decode(in);
  check_named(fa::h200_cluster(d.servers), d);
}
#else
extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::bytes in(data, size);
  const decoded d = decode(in);
  if (d.fixed) fuzz_planner_fixed(data, size);
  else check_named(fa::two_tier_topology(d.servers, d.gpus), d);
  return 0;
}
#endif
