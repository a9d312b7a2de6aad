// The GPU headers compiled by nvcc (device code for sm_90 and sm_100 in the same unit): a stream
// wait on a flag that a stream write sets, ordered before a kernel that reads the flag.
#include <fasta2a/gpu_ipc.hpp>
#include <fasta2a/gpu_memory.hpp>

__global__ void fasta2a_read_flag(const unsigned long long* flag, unsigned long long* out) { *out = *flag; }

int fasta2a_gpu_cu_unit() {
  try {
    fasta2a::gpu_memory mem;
    auto b = mem.allocate(2 * sizeof(unsigned long long));
    auto* flag = reinterpret_cast<std::uint64_t*>(b.data());
    fasta2a::gpu::write_value64(mem.stream(), flag, 0);
    fasta2a::gpu::stream other;
    fasta2a::gpu::write_value64(other.get(), flag, 5);
    fasta2a::gpu::wait_value64(mem.stream(), flag, 5);
    fasta2a_read_flag<<<1, 1, 0, mem.stream()>>>(reinterpret_cast<const unsigned long long*>(flag),
                                                 reinterpret_cast<unsigned long long*>(flag + 1));
    std::uint64_t out = 0;
    fasta2a::gpu::memcpy_async(&out, flag + 1, sizeof out, mem.stream());
    mem.synchronize();
    return out == 5 ? 0 : 1;
  } catch (...) {
    return 2;
  }
}
