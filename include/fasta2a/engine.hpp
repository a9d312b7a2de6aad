// fasta2a: the all-to-allv engine. Plans each call with FAST, turns this rank's part of the plan
// into a rank program, and runs it over a scale-up and a scale-out Transport, with real bytes.
#pragma once

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "fasta2a/common.hpp"
#include "fasta2a/decompose.hpp"
#include "fasta2a/memory.hpp"
#include "fasta2a/plan.hpp"
#include "fasta2a/planner.hpp"
#include "fasta2a/program.hpp"
#include "fasta2a/topology.hpp"
#include "fasta2a/transport.hpp"
#include "fasta2a/transpose.hpp"

namespace fasta2a {

/// Options of an engine. Every rank must use the same (the engine checks, see options digest).
struct engine_options {
  plan_options planning{};
  /// How long a rank waits for any one signal (or the bootstrap) before the call fails with an
  /// error naming the peer, the channel and the stage.
  std::chrono::milliseconds timeout{30000};
  /// Rail stages whose sends may be leaving this rank at once. A rank posts the rail sends of
  /// stage t as soon as its balance data for t has arrived and fewer than rail_window of its
  /// earlier stages' rail sends are still leaving it (Connection::sent, in any order: a slow flow
  /// into a busy receiver holds one slot, not the whole window). Each rank paces its own NIC, with
  /// no wait for what other ranks receive. Measured on the emulated cluster (README,
  /// examples/cluster): Megatron matrix 0 at 8 servers x 2 ranks 1.11 / 1.01 / 1.02 x LB_server with
  /// windows 3 / 5 / 8; at 4 x 4 windows 3 and 5 are equal, and windows 5, 8, 9 and 16 differ by
  /// less than the run-to-run noise (FAST over libfabric on Zipf(1.0), measured before the MPI
  /// transport's progress fix: median of 3 runs 1.13 / 1.11 / 1.07 / one run 1.12 x LB_server; with
  /// the fix, window 5 gives 1.07). At least 1.
  std::size_t rail_window = 5;
  /// How the engine's own event loop waits when nothing is ready (spin, yield, then sleep with
  /// back-off). Blocking waits inside a transport use that transport's wait_policy.
  wait_policy waiting{};
  /// Buffers that calls register on their own (not windows) stay registered, up to this many; the
  /// least recently used is deregistered first. At least 2 (a call's send and receive buffers).
  std::size_t registration_cache = 8;
  /// Staging per rank as a fraction of the largest buffer of the call: the most bytes any rank
  /// sends or receives (every rank knows every rank's counts, so every rank plans with the same
  /// budget). Where the plan's own staging layout needs more on some rank, the plan shares staging
  /// across stages within this budget (plan_options::staging_budget: stages cut into slot-sized
  /// chunks, slots reused as stages finish), at least staging_floor and one granule per slot.
  /// Where planning.staging_budget is also set, the smaller budget applies. Unset: only
  /// planning.staging_budget limits staging. The engine keeps the largest staging any call needed.
  std::optional<double> staging_fraction = 0.25;
  /// The least staging budget staging_fraction gives a call, in bytes (default_staging_floor: 8
  /// MiB): a call whose buffers are small needs little staging anyway, and cutting its stages into
  /// chunks of a few bytes or KiB would add a synchronisation per chunk (a call of 256 bytes per
  /// rank pair on 2 x 4 ranks: 32 stages at 25% without a floor, 1 with it). 0: none, the
  /// fraction alone. planning.staging_budget, where set, still caps the budget.
  bytes_t staging_floor = default_staging_floor;
  /// A call whose traffic matrix is the last call's transposed (an MoE layer's combine after its
  /// dispatch: every token goes back where it came from, in the same bytes) runs the last call's
  /// plan transposed (transpose_into: the same stages, every piece reversed), and a call whose
  /// matrix is the last call's again runs the same plan, instead of planning: at 64 GPUs a rank's
  /// part then takes about 1 us instead of 10-20 (docs/DESIGN.md, "Plans of the transposed matrix"). Only
  /// where the staging budget is the same too (per-rail plans included). Each rank tests
  /// its own send counts against its row and its column of the last plan's matrix (2n words kept),
  /// before the counts exchange, and sends the two answers in its header: the matrix is the same
  /// where every rank's row is, and transposed where every rank's row is its old column, so every
  /// rank decides the same in O(n). The header also carries the generation of its last plan, so
  /// ranks that did not make the same last plan all plan anew. `last_stats().plan_from` says what a call did.
  /// Off: every call plans.
  bool reuse_plans = true;
  /// Plans kept for reuse_plans, the most recently used first (1 to 32): a call whose matrix is
  /// any kept plan's, or its transposed, runs that plan (the most recent such). One, the default,
  /// is an MoE layer's dispatch and combine in inference. In training set it to the number of MoE
  /// layers that share the engine: each layer's backward calls move the bytes of its forward calls
  /// (the gradient of the combine retraces the dispatch, and that of the dispatch the combine), so
  /// every backward call runs its layer's kept plan, with no planning after the forward pass. Each
  /// kept plan costs a rank its view of the plan, 2 n words, and where staging is not shared across
  /// stages the S x S server matrix; each call tests its row against every kept plan's row and
  /// column (stopping at the first byte count that differs).
  std::size_t plans_kept = 1;
};

/// Where a call's plan came from (engine_options::reuse_plans).
enum class plan_source : std::uint8_t {
  planned,    ///< planned from the call's matrix
  same,       ///< a kept plan (the last call's, or one of plans_kept): the matrix was that plan's
  transposed, ///< a kept plan transposed: the matrix was that plan's transposed
};

inline const char* to_string(plan_source s) noexcept {
  return s == plan_source::planned ? "planned" : s == plan_source::same ? "same" : "transposed";
}

/// Where the time of the last call went (seconds, measured on this rank), and what it cost.
struct call_stats {
  double plan_s = 0;     ///< planning and building the rank program
  double exchange_s = 0; ///< bootstrap exchanges (counts; handles only when registrations changed)
  double execute_s = 0;  ///< moving bytes: copies, balance, rail stages, redistribution
  double total_s = 0;
  int exchanges = 0;     ///< bootstrap exchanges: 1 (counts); +1 when some rank's displacements are not
                         ///< packed (the displacements); +1 when a registration changed on some rank (handles)
  bool recovered = false; ///< this call first rebuilt the connections after a failed call (see engine)
  plan_source plan_from = plan_source::planned; ///< planned, or a kept plan (engine_options::reuse_plans)
  int registrations = 0; ///< register_memory calls this rank made (per transport pair)
  std::size_t puts = 0;  ///< puts this rank issued (after coalescing)
  std::size_t pieces_sent = 0; ///< plan pieces this rank sent (one put each without coalescing)
  /// Shared staging (plan::staging_ring > 0): how long this rank's rail sends, and its balance
  /// puts, were ready but held for a staging credit (a peer's slot not yet released), in seconds.
  double credit_wait_rail_s = 0;
  double credit_wait_balance_s = 0;
};

/// A 64-bit digest of what every rank's view of one plan shares: shape, granule, decomposer,
/// stages and the staging layout.
inline std::uint64_t plan_hash(const plan& p) noexcept {
  std::uint64_t h = 0x9e3779b97f4a7c15ull;
  auto mix = [&](std::uint64_t w) {
    h ^= w + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    h *= 0xff51afd7ed558ccdull;
  };
  mix(static_cast<std::uint64_t>(p.servers) << 32 | static_cast<std::uint32_t>(p.gpus_per_server));
  mix(p.granule);
  mix(p.total_bytes);
  mix(p.staged);
  for (char c : p.decomposer) mix(static_cast<unsigned char>(c));
  for (bytes_t w : p.stage_weight) mix(w);
  for (std::int32_t d : p.stage_perm) mix(static_cast<std::uint32_t>(d));
  for (bytes_t w : p.rail_weight) mix(w);
  for (std::int32_t d : p.rail_perm) mix(static_cast<std::uint32_t>(d));
  for (bytes_t b : p.staging_bytes) mix(b);
  mix(p.staging_ring);
  mix(p.staging_slot);
  return h;
}

namespace detail {

/// Folds words into a 64-bit digest (not cryptographic: it catches misconfiguration, not malice).
class digest {
public:
  void mix(std::uint64_t w) noexcept {
    h_ ^= w + 0x9e3779b97f4a7c15ull + (h_ << 6) + (h_ >> 2);
    h_ *= 0xff51afd7ed558ccdull;
  }
  void mix(double x) noexcept { mix(std::bit_cast<std::uint64_t>(x)); }
  void mix(const char* s) noexcept {
    for (; s && *s; ++s) mix(static_cast<std::uint64_t>(static_cast<unsigned char>(*s)));
    mix(std::uint64_t{0xff});
  }
  std::uint64_t value() const noexcept { return h_; }

private:
  std::uint64_t h_ = 0x2545f4914f6cdd1dull;
};

} // namespace detail

/// Whether the engine registers memory of kind k with `out` directly: the transport says it can
/// register that kind (static `Out::can_register(k)`) and, where it also answers at run time
/// (RegistersAtRunTime), says yes there too. Otherwise the engine moves the scale-out data through
/// host bounce buffers (see engine).
template <class Out>
bool registers_directly(const Out& out, memory_kind k) {
  if (!Out::can_register(k)) return false;
  if constexpr (RegistersAtRunTime<Out>) return static_cast<bool>(out.registers(k));
  else return true;
}

namespace detail {
template <class M>
struct event_of {
  using type = int;
};
template <StreamMemorySpace M>
struct event_of<M> {
  using type = typename M::event_type;
};

// What the engine asks of its planner: a rank's part of the plan, and the staging budget of a
// call. Behind a virtual call so that engine_core does not depend on the decomposer.
class rank_planner {
public:
  virtual ~rank_planner() = default;
  virtual void make_rank_into(const traffic_view& t, rank_t r, plan& p) = 0;
  virtual void set_staging_budget(bytes_t bytes) = 0;
  /// M of the last plan (planner::rail_matrix), for transposing it.
  virtual const server_matrix& rail_matrix() const = 0;
  /// Every rank's balance bytes in the last plan (planner::balance_bytes), for transposing a
  /// per-rail plan.
  virtual std::vector<bytes_t> balance_bytes() const = 0;
};

template <Topology Topo, Decomposer D>
class rank_planner_of final : public rank_planner {
public:
  rank_planner_of(const Topo& topo, const plan_options& opt, const D& dec) : planner_(topo, opt, dec) {}
  void make_rank_into(const traffic_view& t, rank_t r, plan& p) override { planner_.make_rank_into(t, r, p); }
  void set_staging_budget(bytes_t bytes) override { planner_.set_staging_budget(bytes); }
  const server_matrix& rail_matrix() const override { return planner_.rail_matrix(); }
  std::vector<bytes_t> balance_bytes() const override { return planner_.balance_bytes(); }

private:
  planner<Topo, D> planner_;
};
} // namespace detail

/// The two-phase all-to-allv engine of one rank, composed at compile time from a Topology, a
/// Bootstrap, a scale-up and a scale-out Transport, a Decomposer and a MemorySpace (where staging
/// lives and how local copies are made; host memory by default).
///
/// A call:
/// 1. looks up the send and receive buffers among this engine's registrations (registering them
///    on a miss: registrations last, see `register_window` and engine_options::registration_cache);
/// 2. makes ONE bootstrap exchange: the bytes it sends to each rank, its verdict on its own
///    arguments, a digest of its options (topology, plan options, decomposer, engine options) so
///    that a rank configured differently is caught before any byte moves, a check of its receive
///    counts (so that counts that disagree fail every rank), whether its displacements are packed
///    (messages in rank order, back to back: then every rank derives them from the send counts),
///    and the id of its receive registration; only where some rank's displacements are not packed
///    does a second exchange carry them;
/// 3. plans its own part of the plan (every rank computes the same plan from the same matrix: the
///    gathered send counts, read in place);
/// 4. only when some rank's receive registration is new to its peers, or some rank's staging had
///    to grow, a further exchange carries the new memory handles (every rank knows from step 2 and
///    the plan whether this happens, so all agree);
/// 5. builds its rank program (program.hpp: puts of contiguous runs coalesced) and runs it: self and
///    intra-server copies, then the stages as an event loop (balance puts rail_window stages
///    ahead, a rank sends stage t on its rail once its balance data for t has arrived and fewer than
///    rail_window of its earlier stages' rail sends are still leaving it, each stage redistributed
///    as soon as its rail data lands).
///
/// The engine has its own connection on each transport (several engines may share transports).
/// Staging memory is sized from the plan, grown when a plan needs more, and reused across calls.
///
/// Memory (issue 12): a rank's state grows as n^2 words at most, for n ranks of S servers of G
/// GPUs. The counts exchange gathers n (n + 10) words, the traffic matrix itself, which the rank
/// keeps until its next call and plans from in place; ranks that are threads of one process share
/// one copy (SharedBootstrap: host_bootstrap), other bootstraps give each rank its own. Displacements
/// that are not packed add n^2 words per side. Everything else is O(n G) words per rank (prefix
/// sums of its server's messages, 4 G n; signal counts, 20 n; what it knows of each peer's
/// registrations), plus its planner's scratch for a rank view (planner_scratch_bytes: the S^2
/// server-pair work of decomposing the server matrix, O(S G) besides) and its plan and program,
/// which grow with the stages the decomposer makes. At 4096 ranks (512 x 8): the gathered counts
/// 134.5 MB (per process on threads, per rank over MPI), about 3 MB of other engine state per
/// rank, and 11 MB of the planner's rank-view scratch per rank.
///
/// Scale-out from memory the scale-out transport cannot register (device memory over an MPI that
/// is not CUDA-aware: `registers_directly` is false): every buffer registered with the scale-out
/// transport is a host mirror of the same size (pinned where the memory space allocates pinned
/// host memory, `allocate_host`), at the same offsets. Before the scale-out puts of a section the
/// engine copies their bytes device -> mirror (M::copy, then M::synchronize), the transport sends
/// from the mirror into the receiver's mirror, and once a scale-out wait has covered them the
/// receiver copies them mirror -> device before anything reads them. Cost: one extra copy each
/// way over the host link and one round trip to the host per section that crosses, and host
/// memory as large as the device memory registered (send, receive, staging, windows). M::copy must
/// copy between host and M memory in both directions.
///
/// Stream-ordered calls (memory spaces with streams, StreamMemorySpace): the form taking a
/// stream checks, registers, exchanges counts, plans and builds the program in the calling thread
/// (so bad arguments raise at once, on every rank, as with the host form), then returns without
/// waiting for the bytes: the caller's stream records an event and waits on a flag in device
/// memory. A proxy thread of the engine waits for the event (the caller's earlier work, which
/// writes the send buffer and may read the receive buffer, has completed), tells the peers that
/// put into this rank that it is ready (a signal on a channel of its own: no peer writes into a
/// buffer that the caller's stream has not released yet, nor into staging a previous call still
/// uses), waits for the same from the peers it puts into, runs the rank program (copies on the
/// memory space's stream, puts and signals on the transports, waits by polling), and writes the
/// flag, which releases the caller's stream: work enqueued after the call sees every byte. Calls
/// run in the order they were made. A call that must change what earlier queued calls use
/// (register or evict a buffer, grow staging, exchange or open handles) first waits, in the
/// calling thread, for those calls to finish executing. An error while executing is kept:
/// `async_error()` reports it, the next call (and `synchronize()`) raises it, the caller's stream
/// is released anyway (it never hangs), and later queued calls are released without running.
///
/// Errors and what survives them:
/// - An error raised before execution (bad arguments, counts or options that disagree) leaves the
///   engine as it was: nothing moved.
/// - An error once bytes may move (a peer that did not signal in time, a transport error, a
///   failure opening a peer's handle) ABANDONS the call on this rank before the error reaches the
///   caller: the memory peers write into (this call's receive registration and the staging) is
///   revoked on the transports (host: a late put fails instead of copying; libfabric and verbs:
///   the memory registration is closed, so a late RDMA write fails at the NIC), and the
///   connections are dropped (MPI: posted receives are cancelled). So when the call returns, by
///   an error or normally, nothing is still writing into the caller's buffers, and the caller may
///   free them at once. Exception: a transport whose `late_writes_revoked` is false (the GPU IPC
///   transport: CUDA IPC mappings cannot be revoked by their exporter) cannot stop a late peer;
///   keep the buffers alive until every rank has returned from the call.
/// - The engine stays usable: the next call's exchange carries each rank's "my last call failed"
///   flag, and when any rank raised it, EVERY rank recovers before anything moves: it makes new
///   connections on both transports (fresh signal counters: a stale signal or put of the failed
///   call lands on the old connection, MPI's old communicator or the old connection id of a
///   libfabric or verbs signal, and never counts toward a later call), forgets its peers' handles
///   and re-exchanges them, and re-registers what it revoked. `last_stats().recovered` says so.
/// - A failed bootstrap exchange (a peer that never arrived) cannot be recovered from: the
///   bootstrap's collective is abandoned (MPI cannot cancel one). Every later call raises an error
///   saying so: destroy the engine and its bootstrap and transports on every rank and make new
///   ones (as ncclCommAbort then ncclCommInitRank).
/// - Over MPI, a send the failed rank had started may still read its send buffer until the peer it
///   goes to has returned from the call too (MPI cannot cancel a send); the next call's exchange
///   passes only after every rank has returned.
///
/// Compiled once per decomposer only where it must be: `engine` is a thin shell that makes the
/// planner (the one part that depends on the decomposer) and hands it to `engine_core`, which holds
/// everything else and is compiled once per topology, bootstrap, transports and memory space. A
/// program (the CLI, a test) that offers several decomposers compiles the engine once, not once
/// per decomposer; the plan is made through one virtual call per all-to-allv.
template <Topology Topo, Bootstrap Boot, Transport Up, Transport Out, MemorySpace M>
class engine_core {
  static_assert(Up::can_register(M::kind), "the scale-up transport cannot register the memory space's memory");

public:
  /// A buffer registered for use in later calls, like an NCCL window or an MPI window: any call
  /// whose send or receive buffer lies inside it uses this registration. Deregistered when the
  /// window is destroyed (the engine must still exist then). Move-only.
  class window {
  public:
    window() = default;
    window(window&& o) noexcept : eng_(std::exchange(o.eng_, nullptr)), id_(o.id_), bytes_(o.bytes_) {}
    window& operator=(window&& o) noexcept {
      if (this != &o) {
        release();
        eng_ = std::exchange(o.eng_, nullptr);
        id_ = o.id_;
        bytes_ = o.bytes_;
      }
      return *this;
    }
    window(const window&) = delete;
    window& operator=(const window&) = delete;
    ~window() { release(); }
    /// The registered bytes.
    std::span<std::byte> bytes() const noexcept { return bytes_; }
    /// Deregisters now (also done by the destructor).
    void release() noexcept {
      if (eng_) eng_->drop_registration(id_);
      eng_ = nullptr;
    }

