// The main of an MPI doctest program: MPI around doctest, every rank runs every case, rank 0
// reports in full and the others only their failures; the exit status is the worst of all ranks.
#pragma once

#include <doctest/doctest.h>
#include <mpi.h>

#include <cstdio>

inline int run_doctest_under_mpi(int argc, char** argv, const char* program) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  doctest::Context ctx(argc, argv);
  if (rank != 0) {
    ctx.setOption("minimal", true);
    ctx.setOption("no-colors", true);
  }
  int result = ctx.run();
  if (ctx.shouldExit()) {
    MPI_Finalize();
    return result;
  }
  int worst = 0;
  MPI_Allreduce(&result, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0 && worst != 0 && result == 0) std::fprintf(stderr, "%s: another rank failed\n", program);
  MPI_Finalize();
  return worst;
}
