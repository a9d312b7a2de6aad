// fasta2a: what one-sided RDMA transports (libfabric, libibverbs) share besides the calls into
// their libraries: signal encodings (64 bits of remote CQ data, a 32-bit immediate), chunking of
// puts at a largest message, completion accounting (watermarks over numbered operations, signals
// waiting for the puts they cover) and connection bookkeeping (per-connection, per-(peer,
// channel) lanes and arrived-signal counters, kept even for a connection not made yet here),
// registered memory and the handles peers exchange (address, key, size), and the connection
// class both transports hand out (rma::connection<Transport>, forwarding to its transport).
// Depends on nothing but the standard library and fasta2a/transport.hpp, so it is tested on any
// machine (tests/test_rma.cpp) and used by transports that run only where an RDMA NIC is.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fasta2a/common.hpp"
#include "fasta2a/transport.hpp"

namespace fasta2a::rma {

// ------------------------------------------------------------------------------------------------
// Signal encodings
// ------------------------------------------------------------------------------------------------

/// What a signal says: who sent it, on which connection and channel, and (where the encoding has
/// room) its number on that (connection, channel) modulo the sequence field's range.
struct signal_fields {
  rank_t from = 0;
  std::uint32_t conn = 0;
  channel_id ch = 0;
  std::uint32_t seq = 0;
  bool operator==(const signal_fields&) const = default;
};

/// 64 bits of remote CQ data (libfabric): sender rank (24 bits), connection (16), channel (24).
/// No sequence: the receiver counts arrivals.
struct code64 {
  static constexpr unsigned rank_bits = 24, conn_bits = 16, channel_bits = 24;
  static constexpr std::uint64_t max_ranks = std::uint64_t{1} << rank_bits;
  static constexpr std::uint64_t max_connections = std::uint64_t{1} << conn_bits;
  static constexpr std::uint64_t max_channels = std::uint64_t{1} << channel_bits;

  /// Throws fasta2a::error naming the field that does not fit.
  static std::uint64_t encode(rank_t from, std::uint32_t conn, channel_id ch) {
    if (from < 0 || static_cast<std::uint64_t>(from) >= max_ranks)
      throw error("rma::code64: rank " + std::to_string(from) + " does not fit in " + std::to_string(rank_bits) + " bits");
    if (conn >= max_connections)
      throw error("rma::code64: connection " + std::to_string(conn) + " does not fit in " + std::to_string(conn_bits) + " bits");
    if (ch >= max_channels)
      throw error("rma::code64: channel " + std::to_string(ch) + " does not fit in " + std::to_string(channel_bits) + " bits");
    return (static_cast<std::uint64_t>(from) << (conn_bits + channel_bits)) | (static_cast<std::uint64_t>(conn) << channel_bits) | ch;
  }
  static signal_fields decode(std::uint64_t data) noexcept {
    signal_fields f;
    f.from = static_cast<rank_t>(data >> (conn_bits + channel_bits));
    f.conn = static_cast<std::uint32_t>((data >> channel_bits) & (max_connections - 1));
    f.ch = static_cast<channel_id>(data & (max_channels - 1));
    return f;
  }
};

/// A 32-bit immediate (libibverbs RDMA write with immediate): connection (12 bits), channel (8),
/// sequence (12). The sender needs no field: a reliable-connected queue pair links two ranks, so
/// the receiver knows the sender from the queue pair the completion arrived on. The sequence is
/// the signal's number on its (connection, channel) to that peer, from 1, modulo 4096: the
/// receiver checks it against its own count, so that a signal lost or delivered twice is an
/// error and never a wrong count. Limits: 4096 connections over a transport's life, 256 channels.
struct imm32 {
  static constexpr unsigned conn_bits = 12, channel_bits = 8, seq_bits = 12;
  static constexpr std::uint32_t max_connections = std::uint32_t{1} << conn_bits;
  static constexpr std::uint32_t max_channels = std::uint32_t{1} << channel_bits;
  static constexpr std::uint32_t seq_modulus = std::uint32_t{1} << seq_bits;
  static_assert(conn_bits + channel_bits + seq_bits == 32);

