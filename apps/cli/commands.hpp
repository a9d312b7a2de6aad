// fasta2a CLI: the commands main() dispatches to, and the failures they report as bugs in fasta2a
// (exit status 1) rather than as bad input (fasta2a::error, exit status 2).
#pragma once

#include "options.hpp"

#include <cstdio>
#include <stdexcept>
#include <string>
#include <string_view>

namespace cli {

/// A plan that failed the verifier: a bug in the library, reported apart from bad input.
struct verification_failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// A wrong byte: the engine delivered something other than what was sent (a bug in fasta2a).
struct delivery_failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Prints "fasta2a: error: MESSAGE" and a newline to stderr in one write. std::cerr is unbuffered,
/// so `std::cerr << a << b` is one write per piece, and under `mpirun --tag-output` two ranks that
/// fail together interleave their pieces: "[1,1]<stderr>:fasta2a: error: [1,3]<stderr>:fasta2a:
/// error: rank 3: ..." then "[1,1]<stderr>:rank 1: ...", the first rank's line cut from its prefix.
inline void say_error(std::string_view message) {
  std::string line = "fasta2a: error: ";
  line += message;
  line += '\n';
  std::fflush(stdout); // what the rank printed before comes first
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

/// `fasta2a plan`: plans every matrix, verifies each plan, prints the table and writes the files
/// the options ask for. Returns the exit status.
int plan_command(const options& o);

/// `fasta2a run --transport host`: every rank a thread of this process. Returns the exit status.
int run_host_command(const options& o);

/// `fasta2a run --transport verbs`: throws fasta2a::error saying why the verbs transport cannot
/// run here (no RDMA device, or built without libibverbs).
int run_verbs(const options& o);

#ifdef FASTA2A_HAVE_MPI
/// `fasta2a run --transport mpi` (and `--transport libfabric`: libfabric scale-out), between MPI_Init and MPI_Finalize: this process is one rank. An
/// error on one rank may leave the others waiting in MPI, so it aborts the whole job (after saying
/// what went wrong) rather than returning.
int run_mpi(const options& o);
#endif

#ifdef FASTA2A_HAVE_TCP_RUN
/// `fasta2a run --bootstrap tcp --transport libfabric`: this process is one rank, found through
/// fasta2a::tcp_bootstrap from the launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR,
/// MASTER_PORT). Returns the exit status; on an error the other ranks fail at their timeouts.
int run_tcp(const options& o);
#endif

} // namespace cli