  private:
    friend class engine_core;
    window(engine_core* e, std::uint64_t id, std::span<std::byte> b) : eng_(e), id_(id), bytes_(b) {}
    engine_core* eng_ = nullptr;
    std::uint64_t id_ = 0;
    std::span<std::byte> bytes_{};
  };

  /// As engine's (below), given the planner and the digest of its decomposer.
  engine_core(Topo topo, Boot& boot, Up& scaleup, Out& scaleout, engine_options opt, M mem,
              std::unique_ptr<detail::rank_planner> planner, std::uint64_t decomposer_digest)
      : planner_(std::move(planner)), boot_(&boot), up_(&scaleup), out_(&scaleout), opt_(opt),
        mem_(std::move(mem)), bounce_(!registers_directly(scaleout, M::kind)) {
    n_ = topo.ranks();
    G_ = topo.gpus_per_server();
    me_ = boot.rank();
    if (boot.size() != n_)
      throw error("engine: the bootstrap has " + std::to_string(boot.size()) + " ranks, the topology " +
                  std::to_string(topo.servers()) + " x " + std::to_string(topo.gpus_per_server()) +
                  " = " + std::to_string(n_));
    if (opt_.rail_window < 1) throw error("engine: rail_window must be at least 1");
    if (opt_.staging_fraction && !(*opt_.staging_fraction > 0 && std::isfinite(*opt_.staging_fraction)))
      throw error("engine: staging_fraction must be above 0 (got " + std::to_string(*opt_.staging_fraction) + ")");
    if (opt_.planning.staging_slots < 1) throw error("engine: planning.staging_slots must be at least 1");
    if (opt_.registration_cache < 2) throw error("engine: registration_cache must be at least 2 (send and receive)");
    if (opt_.plans_kept < 1 || opt_.plans_kept > max_plans_kept)
      throw error("engine: plans_kept must be 1 to " + std::to_string(max_plans_kept) + " (got " +
                  std::to_string(opt_.plans_kept) + ")");
    if (bounce_ && !Out::can_register(memory_kind::host))
      throw error(std::string("engine: the scale-out transport registers neither ") + to_string(M::kind) +
                  " memory nor host memory to bounce it through");
    digest_ = options_digest(topo, decomposer_digest);
    up_conn_.emplace(up_->connect(channels));
    out_conn_.emplace(out_->connect(channels));
    expected_.assign(static_cast<std::size_t>(n_) * 2 * channels, 0);
    signalled_.assign(static_cast<std::size_t>(n_) * 2 * channels, 0);
    known_.resize(static_cast<std::size_t>(n_));
    peer_staging_.resize(static_cast<std::size_t>(n_));
    staging_cap_.assign(static_cast<std::size_t>(n_), 0);
  }
  engine_core(const engine_core&) = delete;
  engine_core& operator=(const engine_core&) = delete;

  /// Waits for queued stream-ordered calls to finish executing (their errors are dropped), then
  /// deregisters every buffer this engine registered and forgets its peers' handles. The caller's
  /// streams must have passed the engine's last call before it is destroyed (they wait on a flag
  /// the engine owns), as a communicator is destroyed only after its work.
  ~engine_core() {
    stop_proxy();
    settle(); // what a failed call revoked is not released twice
    try {
      mem_.synchronize(); // the last release flag write is done before the flag is freed
    } catch (...) {
    }
    for (auto& peer : known_)
      for (remote_entry& e : peer) forget(e);
    for (peer_stage& s : peer_staging_) forget(s);
    for (registration& r : regs_) deregister(r);
    if (staging_reg_) deregister(*staging_reg_);
  }

  rank_t rank() const noexcept { return me_; }
  rank_t ranks() const noexcept { return n_; }
  /// Bytes of staging memory this rank holds (grown to the largest plan so far).
  bytes_t staging_bytes() const noexcept { return staging_.size(); }
  /// This rank's view of the last call's plan.
  const plan& last_plan() const noexcept { return plan_(); }
  /// This rank's program of the last call.
  const rank_program& last_program() const noexcept { return cur_.program; }
  const call_stats& last_stats() const noexcept { return stats_; }
  /// The digest of this engine's options that every rank compares in each call.
  std::uint64_t options_digest() const noexcept { return digest_; }
  /// Buffers registered now: windows and cached ones (staging not counted).
  std::size_t registered_buffers() const noexcept { return regs_.size(); }
  /// Whether scale-out data goes through host bounce buffers (see the class comment).
  bool bounces() const noexcept { return bounce_; }

  /// The error of a stream-ordered call that failed while executing, or "" (like
  /// ncclCommGetAsyncError). The next call (or `synchronize()`) raises it once and clears it; the
  /// call after that recovers (see the class comment).
  std::string async_error() const {
    std::lock_guard l(qm_);
    return async_error_;
  }
  /// Stream-ordered calls made but not yet finished executing (queued or running).
  std::size_t pending() const {
    std::lock_guard l(qm_);
    return queue_.size() + (busy_ ? 1 : 0);
  }
  /// Waits until every stream-ordered call made so far has finished executing (the caller's
  /// streams are released by then, or about to be), then raises an asynchronous error if any.
  void synchronize() {
    drain();
    raise_async_error();
  }

  /// Registers `buf` for later calls: a call whose send or receive buffer lies inside it needs no
  /// registration of its own. Local (not collective). Throws whatever the transports throw.
  window register_window(std::span<std::byte> buf) {
    drain();
    registration& r = add_registration(buf.data(), buf.size(), true);
    return window(this, r.id, buf);
  }

  /// Forgets cached registrations that contain `p`: call it before freeing a buffer that calls used
  /// and may be reused at the same address for other memory (a transport that maps or pins memory
  /// would otherwise keep the old mapping). Windows are released by their own handle.
  void forget_buffer(const void* p) noexcept {
    drain();
    settle();
    const auto* b = static_cast<const std::byte*>(p);
    for (std::size_t i = 0; i < regs_.size();)
      if (!regs_[i].window && regs_[i].ptr <= b && b < regs_[i].ptr + std::max<std::size_t>(regs_[i].size, 1)) {
        deregister(regs_[i]);
        regs_.erase(regs_.begin() + static_cast<std::ptrdiff_t>(i));
      } else {
        ++i;
      }
  }

  /// All-to-allv, as MPI_Alltoallv and torch.distributed.all_to_all_single: this rank sends
  /// send_counts[j] elements starting at element send_displs[j] of `send` to rank j, and receives
  /// recv_counts[i] elements from rank i at element recv_displs[i] of `recv`. Elements are
  /// elem_size bytes. Every rank must call it with consistent counts. Errors (counts that do not
  /// fit the buffers, counts that disagree between ranks, ranks configured differently, a peer that
  /// does not signal within the timeout) are raised on every rank that can see them, before any
  /// byte moves where possible.
  void alltoallv(std::span<const std::byte> send, std::span<const std::uint64_t> send_counts,
                 std::span<const std::uint64_t> send_displs, std::span<std::byte> recv,
                 std::span<const std::uint64_t> recv_counts, std::span<const std::uint64_t> recv_displs,
                 std::size_t elem_size = 1) {
    using clock = std::chrono::steady_clock;
    const auto t0 = clock::now();
    raise_async_error();
    drain(); // queued stream-ordered calls finish first: this call runs in the calling thread
    prepare(send, send_counts, send_displs, recv, recv_counts, recv_displs, elem_size, false, {});
    const auto t4 = clock::now();
    try {
      execute(cur_);
    } catch (...) {
      abandon(&cur_.recv_reg, staging_reg_ ? &*staging_reg_ : nullptr);
      throw;
    }
    const auto t5 = clock::now();
    stats_.execute_s = std::chrono::duration<double>(t5 - t4).count();
    stats_.total_s = std::chrono::duration<double>(t5 - t0).count();
  }

