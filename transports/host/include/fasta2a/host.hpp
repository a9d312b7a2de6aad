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
#include <shared_mutex>
#include <unordered_map>
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

  /// A registered region of one rank's memory. Puts into it hold it shared; deregistration takes
  /// it exclusively and marks it dead, so that once `revoke` returns no put is copying into it and
  /// none will: a late peer's put fails instead of writing into memory its owner may have freed.
  struct region {
    std::shared_mutex lock;
    bool live = true;
  };

  /// A new live region and its id (unique over the fabric's life).
  std::pair<std::uint64_t, std::shared_ptr<region>> add_region() {
    std::lock_guard l(mutex_);
    const std::uint64_t id = ++region_ids_;
    auto r = std::make_shared<region>();
    regions_.emplace(id, r);
    return {id, r};
  }
  /// The region of `id`, or null once it has been revoked (or never existed).
  std::shared_ptr<region> find_region(std::uint64_t id) {
    std::lock_guard l(mutex_);
    const auto it = regions_.find(id);
    return it == regions_.end() ? nullptr : it->second;
  }
  /// Marks the region dead, after any put copying into it has finished.
  void revoke(std::uint64_t id, region& r) {
    {
      std::unique_lock w(r.lock);
      r.live = false;
    }
    std::lock_guard l(mutex_);
    regions_.erase(id);
  }

  /// Allgather among all ranks of the fabric, into each rank's own `all`. A rank that times out leaves the fabric's bootstrap unusable (it has contributed to a
  /// generation the others may never complete): every later allgather on every rank throws, and
  /// ranks waiting in one wake up and throw (see host_fabric::broken).
  void allgather(rank_t rank, std::span<const std::byte> mine, std::span<std::byte> all) {
    if (all.size() != mine.size() * ranks_)
      throw error("host bootstrap: allgather of " + std::to_string(mine.size()) + " bytes per rank needs " +
                  std::to_string(mine.size() * ranks_) + " bytes, got " + std::to_string(all.size()));
    const auto gathered = allgather_shared(rank, mine);
    if (!all.empty()) std::memcpy(all.data(), gathered->data(), all.size());
  }

  /// Allgather among all ranks of the fabric, every rank handed the same buffer: the threads of
  /// the process hold one copy of the gathered blobs, not one each. Each generation gathers into
  /// a buffer of its own, never written once every rank has arrived; the fabric keeps the last two
  /// (a rank can only start generation g + 2 after every rank has arrived at g + 1, so after it
  /// took generation g's), and the ranks keep theirs as long as they hold them.
  std::shared_ptr<const std::vector<std::byte>> allgather_shared(rank_t rank, std::span<const std::byte> mine) {
    std::unique_lock lock(mutex_);
    if (!broken_.empty())
      throw error("host bootstrap: rank " + std::to_string(rank) + " cannot exchange: the fabric's bootstrap is unusable since " +
                  broken_ + "; make a new host_fabric (and engines on it) on every rank");
    const std::uint64_t gen = generation_;
    auto& buf = buffers_[gen % 2];
    if (arrived_ == 0) {
      blob_ = mine.size();
      buf = std::make_shared<std::vector<std::byte>>(blob_ * ranks_, std::byte{0});
      std::fill(arrived_flags_.begin(), arrived_flags_.end(), 0);
    } else if (mine.size() != blob_) {
      throw error("host bootstrap: rank " + std::to_string(rank) + " contributes " +
                  std::to_string(mine.size()) + " bytes, the others " + std::to_string(blob_));
    }
    // Empty blobs may have no storage: memcpy with a null pointer is undefined even for 0 bytes.
    if (!mine.empty()) std::memcpy(buf->data() + blob_ * rank, mine.data(), mine.size());
    arrived_flags_[rank] = 1;
    if (++arrived_ == ranks_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
    } else if (!cv_.wait_for(lock, timeout_, [&] { return generation_ != gen || !broken_.empty(); })) {
      std::string missing;
      for (rank_t r = 0; r < ranks_; ++r)
        if (!arrived_flags_[r]) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      const std::string what = "host bootstrap: rank " + std::to_string(rank) + " waited " +
                               std::to_string(timeout_.count()) + " ms in allgather; rank(s) " + missing +
                               " never arrived";
      broken_ = "rank " + std::to_string(rank) + " timed out in an allgather (rank(s) " + missing + " never arrived)";
      cv_.notify_all();
      throw timeout_error(what);
    } else if (generation_ == gen) {
      throw timeout_error("host bootstrap: rank " + std::to_string(rank) + "'s allgather was abandoned: " + broken_ +
                          "; make a new host_fabric (and engines on it) on every rank");
    }
    return buf;
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
  std::shared_ptr<std::vector<std::byte>> buffers_[2];
  std::string broken_; ///< why the bootstrap is unusable ("" while it works)
  std::uint64_t region_ids_ = 0;
  std::unordered_map<std::uint64_t, std::shared_ptr<region>> regions_; ///< live regions
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
  /// The same exchange, every thread-rank of the fabric handed one shared buffer
  /// (SharedBootstrap): what the engine uses, so that the threads hold one copy of the counts.
  std::shared_ptr<const std::vector<std::byte>> allgather_shared(std::span<const std::byte> mine) {
    return fabric_->allgather_shared(rank_, mine);
  }

private:
  host_fabric* fabric_;
  rank_t rank_;
};

