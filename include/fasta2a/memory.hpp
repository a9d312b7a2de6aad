// fasta2a: where the engine's own memory lives and how it copies locally. The engine takes a
// MemorySpace as a template parameter (host memory by default), so that nothing in it assumes
// host memory: a GPU memory space allocates staging on the device and copies on a stream.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <string>

#include "fasta2a/common.hpp"
#include "fasta2a/transport.hpp"

namespace fasta2a {

/// What the engine needs from a kind of memory:
/// - `M::kind`: the memory_kind of everything it allocates and of the user buffers it works on
///   (the engine checks that both transports can register that kind);
/// - `allocate(n)`: an owning `M::buffer` of n bytes (`data()`, `size()`), contents unspecified;
///   throws fasta2a::error when the memory is not there;
/// - `copy(dst, src, n)`: a local copy of n bytes, ordered before whatever the engine issues
///   after it on this rank (host: done when it returns; a GPU: enqueued on the engine's stream);
/// - `synchronize()`: every copy issued so far has completed.
template <class M>
concept MemorySpace = requires(M& m, std::size_t n, std::byte* dst, const std::byte* src, typename M::buffer& b) {
  typename M::buffer;
  { M::kind } -> std::convertible_to<memory_kind>;
  { m.allocate(n) } -> std::same_as<typename M::buffer>;
  { b.data() } -> std::same_as<std::byte*>;
  { b.size() } -> std::convertible_to<std::size_t>;
  m.copy(dst, src, n);
  m.synchronize();
} && std::movable<typename M::buffer>;

/// Host memory: staging from the heap, left uninitialised (every byte the engine reads is written
/// first), copies with memcpy.
struct host_memory {
  static constexpr memory_kind kind = memory_kind::host;

  /// An owning block of host memory.
  class buffer {
  public:
    buffer() = default;
    explicit buffer(std::size_t n) : p_(n ? std::make_unique_for_overwrite<std::byte[]>(n) : nullptr), n_(n) {}
    std::byte* data() const noexcept { return p_.get(); }
    std::size_t size() const noexcept { return n_; }

  private:
    std::unique_ptr<std::byte[]> p_;
    std::size_t n_ = 0;
  };

  /// Throws fasta2a::error naming the size when the heap cannot give it.
  buffer allocate(std::size_t n) const {
    try {
      return buffer(n);
    } catch (const std::bad_alloc&) {
      throw error("host_memory: cannot allocate " + std::to_string(n) + " bytes of staging");
    }
  }
  void copy(std::byte* dst, const std::byte* src, std::size_t n) const noexcept {
    if (n) std::memcpy(dst, src, n);
  }
  void synchronize() const noexcept {}
};

static_assert(MemorySpace<host_memory>);

// ---------------------------------------------------------------------------------------------
// Optional capabilities of a memory space, asked for by name where the engine uses them (see the
// capability concepts of transport.hpp; tests/test_transport_contract.cpp checks each).
// ---------------------------------------------------------------------------------------------

/// A memory space that allocates pinned host memory for bounce buffers: `allocate_host(n)` gives
/// an owning `M::host_buffer`. The engine bounces the scale-out data of a memory kind its
/// scale-out transport cannot register through such buffers (plain host memory otherwise).
template <class M>
concept PinnedHostAllocation = requires(const M& m, std::size_t n) {
  typename M::host_buffer;
  { m.allocate_host(n) } -> std::same_as<typename M::host_buffer>;
};

/// A memory space on one device that names it: `m.device()`, the GPU's ordinal, which the engine
/// hands to a transport that registers device memory (RegistersDevice).
template <class M>
concept DeviceOrdinal = requires(const M& m) {
  { m.device() } -> std::convertible_to<int>;
};

/// A MemorySpace that can also run calls in the order of a caller's stream (gpu_memory):
/// - `M::stream_type`: the caller's stream; `m.stream()`: the memory space's own stream;
/// - `m.record(s)`: an `M::event_type` recorded on s, whose `done()` (never blocking) says that
///   everything enqueued on s before it has completed;
/// - `m.write_value(flag, v)`: *flag = v on the memory space's own stream, after its earlier work;
/// - `m.wait_value(s, flag, v)`: work enqueued on s later waits until *flag >= v.
/// The flag is M memory (allocated with `allocate`).
template <class M>
concept StreamMemorySpace =
    MemorySpace<M> && std::movable<typename M::event_type> &&
    requires(M& m, const M& cm, typename M::stream_type s, std::uint64_t* flag, std::uint64_t v, typename M::event_type& e) {
      { cm.stream() } -> std::convertible_to<typename M::stream_type>;
      { m.record(s) } -> std::same_as<typename M::event_type>;
      { e.done() } -> std::convertible_to<bool>;
      m.write_value(flag, v);
      m.wait_value(s, flag, v);
    };

/// `S` is the stream type of the stream-ordered memory space `M` (the constraint of engine's stream
/// form). A concept of both, not `std::same_as<S, typename M::stream_type>` in the member's
/// requires-clause, so that the clause stays dependent on `S`: Clang 14 substitutes `M` into it
/// when the engine is instantiated and fails for a memory space that has no streams.
template <class M, class S>
concept StreamOf = StreamMemorySpace<M> && std::same_as<S, typename M::stream_type>;

namespace detail {
/// The engine's bounce buffer for memory space M: its pinned host buffer, else plain host memory.
template <class M>
struct host_buffer_of {
  using type = host_memory::buffer;
};
template <PinnedHostAllocation M>
struct host_buffer_of<M> {
  using type = typename M::host_buffer;
};
} // namespace detail

} // namespace fasta2a
