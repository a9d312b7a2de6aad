// fasta2a: the command-line program. `fasta2a plan` plans traffic matrices (a recorded trace or a
// synthetic generator), verifies every plan, and compares the FAST plan with the spread-out and
// direct baselines in the alpha-beta cost model (plan.cpp). `fasta2a run` executes all-to-allv
// calls with real bytes on a transport, checks every received byte, and measures them against
// direct execution on the same transport (run_host.cpp, run_mpi.cpp). Options and help texts are
// in options.cpp. This file picks the command and turns what it throws into an exit status.
#include "commands.hpp"
#include "options.hpp"

#include <exception>
#include <iostream>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace cli {
namespace {

int run_run(const std::vector<std::string_view>& args) {
  const std::optional<options> parsed = parse_options(args, true);
  if (!parsed) {
    std::cout << run_usage << mpi_run_usage << tcp_run_usage;
    return 0;
  }
  const options& o = *parsed;
  if (o.transport == "verbs") return run_verbs(o); // exits 2 here, saying why
  if (o.bootstrap == "tcp") {
#ifdef FASTA2A_HAVE_TCP_RUN
    if (o.transport != "libfabric")
      throw fa::error("--bootstrap tcp runs with --transport libfabric (got --transport " + o.transport + ")");
    if (o.compare_mpi) throw fa::error("--compare-mpi needs MPI, not --bootstrap tcp");
    return run_tcp(o);
#else
    throw fa::error("--bootstrap tcp is not built into this fasta2a (it needs the libfabric transport)");
#endif
  }
  if (o.bootstrap == "mpi" && o.transport == "host")
    throw fa::error("--bootstrap mpi needs processes started by mpirun (--transport mpi), not --transport host");
#ifdef FASTA2A_HAVE_MPI
  if (o.transport == "mpi") return run_mpi(o);
#ifdef FASTA2A_HAVE_LIBFABRIC
  if (o.transport == "libfabric") return run_mpi(o);
#endif
#endif
  if (o.transport == "libfabric")
    throw fa::error("--transport libfabric runs here with --bootstrap tcp (every process one rank, started without MPI)");
  if (o.transport != "host")
    throw fa::error("--transport " + o.transport + " is not built into this fasta2a (" +
#ifdef FASTA2A_HAVE_MPI
                    "host and mpi only: libfabric-dev was not found when it was built"
#else
                    "host only: MPI was not found when it was built"
#endif
                    + ")");
  if (o.compare_mpi) throw fa::error("--compare-mpi needs --transport mpi or libfabric");
  return run_host_command(o);
}

int run_plan(const std::vector<std::string_view>& args) {
  const std::optional<options> parsed = parse_options(args, false);
  if (!parsed) {
    std::cout << plan_usage;
    return 0;
  }
  return plan_command(*parsed);
}

} // namespace
} // namespace cli

int main(int argc, char** argv) {
  using namespace cli;
  const std::vector<std::string_view> args(argv + 1, argv + argc);
  try {
    if (args.empty()) {
      std::cerr << "fasta2a: error: no command given\n" << general_usage;
      return 2;
    }
    if (args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
      std::cout << general_usage << "\n" << plan_usage;
      return 0;
    }
    if (args[0] == "run") return run_run({args.begin() + 1, args.end()});
    if (args[0] != "plan")
      throw fa::error("unknown command '" + std::string(args[0]) + "' (try fasta2a --help)");
    return run_plan({args.begin() + 1, args.end()});
  } catch (const delivery_failure& e) {
    say_error(std::string(e.what()) + " (this is a bug in fasta2a; please report it)");
    return 1;
  } catch (const verification_failure& e) {
    say_error(std::string(e.what()) + " (this is a bug in fasta2a; please report it)");
    return 1;
  } catch (const fa::error& e) { // plan_too_large included
    say_error(e.what());
    return 2;
  } catch (const std::bad_alloc&) {
    say_error("out of memory (try fewer ranks or a smaller --max-plan-bytes)");
    return 2;
  } catch (const std::exception& e) {
    say_error(std::string("internal error: ") + e.what());
    return 1;
  }
}
