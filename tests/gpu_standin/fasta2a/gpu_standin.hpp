// fasta2a's stand-in of the few GPU runtime calls the library uses, for tests on machines without
// a GPU. It checks ordering and bookkeeping, never performance: nothing it measures is a GPU figure.
//
// - A stream is a worker thread running its queued operations in order; each operation may first
//   sleep a random time (settings().max_delay_us, seeded per stream), which is what exposes work
//   enqueued on the wrong stream.
// - An event records a generation on a stream; querying it, or a stream waiting on it, compares
//   the generation the stream has reached with the one recorded.
// - Device memory comes from POSIX shared memory (shm_open + mmap), so that an IPC handle (the
//   segment's name and size) opens in another thread or process as a second mapping of the same
//   pages. A pointer that does not come from this allocator has no IPC handle (an error), unless
//   settings().host_pointers_in_process is set: then its handle is the address itself and opens
//   only in the same process (what lets the conformance suite, whose buffers are std::vectors,
//   run over the GPU transport; no real runtime can do this).
// - Stream write / wait of a 64-bit value: an atomic release store / a wait until an acquire load
//   is >= the value, in stream order.
// - Host memory is pinned when it comes from malloc_host, pageable otherwise, with the real
//   runtimes' documented behaviour: an asynchronous copy from device memory into pageable memory
//   returns only once it has completed (the caller waits for the stream to reach it), and one from
//   pageable memory into device memory reads the source before it returns. read_value64 takes a
//   pinned slot only (invalid_value otherwise).
// - The driver's context lock, as seen on a real H200 (CUDA 13): a thread blocked in a copy into
//   pageable memory holds it shared until the copy completes, and calls that create or destroy
//   resources (events, streams, allocations, IPC mappings) take it exclusively. On a real GPU such
//   a call then waits for the copy, and hangs for ever when the copy waits for that very thread
//   (an engine's proxy creating an event while the caller waits in a pageable copy for the call
//   the proxy is running). The stand-in waits settings().context_lock_wait_ms for the lock and then
//   fails the call with status::would_hang, naming the cause, instead of hanging.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <random>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

