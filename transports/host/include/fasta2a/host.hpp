// fasta2a host transport: the ranks are threads of one process sharing memory. A put is a memcpy
// into the peer's buffer, a signal is an atomic counter the peer polls. It is the embedded
// default (tests, CPU runs, one-process demos) and the reference the other transports are
// checked against. Depends on nothing but the C++ standard library and threads.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "fasta2a/transport.hpp"

namespace fasta2a {

/// What the threads of one process share: the signal counters of every connection and the
/// bootstrap's meeting point. Create one per group of ranks, then one host_bootstrap and one
/// host_transport per thread.
class host_fabric {
public:
  /// Throws fasta2a::error if ranks < 1.
  explicit host_fabric(rank_t ranks, std::chrono::milliseconds timeout = std::chrono::seconds(30))
      : ranks_(ranks), timeout_(timeout) {
    if (ranks < 1) throw error("host_fabric needs at least one rank (got " + std::to_string(ranks) + ")");
    arrived_flags_.assign(ranks, 0);
    connections_made_.assign(ranks, 0);
  }
  host_fabric(const host_fabric&) = delete;
  host_fabric& operator=(const host_fabric&) = delete;

  rank_t size() const noexcept { return ranks_; }
  std::chrono::milliseconds timeout() const noexcept { return timeout_; }

  /// The signal counters of rank `rank`'s next connection: its k-th connection shares them with
  /// every other rank's k-th (connections are made in the same order on every rank), indexed
  /// (receiver, sender, channel). Throws fasta2a::error if ranks disagree on the channel count.
  std::atomic<std::uint64_t>* connect(rank_t rank, channel_id channels) {
    std::lock_guard lock(mutex_);
    const std::size_t k = connections_made_[static_cast<std::size_t>(rank)]++;
    if (k == tables_.size()) {
      const std::size_t n = static_cast<std::size_t>(ranks_) * static_cast<std::size_t>(ranks_) * channels;
      tables_.push_back({std::make_unique<std::atomic<std::uint64_t>[]>(n), channels});
      for (std::size_t i = 0; i < n; ++i) tables_.back().counters[i].store(0, std::memory_order_relaxed);
    } else if (tables_[k].channels != channels) {
      throw error("host_fabric: rank " + std::to_string(rank) + "'s connection " + std::to_string(k) + " has " +
                  std::to_string(channels) + " channels, another rank's " + std::to_string(tables_[k].channels));
    }
    return tables_[k].counters.get();
  }

  /// Allgather among all ranks of the fabric. Two buffers alternate by generation: a rank can only
  /// write generation g + 2 after every rank has arrived at g + 1, so after it read generation g.
  void allgather(rank_t rank, std::span<const std::byte> mine, std::span<std::byte> all) {
    if (all.size() != mine.size() * ranks_)
      throw error("host bootstrap: allgather of " + std::to_string(mine.size()) + " bytes per rank needs " +
                  std::to_string(mine.size() * ranks_) + " bytes, got " + std::to_string(all.size()));
    std::unique_lock lock(mutex_);
    const std::uint64_t gen = generation_;
    auto& buf = buffers_[gen % 2];
    if (arrived_ == 0) {
      blob_ = mine.size();
      buf.assign(blob_ * ranks_, std::byte{0});
      std::fill(arrived_flags_.begin(), arrived_flags_.end(), 0);
    } else if (mine.size() != blob_) {
      throw error("host bootstrap: rank " + std::to_string(rank) + " contributes " +
                  std::to_string(mine.size()) + " bytes, the others " + std::to_string(blob_));
    }
    // Empty blobs may have no storage: memcpy with a null pointer is undefined even for 0 bytes.
    if (!mine.empty()) std::memcpy(buf.data() + blob_ * rank, mine.data(), mine.size());
    arrived_flags_[rank] = 1;
    if (++arrived_ == ranks_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
    } else if (!cv_.wait_for(lock, timeout_, [&] { return generation_ != gen; })) {
      std::string missing;
      for (rank_t r = 0; r < ranks_; ++r)
        if (!arrived_flags_[r]) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      throw error("host bootstrap: rank " + std::to_string(rank) + " waited " +
                  std::to_string(timeout_.count()) + " ms in allgather; rank(s) " + missing +
                  " never arrived");
    }
    if (!all.empty()) std::memcpy(all.data(), buf.data(), all.size());
  }

private:
  rank_t ranks_;
  std::chrono::milliseconds timeout_;
  struct table {
    std::unique_ptr<std::atomic<std::uint64_t>[]> counters;
    channel_id channels;
  };
  std::deque<table> tables_;             ///< per connection (a deque never moves them)
  std::vector<std::size_t> connections_made_; ///< per rank
  std::mutex mutex_;
  std::condition_variable cv_;
  std::uint64_t generation_ = 0;
  rank_t arrived_ = 0;
  std::size_t blob_ = 0;
  std::vector<char> arrived_flags_;
  std::vector<std::byte> buffers_[2];
};

/// Bootstrap of one thread-rank of a host_fabric.
class host_bootstrap {
public:
  host_bootstrap(host_fabric& fabric, rank_t rank) : fabric_(&fabric), rank_(rank) {
    if (rank < 0 || rank >= fabric.size())
      throw error("host_bootstrap: rank " + std::to_string(rank) + " is not in a fabric of " +
                  std::to_string(fabric.size()));
  }
  rank_t rank() const noexcept { return rank_; }
  rank_t size() const noexcept { return fabric_->size(); }
  void allgather(std::span<const std::byte> mine, std::span<std::byte> all) {
    fabric_->allgather(rank_, mine, all);
  }

private:
  host_fabric* fabric_;
  rank_t rank_;
};

/// Transport of one thread-rank of a host_fabric: memcpy puts, atomic-counter signals. Memory
/// needs no registration (a handle is a pointer and a size); connections have their own counters.
class host_transport {
public:
  struct memory {
    std::byte* ptr = nullptr;
    std::size_t size = 0;
  };
  using remote = memory;
  static constexpr std::size_t handle_bytes = sizeof(std::byte*) + sizeof(std::size_t);
  static constexpr bool can_register(memory_kind k) noexcept { return k == memory_kind::host; }

