// fasta2a CLI: parsing the command line, and the help texts that document it (kept side by side so
// that a new option and its help line change together).
#include "options.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <functional>
#include <limits>
#include <set>
#include <system_error>

namespace cli {

const char* const general_usage =
    "usage: fasta2a plan [options]     plan all-to-allv traffic with FAST (see fasta2a plan --help)\n"
    "       fasta2a run [options]      execute all-to-allv calls with real bytes (see fasta2a run --help)\n"
    "       fasta2a --help             this text\n";

const char* const plan_usage = R"(usage: fasta2a plan --servers S --gpus G INPUT [options]

Plans all-to-allv traffic matrices with FAST, verifies every plan, and compares it with the
spread-out and direct baselines. One table row per matrix. LB, FAST, spread-out and direct are
predictions of the alpha-beta MODEL (bytes / bandwidth + alpha per stage), not measurements;
synth is the measured wall time of planning (median of --repeat runs): the whole plan, and
rank 0's part, which is what each rank computes per call.

Topology:
  --servers S             servers (required, at least 1)
  --gpus G                GPUs per server, one 50 GB/s NIC each (required, at least 1)
  --scaleup switch|mesh   switch: H200 NVSwitch, 450 GB/s per GPU port (default);
                          mesh: MI300X xGMI, 64 GB/s per GPU pair
Planning:
  --decomposer NAME       how the FAST plan is staged: birkhoff (exact, the paper; default),
                          bottleneck (exact, max-min matchings: fewer stages), slack (exact,
                          padding decided stage by stage: the fewest exact stages), quantized
                          (weights in multiples of a quantum chosen from --alpha: bounded padding,
                          far fewer stages), factorized (the fewest stages, or up to 4 more where
                          --alpha's model says faster; each pair in one, pairs of similar size
                          sharing a stage), best (whichever of those five or
                          spread-out the scale-out model predicts fastest),
                          spread-out, direct
  --adaptive              also predict direct sending, and send directly where that is faster
                          (small messages); the choice and its reason are printed and reported
  --granule BYTES         rail loads balanced to, and messages split on, this size; generated
                          matrices are made of it too (default 1)
  --alpha US              model cost of one stage's synchronisation, microseconds (default 10)
  --max-plan-bytes B      refuse to build a plan larger than B bytes (default 2GiB)
  --staging-budget B      staging memory per rank at most B bytes: where the plan's own layout
                          needs more, staging is shared across stages in two rings of
                          --staging-slots slots and stages are cut into slot-sized chunks (more
                          stages, same sum of weights; plan_options::staging_budget). Default: none
  --staging-fraction F    the budget as F of each matrix's largest buffer (the most bytes any rank
                          sends or receives), at least a granule per slot, at most --staging-budget
                          if given: what the engine does per call (engine_options::staging_fraction).
                          plan's default: none; run's default: the engine's, 0.25; 0 turns it off
  --staging-floor B       the least budget --staging-fraction gives (default 8MiB, the engine's
                          engine_options::staging_floor; 0: none): smaller calls keep their own
                          layout instead of stages cut into chunks too small to pay for their
                          synchronisations
  --staging-slots K       slots per staging ring where staging is shared (default 8)
  --rails MODE            shared (default: FAST, every rail of a server in step on server-level
                          stages), per-rail (each server pair on one rail, each rail's matrix
                          decomposed on its own: far fewer stages from a few dozen servers on,
                          more scale-up hops) or auto (whichever the scale-out model predicts
                          faster); plan_options::rails
  --repeat N              synthesis time = median of N plannings of one matrix (default 5)
  --rank R                plan only rank R's part (what rank R computes per call), never the whole
                          plan nor the baselines: memory is the matrix plus one rank's part, so
                          thousands of GPUs plan within the default --max-plan-bytes. See below
