// The README's C++ quick start: plan one Megatron matrix, check it, walk rank 3's work.
// Usage: quickstart [trace-file]
#include <fasta2a/fasta2a.hpp>
#include <cstdio>
#include <string>

int main(int argc, char** argv) try {
  const std::string path = argc > 1 ? argv[1] : "megatron-4n-32gpu.txt";
  auto topo = fasta2a::h200_cluster(4);                     // 4 servers x 8 H200 (NVSwitch, 400G NICs)
  auto traffic = fasta2a::read_matrix(path, topo.ranks(), /*index=*/0, /*unit=*/8192);

  fasta2a::planner<fasta2a::fixed_topology<8>> planner(topo, {.granule = 8192}); // reuse across calls
  fasta2a::plan plan;
  planner.make_into(traffic, plan);                          // microseconds; no allocation once warm
  if (auto check = fasta2a::verify(plan, traffic); !check) std::puts(check.error.c_str());

  const fasta2a::rank_t me = 3;
  for (std::size_t t = 0; t < plan.op_stages(); ++t)         // what rank 3 does, stage by stage
    for (const fasta2a::rank_op& op : plan.ops(me, t)) {
      const fasta2a::piece& pc = plan.pieces[op.piece];    // bytes [offset, offset+bytes) of src->dst
      if (op.kind == fasta2a::op_kind::rail_send)
        std::printf("stage %zu: rail %d sends %llu B of %d->%d to rank %d\n", t, pc.rail,
                    (unsigned long long)pc.bytes, pc.src, pc.dst, plan.rail_target(pc));
    }
  auto model = fasta2a::predict(topo, plan, {.alpha = 10e-6});   // alpha-beta model, not a measurement
  std::printf("%zu stages, model %.3f ms, lower bound %.3f ms\n", plan.stages(), model.total_s * 1e3,
              fasta2a::lower_bound(topo, traffic).overall_s() * 1e3);
} catch (const fasta2a::error& e) {
  std::fprintf(stderr, "quickstart: %s\n", e.what());
  return 2;
}