  /// Typed form: counts and displacements in elements of T.
  template <class T>
  void alltoallv(std::span<const T> send, std::span<const std::uint64_t> send_counts,
                 std::span<const std::uint64_t> send_displs, std::span<T> recv,
                 std::span<const std::uint64_t> recv_counts, std::span<const std::uint64_t> recv_displs) {
    alltoallv(std::as_bytes(send), send_counts, send_displs, std::as_writable_bytes(recv), recv_counts,
              recv_displs, sizeof(T));
  }

  /// Stream-ordered form, for buffers in the memory space's memory (device buffers with
  /// gpu_memory): the same arguments, counts and displacements on the host, and the caller's
  /// `stream`. Checks, exchanges the counts and plans now, in the calling thread (errors in the
  /// arguments raise here, on every rank, as in the host form), then returns without waiting for
  /// the bytes: work enqueued on `stream` before the call is complete before any byte of the call
  /// is read or written, and work enqueued on it after the call sees every byte received. Every
  /// rank must make the same calls in the same order, all host form or all stream form per call.
  ///
  /// Until `stream` has passed the call, the caller must keep alive: the send and receive
  /// buffers (and not write the send buffer nor touch the receive buffer except through work
  /// enqueued on `stream`), the stream itself, and the engine. The counts and displacements are
  /// copied: their arrays may be reused as soon as the call returns.
  ///
  /// Raises an earlier call's asynchronous error (see async_error) before doing anything. `stream`
  /// must not be the memory space's own stream (the engine works on that one while the caller's
  /// waits): every rank is told, as for bad arguments.
  template <class S>
    requires StreamOf<M, S>
  void alltoallv(std::span<const std::byte> send, std::span<const std::uint64_t> send_counts,
                 std::span<const std::uint64_t> send_displs, std::span<std::byte> recv,
                 std::span<const std::uint64_t> recv_counts, std::span<const std::uint64_t> recv_displs, S stream,
                 std::size_t elem_size = 1) {
    using clock = std::chrono::steady_clock;
    const auto t0 = clock::now();
    raise_async_error();
    std::string problem;
    if (stream == static_cast<S>(mem_.stream()))
      problem = "the stream passed is the memory space's own stream, on which the engine works: pass the caller's stream";
    prepare(send, send_counts, send_displs, recv, recv_counts, recv_displs, elem_size, true, problem);
    enqueue(stream);
    stats_.total_s = std::chrono::duration<double>(clock::now() - t0).count();
  }

  /// Typed stream-ordered form.
  template <class T, class S>
    requires StreamOf<M, S>
  void alltoallv(std::span<const T> send, std::span<const std::uint64_t> send_counts,
                 std::span<const std::uint64_t> send_displs, std::span<T> recv,
                 std::span<const std::uint64_t> recv_counts, std::span<const std::uint64_t> recv_displs, S stream) {
    alltoallv(std::as_bytes(send), send_counts, send_displs, std::as_writable_bytes(recv), recv_counts,
              recv_displs, stream, sizeof(T));
  }

private:
  using up_conn = typename Up::connection;
  using out_conn = typename Out::connection;
  using bounce_buffer = typename detail::host_buffer_of<M>::type;
  /// The engine's channels: the program's, and one on which a rank tells a peer that it is ready
  /// for the peer's puts of a stream-ordered call.
  static constexpr channel_id ready_channel = engine_channel::count;
  static constexpr channel_id channels = engine_channel::count + 1;

  /// A buffer registered with both transports.
  struct registration {
    std::byte* ptr = nullptr;
    std::size_t size = 0;
    typename Up::memory up{};
    typename Out::memory out{};
    std::shared_ptr<bounce_buffer> mirror; ///< bouncing: the host mirror registered with the scale-out transport
    std::uint64_t id = 0;   ///< unique over this engine's life; never reused
    std::uint64_t used = 0; ///< the call that used it last (LRU)
    bool window = false;
    bool revoked = false; ///< revoked by a failed call: registered again when next used
  };
  /// What this rank knows of a peer's receive registration: its id and the handles it opened
  /// (scale-up for peers of its server, scale-out for the others).
  /// The handles are opened only when this rank first puts into the registration: then its owner
  /// is inside the call that uses it (it waits for this rank's signal), so its memory is alive. A
  /// rank that has nothing to put never opens it, even if its owner frees it at once.
  struct remote_entry {
    std::uint64_t id = 0;
    std::uint64_t used = 0;
    std::vector<std::byte> blob; ///< the handle (scale-up for peers of this server, else scale-out)
    std::optional<typename Up::remote> up;
    std::optional<typename Out::remote> out;
  };
  struct peer_stage {
    std::uint64_t id = 0;
    std::optional<typename Up::remote> up;
    std::optional<typename Out::remote> out;
  };

  // The counts exchange: per rank a blob of n + header_words words, the bytes it sends to each
  // rank, then a header. The gathered blobs are the traffic matrix with an outer stride (row i:
  // the first n words of rank i's blob), which the planner reads in place. Receive counts and
  // displacements are not gathered (see exchange_counts).
  enum header : std::size_t {
    h_verdict, h_elem, h_digest, h_recv_id, h_recv_base, h_ordered,
    h_recv_check, ///< its receive counts' check: the sum of bytes x check_weight(sender), mod 2^64
    h_packed,     ///< bit 0: its send displacements are packed, bit 1: its receive displacements
    h_send_first, ///< packed send displacements: where the first message starts (bytes)
    h_recv_first, ///< packed receive displacements: likewise
    h_failed,     ///< its last call failed once bytes could move: every rank recovers (see recover)
    h_buffer,     ///< the larger of the bytes it sends and the bytes it receives (the staging budget's base)
    h_plan,       ///< the generation of its last plan, 0 if none can be reused (engine_options::reuse_plans)
    h_match,      ///< its send counts against the kept plans' (reuse_plans): bit 2i its row of plan i's matrix, 2i + 1 its column
    header_words
  };
  static constexpr std::uint64_t send_packed = 1, recv_packed = 2;
  static constexpr std::size_t max_plans_kept = 32; // two bits each in h_match
  std::size_t counts_words() const noexcept { return static_cast<std::size_t>(n_) + header_words; }
  /// Header word k of rank r's blob in the last counts exchange.
  std::uint64_t word(rank_t r, std::size_t k) const noexcept {
    return all_[static_cast<std::size_t>(r) * counts_words() + static_cast<std::size_t>(n_) + k];
  }
  /// Bytes rank i sends rank j in this call.
  bytes_t sent(rank_t i, rank_t j) const noexcept { return all_[static_cast<std::size_t>(i) * counts_words() + static_cast<std::size_t>(j)]; }
  /// The traffic matrix of this call, in place in the gathered counts.
  traffic_view traffic() const noexcept {
    return Eigen::Map<const traffic_matrix, 0, Eigen::OuterStride<>>(all_, n_, n_, Eigen::OuterStride<>(static_cast<Eigen::Index>(counts_words())));
  }
  /// Rank r's weight in a receive check: odd, so that a single count off by d != 0 changes the
  /// check by d * weight != 0 (mod 2^64).
  static std::uint64_t check_weight(rank_t r) noexcept {
    std::uint64_t z = static_cast<std::uint64_t>(r) + 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return (z ^ (z >> 31)) | 1;
  }

  // Where messages sit, for the program builder. Packed displacements (every message with bytes
  // in rank order, back to back, from a first offset) are derived from the gathered send counts:
  // a rank's program needs offsets only of messages whose source or destination is on its server
  // (every piece it sends, receives, balances or redistributes is one), so it keeps their prefix
  // sums, 4 G n words. Displacements of other shapes come from a second exchange.
  bytes_t send_displ(rank_t src, rank_t dst) const noexcept {
    if (send_displs_) return send_displs_[static_cast<std::size_t>(src) * displ_words_ + static_cast<std::size_t>(dst)];
    const bytes_t first = word(src, h_send_first);
    const auto nn = static_cast<std::size_t>(n_), G = static_cast<std::size_t>(G_);
    if (same_server(src, me_)) return first + send_rows_[static_cast<std::size_t>(src - home_) * nn + static_cast<std::size_t>(dst)];
    if (same_server(dst, me_)) return first + send_cols_[static_cast<std::size_t>(src) * G + static_cast<std::size_t>(dst - home_)];
    bytes_t at = first; // no program asks for this one; correct, not fast
    for (rank_t k = 0; k < dst; ++k) at += sent(src, k);
    return at;
  }
  bytes_t recv_displ(rank_t dst, rank_t src) const noexcept {
    if (recv_displs_) return recv_displs_[static_cast<std::size_t>(dst) * displ_words_ + static_cast<std::size_t>(src)];
    const bytes_t first = word(dst, h_recv_first);
    const auto nn = static_cast<std::size_t>(n_);
    if (same_server(dst, me_)) return first + recv_cols_[static_cast<std::size_t>(dst - home_) * nn + static_cast<std::size_t>(src)];
    if (same_server(src, me_)) return first + recv_rows_[static_cast<std::size_t>(src - home_) * nn + static_cast<std::size_t>(dst)];
    bytes_t at = first; // no program asks for this one; correct, not fast
    for (rank_t k = 0; k < src; ++k) at += sent(k, dst);
    return at;
  }

  /// Where messages sit, for the program builder: from the counts exchange.
  struct layout {
    const engine_core* e;
    bytes_t send_offset(rank_t src, rank_t dst) const noexcept { return e->send_displ(src, dst); }
    bytes_t recv_offset(rank_t dst, rank_t src) const noexcept { return e->recv_displ(dst, src); }
  };

  std::uint64_t options_digest(const Topo& topo, std::uint64_t decomposer_digest) const {
    detail::digest h;
    h.mix(static_cast<std::uint64_t>(topo.servers()));
    h.mix(static_cast<std::uint64_t>(topo.gpus_per_server()));
    h.mix(static_cast<std::uint64_t>(topo.scaleup()));
    h.mix(static_cast<double>(topo.scaleup_bandwidth()));
    h.mix(static_cast<double>(topo.scaleout_bandwidth()));
    h.mix(static_cast<double>(topo.scaleout_alpha()));
    h.mix(opt_.planning.granule);
    h.mix(static_cast<std::uint64_t>(opt_.planning.max_plan_bytes));
    h.mix(static_cast<std::uint64_t>(opt_.planning.direct_if_faster_alpha.has_value()));
    h.mix(opt_.planning.direct_if_faster_alpha.value_or(0.0));
    h.mix(static_cast<std::uint64_t>(opt_.registration_cache));
    h.mix(opt_.planning.staging_budget);
    h.mix(static_cast<std::uint64_t>(opt_.planning.staging_slots));
    h.mix(static_cast<std::uint64_t>(opt_.planning.rails));
    h.mix(static_cast<std::uint64_t>(opt_.staging_fraction.has_value()));
    h.mix(opt_.staging_fraction.value_or(0.0));
    h.mix(opt_.staging_floor);
    h.mix(static_cast<std::uint64_t>(opt_.reuse_plans)); // every rank must decide alike
    h.mix(static_cast<std::uint64_t>(opt_.plans_kept));
    h.mix(decomposer_digest);
    h.mix(static_cast<std::uint64_t>(M::kind));
    h.mix(static_cast<std::uint64_t>(Up::handle_bytes));
    h.mix(static_cast<std::uint64_t>(Out::handle_bytes));
    return h.value();
  }

  // This call's staging budget (engine_options::staging_fraction, staging_budget_for): the same on
  // every rank, from the gathered headers.
  bytes_t staging_budget() const noexcept {
    std::uint64_t largest = 0;
    for (rank_t r = 0; r < n_; ++r) largest = std::max(largest, word(r, h_buffer));
    return staging_budget_for(largest, *opt_.staging_fraction, opt_.planning, opt_.staging_floor);
  }

