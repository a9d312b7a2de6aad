// Synthesis time of complete FAST plans (Google Benchmark): from the traffic matrix to a verified-
// shape, executable plan, with the planner object reused across calls as a runtime would.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "fasta2a/factorized.hpp"
#include "fasta2a/fewer_stages.hpp"
#include "fasta2a/planner.hpp"
#include "fasta2a/transpose.hpp"

using namespace fasta2a;

namespace {

const std::string megatron = std::string(FASTA2A_WORKLOADS_DIR) + "/megatron-4n-32gpu.txt";

const std::vector<traffic_matrix>& megatron_trace() {
  static const std::vector<traffic_matrix> trace =
      std::filesystem::exists(megatron) ? read_trace(megatron, 32, 8192) : std::vector<traffic_matrix>{};
  return trace;
}

// False, and the benchmark skipped with the path, where the trace is not there.
bool have_trace(benchmark::State& state) {
  if (!megatron_trace().empty()) return true;
  state.SkipWithError(("trace not found: " + megatron).c_str());
  return false;
}

// The Megatron trace at S x 8 GPUs: the 32 x 32 matrices tiled as blocks, block (i, j) taken from
// a different iteration so that the tiles are not copies of one another.
traffic_matrix megatron_tiled(int servers, std::size_t first) {
  const auto& trace = megatron_trace();
  const rank_t n = servers * 8;
  traffic_matrix t(n, n);
  const int blocks = (n + 31) / 32;
  for (int bi = 0; bi < blocks; ++bi)
    for (int bj = 0; bj < blocks; ++bj) {
      const auto& m = trace[(first + static_cast<std::size_t>(bi) * blocks + bj) % trace.size()];
      for (int i = 0; i < 32 && bi * 32 + i < n; ++i)
        for (int j = 0; j < 32 && bj * 32 + j < n; ++j) t(bi * 32 + i, bj * 32 + j) = m(i, j);
    }
  return t;
}

// What a benchmark plans: the whole plan (every rank's part) or one rank's part, which is what
// each rank computes per call; with exact Birkhoff (the paper) or the default quantised
// decomposer (closed-form quantum, alpha 10 us), the slack decomposer (exact, fewest exact stages)
// or the factorized one (S - 1 stages, each pair in one: the nearest to LB_alpha on dense traffic).
enum mode : int {
  whole_birkhoff = 0,
  rank_birkhoff = 1,
  whole_quantized = 2,
  rank_quantized = 3,
  whole_slack = 4,
  rank_slack = 5,
  whole_factorized = 6,
  rank_factorized = 7
};

template <class D>
void run_with(benchmark::State& state, const std::vector<traffic_matrix>& inputs, int servers, bytes_t granule,
              bool rank_view) {
  planner<fixed_topology<8>, D> pl(h200_cluster(servers), {.granule = granule});
  plan p;
  std::size_t i = 0, stages = 0, plans = 0, memory = 0;
  const rank_t ranks = servers * 8;
  auto make = [&](const traffic_matrix& t) {
    // Rank views cycle through the ranks: servers differ in how much phase 1 they need.
    if (rank_view) pl.make_rank_into(t, static_cast<rank_t>(plans % static_cast<std::size_t>(ranks)), p);
    else pl.make_into(t, p);
  };
  try {
    make(inputs[0]); // warm the planner's and the plan's storage
    for (auto _ : state) {
      make(inputs[i]);
      benchmark::DoNotOptimize(p.pieces.data());
      stages += p.stages();
      memory = std::max(memory, p.memory_bytes());
      ++plans;
      i = (i + 1) % inputs.size();
    }
  } catch (const plan_too_large& e) {
    state.SkipWithError(e.what());
    return;
  }
  state.counters["stages"] = static_cast<double>(stages) / std::max<std::size_t>(plans, 1);
  state.counters["plan_MB"] = static_cast<double>(memory) / 1e6;
  state.counters["ranks"] = servers * 8;
}

void run(benchmark::State& state, std::vector<traffic_matrix> inputs, int servers, bytes_t granule) {
  const auto m = static_cast<mode>(state.range(1));
  static const char* labels[] = {"whole plan, birkhoff",  "rank's part, birkhoff", "whole plan, quantized",
                                 "rank's part, quantized", "whole plan, slack",     "rank's part, slack",
                                 "whole plan, factorized", "rank's part, factorized"};
  state.SetLabel(labels[m]);
  if (m == whole_birkhoff || m == rank_birkhoff)
    run_with<birkhoff_decomposer>(state, inputs, servers, granule, m == rank_birkhoff);
  else if (m == whole_quantized || m == rank_quantized)
    run_with<quantized_decomposer>(state, inputs, servers, granule, m == rank_quantized);
  else if (m == whole_slack || m == rank_slack)
    run_with<slack_decomposer>(state, inputs, servers, granule, m == rank_slack);
  else
    run_with<factorized_decomposer>(state, inputs, servers, granule, m == rank_factorized);
}

void BM_synthesis_megatron(benchmark::State& state) {
  const int servers = static_cast<int>(state.range(0));
  if (!have_trace(state)) return;
  std::vector<traffic_matrix> inputs;
  // 4 x 8 is the trace itself, every matrix in turn; larger clusters tile it.
  const std::size_t count = servers == 4 ? 600 : (servers <= 40 ? 16 : 2);
  for (std::size_t k = 0; k < count; ++k)
    inputs.push_back(servers == 4 ? megatron_trace()[k] : megatron_tiled(servers, k * 7));
  run(state, std::move(inputs), servers, 8192);
}

void BM_synthesis_zipf(benchmark::State& state) {
  const int servers = static_cast<int>(state.range(0));
  std::vector<traffic_matrix> inputs;
  const int count = servers <= 40 ? 16 : 2;
  for (int k = 0; k < count; ++k)
    inputs.push_back(zipf_traffic(servers * 8, 1.0, bytes_t{64} << 20, 1000 + k, 8192));
  run(state, std::move(inputs), servers, 8192);
}

// A rank's part as a runtime meets it: a different matrix every call. The benchmarks above cycle
// through 16 matrices (2 at 128 servers and more), 512 KiB at 64 GPUs, which fit in a 1 MiB L2
// cache and which a branch predictor partly learns; these cycle through 128 (4 MiB at 64 GPUs),
// none planned again before the other 127.
constexpr std::size_t fresh_inputs = 128;

void BM_synthesis_megatron_fresh(benchmark::State& state) {
  const int servers = static_cast<int>(state.range(0));
  if (!have_trace(state)) return;
  std::vector<traffic_matrix> inputs;
  for (std::size_t k = 0; k < fresh_inputs; ++k) inputs.push_back(megatron_tiled(servers, k * 7));
  run(state, std::move(inputs), servers, 8192);
}

void BM_synthesis_zipf_fresh(benchmark::State& state) {
  const int servers = static_cast<int>(state.range(0));
  std::vector<traffic_matrix> inputs;
  for (std::size_t k = 0; k < fresh_inputs; ++k)
    inputs.push_back(zipf_traffic(servers * 8, 1.0, bytes_t{64} << 20, 2000 + k, 8192));
  run(state, std::move(inputs), servers, 8192);
}

// An MoE layer's combine after its dispatch: the combine's matrix is the dispatch's transposed.
// Its plan, planned (`transposed_plan` 0: the baseline, the same as BM_synthesis_* of the
// transposed inputs) or made from the dispatch's plan (1: transpose_into, the dispatch's plans
// made before the timing). The same inputs and ranks both ways.
template <class D>
void combine_with(benchmark::State& state, const std::vector<traffic_matrix>& dispatch, int servers, bool rank_view,
                  bool from_dispatch, rail_schedule rails) {
  planner<fixed_topology<8>, D> pl(h200_cluster(servers), {.granule = 8192, .rails = rails});
  const rank_t ranks = servers * 8;
  std::vector<traffic_matrix> combine;
  std::vector<plan> made(dispatch.size());
  std::vector<server_matrix> m(dispatch.size());
  std::vector<std::vector<bytes_t>> balance(dispatch.size());
  for (std::size_t k = 0; k < dispatch.size(); ++k) {
    combine.push_back(dispatch[k].transpose());
    const auto r = static_cast<rank_t>(k % static_cast<std::size_t>(ranks));
    if (rank_view) pl.make_rank_into(dispatch[k], r, made[k]);
    else pl.make_into(dispatch[k], made[k]);
    m[k] = pl.rail_matrix();
    balance[k] = pl.balance_bytes();
  }
  plan p;
  std::size_t i = 0, stages = 0, calls = 0, per_rail = 0;
  for (auto _ : state) {
    const auto r = static_cast<rank_t>(i % static_cast<std::size_t>(ranks));
    if (from_dispatch) transpose_into<8>(made[i], m[i], p, balance[i]);
    else if (rank_view) pl.make_rank_into(combine[i], r, p);
    else pl.make_into(combine[i], p);
    benchmark::DoNotOptimize(p.pieces.data());
    stages += p.stages();
    per_rail += p.per_rail();
    ++calls;
    i = (i + 1) % dispatch.size();
  }
  state.counters["stages"] = static_cast<double>(stages) / static_cast<double>(std::max<std::size_t>(calls, 1));
  state.counters["per_rail"] = static_cast<double>(per_rail) / static_cast<double>(std::max<std::size_t>(calls, 1));
  state.counters["ranks"] = ranks;
}

void BM_combine(benchmark::State& state) {
  const int servers = static_cast<int>(state.range(0));
  const auto m = static_cast<mode>(state.range(1));
  const bool megatron_inputs = state.range(2) != 0, from_dispatch = state.range(3) != 0;
  const rail_schedule rails = state.range(4) != 0 ? rail_schedule::automatic : rail_schedule::shared;
  if (megatron_inputs && !have_trace(state)) return;
  std::vector<traffic_matrix> inputs;
  const std::size_t count = servers > 64 ? 2 : 16; // at 4096 GPUs a matrix is 134 MB: two, and their combines
  for (std::size_t k = 0; k < count; ++k)
    inputs.push_back(megatron_inputs ? megatron_tiled(servers, k * 7)
                                     : zipf_traffic(servers * 8, 1.0, bytes_t{64} << 20, 1000 + k, 8192));
  const bool rank_view = m == rank_slack || m == rank_factorized;
  state.SetLabel(std::string(megatron_inputs ? "megatron, " : "zipf, ") + (rank_view ? "rank's part, " : "whole plan, ") +
                 (m == rank_slack || m == whole_slack ? "slack, " : "factorized, ") +
                 (from_dispatch ? "transposed from the dispatch's" : "planned") +
                 (rails == rail_schedule::automatic ? ", rails auto" : ""));
  if (m == rank_slack || m == whole_slack)
    combine_with<slack_decomposer>(state, inputs, servers, rank_view, from_dispatch, rails);
  else
    combine_with<factorized_decomposer>(state, inputs, servers, rank_view, from_dispatch, rails);
}

void combine_scales(benchmark::internal::Benchmark* b) {
  b->Unit(benchmark::kMicrosecond)->Repetitions(5)->ReportAggregatesOnly(true);
  for (int servers : {8, 40})
    for (int m : {rank_slack, rank_factorized, whole_slack})
      for (int megatron_inputs : {0, 1})
        for (int from_dispatch : {0, 1}) b->Args({servers, m, megatron_inputs, from_dispatch, 0});
}

// A rank's part at 4096 GPUs (the two inputs of BM_combine there), planned, and transposed: more
// calls, so that the plan it is made into has its storage from earlier calls, as the engine's has.
// Shared stages, and factorized with rail_schedule::automatic (per-rail plans there: counter
// per_rail), as item 2's table plans 4096 GPUs.
template <int from_dispatch>
void big_combine_scales(benchmark::internal::Benchmark* b) {
  b->Unit(benchmark::kMillisecond)->Iterations(from_dispatch ? 20 : 2)->Repetitions(3)->ReportAggregatesOnly(true);
  for (int m : {rank_slack, rank_factorized})
    for (int megatron_inputs : {0, 1}) b->Args({512, m, megatron_inputs, from_dispatch, 0});
  for (int megatron_inputs : {0, 1}) b->Args({512, rank_factorized, megatron_inputs, from_dispatch, 1});
}

// The engine's test of whether a call's matrix is its last plan's transposed (engine_options::
// reuse_plans), on a combine at n ranks: the matrix gathered as the engine holds it (each rank's
// n counts and its header of 14 words), the last one transposed. `rank_test` 1: what the engine
// does, each rank's row against its row and column of the last matrix, then every rank's answer
// read from the headers; 0, the baseline: every rank comparing the whole matrix with the last
// one, both ways, in 32 x 32 blocks (the engine until 2026-12-06).
void BM_reuse_test(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0)), w = n + 14;
  const bool rank_test = state.range(1) != 0;
  std::vector<std::uint64_t> now(n * w, 0), last(n * w, 0);
  std::mt19937_64 rng(7);
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t j = 0; j < n; ++j) last[i * w + j] = rng() % 100000;
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t j = 0; j < n; ++j) now[i * w + j] = last[j * w + i];
  const std::size_t me = n / 3, h_match = n + 13;
  std::vector<std::uint64_t> last_row(last.begin() + static_cast<std::ptrdiff_t>(me * w),
                                      last.begin() + static_cast<std::ptrdiff_t>(me * w + n)),
      last_col(n);
  for (std::size_t j = 0; j < n; ++j) last_col[j] = last[j * w + me];
  for (std::size_t r = 0; r < n; ++r) now[r * w + h_match] = 2; // every rank's column matched
  int found = 0;
  for (auto _ : state) {
    bool same = true, flipped = true;
    if (rank_test) {
      const std::uint64_t* row = now.data() + me * w;
      const bool r = std::equal(row, row + n, last_row.begin(), last_row.end());
      const bool c = std::equal(row, row + n, last_col.begin(), last_col.end());
      std::uint64_t match = (r ? 1 : 0) | (c ? 2 : 0);
      for (std::size_t k = 0; k < n; ++k) match &= now[k * w + h_match];
      same = (match & 1) != 0;
      flipped = (match & 2) != 0;
    } else {
      const std::uint64_t *a = now.data(), *b = last.data();
      for (std::size_t i0 = 0; i0 < n && (same || flipped); i0 += 32)
        for (std::size_t j0 = 0; j0 < n && (same || flipped); j0 += 32) {
          const std::size_t i1 = std::min(n, i0 + 32), j1 = std::min(n, j0 + 32);
          for (std::size_t i = i0; i < i1; ++i) {
            for (std::size_t j = j0; j < j1; ++j) {
              const std::uint64_t x = a[i * w + j];
              same &= x == b[i * w + j];
              flipped &= x == b[j * w + i];
            }
            if (!same && !flipped) break;
          }
        }
    }
    found += !same && flipped;
    benchmark::ClobberMemory();
  }
  if (found != static_cast<int>(state.iterations())) state.SkipWithError("the transposed matrix was not found");
  state.counters["ranks"] = static_cast<double>(n);
  state.SetLabel(rank_test ? "each rank its row, answers in the headers" : "whole matrix both ways (baseline)");
}

