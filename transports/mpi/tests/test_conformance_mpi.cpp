// The conformance suite (tests/conformance/) on the MPI transport: one rank per process, run under
// mpiexec at several process counts; without and with random delays before every operation. Every
// rank runs every case and sees every rank's outcome; the exit status is the worst of all ranks.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "mpi_doctest_main.hpp"

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <fasta2a/mpi.hpp>

#include "conformance/conformance.hpp"

namespace {

/// The processes of MPI_COMM_WORLD; the transport cuts messages at 4093 bytes so that chunking is
/// exercised everywhere. DelayUs > 0 pauses a random time below it before half of the operations.
template <int DelayUs>
struct mpi_world {
  static constexpr const char* name = DelayUs > 0 ? "MPI transport, random delays" : "MPI transport";
  using bootstrap = fasta2a::mpi_bootstrap;
  using transport = fasta2a::mpi_transport;
  static constexpr std::size_t chunk = 4093;
  static fasta2a::rank_t ranks(fasta2a::rank_t) {
    int n = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    return n;
  }
  static std::size_t chunk_limit() { return chunk; }
  static std::chrono::microseconds max_delay() { return std::chrono::microseconds(DelayUs); }

  template <class F>
  static std::vector<std::string> run(fasta2a::rank_t n, F&& f, std::chrono::milliseconds timeout) {
    const fasta2a::rank_t size = ranks(0);
    if (n != size) throw fasta2a::error("mpi_world: a case asked for " + std::to_string(n) + " ranks, the world has " + std::to_string(size));
    int me = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    std::string mine;
    try {
      fasta2a::mpi_bootstrap boot(MPI_COMM_WORLD, {.timeout = timeout});
      fasta2a::mpi_transport base(MPI_COMM_WORLD, {.flush_timeout = timeout, .max_message_bytes = chunk});
      fasta2a::testing::probe pr = fasta2a::testing::delaying_probe(max_delay(), static_cast<std::uint64_t>(me) * 7919u + DelayUs);
      fasta2a::testing::probed_transport<fasta2a::mpi_transport> tr(base, pr);
      f(me, boot, tr, pr);
    } catch (const std::exception& e) {
      mine = e.what();
      if (mine.empty()) mine = "(empty error)";
    }
    // Every rank's outcome, on every rank (this also orders one case after the next).
    constexpr std::size_t width = 1024;
    std::vector<char> out(width, 0), all(width * static_cast<std::size_t>(size), 0);
    std::memcpy(out.data(), mine.data(), std::min(mine.size(), width - 1));
    MPI_Allgather(out.data(), static_cast<int>(width), MPI_CHAR, all.data(), static_cast<int>(width), MPI_CHAR, MPI_COMM_WORLD);
    std::vector<std::string> errors;
    for (fasta2a::rank_t r = 0; r < size; ++r) errors.emplace_back(all.data() + width * static_cast<std::size_t>(r));
    return errors;
  }
};

} // namespace

// The probe wrapper keeps the MPI connection's trait, so that the suite runs the engine's path for
// it (shared staging frees arrival slots by posting receives, not by credits).
static_assert(fasta2a::testing::probed_transport<fasta2a::mpi_transport>::connection::expects_gate_puts);
// What the MPI transport offers of the contract's optional capabilities (transport.hpp).
static_assert(fasta2a::ExpectsGatePuts<fasta2a::mpi_transport::connection> &&
              fasta2a::DrivesProgress<fasta2a::mpi_transport::connection> &&
              fasta2a::Abandonable<fasta2a::mpi_transport::connection> &&
              fasta2a::RevokesLateWrites<fasta2a::mpi_transport> && fasta2a::SurvivesRevokedWrites<fasta2a::mpi_transport> &&
              !fasta2a::RegistersDevice<fasta2a::mpi_transport>);

TEST_CASE_TEMPLATE_INVOKE(fasta2a_conformance, mpi_world<0>, mpi_world<100>);

int main(int argc, char** argv) { return run_doctest_under_mpi(argc, argv, "test_conformance_mpi"); }