  std::string check_arguments(std::span<const std::byte> send, std::span<const std::uint64_t> send_counts,
                               std::span<const std::uint64_t> send_displs, std::span<std::byte> recv,
                               std::span<const std::uint64_t> recv_counts,
                               std::span<const std::uint64_t> recv_displs, std::size_t elem_size) const {
    const auto n = static_cast<std::size_t>(n_);
    if (elem_size == 0) return "element size is 0";
    if (send_counts.size() != n || send_displs.size() != n || recv_counts.size() != n || recv_displs.size() != n)
      return "counts and displacements need " + std::to_string(n) + " entries each (got send " +
             std::to_string(send_counts.size()) + "/" + std::to_string(send_displs.size()) + ", receive " +
             std::to_string(recv_counts.size()) + "/" + std::to_string(recv_displs.size()) + ")";
    auto fits = [&](const char* side, std::span<const std::uint64_t> counts, std::span<const std::uint64_t> displs,
                    std::size_t capacity) -> std::string {
      for (std::size_t j = 0; j < n; ++j) {
        std::uint64_t end, bytes;
        if (__builtin_add_overflow(displs[j], counts[j], &end) || __builtin_mul_overflow(end, elem_size, &bytes))
          return std::string(side) + " counts[" + std::to_string(j) + "] + displs[" + std::to_string(j) +
                 "] overflows 64 bits";
        if (bytes > capacity)
          return std::string(side) + " counts[" + std::to_string(j) + "] = " + std::to_string(counts[j]) +
                 " at displs[" + std::to_string(j) + "] = " + std::to_string(displs[j]) + " ends at byte " +
                 std::to_string(bytes) + ", past the " + side + " buffer's " + std::to_string(capacity) + " bytes";
      }
      return {};
    };
    if (auto s = fits("send", send_counts, send_displs, send.size()); !s.empty()) return s;
    return fits("receive", recv_counts, recv_displs, recv.size());
  }

  // --- one call, up to execution ---------------------------------------------------------

  /// What execution reads: a copy goes with a stream-ordered call into the proxy's queue.
  struct exec {
    rank_program program;
    bool staged = false;
    bool rails_apart = false;     ///< per-rail plan: each rail follows stages of its own (plan::per_rail)
    bool ordered = false;         ///< stream form: peers say they are ready first
    std::uint64_t seq = 0;        ///< stream form: the value of the release flag when done
    std::vector<bytes_t> peer_recv_base;
    registration send_reg, recv_reg, staging_reg;
    std::byte *send_ptr = nullptr, *recv_ptr = nullptr, *staging_ptr = nullptr;
    bytes_t send_base = 0, recv_base = 0;
    std::vector<remote_entry*> peer_recv;
    std::vector<std::vector<instr>> bounce_in; ///< bouncing: scale-out expects per stage (last: finish)
  };

  // Everything of a call before execution, in the calling thread; fills cur_.
  void prepare(std::span<const std::byte> send, std::span<const std::uint64_t> send_counts,
               std::span<const std::uint64_t> send_displs, std::span<std::byte> recv,
               std::span<const std::uint64_t> recv_counts, std::span<const std::uint64_t> recv_displs,
               std::size_t elem_size, bool ordered, std::string problem) {
    using clock = std::chrono::steady_clock;
    const auto t0 = clock::now();
    stats_ = {};
    ++clock_;
    if (!gone_.empty())
      throw error("rank " + std::to_string(me_) + ": this engine is unusable since " + gone_ +
                  ": destroy it, its bootstrap and its transports on every rank and make new ones");
    settle(true);
    if (problem.empty())
      problem = check_arguments(send, send_counts, send_displs, recv, recv_counts, recv_displs, elem_size);
    // A rank with bad arguments still takes part in the exchange, so every rank learns it.
    registration* sreg = nullptr;
    registration* rreg = nullptr;
    if (problem.empty()) {
      try {
        sreg = &lookup(const_cast<std::byte*>(send.data()), send.size());
        rreg = &lookup(recv.data(), recv.size());
        sreg = &lookup(const_cast<std::byte*>(send.data()), send.size()); // the recv lookup may have moved it
      } catch (const std::exception& e) {
        problem = std::string("registering its buffers: ") + e.what();
      }
    }
    const int counted = exchange_counts(problem, rreg, recv, send_counts, send_displs, recv_counts, recv_displs, elem_size, ordered);
    const auto t1 = clock::now();
    const bytes_t budget = opt_.staging_fraction ? staging_budget() : 0;
    if (opt_.staging_fraction) planner_->set_staging_budget(budget);
    make_plan(budget);
    const bool handles = staging_and_handles_needed();
    const auto t2 = clock::now();
    // From here on peers may put into this rank's buffers: an error abandons the call.
    try {
      if (handles) {
        drain();
        exchange_handles(*rreg);
      }
    } catch (...) {
      abandon(rreg, staging_reg_ ? &*staging_reg_ : nullptr);
      throw;
    }
    const auto t3 = clock::now();
    try {
      builder_.build(plan_(), me_, layout{this}, cur_.program);
      bind(cur_, *sreg, send, *rreg, recv);
    } catch (...) {
      abandon(rreg, staging_reg_ ? &*staging_reg_ : nullptr);
      throw;
    }
    cur_.ordered = ordered;
    const auto t4 = clock::now();
    auto sec = [](auto a, auto b) { return std::chrono::duration<double>(b - a).count(); };
    stats_.plan_s = sec(t1, t2) + sec(t3, t4);
    stats_.exchange_s = sec(t0, t1) + sec(t2, t3);
    stats_.exchanges = counted + (handles ? 1 : 0);
    stats_.puts = cur_.program.puts();
    stats_.pieces_sent = cur_.program.pieces_sent();
  }

  // --- stream-ordered calls: the queue and the proxy thread ------------------------------------

  struct stream_job {
    exec x;
    std::optional<typename detail::event_of<M>::type> start;
  };

  void raise_async_error() {
    std::lock_guard l(qm_);
    if (async_error_.empty()) return;
    const std::string e = std::exchange(async_error_, std::string());
    throw error("an earlier stream-ordered all-to-allv failed: " + e + " (raised once; the next call recovers)");
  }
  // Waits until no stream-ordered call is queued or running (never throws).
  void drain() noexcept {
    std::unique_lock l(qm_);
    qcv_.wait(l, [&] { return queue_.empty() && !busy_; });
  }

  template <class S>
  void enqueue(S stream) {
    if constexpr (StreamMemorySpace<M>) {
      if (!flag_.data()) {
        flag_ = mem_.allocate(sizeof(std::uint64_t));
        const std::uint64_t zero = 0;
        mem_.copy(flag_.data(), reinterpret_cast<const std::byte*>(&zero), sizeof zero);
        mem_.synchronize();
      }
      if (!proxy_.joinable()) proxy_ = std::thread([this] { proxy_loop(); });
      auto job = std::make_unique<stream_job>();
      job->x = cur_;
      job->x.seq = ++release_seq_;
      job->start.emplace(mem_.record(stream));
      mem_.wait_value(stream, reinterpret_cast<std::uint64_t*>(flag_.data()), job->x.seq);
      {
        std::lock_guard l(qm_);
        queue_.push_back(std::move(job));
      }
      qcv_.notify_all();
    }
  }

  void stop_proxy() noexcept {
    if (!proxy_.joinable()) return;
    {
      std::lock_guard l(qm_);
      stop_ = true;
    }
    qcv_.notify_all();
    proxy_.join();
  }

  // The proxy: one queued call after another, each after the caller's stream reached it; the
  // caller's stream is released (the flag written) whatever happens.
  void proxy_loop() {
    if constexpr (StreamMemorySpace<M>) {
      for (;;) {
        std::unique_ptr<stream_job> job;
        bool failed;
        {
          std::unique_lock l(qm_);
          qcv_.wait(l, [&] { return stop_ || !queue_.empty(); });
          if (queue_.empty()) return;
          job = std::move(queue_.front());
          queue_.pop_front();
          busy_ = true;
          failed = !async_error_.empty() || failed_; // after a failure, queued calls are released unrun
        }
        std::string err;
        if (!failed) {
          try {
            const bool reached = detail::poll_until([&] { return static_cast<bool>(job->start->done()); }, opt_.waiting,
                                                    opt_.timeout);
            if (!reached)
              throw timeout_error("rank " + std::to_string(me_) + ": the caller's stream did not reach stream-ordered call " +
                          std::to_string(job->x.seq) + " within " + std::to_string(opt_.timeout.count()) + " ms");
            execute(job->x);
          } catch (const std::exception& e) {
            err = e.what();
            if (err.empty()) err = "(an error without a message)";
            // Revoked before the caller's stream is released: nothing writes after it passes.
            abandon(&job->x.recv_reg, job->x.staging_reg.id ? &job->x.staging_reg : nullptr);
          }
        }
        try {
          mem_.write_value(reinterpret_cast<std::uint64_t*>(flag_.data()), job->x.seq);
        } catch (const std::exception& e) {
          if (err.empty()) err = std::string("releasing the caller's stream: ") + e.what();
        }
        job.reset();
        {
          std::lock_guard l(qm_);
          if (!err.empty() && async_error_.empty()) async_error_ = err;
          busy_ = false;
        }
        qcv_.notify_all();
      }
    }
  }

  // --- registrations -------------------------------------------------------------------------

  // Registers [p, p + n) with both transports (the scale-out one: its host mirror, when bouncing).
  registration make_registration(std::byte* p, std::size_t n) {
    registration r;
    r.ptr = p;
    r.size = n;
    r.up = up_->register_memory(p, n);
    try {
      if (bounce_) {
        if constexpr (PinnedHostAllocation<M>) r.mirror = std::make_shared<bounce_buffer>(mem_.allocate_host(n));
        else r.mirror = std::make_shared<bounce_buffer>(host_memory{}.allocate(n));
        r.out = out_->register_memory(r.mirror->data(), n);
      } else if constexpr (M::kind != memory_kind::host && RegistersDevice<Out>) {
        // Device memory registered directly (GPUDirect RDMA): the RDMA transports take its kind.
        if constexpr (DeviceOrdinal<M>) r.out = out_->register_memory(p, n, M::kind, mem_.device());
        else r.out = out_->register_memory(p, n, M::kind, 0);
      } else {
        r.out = out_->register_memory(p, n);
      }
    } catch (...) {
      up_->deregister(r.up);
      throw;
    }
    return r;
  }

  registration& add_registration(std::byte* p, std::size_t n, bool window) {
    registration r = make_registration(p, n);
    ++stats_.registrations;
    r.id = next_id_++;
    r.used = clock_;
    r.window = window;
    regs_.push_back(r);
    return regs_.back();
  }

  void deregister(registration& r) noexcept {
    try {
      up_->deregister(r.up);
    } catch (...) {
    }
    try {
      out_->deregister(r.out);
    } catch (...) {
    }
  }

  void drop_registration(std::uint64_t id) noexcept {
    drain();
    settle();
    for (std::size_t i = 0; i < regs_.size(); ++i)
      if (regs_[i].id == id) {
        deregister(regs_[i]);
        regs_.erase(regs_.begin() + static_cast<std::ptrdiff_t>(i));
        return;
      }
  }

  // The registration holding [p, p + n): a window or a cached one that contains it, else a new
  // cached one (evicting the least recently used cached registration not used by this call).
  registration& lookup(std::byte* p, std::size_t n) {
    registration* best = nullptr;
    for (registration& r : regs_)
      if (r.ptr <= p && n <= r.size && static_cast<std::size_t>(p - r.ptr) <= r.size - n &&
          (best == nullptr || r.window > best->window))
        best = &r;
    if (best) {
      best->used = clock_;
      if (best->revoked) { // a failed call revoked it: register it again (same id: every rank recovers)
        drain();
        registration fresh = make_registration(best->ptr, best->size);
        ++stats_.registrations;
        fresh.id = best->id;
        fresh.used = clock_;
        fresh.window = best->window;
        *best = std::move(fresh);
      }
      return *best;
    }
    for (;;) {
      std::size_t cached = 0;
      registration* lru = nullptr;
      for (registration& r : regs_)
        if (!r.window) {
          ++cached;
          if (r.used != clock_ && (lru == nullptr || r.used < lru->used)) lru = &r;
        }
      if (cached < opt_.registration_cache || lru == nullptr) break;
      drop_registration(lru->id);
    }
    drain(); // regs_ may move: queued calls hold no pointer into it, but keep it simple and safe
    return add_registration(p, n, false);
  }

  // --- the counts exchange ------------------------------------------------------------------

  /// One exchange of `mine` (words), returning every rank's words, rank after rank: in a buffer
  /// shared with the other ranks of this process where the bootstrap offers one
  /// (SharedBootstrap: `shared` holds it until the next exchange of the kind), else in `own`.
  const std::uint64_t* gather(std::span<const std::uint64_t> mine, std::shared_ptr<const std::vector<std::byte>>& shared,
                              std::vector<std::uint64_t>& own) {
    const std::size_t bytes = mine.size_bytes() * static_cast<std::size_t>(n_);
    shared.reset(); // the previous call's, before the new one is made
    if constexpr (SharedBootstrap<Boot>) {
      shared = boot_->allgather_shared(std::as_bytes(mine));
      if (!shared || shared->size() != bytes)
        throw error("bootstrap: a shared allgather of " + std::to_string(mine.size_bytes()) + " bytes per rank returned " +
                    std::to_string(shared ? shared->size() : 0) + " bytes, not " + std::to_string(bytes));
      return reinterpret_cast<const std::uint64_t*>(shared->data());
    } else {
      own.assign(mine.size() * static_cast<std::size_t>(n_), 0);
      boot_->allgather(std::as_bytes(mine), std::as_writable_bytes(std::span(own)));
      return own.data();
    }
  }