  /// `seq` is taken modulo 4096. Throws fasta2a::error naming the field that does not fit.
  static std::uint32_t encode(std::uint32_t conn, channel_id ch, std::uint64_t seq) {
    if (conn >= max_connections)
      throw error("rma::imm32: connection " + std::to_string(conn) + " does not fit in " + std::to_string(conn_bits) +
                  " bits (at most " + std::to_string(max_connections) + " connections per transport)");
    if (ch >= max_channels)
      throw error("rma::imm32: channel " + std::to_string(ch) + " does not fit in " + std::to_string(channel_bits) +
                  " bits (at most " + std::to_string(max_channels) + " channels)");
    return (conn << (channel_bits + seq_bits)) | (ch << seq_bits) | static_cast<std::uint32_t>(seq % seq_modulus);
  }
  static signal_fields decode(std::uint32_t imm, rank_t from) noexcept {
    signal_fields f;
    f.from = from;
    f.conn = imm >> (channel_bits + seq_bits);
    f.ch = (imm >> seq_bits) & (max_channels - 1);
    f.seq = imm & (seq_modulus - 1);
    return f;
  }
  /// The sequence field of the `count`-th signal (count from 1).
  static constexpr std::uint32_t seq_of(std::uint64_t count) noexcept { return static_cast<std::uint32_t>(count % seq_modulus); }
};

// ------------------------------------------------------------------------------------------------
// Chunking
// ------------------------------------------------------------------------------------------------

/// How many writes of at most `max` bytes a put of n bytes takes (0 for n = 0). Throws
/// fasta2a::error if max is 0.
inline std::size_t chunk_count(std::size_t n, std::size_t max) {
  if (max == 0) throw error("rma::chunk_count: the largest write is 0 bytes");
  return n / max + (n % max != 0);
}

/// Calls f(offset, length) for each chunk of a put of n bytes cut at `max`, in order: every
/// chunk but the last has `max` bytes, the lengths sum to n, nothing for n = 0.
template <class F>
void for_each_chunk(std::size_t n, std::size_t max, F&& f) {
  if (max == 0) throw error("rma::for_each_chunk: the largest write is 0 bytes");
  for (std::size_t off = 0; off < n; off += max) f(off, n - off < max ? n - off : max);
}

// ------------------------------------------------------------------------------------------------
// Completion accounting
// ------------------------------------------------------------------------------------------------

/// Operations numbered 1, 2, ... as they are posted; `done()` is the largest k such that 1..k
/// have all completed. Completions may come one at a time in any order (`complete`: a libfabric
/// completion queue) or cumulatively (`complete_upto`: a verbs send queue, whose completion of a
/// signalled work request means every earlier one on that queue has completed).
class watermark {
public:
  /// The number the next posted operation gets.
  std::uint64_t next() const noexcept { return posted_ + 1; }
  /// Counts one operation as posted; returns its number.
  std::uint64_t post() noexcept { return ++posted_; }
  /// Operation `seq` completed. Throws fasta2a::error if it was never posted or already counted.
  void complete(std::uint64_t seq) {
    if (seq == 0 || seq > posted_ || seq <= done_ || ahead_.count(seq) != 0)
      throw error("rma::watermark: completion of operation " + std::to_string(seq) + " (posted " + std::to_string(posted_) +
                  ", done up to " + std::to_string(done_) + ") is not of an operation in flight");
    if (seq != done_ + 1) {
      ahead_.insert(seq);
      return;
    }
    ++done_;
    while (!ahead_.empty() && *ahead_.begin() == done_ + 1) {
      ahead_.erase(ahead_.begin());
      ++done_;
    }
  }
  /// Operations 1..seq completed (seq at or below done() changes nothing). Throws fasta2a::error
  /// if seq was never posted.
  void complete_upto(std::uint64_t seq) {
    if (seq > posted_)
      throw error("rma::watermark: completion up to operation " + std::to_string(seq) + " but only " +
                  std::to_string(posted_) + " posted");
    if (seq <= done_) return;
    done_ = seq;
    while (!ahead_.empty() && *ahead_.begin() <= done_) ahead_.erase(ahead_.begin());
    while (!ahead_.empty() && *ahead_.begin() == done_ + 1) {
      ahead_.erase(ahead_.begin());
      ++done_;
    }
  }
  std::uint64_t posted() const noexcept { return posted_; }
  std::uint64_t done() const noexcept { return done_; }
  /// Posted and not completed.
  std::uint64_t in_flight() const noexcept { return posted_ - done_ - ahead_.size(); }
  bool idle() const noexcept { return done_ == posted_; }

private:
  std::uint64_t posted_ = 0, done_ = 0;
  std::set<std::uint64_t> ahead_; ///< completed past done_
};

/// The signals of one (connection, peer, channel), outbound: each covers the puts posted before
/// it, which complete when a watermark (the lane's, or the queue pair's) reaches its `need`.
/// A signal is either handed to the network at once (ordered behind its puts by the network) or
/// deferred until its puts have completed (posted by `post_due`). `sent_upto()` is the largest
/// count such that signals 1..count are posted and their puts complete: what `sent` reads.
class signal_track {
public:
  /// Records signal number signals()+1, covering operations up to `need`; `posted` says whether
  /// it was already handed to the network. `done` is the watermark now. Returns its number.
  std::uint64_t add(std::uint64_t need, bool posted, std::uint64_t done) {
    const std::uint64_t index = ++signals_;
    if (posted && need <= done && waiting_.empty()) sent_upto_ = index;
    else {
      waiting_.push_back({index, need, posted});
      deferred_ += !posted;
    }
    return index;
  }
  /// The watermark reached `done`: signals already posted whose puts are complete are sent.
  void settle(std::uint64_t done) {
    while (!waiting_.empty() && waiting_.front().posted && waiting_.front().need <= done) {
      sent_upto_ = waiting_.front().index;
      waiting_.pop_front();
    }
  }
  /// Posts deferred signals whose puts are complete, in order, with `post(index)`, which returns
  /// false when the network is busy (then this stops; call again later). Returns how many it
  /// posted.
  template <class Post>
  std::uint64_t post_due(std::uint64_t done, Post&& post) {
    settle(done);
    std::uint64_t n = 0;
    while (!waiting_.empty() && !waiting_.front().posted && waiting_.front().need <= done) {
      if (!post(waiting_.front().index)) break;
      sent_upto_ = waiting_.front().index;
      waiting_.pop_front();
      --deferred_;
      ++n;
      settle(done);
    }
    return n;
  }
  std::uint64_t signals() const noexcept { return signals_; }
  std::uint64_t sent_upto() const noexcept { return sent_upto_; }
  /// Signals not yet posted.
  std::uint64_t deferred() const noexcept { return deferred_; }
  /// Whether every signal is posted and complete.
  bool idle() const noexcept { return waiting_.empty(); }

private:
  struct pending {
    std::uint64_t index, need;
    bool posted;
  };
  std::uint64_t signals_ = 0, sent_upto_ = 0, deferred_ = 0;
  std::deque<pending> waiting_;
};

// ------------------------------------------------------------------------------------------------
// Connection bookkeeping
// ------------------------------------------------------------------------------------------------

/// What a libfabric-like transport keeps per (connection, peer, channel): its puts' watermark
/// and its signals.
struct lane {
  watermark puts;
  signal_track signals;
};

/// The connections of one transport: per connection its channel count, a Lane per (peer,
/// channel), arrived-signal counters per (peer, channel), operations in flight. Connection ids
/// are 0, 1, ... in the order `make` is called (the same on every rank), so a signal names its
/// connection by id; one that arrives for a connection not made here yet is counted all the
/// same and found when it is made. `who` prefixes every error ("verbs_transport").
template <class Lane = lane>
class connection_table {
public:
  struct conn {
    channel_id channels = 0;                         ///< 0 until made here
    std::vector<Lane> lanes;                         ///< [peer * channels + channel]
    std::vector<std::vector<std::uint64_t>> arrived; ///< [peer][channel] signals received
    std::uint64_t outstanding = 0;                   ///< operations posted, not completed
  };

