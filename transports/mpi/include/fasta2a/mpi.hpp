// fasta2a: host memory moved by MPI point-to-point messages. A Bootstrap over an MPI communicator
// and a two-sided Transport (MPI_Isend / MPI_Irecv) that the engine can use for scale-up, scale-out
// or both. The bytes really move; nothing is simulated. Depends on MPI only.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <deque>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "fasta2a/common.hpp"
#include "fasta2a/topology.hpp"
#include "fasta2a/transport.hpp"

namespace fasta2a {

namespace detail {

/// Throws fasta2a::error naming `what` and MPI's own description when an MPI call failed (only
/// reachable on communicators whose error handler returns, such as the transport's own).
inline void mpi_check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = 0;
  throw error(std::string(what) + " failed: " + (len > 0 ? std::string(text, static_cast<std::size_t>(len))
                                                         : "MPI error " + std::to_string(rc)));
}

/// The largest message MPI's int counts can describe, as a size.
inline constexpr std::size_t mpi_int_max = static_cast<std::size_t>(INT_MAX);

inline std::size_t check_max_message(std::size_t m, const char* who) {
  if (m == 0 || m > mpi_int_max)
    throw error(std::string(who) + ": max_message_bytes must be in [1, INT_MAX], got " + std::to_string(m));
  return m;
}

/// Number of MPI messages a transfer of n bytes becomes when split into pieces of at most `limit`
/// bytes: at least one, so that a zero-byte put still matches its zero-byte expect.
inline std::size_t mpi_chunks(std::size_t n, std::size_t limit) noexcept {
  return n == 0 ? 1 : (n - 1) / limit + 1;
}

/// Calls f(offset, length) for each chunk of n bytes cut at `limit` (one empty chunk for n = 0):
/// sender and receiver cut a message identically, so chunks match one to one.
template <class F>
void for_each_chunk(std::size_t n, std::size_t limit, F&& f) {
  const std::size_t chunks = mpi_chunks(n, limit);
  for (std::size_t k = 0; k < chunks; ++k) {
    const std::size_t off = k * limit;
    f(off, n == 0 ? 0 : std::min(limit, n - off));
  }
}

/// After a collective timed out: which ranks are not here? Every rank that timed out tells every
/// other one that it is alive and waiting (a small message on `roll`, a communicator used for
/// nothing else), then listens for the same for a grace period (a second, at most `timeout`): the
/// ranks it did not hear from never reached the collective (stopped, dead, or busy elsewhere).
/// Ranks that reached it time out within a moment of each other, well inside the grace period.
/// Returns them as "5" or "2, 5", or "" if every rank answered (the collective itself is stuck).
inline std::string mpi_roll_call(MPI_Comm roll, int rank, int size, std::chrono::milliseconds timeout,
                                 const wait_policy& waiting) noexcept {
  try {
    constexpr int tag = 7;
    static const std::uint64_t token = 1; // outlives the sends, which are never waited for
    for (int p = 0; p < size; ++p) {
      if (p == rank) continue;
      MPI_Request r = MPI_REQUEST_NULL;
      if (MPI_Isend(&token, 1, MPI_UINT64_T, p, tag, roll, &r) == MPI_SUCCESS) MPI_Request_free(&r);
    }
    std::vector<char> here(static_cast<std::size_t>(size), 0);
    here[static_cast<std::size_t>(rank)] = 1;
    int heard = 1;
    const auto grace = std::min<std::chrono::milliseconds>(timeout, std::chrono::milliseconds(1000));
    poll_until(
        [&] {
          for (;;) {
            int flag = 0;
            MPI_Status st;
            if (MPI_Iprobe(MPI_ANY_SOURCE, tag, roll, &flag, &st) != MPI_SUCCESS || !flag) break;
            std::uint64_t got = 0;
            MPI_Recv(&got, 1, MPI_UINT64_T, st.MPI_SOURCE, tag, roll, MPI_STATUS_IGNORE);
            if (!here[static_cast<std::size_t>(st.MPI_SOURCE)]) here[static_cast<std::size_t>(st.MPI_SOURCE)] = 1, ++heard;
          }
          return heard == size;
        },
        waiting, grace);
    std::string missing;
    for (int p = 0; p < size; ++p)
      if (!here[static_cast<std::size_t>(p)]) missing += (missing.empty() ? "" : ", ") + std::to_string(p);
    return missing;
  } catch (...) {
    return {};
  }
}

} // namespace detail

// ---------------------------------------------------------------------------------------------
// Bootstrap
// ---------------------------------------------------------------------------------------------

/// Options of an mpi_bootstrap.
struct mpi_bootstrap_options {
  /// How long allgather waits for the other ranks before it throws (see mpi_bootstrap).
  std::chrono::milliseconds timeout{30000};
  /// How allgather polls MPI: Open MPI's blocking collectives spin, which starves the ranks doing
  /// work when many share few cores.
  wait_policy waiting{};
  /// The largest single MPI message; longer blobs are gathered in pieces. At most INT_MAX (what
  /// MPI's int counts allow); every rank must use the same.
  std::size_t max_message_bytes = detail::mpi_int_max;
  /// Agree on the blob length (one small MPI_Iallreduce) before gathering, so that blobs of unequal
  /// length are an error on every rank rather than undefined behaviour inside MPI_Allgather. It
  /// doubles the collectives of a call; turn it off only where every rank's length is known equal.
  bool check_lengths = true;
};