  /// The counts exchange: ONE allgather of this rank's send counts (bytes) and a header (its
  /// verdict on its arguments, element size, options digest, receive registration, call form, a
  /// check of its receive counts, and whether its displacements are packed). Per rank n +
  /// header_words words are contributed and n (n + header_words) gathered: the traffic matrix
  /// itself, shared by the ranks of a process (SharedBootstrap). Receive counts are not gathered:
  /// each rank compares its own with its column, and every other rank compares the check in its
  /// header with the same column, so a disagreement fails every rank in this exchange. Where some
  /// rank's displacements are not packed, a second exchange carries the displacements of the
  /// sides that need them (every rank knows from the headers). Returns the exchanges made.
  int exchange_counts(const std::string& problem, const registration* rreg, std::span<std::byte> recv,
                      std::span<const std::uint64_t> send_counts, std::span<const std::uint64_t> send_displs,
                      std::span<const std::uint64_t> recv_counts, std::span<const std::uint64_t> recv_displs,
                      std::size_t elem_size, bool ordered) {
    const auto nn = static_cast<std::size_t>(n_);
    const std::size_t w = counts_words();
    mine_.assign(w, 0);
    std::uint64_t* h = mine_.data() + nn;
    h[h_verdict] = problem.empty() ? 0 : 1;
    h[h_ordered] = ordered ? 1 : 0;
    h[h_elem] = elem_size;
    h[h_digest] = digest_;
    h[h_failed] = failed_seen_ ? 1 : 0;
    h[h_plan] = plan_gen_;
    // Messages with bytes in rank order, back to back from the first: where they start (elements).
    auto packed = [&](std::span<const std::uint64_t> counts, std::span<const std::uint64_t> displs, std::uint64_t& first) {
      bool any = false;
      std::uint64_t next = 0;
      first = 0;
      for (std::size_t j = 0; j < nn; ++j) {
        if (counts[j] == 0) continue;
        if (!any) first = next = displs[j], any = true;
        if (displs[j] != next) return false;
        next += counts[j]; // displs[j] + counts[j] fits in 64 bits (check_arguments)
      }
      return true;
    };
    if (problem.empty()) {
      h[h_recv_id] = rreg->id;
      h[h_recv_base] = static_cast<std::uint64_t>(recv.data() - rreg->ptr);
      std::uint64_t check = 0, first = 0;
      recv_bytes_.resize(nn);
      for (std::size_t j = 0; j < nn; ++j) {
        mine_[j] = send_counts[j] * elem_size;
        recv_bytes_[j] = recv_counts[j] * elem_size;
        check += recv_bytes_[j] * check_weight(static_cast<rank_t>(j));
      }
      h[h_recv_check] = check;
      if (opt_.reuse_plans) {
        // The matrix is the last plan's iff every rank's row is its row of it, and the last plan's
        // transposed iff every rank's row is its column of it (the bytes every rank sent it then,
        // which its receive counts were checked against): each rank tests its own, in O(n), and
        // make_plan combines the answers from the headers, the same on every rank.
        if (plan_gen_ != 0) {
          const auto first = mine_.begin(), last = mine_.begin() + static_cast<std::ptrdiff_t>(nn);
          for (std::size_t i = 0; i < kept_.size(); ++i) {
            const kept_plan& k = kept_[i];
            h[h_match] |= static_cast<std::uint64_t>(std::equal(first, last, k.row.begin(), k.row.end())) << (2 * i);
            h[h_match] |= static_cast<std::uint64_t>(std::equal(first, last, k.col.begin(), k.col.end())) << (2 * i + 1);
          }
        }
      }
      std::uint64_t out = 0, in = 0; // fit in 64 bits: the counts end inside the buffers (check_arguments)
      for (std::size_t j = 0; j < nn; ++j) out += mine_[j], in += recv_bytes_[j];
      h[h_buffer] = std::max(out, in);
      if (packed(send_counts, send_displs, first)) h[h_packed] |= send_packed, h[h_send_first] = first * elem_size;
      if (packed(recv_counts, recv_displs, first)) h[h_packed] |= recv_packed, h[h_recv_first] = first * elem_size;
    }
    send_displs_ = recv_displs_ = nullptr;
    all_ = nullptr; // until the exchange succeeds
    all_ = guarded("counts", [&] { return gather(mine_, all_shared_, all_own_); });
    // Every rank sees the same flags: all recover here, before anything else can fail.
    std::string failed;
    for (rank_t r = 0; r < n_; ++r)
      if (word(r, h_failed) != 0) failed += (failed.empty() ? "" : ", ") + std::to_string(r);
    if (!failed.empty()) recover(failed);
    if (!problem.empty()) throw error("rank " + std::to_string(me_) + ": " + problem);
    for (rank_t r = 0; r < n_; ++r) {
      if (word(r, h_verdict) != 0)
        throw error("rank " + std::to_string(r) + " refused its all-to-allv arguments; nothing was sent");
      if (word(r, h_digest) != digest_)
        throw error("rank " + std::to_string(r) + " was made with other options than rank " + std::to_string(me_) +
                    " (topology, plan options, decomposer, memory space, transports or engine options differ): "
                    "every rank must make the same plan; nothing was sent");
      if (word(r, h_ordered) != (ordered ? 1u : 0u))
        throw error("rank " + std::to_string(r) + " made this call in the " +
                    (word(r, h_ordered) ? "stream-ordered" : "host") + " form, rank " + std::to_string(me_) +
                    " in the " + (ordered ? "stream-ordered" : "host") + " form: every rank must use the same; nothing was sent");
      if (word(r, h_elem) != elem_size)
        throw error("rank " + std::to_string(r) + " uses elements of " + std::to_string(word(r, h_elem)) +
                    " bytes, rank " + std::to_string(me_) + " of " + std::to_string(elem_size));
    }
    // Receive counts against the columns of the send counts: every rank fails naming the lowest
    // rank whose counts disagree; that rank names the first sender and both counts.
    column_check_.assign(nn, 0);
    for (rank_t i = 0; i < n_; ++i) {
      const std::uint64_t wi = check_weight(i);
      const std::uint64_t* row = all_ + static_cast<std::size_t>(i) * w;
      for (std::size_t j = 0; j < nn; ++j) column_check_[j] += row[j] * wi;
    }
    for (rank_t j = 0; j < n_; ++j) {
      if (j == me_) {
        for (rank_t i = 0; i < n_; ++i)
          if (recv_counts[static_cast<std::size_t>(i)] * elem_size != sent(i, j))
            throw error("rank " + std::to_string(j) + " expects " + std::to_string(recv_counts[static_cast<std::size_t>(i)] * elem_size) +
                        " bytes from rank " + std::to_string(i) + ", which sends " + std::to_string(sent(i, j)) +
                        "; nothing was sent");
      } else if (word(j, h_recv_check) != column_check_[static_cast<std::size_t>(j)]) {
        throw error("rank " + std::to_string(j) + "'s receive counts disagree with the bytes the ranks send it (rank " +
                    std::to_string(j) + "'s error names the first); nothing was sent");
      }
    }
    // Displacements: derived from the send counts where every rank's are packed, else exchanged.
    bool all_send = true, all_recv = true;
    for (rank_t r = 0; r < n_; ++r) {
      all_send &= (word(r, h_packed) & send_packed) != 0;
      all_recv &= (word(r, h_packed) & recv_packed) != 0;
    }
    home_ = me_ / G_ * G_;
    const auto G = static_cast<std::size_t>(G_), home = static_cast<std::size_t>(home_);
    if (all_send) {
      // Offsets in this server's ranks' send buffers (G rows of prefix sums), and in every rank's
      // send buffer of its messages to this server's ranks (n x G).
      send_rows_.resize(G * nn);
      for (std::size_t a = 0; a < G; ++a) {
        bytes_t at = 0;
        for (std::size_t j = 0; j < nn; ++j) send_rows_[a * nn + j] = at, at += sent(static_cast<rank_t>(home + a), static_cast<rank_t>(j));
      }
      send_cols_.resize(nn * G);
      for (std::size_t i = 0; i < nn; ++i) {
        const std::uint64_t* row = all_ + i * w;
        bytes_t at = 0;
        for (std::size_t k = 0; k < home; ++k) at += row[k];
        for (std::size_t b = 0; b < G; ++b) send_cols_[i * G + b] = at, at += row[home + b];
      }
    }
    if (all_recv) {
      // Offsets in this server's ranks' receive buffers of every rank's message (G columns of
      // prefix sums), and in every rank's receive buffer of the messages from this server's ranks.
      recv_cols_.resize(G * nn);
      recv_rows_.assign(G * nn, 0);
      for (std::size_t i = 0; i < nn; ++i) {
        const std::uint64_t* row = all_ + i * w;
        for (std::size_t b = 0; b < G; ++b) recv_cols_[b * nn + i] = i == 0 ? 0 : recv_cols_[b * nn + i - 1] + all_[(i - 1) * w + home + b];
        if (i < home) // recv_rows_[0]: the column sums of the rows above this server
          for (std::size_t j = 0; j < nn; ++j) recv_rows_[j] += row[j];
      }
      for (std::size_t a = 1; a < G; ++a) {
        const std::uint64_t* row = all_ + (home + a - 1) * w;
        for (std::size_t j = 0; j < nn; ++j) recv_rows_[a * nn + j] = recv_rows_[(a - 1) * nn + j] + row[j];
      }
    }
    if (all_send && all_recv) {
      displs_shared_.reset();
      displs_own_ = {};
      return 1;
    }
    displ_words_ = (all_send ? 0 : nn) + (all_recv ? 0 : nn);
    mine_.assign(displ_words_, 0);
    for (std::size_t j = 0; j < nn; ++j) {
      if (!all_send) mine_[j] = send_displs[j] * elem_size;
      if (!all_recv) mine_[displ_words_ - nn + j] = recv_displs[j] * elem_size;
    }
    const std::uint64_t* d = guarded("displacements", [&] { return gather(mine_, displs_shared_, displs_own_); });
    if (!all_send) send_displs_ = d;
    if (!all_recv) recv_displs_ = d + (displ_words_ - nn);
    return 2;
  }

  // --- staging and the handle exchange -------------------------------------------------------

  bool same_server(rank_t a, rank_t b) const noexcept { return a / G_ == b / G_; }

  std::vector<remote_entry>& known(rank_t r) noexcept { return known_[static_cast<std::size_t>(r)]; }
  remote_entry* find_known(rank_t r, std::uint64_t id) noexcept {
    for (remote_entry& e : known(r))
      if (e.id == id) return &e;
    return nullptr;
  }
  std::size_t known_capacity() const noexcept { return 2 * opt_.registration_cache + 8; }

  void forget(remote_entry& e) noexcept {
    try {
      if (e.up) up_->forget(*e.up);
      if (e.out) out_->forget(*e.out);
    } catch (...) {
    }
    e.up.reset();
    e.out.reset();
  }
  void forget(peer_stage& s) noexcept {
    try {
      if (s.up) up_->forget(*s.up);
      if (s.out) out_->forget(*s.out);
    } catch (...) {
    }
    s.up.reset();
    s.out.reset();
  }