// What the plan format alone costs: the whole slack plans of BM_synthesis_* at 64 GPUs, made before
// the timing, each copied piece by piece into a plan, its op index built as the planner builds it
// (detail::index_builder, counted as each piece is stored, placed at the end) and its message
// index set, with no planning at all. Item 3 of issue 13 asks for the whole plan in 50 us: where
// this alone takes about that, a planner that writes every piece and op of every rank cannot get
// there by planning faster. `rank_view` 1: the same for rank views (cycling through the ranks).
void BM_plan_materialize(benchmark::State& state) {
  const int servers = static_cast<int>(state.range(0));
  const bool megatron_inputs = state.range(1) != 0, rank_view = state.range(2) != 0;
  if (megatron_inputs && !have_trace(state)) return;
  const rank_t ranks = servers * 8;
  planner<fixed_topology<8>, slack_decomposer> pl(h200_cluster(servers), {.granule = 8192});
  std::vector<plan> made;
  for (std::size_t k = 0; k < 16; ++k) {
    const traffic_matrix t = megatron_inputs ? megatron_tiled(servers, k * 7)
                                             : zipf_traffic(ranks, 1.0, bytes_t{64} << 20, 1000 + k, 8192);
    made.push_back(rank_view ? pl.make_rank(t, static_cast<rank_t>(k * 5 % static_cast<std::size_t>(ranks)))
                             : pl.make(t));
  }
  plan q;
  detail::index_builder<8> index;
  std::size_t i = 0, pieces = 0, ops = 0, plans = 0;
  for (auto _ : state) {
    const plan& p = made[i];
    q.servers = p.servers;
    q.gpus_per_server = p.gpus_per_server;
    q.view = p.view;
    q.stage_weight.assign(p.stage_weight.begin(), p.stage_weight.end());
    q.message_first.assign(p.message_first.begin(), p.message_first.end());
    q.message_count.assign(p.message_count.begin(), p.message_count.end());
    q.pieces.clear();
    index.begin(q);
    for (const piece& pc : p.pieces) {
      index.add(pc);
      q.pieces.push_back(pc);
    }
    index.finish();
    benchmark::DoNotOptimize(q.op_list.data());
    pieces += q.pieces.size();
    ops += q.op_list.size();
    ++plans;
    i = (i + 1) % made.size();
  }
  if (q.op_list != made[(i + made.size() - 1) % made.size()].op_list) state.SkipWithError("the op index differs");
  state.counters["pieces"] = static_cast<double>(pieces) / static_cast<double>(std::max<std::size_t>(plans, 1));
  state.counters["ops"] = static_cast<double>(ops) / static_cast<double>(std::max<std::size_t>(plans, 1));
  state.counters["ranks"] = ranks;
  state.SetLabel(std::string(megatron_inputs ? "megatron, " : "zipf, ") +
                 (rank_view ? "a rank's pieces and ops, copied and indexed" : "whole plan's pieces and ops, copied and indexed"));
}

