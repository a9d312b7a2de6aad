// Tests that read a trace from FASTA2A_WORKLOADS_DIR (../shared/workloads, there in CI and in
// every checkout beside ../shared): a missing file FAILS the test case, naming the path, so that a
// wrong FASTA2A_WORKLOADS_DIR cannot turn these tests into ones that pass by checking nothing. Where
// the traces are knowingly absent, FASTA2A_SKIP_MISSING_WORKLOADS=1 in the environment skips them
// instead, each with a message. Include after <doctest/doctest.h>.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <string>

namespace fasta2a::testing {

/// True if `path` exists; otherwise fails the current test case (or, with
/// FASTA2A_SKIP_MISSING_WORKLOADS=1, reports a skip) and returns false.
inline bool have_workload(const std::string& path) {
  if (std::filesystem::exists(path)) return true;
  const char* skip = std::getenv("FASTA2A_SKIP_MISSING_WORKLOADS");
  if (skip != nullptr && std::string(skip) == "1") {
    MESSAGE("skipped (FASTA2A_SKIP_MISSING_WORKLOADS=1): " << path << " not found");
    return false;
  }
  FAIL_CHECK(path << " not found: the trace tests need FASTA2A_WORKLOADS_DIR (../shared/workloads); "
                     "set FASTA2A_SKIP_MISSING_WORKLOADS=1 to skip them knowingly");
  return false;
}

/// The Megatron-LM trace (600 matrices of 32 x 32 ranks, in tokens of 8 KiB).
inline const std::string megatron = std::string(FASTA2A_WORKLOADS_DIR) + "/megatron-4n-32gpu.txt";

/// have_workload(megatron).
inline bool have_megatron() { return have_workload(megatron); }

} // namespace fasta2a::testing