  // This call's plan (this rank's part): a kept plan, as it is or transposed, where
  // engine_options::reuse_plans finds the matrix the same as that plan's or transposed, else
  // planned. Every rank decides alike: from the same headers (every rank's answers for its own
  // row), and only where every rank's last plan has the same generation (all ranks made the same
  // plans since they last disagreed, so they keep the same plans in the same order).
  void make_plan(bytes_t budget) {
    std::uint64_t newest = 0, match = ~std::uint64_t{0};
    bool agree = true;
    for (rank_t r = 0; r < n_; ++r) {
      newest = std::max(newest, word(r, h_plan));
      agree &= word(r, h_plan) == word(0, h_plan);
      match &= word(r, h_match);
    }
    plan_source from = plan_source::planned;
    std::size_t at = 0; // the kept plan it comes from: the most recently used that fits
    if (opt_.reuse_plans && agree && plan_gen_ != 0 && newest == plan_gen_)
      for (; at < kept_.size(); ++at) {
        if (kept_[at].budget != budget) continue;
        if ((match >> (2 * at)) & 1) {
          from = plan_source::same;
          break;
        }
        if ((match >> (2 * at + 1)) & 1) {
          from = plan_source::transposed;
          break;
        }
      }
    plan_gen_ = 0; // until this call's plan is made (planning can throw, on every rank alike)
    if (from != plan_source::planned) {
      kept_plan& k = kept_[at];
      if (from == plan_source::transposed) {
        transpose_into<static_gpus_v<Topo>>(k.p, k.m, spare_, k.balance);
        std::swap(k.p, spare_);
        // Its M (or a per-rail plan's balance bytes) is read only where staging is not shared
        // across stages (the regions' bases). A rank's balance part of the transposed plan is its
        // receive part of the plan.
        if (k.p.staged && k.p.staging_ring == 0) {
          if (k.p.per_rail())
            for (std::size_t r = 0; r < k.balance.size(); ++r) k.balance[r] = k.p.staging_bytes[r] - k.balance[r];
          else
            k.m.transposeInPlace();
        }
        std::swap(k.row, k.col); // this rank's row of the transposed matrix is its column of the matrix
      }
      std::rotate(kept_.begin(), kept_.begin() + static_cast<std::ptrdiff_t>(at), kept_.begin() + static_cast<std::ptrdiff_t>(at) + 1);
    } else {
      // This rank's part only, from the gathered counts in place (the same error on every rank),
      // into the least recently used kept plan (or a new one, while fewer are kept), made the
      // first; its row and column are cleared until it is made, so that a failed planning leaves
      // nothing another call could match.
      const std::size_t keep = opt_.reuse_plans ? opt_.plans_kept : 1;
      if (kept_.size() < keep) kept_.emplace_back();
      std::rotate(kept_.begin(), kept_.end() - 1, kept_.end());
      kept_plan& k = kept_.front();
      k.row.clear();
      k.col.clear();
      planner_->make_rank_into(traffic(), me_, k.p);
      if (k.p.staged && k.p.staging_ring == 0 && opt_.reuse_plans) {
        if (k.p.per_rail()) k.balance = planner_->balance_bytes();
        else k.m = planner_->rail_matrix();
      }
      k.budget = budget;
      if (opt_.reuse_plans) {
        const std::uint64_t* row = all_ + static_cast<std::size_t>(me_) * counts_words();
        k.row.assign(row, row + n_);
        std::swap(k.col, recv_bytes_);
      }
    }
    stats_.plan_from = from;
    if (opt_.reuse_plans) plan_gen_ = newest + 1;
  }

  // Every rank reaches the same answer: staging capacities are tracked for every rank from the
  // plans, and every rank's knowledge of every receive registration is the same (each rank saw
  // the same exchanges). Grows this rank's own staging where the plan needs more.
  bool staging_and_handles_needed() {
    bool needed = false;
    for (rank_t r = 0; r < n_; ++r) {
      const bytes_t need = plan_().staging_bytes.empty() ? 0 : plan_().staging_bytes[static_cast<std::size_t>(r)];
      if (need > staging_cap_[static_cast<std::size_t>(r)]) {
        staging_cap_[static_cast<std::size_t>(r)] = need;
        needed = true;
      }
      if (!find_known(r, word(r, h_recv_id))) needed = true;
    }
    const bytes_t mine = staging_cap_[static_cast<std::size_t>(me_)];
    if (staging_reg_ && staging_reg_->revoked) {
      // A failed call revoked it; this call recovered on every rank (the revocation is settled only
      // at the start of a call, before the exchange that carries the failed flag), so every rank
      // exchanges handles and learns the new registration.
      drain();
      staging_reg_.reset();
      registration r = make_registration(staging_.data(), staging_.size());
      stats_.registrations += 1;
      r.id = next_id_++;
      staging_reg_ = r;
    }
    if (mine > staging_.size()) { // grown, never shrunk; contents unspecified (every byte read is written first)
      drain();                      // queued calls use the old staging
      if (staging_reg_) deregister(*staging_reg_);
      staging_reg_.reset();
      staging_ = typename M::buffer{};
      staging_ = mem_.allocate(mine);
      registration r = make_registration(staging_.data(), staging_.size());
      stats_.registrations += 1;
      r.id = next_id_++;
      staging_reg_ = r;
    }
    return needed;
  }

  // One exchange of handles: shared by the ranks of the process where the bootstrap can.
  const std::byte* gather_bytes(std::span<const std::byte> mine) {
    const std::size_t bytes = mine.size() * static_cast<std::size_t>(n_);
    handles_shared_.reset();
    if constexpr (SharedBootstrap<Boot>) {
      handles_shared_ = boot_->allgather_shared(mine);
      if (!handles_shared_ || handles_shared_->size() != bytes)
        throw error("bootstrap: a shared allgather of " + std::to_string(mine.size()) + " bytes per rank returned " +
                    std::to_string(handles_shared_ ? handles_shared_->size() : 0) + " bytes, not " + std::to_string(bytes));
      return handles_shared_->data();
    } else {
      all_handles_.assign(bytes, std::byte{0});
      boot_->allgather(mine, all_handles_);
      return all_handles_.data();
    }
  }

  void exchange_handles(const registration& rreg) {
    constexpr std::size_t hu = Up::handle_bytes, ho = Out::handle_bytes;
    constexpr std::size_t blob = 16 + 2 * hu + 2 * ho;
    handles_.assign(blob, std::byte{0});
    const std::uint64_t ids[2] = {rreg.id, staging_reg_ ? staging_reg_->id : 0};
    std::memcpy(handles_.data(), ids, 16);
    auto put_handle = [&](std::size_t at, const std::vector<std::byte>& h, std::size_t size) {
      if (h.size() != size)
        throw error("transport handle has " + std::to_string(h.size()) + " bytes, declared " + std::to_string(size));
      std::memcpy(handles_.data() + at, h.data(), size);
    };
    put_handle(16, up_->serialize(rreg.up), hu);
    put_handle(16 + hu, out_->serialize(rreg.out), ho);
    if (staging_reg_) {
      put_handle(16 + hu + ho, up_->serialize(staging_reg_->up), hu);
      put_handle(16 + 2 * hu + ho, out_->serialize(staging_reg_->out), ho);
    }
    const std::byte* all_handles = guarded("memory handles", [&] { return gather_bytes(handles_); });
    for (rank_t r = 0; r < n_; ++r) {
      const std::byte* b = all_handles + blob * static_cast<std::size_t>(r);
      std::uint64_t got[2];
      std::memcpy(got, b, 16);
      const bool up = same_server(r, me_) && r != me_, out = !same_server(r, me_);
      if (!find_known(r, got[0])) {
        auto& list = known(r);
        if (list.size() >= known_capacity()) {
          auto lru = std::min_element(list.begin(), list.end(), [](const remote_entry& x, const remote_entry& y) { return x.used < y.used; });
          forget(*lru);
          list.erase(lru);
        }
        remote_entry e;
        e.id = got[0];
        e.used = clock_;
        if (up) e.blob.assign(b + 16, b + 16 + hu);
        if (out) e.blob.assign(b + 16 + hu, b + 16 + hu + ho);
        list.push_back(std::move(e));
      }
      peer_stage& ps = peer_staging_[static_cast<std::size_t>(r)];
      if (got[1] != ps.id) {
        forget(ps);
        ps.id = got[1];
        if (got[1] != 0) {
          if (up) ps.up = up_->deserialize(r, std::span(b + 16 + hu + ho, hu));
          if (out) ps.out = out_->deserialize(r, std::span(b + 16 + 2 * hu + ho, ho));
        }
      }
    }
  }

  // --- failures: abandon, settle, recover --------------------------------------------------

  // A bootstrap exchange; its failure leaves the engine unusable (see the class comment).
  template <class Exchange>
  auto guarded(const char* what, Exchange&& exchange) {
    try {
      return exchange();
    } catch (const std::exception& e) {
      gone_ = std::string("the exchange of ") + what + " failed (" + e.what() + ")";
      const std::string m = "rank " + std::to_string(me_) + ": the exchange of " + what + " failed: " + e.what() +
                            "; this engine cannot recover from a failed exchange: destroy it, its bootstrap and its "
                            "transports on every rank and make new ones";
      if (dynamic_cast<const timeout_error*>(&e) != nullptr) throw timeout_error(m); // still a timeout
      throw error(m);
    }
  }

  // The call failed on this rank once peers may write into its memory: revoke what they write
  // into (the receive registration and the staging: on transports that revoke, a late put fails
  // instead of writing), drop the connections (MPI: cancels posted receives), finish this rank's
  // own queued device copies, and raise the flag the next call's exchange carries. Runs in the
  // thread that executed the call (the caller's, or the proxy's); touches only the transports and
  // the registrations' copies given, and records the revoked ids for `settle`. Never throws.
  void abandon(const registration* recv, const registration* staging) noexcept {
    try {
      mem_.synchronize();
    } catch (...) {
    }
    try {
      retire(up_conn_, retired_up_);
      retire(out_conn_, retired_out_);
    } catch (...) {
      up_conn_.reset();
      out_conn_.reset();
    }
    std::vector<std::uint64_t> ids;
    for (const registration* r : {recv, staging}) {
      if (r == nullptr || r->id == 0) continue;
      registration copy = *r; // deregister on a copy: the engine's own entry is settled later
      deregister(copy);
      ids.push_back(r->id);
    }
    std::lock_guard l(qm_);
    failed_ = true;
    revoked_ids_.insert(revoked_ids_.end(), ids.begin(), ids.end());
  }

  // A connection given up: what it had in flight is abandoned (MPI: posted receives cancelled),
  // and it is kept until the engine goes, so that nothing reuses what identifies it while a late
  // peer may still send to it (an MPI context id, say).
  template <class C>
  static void retire(std::optional<C>& c, std::deque<C>& into) {
    if (!c) return;
    if constexpr (Abandonable<C>) c->abandon();
    into.push_back(std::move(*c));
    c.reset();
  }

  // In the calling thread: marks the registrations a failed call revoked (registered again when
  // next used). At the start of a call (before its exchange) it also notes the failure for the
  // exchange, under the same lock: a failure noted has its revoked registrations marked too.
  void settle(bool call_start = false) noexcept {
    std::vector<std::uint64_t> ids;
    {
      std::lock_guard l(qm_);
      ids.swap(revoked_ids_);
      if (call_start) failed_seen_ = failed_;
    }
    auto mark = [](registration& r) {
      r.up = typename Up::memory{}; // already deregistered: nothing to release again
      r.out = typename Out::memory{};
      r.revoked = true;
    };
    for (std::uint64_t id : ids) {
      for (registration& r : regs_)
        if (r.id == id) mark(r);
      if (staging_reg_ && staging_reg_->id == id) mark(*staging_reg_);
    }
  }

  // Some rank's last call failed (all ranks see it in the same exchange): start over with new
  // connections and forget every peer's handle, so that they are exchanged again in this call.
  void recover(const std::string& failed) {
    plan_gen_ = 0; // every rank recovers in this call: none reuses a plan in it, and none is kept
    kept_.resize(1);
    kept_.front().row.clear();
    kept_.front().col.clear();
    drain(); // queued calls finish (or are released, after a failure) before the connections go
    try {
      retire(up_conn_, retired_up_);
      retire(out_conn_, retired_out_);
      up_conn_.emplace(up_->connect(channels));
      out_conn_.emplace(out_->connect(channels));
    } catch (const std::exception& e) {
      gone_ = std::string("making new connections after a failed call failed (") + e.what() + ")";
      throw error("rank " + std::to_string(me_) + ": recovering from a failed call on rank(s) " + failed + ": " + e.what() +
                  "; destroy this engine, its bootstrap and its transports on every rank and make new ones");
    }
    std::fill(expected_.begin(), expected_.end(), 0);
    std::fill(signalled_.begin(), signalled_.end(), 0);
    for (auto& peer : known_) {
      for (remote_entry& e : peer) forget(e);
      peer.clear();
    }
    for (peer_stage& ps : peer_staging_) {
      forget(ps);
      ps.id = 0;
    }
    {
      std::lock_guard l(qm_);
      failed_ = false;
    }
    failed_seen_ = false;
    stats_.recovered = true;
  }

  // --- execution -----------------------------------------------------------------------------

  // Resolves this call's buffers: local registrations and base offsets, peers' receive entries,
  // opening a peer's handle the first time this rank puts into it.
  void bind(exec& x, registration& sreg, std::span<const std::byte> send, registration& rreg, std::span<std::byte> recv) {
    x.staged = plan_().staged;
    x.rails_apart = plan_().per_rail();
    x.send_reg = sreg;
    x.recv_reg = rreg;
    x.staging_reg = staging_reg_ ? *staging_reg_ : registration{};
    x.staging_ptr = staging_.data();
    x.send_ptr = const_cast<std::byte*>(send.data());
    x.recv_ptr = recv.data();
    x.send_base = static_cast<bytes_t>(x.send_ptr - sreg.ptr);
    x.recv_base = static_cast<bytes_t>(x.recv_ptr - rreg.ptr);
    x.peer_recv.assign(static_cast<std::size_t>(n_), nullptr);
    x.peer_recv_base.assign(static_cast<std::size_t>(n_), 0);
    for (rank_t r = 0; r < n_; ++r) {
      remote_entry* e = find_known(r, word(r, h_recv_id));
      e->used = clock_;
      x.peer_recv[static_cast<std::size_t>(r)] = e;
      x.peer_recv_base[static_cast<std::size_t>(r)] = word(r, h_recv_base);
    }
    for (const instr& i : x.program.code()) {
      if (i.op != instr_op::put || i.dst_buf != buffer_id::recv || i.peer == me_) continue;
      remote_entry& e = *x.peer_recv[static_cast<std::size_t>(i.peer)];
      const bool up = i.via == tier::scaleup;
      if (up ? e.up.has_value() : e.out.has_value()) continue;
      drain(); // opening changes the transport's state that queued calls may use
      if (up) e.up = up_->deserialize(i.peer, e.blob);
      else e.out = out_->deserialize(i.peer, e.blob);
    }
    x.bounce_in.clear();
    if (bounce_) {
      x.bounce_in.resize(x.program.stages() + 1);
      for (const instr& i : x.program.at(rank_program::section::post))
        if (i.via == tier::scaleout && i.bytes > 0)
          x.bounce_in[x.staged ? static_cast<std::size_t>(i.stage) : x.program.stages()].push_back(i);
    }
  }