namespace fasta2a::gpu_standin {

enum class status : int { success = 0, invalid_value = 1, out_of_memory = 2, not_ready = 600, ipc_failed = 201, would_hang = 999 };

inline const char* error_string(status s) noexcept {
  switch (s) {
  case status::success: return "success";
  case status::invalid_value: return "invalid value (stand-in)";
  case status::out_of_memory: return "out of shared memory (stand-in)";
  case status::not_ready: return "not ready";
  case status::ipc_failed: return "no IPC handle: the pointer is not from the stand-in allocator, or the handle does not open here";
  case status::would_hang:
    return "would hang on a real GPU (stand-in): this call takes the driver's context lock, which a thread blocked in a "
           "copy into pageable memory holds until its stream reaches that copy";
  }
  return "?";
}

struct config {
  int devices = 1;
  std::uint32_t max_delay_us = 0; ///< each operation first sleeps [0, max) us with probability 1/2
  std::uint64_t seed = 1;
  bool host_pointers_in_process = false;
  std::uint32_t context_lock_wait_ms = 5000; ///< see status::would_hang
};
inline config& settings() {
  static config c;
  return c;
}

/// How often this process called what, on a real device, makes the host wait for the device or
/// talk to the driver: counts, for tests and benchmarks that compare protocols by their round
/// trips (never a time).
struct call_counts {
  std::atomic<std::uint64_t> synchronize{0}; ///< stream_synchronize
  std::atomic<std::uint64_t> read_value{0};  ///< read_value64 (on a device: a copy and a synchronize)
  std::atomic<std::uint64_t> query{0};       ///< event_query
  std::atomic<std::uint64_t> enqueued{0};    ///< memcpy_async, write_value64, wait_value64, event_record, stream_wait_event
};
inline call_counts& counts() {
  static call_counts c;
  return c;
}

/// The IPC handle: 64 bytes, as CUDA's and HIP's.
struct ipc_mem_handle {
  char bytes[64];
};

namespace detail {
struct segment {
  std::string name;
  std::size_t size;
};
struct registry {
  std::mutex m;
  std::map<std::uintptr_t, segment> allocations; ///< by base address
  std::map<std::uintptr_t, std::size_t> opened;  ///< mappings made by ipc_open, by address
  std::map<std::uintptr_t, std::size_t> pinned;  ///< malloc_host blocks, by address
  std::uint64_t next = 0;
};
/// Whether p lies in one of the blocks of `m` (base -> size); the caller holds the registry lock.
inline bool inside(const std::map<std::uintptr_t, std::size_t>& m, const void* p) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  auto it = m.upper_bound(a);
  if (it == m.begin()) return false;
  --it;
  return a < it->first + it->second;
}
inline registry& reg() {
  static registry r;
  return r;
}
/// The driver's context lock (see the header comment).
inline std::shared_timed_mutex& context_lock() {
  static std::shared_timed_mutex m;
  return m;
}
/// Held exclusively by a resource call; `ok()` false when it was not had in time (would_hang).
class exclusive_context {
public:
  exclusive_context() : l_(context_lock(), std::defer_lock) {
    ok_ = l_.try_lock_for(std::chrono::milliseconds(settings().context_lock_wait_ms));
  }
  bool ok() const noexcept { return ok_; }

private:
  std::unique_lock<std::shared_timed_mutex> l_;
  bool ok_ = false;
};
struct handle_layout { // inside ipc_mem_handle::bytes
  std::uint64_t kind;  // 1: shared-memory segment, 2: in-process host pointer
  std::uint64_t size;  // segment size (kind 1)
  std::uint64_t where; // pid (kind 2: with the address in name)
  char name[40];
};
static_assert(sizeof(handle_layout) == 64);
} // namespace detail