/// A Bootstrap over an MPI communicator, which it does not own (the caller keeps it alive and frees
/// it). `allgather` uses non-blocking collectives (MPI_Iallreduce to check that every rank gives a
/// blob of the same length, unless turned off, then MPI_Iallgather), polled under a wait_policy:
/// Open MPI's blocking collectives spin on the CPU, which starves the ranks doing work when many
/// share few cores.
///
/// Timeout: polling lets a rank notice that a peer has not arrived and throw fasta2a::error, but MPI
/// cannot cancel a collective that has started, so after such an error the communicator holds an
/// unfinished collective and must not be used for collectives again: this bootstrap refuses
/// further calls, and in practice the program reports and calls MPI_Abort. The buffers the
/// abandoned collective may still write are the bootstrap's own and are deliberately never freed,
/// so a late peer cannot corrupt memory. A peer that never arrives is thus an error within the
/// timeout, never a silent hang; a peer that dies inside MPI is MPI's to detect.
class mpi_bootstrap {
public:
  /// Wraps `comm`. Throws fasta2a::error if comm is MPI_COMM_NULL, MPI is not initialised, or
  /// an option is out of range.
  explicit mpi_bootstrap(MPI_Comm comm, mpi_bootstrap_options opt = {})
      : comm_(comm), opt_(opt) {
    detail::check_max_message(opt_.max_message_bytes, "mpi_bootstrap");
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) throw error("mpi_bootstrap: MPI is not initialised (call MPI_Init first)");
    if (comm == MPI_COMM_NULL) throw error("mpi_bootstrap: the communicator is MPI_COMM_NULL");
    detail::mpi_check(MPI_Comm_rank(comm, &rank_), "mpi_bootstrap: MPI_Comm_rank");
    detail::mpi_check(MPI_Comm_size(comm, &size_), "mpi_bootstrap: MPI_Comm_size");
    // A communicator of its own for the roll call after a timeout (see complete()), so that its
    // messages never meet the caller's. Collective over comm, as every rank makes its bootstrap.
    detail::mpi_check(MPI_Comm_dup(comm, &roll_), "mpi_bootstrap: MPI_Comm_dup");
    MPI_Comm_set_errhandler(roll_, MPI_ERRORS_RETURN);
  }
  mpi_bootstrap(const mpi_bootstrap&) = delete;
  mpi_bootstrap& operator=(const mpi_bootstrap&) = delete;
  /// Frees the roll-call communicator unless MPI is finalised or a roll call used it (its
  /// messages may still be in flight: it is then kept, as the abandoned collective's buffers are).
  ~mpi_bootstrap() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && !broken_ && roll_ != MPI_COMM_NULL) MPI_Comm_free(&roll_);
  }

  /// This process's rank in the communicator.
  rank_t rank() const noexcept { return rank_; }
  /// The number of ranks of the communicator.
  rank_t size() const noexcept { return size_; }
  /// The wrapped communicator.
  MPI_Comm comm() const noexcept { return comm_; }

  /// Every rank's `mine`, in rank order, into `all` (which must be exactly size() * mine.size()
  /// bytes). Collective. Throws fasta2a::error if `all` has the wrong size, if the ranks' blobs
  /// differ in length (every rank throws, naming the lengths), if a peer has not arrived within
  /// the timeout, or if an earlier call timed out (see the class comment).
  void allgather(std::span<const std::byte> mine, std::span<std::byte> all) {
    if (broken_)
      throw error("mpi_bootstrap::allgather: an earlier allgather on rank " + std::to_string(rank_) +
                  " timed out, so its communicator is unusable");
    const std::size_t len = mine.size();
    if (all.size() / static_cast<std::size_t>(size_) != len || all.size() % static_cast<std::size_t>(size_) != 0)
      throw error("mpi_bootstrap::allgather: the output holds " + std::to_string(all.size()) + " bytes, not " +
                  std::to_string(size_) + " ranks x " + std::to_string(len) + " bytes");
    MPI_Request req = MPI_REQUEST_NULL;
    if (opt_.check_lengths) {
      // Blobs of unequal length would make MPI_Allgather misread memory or fail on some ranks
      // only: agree on the length first, so that every rank sees the same mismatch.
      lengths_.assign({static_cast<long long>(len), -static_cast<long long>(len), 0, 0});
      detail::mpi_check(MPI_Iallreduce(lengths_.data(), lengths_.data() + 2, 2, MPI_LONG_LONG, MPI_MAX, comm_, &req),
                        "mpi_bootstrap: MPI_Iallreduce");
      complete(req, "checking the blob lengths");
      if (lengths_[2] != -lengths_[3])
        throw error("mpi_bootstrap::allgather: the ranks' blobs differ in length (from " +
                    std::to_string(-lengths_[3]) + " to " + std::to_string(lengths_[2]) +
                    " bytes; this rank has " + std::to_string(len) + ")");
    }
    if (len == 0) {
      // Nothing to gather, but the call must still order this rank after the others.
      if (!opt_.check_lengths) {
        detail::mpi_check(MPI_Ibarrier(comm_, &req), "mpi_bootstrap: MPI_Ibarrier");
        complete(req, "synchronising");
      }
      return;
    }
    // MPI reads and writes the bootstrap's own copies, not the caller's buffers: a collective
    // abandoned at the timeout may still touch them later, and they are then never freed.
    out_.assign(mine.begin(), mine.end());
    in_.resize(all.size());
    if (len <= opt_.max_message_bytes) {
      detail::mpi_check(MPI_Iallgather(out_.data(), static_cast<int>(len), MPI_BYTE, in_.data(),
                                       static_cast<int>(len), MPI_BYTE, comm_, &req),
                        "mpi_bootstrap: MPI_Iallgather");
      complete(req, "gathering the blobs");
    } else {
      // A blob past the limit goes in pieces: piece k of every rank lands at its place in every
      // rank's slot, through a type whose extent is the whole blob.
      for (std::size_t off = 0; off < len; off += opt_.max_message_bytes) {
        const std::size_t n = std::min(opt_.max_message_bytes, len - off);
        MPI_Datatype piece = MPI_DATATYPE_NULL, slot = MPI_DATATYPE_NULL;
        detail::mpi_check(MPI_Type_contiguous(static_cast<int>(n), MPI_BYTE, &piece),
                          "mpi_bootstrap: MPI_Type_contiguous");
        detail::mpi_check(MPI_Type_create_resized(piece, 0, static_cast<MPI_Aint>(len), &slot),
                          "mpi_bootstrap: MPI_Type_create_resized");
        MPI_Type_free(&piece);
        detail::mpi_check(MPI_Type_commit(&slot), "mpi_bootstrap: MPI_Type_commit");
        const int rc = MPI_Iallgather(out_.data() + off, static_cast<int>(n), MPI_BYTE, in_.data() + off, 1, slot,
                                      comm_, &req);
        // A committed type in use by a pending operation may be freed: MPI keeps it until done.
        MPI_Type_free(&slot);
        detail::mpi_check(rc, "mpi_bootstrap: MPI_Iallgather");
        complete(req, "gathering the blobs");
      }
    }
    std::copy(in_.begin(), in_.end(), all.begin());
  }