  static std::byte* local_ptr(const exec& x, buffer_id b) noexcept {
    return b == buffer_id::send ? x.send_ptr : b == buffer_id::recv ? x.recv_ptr : x.staging_ptr;
  }
  static bytes_t local_base(const exec& x, buffer_id b) noexcept {
    return b == buffer_id::send ? x.send_base : b == buffer_id::recv ? x.recv_base : 0;
  }
  static const registration& reg_of(const exec& x, buffer_id b) noexcept {
    return b == buffer_id::send ? x.send_reg : b == buffer_id::recv ? x.recv_reg : x.staging_reg;
  }

  std::uint64_t& expected(tier via, rank_t peer, channel_id ch) noexcept {
    return expected_[(static_cast<std::size_t>(peer) * 2 + static_cast<std::size_t>(via)) * channels + ch];
  }
  std::uint64_t& signalled(tier via, rank_t peer, channel_id ch) noexcept {
    return signalled_[(static_cast<std::size_t>(peer) * 2 + static_cast<std::size_t>(via)) * channels + ch];
  }

  void signal(tier via, rank_t peer, channel_id ch) {
    if (via == tier::scaleup) up_conn_->signal(peer, ch);
    else out_conn_->signal(peer, ch);
    ++signalled(via, peer, ch);
  }

  // Runs one copy, put, expect or signal.
  void run(const exec& x, const instr& i) {
    const bool up = i.via == tier::scaleup;
    switch (i.op) {
    case instr_op::copy: mem_.copy(local_ptr(x, i.dst_buf) + i.dst, local_ptr(x, i.src_buf) + i.src, i.bytes); break;
    case instr_op::put: {
      const bool to_recv = i.dst_buf == buffer_id::recv;
      const remote_entry* pr = x.peer_recv[static_cast<std::size_t>(i.peer)];
      const peer_stage& ps = peer_staging_[static_cast<std::size_t>(i.peer)];
      const bytes_t dst = i.dst + (to_recv ? x.peer_recv_base[static_cast<std::size_t>(i.peer)] : 0);
      const registration& reg_s = reg_of(x, i.src_buf);
      const bytes_t src = i.src + local_base(x, i.src_buf);
      if (up) up_conn_->put(i.peer, reg_s.up, src, to_recv ? *pr->up : *ps.up, dst, i.bytes, i.channel);
      else out_conn_->put(i.peer, reg_s.out, src, to_recv ? *pr->out : *ps.out, dst, i.bytes, i.channel);
      break;
    }
    case instr_op::expect: {
      const registration& reg_d = reg_of(x, i.dst_buf);
      const bytes_t dst = i.dst + local_base(x, i.dst_buf);
      if (up) up_conn_->expect(i.peer, reg_d.up, dst, i.bytes, i.channel);
      else out_conn_->expect(i.peer, reg_d.out, dst, i.bytes, i.channel);
      break;
    }
    case instr_op::signal: signal(i.via, i.peer, i.channel); break;
    case instr_op::wait: break; // the runner waits
    }
  }
  void run(const exec& x, std::span<const instr> code) {
    bounce_out(x, code);
    for (const instr& i : code) run(x, i);
  }

  // Bouncing: the bytes of a section's scale-out puts go device -> host mirror before the puts
  // (which the transport makes from the mirror, at the same offsets).
  void bounce_out(const exec& x, std::span<const instr> code) {
    if (!bounce_) return;
    bool any = false;
    for (const instr& i : code)
      if (i.op == instr_op::put && i.via == tier::scaleout && i.bytes > 0) {
        const registration& reg = reg_of(x, i.src_buf);
        const bytes_t at = i.src + local_base(x, i.src_buf);
        mem_.copy(reg.mirror->data() + at, reg.ptr + at, i.bytes);
        any = true;
      }
    if (any) mem_.synchronize();
  }
  // Bouncing: once the waits of stage t (or of the finish, t = stages) have covered them, the
  // scale-out expects' bytes go host mirror -> device, before anything reads them.
  void bounce_in(const exec& x, std::size_t t) {
    if (!bounce_ || x.bounce_in[t].empty()) return;
    for (const instr& i : x.bounce_in[t]) {
      const registration& reg = reg_of(x, i.dst_buf);
      const bytes_t at = i.dst + local_base(x, i.dst_buf);
      mem_.copy(reg.ptr + at, reg.mirror->data() + at, i.bytes);
    }
    mem_.synchronize(); // the scale-up transport's stream may not be the memory space's
  }

  // Takes the next signal of a wait if it is there already; never blocks.
  // A test that finds nothing has driven its tier's progress (every transport's test and sent
  // poll their transport when the answer is not known yet): run_stages notes it in polled_.
  bool take(const instr& w) {
    std::uint64_t& e = expected(w.via, w.peer, w.channel);
    const bool ok = w.via == tier::scaleup ? up_conn_->test(w.peer, w.channel, e + 1) : out_conn_->test(w.peer, w.channel, e + 1);
    if (ok) ++e;
    else polled_[w.via == tier::scaleup ? 0 : 1] = true;
    return ok;
  }
  // A connection whose transfers move only while this rank calls into its transport (MPI's
  // rendezvous over TCP, or over shared memory without single-copy; libfabric's and verbs'
  // completion queues) says so with progress(). While this rank waits on one tier, a peer's
  // transfer on the other may need its progress: a rank that waits for a redistribute signal
  // while the rail bytes it owes a third rank sit unsent waits for ever (seen with GPU IPC over
  // MPI on an H200, and with Open MPI's btl_vader_single_copy_mechanism=none on the stand-in).
  template <class C>
  static constexpr bool drives_progress = DrivesProgress<C>;
  // A scale-out connection whose puts land only in posted expects (MPI): shared staging frees a
  // rail sender's arrival slot by posting the next stage's expects instead of a credit signal.
  static constexpr bool expects_gate_puts = ExpectsGatePuts<out_conn>;
  // Whether this call's rail expects of stages >= K are posted when their arrival slot is freed
  // (and the rail credits are neither sent nor awaited).
  static bool lazy_rail_expects(const rank_program& pg) noexcept { return expects_gate_puts && pg.ring() > 0; }
  static bool deferred(const rank_program& pg, const instr& i) noexcept {
    return i.op == instr_op::expect && i.via == tier::scaleout && i.channel == engine_channel::rail &&
           static_cast<std::size_t>(i.stage) >= pg.ring();
  }
  // One poke of the progress of the tier other than `busy` (where it has any).
  void progress_other(tier busy) {
    if (busy == tier::scaleup) {
      if constexpr (drives_progress<out_conn>) out_conn_->progress();
    } else {
      if constexpr (drives_progress<up_conn>) up_conn_->progress();
    }
  }
  // Waits for the next signal of a wait, naming what is missing on timeout; drives the other
  // tier's progress meanwhile.
  void await(const exec& x, const instr& w) {
    std::uint64_t& e = expected(w.via, w.peer, w.channel);
    ++e;
    bool ok = false;
    const bool other_progresses = w.via == tier::scaleup ? drives_progress<out_conn> : drives_progress<up_conn>;
    if (other_progresses) {
      ok = detail::poll_until(
          [&] {
            const bool got = w.via == tier::scaleup ? up_conn_->test(w.peer, w.channel, e) : out_conn_->test(w.peer, w.channel, e);
            if (!got) progress_other(w.via);
            return got;
          },
          opt_.waiting, opt_.timeout);
    } else {
      ok = w.via == tier::scaleup ? up_conn_->wait(w.peer, w.channel, e, opt_.timeout)
                                  : out_conn_->wait(w.peer, w.channel, e, opt_.timeout);
    }
    if (!ok) throw missing(x, w);
  }
  timeout_error missing(const exec& x, const instr& w) const {
    if (w.channel == ready_channel)
      return timeout_error("rank " + std::to_string(me_) + ": rank " + std::to_string(w.peer) +
                   " did not say it is ready for stream-ordered call " + std::to_string(x.seq) + " within " +
                   std::to_string(opt_.timeout.count()) + " ms (its stream did not reach the call, or it failed)");
    return timeout_error("rank " + std::to_string(me_) + ": no " + engine_channel_name(w.channel) + " signal from rank " +
                 std::to_string(w.peer) + (x.staged ? " in stage " + std::to_string(w.stage) : std::string()) +
                 " within " + std::to_string(opt_.timeout.count()) + " ms");
  }

  // Stream form: this rank tells every peer that puts into it that it is ready (its stream has
  // reached the call, and its previous call has finished with staging), then waits until every
  // peer it puts into has said the same.
  void clear_to_send(const exec& x) {
    ready_in_.clear();
    ready_out_.clear();
    for (const instr& i : x.program.code()) {
      if (i.op == instr_op::expect) ready_in_.emplace_back(i.via, i.peer);
      if (i.op == instr_op::put) ready_out_.emplace_back(i.via, i.peer);
    }
    for (auto* v : {&ready_in_, &ready_out_}) {
      std::sort(v->begin(), v->end());
      v->erase(std::unique(v->begin(), v->end()), v->end());
    }
    for (const auto& [via, peer] : ready_in_) signal(via, peer, ready_channel);
    for (const auto& [via, peer] : ready_out_) {
      instr w;
      w.op = instr_op::wait, w.via = via, w.peer = peer, w.channel = ready_channel;
      await(x, w);
    }
  }

  void execute(const exec& x) {
    using sec = rank_program::section;
    if (!up_conn_ || !out_conn_)
      throw error("rank " + std::to_string(me_) + ": the connections were dropped by a failed call and not yet rebuilt");
    const rank_program& pg = x.program;
    if (lazy_rail_expects(pg)) {
      // Rail expects of stages >= K wait for their arrival slot (run_stages); the rest post now.
      // The post section is in stage order, so each stage's deferred expects are a run of them.
      deferred_.clear();
      deferred_at_.assign(pg.stages() + 1, 0);
      for (const instr& i : pg.at(sec::post)) {
        if (!deferred(pg, i)) run(x, i);
        else deferred_.push_back(i), ++deferred_at_[static_cast<std::size_t>(i.stage) + 1];
      }
      for (std::size_t t = 0; t < pg.stages(); ++t) deferred_at_[t + 1] += deferred_at_[t];
    } else {
      run(x, pg.at(sec::post));
    }
    if (x.ordered) clear_to_send(x);
    run(x, pg.at(sec::start));
    if (pg.stages() > 0) run_stages(x);
    for (const instr& w : pg.at(sec::finish)) await(x, w);
    if (bounce_) bounce_in(x, pg.stages());
    up_conn_->flush();
    out_conn_->flush();
    mem_.synchronize();
  }