// Phase 2 alone (exact Birkhoff on the server matrix), where the whole plan is too large to build:
// how many stages exact decomposition needs and what it costs.
void BM_decompose_birkhoff(benchmark::State& state) {
  const int servers = static_cast<int>(state.range(0));
  const bool zipf = state.range(1) != 0;
  if (!zipf && !have_trace(state)) return;
  const traffic_matrix t =
      zipf ? zipf_traffic(servers * 8, 1.0, bytes_t{64} << 20, 1000, 8192) : megatron_tiled(servers, 0);
  server_matrix m = server_matrix::Zero(servers, servers);
  for (int s = 0; s < servers; ++s)
    for (int d = 0; d < servers; ++d)
      if (s != d) m(s, d) = per_rail_bytes(t.block(s * 8, d * 8, 8, 8).sum(), 8, 8192);
  birkhoff_decomposer dec;
  stage_list out;
  for (auto _ : state) {
    dec.decompose(m, out);
    benchmark::DoNotOptimize(out.weights.data());
  }
  state.counters["stages"] = static_cast<double>(out.size());
  state.counters["ranks"] = servers * 8;
  state.SetLabel(zipf ? "zipf" : "megatron");
}

void scales(benchmark::internal::Benchmark* b) {
  b->Unit(benchmark::kMicrosecond)->Repetitions(5)->ReportAggregatesOnly(true);
  for (int servers : {4, 8, 40})
    for (int m = 0; m < 8; ++m) b->Args({servers, m});
}
void big_scales(benchmark::internal::Benchmark* b) {
  b->Unit(benchmark::kMillisecond)->Iterations(2)->Repetitions(3)->ReportAggregatesOnly(true);
  for (int servers : {128, 512})
    for (int m = 0; m < 8; ++m) b->Args({servers, m});
}

