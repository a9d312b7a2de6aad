// Test-owned wrappers over the public Bootstrap and Transport concepts: they count what the engine
// asks of its bootstrap and transports, inject random delays between operations, and inject faults
// (signals that never go out, sends that never leave). They wrap any transport by reference, so
// the same faults are tried on every transport.
#pragma once

#include <chrono>
#include <cstdint>
#include <random>
#include <span>
#include <thread>
#include <utility>
#include <vector>

#include <fasta2a/transport.hpp>

namespace fasta2a::testing {

/// What a wrapped transport does besides forwarding, and what it counted. One per rank (not
/// shared between threads).
struct probe {
  // Faults and delays.
  bool mute = false;  ///< signals are dropped (a peer that never signals)
  bool stuck = false; ///< sent() never says yes (sends that never leave)
  std::chrono::milliseconds late{0}; ///< the next put first sleeps this long (once: a late peer)
  std::chrono::microseconds max_delay{0}; ///< a random pause of [0, max_delay) before each operation
  double delay_probability = 0.5;
  /// sent() says "not yet" with this probability on each poll, whatever the transport says: sends
  /// that leave late (a transport whose puts complete asynchronously, as MPI's and RDMA's do).
  double unsent_probability = 0;
  std::mt19937_64 rng{1};
  // Counts.
  long registrations = 0, deregistrations = 0, deserialized = 0, forgotten = 0, connections = 0;
  long puts = 0, expects = 0, signals = 0;

  void pause() {
    if (max_delay.count() <= 0) return;
    std::uniform_real_distribution<double> u(0.0, 1.0);
    if (u(rng) >= delay_probability) return;
    std::this_thread::sleep_for(std::chrono::microseconds(static_cast<long>(u(rng) * static_cast<double>(max_delay.count()))));
  }
};

/// A probe that pauses up to max_delay before half of the operations, its delays drawn from `seed`.
inline probe delaying_probe(std::chrono::microseconds max_delay, std::uint64_t seed) {
  probe p;
  p.max_delay = max_delay;
  p.unsent_probability = max_delay.count() > 0 ? 0.5 : 0;
  p.rng.seed(seed);
  return p;
}

/// A Transport that forwards to `T` and consults a probe.
template <Transport T>
class probed_transport {
public:
  using memory = typename T::memory;
  using remote = typename T::remote;
  static constexpr std::size_t handle_bytes = T::handle_bytes;
  static constexpr bool can_register(memory_kind k) noexcept { return T::can_register(k); }
  static constexpr bool late_writes_revoked = fasta2a::late_writes_revoked<T>();
  static constexpr bool survives_revoked_writes = SurvivesRevokedWrites<T>;

  class connection {
  public:
    /// As T's connection says (MPI: puts land only in posted expects; transport.hpp).
    static constexpr bool expects_gate_puts = ExpectsGatePuts<typename T::connection>;
    void put(rank_t peer, const memory& src, std::size_t so, const remote& dst, std::size_t d, std::size_t n, channel_id ch) {
      p_->pause();
      if (p_->late.count() > 0) std::this_thread::sleep_for(std::exchange(p_->late, std::chrono::milliseconds(0)));
      ++p_->puts;
      c_.put(peer, src, so, dst, d, n, ch);
    }
    void expect(rank_t peer, const memory& dst, std::size_t d, std::size_t n, channel_id ch) {
      p_->pause();
      ++p_->expects;
      c_.expect(peer, dst, d, n, ch);
    }
    void signal(rank_t peer, channel_id ch) {
      p_->pause();
      if (p_->mute) return;
      ++p_->signals;
      c_.signal(peer, ch);
    }
    bool wait(rank_t peer, channel_id ch, std::uint64_t count, std::chrono::milliseconds timeout) {
      p_->pause();
      return c_.wait(peer, ch, count, timeout);
    }
    bool test(rank_t peer, channel_id ch, std::uint64_t count) { return c_.test(peer, ch, count); }
    bool sent(rank_t peer, channel_id ch, std::uint64_t count) {
      if (p_->stuck) return false;
      if (p_->unsent_probability > 0 && std::uniform_real_distribution<double>(0.0, 1.0)(p_->rng) < p_->unsent_probability)
        return false;
      return c_.sent(peer, ch, count);
    }
    void flush() {
      p_->pause();
      c_.flush();
    }
    /// Only where T's connection has it (MPI: cancels posted receives after a failed call).
    void abandon() noexcept
      requires Abandonable<typename T::connection>
    {
      c_.abandon();
    }
    /// Only where T's connection has it (MPI, libfabric, verbs).
    void progress()
      requires DrivesProgress<typename T::connection>
    {
      c_.progress();
    }

  private:
    friend class probed_transport;
    connection(typename T::connection c, probe* p) : c_(std::move(c)), p_(p) {}
    typename T::connection c_;
    probe* p_;
  };

  probed_transport(T& inner, probe& p) : t_(&inner), p_(&p) {}

  memory register_memory(void* ptr, std::size_t n) {
    ++p_->registrations;
    return t_->register_memory(ptr, n);
  }
  void deregister(memory& m) {
    ++p_->deregistrations;
    t_->deregister(m);
  }
  std::vector<std::byte> serialize(const memory& m) const { return t_->serialize(m); }
  remote deserialize(rank_t peer, std::span<const std::byte> blob) {
    ++p_->deserialized;
    return t_->deserialize(peer, blob);
  }
  void forget(remote& r) {
    ++p_->forgotten;
    t_->forget(r);
  }
  connection connect(channel_id channels) {
    ++p_->connections;
    return connection(t_->connect(channels), p_);
  }
  /// Only where T has it (libfabric, verbs): the engine treats a transport without `registers`
  /// as registering every kind its `can_register` allows.
  bool registers(memory_kind k) const
    requires RegistersAtRunTime<T>
  {
    return t_->registers(k);
  }

private:
  T* t_;
  probe* p_;
};

/// A Bootstrap that forwards to `B` and counts its exchanges.
template <Bootstrap B>
class counting_bootstrap {
public:
  explicit counting_bootstrap(B& inner) : b_(&inner) {}
  rank_t rank() const { return b_->rank(); }
  rank_t size() const { return b_->size(); }
  void allgather(std::span<const std::byte> mine, std::span<std::byte> all) {
    ++exchanges;
    b_->allgather(mine, all);
  }
  long exchanges = 0;

private:
  B* b_;
};

} // namespace fasta2a::testing
