// A minimal fasta2a transport, the worked example of transports/README.md: ranks are threads of one
// process, a put is a memcpy into the peer's memory, a signal is an atomic counter the peer reads.
// It satisfies fasta2a::Transport with one optional capability, RevokesLateWrites (deregistering
// memory stops every later put into it: what lets a failed call free its buffers at once), and
// passes the conformance suite (test_minimal_transport.cpp). A real transport replaces the memcpy
// with its network's write, the counter with its network's notification and the revocation with
// its NIC's (closing a memory registration invalidates its key); the rest stays as here.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>
#include <utility>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <fasta2a/transport.hpp>

namespace example {

using fasta2a::channel_id;
using fasta2a::rank_t;

/// A registered region: puts into it hold `lock` shared and check `live`; deregistering takes it
/// exclusively and clears `live`, so once deregister returns no put is copying and none will.
struct minimal_region {
  std::shared_mutex lock;
  bool live = true;
};

/// What the thread-ranks of one process share: the signal counters of every connection (the k-th
/// connection that each rank makes is one connection: connect is collective, made in the same
/// order everywhere; a counter per receiver, sender and channel), and the registered regions.
class minimal_world {
public:
  explicit minimal_world(rank_t ranks) : ranks_(ranks), made_(static_cast<std::size_t>(ranks), 0) {}
  rank_t size() const noexcept { return ranks_; }

  std::atomic<std::uint64_t>* next_connection(rank_t r, channel_id channels) {
    std::lock_guard lock(m_);
    const std::size_t k = made_[static_cast<std::size_t>(r)]++;
    if (k == sets_.size()) {
      const auto n = static_cast<std::size_t>(ranks_) * static_cast<std::size_t>(ranks_) * channels;
      sets_.push_back({std::make_unique<std::atomic<std::uint64_t>[]>(n), channels}); // zeroed
    }
    if (sets_[k].channels != channels)
      throw fasta2a::error("minimal_transport: rank " + std::to_string(r) + "'s connection " + std::to_string(k) +
                           " has " + std::to_string(channels) + " channels, another rank's " +
                           std::to_string(sets_[k].channels) + ": connections made in different orders");
    return sets_[k].counters.get();
  }

  std::pair<std::uint64_t, std::shared_ptr<minimal_region>> add_region() {
    std::lock_guard lock(m_);
    auto r = std::make_shared<minimal_region>();
    regions_[++last_id_] = r;
    return {last_id_, std::move(r)};
  }
  /// The region of an id, or null once it was deregistered.
  std::shared_ptr<minimal_region> find_region(std::uint64_t id) {
    std::lock_guard lock(m_);
    const auto it = regions_.find(id);
    return it == regions_.end() ? nullptr : it->second;
  }
  void revoke(std::uint64_t id, minimal_region& r) {
    {
      std::unique_lock hold(r.lock); // waits for the puts copying into it
      r.live = false;
    }
    std::lock_guard lock(m_);
    regions_.erase(id);
  }

private:
  struct counter_set {
    std::unique_ptr<std::atomic<std::uint64_t>[]> counters;
    channel_id channels;
  };
  rank_t ranks_;
  std::mutex m_;
  std::vector<std::size_t> made_;   // connections made so far, per rank
  std::vector<counter_set> sets_;   // per connection
  std::unordered_map<std::uint64_t, std::shared_ptr<minimal_region>> regions_;
  std::uint64_t last_id_ = 0;
};

class minimal_transport {
public:
  /// Registered memory: nothing to pin in one process, so the span and the region that guards it.
  struct memory {
    std::byte* ptr = nullptr;
    std::size_t size = 0;
    std::uint64_t id = 0;
    std::shared_ptr<minimal_region> region;
  };
  using remote = memory; ///< a peer's memory as this rank sees it: the same address space
  static constexpr std::size_t handle_bytes = sizeof(std::uintptr_t) + 2 * sizeof(std::uint64_t);
  static constexpr bool late_writes_revoked = true; ///< fasta2a::RevokesLateWrites
  static constexpr bool can_register(fasta2a::memory_kind k) noexcept { return k == fasta2a::memory_kind::host; }