  connection_table(std::string who, rank_t ranks, std::uint64_t max_connections, std::uint64_t max_channels)
      : who_(std::move(who)), ranks_(ranks), max_connections_(max_connections), max_channels_(max_channels) {}

  /// A new connection with `channels` channels; returns its id. Throws fasta2a::error naming the
  /// limit that is exceeded.
  std::uint32_t make(channel_id channels) {
    if (channels < 1 || channels > max_channels_)
      throw error(who_ + "::connect: " + std::to_string(channels) + " channels (from 1 to " + std::to_string(max_channels_) + ")");
    if (made_ >= max_connections_)
      throw error(who_ + "::connect: more than " + std::to_string(max_connections_) + " connections on one transport");
    const auto id = static_cast<std::uint32_t>(made_++);
    conn& c = state(id);
    c.channels = channels;
    c.lanes.resize(static_cast<std::size_t>(ranks_) * channels);
    for (auto& a : c.arrived)
      if (a.size() < channels) a.resize(channels, 0);
    return id;
  }

  /// Throws fasta2a::error (`what` to rank `peer` on channel `ch`) unless connection id is made
  /// and peer and channel are in range.
  void check(std::uint32_t id, rank_t peer, channel_id ch, const char* what) const {
    const channel_id channels = id < conns_.size() ? conns_[id].channels : 0;
    if (id >= made_ || peer < 0 || peer >= ranks_ || ch >= channels)
      throw error(who_ + ": " + what + " to rank " + std::to_string(peer) + " on channel " + std::to_string(ch) +
                  " of connection " + std::to_string(id) + ": there are " + std::to_string(ranks_) + " ranks and " +
                  std::to_string(channels) + " channels");
  }