void fresh_scales(benchmark::internal::Benchmark* b) {
  b->Unit(benchmark::kMicrosecond)->Repetitions(5)->ReportAggregatesOnly(true);
  for (int m : {rank_slack, rank_factorized, whole_slack}) b->Args({8, m});
}

} // namespace

BENCHMARK(BM_synthesis_megatron)->Apply(scales);
BENCHMARK(BM_synthesis_megatron_fresh)->Apply(fresh_scales);
BENCHMARK(BM_synthesis_zipf_fresh)->Apply(fresh_scales);
BENCHMARK(BM_synthesis_zipf)->Apply(scales);
BENCHMARK(BM_synthesis_megatron)->Apply(big_scales);
BENCHMARK(BM_synthesis_zipf)->Apply(big_scales);

BENCHMARK(BM_combine)->Apply(combine_scales);
BENCHMARK(BM_combine)->Apply(big_combine_scales<0>);
BENCHMARK(BM_combine)->Apply(big_combine_scales<1>);
BENCHMARK(BM_reuse_test)->Unit(benchmark::kMicrosecond)->Repetitions(5)->ReportAggregatesOnly(true)
    ->Args({64, 0})->Args({64, 1})->Args({1024, 0})->Args({1024, 1})->Args({4096, 0})->Args({4096, 1});

BENCHMARK(BM_plan_materialize)->Unit(benchmark::kMicrosecond)->Repetitions(5)->ReportAggregatesOnly(true)
    ->Args({8, 0, 0})->Args({8, 1, 0})->Args({8, 0, 1})->Args({8, 1, 1});

BENCHMARK(BM_decompose_birkhoff)
    ->Unit(benchmark::kMillisecond)->Iterations(1)->Repetitions(3)->ReportAggregatesOnly(true)
    ->Args({128, 0})->Args({128, 1})->Args({512, 0})->Args({512, 1});

BENCHMARK_MAIN();
