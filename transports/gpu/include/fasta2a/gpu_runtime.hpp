// fasta2a: the few GPU runtime calls the GPU transport and memory space make, under one set of
// names, mapped to CUDA (the default), HIP (__HIP_PLATFORM_AMD__) or the tests' stand-in runtime
// (FASTA2A_GPU_STANDIN, tests/gpu_standin/: streams as threads, device memory in POSIX shared
// memory). Every call throws fasta2a::error naming the call and the runtime's reason.
//
// CUDA: only the runtime (cudart) is linked; the driver functions (stream write / wait of a value,
// the address range of an allocation) are fetched at run time with
// cudaGetDriverEntryPointByVersion, so that a binary starts on a machine without a driver and can
// say so (device_count reports it) instead of failing to load libcuda.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "fasta2a/common.hpp"
#include "fasta2a/transport.hpp"

#if defined(FASTA2A_GPU_STANDIN)
#include "fasta2a/gpu_standin.hpp"
#elif defined(__HIP_PLATFORM_AMD__)
#include <hip/hip_runtime_api.h>
#else
#include <cuda.h> // types and enums only: no libcuda function is called by name
#include <cuda_runtime_api.h>
#include <mutex>
#endif

namespace fasta2a::gpu {

#if defined(FASTA2A_GPU_STANDIN)
namespace rt = fasta2a::gpu_standin;
using status_t = rt::status;
using stream_t = rt::stream_t;
using event_t = rt::event_t;
using ipc_handle_t = rt::ipc_mem_handle;
inline constexpr const char* runtime_name = "GPU stand-in";
/// The stand-in plays a CUDA device.
inline constexpr memory_kind device_kind = memory_kind::cuda_device;
/// Whether an IPC handle can ever be made for host memory (only the stand-in, in one process,
/// when asked to: see gpu_standin::config::host_pointers_in_process).
inline constexpr bool host_memory_ipc = true;
inline constexpr status_t success = rt::status::success;
inline const char* error_string(status_t s) noexcept { return rt::error_string(s); }
#elif defined(__HIP_PLATFORM_AMD__)
using status_t = hipError_t;
using stream_t = hipStream_t;
using event_t = hipEvent_t;
using ipc_handle_t = hipIpcMemHandle_t;
inline constexpr const char* runtime_name = "HIP";
inline constexpr memory_kind device_kind = memory_kind::hip_device;
inline constexpr bool host_memory_ipc = false;
inline constexpr status_t success = hipSuccess;
inline const char* error_string(status_t s) noexcept { return hipGetErrorString(s); }
#else
using status_t = cudaError_t;
using stream_t = cudaStream_t;
using event_t = cudaEvent_t;
using ipc_handle_t = cudaIpcMemHandle_t;
inline constexpr const char* runtime_name = "CUDA";
inline constexpr memory_kind device_kind = memory_kind::cuda_device;
inline constexpr bool host_memory_ipc = false;
inline constexpr status_t success = cudaSuccess;
inline const char* error_string(status_t s) noexcept { return cudaGetErrorString(s); }
#endif

/// Throws fasta2a::error naming the call unless s is success.
inline void check(status_t s, const char* call) {
  if (s != success) throw error(std::string(runtime_name) + ": " + call + " failed: " + gpu::error_string(s));
}

#if !defined(FASTA2A_GPU_STANDIN) && !defined(__HIP_PLATFORM_AMD__)
namespace detail {
// Driver functions, fetched once through the runtime (never by linking libcuda).
using write_value64_fn = CUresult(CUDAAPI*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
using wait_value64_fn = CUresult(CUDAAPI*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
using address_range_fn = CUresult(CUDAAPI*)(CUdeviceptr*, std::size_t*, CUdeviceptr);
struct driver {
  write_value64_fn write_value64 = nullptr;
  wait_value64_fn wait_value64 = nullptr;
  address_range_fn address_range = nullptr;
};
inline void* driver_symbol(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q{};
  check(cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &q), name);
  if (!fn || q != cudaDriverEntryPointSuccess)
    throw error(std::string("CUDA: the driver has no ") + name + " (CUDA 12.0 ABI)");
  return fn;
}
inline const driver& drv() {
  static driver d;
  static std::once_flag once;
  std::call_once(once, [] {
    d.write_value64 = reinterpret_cast<write_value64_fn>(driver_symbol("cuStreamWriteValue64"));
    d.wait_value64 = reinterpret_cast<wait_value64_fn>(driver_symbol("cuStreamWaitValue64"));
    d.address_range = reinterpret_cast<address_range_fn>(driver_symbol("cuMemGetAddressRange"));
  });
  return d;
}
inline void check_cu(CUresult r, const char* call) {
  if (r != CUDA_SUCCESS) throw error(std::string("CUDA: ") + call + " failed with CUresult " + std::to_string(static_cast<int>(r)));
}
} // namespace detail
#endif

/// The number of devices, or 0 with `why` set when there is no device or no driver (never throws).
inline int device_count(std::string* why = nullptr) noexcept {
  int n = 0;
#if defined(FASTA2A_GPU_STANDIN)
  const status_t s = rt::get_device_count(&n);
#elif defined(__HIP_PLATFORM_AMD__)
  const status_t s = hipGetDeviceCount(&n);
#else
  const status_t s = cudaGetDeviceCount(&n);
#endif
  if (s != success) {
    if (why) *why = std::string(runtime_name) + ": no device or driver: " + gpu::error_string(s);
    return 0;
  }
  if (n == 0 && why) *why = std::string(runtime_name) + ": no device";
  return n;
}

inline void* malloc_device(std::size_t n) {
  void* p = nullptr;
#if defined(FASTA2A_GPU_STANDIN)
  check(rt::malloc_device(&p, n), "device allocation");
#elif defined(__HIP_PLATFORM_AMD__)
  check(hipMalloc(&p, n), "hipMalloc");
#else
  check(cudaMalloc(&p, n), "cudaMalloc");
#endif
  return p;
}
inline void free_device(void* p) noexcept {
#if defined(FASTA2A_GPU_STANDIN)
  (void)rt::free_device(p);
#elif defined(__HIP_PLATFORM_AMD__)
  (void)hipFree(p);
#else
  (void)cudaFree(p);
#endif
}

/// n bytes of pinned (page-locked) host memory, for bounce buffers: cudaHostAlloc / hipHostMalloc
/// (the stand-in: plain host memory).
inline void* malloc_host(std::size_t n) {
  void* p = nullptr;
#if defined(FASTA2A_GPU_STANDIN)
  check(rt::malloc_host(&p, n), "host allocation");
#elif defined(__HIP_PLATFORM_AMD__)
  check(hipHostMalloc(&p, n, hipHostMallocDefault), "hipHostMalloc");
#else
  check(cudaHostAlloc(&p, n, cudaHostAllocDefault), "cudaHostAlloc");
#endif
  return p;
}
inline void free_host(void* p) noexcept {
#if defined(FASTA2A_GPU_STANDIN)
  (void)rt::free_host(p);
#elif defined(__HIP_PLATFORM_AMD__)
  (void)hipHostFree(p);
#else
  (void)cudaFreeHost(p);
#endif
}

/// Copies n bytes (device or host, either way) in stream order.
inline void memcpy_async(void* dst, const void* src, std::size_t n, stream_t s) {
#if defined(FASTA2A_GPU_STANDIN)
  check(rt::memcpy_async(dst, src, n, s), "memcpy_async");
#elif defined(__HIP_PLATFORM_AMD__)
  check(hipMemcpyAsync(dst, src, n, hipMemcpyDefault, s), "hipMemcpyAsync");
#else
  check(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, s), "cudaMemcpyAsync");
#endif
}

/// A stream that does not synchronise with the legacy default stream.
inline stream_t stream_create() {
  stream_t s{};
#if defined(FASTA2A_GPU_STANDIN)
  check(rt::stream_create(&s), "stream_create");
#elif defined(__HIP_PLATFORM_AMD__)
  check(hipStreamCreateWithFlags(&s, hipStreamNonBlocking), "hipStreamCreateWithFlags");
#else
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
#endif
  return s;
}
inline void stream_destroy(stream_t s) noexcept {
#if defined(FASTA2A_GPU_STANDIN)
  (void)rt::stream_destroy(s);
#elif defined(__HIP_PLATFORM_AMD__)
  (void)hipStreamDestroy(s);
#else
  (void)cudaStreamDestroy(s);
#endif
}
inline void stream_synchronize(stream_t s) {
#if defined(FASTA2A_GPU_STANDIN)
  check(rt::stream_synchronize(s), "stream_synchronize");
#elif defined(__HIP_PLATFORM_AMD__)
  check(hipStreamSynchronize(s), "hipStreamSynchronize");
#else
  check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
#endif
}

/// An event without timing (cheap to record and query).
inline event_t event_create() {
  event_t e{};
#if defined(FASTA2A_GPU_STANDIN)
  check(rt::event_create(&e), "event_create");
#elif defined(__HIP_PLATFORM_AMD__)
  check(hipEventCreateWithFlags(&e, hipEventDisableTiming), "hipEventCreateWithFlags");
#else
  check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
#endif
  return e;
}
inline void event_destroy(event_t e) noexcept {
#if defined(FASTA2A_GPU_STANDIN)
  (void)rt::event_destroy(e);
#elif defined(__HIP_PLATFORM_AMD__)
  (void)hipEventDestroy(e);
#else
  (void)cudaEventDestroy(e);
#endif
}
inline void event_record(event_t e, stream_t s) {
#if defined(FASTA2A_GPU_STANDIN)
  check(rt::event_record(e, s), "event_record");
#elif defined(__HIP_PLATFORM_AMD__)
  check(hipEventRecord(e, s), "hipEventRecord");
#else
  check(cudaEventRecord(e, s), "cudaEventRecord");
#endif
}
/// True once everything before the event's record has completed; never blocks.
inline bool event_done(event_t e) {
#if defined(FASTA2A_GPU_STANDIN)
  const status_t r = rt::event_query(e);
  if (r == rt::status::not_ready) return false;
  check(r, "event_query");
#elif defined(__HIP_PLATFORM_AMD__)
  const status_t r = hipEventQuery(e);
  if (r == hipErrorNotReady) return false;
  check(r, "hipEventQuery");
#else
  const status_t r = cudaEventQuery(e);
  if (r == cudaErrorNotReady) return false;
  check(r, "cudaEventQuery");
#endif
  return true;
}
/// Work enqueued on s after this waits for the event's work.
inline void stream_wait_event(stream_t s, event_t e) {
#if defined(FASTA2A_GPU_STANDIN)
  check(rt::stream_wait_event(s, e), "stream_wait_event");
#elif defined(__HIP_PLATFORM_AMD__)
  check(hipStreamWaitEvent(s, e, 0), "hipStreamWaitEvent");
#else
  check(cudaStreamWaitEvent(s, e, 0), "cudaStreamWaitEvent");
#endif
}

/// The device allocation containing p: its base and size. Returns false (never throws) when p is
/// not inside one of this process's device allocations.
inline bool address_range(const void* p, void** base, std::size_t* size) {
#if defined(FASTA2A_GPU_STANDIN)
  return rt::get_address_range(p, base, size) == rt::status::success;
#elif defined(__HIP_PLATFORM_AMD__)
  hipDeviceptr_t b{};
  if (hipMemGetAddressRange(&b, size, const_cast<void*>(p)) != hipSuccess) return false;
  *base = reinterpret_cast<void*>(b);
  return true;
#else
  CUdeviceptr b{};
  if (detail::drv().address_range(&b, size, reinterpret_cast<CUdeviceptr>(p)) != CUDA_SUCCESS) return false;
  *base = reinterpret_cast<void*>(b);
  return true;
#endif
}

/// The IPC handle of the allocation whose base is `base`.
inline ipc_handle_t ipc_get_handle(void* base) {
  ipc_handle_t h{};
#if defined(FASTA2A_GPU_STANDIN)
  check(rt::ipc_get_mem_handle(&h, base), "ipc_get_mem_handle");
#elif defined(__HIP_PLATFORM_AMD__)
  check(hipIpcGetMemHandle(&h, base), "hipIpcGetMemHandle");
#else
  check(cudaIpcGetMemHandle(&h, base), "cudaIpcGetMemHandle");
#endif
  return h;
}
/// Maps a peer's allocation into this process; returns its base here.
inline void* ipc_open(const ipc_handle_t& h) {
  void* p = nullptr;
#if defined(FASTA2A_GPU_STANDIN)
  check(rt::ipc_open_mem_handle(&p, h), "ipc_open_mem_handle");
#elif defined(__HIP_PLATFORM_AMD__)
  check(hipIpcOpenMemHandle(&p, h, hipIpcMemLazyEnablePeerAccess), "hipIpcOpenMemHandle");
#else
  check(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
#endif
  return p;
}
inline void ipc_close(void* p) noexcept {
#if defined(FASTA2A_GPU_STANDIN)
  (void)rt::ipc_close_mem_handle(p);
#elif defined(__HIP_PLATFORM_AMD__)
  (void)hipIpcCloseMemHandle(p);
#else
  (void)cudaIpcCloseMemHandle(p);
#endif
}

/// In stream order, *addr = v, after everything enqueued before on s (with the runtime's default
/// memory barrier, so that a reader who sees v sees the stream's earlier writes).
inline void write_value64(stream_t s, std::uint64_t* addr, std::uint64_t v) {
#if defined(FASTA2A_GPU_STANDIN)
  check(rt::write_value64(s, addr, v), "write_value64");
#elif defined(__HIP_PLATFORM_AMD__)
  check(hipStreamWriteValue64(s, addr, v, 0), "hipStreamWriteValue64");
#else
  detail::check_cu(detail::drv().write_value64(s, reinterpret_cast<CUdeviceptr>(addr), v, CU_STREAM_WRITE_VALUE_DEFAULT),
                   "cuStreamWriteValue64");
#endif
}
/// Work enqueued on s after this waits until *addr >= v.
inline void wait_value64(stream_t s, std::uint64_t* addr, std::uint64_t v) {
#if defined(FASTA2A_GPU_STANDIN)
  check(rt::wait_value64(s, addr, v), "wait_value64");
#elif defined(__HIP_PLATFORM_AMD__)
  check(hipStreamWaitValue64(s, addr, v, hipStreamWaitValueGte, ~std::uint64_t{0}), "hipStreamWaitValue64");
#else
  detail::check_cu(detail::drv().wait_value64(s, reinterpret_cast<CUdeviceptr>(addr), v, CU_STREAM_WAIT_VALUE_GEQ),
                   "cuStreamWaitValue64");
#endif
}

/// The host's read of a device value that streams write: a copy into `slot` (pinned host memory,
/// malloc_host) on `poll` (a stream kept for this), synchronised: correct, but a round trip per
/// poll. The slot must be pinned: a copy from the device into pageable memory goes through the
/// runtime's staging and returns only once complete; on an H200 a proxy thread that polled through
/// a pageable variable while the caller's thread had a pageable copy queued behind the stream wait
/// of a stream-ordered call hung (no timeout fired). The stand-in refuses a pageable slot.
inline std::uint64_t read_value64(const std::uint64_t* addr, [[maybe_unused]] stream_t poll, std::uint64_t* slot) {
#if defined(FASTA2A_GPU_STANDIN)
  check(rt::read_value64(addr, slot), "read_value64 (into a slot that is not pinned host memory?)");
#else
  gpu::memcpy_async(slot, addr, sizeof *slot, poll);
  gpu::stream_synchronize(poll);
#endif
  return *slot;
}

/// read_value64 of n consecutive values into slot[0, n): one copy and one round trip for all of
/// them. Each value is an aligned 64-bit word that streams write whole; the values of one copy may
/// be of different moments (no snapshot of them all), and a value is read as read_value64 reads one.
inline void read_values64(const std::uint64_t* addr, std::size_t n, [[maybe_unused]] stream_t poll, std::uint64_t* slot) {
  if (n == 0) return;
#if defined(FASTA2A_GPU_STANDIN)
  check(rt::read_values64(addr, n, slot), "read_values64 (into a slot that is not pinned host memory?)");
#else
  gpu::memcpy_async(slot, addr, n * sizeof *slot, poll);
  gpu::stream_synchronize(poll);
#endif
}

/// An owned stream (move-only).
class stream {
public:
  stream() : s_(gpu::stream_create()) {}
  stream(stream&& o) noexcept : s_(std::exchange(o.s_, stream_t{})) {}
  stream& operator=(stream&& o) noexcept {
    if (this != &o) {
      reset();
      s_ = std::exchange(o.s_, stream_t{});
    }
    return *this;
  }
  stream(const stream&) = delete;
  stream& operator=(const stream&) = delete;
  ~stream() { reset(); }
  stream_t get() const noexcept { return s_; }
  void synchronize() const { gpu::stream_synchronize(s_); }

private:
  void reset() noexcept {
    if (s_) {
      try {
        gpu::stream_synchronize(s_);
      } catch (...) {
      }
      gpu::stream_destroy(s_);
    }
    s_ = stream_t{};
  }
  stream_t s_{};
};

/// An owned event (move-only).
class event {
public:
  event() : e_(gpu::event_create()) {}
  event(event&& o) noexcept : e_(std::exchange(o.e_, event_t{})) {}
  event& operator=(event&& o) noexcept {
    if (this != &o) {
      if (e_) gpu::event_destroy(e_);
      e_ = std::exchange(o.e_, event_t{});
    }
    return *this;
  }
  event(const event&) = delete;
  event& operator=(const event&) = delete;
  ~event() {
    if (e_) gpu::event_destroy(e_);
  }
  void record(stream_t s) { gpu::event_record(e_, s); }
  bool done() const { return gpu::event_done(e_); }
  event_t get() const noexcept { return e_; }

private:
  event_t e_{};
};

/// An owned device allocation (move-only).
class device_buffer {
public:
  device_buffer() = default;
  explicit device_buffer(std::size_t n) : p_(n ? static_cast<std::byte*>(gpu::malloc_device(n)) : nullptr), n_(n) {}
  device_buffer(device_buffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  device_buffer& operator=(device_buffer&& o) noexcept {
    if (this != &o) {
      gpu::free_device(p_);
      p_ = std::exchange(o.p_, nullptr);
      n_ = std::exchange(o.n_, 0);
    }
    return *this;
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() { gpu::free_device(p_); }
  std::byte* data() const noexcept { return p_; }
  std::size_t size() const noexcept { return n_; }

private:
  std::byte* p_ = nullptr;
  std::size_t n_ = 0;
};

/// An owned block of pinned host memory (move-only).
class pinned_buffer {
public:
  pinned_buffer() = default;
  explicit pinned_buffer(std::size_t n) : p_(n ? static_cast<std::byte*>(gpu::malloc_host(n)) : nullptr), n_(n) {}
  pinned_buffer(pinned_buffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  pinned_buffer& operator=(pinned_buffer&& o) noexcept {
    if (this != &o) {
      gpu::free_host(p_);
      p_ = std::exchange(o.p_, nullptr);
      n_ = std::exchange(o.n_, 0);
    }
    return *this;
  }
  pinned_buffer(const pinned_buffer&) = delete;
  pinned_buffer& operator=(const pinned_buffer&) = delete;
  ~pinned_buffer() { gpu::free_host(p_); }
  std::byte* data() const noexcept { return p_; }
  std::size_t size() const noexcept { return n_; }

private:
  std::byte* p_ = nullptr;
  std::size_t n_ = 0;
};

} // namespace fasta2a::gpu