  // The staged part, as an event loop over three cursors: balance puts run rail_window stages
  // ahead of the rail; the rail sends of stage t start once t's balance data has arrived and fewer
  // than rail_window earlier stages' rail sends are still leaving this rank; stage r is
  // redistributed as soon as its rail data has arrived. Where the plan shares staging across
  // stages (rank_program::ring() K > 0), stage t's balance puts also wait for the credits of
  // their rail ranks' balance slots and its rail sends for the credit of the rail target's arrival
  // slot, and two more cursors send credits in stage order: stage t + K's balance slot is free once
  // this rank's rail sends of stage t have left it, its arrival slot once its redistribution of
  // stage t has. Where scale-out puts land only in posted expects (expects_gate_puts: MPI), an
  // arrival slot is freed by posting the rail expects of stage t + K instead (execute deferred
  // them), and rail sends do not wait for credits: the transport holds a put until its expect is
  // posted, and the receiver takes stage t + K's rail signal only once it has posted them. The
  // credit would cross the network once more than the transport's own handshake (a rendezvous).
  // Nothing waits on a condition while another one could progress.
  void run_stages(const exec& x) {
    using sec = rank_program::section;
    const rank_program& pg = x.program;
    const std::size_t T = pg.stages(), W = opt_.rail_window, K = pg.ring();
    const bool lazy = lazy_rail_expects(pg);
    const std::size_t released = K > 0 && T > K ? T - K : 0; // stages whose slots are released for stage + K
    rail_peer_.assign(T, -1);
    rail_count_.assign(T, 0);
    leaving_.clear();
    redist_sent_.clear();
    auto post_rail = [&](std::size_t t) {
      bounce_out(x, pg.at(sec::rail, t));
      for (const instr& i : pg.at(sec::rail, t)) {
        run(x, i);
        if (i.op == instr_op::signal) {
          rail_peer_[t] = i.peer;
          rail_count_[t] = signalled(tier::scaleout, i.peer, i.channel);
          leaving_.push_back(t);
        }
      }
    };

    // Cursors: the next stage to balance, to send on the rail, to redistribute, and to release
    // the balance and arrival slots of; and how many waits of the current stage each has taken.
    std::size_t bal = 0, rail = 0, redist = 0, rel_out = 0, rel_in = 0;
    std::size_t cb_i = 0, bal_i = 0, cr_i = 0, in_i = 0;
    detail::backoff idle(opt_.waiting);
    auto last = std::chrono::steady_clock::now();
    // Time held by credits alone (call_stats::credit_wait_*): measured from the turn a cursor
    // is found held to the turn it is not.
    using clock = std::chrono::steady_clock;
    struct held_since {
      bool held = false;
      clock::time_point since{};
    } held_rail, held_bal;
    stats_.credit_wait_rail_s = stats_.credit_wait_balance_s = 0;
    auto hold = [](held_since& h, bool held, double& total) {
      if (held == h.held) return;
      const auto now = clock::now();
      if (held) h.since = now;
      else total += std::chrono::duration<double>(now - h.since).count();
      h.held = held;
    };
    while (bal < T || rail < T || redist < T || rel_out < released || rel_in < released) {
      bool moved = false;
      polled_[0] = polled_[1] = false;
      // Stages whose rail sends have left no longer count against the window, in any order (one
      // slow flow into a busy receiver holds one slot, not the whole window), and release their
      // balance slots: checked after the last rail stage too.
      std::erase_if(leaving_, [&](std::size_t t) {
        const bool gone = out_conn_->sent(rail_peer_[t], engine_channel::rail, rail_count_[t]);
        moved |= gone;
        polled_[1] |= !gone;
        return gone;
      });
      // Balance runs rail_window stages ahead of this rank's own rail; in a per-rail plan the other
      // rails' stage t need not come near this rail's (each follows its own stages), so balance
      // is not held back by this rank's rail at all (a staging ring still bounds it by credits).
      while (bal < T && (x.rails_apart || bal < rail + W)) {
        const auto credits = pg.at(sec::credit_balance, bal);
        while (cb_i < credits.size() && take(credits[cb_i])) ++cb_i, moved = true;
        hold(held_bal, cb_i < credits.size(), stats_.credit_wait_balance_s);
        if (cb_i < credits.size()) break;
        run(x, pg.at(sec::balance, bal));
        ++bal;
        cb_i = 0;
        moved = true;
      }
      if (rail < T) {
        const auto waits = pg.at(sec::await_balance, rail);
        while (bal_i < waits.size() && take(waits[bal_i])) ++bal_i, moved = true;
        const auto credits = lazy ? std::span<const instr>() : pg.at(sec::credit_rail, rail);
        while (cr_i < credits.size() && take(credits[cr_i])) ++cr_i, moved = true;
        if (K > 0) hold(held_rail, bal_i == waits.size() && leaving_.size() < W && cr_i < credits.size(), stats_.credit_wait_rail_s);
        if (bal_i == waits.size() && cr_i == credits.size() && leaving_.size() < W) {
          post_rail(rail);
          ++rail;
          bal_i = cr_i = 0;
          moved = true;
        }
      }
      if (redist < T && (!lazy || redist < rel_in + K)) { // lazy: its rail expects are posted
        const auto waits = pg.at(sec::await_rail, redist);
        while (in_i < waits.size() && take(waits[in_i])) ++in_i, moved = true;
        if (in_i == waits.size()) {
          bounce_in(x, redist);
          const auto code = pg.at(sec::redistribute, redist);
          run(x, code);
          if (K > 0)
            for (const instr& i : code)
              if (i.op == instr_op::signal) redist_sent_.push_back({redist, i.peer, signalled(i.via, i.peer, i.channel)});
          ++redist;
          in_i = 0;
          moved = true;
        }
      }
      // Balance slots of stage rel_out + K: free once this rank's rail sends of rel_out have left.
      while (rel_out < released && rel_out < rail &&
             std::find(leaving_.begin(), leaving_.end(), rel_out) == leaving_.end()) {
        run(x, pg.at(sec::release_out, rel_out + K));
        ++rel_out;
        moved = true;
      }
      // Arrival slots of stage rel_in + K: free once this rank's redistribution of rel_in has left.
      while (rel_in < released && rel_in < redist) {
        bool left = true; // the first that has not left is enough to wait for: the rest are asked next turn
        for (const redist_signal& r : redist_sent_)
          if (r.stage == rel_in && !up_conn_->sent(r.peer, engine_channel::redistribute, r.count)) {
            left = false;
            polled_[0] = true;
            break;
          }
        if (!left) break;
        std::erase_if(redist_sent_, [&](const redist_signal& r) { return r.stage == rel_in; });
        if (lazy) {
          for (std::size_t k = deferred_at_[rel_in + K]; k < deferred_at_[rel_in + K + 1]; ++k) run(x, deferred_[k]);
          for (const instr& i : pg.at(sec::release_in, rel_in + K))
            if (i.via != tier::scaleout) run(x, i);
        } else {
          run(x, pg.at(sec::release_in, rel_in + K));
        }
        ++rel_in;
        moved = true;
      }
      const auto now = std::chrono::steady_clock::now();
      if (moved) {
        idle.reset();
        last = now;
        continue;
      }
      if (now - last >= opt_.timeout) {
        if (redist < T && (!lazy || redist < rel_in + K) && in_i < pg.at(sec::await_rail, redist).size()) throw missing(x, pg.at(sec::await_rail, redist)[in_i]);
        if (rail < T && bal_i < pg.at(sec::await_balance, rail).size()) throw missing(x, pg.at(sec::await_balance, rail)[bal_i]);
        if (!lazy && rail < T && cr_i < pg.at(sec::credit_rail, rail).size()) throw missing(x, pg.at(sec::credit_rail, rail)[cr_i]);
        if (bal < T && cb_i < pg.at(sec::credit_balance, bal).size()) throw missing(x, pg.at(sec::credit_balance, bal)[cb_i]);
        if (!leaving_.empty())
          throw timeout_error("rank " + std::to_string(me_) + ": its rail sends of stage " + std::to_string(leaving_.front()) +
                      " to rank " + std::to_string(rail_peer_[leaving_.front()]) + " did not leave within " +
                      std::to_string(opt_.timeout.count()) + " ms");
        throw timeout_error("rank " + std::to_string(me_) + ": its redistribution of stage " + std::to_string(rel_in) +
                    " did not leave within " + std::to_string(opt_.timeout.count()) + " ms");
      }
      // Nothing moved: peers may need this rank's progress on either tier. A tier whose test or
      // sent found nothing this turn has been polled already (over MPI every such call runs Open
      // MPI's progress, which polls every socket and, oversubscribed, yields the core): one more
      // call would only repeat it.
      if (!polled_[1]) progress_other(tier::scaleup);
      if (!polled_[0]) progress_other(tier::scaleout);
      idle.pause();
    }
  }

  std::unique_ptr<detail::rank_planner> planner_; // the decomposer's planner (engine makes it)
  Boot* boot_;
  Up* up_;
  Out* out_;
  engine_options opt_;
  M mem_;
  std::optional<up_conn> up_conn_;
  std::optional<out_conn> out_conn_;
  std::deque<up_conn> retired_up_;   ///< given up after failed calls (see retire)
  std::deque<out_conn> retired_out_;
  rank_t n_ = 0, me_ = 0;
  int G_ = 1;
  std::uint64_t digest_ = 0;
  call_stats stats_;
  program_builder<layout> builder_;
  exec cur_; ///< the call being prepared (host form: and executed)
  std::vector<std::uint64_t> mine_, expected_, signalled_;
  std::vector<std::byte> handles_, all_handles_;
  std::shared_ptr<const std::vector<std::byte>> handles_shared_;

  // The last counts exchange (see exchange_counts): every rank's send counts and header, held
  // until the next call, shared with the process's other ranks where the bootstrap can.
  const std::uint64_t* all_ = nullptr;
  std::shared_ptr<const std::vector<std::byte>> all_shared_;
  std::vector<std::uint64_t> all_own_, column_check_;
  // Kept plans (engine_options::reuse_plans, plans_kept), the most recently used first; the first
  // is this call's (and the only one where reuse is off). Each: this rank's view, its M where
  // transposing reads it (staged plans sharing no staging; transposed with the view), this rank's
  // row and column of the plan's matrix (bytes), and its staging budget. The generation of the
  // last plan (0: none to reuse) goes in every rank's header; recv_bytes_ is this call's column
  // until a plan made in it keeps it.
  struct kept_plan {
    plan p;
    server_matrix m;
    std::vector<bytes_t> balance; ///< a per-rail plan's, for transposing it (planner::balance_bytes)
    std::vector<bytes_t> row, col;
    bytes_t budget = 0;
  };
  std::vector<kept_plan> kept_ = std::vector<kept_plan>(1);
  std::vector<bytes_t> recv_bytes_;
  std::uint64_t plan_gen_ = 0;
  plan spare_; ///< transpose_into's target, swapped with a kept plan's
  const plan& plan_() const noexcept { return kept_.front().p; }
  // Displacements: prefix sums of the send counts for this server's messages where every rank's
  // are packed (4 G n words), else the second exchange's (null where not exchanged).
  rank_t home_ = 0; ///< this server's first rank
  std::vector<bytes_t> send_rows_, send_cols_, recv_cols_, recv_rows_;
  const std::uint64_t *send_displs_ = nullptr, *recv_displs_ = nullptr;
  std::size_t displ_words_ = 0;
  std::shared_ptr<const std::vector<std::byte>> displs_shared_;
  std::vector<std::uint64_t> displs_own_;

  // Registrations: this rank's buffers (windows and cached), its staging, what it knows of peers.
  std::vector<registration> regs_;
  std::uint64_t next_id_ = 1, clock_ = 0;
  typename M::buffer staging_{};
  std::optional<registration> staging_reg_;
  std::vector<bytes_t> staging_cap_; ///< every rank's staging capacity, tracked from the plans
  std::vector<std::vector<remote_entry>> known_;
  std::vector<peer_stage> peer_staging_;

  // Execution's scratch (used by one thread at a time: the caller's, or the proxy's while calls
  // are queued; the host form drains the queue first).
  std::vector<rank_t> rail_peer_;
  std::vector<std::uint64_t> rail_count_;
  std::vector<std::size_t> leaving_; // stages whose rail sends have not yet left this rank
  struct redist_signal {
    std::size_t stage;
    rank_t peer;
    std::uint64_t count;
  };
  std::vector<redist_signal> redist_sent_; // redistributions not yet released (shared staging)
  bool polled_[2] = {false, false};        // run_stages: this turn polled scale-up [0], scale-out [1]
  std::vector<instr> deferred_;            // lazy rail expects (expects_gate_puts), by stage:
  std::vector<std::size_t> deferred_at_;   // stage t's are [deferred_at_[t], deferred_at_[t + 1])
  std::vector<std::pair<tier, rank_t>> ready_in_, ready_out_;

  // Bouncing scale-out data through host mirrors (see the class comment).
  bool bounce_ = false;

  // Stream-ordered calls: the queue, the proxy thread, the flag that releases callers' streams.
  mutable std::mutex qm_;
  mutable std::condition_variable qcv_;
  std::deque<std::unique_ptr<stream_job>> queue_;
  bool busy_ = false, stop_ = false;
  std::string async_error_;
  // Failures (see the class comment): set by abandon (either thread), read by settle.
  bool failed_ = false;
  std::vector<std::uint64_t> revoked_ids_;
  bool failed_seen_ = false; ///< calling thread: the flag this call's exchange carries
  std::string gone_;         ///< why the engine is unusable ("" while it works)
  typename M::buffer flag_{};
  std::uint64_t release_seq_ = 0;
  std::thread proxy_; // last: started only once everything above exists
};

/// The engine of the class comment above (engine_core), with the planner of decomposer D.
template <Topology Topo, Bootstrap Boot, Transport Up, Transport Out, Decomposer D = birkhoff_decomposer,
          MemorySpace M = host_memory>
class engine : public engine_core<Topo, Boot, Up, Out, M> {
public:
  /// Collective over the transports (each hands this engine a connection of its own: every rank
  /// makes its engines in the same order). Throws fasta2a::error if the bootstrap's size does not
  /// match the topology or an option is out of range. `dec` configures the decomposer (a best_of's
  /// alpha, a quantum); `mem` is the memory space (a GPU space carries its stream).
  engine(Topo topo, Boot& boot, Up& scaleup, Out& scaleout, engine_options opt = {}, D dec = D{}, M mem = M{})
      : engine_core<Topo, Boot, Up, Out, M>(topo, boot, scaleup, scaleout, opt, std::move(mem),
                                            std::make_unique<detail::rank_planner_of<Topo, D>>(topo, opt.planning, dec),
                                            detail::decomposer_digest(dec)) {}
};

} // namespace fasta2a
