// fasta2a: one transport whose blocking calls also drive another's progress. Where the engine's
// two tiers are different transports that both need the application to make progress (MPI's
// shared memory, whose receiver copies; libfabric's manual-progress providers such as
// tcp;ofi_rxm), a rank blocked in one transport's wait or flush leaves the other's peers without
// progress: a rank flushing MPI sends to a server peer that itself waits, inside libfabric, for a
// third rank flushing MPI, waits for ever (seen: the flush timeout on the emulated cluster). The
// wrapper turns the wrapped transport's blocking calls into polls of its non-blocking ones, with
// `pump()` (the other transport's progress) between polls. Depends on the library only.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "fasta2a/common.hpp"
#include "fasta2a/transport.hpp"

namespace fasta2a {

/// A Transport that forwards everything to `inner` (which it does not own), except that its
/// connections' wait and flush poll inner's test and sent under a wait_policy and call `pump`
/// between polls, and test and sent call `pump` first. flush waits until every put covered by a
/// signal has left (sent), then calls inner's flush (puts after a connection's last signal, which
/// the engine never leaves, would still block inside it). `ranks` is the number of ranks of
/// inner's group.
template <Transport T>
class progress_coupled {
public:
  using memory = typename T::memory;
  using remote = typename T::remote;
  static constexpr std::size_t handle_bytes = T::handle_bytes;
  static constexpr bool can_register(memory_kind k) noexcept { return T::can_register(k); }

  class connection {
  public:
    void put(rank_t peer, const memory& src, std::size_t src_off, const remote& dst, std::size_t dst_off, std::size_t n,
             channel_id ch) {
      c_.put(peer, src, src_off, dst, dst_off, n, ch);
    }
    void expect(rank_t peer, const memory& dst, std::size_t off, std::size_t n, channel_id ch) {
      c_.expect(peer, dst, off, n, ch);
    }
    void signal(rank_t peer, channel_id ch) {
      c_.signal(peer, ch);
      ++signals_[lane(peer, ch)];
    }
    bool test(rank_t peer, channel_id ch, std::uint64_t count) {
      if (c_.test(peer, ch, count)) return true;
      (*pump_)();
      return c_.test(peer, ch, count);
    }
    bool sent(rank_t peer, channel_id ch, std::uint64_t count) {
      (*pump_)();
      return c_.sent(peer, ch, count);
    }
    bool wait(rank_t peer, channel_id ch, std::uint64_t count, std::chrono::milliseconds timeout) {
      return detail::poll_until([&] { return test(peer, ch, count); }, waiting_, timeout);
    }
    void flush() {
      const bool left = detail::poll_until(
          [&] {
            (*pump_)();
            for (std::size_t l = 0; l < signals_.size(); ++l)
              if (signals_[l] > 0 && !c_.sent(static_cast<rank_t>(l / channels_), static_cast<channel_id>(l % channels_), signals_[l]))
                return false;
            return true;
          },
          waiting_, timeout_);
      if (!left)
        throw timeout_error("progress_coupled::flush: this rank's signalled puts did not leave within " +
                    std::to_string(timeout_.count()) + " ms");
      c_.flush();
    }
    /// The inner connection's progress (where it has one), then the pump.
    void progress() {
      if constexpr (DrivesProgress<typename T::connection>) c_.progress();
      (*pump_)();
    }

  private:
    friend class progress_coupled;
    connection(typename T::connection c, const std::function<void()>* pump, std::size_t ranks, channel_id channels,
               wait_policy waiting, std::chrono::milliseconds timeout)
        : c_(std::move(c)), pump_(pump), channels_(channels), signals_(ranks * channels, 0), waiting_(waiting),
          timeout_(timeout) {}
    std::size_t lane(rank_t peer, channel_id ch) const {
      const std::size_t l = static_cast<std::size_t>(peer) * channels_ + ch;
      if (peer < 0 || ch >= channels_ || l >= signals_.size())
        throw error("progress_coupled: peer " + std::to_string(peer) + " or channel " + std::to_string(ch) +
                    " is out of range");
      return l;
    }
    typename T::connection c_;
    const std::function<void()>* pump_;
    std::size_t channels_;
    std::vector<std::uint64_t> signals_; ///< per (peer, channel): signals sent over the lifetime
    wait_policy waiting_;
    std::chrono::milliseconds timeout_;
  };

  /// Wraps `inner` (kept by reference) of a group of `ranks` ranks; `pump` drives the other
  /// transport's progress and must not throw for lack of work. flush gives up after `timeout`.
  progress_coupled(T& inner, rank_t ranks, std::function<void()> pump, wait_policy waiting = {},
                   std::chrono::milliseconds timeout = std::chrono::milliseconds(30000))
      : inner_(inner), ranks_(ranks), pump_(std::move(pump)), waiting_(waiting), timeout_(timeout) {
    if (ranks < 1) throw error("progress_coupled: a group needs at least one rank");
    if (!pump_) throw error("progress_coupled: no pump given");
  }
  progress_coupled(const progress_coupled&) = delete;
  progress_coupled& operator=(const progress_coupled&) = delete;

  memory register_memory(void* p, std::size_t n) { return inner_.register_memory(p, n); }
  void deregister(memory& m) { inner_.deregister(m); }
  std::vector<std::byte> serialize(const memory& m) const { return inner_.serialize(m); }
  remote deserialize(rank_t peer, std::span<const std::byte> blob) { return inner_.deserialize(peer, blob); }
  void forget(remote& r) { inner_.forget(r); }
  connection connect(channel_id channels) {
    return connection(inner_.connect(channels), &pump_, static_cast<std::size_t>(ranks_), channels, waiting_, timeout_);
  }

private:
  T& inner_;
  rank_t ranks_;
  std::function<void()> pump_;
  wait_policy waiting_;
  std::chrono::milliseconds timeout_;
};

} // namespace fasta2a
