// fasta2a CLI: loading and describing the input traffic.
#include "workload.hpp"

#include "report.hpp" // strf

namespace cli {

workload load_workload(const options& o, rank_t n) {
  workload w;
  switch (o.input) {
  case input_kind::matrix:
    if (o.all) w.matrices = fa::read_trace(o.matrix_path, n, o.unit);
    else {
      w.matrices.push_back(fa::read_matrix(o.matrix_path, n, o.index, o.unit));
      w.first_index = o.index;
    }
    break;
  case input_kind::uniform:
    w.matrices.push_back(fa::uniform_traffic(n, o.bytes_per_rank, o.seed, o.granule));
    break;
  case input_kind::zipf:
    w.matrices.push_back(fa::zipf_traffic(n, o.zipf_s, o.bytes_per_rank, o.seed, o.granule));
    break;
  case input_kind::hotspot:
    w.matrices.push_back(fa::hotspot_traffic(n, o.hot, o.hot_share, o.bytes_per_rank, o.seed, o.granule));
    break;
  case input_kind::lognormal:
    w.matrices.push_back(fa::lognormal_traffic(n, o.sigma, o.bytes_per_rank, o.seed, o.granule));
    break;
  case input_kind::none: throw fa::error("no input");
  }
  return w;
}

std::string input_description(const options& o) {
  switch (o.input) {
  case input_kind::matrix:
    return "trace '" + o.matrix_path + "'" +
           (o.all ? std::string(", all matrices") : ", matrix " + std::to_string(o.index)) + ", unit " +
           std::to_string(o.unit) + " B";
  case input_kind::uniform: return "uniform, " + std::to_string(o.bytes_per_rank) + " B per rank";
  case input_kind::zipf:
    return strf("zipf(%g), %llu B per rank, seed %llu", o.zipf_s,
                static_cast<unsigned long long>(o.bytes_per_rank), static_cast<unsigned long long>(o.seed));
  case input_kind::hotspot:
    return strf("hotspot(%d hot, share %g), %llu B per rank, seed %llu", o.hot, o.hot_share,
                static_cast<unsigned long long>(o.bytes_per_rank), static_cast<unsigned long long>(o.seed));
  case input_kind::lognormal:
    return strf("lognormal(sigma %g), %llu B per rank, seed %llu", o.sigma,
                static_cast<unsigned long long>(o.bytes_per_rank), static_cast<unsigned long long>(o.seed));
  case input_kind::none: break;
  }
  return "none";
}

} // namespace cli
