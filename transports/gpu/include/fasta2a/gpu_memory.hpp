// fasta2a: GPU device memory as the engine's MemorySpace: staging allocated on the device, local
// copies enqueued on a stream (the engine's stream), synchronize waits for that stream.
#pragma once

#include <memory>
#include <string>

#include "fasta2a/gpu_runtime.hpp"
#include "fasta2a/memory.hpp"

namespace fasta2a {

/// Device memory of the current device. Copies go on its stream, which it shares (by
/// shared_ptr) with whoever else must be ordered with them: give the scale-up gpu_ipc_transport the
/// same stream (`shared_stream()`), so that a put issued after a local copy reads what it wrote.
class gpu_memory {
public:
  static constexpr memory_kind kind = gpu::device_kind;
  using buffer = gpu::device_buffer;

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

private:
  std::shared_ptr<gpu::stream> s_;
};

static_assert(MemorySpace<gpu_memory>);

} // namespace fasta2a
