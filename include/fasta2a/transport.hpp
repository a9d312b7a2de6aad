// fasta2a: what the engine needs from the machinery that moves bytes: a Bootstrap to exchange
// small blobs among all ranks, and Transports to put bytes into peers' registered memory and to
// signal them. Scale-up and scale-out transports are chosen independently.
#pragma once

#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <thread>
#include <vector>

#include "fasta2a/common.hpp"

namespace fasta2a {

/// Exchanges equal-sized byte blobs among all ranks of a communicator (an allgather): after
/// `allgather(mine, all)`, `all` holds every rank's blob in rank order. It is also the engine's
/// only collective, so it orders one call after the previous one on every rank. Throws
/// fasta2a::error if a peer does not arrive within the bootstrap's timeout.
template <class B>
concept Bootstrap = requires(B& b, std::span<const std::byte> mine, std::span<std::byte> all) {
  { b.rank() } -> std::convertible_to<rank_t>;
  { b.size() } -> std::convertible_to<rank_t>;
  b.allgather(mine, all);
};

/// A Bootstrap whose ranks share one address space (threads of one process) may also offer
/// `b.allgather_shared(mine)`: the same exchange, in the same order as the plain one, returning
/// one read-only buffer of every rank's blob that all ranks of the process share, instead of a
/// copy per rank. Nothing writes the buffer after the exchange returns (a later exchange makes a
/// new one); it lives while anyone holds it. The engine uses it where a bootstrap offers it, so
/// that n thread-ranks hold one gathered counts buffer (n^2 words), not n of them.
template <class B>
concept SharedBootstrap = Bootstrap<B> && requires(B& b, std::span<const std::byte> mine) {
  { b.allgather_shared(mine) } -> std::convertible_to<std::shared_ptr<const std::vector<std::byte>>>;
};

/// A signal channel: an opaque id chosen by whoever owns the connection (the engine uses one per
/// phase of FAST). A peer's signals are counted separately per channel, and within a channel they
/// are sent and awaited in the same order, so a receiver always knows how many to wait for without
/// any other coordination. Channels of a connection are numbered from 0 to its channel count.
using channel_id = std::uint32_t;

/// Where memory lives. A transport says which kinds it can register (`T::can_register`); a
/// MemorySpace says which kind it allocates (`M::kind`).
enum class memory_kind : std::uint8_t { host, cuda_device, hip_device };

inline const char* to_string(memory_kind k) noexcept {
  switch (k) {
  case memory_kind::host: return "host";
  case memory_kind::cuda_device: return "CUDA device";
  case memory_kind::hip_device: return "HIP device";
  }
  return "?";
}

/// A connection of one rank to every peer of a transport: what moves bytes and counts signals.
/// Each owner (an engine) has its own, so that signal counts of one never mix with another's.
///
/// - `put(peer, src, src_off, dst, dst_off, n, ch)` starts copying n bytes from local memory src
///   at src_off into peer's memory dst at dst_off; the bytes belong to channel ch (the channel of
///   the signal that will follow). It may return before the bytes have landed.
/// - `expect(peer, dst, dst_off, n, ch)`: this rank will receive n bytes from peer into its own
///   dst at dst_off (one call per put, in the order the peer puts them on that channel). A
///   one-sided transport ignores it.
/// - `signal(peer, ch)`: after every put this rank made to peer before it has landed, peer's
///   counter for (this rank, ch) on this connection grows by one.
/// - `wait(peer, ch, count, timeout)`: true once this rank's counter for (peer, ch) reaches count
///   and every expect that those signals cover (the peer's puts on ch before its count-th signal)
///   has completed; false at the timeout. Expects of later stages may still be pending.
/// - `test(peer, ch, count)`: one poll of `wait`, never blocking (an event loop interleaves several
///   conditions with it).
/// - `sent(peer, ch, count)`: never blocking; true once every put this rank made to peer on ch
///   before its count-th signal there has left this rank (its source may be reused, the network
///   has the bytes).
/// - `flush()`: every put this rank started has completed (its source may be reused).
///
/// Counts start at zero when the connection is made and are the connection's own.
template <class C, class Mem, class Rem>
concept Connection = requires(C& c, rank_t peer, const Mem& mem, const Rem& rem, std::size_t n,
                              channel_id ch, std::uint64_t count, std::chrono::milliseconds timeout) {
  c.put(peer, mem, n, rem, n, n, ch);
  c.expect(peer, mem, n, n, ch);
  c.signal(peer, ch);
  { c.wait(peer, ch, count, timeout) } -> std::same_as<bool>;
  { c.test(peer, ch, count) } -> std::same_as<bool>;
  { c.sent(peer, ch, count) } -> std::same_as<bool>;
  c.flush();
};

/// Moves bytes between ranks: one-sided in spirit (the sender names where the bytes land), with
/// an `expect` hook so that two-sided transports (MPI send/receive, a NIC's receive queue) can post
/// the matching receive. A transport owns what lasts (memory registrations, the links to peers);
/// the moving and signalling happen on connections it hands out.
///
/// - `can_register(kind)` (static): whether memory of that kind can be registered at all.
/// - `register_memory(p, n)` makes [p, p+n) a target or source until `deregister`; `serialize`
///   gives a handle of exactly `handle_bytes` bytes that another rank turns into a `remote` with
///   `deserialize`, and releases with `forget` (an opened IPC mapping, say) when it no longer
///   needs it. Registration is meant to be done once per buffer and kept: it may pin pages or map
///   memory, which costs far more than a put.
/// - `connect(channels)` makes a connection with its own signal counters for channels
///   [0, channels). Collective over the transport's ranks: every rank makes its connections in the
///   same order (as communicators are made). A connection must not outlive its transport.
/// - Optional capabilities (progress, two-sided puts, abandoning a failed call, device memory,
///   revocation) are the named concepts below, each asked for by name where the engine uses it.
template <class T>
concept Transport = requires(T& t, const T& ct, void* p, std::size_t n, rank_t peer, typename T::memory& mem,
                             typename T::remote& rem, std::span<const std::byte> blob, channel_id channels) {
  typename T::memory;
  typename T::remote;
  typename T::connection;
  { T::handle_bytes } -> std::convertible_to<std::size_t>;
  { T::can_register(memory_kind::host) } -> std::same_as<bool>;
  { t.register_memory(p, n) } -> std::same_as<typename T::memory>;
  t.deregister(mem);
  { ct.serialize(mem) } -> std::same_as<std::vector<std::byte>>;
  { t.deserialize(peer, blob) } -> std::same_as<typename T::remote>;
  t.forget(rem);
  { t.connect(channels) } -> std::same_as<typename T::connection>;
} && Connection<typename T::connection, typename T::memory, typename T::remote>;

// ---------------------------------------------------------------------------------------------
// Optional capabilities. A transport (or its connection) offers each by having the member named;
// the engine asks for the concept by name (`if constexpr (DrivesProgress<C>)`) and does without
// where it is absent. tests/test_transport_contract.cpp checks each against types that have it
// and types that do not; transports/README.md is the guide to writing a transport.
// ---------------------------------------------------------------------------------------------

/// A connection whose transfers move only while its rank calls into the transport (MPI,
/// libfabric's manual-progress providers, verbs' completion queue) has `progress()`: one
/// non-blocking poke of the transport's progress engine, run every time it is called (MPI's probes
/// a tag no message carries: a probe that matches a queued message returns without progressing
/// anything). The engine calls it while it waits on its other tier, so that no transfer of this
/// rank stalls while it waits on a peer that waits on that transfer. Such a connection's `test` and
/// `sent` must drive the same progress whenever they answer false: a staged turn of the engine
/// that already asked a tier and found nothing does not call its `progress()` again.
template <class C>
concept DrivesProgress = requires(C& c) { c.progress(); };

/// A connection whose puts land only where the receiver has posted the matching expect
/// (two-sided: MPI's matched receives) says so with `static constexpr bool expects_gate_puts =
/// true`. Where a plan shares staging across stages, the engine then frees a peer's slot by
/// posting the expects of the stage that reuses it, in place of a credit signal the peer would
/// wait for (see engine::run_stages): one message less per slot and stage.
template <class C>
concept ExpectsGatePuts = requires { requires static_cast<bool>(C::expects_gate_puts); };

/// A connection that can give up what it has in flight after a failed call has `abandon()`
/// (MPI: cancels its posted receives, so that a late peer's message cannot match them). The
/// engine calls it on a connection it retires; the connection object is then kept, unused, until
/// the engine goes, so that nothing reuses what identifies it while a late peer may still send.
template <class C>
concept Abandonable = requires(C& c) { c.abandon(); };

/// Whether, once a rank has deregistered memory (or dropped the connection that receives into it),
/// no peer's late put can still write into it: `static constexpr bool late_writes_revoked = true`.
/// The engine relies on it so that a call that failed leaves nothing writing into the caller's
/// buffers (see engine): host (the put checks a revocable region), MPI (dropping the connection
/// cancels its posted receives), libfabric and verbs (closing the memory registration invalidates
/// its key at the NIC) say true; GPU IPC says false (an exporter cannot revoke a CUDA or HIP IPC
/// mapping). A transport that says nothing is taken not to revoke.
template <class T>
concept RevokesLateWrites = requires { requires static_cast<bool>(T::late_writes_revoked); };

/// The same as a value (RevokesLateWrites<T>).
template <class T>
constexpr bool late_writes_revoked() noexcept {
  return RevokesLateWrites<T>;
}

/// Whether the transport keeps working after a peer's late write was refused: true unless it says
/// `static constexpr bool survives_revoked_writes = false` (libfabric's tcp;ofi_rxm closes the
/// link between the two processes; later operations between them fail, never hang, and the
/// transports must be made anew).
template <class T>
concept SurvivesRevokedWrites =
    !requires { T::survives_revoked_writes; } || requires { requires static_cast<bool>(T::survives_revoked_writes); };

/// A transport that can tell at run time whether it registers memory of a kind (a verbs or
/// libfabric transport whose device supports GPUDirect on this machine, say): `t.registers(kind)`.
/// Convention: static `can_register(kind)` says whether it ever can, `registers(kind)` whether it
/// can here; the engine registers directly iff both say yes (`registers_directly`, engine.hpp) and
/// moves the scale-out data through host bounce buffers otherwise.
template <class T>
concept RegistersAtRunTime = requires(const T& t, memory_kind k) {
  { t.registers(k) } -> std::convertible_to<bool>;
};

/// A transport that registers device memory (GPUDirect RDMA: the libfabric and verbs transports):
/// `register_memory(p, n, kind, device)`, device being the GPU's ordinal; `register_memory(p, n)`
/// stays the form for host memory.
template <class T>
concept RegistersDevice = requires(T& t, void* p, std::size_t n, memory_kind k, int device) {
  { t.register_memory(p, n, k, device) } -> std::same_as<typename T::memory>;
};

/// How a rank waits for a signal: spin briefly (cheap when the peer is close), then yield, then
/// sleep with exponential back-off, so that many ranks sharing few cores do not starve the ones
/// doing the work. A wait that goes on without progress sleeps longer still: each pause up to
/// 1/32 of the time since its first sleep, so a long wait (a slow, stopped or dead peer, until the
/// timeout) costs few wake-ups, while the delay it adds to a wait that ends stays within about 3%.
struct wait_policy {
  int spin = 64;                    ///< polls before the first yield
  int yields = 64;                  ///< yields before the first sleep
  std::chrono::microseconds min_sleep{2};
  std::chrono::microseconds max_sleep{200};     ///< the back-off's cap while a wait is short
  std::chrono::microseconds max_idle_sleep{2000}; ///< the cap once 1/32 of the wait exceeds max_sleep
};

namespace detail {

/// The waiting of one wait_policy, one pause at a time: spin, then yield, then sleep with
/// exponential back-off up to max_sleep, then (the wait going on) up to 1/32 of the time since the
/// first sleep, at most max_idle_sleep. `reset()` after progress starts over.
class backoff {
public:
  explicit backoff(const wait_policy& wp) noexcept : wp_(&wp), sleep_(wp.min_sleep) {}
  void reset() noexcept {
    polls_ = 0;
    sleep_ = wp_->min_sleep;
  }
  /// How long the next pause sleeps, once spinning and yielding are over.
  std::chrono::microseconds next_sleep() const noexcept { return sleep_; }
  void pause() {
    ++polls_;
    if (polls_ <= wp_->spin) return;
    if (polls_ <= wp_->spin + wp_->yields) {
      std::this_thread::yield();
      return;
    }
    const auto now = std::chrono::steady_clock::now();
    if (polls_ == wp_->spin + wp_->yields + 1) first_sleep_ = now;
    std::this_thread::sleep_for(sleep_);
    const auto waited = std::chrono::duration_cast<std::chrono::microseconds>(now - first_sleep_);
    const auto cap = std::max(wp_->max_sleep, std::min(waited / 32, wp_->max_idle_sleep));
    sleep_ = std::min(sleep_ * 2, cap);
  }

private:
  const wait_policy* wp_;
  int polls_ = 0;
  std::chrono::microseconds sleep_;
  std::chrono::steady_clock::time_point first_sleep_{};
};

/// Polls `ready()` under a wait_policy until it is true (returns true) or `timeout` passes.
template <class Ready>
bool poll_until(Ready&& ready, const wait_policy& wp, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  backoff b(wp);
  while (!ready()) {
    if (std::chrono::steady_clock::now() >= deadline) return ready();
    b.pause();
  }
  return true;
}

} // namespace detail
} // namespace fasta2a