private:
  void complete(MPI_Request& req, const char* what) {
    int rc = MPI_SUCCESS;
    const bool done = detail::poll_until(
        [&] {
          int flag = 0;
          rc = MPI_Test(&req, &flag, MPI_STATUS_IGNORE);
          return rc != MPI_SUCCESS || flag != 0;
        },
        opt_.waiting, opt_.timeout);
    detail::mpi_check(rc, "mpi_bootstrap: MPI_Test");
    if (done) return;
    // MPI cannot cancel a collective: keep what it may still write alive for good (a leak, once).
    broken_ = true;
    static_cast<void>(new std::vector<std::byte>(std::move(out_)));
    static_cast<void>(new std::vector<std::byte>(std::move(in_)));
    static_cast<void>(new std::vector<long long>(std::move(lengths_)));
    const std::string missing = roll_call();
    throw timeout_error("mpi_bootstrap::allgather: rank " + std::to_string(rank_) + " timed out after " +
                std::to_string(opt_.timeout.count()) + " ms " + what + ": " +
                (missing.empty() ? std::string("some rank did not reach the allgather")
                                 : "rank(s) " + missing + " did not reach the allgather (no answer to a roll call)") +
                " (the communicator is unusable now)");
  }

  std::string roll_call() noexcept { return detail::mpi_roll_call(roll_, rank_, size_, opt_.timeout, opt_.waiting); }

  MPI_Comm comm_;
  MPI_Comm roll_ = MPI_COMM_NULL; ///< the roll call's own duplicate of comm_
  mpi_bootstrap_options opt_;
  std::vector<long long> lengths_;     ///< this rank's length and its negation, then the maxima
  std::vector<std::byte> out_, in_;    ///< what MPI sends and receives
  bool broken_ = false;                ///< a collective was abandoned at its timeout
  int rank_ = 0;
  int size_ = 1;
};

static_assert(Bootstrap<mpi_bootstrap>);

// ---------------------------------------------------------------------------------------------
// Open MPI's TCP transport settings, read through the MPI tool interface
// ---------------------------------------------------------------------------------------------

/// What this process's Open MPI TCP transport (BTL) does with large messages, read through the
/// MPI tool interface (MPI_T control variables) after MPI_Init. With "put" in `btl_tcp_flags`
/// (Open MPI's default), a message of at least `rdma_pipeline_bytes` goes through an emulated-RDMA
/// pipeline that the receiver drives, fragment by fragment; receivers that sleep between polls (the
/// transport's waits, the engine's idle loop) stall it. Without "put", or below that size, a
/// message is sent in fragments after one rendezvous.
struct mpi_tcp_settings {
  bool put = false;                  ///< btl_tcp_flags includes "put"
  std::size_t rdma_pipeline_bytes = 0; ///< smallest message that uses the pipeline (with put)
};

namespace detail {

/// The value of the MPI_T control variable `name` (an integer, one element), and through `bit`
/// the value of its enumeration's item `item` if it has one. Nothing where it is not there.
inline std::optional<unsigned long long> mpi_cvar(const char* name, const char* item = nullptr,
                                                  unsigned long long* bit = nullptr) {
  int count = 0;
  if (MPI_T_cvar_get_num(&count) != MPI_SUCCESS) return std::nullopt;
  for (int i = 0; i < count; ++i) {
    char found[256], desc[8];
    int name_len = sizeof(found), desc_len = sizeof(desc), verbosity = 0, bind = 0, scope = 0;
    MPI_Datatype type = MPI_DATATYPE_NULL;
    MPI_T_enum enumtype = MPI_T_ENUM_NULL;
    if (MPI_T_cvar_get_info(i, found, &name_len, &verbosity, &type, &enumtype, desc, &desc_len, &bind, &scope) !=
            MPI_SUCCESS ||
        std::strcmp(found, name) != 0)
      continue;
    if (item != nullptr && bit != nullptr && enumtype != MPI_T_ENUM_NULL) {
      int items = 0;
      char text[64];
      int len = sizeof(text);
      if (MPI_T_enum_get_info(enumtype, &items, text, &len) == MPI_SUCCESS)
        for (int k = 0; k < items; ++k) {
          int value = 0;
          len = sizeof(text);
          if (MPI_T_enum_get_item(enumtype, k, &value, text, &len) == MPI_SUCCESS && std::strcmp(text, item) == 0)
            *bit = static_cast<unsigned long long>(value);
        }
    }
    MPI_T_cvar_handle handle = nullptr;
    int elements = 0;
    if (MPI_T_cvar_handle_alloc(i, nullptr, &handle, &elements) != MPI_SUCCESS) return std::nullopt;
    std::optional<unsigned long long> out;
    if (elements == 1) {
      if (type == MPI_INT || type == MPI_UNSIGNED) {
        unsigned v = 0;
        if (MPI_T_cvar_read(handle, &v) == MPI_SUCCESS) out = v;
      } else if (type == MPI_UNSIGNED_LONG || type == MPI_LONG) {
        unsigned long v = 0;
        if (MPI_T_cvar_read(handle, &v) == MPI_SUCCESS) out = v;
      } else if (type == MPI_UNSIGNED_LONG_LONG || type == MPI_LONG_LONG) {
        unsigned long long v = 0;
        if (MPI_T_cvar_read(handle, &v) == MPI_SUCCESS) out = v;
      }
    }
    MPI_T_cvar_handle_free(&handle);
    return out;
  }
  return std::nullopt;
}

} // namespace detail

