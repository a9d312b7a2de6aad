// The GPU transport and memory space on the real CUDA runtime (a plain C++ translation unit linked
// to cudart only; driver functions come through cudaGetDriverEntryPointByVersion). Without a device
// or driver it says so and exits 77 (ctest: skipped). With one: one rank puts into its own device
// memory through a gpu_ipc_transport connection, signals with a stream write of a value, waits by
// polling the flag, and checks the bytes; then a stream wait on the flag and an event.
#include <cstdio>
#include <string>
#include <vector>

#include <fasta2a/gpu_ipc.hpp>
#include <fasta2a/gpu_memory.hpp>
#include <fasta2a/host.hpp>

// Declared in gpu_cuda_smoke.cu (compiled by nvcc for sm_90 and sm_100): the same headers there.
int fasta2a_gpu_cu_unit();

int main() {
  std::string why;
  const int devices = fasta2a::gpu::device_count(&why);
  if (devices == 0) {
    std::printf("SKIP: no device (%s)\n", why.c_str());
    return 77;
  }
  try {
    using ipc = fasta2a::gpu_ipc_transport<fasta2a::host_bootstrap>;
    fasta2a::host_fabric fabric(1);
    fasta2a::host_bootstrap boot(fabric, 0);
    fasta2a::gpu_memory mem;
    ipc t(boot, mem.shared_stream());
    const std::size_t n = 1 << 20;
    auto src = mem.allocate(n), dst = mem.allocate(n);
    std::vector<std::byte> h(n), back(n);
    for (std::size_t i = 0; i < n; ++i) h[i] = static_cast<std::byte>(i * 131 + 7);
    fasta2a::gpu::memcpy_async(src.data(), h.data(), n, mem.stream());
    mem.synchronize();
    auto sm = t.register_memory(src.data(), n);
    auto dm = t.register_memory(dst.data() + 64, n - 64); // an offset inside the allocation
    const auto blob = t.serialize(dm);
    auto rem = t.deserialize(0, blob);
    auto conn = t.connect(2);
    conn.put(0, sm, 0, rem, 0, n - 64, 1);
    conn.signal(0, 1);
    if (!conn.wait(0, 1, 1, std::chrono::milliseconds(5000))) throw fasta2a::error("no signal within 5 s");
    while (!conn.sent(0, 1, 1)) {
    }
    conn.flush();
    fasta2a::gpu::memcpy_async(back.data(), dst.data() + 64, n - 64, mem.stream());
    mem.synchronize();
    for (std::size_t i = 0; i + 64 < n; ++i)
      if (back[i] != h[i]) throw fasta2a::error("byte " + std::to_string(i) + " is wrong");
    t.forget(rem);
    if (fasta2a_gpu_cu_unit() != 0) throw fasta2a::error("the nvcc-compiled unit failed");
    std::printf("OK: %d device(s); put, stream-write signal, host wait, sent and flush on CUDA\n", devices);
    return 0;
  } catch (const std::exception& e) {
    std::printf("FAIL: %s\n", e.what());
    return 1;
  }
}
