// An all-to-allv among the processes of MPI_COMM_WORLD (servers of 2 ranks) through fasta2a::mpi;
// every received byte is checked against its sender's pattern and against MPI_Alltoallv's.
#include <fasta2a/engine.hpp>
#include <fasta2a/mpi.hpp>
#include <fasta2a/pattern.hpp>
#include <fasta2a/traffic.hpp>

#include <cstdio>
#include <exception>
#include <vector>

namespace fa = fasta2a;

// This rank's part: build its engine, run the call, count the bytes that came out wrong.
std::uint64_t run_rank() {
  fa::mpi_bootstrap boot(MPI_COMM_WORLD);
  fa::mpi_transport link(MPI_COMM_WORLD);
  fa::engine<fa::two_tier_topology, fa::mpi_bootstrap, fa::mpi_transport, fa::mpi_transport> eng(
      fa::mpi_world_topology(2), boot, link /*scale-up*/, link /*scale-out*/);
  const fa::traffic_matrix t = fa::zipf_traffic(boot.size(), 1.0, 256 << 10, 7); // same on every rank
  const fa::packed_layout l(t, boot.rank());
  std::vector<std::byte> send(l.send_bytes), recv(l.recv_bytes), ref(l.recv_bytes);
  l.fill(send, boot.rank());
  eng.alltoallv(send, l.send_counts, l.send_displs, recv, l.recv_counts, l.recv_displs);

  const std::vector<int> sc(l.send_counts.begin(), l.send_counts.end()), sd(l.send_displs.begin(), l.send_displs.end()),
      rc(l.recv_counts.begin(), l.recv_counts.end()), rd(l.recv_displs.begin(), l.recv_displs.end());
  MPI_Alltoallv(send.data(), sc.data(), sd.data(), MPI_BYTE, ref.data(), rc.data(), rd.data(), MPI_BYTE, MPI_COMM_WORLD);
  std::uint64_t wrong = l.mismatches(recv, boot.rank());
  for (std::size_t k = 0; k < recv.size(); ++k) wrong += recv[k] != ref[k];
  return wrong;
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  std::uint64_t wrong = 0, all = 0;
  try {
    wrong = run_rank();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consumer_mpi: %s\n", e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  MPI_Allreduce(&wrong, &all, 1, MPI_UINT64_T, MPI_SUM, MPI_COMM_WORLD);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (rank == 0) std::printf("consumer_mpi: %d ranks, %llu bytes wrong\n", size, static_cast<unsigned long long>(all));
  MPI_Finalize();
  return all == 0 ? 0 : 1;
}