/// Open MPI's TCP transport settings of this process (see mpi_tcp_settings); nothing where there
/// is no `btl_tcp_flags` variable (another MPI, or Open MPI without its TCP transport). Call after
/// MPI_Init.
inline std::optional<mpi_tcp_settings> mpi_btl_tcp_settings() {
  int provided = 0;
  if (MPI_T_init_thread(MPI_THREAD_SINGLE, &provided) != MPI_SUCCESS) return std::nullopt;
  std::optional<mpi_tcp_settings> out;
  unsigned long long put_bit = 0x2; // MCA_BTL_FLAGS_PUT in Open MPI 4 and 5, unless the enumeration says
  if (const auto flags = detail::mpi_cvar("btl_tcp_flags", "put", &put_bit)) {
    mpi_tcp_settings t;
    t.put = (*flags & put_bit) != 0;
    // Open MPI raises the pipeline's threshold to at least eager limit + pipeline send length.
    const unsigned long long min_size = detail::mpi_cvar("btl_tcp_min_rdma_pipeline_size").value_or(196608);
    const unsigned long long floor = detail::mpi_cvar("btl_tcp_eager_limit").value_or(65536) +
                                     detail::mpi_cvar("btl_tcp_rdma_pipeline_send_length").value_or(131072);
    t.rdma_pipeline_bytes = static_cast<std::size_t>(std::max(min_size, floor));
    out = t;
  }
  MPI_T_finalize();
  return out;
}

// ---------------------------------------------------------------------------------------------
// Transport
// ---------------------------------------------------------------------------------------------

/// Options of an mpi_transport.
struct mpi_transport_options {
  /// How wait() and flush() poll MPI: spinning on 2 cores with 16 ranks starves the senders.
  wait_policy waiting{};
  /// How long flush() waits for this rank's sends to complete before it throws.
  std::chrono::milliseconds flush_timeout{30000};
  /// The largest single MPI message; longer puts are split into pieces of this size (sender and
  /// receiver split the same way, so every rank must use the same value). At most INT_MAX.
  std::size_t max_message_bytes = detail::mpi_int_max;
  /// Where Open MPI's TCP transport runs its receiver-driven "put" pipeline (btl_tcp_flags with
  /// put, its default; see mpi_tcp_settings) and max_message_bytes is left at its default, cut
  /// messages just below the pipeline's threshold, so that every message goes by send semantics
  /// after one rendezvous, as it does without put. The constructor then reads the setting (MPI_T)
  /// and the ranks agree on the smallest cut (one MPI_Allreduce). Off by default: on the emulated
  /// cluster under Open MPI's defaults it did not help (Zipf 4 x 4, one run: 1.45 s cut, 1.27 s
  /// whole; examples/cluster/results/results-libfabric.md), so the pipeline is not the whole story.
  bool avoid_tcp_put_pipeline = false;
};

/// A two-sided Transport over MPI point-to-point. The transport holds its own duplicate of a
/// communicator; each connection holds a duplicate of that (so messages of two engines never match
/// each other's, nor anyone else's). Non-copyable; connections are move-only.
///
/// - `put` is an MPI_Isend on the channel's data tag, `expect` the matching MPI_Irecv straight into
///   the registered memory: MPI matches messages of one (source, tag) in the order they were sent,
///   so puts and expects pair up per (peer, channel) exactly as the Connection concept orders them.
/// - `signal` is a small MPI_Isend on the channel's signal tag that carries how many puts this rank
///   has made to the peer on that channel so far. MPI does not order messages of different tags,
///   so a signal cannot vouch for the data by arriving after it; the count says instead which
///   expects it covers, and `wait` completes exactly those (not the expects of later stages, whose
///   data may depend on this rank's own progress).
/// - `wait` and `flush` poll (MPI_Iprobe, MPI_Testall) under the wait_policy: no hard spinning.
///
/// Memory needs no registration with MPI: a `memory` is a pointer and a size, a `remote` the
/// peer's rank and the size of its region (for bounds checks at the sender). Host memory only
/// (Debian's Open MPI is not CUDA-aware).
class mpi_transport {
public:
  /// Local memory the transport reads from or receives into.
  struct memory {
    std::byte* ptr = nullptr;
    std::size_t size = 0;
  };
  /// A peer's memory, as far as a sender needs it: MPI addresses the receiver by rank, and the
  /// receiver says where the bytes land (expect), so only the size is kept, to check bounds.
  struct remote {
    rank_t rank = -1;
    std::size_t size = 0;
  };
  /// A serialized handle: the region's address and size, 8 bytes each.
  static constexpr std::size_t handle_bytes = 16;
  static constexpr bool can_register(memory_kind k) noexcept { return k == memory_kind::host; }
  /// Peers' bytes land only through this rank's posted receives, which a connection's destruction
  /// cancels (MPI_Cancel, then MPI_Wait): after it, nothing writes into the memory.
  static constexpr bool late_writes_revoked = true;

  /// One engine's connection: its own communicator (a duplicate), its own requests and counts.
  class connection {
  public:
    connection(connection&& o) noexcept
        : opt_(o.opt_), comm_(std::exchange(o.comm_, MPI_COMM_NULL)), rank_(o.rank_), size_(o.size_),
          channels_(o.channels_), inbound_(std::move(o.inbound_)), outbound_(std::move(o.outbound_)),
          puts_sent_(std::move(o.puts_sent_)), sends_(std::move(o.sends_)), send_peer_(std::move(o.send_peer_)),
          signal_payload_(std::move(o.signal_payload_)), abandoned_(o.abandoned_) {}
    connection& operator=(connection&&) = delete;
    connection(const connection&) = delete;
    connection& operator=(const connection&) = delete;

