// fasta2a GPU IPC transport (scale-up): the ranks are GPUs of one server, each in its own process
// (or, with the stand-in runtime, its own thread). Registered memory is device memory whose IPC
// handle peers open once and keep mapped; a put is an asynchronous copy on the transport's stream
// into the peer's mapping; a signal is a 64-bit counter written, in stream order after the puts,
// into the peer's flag slot (a device allocation per connection that every peer maps). The host
// runner waits by polling its own flags. Depends on the GPU runtime through gpu_runtime.hpp.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "fasta2a/gpu_runtime.hpp"
#include "fasta2a/transport.hpp"

namespace fasta2a {

/// Options of a gpu_ipc_transport.
struct gpu_ipc_options {
  wait_policy waiting{};
  /// Ranks per server: rank r reaches the ranks r' with r' / node_ranks == r / node_ranks (their
  /// memory and flags are opened); 0: every rank of the bootstrap.
  rank_t node_ranks = 0;
};

/// The transport of one rank. B is the bootstrap used by connect() to exchange the flags' handles
/// (the Transport concept's connect takes none; connect is collective anyway). It must outlive the
/// transport. The stream carries every put and signal of every connection; share it with the
/// engine's gpu_memory so that puts are ordered after the local copies before them.
template <Bootstrap B>
class gpu_ipc_transport {
public:
  /// A registration: [ptr, ptr+size) inside the allocation of `handle`, at `offset` from its base.
  struct memory {
    std::byte* ptr = nullptr;
    std::size_t size = 0;
    gpu::ipc_handle_t handle{};
    std::size_t offset = 0;
    bool empty = true;
  };
  /// A peer's registration, mapped here (ptr is where its bytes are in this process).
  struct remote {
    std::byte* ptr = nullptr;
    std::size_t size = 0;
    std::string key; ///< the opened mapping this uses ("" if none)
  };
  static constexpr std::size_t handle_bytes = sizeof(gpu::ipc_handle_t) + 4 * sizeof(std::uint64_t);
  /// Device memory; host memory only with the stand-in runtime's in-process handles (tests).
  static constexpr bool can_register(memory_kind k) noexcept {
    return k == gpu::device_kind || (gpu::host_memory_ipc && k == memory_kind::host);
  }

  class connection;

  /// Throws fasta2a::error if there is no stream or node_ranks does not divide the ranks.
  gpu_ipc_transport(B& boot, std::shared_ptr<gpu::stream> s = nullptr, gpu_ipc_options opt = {})
      : boot_(&boot), s_(s ? std::move(s) : std::make_shared<gpu::stream>()), opt_(opt) {
    const rank_t n = boot.size();
    if (opt_.node_ranks == 0) opt_.node_ranks = n;
    if (opt_.node_ranks < 1 || n % opt_.node_ranks != 0)
      throw error("gpu_ipc_transport: " + std::to_string(opt_.node_ranks) + " ranks per node do not divide " +
                  std::to_string(n) + " ranks");
  }
  gpu_ipc_transport(const gpu_ipc_transport&) = delete;
  gpu_ipc_transport& operator=(const gpu_ipc_transport&) = delete;
  ~gpu_ipc_transport() {
    for (auto& [key, m] : opened_) gpu::ipc_close(m.base);
  }

  rank_t rank() const { return boot_->rank(); }
  rank_t size() const { return boot_->size(); }
  gpu::stream_t stream() const noexcept { return s_->get(); }
  /// Whether rank r's memory can be opened here (same node).
  bool reaches(rank_t r) const noexcept { return r / opt_.node_ranks == rank() / opt_.node_ranks; }

  /// Throws fasta2a::error if [p, p+n) is not inside one device allocation of this process (with
  /// the runtime's reason).
  memory register_memory(void* p, std::size_t n) {
    memory m;
    m.ptr = static_cast<std::byte*>(p);
    m.size = n;
    if (!p || n == 0) return m; // nothing to map: a peer's puts into it are all empty
    void* base = nullptr;
    std::size_t len = 0;
    if (gpu::address_range(p, &base, &len)) {
      m.offset = static_cast<std::size_t>(m.ptr - static_cast<std::byte*>(base));
      if (m.offset + n > len)
        throw error("gpu_ipc_transport: [" + std::to_string(m.offset) + ", +" + std::to_string(n) +
                    ") runs past its device allocation of " + std::to_string(len) + " bytes");
    } else {
      base = p; // not device memory: only the stand-in's in-process host handles can take it
    }
    try {
      m.handle = gpu::ipc_get_handle(base);
    } catch (const error& e) {
      throw error(std::string("gpu_ipc_transport: cannot register ") + std::to_string(n) +
                  " bytes: not device memory from this process's allocator (" + e.what() + ")");
    }
    m.empty = false;
    return m;
  }
  void deregister(memory& m) noexcept { m = memory{}; }
  /// A peer that opened this rank's IPC handle keeps its mapping: the exporter cannot revoke it, so
  /// a late peer can still write (see engine: keep buffers alive until every rank has returned).
  static constexpr bool late_writes_revoked = false;