  Lane& lane_of(std::uint32_t id, rank_t peer, channel_id ch) { return conns_[id].lanes[index(id, peer, ch)]; }
  std::size_t index(std::uint32_t id, rank_t peer, channel_id ch) const {
    return static_cast<std::size_t>(peer) * conns_[id].channels + ch;
  }
  conn& at(std::uint32_t id) { return conns_[id]; }
  const conn& at(std::uint32_t id) const { return conns_[id]; }
  /// Connections made here.
  std::uint32_t made() const noexcept { return static_cast<std::uint32_t>(made_); }
  /// Connections with state (made here, or signalled by a peer already).
  std::uint32_t known() const noexcept { return static_cast<std::uint32_t>(conns_.size()); }

  /// One signal arrived from `from` on (conn, ch); returns that counter's new value. Throws
  /// fasta2a::error if the sender, connection or channel cannot be (a corrupt or foreign signal).
  std::uint64_t arrive(std::uint32_t id, rank_t from, channel_id ch) {
    if (from < 0 || from >= ranks_)
      throw error(who_ + ": a signal claims to come from rank " + std::to_string(from) + " of " + std::to_string(ranks_));
    if (id >= max_connections_ || ch >= max_channels_)
      throw error(who_ + ": a signal from rank " + std::to_string(from) + " names connection " + std::to_string(id) +
                  " and channel " + std::to_string(ch) + ", beyond the limits");
    auto& counts = state(id).arrived[static_cast<std::size_t>(from)];
    if (counts.size() <= ch) counts.resize(ch + 1, 0);
    return ++counts[ch];
  }
  /// Signals arrived from peer on (conn, ch).
  std::uint64_t arrived(std::uint32_t id, rank_t peer, channel_id ch) const {
    if (id >= conns_.size()) return 0;
    const auto& counts = conns_[id].arrived[static_cast<std::size_t>(peer)];
    return ch < counts.size() ? counts[ch] : 0;
  }

  /// Operations in flight over every connection.
  std::uint64_t outstanding() const noexcept {
    std::uint64_t n = 0;
    for (const conn& c : conns_) n += c.outstanding;
    return n;
  }

private:
  conn& state(std::uint32_t id) {
    while (conns_.size() <= id) {
      conns_.emplace_back();
      conns_.back().arrived.resize(static_cast<std::size_t>(ranks_));
    }
    return conns_[id];
  }