Input, exactly one of:
  --matrix FILE           trace of whitespace-separated counts, (S*G) x (S*G) per matrix; a regular
                          file (a FIFO, a device or a directory is refused before it is opened)
      --index K           plan matrix K of the trace, from 0 (default 0)
      --all               plan every matrix of the trace; a summary line follows the table
      --unit BYTES        bytes per count, e.g. 8192 for a bf16 token of hidden size 4096 (default 1)
  --uniform               every rank sends the same to every rank
  --zipf S                destinations drawn with Zipf(S) popularity
  --hotspot K             K hot ranks receive --hot-share F of every rank's bytes (default 0.5)
  --lognormal SIGMA       per-rank load log-normal with parameter SIGMA
      --bytes-per-rank B  bytes each rank sends (default 64MiB), rounded down to whole --granule;
                          options that give no traffic at all are an error (B = 0 plans none)
      --seed N            generator seed (default 1)
Output files (the plan and timeline of the first planned matrix):
  --json FILE             the FAST plan, format fasta2a.plan.v1
  --report FILE           one JSON object per line and matrix: index, ranks, servers, gpus, bytes,
                          stages, scaleup_bytes, staging_bytes (largest per-rank staging buffer),
                          lower_bound_s, lower_bound_alpha_s (LB_out plus alpha per stage a
                          staged plan needs at least: S - 1 where every server pair has traffic),
                          predicted_s, predicted_over_lower_bound_alpha, predicted_spreadout_s,
                          predicted_direct_s,
                          synthesis_us (whole plan), synthesis_rank_us (rank 0's part),
                          decomposer and choice (the schedule used and why, with best/--adaptive),
                          staging_budget (0: none), staging_ring (slots per ring where staging is
                          shared, else 0), buffer_bytes_max (the largest buffer: the most bytes any
                          rank sends or receives) and staging_over_own_buffer_max (the largest of
                          any rank's staging over its own larger buffer)
  --svg FILE              the model's timeline, FAST above direct sending

With --rank R (R from 0 to S*G - 1), one row per matrix of rank R's part: its stages, pieces
(those R sends, receives or carries on its rail) and ops, R's staging buffer and the largest of
any rank's, LB, LB+alpha, and the scale-out part of the FAST prediction (the stages' alpha +
weight / NIC bandwidth; for direct sending the busiest NIC's bytes): the whole prediction, the
baselines and the scale-up bytes need every rank's part and are left out. Every part is checked
on its own: R's messages, sent and received, tiled exactly by their pieces, R's rail within the
stage weights, its staging slots and ops (fasta2a::verify_rank_view); at up to 256 ranks, where
the whole plan fits --max-plan-bytes, the whole plan is also built and the part must equal its
pieces and ops for R. --json and --svg need the whole plan and are refused with --rank.
  --report FILE           with --rank, one JSON object per line and matrix: index, ranks, servers,
                          gpus, rank, bytes (the whole matrix), stages, pieces, ops, staging_bytes
                          (rank R's), staging_bytes_max (the largest of any rank), lower_bound_s,
                          lower_bound_alpha_s, predicted_scaleout_s, synthesis_rank_us,
                          decomposer, choice, checked ("whole plan" or "own messages")

Sizes take the suffixes K, M, G (or KiB, MiB, GiB): powers of 1024. Options take their value as
the next argument or after '=' (--servers=4).
Exit status: 0 done; 1 a plan failed verification (a bug in fasta2a); 2 bad input or plan too large.
)";

const char* const run_usage = R"(usage: fasta2a run --servers S --gpus G INPUT [options]

Executes all-to-allv calls with real bytes through the fasta2a engine: every send buffer is filled
with a pattern of (source, destination, offset) and every received byte is checked. Each call is
timed from the first rank's start to the last rank's return (median of --iters calls after one
warm-up; each call plans, though they repeat one matrix: engine_options::reuse_plans is off), next
to direct execution (every message straight to its destination) on the same
transport and buffers, and beside the plan's model figures.

  --transport host        ranks are threads of this process, sharing memory (default)
  --iters N               timed calls per matrix (default 5)
  --rail-window W         rail stages a rank may have in flight (engine_options::rail_window,
                          default 5)
  --timeout MS            how long a rank waits for a peer before it fails naming it
                          (engine_options::timeout, default 30000)
  --dump-program RANK     print rank RANK's program of the first call of each matrix (its
                          copies, coalesced puts, expects, signals and waits, per stage)
  --report FILE           one JSON object per line and matrix: index, ranks, servers, gpus, bytes,
                          stages, staging_bytes, call_s, direct_call_s, speedup, plan_s, exchange_s,
                          execute_s, predicted_s, predicted_direct_s, lower_bound_s, bytes_checked

Topology, planning and input options are those of `fasta2a plan` (--servers, --gpus, --scaleup,
--decomposer, --granule, --alpha, --max-plan-bytes, --staging-budget, --staging-fraction (default
0.25 here, as the engine's), --staging-floor, --staging-slots, --rails, --matrix/--index/--all/
--unit, --uniform, --zipf, --hotspot/--hot-share, --lognormal, --bytes-per-rank, --seed). One process holds every
rank's buffers: size --unit or --bytes-per-rank to the machine's memory.
Exit status: 0 every byte arrived; 1 a byte was wrong or a plan failed verification (a bug);
2 bad input.
)";

#ifdef FASTA2A_HAVE_MPI
const char* const mpi_run_usage = R"(
Over MPI (this fasta2a is built with the MPI transport), every process is one rank:
  mpirun -np N fasta2a run --transport mpi --gpus G INPUT [options]
  --transport mpi         servers are N / G consecutive ranks (--servers may be left out; if
                          given it must be N / G); every rank holds only its own buffers
  --compare-mpi           also run MPI_Alltoallv on the same send buffers and compare every
                          received byte with the engine's; its time is shown beside the engine's
  Times are the slowest rank's wall time per call after a barrier. The report adds
  mpi_alltoallv_s (null without --compare-mpi) and bytes_compared_mpi.
  --transport libfabric   the same under mpirun (MPI bootstraps and carries scale-up inside a
                          server), but scale-out between servers over libfabric RMA writes
                          (fasta2a::libfabric_transport); the provider is printed at start-up.
                          Only where this fasta2a is built with libfabric.
  --fi-provider P         libfabric's provider: tcp;ofi_rxm, shm, verbs;ofi_rxm, efa, cxi
                          (default: $FASTA2A_FI_PROVIDER, else tcp;ofi_rxm); libfabric's own
                          variables apply (FI_TCP_IFACE=eth1 pins tcp to one interface)
  --transport verbs       scale-out over libibverbs RC queue pairs: exits 2 saying why it cannot
                          run here (no RDMA device, or built without libibverbs)
)";
#else
const char* const mpi_run_usage = "";
#endif