  std::vector<std::byte> serialize(const memory& m) const {
    std::vector<std::byte> out(handle_bytes);
    const std::uint64_t words[4] = {m.offset, m.size, reinterpret_cast<std::uintptr_t>(m.ptr), m.empty ? 1u : 0u};
    std::memcpy(out.data(), &m.handle, sizeof m.handle);
    std::memcpy(out.data() + sizeof m.handle, words, sizeof words);
    return out;
  }

  /// Opens the peer's allocation (once per allocation, reference-counted); this rank's own handle
  /// resolves to its own pointer. Throws fasta2a::error for a rank on another node or a handle that
  /// does not open.
  remote deserialize(rank_t peer, std::span<const std::byte> blob) {
    if (blob.size() != handle_bytes)
      throw error("gpu_ipc_transport: rank " + std::to_string(peer) + "'s memory handle has " +
                  std::to_string(blob.size()) + " bytes, expected " + std::to_string(handle_bytes));
    gpu::ipc_handle_t h;
    std::uint64_t words[4];
    std::memcpy(&h, blob.data(), sizeof h);
    std::memcpy(words, blob.data() + sizeof h, sizeof words);
    remote r;
    r.size = static_cast<std::size_t>(words[1]);
    if (words[3]) return r;
    if (peer == rank()) {
      r.ptr = reinterpret_cast<std::byte*>(static_cast<std::uintptr_t>(words[2]));
      return r;
    }
    if (!reaches(peer))
      throw error("gpu_ipc_transport: rank " + std::to_string(peer) + " is not on rank " + std::to_string(rank()) +
                  "'s node (" + std::to_string(opt_.node_ranks) + " ranks per node)");
    r.key.assign(reinterpret_cast<const char*>(&h), sizeof h);
    auto it = opened_.find(r.key);
    if (it == opened_.end()) {
      void* base = nullptr;
      try {
        base = gpu::ipc_open(h);
      } catch (const error& e) {
        throw error("gpu_ipc_transport: cannot open rank " + std::to_string(peer) + "'s memory: " + e.what());
      }
      it = opened_.emplace(r.key, mapping{base, 0}).first;
    }
    ++it->second.users;
    r.ptr = static_cast<std::byte*>(it->second.base) + words[0];
    return r;
  }
  /// Closes the peer's mapping when no remote uses it any more.
  void forget(remote& r) noexcept {
    if (!r.key.empty()) {
      auto it = opened_.find(r.key);
      if (it != opened_.end() && --it->second.users == 0) {
        gpu::ipc_close(it->second.base);
        opened_.erase(it);
      }
    }
    r = remote{};
  }

  /// A connection with its own flags for channels [0, channels): collective over the bootstrap's
  /// ranks (it allgathers the flags' handles), made in the same order on every rank.
  connection connect(channel_id channels) {
    if (channels < 1) throw error("gpu_ipc_transport: a connection needs at least one channel");
    return connection(*this, channels);
  }

private:
  struct mapping {
    void* base;
    long users;
  };
  B* boot_;
  std::shared_ptr<gpu::stream> s_;
  gpu_ipc_options opt_;
  std::map<std::string, mapping> opened_;
};

/// One rank's connection. Flags: ranks x channels 64-bit counters in a device allocation, slot
/// (sender, channel) written by that sender with its running count of signals.
template <Bootstrap B>
class gpu_ipc_transport<B>::connection {
public:
  connection(connection&&) noexcept = default;
  connection& operator=(connection&&) noexcept = default;
  ~connection() {
    if (!st_) return;
    try {
      st_->t->s_->synchronize(); // nothing of ours may still write into a peer's flags
    } catch (...) {
    }
    for (void* p : st_->opened) gpu::ipc_close(p);
  }