    /// Cancels receives still posted, lets sends still in flight finish on their own, and frees the
    /// duplicate communicator, unless the connection was abandoned (a failed call) or still had
    /// messages in flight: a peer's late message may still come to it, and Open MPI hands a freed
    /// communicator's messages to the next communicator that gets its context id (a later
    /// engine's connection, which would take a stale signal or stale bytes for its own). That
    /// communicator is kept for good: one per failed call. Does nothing once MPI has been finalised.
    ~connection() {
      if (comm_ == MPI_COMM_NULL) return;
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (finalized) return;
      bool in_flight = abandoned_;
      for (const inbound& in : inbound_)
        for (MPI_Request r : in.reqs) in_flight |= r != MPI_REQUEST_NULL;
      for (MPI_Request r : sends_) in_flight |= r != MPI_REQUEST_NULL;
      abandon();
      if (!in_flight) MPI_Comm_free(&comm_);
    }

    /// Gives up what is in flight, after a failed call: cancels the receives still posted (once it
    /// returns, nothing lands in this rank's memory through them) and lets sends still in flight
    /// finish on their own. The connection is unusable afterwards, and its communicator is never
    /// freed, not even by the destructor: a late message of a peer may still come to it, and Open
    /// MPI keeps messages for a freed communicator's context id and hands them to the next
    /// communicator that gets the same id.
    void abandon() noexcept {
      if (comm_ == MPI_COMM_NULL) return;
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (finalized) return;
      abandoned_ = true;
      for (inbound& in : inbound_) {
        for (MPI_Request& r : in.reqs)
          if (r != MPI_REQUEST_NULL) {
            MPI_Cancel(&r);
            MPI_Wait(&r, MPI_STATUS_IGNORE);
          }
        in = inbound{};
      }
      for (MPI_Request& r : sends_)
        if (r != MPI_REQUEST_NULL) MPI_Request_free(&r);
      sends_.clear();
      send_peer_.clear();
      for (outbound& o : outbound_) o = outbound{};
    }

    /// Starts sending bytes [src_off, src_off + n) of src to peer, landing at dst_off of dst (where
    /// peer's matching expect on channel_id ch puts it). Returns at once; the source must stay untouched
    /// until flush(). Throws fasta2a::error naming the offsets if either range is out of bounds.
    void put(rank_t peer, const memory& src, std::size_t src_off, const remote& dst, std::size_t dst_off,
             std::size_t n, channel_id ch) {
      check_peer(peer, "put");
      const std::size_t c = check_channel(ch, "put");
      if (dst.rank != peer)
        throw error("mpi_transport::put: the remote handle belongs to rank " + std::to_string(dst.rank) +
                    ", not to the peer " + std::to_string(peer));
      check_range(src_off, n, src.size, "put", "source", peer);
      check_range(dst_off, n, dst.size, "put", "destination", peer);
      detail::for_each_chunk(n, opt_.max_message_bytes, [&](std::size_t off, std::size_t len) {
        MPI_Request r = MPI_REQUEST_NULL;
        detail::mpi_check(MPI_Isend(src.ptr + src_off + off, static_cast<int>(len), MPI_BYTE, peer, data_tag(c), comm_, &r),
                          "mpi_transport::put: MPI_Isend");
        outbound_[lane(peer, c)].reqs.push_back(sends_.size());
        sends_.push_back(r);
        send_peer_.push_back(peer);
      });
      ++puts_sent_[lane(peer, c)];
    }

    /// A put lands only in a posted receive (MPI matches sends to receives in order): the engine
    /// frees a shared staging slot by posting the receives of the stage that reuses it, instead of
    /// signalling the sender (transport.hpp, expects_gate_puts).
    static constexpr bool expects_gate_puts = true;

    /// Posts the receive of peer's next put on channel_id ch: n bytes into [dst_off, dst_off + n) of
    /// dst. Throws fasta2a::error naming the offsets if the range is outside the registration.
    void expect(rank_t peer, const memory& dst, std::size_t dst_off, std::size_t n, channel_id ch) {
      check_peer(peer, "expect");
      const std::size_t c = check_channel(ch, "expect");
      check_range(dst_off, n, dst.size, "expect", "destination", peer);
      inbound& in = inbound_[lane(peer, c)];
      detail::for_each_chunk(n, opt_.max_message_bytes, [&](std::size_t off, std::size_t len) {
        MPI_Request r = MPI_REQUEST_NULL;
        detail::mpi_check(MPI_Irecv(dst.ptr + dst_off + off, static_cast<int>(len), MPI_BYTE, peer, data_tag(c), comm_, &r),
                          "mpi_transport::expect: MPI_Irecv");
        in.reqs.push_back(r);
      });
      in.expect_end.push_back(in.reqs_base + in.reqs.size());
      ++in.expects_posted;
    }

    /// Tells peer that this rank's puts to it on channel_id ch so far are on their way: peer's counter
    /// for (this rank, ch) grows by one, and its wait covers those puts.
    void signal(rank_t peer, channel_id ch) {
      check_peer(peer, "signal");
      const std::size_t c = check_channel(ch, "signal");
      // The payload must outlive the send: a deque never moves its elements.
      signal_payload_.push_back(puts_sent_[lane(peer, c)]);
      MPI_Request r = MPI_REQUEST_NULL;
      detail::mpi_check(MPI_Isend(&signal_payload_.back(), 1, MPI_UINT64_T, peer, signal_tag(c), comm_, &r),
                        "mpi_transport::signal: MPI_Isend");
      sends_.push_back(r);
      send_peer_.push_back(peer);
      outbound& o = outbound_[lane(peer, c)];
      o.mark.push_back(o.reqs.size());
      ++o.signals;
    }

