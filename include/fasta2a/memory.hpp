// fasta2a: where the engine's own memory lives and how it copies locally. The engine takes a
// MemorySpace as a template parameter (host memory by default), so that nothing in it assumes
// host memory: a GPU memory space allocates staging on the device and copies on a stream.
#pragma once

#include <concepts>
#include <cstddef>
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

} // namespace fasta2a