  std::string who_;
  rank_t ranks_;
  std::uint64_t max_connections_, max_channels_;
  std::uint64_t made_ = 0;
  std::deque<conn> conns_; ///< by id; stable references
};

// ------------------------------------------------------------------------------------------------
// Registered memory and handles
// ------------------------------------------------------------------------------------------------

/// Local memory: the region and its registration. `Registration` is the library's registration
/// object (fid_mr, ibv_mr); `local` is what a local operation names the registration by (a
/// libfabric descriptor, a verbs lkey); `key` is the remote key a peer writes with.
template <class Registration, class Local>
struct memory {
  std::byte* ptr = nullptr;
  std::size_t size = 0;
  Registration* mr = nullptr;
  Local local{};
  std::uint64_t key = 0;
};

/// A peer's registered region: where writes go (addr + offset: a virtual address, or 0 where the
/// library takes offsets), its remote key and size, and whose it is.
struct remote {
  std::uint64_t addr = 0;
  std::uint64_t key = 0;
  std::size_t size = 0;
  rank_t peer = -1;
};

/// A serialized handle: address, key and size, 8 bytes each (native byte order: the ranks of one
/// job share an architecture).
inline constexpr std::size_t handle_bytes = 24;

/// The handle of a region at `addr` (as peers address it) with remote key `key` and `size` bytes.
inline std::vector<std::byte> serialize_handle(std::uint64_t addr, std::uint64_t key, std::size_t size) {
  const std::uint64_t words[3] = {addr, key, static_cast<std::uint64_t>(size)};
  std::vector<std::byte> blob(handle_bytes);
  std::memcpy(blob.data(), words, handle_bytes);
  return blob;
}

/// Reads rank `peer`'s handle. Throws fasta2a::error, prefixed with `who`
/// ("libfabric_transport"), if peer is not among `ranks` or the blob is not handle_bytes long.
inline remote deserialize_handle(std::string_view who, rank_t peer, rank_t ranks, std::span<const std::byte> blob) {
  if (peer < 0 || peer >= ranks)
    throw error(std::string(who) + "::deserialize: rank " + std::to_string(peer) + " is not among " + std::to_string(ranks));
  if (blob.size() != handle_bytes)
    throw error(std::string(who) + "::deserialize: rank " + std::to_string(peer) + "'s handle has " +
                std::to_string(blob.size()) + " bytes, expected " + std::to_string(handle_bytes));
  std::uint64_t words[3];
  std::memcpy(words, blob.data(), handle_bytes);
  return remote{words[0], words[1], static_cast<std::size_t>(words[2]), peer};
}

/// Throws fasta2a::error, prefixed with `who`, unless n bytes from src_off fit in a source of
/// src_size bytes and from dst_off in a destination of dst_size bytes (a put to rank `peer`).
inline void check_put_bounds(std::string_view who, rank_t peer, std::size_t src_off, std::size_t src_size,
                             std::size_t dst_off, std::size_t dst_size, std::size_t n) {
  if (src_off > src_size || n > src_size - src_off || dst_off > dst_size || n > dst_size - dst_off)
    throw error(std::string(who) + ": put of " + std::to_string(n) + " bytes from offset " + std::to_string(src_off) +
                " (of " + std::to_string(src_size) + ") to rank " + std::to_string(peer) + " at offset " +
                std::to_string(dst_off) + " (of " + std::to_string(dst_size) + ") is out of bounds");
}

// ------------------------------------------------------------------------------------------------
// The connection
// ------------------------------------------------------------------------------------------------

/// One owner's connection on a Transport T of this kind: its own signal counters (its id in T's
/// connection table), sharing T's endpoint or queue pairs. Move-only; must not outlive its
/// transport. T makes it (`connect`) and befriends it; it asks of T, privately:
/// - `check(id, peer, ch, what)`, `put(id, ...)`, `signal(id, peer, ch)`, `flush(id)`;
/// - `progress()`: reads the completion queue once (a manual-progress provider moves only then;
///   the engine calls it while it waits on its other tier);
/// - `conns_`, a connection_table whose lanes have `signals` (a signal_track), and
///   `opt_.waiting`, the wait_policy of its waits.
template <class T>
class connection {
public:
  connection(connection&& o) noexcept : t_(std::exchange(o.t_, nullptr)), id_(o.id_) {}
  connection& operator=(connection&& o) noexcept {
    t_ = std::exchange(o.t_, nullptr);
    id_ = o.id_;
    return *this;
  }
  connection(const connection&) = delete;
  connection& operator=(const connection&) = delete;
  ~connection() = default;

  void put(rank_t peer, const typename T::memory& src, std::size_t src_off, const typename T::remote& dst,
           std::size_t dst_off, std::size_t n, channel_id ch) {
    t_->put(id_, peer, src, src_off, dst, dst_off, n, ch);
  }
  /// One-sided: the sender says where the bytes land.
  void expect(rank_t peer, const typename T::memory&, std::size_t, std::size_t, channel_id ch) {
    t_->check(id_, peer, ch, "expect");
  }
  void signal(rank_t peer, channel_id ch) { t_->signal(id_, peer, ch); }
  /// Whether `count` signals from peer on ch have arrived, reading the completion queue once if
  /// they have not yet.
  bool test(rank_t peer, channel_id ch, std::uint64_t count) {
    t_->check(id_, peer, ch, "test");
    if (t_->conns_.arrived(id_, peer, ch) >= count) return true;
    t_->progress();
    return t_->conns_.arrived(id_, peer, ch) >= count;
  }
  bool wait(rank_t peer, channel_id ch, std::uint64_t count, std::chrono::milliseconds timeout) {
    t_->check(id_, peer, ch, "wait");
    return detail::poll_until([&] { return test(peer, ch, count); }, t_->opt_.waiting, timeout);
  }
  /// Whether this connection's signals 1..count to peer on ch are out and the puts they cover
  /// complete.
  bool sent(rank_t peer, channel_id ch, std::uint64_t count) {
    t_->check(id_, peer, ch, "sent");
    t_->progress();
    return t_->conns_.lane_of(id_, peer, ch).signals.sent_upto() >= count;
  }
  void flush() { t_->flush(id_); }
  /// Reads the completion queue once: the engine calls it while it waits on its other tier.
  void progress() { t_->progress(); }
  /// This connection's id (the k-th made on its transport, from 0).
  std::uint32_t id() const noexcept { return id_; }

private:
  friend T;
  connection(T* t, std::uint32_t id) : t_(t), id_(id) {}
  T* t_;
  std::uint32_t id_;
};

} // namespace fasta2a::rma