  class connection {
  public:
    void put(rank_t peer, const memory& src, std::size_t src_off, const remote& dst, std::size_t dst_off,
             std::size_t n, channel_id ch) const {
      check(peer, ch);
      if (src_off > src.size || n > src.size - src_off || dst_off > dst.size || n > dst.size - dst_off)
        throw fasta2a::error("minimal_transport: a put of " + std::to_string(n) + " bytes to rank " +
                             std::to_string(peer) + " is out of bounds");
      if (n == 0) return;
      if (!dst.region) throw fasta2a::error("minimal_transport: a put into memory that was never registered");
      std::shared_lock hold(dst.region->lock);
      if (!dst.region->live)
        throw fasta2a::error("minimal_transport: rank " + std::to_string(peer) +
                             "'s memory is no longer registered; nothing was written");
      std::memcpy(dst.ptr + dst_off, src.ptr + src_off, n); // landed when put returns
    }
    /// One-sided: the sender names where bytes land, so nothing to post.
    void expect(rank_t peer, const memory&, std::size_t, std::size_t, channel_id ch) const { check(peer, ch); }
    /// Release: whoever sees the new count also sees every byte put before it.
    void signal(rank_t peer, channel_id ch) const {
      check(peer, ch);
      at(peer, rank_, ch).fetch_add(1, std::memory_order_release);
    }
    bool test(rank_t peer, channel_id ch, std::uint64_t count) const {
      check(peer, ch);
      return at(rank_, peer, ch).load(std::memory_order_acquire) >= count;
    }
    /// Polls: spins a little, then sleeps, so that many thread-ranks on few cores make progress.
    bool wait(rank_t peer, channel_id ch, std::uint64_t count, std::chrono::milliseconds timeout) const {
      const auto deadline = std::chrono::steady_clock::now() + timeout;
      for (int polls = 0; !test(peer, ch, count); ++polls) {
        if (std::chrono::steady_clock::now() >= deadline) return test(peer, ch, count);
        if (polls < 100) std::this_thread::yield();
        else std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
      return true;
    }
    /// A put is complete when it returns: everything has always left.
    bool sent(rank_t, channel_id, std::uint64_t) const noexcept { return true; }
    void flush() const noexcept {}

  private:
    friend class minimal_transport;
    connection(std::atomic<std::uint64_t>* c, rank_t ranks, rank_t rank, channel_id channels)
        : c_(c), ranks_(ranks), rank_(rank), channels_(channels) {}
    std::atomic<std::uint64_t>& at(rank_t to, rank_t from, channel_id ch) const noexcept {
      return c_[(static_cast<std::size_t>(to) * static_cast<std::size_t>(ranks_) + static_cast<std::size_t>(from)) * channels_ + ch];
    }
    void check(rank_t peer, channel_id ch) const {
      if (peer < 0 || peer >= ranks_ || ch >= channels_)
        throw fasta2a::error("minimal_transport: rank " + std::to_string(peer) + ", channel " + std::to_string(ch) +
                             ": there are " + std::to_string(ranks_) + " ranks and " + std::to_string(channels_) +
                             " channels");
    }
    std::atomic<std::uint64_t>* c_;
    rank_t ranks_, rank_;
    channel_id channels_;
  };

  minimal_transport(minimal_world& w, rank_t rank) : w_(&w), rank_(rank) {}

  memory register_memory(void* p, std::size_t n) {
    auto [id, region] = w_->add_region();
    return {static_cast<std::byte*>(p), n, id, std::move(region)};
  }
  /// Revokes: once it returns, no peer's put is copying into the memory and every later one fails.
  void deregister(memory& m) {
    if (m.region) w_->revoke(m.id, *m.region);
    m = {};
  }
  /// A handle is what a peer needs to address the memory: here its address, size and region id.
  std::vector<std::byte> serialize(const memory& m) const {
    std::vector<std::byte> h(handle_bytes);
    const auto addr = reinterpret_cast<std::uintptr_t>(m.ptr);
    const auto size = static_cast<std::uint64_t>(m.size);
    std::memcpy(h.data(), &addr, sizeof addr);
    std::memcpy(h.data() + sizeof addr, &size, sizeof size);
    std::memcpy(h.data() + sizeof addr + sizeof size, &m.id, sizeof m.id);
    return h;
  }
  remote deserialize(rank_t peer, std::span<const std::byte> h) const {
    if (h.size() != handle_bytes)
      throw fasta2a::error("minimal_transport: rank " + std::to_string(peer) + "'s handle has " +
                           std::to_string(h.size()) + " bytes, not " + std::to_string(handle_bytes));
    std::uintptr_t addr = 0;
    std::uint64_t size = 0, id = 0;
    std::memcpy(&addr, h.data(), sizeof addr);
    std::memcpy(&size, h.data() + sizeof addr, sizeof size);
    std::memcpy(&id, h.data() + sizeof addr + sizeof size, sizeof id);
    auto region = w_->find_region(id);
    if (!region) { // already deregistered: puts into it fail
      region = std::make_shared<minimal_region>();
      region->live = false;
    }
    return {reinterpret_cast<std::byte*>(addr), static_cast<std::size_t>(size), id, std::move(region)};
  }
  void forget(remote&) const noexcept {}
  connection connect(channel_id channels) {
    if (channels < 1) throw fasta2a::error("minimal_transport: a connection needs at least one channel");
    return connection(w_->next_connection(rank_, channels), w_->size(), rank_, channels);
  }

private:
  minimal_world* w_;
  rank_t rank_;
};

static_assert(fasta2a::Transport<minimal_transport> && fasta2a::RevokesLateWrites<minimal_transport>);

} // namespace example
