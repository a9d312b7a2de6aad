// A plain C++ program (g++, no nvcc) that includes the GPU transport, memory space and engine
// headers and links the CUDA runtime only (never libcuda): on a machine without a GPU or driver it
// starts, says "no device" and exits 77; with one, it moves bytes through a device buffer and
// exits 0. The ctest gpu_cuda.nodevice accepts exactly these two outcomes.
#include <cstdio>
#include <string>
#include <vector>

#include <fasta2a/engine.hpp>
#include <fasta2a/gpu_ipc.hpp>
#include <fasta2a/gpu_memory.hpp>

int main() {
  std::string why;
  const int devices = fasta2a::gpu::device_count(&why);
  if (devices == 0) {
    std::printf("fasta2a: no device: %s\n", why.c_str());
    return 77;
  }
  try {
    fasta2a::gpu_memory mem;
    auto d = mem.allocate(4096);
    std::vector<std::byte> h(4096), back(4096);
    for (std::size_t i = 0; i < h.size(); ++i) h[i] = static_cast<std::byte>(i * 7 + 1);
    mem.copy(d.data(), h.data(), h.size());
    mem.copy(back.data(), d.data(), back.size());
    mem.synchronize();
    if (back != h) throw fasta2a::error("the bytes came back wrong");
    std::printf("fasta2a: %d device(s), a device buffer round trip is correct\n", devices);
    return 0;
  } catch (const std::exception& e) {
    std::printf("fasta2a: error: %s\n", e.what());
    return 1;
  }
}
