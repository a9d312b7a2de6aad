// fasta2a CLI: the command line's options, their help texts, and what they mean to the library.
// Every option is read here and only here; the commands see an `options` value, already checked.
#pragma once

#include <fasta2a/common.hpp>
#include <fasta2a/engine.hpp>
#include <fasta2a/planner.hpp>
#include <fasta2a/registry.hpp>
#include <fasta2a/topology.hpp>

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace cli {

namespace fa = fasta2a;
using fa::bytes_t;
using fa::rank_t;

/// `fasta2a --help`, and what an empty command line prints after its error.
extern const char* const general_usage;
/// `fasta2a plan --help`.
extern const char* const plan_usage;
/// `fasta2a run --help`.
extern const char* const run_usage;
/// Appended to run_usage: the MPI transport's options where it is built, else empty.
extern const char* const mpi_run_usage;
/// Appended to run_usage: `--bootstrap tcp` where it is built (with libfabric), else empty.
extern const char* const tcp_run_usage;

/// Which traffic the options ask for.
enum class input_kind { none, matrix, uniform, zipf, hotspot, lognormal };

/// Everything the command line says, checked: sizes in bytes, times in seconds.
struct options {
  int servers = 0;
  int gpus = 0;
  fa::link_model links = fa::h200_links;
  std::string decomposer = "birkhoff"; // one of fa::decomposer_names()
  bool adaptive = false;
  bytes_t granule = 1;
  double alpha_s = 10e-6; // --alpha is given in microseconds; parse_options converts it, once
  std::size_t max_plan_bytes = fa::plan_options{}.max_plan_bytes;
  /// --staging-budget B: plan_options::staging_budget (0: none). --staging-fraction F: the budget
  /// as F of the call's largest buffer (engine_options::staging_fraction; 0: none; negative: the
  /// command's default, the engine's 0.25 for run and none for plan). --staging-slots K.
  bytes_t staging_budget = 0;
  double staging_fraction = -1;
  /// --staging-floor B: the least budget --staging-fraction gives (engine_options::staging_floor).
  bytes_t staging_floor = fa::default_staging_floor;
  std::uint32_t staging_slots = fa::plan_options{}.staging_slots;
  /// --rails shared|per-rail|auto: plan_options::rails.
  fa::rail_schedule rails = fa::rail_schedule::shared;
  unsigned repeat = 5;
  /// --rank R: plan only rank R's part (planner::make_rank_into), never the whole plan nor the
  /// baselines; -1: the whole plan. Checked against the ranks in plan_command, which knows S x G.
  rank_t rank = -1;

  input_kind input = input_kind::none;
  std::string input_flag; // as given, for messages
  std::string matrix_path;
  std::size_t index = 0;
  bool all = false;
  bytes_t unit = 1;
  double zipf_s = 0;
  rank_t hot = 0;
  double hot_share = 0.5;
  double sigma = 0;
  bytes_t bytes_per_rank = bytes_t{64} << 20;
  std::uint64_t seed = 1;

  std::string json_path, report_path, svg_path;

  // fasta2a run
  std::string transport = "host"; // host, mpi, libfabric (MPI-launched, libfabric scale-out), verbs
  /// --fi-provider: the libfabric provider of --transport libfabric (empty: FASTA2A_FI_PROVIDER,
  /// else tcp;ofi_rxm).
  std::string fi_provider;
  unsigned iters = 5;
  std::size_t rail_window = fa::engine_options{}.rail_window;
  /// --timeout MS: how long a rank waits for a peer (engine_options::timeout, and the MPI run's own
  /// barriers and reductions).
  std::chrono::milliseconds timeout = fa::engine_options{}.timeout;
  bool compare_mpi = false;
  /// --bootstrap: "tcp" (fasta2a::tcp_bootstrap, every process one rank), "mpi", or empty (the
  /// transport's own: threads for host, MPI for mpi).
  std::string bootstrap;
  /// --dump-program RANK: print that rank's rank program of the first call (-1: none).
  int dump_program = -1;
};

/// Parses the arguments of `fasta2a plan` (or, with `run`, of `fasta2a run`). Returns nothing
/// when help was asked for. Throws fasta2a::error naming the option for anything it cannot take:
/// an unknown or repeated option, a missing or malformed value, options that contradict each
/// other or do not apply to the command.
std::optional<options> parse_options(const std::vector<std::string_view>& args, bool run);

/// The decomposer configuration of the options: the topology's scale-out model, which carries --alpha: what
/// fasta2a::with_decomposer(o.decomposer, ...) is given. The closed-form quantum, since a runtime
/// plans on every call.
inline fa::decomposer_params decomposer_params_of(const fa::scaleout_model& scaleout) {
  return {.scaleout = scaleout, .quantum = fa::quantum_rule::formula};
}

/// Planning options from the command line: --adaptive adds the direct fallback at --alpha.
/// How many ranks run on this machine, from what launchers set: LOCAL_WORLD_SIZE (torchrun,
/// launch_ranks.sh, cluster.sh), OMPI_COMM_WORLD_LOCAL_SIZE (Open MPI), MPI_LOCALNRANKS (MPICH);
/// 1 where none is set.
inline int ranks_on_this_machine() {
  for (const char* name : {"LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"})
    if (const char* v = std::getenv(name); v != nullptr && *v != '\0') {
      const long k = std::strtol(v, nullptr, 10);
      if (k >= 1 && k <= (1 << 20)) return static_cast<int>(k);
    }
  return 1;
}

/// The memory this process may use: the machine's physical memory, shared equally by `sharing`
/// processes of the job on it, or less where the address space is limited (ulimit -v).
inline long double memory_limit_bytes(int sharing = 1) {
  long double limit = std::numeric_limits<std::ptrdiff_t>::max(); // what a vector can address
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  if (pages > 0 && page > 0) limit = std::min(limit, static_cast<long double>(pages) * page / std::max(sharing, 1));
  rlimit as{};
  if (getrlimit(RLIMIT_AS, &as) == 0 && as.rlim_cur != RLIM_INFINITY)
    limit = std::min(limit, static_cast<long double>(as.rlim_cur));
  return limit;
}

inline fa::plan_options planning_options(const options& o) {
  fa::plan_options p{o.granule, o.max_plan_bytes};
  if (o.adaptive) p.direct_if_faster_alpha = o.alpha_s;
  p.staging_budget = o.staging_budget;
  p.staging_slots = o.staging_slots;
  p.rails = o.rails;
  return p;
}

/// The staging budget `fasta2a plan` plans matrix t with: --staging-fraction of its largest buffer
/// as the engine computes it, else --staging-budget (0: none).
inline bytes_t staging_budget_of(const options& o, const fa::traffic_view& t) {
  if (o.staging_fraction <= 0) return o.staging_budget;
  return fa::staging_budget_for(fa::largest_buffer(t), o.staging_fraction, planning_options(o), o.staging_floor);
}

} // namespace cli
