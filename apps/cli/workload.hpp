// fasta2a CLI: the traffic the options ask for (a recorded trace or a generator) and its
// description for captions.
#pragma once

#include "options.hpp"

#include <fasta2a/traffic.hpp>

#include <cstddef>
#include <string>
#include <vector>

namespace cli {

/// The traffic the options ask for: one generated matrix, one matrix of a trace, or all of them.
struct workload {
  std::vector<fa::traffic_matrix> matrices;
  std::size_t first_index = 0; // trace index of matrices[0]
};

/// Reads or generates the matrices of `o` for `n` ranks; every rank that calls it gets the same.
/// Throws fasta2a::error for a trace that cannot be read or does not fit n ranks, and for generator
/// options that give no traffic (every count 0) although --bytes-per-rank asked for some.
workload load_workload(const options& o, rank_t n);

/// One line saying what the input is ("zipf(1.2), 1048576 B per rank, seed 7"), for headers and
/// captions.
std::string input_description(const options& o);

} // namespace cli