    /// True once `count` signals from peer on channel_id ch have arrived (counted over the transport's
    /// lifetime) and every expect those signals cover has received its bytes; false if that has not
    /// happened within `timeout`. Throws fasta2a::error if peer has put more on ch than this rank has
    /// expected (the two sides disagree on the traffic), or if a receive failed (for instance a put
    /// longer than its expect).
    bool wait(rank_t peer, channel_id ch, std::uint64_t count, std::chrono::milliseconds timeout) {
      check_peer(peer, "wait");
      const std::size_t c = check_channel(ch, "wait");
      inbound& in = inbound_[lane(peer, c)];
      return detail::poll_until([&] { return progress(in, peer, c, count); }, opt_.waiting, timeout);
    }

    /// One poll of wait(peer, ch, count): never blocks.
    bool test(rank_t peer, channel_id ch, std::uint64_t count) {
      check_peer(peer, "test");
      const std::size_t c = check_channel(ch, "test");
      return progress(inbound_[lane(peer, c)], peer, c, count);
    }

    /// True once every put this rank made to peer on channel_id ch before its count-th signal there has
    /// left this rank (MPI_Test says its send completed: the source may be reused). Never blocks.
    /// Throws fasta2a::error if this rank has not signalled peer count times on ch.
    bool sent(rank_t peer, channel_id ch, std::uint64_t count) {
      check_peer(peer, "sent");
      const std::size_t c = check_channel(ch, "sent");
      outbound& o = outbound_[lane(peer, c)];
      if (count <= o.base) return true; // flushed
      if (count > o.signals)
        throw error("mpi_transport::sent: rank " + std::to_string(rank_) + " has signalled rank " + std::to_string(peer) +
                    " " + std::to_string(o.signals) + " times on channel " + std::to_string(ch) + ", not " +
                    std::to_string(count));
      const std::size_t need = o.mark[count - 1 - o.base];
      while (o.done < need) {
        int flag = 0;
        detail::mpi_check(MPI_Test(&sends_[o.reqs[o.done]], &flag, MPI_STATUS_IGNORE), "mpi_transport::sent: MPI_Test");
        if (!flag) return false;
        ++o.done;
      }
      return true;
    }

    /// Drives MPI's progress once (an MPI_Iprobe that matches nothing it takes). The engine calls
    /// it while it waits on its other tier: this rank's sends and receives in flight may move only
    /// while it calls MPI (a rendezvous over TCP, or over shared memory without single-copy).
    /// The probe is for a tag no message on this connection's communicator carries: a probe that
    /// matches a message (any signal not yet taken, with MPI_ANY_TAG) returns without running MPI's
    /// progress engine, and a peer's rendezvous into this rank would then never move.
    void progress() {
      int flag = 0;
      detail::mpi_check(MPI_Iprobe(MPI_ANY_SOURCE, progress_tag(), comm_, &flag, MPI_STATUS_IGNORE),
                        "mpi_transport::progress: MPI_Iprobe");
    }

    /// Returns once every put and signal this rank started has completed (its source may be reused).
    /// Throws fasta2a::error naming a peer that has not taken its bytes within the flush timeout.
    void flush() {
      int rc = MPI_SUCCESS;
      const bool done = detail::poll_until(
          [&] {
            int flag = 0;
            rc = MPI_Testall(static_cast<int>(sends_.size()), sends_.data(), &flag, MPI_STATUSES_IGNORE);
            return rc != MPI_SUCCESS || flag != 0;
          },
          opt_.waiting, opt_.flush_timeout);
      detail::mpi_check(rc, "mpi_transport::flush: MPI_Testall");
      if (!done) {
        rank_t late = -1;
        for (std::size_t i = 0; i < sends_.size() && late < 0; ++i) {
          int flag = 0;
          MPI_Test(&sends_[i], &flag, MPI_STATUS_IGNORE);
          if (!flag) late = send_peer_[i];
        }
        throw timeout_error("mpi_transport::flush: rank " + std::to_string(rank_) + "'s sends to rank " +
                            std::to_string(late) + " did not complete within " +
                            std::to_string(opt_.flush_timeout.count()) + " ms (did it post the matching expects?)");
      }
      sends_.clear();
      send_peer_.clear();
      signal_payload_.clear();
      for (outbound& o : outbound_) {
        o.base = o.signals;
        o.reqs.clear();
        o.mark.clear();
        o.done = 0;
      }
    }

  private:
    /// What this rank knows of one (peer, channel): its posted receives and the signals seen.
    /// Indices are absolute over the transport's lifetime; the vectors hold only what is not known
    /// to be complete, from reqs_base and expects_base on.
    struct inbound {
      std::vector<MPI_Request> reqs;          ///< chunk receives, from absolute index reqs_base
      std::vector<std::uint64_t> expect_end;  ///< per expect from expects_base: one past its last chunk
      std::uint64_t reqs_base = 0;
      std::uint64_t expects_base = 0;
      std::uint64_t expects_posted = 0;
      std::uint64_t chunks_done = 0; ///< chunks [0, chunks_done) have completed
      std::uint64_t signals = 0;     ///< signals received
      std::uint64_t covered = 0;     ///< puts the latest received signal vouches for
    };

    /// What this rank has sent to one (peer, channel) since the last flush, for sent().
    struct outbound {
      std::vector<std::size_t> reqs; ///< indices into sends_ of the put chunks, in order
      std::vector<std::size_t> mark; ///< per signal since the flush: how many of reqs it covers
      std::size_t done = 0;          ///< reqs[0, done) are known complete
      std::uint64_t signals = 0;     ///< signals sent over the lifetime
      std::uint64_t base = 0;        ///< signals sent before the last flush (all complete)
    };

    static int data_tag(std::size_t c) noexcept { return static_cast<int>(c); }
    int signal_tag(std::size_t c) const noexcept { return static_cast<int>(channels_ + c); }
    int progress_tag() const noexcept { return static_cast<int>(2 * channels_); } ///< never sent
    std::size_t lane(rank_t peer, std::size_t c) const noexcept {
      return static_cast<std::size_t>(peer) * channels_ + c;
    }