  /// One rank's connection: puts are copies made before put returns, a signal is a release
  /// increment of the peer's counter, a wait polls it under the transport's wait_policy.
  class connection {
  public:
    void put(rank_t peer, const memory& src, std::size_t src_off, const remote& dst, std::size_t dst_off,
             std::size_t n, channel_id ch) const {
      check(peer, ch, "put");
      if (n == 0) return;
      if (src_off > src.size || n > src.size - src_off || dst_off > dst.size || n > dst.size - dst_off)
        throw error("host_transport: put of " + std::to_string(n) + " bytes from offset " +
                    std::to_string(src_off) + " (of " + std::to_string(src.size) + ") to rank " +
                    std::to_string(peer) + " at offset " + std::to_string(dst_off) + " (of " +
                    std::to_string(dst.size) + ") is out of bounds");
      std::memcpy(dst.ptr + dst_off, src.ptr + src_off, n);
    }
    /// One-sided: the bytes land where the sender puts them.
    void expect(rank_t peer, const memory&, std::size_t, std::size_t, channel_id ch) const { check(peer, ch, "expect"); }
    void signal(rank_t peer, channel_id ch) const {
      check(peer, ch, "signal");
      // Release: the peer's acquire load that sees this count also sees every byte put before.
      counter(peer, rank_, ch).fetch_add(1, std::memory_order_release);
    }
    bool wait(rank_t peer, channel_id ch, std::uint64_t count, std::chrono::milliseconds timeout) const {
      check(peer, ch, "wait");
      auto& c = counter(rank_, peer, ch);
      return detail::poll_until([&] { return c.load(std::memory_order_acquire) >= count; }, waiting_, timeout);
    }
    bool test(rank_t peer, channel_id ch, std::uint64_t count) const {
      check(peer, ch, "test");
      return counter(rank_, peer, ch).load(std::memory_order_acquire) >= count;
    }
    /// Puts are copies made before put returns: they have always left.
    bool sent(rank_t, channel_id, std::uint64_t) const noexcept { return true; }
    void flush() const noexcept {}

  private:
    friend class host_transport;
    connection(std::atomic<std::uint64_t>* counters, rank_t ranks, rank_t rank, channel_id channels, wait_policy w)
        : counters_(counters), ranks_(ranks), rank_(rank), channels_(channels), waiting_(w) {}
    std::atomic<std::uint64_t>& counter(rank_t to, rank_t from, channel_id ch) const noexcept {
      return counters_[(static_cast<std::size_t>(to) * static_cast<std::size_t>(ranks_) + static_cast<std::size_t>(from)) *
                           channels_ + ch];
    }
    void check(rank_t peer, channel_id ch, const char* what) const {
      if (peer < 0 || peer >= ranks_ || ch >= channels_)
        throw error(std::string("host_transport: ") + what + " to rank " + std::to_string(peer) + " on channel " +
                    std::to_string(ch) + ": there are " + std::to_string(ranks_) + " ranks and " +
                    std::to_string(channels_) + " channels");
    }
    std::atomic<std::uint64_t>* counters_;
    rank_t ranks_, rank_;
    channel_id channels_;
    wait_policy waiting_;
  };

  host_transport(host_fabric& fabric, rank_t rank, wait_policy waiting = {})
      : fabric_(&fabric), rank_(rank), waiting_(waiting) {
    if (rank < 0 || rank >= fabric.size())
      throw error("host_transport: rank " + std::to_string(rank) + " is not in a fabric of " +
                  std::to_string(fabric.size()));
  }

  rank_t rank() const noexcept { return rank_; }
  rank_t size() const noexcept { return fabric_->size(); }

  memory register_memory(void* p, std::size_t n) const noexcept { return {static_cast<std::byte*>(p), n}; }
  void deregister(memory&) const noexcept {}

  std::vector<std::byte> serialize(const memory& m) const {
    std::vector<std::byte> out(handle_bytes);
    std::memcpy(out.data(), &m.ptr, sizeof(m.ptr));
    std::memcpy(out.data() + sizeof(m.ptr), &m.size, sizeof(m.size));
    return out;
  }

  remote deserialize(rank_t peer, std::span<const std::byte> blob) const {
    if (blob.size() != handle_bytes)
      throw error("host_transport: rank " + std::to_string(peer) + "'s memory handle has " +
                  std::to_string(blob.size()) + " bytes, expected " + std::to_string(handle_bytes));
    remote r;
    std::memcpy(&r.ptr, blob.data(), sizeof(r.ptr));
    std::memcpy(&r.size, blob.data() + sizeof(r.ptr), sizeof(r.size));
    return r;
  }
  void forget(remote&) const noexcept {}

  /// A connection with its own counters for channels [0, channels). Every rank of the fabric makes
  /// its connections in the same order; the k-th of each meet.
  connection connect(channel_id channels) {
    if (channels < 1) throw error("host_transport: a connection needs at least one channel");
    return connection(fabric_->connect(rank_, channels), fabric_->size(), rank_, channels, waiting_);
  }

private:
  host_fabric* fabric_;
  rank_t rank_;
  wait_policy waiting_;
};

static_assert(Bootstrap<host_bootstrap>);
static_assert(Transport<host_transport>);

} // namespace fasta2a