#ifdef FASTA2A_HAVE_TCP_RUN
const char* const tcp_run_usage = R"(
Without MPI (this fasta2a is built with the libfabric transport), every process is one rank, started
by any launcher that sets torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; each
may be given as FASTA2A_<NAME> instead, or FASTA2A_BOOTSTRAP_ID=host:port for the last two):
  RANK=r WORLD_SIZE=N MASTER_ADDR=host MASTER_PORT=port fasta2a run --bootstrap tcp --transport libfabric --gpus G INPUT
  --bootstrap tcp         ranks find each other through rank 0 over TCP (fasta2a::tcp_bootstrap;
                          FASTA2A_BOOTSTRAP_TIMEOUT seconds, default 60); servers are N / G
                          consecutive ranks
  --transport libfabric   scale-up and scale-out over libfabric RMA (provider FASTA2A_FI_PROVIDER,
                          default tcp;ofi_rxm; FI_TCP_IFACE pins the tcp provider to one NIC)
  Times are the slowest rank's wall time per call after a barrier.
)";
#else
const char* const tcp_run_usage = "";
#endif

namespace {

/// A non-negative decimal integer that fits in `max`, or an error naming the option.
std::uint64_t parse_uint(std::string_view flag, std::string_view text, std::uint64_t max) {
  if (text.empty() || text.front() == '-' || text.front() == '+')
    throw fa::error(std::string(flag) + " expects a non-negative integer, got '" + std::string(text) + "'" +
                    (text.starts_with('-') ? " (negative)" : ""));
  std::uint64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec == std::errc::result_out_of_range ||
      (ec == std::errc() && end == text.data() + text.size() && v > max))
    throw fa::error(std::string(flag) + " value '" + std::string(text) + "' is too large (at most " +
                    std::to_string(max) + ")");
  if (ec != std::errc() || end != text.data() + text.size())
    throw fa::error(std::string(flag) + " expects a non-negative integer, got '" + std::string(text) + "'");
  return v;
}