  void put(rank_t peer, const memory& src, std::size_t src_off, const remote& dst, std::size_t dst_off, std::size_t n,
           channel_id ch) {
    check(peer, ch, "put");
    if (n == 0) return;
    if (src_off > src.size || n > src.size - src_off || dst_off > dst.size || n > dst.size - dst_off || !dst.ptr)
      throw error("gpu_ipc_transport: put of " + std::to_string(n) + " bytes from offset " + std::to_string(src_off) +
                  " (of " + std::to_string(src.size) + ") to rank " + std::to_string(peer) + " at offset " +
                  std::to_string(dst_off) + " (of " + std::to_string(dst.size) + ") is out of bounds");
    gpu::memcpy_async(dst.ptr + dst_off, src.ptr + src_off, n, st_->t->stream());
  }
  /// One-sided: the bytes land where the sender puts them.
  void expect(rank_t peer, const memory&, std::size_t, std::size_t, channel_id ch) const { check(peer, ch, "expect"); }

  /// The peer's flag for (this rank, ch) becomes this connection's count of signals to it there,
  /// written on the transport's stream after every put enqueued before.
  void signal(rank_t peer, channel_id ch) {
    check(peer, ch, "signal");
    std::uint64_t* flag = st_->peer_flags[static_cast<std::size_t>(peer)];
    if (!flag)
      throw error("gpu_ipc_transport: signal to rank " + std::to_string(peer) + ", which is not on this node");
    const std::size_t k = slot(peer, ch);
    const std::uint64_t v = ++st_->signalled[k];
    gpu::write_value64(st_->t->stream(), flag + slot(st_->me, ch), v);
    // An event of the connection's ring marks when the copies before this signal are done. Never
    // a new event here: creating one takes the driver's context lock for writing, which a caller
    // thread blocked in a copy to pageable memory (waiting for its stream, i.e. for this call)
    // holds for reading: the first real-GPU runs deadlocked exactly so (cuEventCreate inside
    // signal). When every event of the ring is still pending, wait for the oldest: it is on the
    // transport's own stream, which depends on nothing the caller holds.
    state& st = *st_;
    reap();
    if (st.queued == st.ring.size()) {
      if (!detail::poll_until([&] { return st.ring[st.head].done(); }, st.t->opt_.waiting, ring_wait))
        throw timeout_error("gpu_ipc_transport: the transport's stream completed no copy within " +
                            std::to_string(ring_wait.count()) + " ms (" + std::to_string(st.ring.size()) +
                            " signals outstanding)");
      reap();
    }
    const std::size_t at = (st.head + st.queued) % st.ring.size();
    st.ring[at].record(st.t->stream());
    st.ring_slot[at] = k;
    st.ring_count[at] = v;
    ++st.queued;
    ++st.outstanding[k];
  }

  bool wait(rank_t peer, channel_id ch, std::uint64_t count, std::chrono::milliseconds timeout) {
    check(peer, ch, "wait");
    return detail::poll_until([&] { return reached(peer, ch, count); }, st_->t->opt_.waiting, timeout);
  }
  bool test(rank_t peer, channel_id ch, std::uint64_t count) {
    check(peer, ch, "test");
    return reached(peer, ch, count);
  }
  /// Whether the copies before the count-th signal to peer on ch have completed (an event per signal).
  bool sent(rank_t peer, channel_id ch, std::uint64_t count) {
    check(peer, ch, "sent");
    const std::size_t k = slot(peer, ch);
    reap();
    if (st_->outstanding[k] == 0) st_->left[k] = st_->signalled[k];
    return st_->left[k] >= count;
  }
  /// Every put and signal enqueued so far has completed.
  void flush() {
    st_->t->s_->synchronize();
  }

private:
  friend class gpu_ipc_transport;
  struct state {
    gpu_ipc_transport* t;
    rank_t ranks, me;
    channel_id channels;
    gpu::device_buffer flags;
    std::vector<std::uint64_t*> peer_flags; ///< each peer's flags mapped here (null: not reachable)
    std::vector<void*> opened;
    std::vector<std::uint64_t> signalled, left; ///< per (peer, channel)
    // Signals whose copies may still be running, oldest first, in a ring of events made once
    // (they complete in this order: one stream): the slot and count each covers.
    std::vector<gpu::event> ring;
    std::vector<std::size_t> ring_slot;
    std::vector<std::uint64_t> ring_count;
    std::size_t head = 0, queued = 0;
    std::vector<std::size_t> outstanding; ///< per (peer, channel): its signals in the ring
    gpu::stream poll;         ///< reads of the flags on a real device
    // The flags of this node's ranks (the only ones that can signal here) as last read, all in one
    // copy: per (node rank, channel). A flag only grows, so a value read once stays a lower bound:
    // a test it answers needs no read, and one read answers the tests of every flag that arrived
    // (on a device each read is a copy and a synchronize).
    rank_t node_first = 0, node_ranks = 0;
    std::vector<std::uint64_t> seen;
    gpu::pinned_buffer snapshot; ///< where a read lands (pinned: see gpu::read_value64)
  };

