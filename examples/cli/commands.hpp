// fasta2a CLI: the commands main() dispatches to, and the failures they report as bugs in fasta2a
// (exit status 1) rather than as bad input (fasta2a::error, exit status 2).
#pragma once

#include "options.hpp"

#include <stdexcept>

namespace cli {

/// A plan that failed the verifier: a bug in the library, reported apart from bad input.
struct verification_failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// A wrong byte: the engine delivered something other than what was sent (a bug in fasta2a).
struct delivery_failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

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