/// A finite, non-negative decimal number.
double parse_real(std::string_view flag, std::string_view text) {
  double v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || !std::isfinite(v))
    throw fa::error(std::string(flag) + " expects a non-negative number, got '" + std::string(text) + "'");
  if (v < 0)
    throw fa::error(std::string(flag) + " expects a non-negative number, got '" + std::string(text) +
                    "' (negative)");
  return v;
}

int parse_positive_int(std::string_view flag, std::string_view text) {
  const auto v = parse_uint(flag, text, static_cast<std::uint64_t>(std::numeric_limits<int>::max()));
  if (v == 0) throw fa::error(std::string(flag) + " must be at least 1, got 0");
  return static_cast<int>(v);
}

} // namespace

std::optional<options> parse_options(const std::vector<std::string_view>& args, bool run) {
  options o;
  const char* command = run ? "fasta2a run" : "fasta2a plan";
  std::set<std::string, std::less<>> given;
  bool have_index = false, have_unit = false, have_share = false, have_bytes = false, have_seed = false;
  const auto set_input = [&](input_kind k, std::string_view flag) {
    if (o.input != input_kind::none)
      throw fa::error("two inputs given (" + o.input_flag + " and " + std::string(flag) +
                      "): give exactly one of --matrix, --uniform, --zipf, --hotspot, --lognormal");
    o.input = k;
    o.input_flag = std::string(flag);
  };
  for (std::size_t i = 0; i < args.size(); ++i) {
    std::string_view arg = args[i];
    if (arg == "--help" || arg == "-h") return std::nullopt;
    if (!arg.starts_with("--"))
      throw fa::error("unexpected argument '" + std::string(arg) +
                      "' (options start with --; see fasta2a plan --help)");
    std::string_view flag = arg;
    std::optional<std::string_view> inline_value;
    if (const auto eq = arg.find('='); eq != std::string_view::npos) {
      flag = arg.substr(0, eq);
      inline_value = arg.substr(eq + 1);
    }
    // A value is the rest after '=' or the next argument; an option in its place means the value
    // was forgotten, which says more than "'--gpus' is not a number".
    const auto value = [&]() -> std::string_view {
      if (inline_value) return *inline_value;
      if (i + 1 >= args.size() || args[i + 1].starts_with("--"))
        throw fa::error("option " + std::string(flag) + " needs a value");
      return args[++i];
    };
    const auto no_value = [&] {
      if (inline_value) throw fa::error("option " + std::string(flag) + " takes no value");
    };
    if (!given.insert(std::string(flag)).second)
      throw fa::error("option " + std::string(flag) + " given more than once");
    const bool run_only =
        flag == "--transport" || flag == "--iters" || flag == "--compare-mpi" || flag == "--rail-window" ||
        flag == "--timeout" || flag == "--dump-program" || flag == "--bootstrap" || flag == "--fi-provider";
    const bool plan_only = flag == "--json" || flag == "--svg" || flag == "--repeat" || flag == "--rank";
    if ((run_only && !run) || (plan_only && run))
      throw fa::error("option " + std::string(flag) + " does not apply to " + command + " (see " + command +
                      " --help)");

    if (flag == "--servers") o.servers = parse_positive_int(flag, value());
    else if (flag == "--gpus") o.gpus = parse_positive_int(flag, value());
    else if (flag == "--scaleup") {
      const std::string_view v = value();
      if (v == "switch") o.links = fa::h200_links;
      else if (v == "mesh") o.links = fa::mi300x_links;
      else throw fa::error("--scaleup expects switch or mesh, got '" + std::string(v) + "'");
    } else if (flag == "--decomposer") {
      const std::string_view v = value();
      if (!fa::is_decomposer_name(v))
        throw fa::error("--decomposer expects one of " + fa::decomposer_names_text() + ", got '" + std::string(v) +
                        "'");
      o.decomposer = std::string(v);
    } else if (flag == "--adaptive") {
      no_value();
      o.adaptive = true;
    } else if (flag == "--granule") {
      o.granule = fa::parse_bytes(value(), flag);
      if (o.granule == 0) throw fa::error("--granule must be at least 1 byte, got 0");
    } else if (flag == "--alpha") o.alpha_s = parse_real(flag, value()) * 1e-6; // microseconds on the command line
    else if (flag == "--max-plan-bytes") {
      const bytes_t b = fa::parse_bytes(value(), flag);
      o.max_plan_bytes =
          static_cast<std::size_t>(std::min<bytes_t>(b, std::numeric_limits<std::size_t>::max()));
    } else if (flag == "--staging-budget") {
      o.staging_budget = fa::parse_bytes(value(), flag);
      if (o.staging_budget == 0) throw fa::error("--staging-budget must be at least 1 byte, got 0 (leave it out for none)");
    } else if (flag == "--staging-floor") {
      o.staging_floor = fa::parse_bytes(value(), flag);
    } else if (flag == "--staging-fraction") {
      const std::string_view v = value();
      o.staging_fraction = parse_real(flag, v);
      if (!(o.staging_fraction >= 0) || !std::isfinite(o.staging_fraction))
        throw fa::error("--staging-fraction must be 0 (none) or above, got " + std::string(v));
    } else if (flag == "--rails") {
      const std::string_view v = value();
      if (v == "shared") o.rails = fa::rail_schedule::shared;
      else if (v == "per-rail") o.rails = fa::rail_schedule::per_rail;
      else if (v == "auto") o.rails = fa::rail_schedule::automatic;
      else throw fa::error("--rails must be shared, per-rail or auto, got '" + std::string(v) + "'");
    } else if (flag == "--staging-slots") o.staging_slots = static_cast<std::uint32_t>(parse_positive_int(flag, value()));
    else if (flag == "--repeat") o.repeat = static_cast<unsigned>(parse_positive_int(flag, value()));
    else if (flag == "--rank")
      o.rank = static_cast<rank_t>(parse_uint(flag, value(), static_cast<std::uint64_t>(std::numeric_limits<rank_t>::max())));
    else if (flag == "--matrix") {
      set_input(input_kind::matrix, flag);
      o.matrix_path = std::string(value());
    } else if (flag == "--index") {
      o.index = parse_uint(flag, value(), std::numeric_limits<std::size_t>::max());
      have_index = true;
    } else if (flag == "--all") {
      no_value();
      o.all = true;
    } else if (flag == "--unit") {
      o.unit = fa::parse_bytes(value(), flag);
      if (o.unit == 0) throw fa::error("--unit must be at least 1 byte per count, got 0");
      have_unit = true;
    } else if (flag == "--uniform") {
      no_value();
      set_input(input_kind::uniform, flag);
    } else if (flag == "--zipf") {
      set_input(input_kind::zipf, flag);
      o.zipf_s = parse_real(flag, value());
    } else if (flag == "--hotspot") {
      set_input(input_kind::hotspot, flag);
      o.hot = parse_positive_int(flag, value());
    } else if (flag == "--hot-share") {
      const std::string_view v = value();
      o.hot_share = parse_real(flag, v);
      if (o.hot_share > 1) throw fa::error("--hot-share must be in [0, 1], got " + std::string(v));
      have_share = true;
    } else if (flag == "--lognormal") {
      set_input(input_kind::lognormal, flag);
      o.sigma = parse_real(flag, value());
    } else if (flag == "--bytes-per-rank") {
      o.bytes_per_rank = fa::parse_bytes(value(), flag);
      have_bytes = true;
    } else if (flag == "--seed") {
      o.seed = parse_uint(flag, value(), std::numeric_limits<std::uint64_t>::max());
      have_seed = true;
    } else if (flag == "--json") o.json_path = std::string(value());
    else if (flag == "--report") o.report_path = std::string(value());
    else if (flag == "--svg") o.svg_path = std::string(value());
    else if (flag == "--transport") {
      const std::string_view v = value();
      if (v != "host" && v != "mpi" && v != "libfabric" && v != "verbs")
        throw fa::error("--transport expects host, mpi, libfabric or verbs, got '" + std::string(v) + "'");
      o.transport = std::string(v);
    } else if (flag == "--fi-provider") {
      const std::string_view v = value();
      if (v.empty()) throw fa::error("--fi-provider needs a provider name (tcp;ofi_rxm, shm, ...)");
      o.fi_provider = std::string(v);
    } else if (flag == "--iters") o.iters = static_cast<unsigned>(parse_positive_int(flag, value()));
    else if (flag == "--rail-window") o.rail_window = static_cast<std::size_t>(parse_positive_int(flag, value()));
    else if (flag == "--timeout") o.timeout = std::chrono::milliseconds(parse_positive_int(flag, value()));
    else if (flag == "--dump-program") o.dump_program = static_cast<int>(parse_uint(flag, value(), static_cast<std::uint64_t>(std::numeric_limits<int>::max())));
    else if (flag == "--bootstrap") {
      const std::string_view v = value();
      if (v != "tcp" && v != "mpi") throw fa::error("--bootstrap expects tcp or mpi, got '" + std::string(v) + "'");
      o.bootstrap = std::string(v);
    } else if (flag == "--compare-mpi") {
      no_value();
      o.compare_mpi = true;
    } else throw fa::error("unknown option '" + std::string(flag) + "' (see " + command + " --help)");
  }

  // Options that only mean something with another one are errors alone: silently ignoring
  // `--unit 8192` on a generator would print a plan of other traffic than the user asked for.
  // Under MPI the servers follow from the process count and --gpus.
  // MPI-launched runs (mpi, libfabric, verbs) and --bootstrap tcp: the servers follow from the
  // process count.
  const bool launched = run && (o.transport != "host" || o.bootstrap == "tcp");
  if (!o.fi_provider.empty() && o.transport != "libfabric")
    throw fa::error("--fi-provider applies to --transport libfabric only, not to --transport " + o.transport);
  if (o.servers == 0 && !launched)
    throw fa::error("--servers S is required (servers, at least 1)");
  if (o.gpus == 0) throw fa::error("--gpus G is required (GPUs per server, at least 1)");
  if (o.input == input_kind::none)
    throw fa::error(
        "no input: give --matrix FILE or one of --uniform, --zipf S, --hotspot K, --lognormal SIGMA");
  const bool trace = o.input == input_kind::matrix;
  if (!trace && (have_index || have_unit || o.all))
    throw fa::error(std::string(have_index  ? "--index"
                                : have_unit ? "--unit"
                                            : "--all") +
                    " applies to --matrix only, not to " + o.input_flag);
  if (trace && (have_bytes || have_seed))
    throw fa::error(std::string(have_bytes ? "--bytes-per-rank" : "--seed") +
                    " applies to the generators only, not to --matrix");
  if (have_share && o.input != input_kind::hotspot) throw fa::error("--hot-share applies to --hotspot only");
  if (o.all && have_index) throw fa::error("--all and --index cannot be combined: --all plans every matrix");
  // A rank's part is not a plan document nor a timeline: both are drawn from the whole plan.
  if (o.rank >= 0 && (!o.json_path.empty() || !o.svg_path.empty()))
    throw fa::error(std::string(o.json_path.empty() ? "--svg" : "--json") +
                    " needs the whole plan, which --rank does not build (drop --rank, or write --report)");
  o.links.scaleout_alpha = o.alpha_s; // the topology's scale-out model (fasta2a::scaleout_of) carries --alpha
  return o;
}

} // namespace cli
