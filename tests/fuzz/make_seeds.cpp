// Writes the fuzz targets' seed corpora (tests/fuzz/corpus/<target>/): small inputs derived from
// real plans (the library's writer, as `fasta2a plan --json` writes them) and from slices of the
// Megatron trace (../shared/workloads/megatron-4n-32gpu.txt: the top-left n x n block of its first
// matrices). Run once by hand when a target's input format changes; the corpora are committed.
//   build-fuzz/make_seeds ../shared/workloads/megatron-4n-32gpu.txt tests/fuzz/corpus
#include <fasta2a/fasta2a.hpp>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

namespace fa = fasta2a;

namespace {

std::vector<fa::bytes_t> megatron; // the first matrices of the trace, 32 x 32 each

// Top-left n x n block of Megatron matrix k, entries divided by `shrink` (small files).
fa::traffic_matrix slice(int n, int k, fa::bytes_t shrink) {
  fa::traffic_matrix t(n, n);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j) t(i, j) = megatron.at(static_cast<std::size_t>(k) * 1024 + i * 32 + j) / shrink;
  return t;
}

void put(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  if (!(out << bytes)) {
    std::cerr << "make_seeds: cannot write " << path << " (does its folder exist?)\n";
    std::exit(1);
  }
}

std::string text_of(const fa::traffic_matrix& t) {
  std::string s;
  for (Eigen::Index i = 0; i < t.rows(); ++i)
    for (Eigen::Index j = 0; j < t.cols(); ++j) s += std::to_string(t(i, j)) + "\n";
  return s;
}

} // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: make_seeds MEGATRON_TRACE CORPUS_DIR\n";
    return 2;
  }
  {
    std::ifstream in(argv[1]);
    fa::bytes_t v;
    while (megatron.size() < 4 * 1024 && in >> v) megatron.push_back(v);
    if (megatron.size() < 4 * 1024) {
      std::cerr << "make_seeds: cannot read 4 matrices from " << argv[1] << "\n";
      return 1;
    }
  }
  const std::string dir = argv[2];
  int count = 0;

  // Plan reader: plans of Megatron slices and of tiny hand-made matrices, every decomposer kind.
  struct shape { int S, G; };
  const shape shapes[] = {{1, 1}, {1, 2}, {2, 1}, {2, 2}, {2, 3}, {3, 2}, {3, 1}, {4, 2}, {2, 4}};
  int k = 0;
  for (const shape sh : shapes) {
    const fa::two_tier_topology topo(sh.S, sh.G);
    const fa::traffic_matrix t = slice(sh.S * sh.G, k % 4, 64);
    const auto name = [&](const char* d) {
      return dir + "/plan_reader/" + d + "-" + std::to_string(sh.S) + "x" + std::to_string(sh.G) + ".json";
    };
    put(name("birkhoff"), fa::plan_to_json(fa::make_plan(topo, t)));
    if (k % 3 == 0) put(name("spread-out"), fa::plan_to_json(fa::make_plan<fa::spread_out_decomposer>(topo, t)));
    if (k % 3 == 1) put(name("direct"), fa::plan_to_json(fa::make_plan<fa::direct_decomposer>(topo, t)));
    if (k % 3 == 2) put(name("quantized"), fa::plan_to_json(fa::make_plan<fa::quantized_decomposer>(topo, t)));
    count += 2;
    if (sh.S > 1 && sh.G > 1) { // per-rail stages: each stage's "rails"
      put(name("per-rail"), fa::plan_to_json(fa::make_plan(topo, t, {.rails = fa::rail_schedule::per_rail})));
      ++count;
    }
    ++k;
  }
  put(dir + "/plan_reader/empty-2x2.json", fa::plan_to_json(fa::make_plan(fa::two_tier_topology(2, 2),
                                                                          fa::traffic_matrix::Zero(4, 4))));
  ++count;

  // Trace reader: bytes 0..2 are n - 1, the unit pick and the index; then the file.
  const auto trace = [&](const std::string& name, int n, unsigned char unit, unsigned char index,
                         const std::string& text) {
    put(dir + "/trace_reader/" + name, std::string{static_cast<char>(n - 1), static_cast<char>(unit),
                                                   static_cast<char>(index)} + text);
    ++count;
  };
  for (int n : {1, 2, 3, 4, 6, 8}) {
    std::string text;
    for (int m = 0; m < (n <= 3 ? 3 : 1); ++m) text += text_of(slice(n, m, 1));
    trace("megatron-" + std::to_string(n) + ".txt", n, n % 2 ? 0 : 130, 1, text);
  }
  trace("row-per-line.txt", 2, 0, 0, "1 2\n3 4\n5 6\r\n7 8\n");
  trace("tabs-and-blanks.txt", 3, 200, 2, "\t1\v2\f3 \n\n4 5 6 7 8 9   \n");
  trace("largest-entry.txt", 1, 0, 0, "18446744073709551615\n");
  trace("entry-past-64-bits.txt", 1, 0, 0, "18446744073709551616\n");
  trace("row-sum-overflow.txt", 2, 0, 0, "18446744073709551615 1 0 0\n");
  trace("unit-overflow.txt", 2, 255, 0, "3 0 0 3\n");
  trace("unit-zero.txt", 2, 224, 0, "3 0 0 3\n");
  trace("truncated.txt", 2, 0, 0, "1 2 3\n");
  trace("not-a-number.txt", 2, 0, 0, "1 2 3 -4\n");
  trace("empty.txt", 2, 0, 0, "");
  trace("index-past-end.txt", 2, 0, 7, "0 0 0 0\n");

  // Planner: S - 1, G - 1, decomposer/options byte, granule byte (240.. then 8 bytes), then one
  // mode byte per entry (0xE0: the next two bytes are a 16-bit count; 0x40 | v: v < 32).
  const auto planner_seed = [&](const std::string& name, int S, int G, unsigned char how, std::string granule,
                                const fa::traffic_matrix& t) {
    std::string s{static_cast<char>(S - 1), static_cast<char>(G - 1), static_cast<char>(how)};
    s += granule;
    for (Eigen::Index i = 0; i < t.rows(); ++i)
      for (Eigen::Index j = 0; j < t.cols(); ++j) {
        const fa::bytes_t v = t(i, j);
        if (v < 32) s += static_cast<char>(0x40 | v);
        else {
          s += static_cast<char>(0xE0);
          s += static_cast<char>(v & 0xff);
          s += static_cast<char>((v >> 8) & 0xff);
        }
      }
    put(dir + "/planner/" + name, s);
    ++count;
  };
  const std::string g1(1, '\0'), g8(1, static_cast<char>(176 + 3)), g17(1, static_cast<char>(112 + 16));
  const auto g64 = [](fa::bytes_t v) {
    std::string s(1, static_cast<char>(240));
    for (int b = 0; b < 8; ++b) s += static_cast<char>((v >> (8 * b)) & 0xff);
    return s;
  };
  // how: low bits pick the decomposer (decomposer_names() order), 0x80 the direct fallback.
  planner_seed("megatron-4x8-birkhoff", 4, 8, 0, g1, slice(32, 0, 1));
  planner_seed("megatron-4x8-h200-best", 4, 8, 0x40 | 5, g8, slice(32, 1, 1));
  planner_seed("megatron-2x8-quantized", 2, 8, 2, g1, slice(16, 2, 1));
  planner_seed("megatron-8x2-bottleneck", 8, 2, 1, g17, slice(16, 3, 1));
  planner_seed("megatron-3x3-spread-out", 3, 3, 3, g1, slice(9, 0, 1));
  planner_seed("megatron-2x4-direct", 2, 4, 4, g1, slice(8, 1, 1));
  planner_seed("megatron-4x2-adaptive", 4, 2, 0x80, g1, slice(8, 2, 1));
  planner_seed("megatron-8x8-birkhoff", 8, 8, 0, g8, slice(32, 0, 1).replicate(2, 2));
  planner_seed("ones-2x2-huge-granule", 2, 2, 0, g64(fa::bytes_t{1} << 63), fa::traffic_matrix::Ones(4, 4));
  planner_seed("ones-4x2-huge-granule", 4, 2, 0, g64(fa::bytes_t{1} << 62), fa::traffic_matrix::Ones(8, 8));
  planner_seed("zero-granule", 2, 2, 0, g64(0), fa::traffic_matrix::Ones(4, 4));
  planner_seed("one-rank", 1, 1, 0, g1, fa::traffic_matrix::Constant(1, 1, 7));
  planner_seed("empty-3x2", 3, 2, 2, g1, fa::traffic_matrix::Zero(6, 6));
  planner_seed("uniform-2x3-granule-8", 2, 3, 0, g8, fa::traffic_matrix::Constant(6, 6, 13));
  std::cout << "make_seeds: wrote " << count << " files under " << dir << "\n";
  return 0;
}