  connection(gpu_ipc_transport& t, channel_id channels) : st_(std::make_unique<state>()) {
    state& s = *st_;
    s.t = &t;
    s.ranks = t.size();
    s.me = t.rank();
    s.channels = channels;
    const std::size_t slots = static_cast<std::size_t>(s.ranks) * channels;
    s.flags = gpu::device_buffer(slots * sizeof(std::uint64_t));
    {
      const std::vector<std::uint64_t> zero(slots, 0);
      gpu::memcpy_async(s.flags.data(), zero.data(), slots * sizeof(std::uint64_t), t.stream());
      t.s_->synchronize(); // zero before any peer can see the handle
    }
    s.signalled.assign(slots, 0);
    s.left.assign(slots, 0);
    s.node_ranks = t.opt_.node_ranks;
    s.node_first = s.me / s.node_ranks * s.node_ranks;
    s.seen.assign(static_cast<std::size_t>(s.node_ranks) * channels, 0);
    s.snapshot = gpu::pinned_buffer(s.seen.size() * sizeof(std::uint64_t));
    s.outstanding.assign(slots, 0);
    s.ring.resize(ring_events);
    s.ring_slot.assign(ring_events, 0);
    s.ring_count.assign(ring_events, 0);
    // Every rank's flags handle, then map the reachable peers' flags.
    const memory mine = t.register_memory(s.flags.data(), s.flags.size());
    const std::vector<std::byte> blob = t.serialize(mine);
    std::vector<std::byte> all(handle_bytes * static_cast<std::size_t>(s.ranks));
    t.boot_->allgather(blob, all);
    s.peer_flags.assign(static_cast<std::size_t>(s.ranks), nullptr);
    for (rank_t r = 0; r < s.ranks; ++r) {
      if (r == s.me) {
        s.peer_flags[static_cast<std::size_t>(r)] = reinterpret_cast<std::uint64_t*>(s.flags.data());
        continue;
      }
      if (!t.reaches(r)) continue;
      gpu::ipc_handle_t h;
      std::uint64_t words[4];
      std::memcpy(&h, all.data() + handle_bytes * static_cast<std::size_t>(r), sizeof h);
      std::memcpy(words, all.data() + handle_bytes * static_cast<std::size_t>(r) + sizeof h, sizeof words);
      void* base = gpu::ipc_open(h);
      s.opened.push_back(base);
      s.peer_flags[static_cast<std::size_t>(r)] = reinterpret_cast<std::uint64_t*>(static_cast<std::byte*>(base) + words[0]);
    }
  }

  /// Events per connection, made when it is, and how long a signal waits for the oldest.
  static constexpr std::size_t ring_events = 256;
  static constexpr std::chrono::milliseconds ring_wait{60000};

  std::size_t slot(rank_t r, channel_id ch) const noexcept {
    return static_cast<std::size_t>(r) * st_->channels + ch;
  }
  // Retires the ring's completed events, oldest first.
  void reap() {
    state& st = *st_;
    while (st.queued > 0 && st.ring[st.head].done()) {
      const std::size_t k = st.ring_slot[st.head];
      st.left[k] = st.ring_count[st.head];
      --st.outstanding[k];
      st.head = (st.head + 1) % st.ring.size();
      --st.queued;
    }
  }
  // Whether peer's flag on ch has reached count: from the last read where that says so, else
  // after reading every flag of the node again. A rank on another node never signals here.
  bool reached(rank_t peer, channel_id ch, std::uint64_t count) {
    state& st = *st_;
    if (peer < st.node_first || peer >= st.node_first + st.node_ranks) return count == 0;
    const std::size_t k = static_cast<std::size_t>(peer - st.node_first) * st.channels + ch;
    if (st.seen[k] >= count) return true;
    auto* got = reinterpret_cast<std::uint64_t*>(st.snapshot.data());
    gpu::read_values64(reinterpret_cast<const std::uint64_t*>(st.flags.data()) + slot(st.node_first, 0), st.seen.size(),
                       st.poll.get(), got);
    for (std::size_t i = 0; i < st.seen.size(); ++i) st.seen[i] = std::max(st.seen[i], got[i]);
    return st.seen[k] >= count;
  }
  void check(rank_t peer, channel_id ch, const char* what) const {
    if (peer < 0 || peer >= st_->ranks || ch >= st_->channels)
      throw error(std::string("gpu_ipc_transport: ") + what + " to rank " + std::to_string(peer) + " on channel " +
                  std::to_string(ch) + ": there are " + std::to_string(st_->ranks) + " ranks and " +
                  std::to_string(st_->channels) + " channels");
  }

  std::unique_ptr<state> st_;
};

} // namespace fasta2a
