// fasta2a: GPU device memory as the engine's MemorySpace: staging allocated on the device, local
// copies enqueued on a stream (the engine's stream), synchronize waits for that stream.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

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
///
/// Events come from a pool made with it (`pooled_events`, grown only when every one is in use):
/// creating or destroying a runtime event takes the driver's context lock, which a thread blocked
/// in a copy into pageable memory holds until its stream reaches that copy. An engine's proxy
/// thread that destroyed the event of a finished call while the caller waited in such a copy
/// for a later call would hang for ever (seen on an H200 with event creation; see
/// tests/gpu_standin for the model).
class gpu_memory {
  struct event_pool {
    std::mutex m;
    std::vector<std::unique_ptr<gpu::event>> all;
    std::vector<gpu::event*> free;
  };

public:
  static constexpr memory_kind kind = gpu::device_kind;
  using buffer = gpu::device_buffer;
  using host_buffer = gpu::pinned_buffer;
  using stream_type = gpu::stream_t;
  /// Events made in advance.
  static constexpr std::size_t pooled_events = 64;

  /// A runtime event from the pool, returned to it (no runtime call) when destroyed.
  class event_type {
  public:
    event_type(event_type&& o) noexcept : pool_(std::move(o.pool_)), e_(std::exchange(o.e_, nullptr)) {}
    event_type& operator=(event_type&& o) noexcept {
      if (this != &o) {
        release();
        pool_ = std::move(o.pool_);
        e_ = std::exchange(o.e_, nullptr);
      }
      return *this;
    }
    event_type(const event_type&) = delete;
    event_type& operator=(const event_type&) = delete;
    ~event_type() { release(); }
    bool done() const { return e_->done(); }
    gpu::event_t get() const noexcept { return e_->get(); }

  private:
    friend class gpu_memory;
    event_type(std::shared_ptr<event_pool> pool, gpu::event* e) : pool_(std::move(pool)), e_(e) {}
    void release() noexcept {
      if (!e_) return;
      std::lock_guard l(pool_->m);
      pool_->free.push_back(e_); // capacity reserved when the event was made: no allocation
      e_ = nullptr;
    }
    std::shared_ptr<event_pool> pool_;
    gpu::event* e_ = nullptr;
  };

  /// With a stream of its own.
  gpu_memory() : gpu_memory(std::make_shared<gpu::stream>()) {}
  /// On `s` (throws fasta2a::error if null).
  explicit gpu_memory(std::shared_ptr<gpu::stream> s) : s_(std::move(s)), events_(std::make_shared<event_pool>()) {
    if (!s_) throw error("gpu_memory: no stream");
    grow_events(pooled_events);
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
  /// An event recorded on s (from the pool).
  event_type record(stream_type s) const {
    gpu::event* e = nullptr;
    {
      std::lock_guard l(events_->m);
      if (events_->free.empty()) grow_events(events_->all.size()); // all in use: twice as many
      e = events_->free.back();
      events_->free.pop_back();
    }
    event_type out(events_, e);
    e->record(s);
    return out;
  }
  /// *flag = v on this memory space's stream, after everything enqueued on it before.
  void write_value(std::uint64_t* flag, std::uint64_t v) const { gpu::write_value64(s_->get(), flag, v); }
  /// Work enqueued on s later waits until *flag >= v.
  void wait_value(stream_type s, std::uint64_t* flag, std::uint64_t v) const { gpu::wait_value64(s, flag, v); }

private:
  // Adds n events to the pool (its lock held, or not yet shared).
  void grow_events(std::size_t n) const {
    event_pool& p = *events_;
    p.all.reserve(p.all.size() + n);
    p.free.reserve(p.all.size() + n);
    for (std::size_t i = 0; i < n; ++i) {
      p.all.push_back(std::make_unique<gpu::event>());
      p.free.push_back(p.all.back().get());
    }
  }

  std::shared_ptr<gpu::stream> s_;
  std::shared_ptr<event_pool> events_;
};

static_assert(MemorySpace<gpu_memory>);

} // namespace fasta2a