/// Transport of one thread-rank of a host_fabric: memcpy puts, atomic-counter signals. Memory
/// needs no registration (a handle is a pointer and a size); connections have their own counters.
class host_transport {
public:
  /// A registration: the bytes, and the region that puts into them hold (see host_fabric::region).
  struct memory {
    std::byte* ptr = nullptr;
    std::size_t size = 0;
    std::uint64_t id = 0; ///< the region's id in the fabric (0: not registered)
    std::shared_ptr<host_fabric::region> region;
  };
  /// A peer's registration as a sender sees it: null region once its owner has revoked it.
  using remote = memory;
  static constexpr std::size_t handle_bytes = sizeof(std::byte*) + sizeof(std::size_t) + sizeof(std::uint64_t);
  static constexpr bool can_register(memory_kind k) noexcept { return k == memory_kind::host; }
  /// Deregistration revokes: once `deregister` returns no peer's put is copying into the memory
  /// and any later one fails (fasta2a::error naming the owner) instead of writing.
  static constexpr bool late_writes_revoked = true;

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
      // Shared hold on the destination region: its owner's deregistration waits for this copy
      // and, once it has marked the region dead, no copy starts (a late put fails, never writes).
      if (!dst.region) throw revoked(peer);
      std::shared_lock hold(dst.region->lock);
      if (!dst.region->live) throw revoked(peer);
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
    static error revoked(rank_t peer) {
      return error("host_transport: put to rank " + std::to_string(peer) +
                   ": its memory is no longer registered (its call failed or it released the buffer); nothing was written");
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

  memory register_memory(void* p, std::size_t n) {
    auto [id, region] = fabric_->add_region();
    return {static_cast<std::byte*>(p), n, id, std::move(region)};
  }
  /// Revokes the registration (see late_writes_revoked). Safe on an empty or deregistered memory.
  void deregister(memory& m) {
    if (m.region) fabric_->revoke(m.id, *m.region);
    m = memory{};
  }

  std::vector<std::byte> serialize(const memory& m) const {
    std::vector<std::byte> out(handle_bytes);
    std::memcpy(out.data(), &m.ptr, sizeof(m.ptr));
    std::memcpy(out.data() + sizeof(m.ptr), &m.size, sizeof(m.size));
    std::memcpy(out.data() + sizeof(m.ptr) + sizeof(m.size), &m.id, sizeof(m.id));
    return out;
  }

  /// The peer's registration; one already revoked gives a remote whose puts fail.
  remote deserialize(rank_t peer, std::span<const std::byte> blob) const {
    if (blob.size() != handle_bytes)
      throw error("host_transport: rank " + std::to_string(peer) + "'s memory handle has " +
                  std::to_string(blob.size()) + " bytes, expected " + std::to_string(handle_bytes));
    remote r;
    std::memcpy(&r.ptr, blob.data(), sizeof(r.ptr));
    std::memcpy(&r.size, blob.data() + sizeof(r.ptr), sizeof(r.size));
    std::memcpy(&r.id, blob.data() + sizeof(r.ptr) + sizeof(r.size), sizeof(r.id));
    r.region = fabric_->find_region(r.id);
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

static_assert(SharedBootstrap<host_bootstrap>);
static_assert(Transport<host_transport>);

} // namespace fasta2a