    void check_peer(rank_t peer, const char* who) const {
      if (peer < 0 || peer >= size_)
        throw error(std::string("mpi_transport::") + who + ": peer " + std::to_string(peer) +
                    " is not a rank of the communicator (size " + std::to_string(size_) + ")");
    }
    std::size_t check_channel(channel_id ch, const char* who) const {
      const auto c = static_cast<std::size_t>(ch);
      if (c >= channels_)
        throw error(std::string("mpi_transport::") + who + ": channel " + std::to_string(c) + " does not exist");
      return c;
    }
    static void check_range(std::size_t off, std::size_t n, std::size_t size, const char* who, const char* side,
                            rank_t peer) {
      if (off > size || n > size - off)
        throw error(std::string("mpi_transport::") + who + ": " + side + " bytes [" + std::to_string(off) + ", " +
                    std::to_string(off) + " + " + std::to_string(n) + ") (peer " + std::to_string(peer) +
                    ") fall outside the registered " + std::to_string(size) + " bytes");
    }

    /// One poll of wait(): takes the signals that have arrived (up to count), then tests the
    /// receives they cover. True when both are done.
    bool progress(inbound& in, rank_t peer, std::size_t c, std::uint64_t count) {
      while (in.signals < count) {
        int flag = 0;
        MPI_Status st;
        detail::mpi_check(MPI_Iprobe(peer, signal_tag(c), comm_, &flag, &st), "mpi_transport::wait: MPI_Iprobe");
        if (!flag) break;
        std::uint64_t covered = 0;
        detail::mpi_check(MPI_Recv(&covered, 1, MPI_UINT64_T, peer, signal_tag(c), comm_, MPI_STATUS_IGNORE),
                          "mpi_transport::wait: MPI_Recv of a signal");
        ++in.signals;
        in.covered = std::max(in.covered, covered);
      }
      if (in.covered > in.expects_posted)
        throw error("mpi_transport::wait: rank " + std::to_string(peer) + " has put " + std::to_string(in.covered) +
                    " messages on channel " + std::to_string(c) + " to rank " +
                    std::to_string(rank_) + ", which expects only " + std::to_string(in.expects_posted) +
                    ": the ranks disagree on the traffic");
      // Chunks the covered expects end at: everything before must have landed.
      const std::uint64_t needed =
          in.covered <= in.expects_base ? in.reqs_base : in.expect_end[in.covered - 1 - in.expects_base];
      if (in.chunks_done < needed) {
        int flag = 0;
        const std::size_t from = in.chunks_done - in.reqs_base;
        const int rc = MPI_Testall(static_cast<int>(needed - in.chunks_done), in.reqs.data() + from, &flag,
                                   MPI_STATUSES_IGNORE);
        if (rc != MPI_SUCCESS) {
          try {
            detail::mpi_check(rc, "MPI_Testall");
          } catch (const error& e) {
            throw error("mpi_transport::wait: receiving from rank " + std::to_string(peer) + " on channel " + std::to_string(c) + ": " + e.what() +
                        " (a put longer than its expect?)");
          }
        }
        if (!flag) return false;
        in.chunks_done = needed;
      }
      // Everything posted has landed: drop it, so a long-lived transport does not grow.
      if (in.chunks_done == in.reqs_base + in.reqs.size() && !in.reqs.empty()) {
        in.reqs_base += in.reqs.size();
        in.expects_base += in.expect_end.size();
        in.reqs.clear();
        in.expect_end.clear();
      }
      return in.signals >= count;
    }


    friend class mpi_transport;
    connection(MPI_Comm parent, const mpi_transport_options& opt, channel_id channels) : opt_(opt), channels_(channels) {
      detail::mpi_check(MPI_Comm_dup(parent, &comm_), "mpi_transport::connect: MPI_Comm_dup");
      MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
      MPI_Comm_rank(comm_, &rank_);
      MPI_Comm_size(comm_, &size_);
      const std::size_t lanes = static_cast<std::size_t>(size_) * channels_;
      inbound_.resize(lanes);
      outbound_.resize(lanes);
      puts_sent_.assign(lanes, 0);
    }

    mpi_transport_options opt_;
    MPI_Comm comm_ = MPI_COMM_NULL;
    int rank_ = 0;
    int size_ = 1;
    std::size_t channels_ = 1;
    std::vector<inbound> inbound_;          ///< per (peer, channel)
    std::vector<outbound> outbound_;        ///< per (peer, channel)
    std::vector<std::uint64_t> puts_sent_;  ///< per (peer, channel): puts made over the lifetime
    std::vector<MPI_Request> sends_;        ///< puts and signals in flight, until flush
    std::vector<rank_t> send_peer_;         ///< the peer of each, for flush's message
    std::deque<std::uint64_t> signal_payload_;
    bool abandoned_ = false; ///< abandon() ran: the destructor keeps the communicator
  };

