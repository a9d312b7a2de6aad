// Plans a skewed all-to-allv with the packaged headers and checks the plan.
#include <fasta2a/fasta2a.hpp>

#include <cstdio>

int main() {
  const auto topo = fasta2a::h200_cluster(4);
  const auto traffic = fasta2a::zipf_traffic(topo.ranks(), 1.0, 1 << 20, 42);
  const fasta2a::plan p = fasta2a::make_plan(topo, traffic);
  const auto check = fasta2a::verify(p, traffic, {.exact_lower_bound = true});
  std::printf("consumer: %zu stages, %zu pieces, verify: %s\n", p.stages(), p.pieces.size(),
              check.ok ? "ok" : check.error.c_str());
  return check.ok ? 0 : 1;
}
