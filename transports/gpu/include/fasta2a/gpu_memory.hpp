// fasta2a: GPU device memory as the engine's MemorySpace: staging allocated on the device, local
// copies enqueued on a stream (the engine's stream), synchronize waits for that stream.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "fasta2a/gpu_runtime.hpp"
#include "fasta2a/memory.hpp"

namespace fasta2a {

/// Device memory of the current device. Copies go on its stream, which it shares (by
/// shared_ptr) with whoever else must be ordered with them: give the scale-up gpu_ipc_transport the
/// same stream (`shared_stream()`), so that a put issued after a local copy reads what it wrote.
///
/// It also runs stream-ordered engine calls (StreamMemorySpace): `stream_type` is the runtime's
/// stream, events are runtime events, the release flag is written and waited on with the stream
/// memory operations (cuStreamWriteValue64 / cuStreamWaitValue64, HIP's equivalents); and it gives
/// pinned host memory for bounce buffers (`allocate_host`).
class gpu_memory {
public:
  static constexpr memory_kind kind = gpu::device_kind;
  using buffer = gpu::device_buffer;
  using host_buffer = gpu::pinned_buffer;
  using stream_type = gpu::stream_t;
  using event_type = gpu::event;

  /// With a stream of its own.
  gpu_memory() : s_(std::make_shared<gpu::stream>()) {}
  /// On `s` (throws fasta2a::error if null).
  explicit gpu_memory(std::shared_ptr<gpu::stream> s) : s_(std::move(s)) {
    if (!s_) throw error("gpu_memory: no stream");
  }

  gpu::stream_t stream() const noexcept { return s_->get(); }
  const std::shared_ptr<gpu::stream>& shared_stream() const noexcept { return s_; }

  /// n bytes of device memory, contents unspecified; throws fasta2a::error naming the size.
  buffer allocate(std::size_t n) const {
    try {
      return buffer(n);
    } catch (const error& e) {
      throw error("gpu_memory: cannot allocate " + std::to_string(n) + " bytes of device memory (" + e.what() + ")");
    }
  }
  /// Enqueued on the stream: ordered before everything enqueued on it later.
  void copy(std::byte* dst, const std::byte* src, std::size_t n) const {
    if (n) gpu::memcpy_async(dst, src, n, s_->get());
  }
  void synchronize() const { s_->synchronize(); }

  /// n bytes of pinned host memory (bounce buffers); throws fasta2a::error naming the size.
  host_buffer allocate_host(std::size_t n) const {
    try {
      return host_buffer(n);
    } catch (const error& e) {
      throw error("gpu_memory: cannot allocate " + std::to_string(n) + " bytes of pinned host memory (" + e.what() + ")");
    }
  }
  /// An event recorded on s.
  event_type record(stream_type s) const {
    event_type e;
    e.record(s);
    return e;
  }
  /// *flag = v on this memory space's stream, after everything enqueued on it before.
  void write_value(std::uint64_t* flag, std::uint64_t v) const { gpu::write_value64(s_->get(), flag, v); }
  /// Work enqueued on s later waits until *flag >= v.
  void wait_value(stream_type s, std::uint64_t* flag, std::uint64_t v) const { gpu::wait_value64(s, flag, v); }

private:
  std::shared_ptr<gpu::stream> s_;
};

static_assert(MemorySpace<gpu_memory>);

} // namespace fasta2a