/// A stream: a worker thread and its queue.
class stream_impl {
public:
  explicit stream_impl(std::uint64_t seed) : rng_(seed), worker_([this] { loop(); }) {}
  stream_impl(const stream_impl&) = delete;
  stream_impl& operator=(const stream_impl&) = delete;
  ~stream_impl() {
    {
      std::lock_guard l(m_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }
  void enqueue(std::function<void()> op) {
    {
      std::lock_guard l(m_);
      q_.push_back(std::move(op));
      ++issued_;
    }
    cv_.notify_all();
  }
  void synchronize() {
    std::unique_lock l(m_);
    const std::uint64_t target = issued_;
    done_cv_.wait(l, [&] { return done_ >= target; });
  }
  /// How many operations have been enqueued / completed (an event's generation).
  std::uint64_t issued() {
    std::lock_guard l(m_);
    return issued_;
  }
  std::uint64_t done() const noexcept { return done_atomic_.load(std::memory_order_acquire); }
  bool stopping() const noexcept { return stop_flag_.load(std::memory_order_relaxed); }

private:
  void loop() {
    for (;;) {
      std::function<void()> op;
      {
        std::unique_lock l(m_);
        cv_.wait(l, [&] { return stop_ || !q_.empty(); });
        if (q_.empty()) return;
        if (stop_) stop_flag_.store(true, std::memory_order_relaxed);
        op = std::move(q_.front());
        q_.pop_front();
      }
      const std::uint32_t d = settings().max_delay_us;
      if (d > 0 && !stopping()) {
        std::uniform_int_distribution<std::uint32_t> u(0, 2 * d - 1);
        const std::uint32_t x = u(rng_);
        if (x < d) std::this_thread::sleep_for(std::chrono::microseconds(x));
      }
      op();
      {
        std::lock_guard l(m_);
        ++done_;
        done_atomic_.store(done_, std::memory_order_release);
      }
      done_cv_.notify_all();
    }
  }
  std::mutex m_;
  std::condition_variable cv_, done_cv_;
  std::deque<std::function<void()>> q_;
  std::uint64_t issued_ = 0, done_ = 0;
  std::atomic<std::uint64_t> done_atomic_{0};
  std::atomic<bool> stop_flag_{false};
  bool stop_ = false;
  std::mt19937_64 rng_;
  std::thread worker_; // last: started once everything above exists
};
using stream_t = stream_impl*;

/// An event: the stream it was last recorded on and that stream's generation then.
struct event_impl {
  std::mutex m;
  stream_impl* s = nullptr;
  std::uint64_t gen = 0;
  bool done() {
    std::lock_guard l(m);
    return s == nullptr || s->done() >= gen;
  }
};
using event_t = event_impl*;

inline status get_device_count(int* n) {
  *n = settings().devices;
  return status::success;
}

inline status malloc_device(void** p, std::size_t n) {
  detail::exclusive_context ctx;
  if (!ctx.ok()) return status::would_hang;
  auto& r = detail::reg();
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  const std::size_t size = n == 0 ? page : (n + page - 1) / page * page;
  std::string name;
  {
    std::lock_guard l(r.m);
    name = "/fasta2a-si-" + std::to_string(getpid()) + "-" + std::to_string(r.next++);
  }
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return status::out_of_memory;
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    close(fd);
    shm_unlink(name.c_str());
    return status::out_of_memory;
  }
  void* a = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (a == MAP_FAILED) {
    shm_unlink(name.c_str());
    return status::out_of_memory;
  }
  std::lock_guard l(r.m);
  r.allocations[reinterpret_cast<std::uintptr_t>(a)] = {name, size};
  *p = a;
  return status::success;
}

inline status free_device(void* p) {
  detail::exclusive_context ctx;
  if (!ctx.ok()) return status::would_hang;
  if (!p) return status::success;
  auto& r = detail::reg();
  std::lock_guard l(r.m);
  auto it = r.allocations.find(reinterpret_cast<std::uintptr_t>(p));
  if (it == r.allocations.end()) return status::invalid_value;
  // Peers that opened the segment keep their mapping; the name goes now.
  shm_unlink(it->second.name.c_str());
  munmap(p, it->second.size);
  r.allocations.erase(it);
  return status::success;
}

/// Pinned host memory: plain host memory here (nothing to pin), remembered as pinned.
inline status malloc_host(void** p, std::size_t n) {
  detail::exclusive_context ctx;
  if (!ctx.ok()) return status::would_hang;
  *p = ::operator new(n == 0 ? 1 : n, std::nothrow);
  if (!*p) return status::out_of_memory;
  auto& r = detail::reg();
  std::lock_guard l(r.m);
  r.pinned[reinterpret_cast<std::uintptr_t>(*p)] = n == 0 ? 1 : n;
  return status::success;
}
inline status free_host(void* p) {
  detail::exclusive_context ctx;
  if (!ctx.ok()) return status::would_hang;
  if (!p) return status::success;
  {
    auto& r = detail::reg();
    std::lock_guard l(r.m);
    r.pinned.erase(reinterpret_cast<std::uintptr_t>(p));
  }
  ::operator delete(p);
  return status::success;
}

/// The allocation (this process's own) containing p.
inline status get_address_range(const void* p, void** base, std::size_t* size) {
  auto& r = detail::reg();
  std::lock_guard l(r.m);
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  auto it = r.allocations.upper_bound(a);
  if (it == r.allocations.begin()) return status::invalid_value;
  --it;
  if (a >= it->first + it->second.size) return status::invalid_value;
  *base = reinterpret_cast<void*>(it->first);
  *size = it->second.size;
  return status::success;
}

inline status stream_create(stream_t* s) {
  detail::exclusive_context ctx;
  if (!ctx.ok()) return status::would_hang;
  static std::atomic<std::uint64_t> streams{0};
  *s = new stream_impl(settings().seed * 0x9e3779b97f4a7c15ull + streams.fetch_add(1));
  return status::success;
}
inline status stream_destroy(stream_t s) {
  delete s; // runs what is queued first, like a real runtime's deferred destruction
  return status::success;
}
inline status stream_synchronize(stream_t s) {
  counts().synchronize.fetch_add(1, std::memory_order_relaxed);
  s->synchronize();
  return status::success;
}

namespace detail {
enum class host_kind { device, pinned, pageable };
inline host_kind kind_of(const void* p) {
  auto& r = reg();
  std::lock_guard l(r.m);
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  auto it = r.allocations.upper_bound(a);
  if (it != r.allocations.begin() && a < std::prev(it)->first + std::prev(it)->second.size) return host_kind::device;
  if (inside(r.opened, p)) return host_kind::device;
  return inside(r.pinned, p) ? host_kind::pinned : host_kind::pageable;
}
} // namespace detail

/// In stream order. Device -> pageable host: returns once the copy has completed (as the real
/// runtimes do). Pageable host -> device: the source is read before this returns (the real
/// runtimes' staging). Other directions: returns at once.
inline status memcpy_async(void* dst, const void* src, std::size_t n, stream_t s) {
  if (!n) return status::success;
  counts().enqueued.fetch_add(1, std::memory_order_relaxed);
  const detail::host_kind from = detail::kind_of(src), to = detail::kind_of(dst);
  if (from == detail::host_kind::device && to == detail::host_kind::pageable) {
    auto done = std::make_shared<std::atomic<bool>>(false);
    s->enqueue([dst, src, n, done] {
      std::memcpy(dst, src, n);
      done->store(true, std::memory_order_release);
    });
    std::shared_lock ctx(detail::context_lock()); // held while waiting, as the real driver does
    while (!done->load(std::memory_order_acquire)) std::this_thread::sleep_for(std::chrono::microseconds(5));
    return status::success;
  }
  if (from == detail::host_kind::pageable && to == detail::host_kind::device) {
    auto staged = std::make_shared<std::vector<std::byte>>(static_cast<const std::byte*>(src), static_cast<const std::byte*>(src) + n);
    s->enqueue([dst, staged] { std::memcpy(dst, staged->data(), staged->size()); });
    return status::success;
  }
  s->enqueue([dst, src, n] { std::memcpy(dst, src, n); });
  return status::success;
}

inline status event_create(event_t* e) {
  detail::exclusive_context ctx;
  if (!ctx.ok()) return status::would_hang;
  *e = new event_impl;
  return status::success;
}
inline status event_destroy(event_t e) {
  detail::exclusive_context ctx;
  if (!ctx.ok()) return status::would_hang;
  delete e;
  return status::success;
}
inline status event_record(event_t e, stream_t s) {
  counts().enqueued.fetch_add(1, std::memory_order_relaxed);
  std::lock_guard l(e->m);
  e->s = s;
  e->gen = s->issued(); // complete once the stream has run everything enqueued so far
  return status::success;
}
inline status event_query(event_t e) {
  counts().query.fetch_add(1, std::memory_order_relaxed);
  return e->done() ? status::success : status::not_ready;
}
inline status stream_wait_event(stream_t s, event_t e) {
  counts().enqueued.fetch_add(1, std::memory_order_relaxed);
  stream_impl* on;
  std::uint64_t gen;
  {
    std::lock_guard l(e->m);
    on = e->s;
    gen = e->gen;
  }
  if (on) s->enqueue([on, gen, s] {
      while (on->done() < gen && !s->stopping()) std::this_thread::sleep_for(std::chrono::microseconds(5));
    });
  return status::success;
}

inline status write_value64(stream_t s, std::uint64_t* addr, std::uint64_t v) {
  counts().enqueued.fetch_add(1, std::memory_order_relaxed);
  s->enqueue([addr, v] { std::atomic_ref<std::uint64_t>(*addr).store(v, std::memory_order_release); });
  return status::success;
}
inline status wait_value64(stream_t s, std::uint64_t* addr, std::uint64_t v) {
  counts().enqueued.fetch_add(1, std::memory_order_relaxed);
  s->enqueue([addr, v, s] {
    while (std::atomic_ref<std::uint64_t>(*addr).load(std::memory_order_acquire) < v && !s->stopping())
      std::this_thread::sleep_for(std::chrono::microseconds(5));
  });
  return status::success;
}
/// What the host reads of a value that streams write (device memory is host memory here), into
/// `slot`, which must be pinned (malloc_host): as on a real device, where the read is a copy on a
/// stream, a copy into pageable memory would go through the runtime's staging.
inline status read_value64(const std::uint64_t* addr, std::uint64_t* slot) {
  counts().read_value.fetch_add(1, std::memory_order_relaxed);
  if (detail::kind_of(slot) != detail::host_kind::pinned) return status::invalid_value;
  *slot = std::atomic_ref<const std::uint64_t>(*addr).load(std::memory_order_acquire);
  return status::success;
}

/// read_value64 of n consecutive values, one call (a device copies them in one round trip).
inline status read_values64(const std::uint64_t* addr, std::size_t n, std::uint64_t* slot) {
  counts().read_value.fetch_add(1, std::memory_order_relaxed);
  if (detail::kind_of(slot) != detail::host_kind::pinned || detail::kind_of(slot + n - 1) != detail::host_kind::pinned)
    return status::invalid_value;
  for (std::size_t i = 0; i < n; ++i) slot[i] = std::atomic_ref<const std::uint64_t>(addr[i]).load(std::memory_order_acquire);
  return status::success;
}

inline status ipc_get_mem_handle(ipc_mem_handle* h, void* p) {
  detail::handle_layout l{};
  auto& r = detail::reg();
  {
    std::lock_guard g(r.m);
    auto it = r.allocations.find(reinterpret_cast<std::uintptr_t>(p));
    if (it != r.allocations.end()) {
      l.kind = 1;
      l.size = it->second.size;
      std::snprintf(l.name, sizeof l.name, "%s", it->second.name.c_str());
    }
  }
  if (l.kind == 0) {
    if (!settings().host_pointers_in_process) return status::ipc_failed;
    l.kind = 2;
    l.where = static_cast<std::uint64_t>(getpid());
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    std::memcpy(l.name, &a, sizeof a);
  }
  std::memcpy(h->bytes, &l, sizeof l);
  return status::success;
}
inline status ipc_open_mem_handle(void** p, const ipc_mem_handle& h) {
  detail::exclusive_context ctx;
  if (!ctx.ok()) return status::would_hang;
  detail::handle_layout l;
  std::memcpy(&l, h.bytes, sizeof l);
  if (l.kind == 2) {
    if (l.where != static_cast<std::uint64_t>(getpid())) return status::ipc_failed;
    std::uintptr_t a;
    std::memcpy(&a, l.name, sizeof a);
    *p = reinterpret_cast<void*>(a);
    return status::success;
  }
  if (l.kind != 1) return status::invalid_value;
  l.name[sizeof l.name - 1] = '\0';
  const int fd = shm_open(l.name, O_RDWR, 0600);
  if (fd < 0) return status::ipc_failed;
  void* a = mmap(nullptr, l.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (a == MAP_FAILED) return status::ipc_failed;
  auto& r = detail::reg();
  std::lock_guard g(r.m);
  r.opened[reinterpret_cast<std::uintptr_t>(a)] = l.size;
  *p = a;
  return status::success;
}
inline status ipc_close_mem_handle(void* p) {
  detail::exclusive_context ctx;
  if (!ctx.ok()) return status::would_hang;
  auto& r = detail::reg();
  std::lock_guard g(r.m);
  auto it = r.opened.find(reinterpret_cast<std::uintptr_t>(p));
  if (it == r.opened.end()) return status::success; // an in-process host pointer: nothing mapped
  munmap(p, it->second);
  r.opened.erase(it);
  return status::success;
}

} // namespace fasta2a::gpu_standin