  /// Duplicates `comm` (collective over it) and sets the duplicate to return errors, so that MPI
  /// failures become fasta2a::error. Throws fasta2a::error if MPI is not initialised, comm is
  /// MPI_COMM_NULL or an option is out of range.
  explicit mpi_transport(MPI_Comm comm, mpi_transport_options opt = {}) : opt_(opt) {
    detail::check_max_message(opt_.max_message_bytes, "mpi_transport");
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) throw error("mpi_transport: MPI is not initialised (call MPI_Init first)");
    if (comm == MPI_COMM_NULL) throw error("mpi_transport: the communicator is MPI_COMM_NULL");
    detail::mpi_check(MPI_Comm_dup(comm, &comm_), "mpi_transport: MPI_Comm_dup");
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    if (opt_.avoid_tcp_put_pipeline && opt_.max_message_bytes == detail::mpi_int_max) {
      // Every rank must cut alike: the smallest cut any rank wants (none: INT_MAX).
      unsigned long long cut = detail::mpi_int_max;
      if (const auto tcp = mpi_btl_tcp_settings(); tcp && tcp->put && tcp->rdma_pipeline_bytes > 1)
        cut = std::min<unsigned long long>(cut, tcp->rdma_pipeline_bytes - 1);
      detail::mpi_check(MPI_Allreduce(MPI_IN_PLACE, &cut, 1, MPI_UNSIGNED_LONG_LONG, MPI_MIN, comm_),
                        "mpi_transport: MPI_Allreduce");
      opt_.max_message_bytes = static_cast<std::size_t>(cut);
    }
  }
  mpi_transport(const mpi_transport&) = delete;
  mpi_transport& operator=(const mpi_transport&) = delete;
  /// Frees the duplicate communicator (connections have their own). Nothing once MPI is finalised.
  ~mpi_transport() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);
  }

  /// This rank in the transport's communicator.
  rank_t rank() const noexcept { return rank_; }
  /// The largest single MPI message (after avoid_tcp_put_pipeline's cut, where it applied).
  std::size_t max_message_bytes() const noexcept { return opt_.max_message_bytes; }
  /// Ranks in the transport's communicator.
  rank_t size() const noexcept { return size_; }

  /// Makes [p, p + n) usable as a put source or an expect target. Throws fasta2a::error if p is
  /// null while n > 0.
  memory register_memory(void* p, std::size_t n) {
    if (p == nullptr && n > 0)
      throw error("mpi_transport::register_memory: null pointer for " + std::to_string(n) + " bytes");
    return memory{static_cast<std::byte*>(p), n};
  }
  /// MPI pins nothing for us: nothing to undo.
  void deregister(memory&) noexcept {}

  /// The handle of `m`: its address and size, 8 bytes each, native byte order (every rank runs
  /// the same program on the same kind of machine).
  std::vector<std::byte> serialize(const memory& m) const {
    std::vector<std::byte> blob(handle_bytes);
    const std::uint64_t words[2] = {static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(m.ptr)),
                                    static_cast<std::uint64_t>(m.size)};
    std::memcpy(blob.data(), words, handle_bytes);
    return blob;
  }

  /// The remote view of peer's handle. Throws fasta2a::error if the blob is not handle_bytes long
  /// or peer is not a rank of the communicator.
  remote deserialize(rank_t peer, std::span<const std::byte> blob) {
    if (peer < 0 || peer >= size_)
      throw error("mpi_transport::deserialize: peer " + std::to_string(peer) +
                  " is not a rank of the communicator (size " + std::to_string(size_) + ")");
    if (blob.size() != handle_bytes)
      throw error("mpi_transport::deserialize: rank " + std::to_string(peer) + "'s handle is " +
                  std::to_string(blob.size()) + " bytes, expected " + std::to_string(handle_bytes));
    std::uint64_t words[2];
    std::memcpy(words, blob.data(), handle_bytes);
    return remote{peer, static_cast<std::size_t>(words[1])};
  }
  void forget(remote&) noexcept {}

  /// A connection with channels [0, channels) on a new duplicate of the communicator: collective,
  /// every rank makes its connections in the same order.
  connection connect(channel_id channels) {
    if (channels < 1) throw error("mpi_transport::connect: a connection needs at least one channel");
    // Tags: data c, signals channels + c, progress 2 * channels; MPI guarantees tags up to 32767.
    if (channels > 16383)
      throw error("mpi_transport::connect: " + std::to_string(channels) +
                  " channels do not fit MPI's tags (at most 16383 channels: the smallest MPI_TAG_UB is 32767)");
    return connection(comm_, opt_, channels);
  }

private:
  mpi_transport_options opt_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
};

static_assert(Transport<mpi_transport>);

/// The topology of MPI's ranks taken as servers of `gpus_per_server` consecutive ranks:
/// (size / G) servers x G. Throws fasta2a::error if G < 1 or the communicator's size is not a
/// multiple of G.
inline two_tier_topology mpi_world_topology(int gpus_per_server, MPI_Comm comm = MPI_COMM_WORLD,
                                            link_model links = h200_links) {
  int size = 0;
  detail::mpi_check(MPI_Comm_size(comm, &size), "mpi_world_topology: MPI_Comm_size");
  if (gpus_per_server < 1)
    throw error("mpi_world_topology: GPUs per server must be at least 1, got " + std::to_string(gpus_per_server));
  if (size % gpus_per_server != 0)
    throw error("mpi_world_topology: " + std::to_string(size) + " MPI ranks are not a whole number of servers of " +
                std::to_string(gpus_per_server) + " GPUs");
  return two_tier_topology(size / gpus_per_server, gpus_per_server, links);
}

/// A line for start-up output where Open MPI's TCP transport runs its "put" pipeline (see
/// mpi_tcp_settings), else empty. Call after MPI_Init.
inline std::string mpi_transport_setting_note() {
  const std::optional<mpi_tcp_settings> tcp = mpi_btl_tcp_settings();
  if (!tcp || !tcp->put) return {};
  return "Open MPI's btl_tcp_flags includes \"put\" (its default), under which the MPI transport between servers "
         "was measured 1.1-1.3x slower than with --mca btl_tcp_flags send,inplace,need-ack,need-csum (its messages of " +
         std::to_string(tcp->rdma_pipeline_bytes) +
         " bytes or more go through a receiver-driven pipeline); set that, or use the libfabric transport";
}

/// The body of an MPI program's main: initialises MPI, runs body() (which returns the exit
/// status), finalises MPI. An exception escaping body() on any rank is printed as
/// "program: error: rank R: what" and aborts the whole job with status 2, so that no rank is left
/// waiting for one that gave up.
template <class Body>
int run_mpi_program(int& argc, char**& argv, const char* program, Body&& body) {
  MPI_Init(&argc, &argv);
  int rc = 0;
  try {
    rc = body();
  } catch (const std::exception& e) {
    int me = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    std::fprintf(stderr, "%s: error: rank %d: %s\n", program, me, e.what());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  MPI_Finalize();
  return rc;
}

} // namespace fasta2a
