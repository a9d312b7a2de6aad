// fasta2a: the all-to-allv engine. Plans each call with FAST and executes the plan over a
// scale-up and a scale-out Transport, with real bytes.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "fasta2a/common.hpp"
#include "fasta2a/decompose.hpp"
#include "fasta2a/plan.hpp"
#include "fasta2a/planner.hpp"
#include "fasta2a/topology.hpp"
#include "fasta2a/transport.hpp"

namespace fasta2a {

/// Options of an engine.
struct engine_options {
  plan_options planning{};
  /// How long a rank waits for any one signal (or the bootstrap) before the call fails with an
  /// error naming the peer, the channel and the stage.
  std::chrono::milliseconds timeout{30000};
  /// Rail stages whose sends may be leaving this rank at once. A rank posts the rail sends of
  /// stage t as soon as its balance data for t has arrived and fewer than rail_window of its
  /// earlier stages' rail sends are still leaving it (Transport::sent, in any order: a slow flow
  /// into a busy receiver holds one slot, not the window). Each rank paces its own NIC, with no
  /// wait for what other ranks receive. 1 keeps stages strictly apart at every sender; with larger
  /// windows a receiver has at most about rail_window senders at once while each sender splits its
  /// NIC among as many flows. Measured on the emulated cluster (README, examples/cluster): Megatron
  /// matrix 0 at 8 servers x 2 ranks 1.11 / 1.01 / 1.02 x LB_server with windows 3 / 5 / 8; at 4 x 4
  /// windows 3 and 5 are equal. At least 1.
  std::size_t rail_window = 5;
  /// How the engine's own event loop waits when nothing is ready (spin, yield, then sleep with
  /// back-off). Blocking waits inside a transport use that transport's wait_policy, given when it
  /// is made (host_transport, mpi_transport options).
  wait_policy waiting{};
};

/// Where the time of the last call went (seconds, measured on this rank).
struct call_stats {
  double plan_s = 0;     ///< planning
  double exchange_s = 0; ///< the two bootstrap exchanges (counts, then plan hash and handles)
  double execute_s = 0;  ///< moving bytes: copies, balance, rail stages, redistribution
  double total_s = 0;
};

/// A 64-bit digest of what every rank's view of one plan shares: shape, granule, decomposer,
/// stages and the staging layout. Ranks compare it, so that a rank with another topology,
/// decomposer or options is caught before any byte moves.
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
  for (bytes_t b : p.staging_bytes) mix(b);
  return h;
}

/// The two-phase all-to-allv engine of one rank, composed at compile time from a Topology, a
/// Bootstrap, a scale-up and a scale-out Transport, and a Decomposer.
///
/// Every call: (1) one allgather exchanges the counts (and each rank's verdict on its own
/// arguments), so every rank knows the whole traffic matrix; (2) every rank computes its own part
/// of the same plan (planner::make_rank_into);
/// (3) a second allgather compares plan hashes and exchanges memory handles; (4) the plan runs:
/// self and intra-server copies, then the stages as an event loop: balance puts run
/// engine_options::rail_window stages ahead, a rank sends stage t on its rail once its balance
/// data for t has arrived and fewer than rail_window of its earlier stages' rail sends are still
/// leaving it (each rank paces its NIC; no rank waits for what others receive), and each stage is
/// redistributed as soon as its rail data lands. Signals are point to point; there is no barrier between stages. Staging memory is sized from the plan, allocated once and
/// only ever grown, and reused across calls; the allgathers order one call after the previous one.
///
/// An error raised before execution (bad arguments, counts or plans that disagree) leaves the
/// engine usable. An error during execution (a peer that did not signal in time) leaves signal
/// counts and, on two-sided transports, posted receives out of step with the peers: discard the
/// engine and its transports then (the communicator is in an unknown state, as after an MPI error).
template <Topology Topo, Bootstrap Boot, Transport Up, Transport Out, Decomposer D = birkhoff_decomposer>
class engine {
public:
  /// Throws fasta2a::error if the bootstrap's size does not match the topology. `dec` configures
  /// the decomposer (a best_of's alpha, a quantum).
  engine(Topo topo, Boot& boot, Up& scaleup, Out& scaleout, engine_options opt = {}, D dec = D{})
      : planner_(topo, opt.planning, std::move(dec)), boot_(&boot), up_(&scaleup), out_(&scaleout), opt_(opt) {
    n_ = topo.ranks();
    me_ = boot.rank();
    if (boot.size() != n_)
      throw error("engine: the bootstrap has " + std::to_string(boot.size()) + " ranks, the topology " +
                  std::to_string(topo.servers()) + " x " + std::to_string(topo.gpus_per_server()) +
                  " = " + std::to_string(n_));
    if (opt_.rail_window < 1) throw error("engine: rail_window must be at least 1");
    expected_.assign(static_cast<std::size_t>(n_) * 2 * channel_count, 0);
    rail_signals_.assign(static_cast<std::size_t>(n_), 0);
  }
  engine(const engine&) = delete;
  engine& operator=(const engine&) = delete;

  rank_t rank() const noexcept { return me_; }
  rank_t ranks() const noexcept { return n_; }
  /// Bytes of staging memory this rank holds (grown to the largest plan so far).
  bytes_t staging_bytes() const noexcept { return staging_size_; }
  /// This rank's view of the last call's plan.
  const plan& last_plan() const noexcept { return plan_; }
  const call_stats& last_stats() const noexcept { return stats_; }

  /// All-to-allv, as MPI_Alltoallv and torch.distributed.all_to_all_single: this rank sends
  /// send_counts[j] elements starting at element send_displs[j] of `send` to rank j, and receives
  /// recv_counts[i] elements from rank i at element recv_displs[i] of `recv`. Elements are
  /// elem_size bytes. Every rank must call it with consistent counts. Errors (counts that do not
  /// fit the buffers, counts that disagree between ranks, plans that differ, a peer that does not
  /// signal within the timeout) are raised on every rank that can see them, before any byte moves
  /// where possible.
  void alltoallv(std::span<const std::byte> send, std::span<const std::uint64_t> send_counts,
                 std::span<const std::uint64_t> send_displs, std::span<std::byte> recv,
                 std::span<const std::uint64_t> recv_counts, std::span<const std::uint64_t> recv_displs,
                 std::size_t elem_size = 1) {
    using clock = std::chrono::steady_clock;
    const auto t0 = clock::now();
    exchange_counts(send, send_counts, send_displs, recv, recv_counts, recv_displs, elem_size);
    const auto t1 = clock::now();
    planner_.make_rank_into(traffic_, me_, plan_); // this rank's part only
    const auto t2 = clock::now();
    exchange_handles(send, recv);
    const auto t3 = clock::now();
    execute(send, recv);
    const auto t4 = clock::now();
    auto sec = [](auto a, auto b) { return std::chrono::duration<double>(b - a).count(); };
    stats_ = {sec(t1, t2), sec(t0, t1) + sec(t2, t3), sec(t3, t4), sec(t0, t4)};
  }

  /// Typed form: counts and displacements in elements of T.
  template <class T>
  void alltoallv(std::span<const T> send, std::span<const std::uint64_t> send_counts,
                 std::span<const std::uint64_t> send_displs, std::span<T> recv,
                 std::span<const std::uint64_t> recv_counts, std::span<const std::uint64_t> recv_displs) {
    alltoallv(std::as_bytes(send), send_counts, send_displs, std::as_writable_bytes(recv), recv_counts,
              recv_displs, sizeof(T));
  }

private:
  // Per-rank words of the first exchange: verdict, element size, then per peer the bytes this rank
  // sends, the bytes it expects to receive, and the byte offset in its receive buffer.
  static constexpr std::size_t header_words = 2;

  std::size_t counts_words() const noexcept { return header_words + 3 * static_cast<std::size_t>(n_); }

  // Checks this rank's arguments, exchanges everything every rank needs to plan and to address
  // its peers' receive buffers, and checks the whole matrix for consistency.
  void exchange_counts(std::span<const std::byte> send, std::span<const std::uint64_t> send_counts,
                       std::span<const std::uint64_t> send_displs, std::span<std::byte> recv,
                       std::span<const std::uint64_t> recv_counts, std::span<const std::uint64_t> recv_displs,
                       std::size_t elem_size) {
    const std::size_t w = counts_words();
    mine_.assign(w, 0);
    std::string problem = check_arguments(send, send_counts, send_displs, recv, recv_counts, recv_displs, elem_size);
    mine_[0] = problem.empty() ? 0 : 1;
    mine_[1] = elem_size;
    if (problem.empty())
      for (rank_t j = 0; j < n_; ++j) {
        mine_[header_words + j] = send_counts[j] * elem_size;
        mine_[header_words + n_ + j] = recv_counts[j] * elem_size;
        mine_[header_words + 2 * n_ + j] = recv_displs[j] * elem_size;
      }
    all_.assign(w * n_, 0);
    boot_->allgather(std::as_bytes(std::span(mine_)), std::as_writable_bytes(std::span(all_)));
    if (!problem.empty()) throw error("rank " + std::to_string(me_) + ": " + problem);
    for (rank_t r = 0; r < n_; ++r) {
      if (word(r, 0) != 0)
        throw error("rank " + std::to_string(r) + " refused its all-to-allv arguments; nothing was sent");
      if (word(r, 1) != elem_size)
        throw error("rank " + std::to_string(r) + " uses elements of " + std::to_string(word(r, 1)) +
                    " bytes, rank " + std::to_string(me_) + " of " + std::to_string(elem_size));
    }
    traffic_.resize(n_, n_);
    for (rank_t i = 0; i < n_; ++i)
      for (rank_t j = 0; j < n_; ++j) traffic_(i, j) = word(i, header_words + j);
    for (rank_t j = 0; j < n_; ++j)
      for (rank_t i = 0; i < n_; ++i)
        if (word(j, header_words + n_ + i) != traffic_(i, j))
          throw error("rank " + std::to_string(j) + " expects " + std::to_string(word(j, header_words + n_ + i)) +
                      " bytes from rank " + std::to_string(i) + ", which sends " +
                      std::to_string(traffic_(i, j)) + "; nothing was sent");
    send_displ_.resize(n_);
    for (rank_t j = 0; j < n_; ++j) send_displ_[j] = send_displs[j] * elem_size;
  }

  std::uint64_t word(rank_t r, std::size_t k) const noexcept { return all_[static_cast<std::size_t>(r) * counts_words() + k]; }
  // Byte offset in rank dst's receive buffer where the message from src starts.
  bytes_t recv_displ(rank_t dst, rank_t src) const noexcept { return word(dst, header_words + 2 * n_ + src); }

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

  // Grows staging to the plan's need, registers the three buffers with both transports, and
  // exchanges the plan hash and every handle.
  void exchange_handles(std::span<const std::byte> send, std::span<std::byte> recv) {
    const bytes_t need = plan_.staging_bytes[me_];
    if (staging_size_ < need) { // grown, never shrunk; left uninitialised (every byte read is written first)
      staging_ = std::make_unique_for_overwrite<std::byte[]>(need);
      staging_size_ = need;
    }
    auto* sendp = const_cast<std::byte*>(send.data()); // registered as a source only
    send_up_ = up_->register_memory(sendp, send.size());
    send_out_ = out_->register_memory(sendp, send.size());
    recv_up_ = up_->register_memory(recv.data(), recv.size());
    recv_out_ = out_->register_memory(recv.data(), recv.size());
    stage_up_ = up_->register_memory(staging_.get(), staging_size_);
    stage_out_ = out_->register_memory(staging_.get(), staging_size_);

    constexpr std::size_t hu = Up::handle_bytes, ho = Out::handle_bytes;
    const std::size_t blob = 8 + 2 * hu + 2 * ho;
    handles_.assign(blob, std::byte{0});
    const std::uint64_t hash = plan_hash(plan_);
    std::memcpy(handles_.data(), &hash, 8);
    auto put_handle = [&](std::size_t at, const std::vector<std::byte>& h, std::size_t size) {
      if (h.size() != size) throw error("transport handle has " + std::to_string(h.size()) + " bytes, declared " + std::to_string(size));
      std::memcpy(handles_.data() + at, h.data(), size);
    };
    put_handle(8, up_->serialize(recv_up_), hu);
    put_handle(8 + hu, up_->serialize(stage_up_), hu);
    put_handle(8 + 2 * hu, out_->serialize(recv_out_), ho);
    put_handle(8 + 2 * hu + ho, out_->serialize(stage_out_), ho);
    all_handles_.assign(blob * n_, std::byte{0});
    boot_->allgather(handles_, all_handles_);
    remote_recv_up_.clear();
    remote_stage_up_.clear();
    remote_recv_out_.clear();
    remote_stage_out_.clear();
    for (rank_t r = 0; r < n_; ++r) {
      const std::byte* b = all_handles_.data() + blob * r;
      std::uint64_t h;
      std::memcpy(&h, b, 8);
      if (h != hash)
        throw error("rank " + std::to_string(r) + " computed a different plan than rank " + std::to_string(me_) +
                    " (hash " + std::to_string(h) + " vs " + std::to_string(hash) +
                    "): every rank must use the same topology, decomposer and plan options; nothing was sent");
      remote_recv_up_.push_back(up_->deserialize(r, std::span(b + 8, hu)));
      remote_stage_up_.push_back(up_->deserialize(r, std::span(b + 8 + hu, hu)));
      remote_recv_out_.push_back(out_->deserialize(r, std::span(b + 8 + 2 * hu, ho)));
      remote_stage_out_.push_back(out_->deserialize(r, std::span(b + 8 + 2 * hu + ho, ho)));
    }
  }

  // Counts the next signal from (peer, ch) and waits for it, naming what is missing on timeout.
  template <class Tr>
  void await(Tr& tr, bool scaleup, rank_t peer, channel ch, std::size_t stage) {
    std::uint64_t& e = expected_[(static_cast<std::size_t>(peer) * 2 + (scaleup ? 0 : 1)) * channel_count +
                                 static_cast<std::uint32_t>(ch)];
    ++e;
    if (!tr.wait(peer, ch, e, opt_.timeout))
      throw error("rank " + std::to_string(me_) + ": no " + to_string(ch) + " signal from rank " +
                  std::to_string(peer) + (plan_.staged ? " in stage " + std::to_string(stage) : std::string()) +
                  " within " + std::to_string(opt_.timeout.count()) + " ms");
  }

  // Who an op of a piece talks to: its source, its destination, or the rail ranks it rides between.
  static constexpr auto src_of = [](const piece& pc) { return pc.src; };
  static constexpr auto dst_of = [](const piece& pc) { return pc.dst; };
  auto rail_source_of() const {
    return [this](const piece& pc) { return plan_.rail_source(pc); };
  }
  auto rail_target_of() const {
    return [this](const piece& pc) { return plan_.rail_target(pc); };
  }

  // Takes the next signal from (peer, ch) if it is there already; never blocks.
  template <class Tr>
  bool take(Tr& tr, bool scaleup, rank_t peer, channel ch) {
    std::uint64_t& e = expected_[(static_cast<std::size_t>(peer) * 2 + (scaleup ? 0 : 1)) * channel_count +
                                 static_cast<std::uint32_t>(ch)];
    if (!tr.test(peer, ch, e + 1)) return false;
    ++e;
    return true;
  }

  // Distinct peers of one op list, in first-seen order (lists are short: G or fewer peers).
  template <class PeerOf>
  const std::vector<rank_t>& peers_of(std::span<const rank_op> ops, op_kind kind, PeerOf&& peer_of) {
    return peers_into(peers_, ops, kind, peer_of);
  }
  template <class PeerOf>
  const std::vector<rank_t>& peers_into(std::vector<rank_t>& out, std::span<const rank_op> ops, op_kind kind,
                                        PeerOf&& peer_of) {
    out.clear();
    for (const rank_op& op : ops)
      if (op.kind == kind) {
        const rank_t p = peer_of(plan_.pieces[op.piece]);
        if (std::find(out.begin(), out.end(), p) == out.end()) out.push_back(p);
      }
    return out;
  }

  void execute(std::span<const std::byte> send, std::span<std::byte> recv) {
    const plan& p = plan_;
    const std::size_t T = p.stages(), slots = p.op_stages();
    const auto rail_src = rail_source_of(), rail_dst = rail_target_of();
    auto my_recv_at = [&](const piece& pc) { return recv_displ(me_, pc.src) + pc.offset; };

    // Every receive of the call, posted up front in stage order (two-sided transports match them).
    for (std::size_t t = 0; t < slots; ++t)
      for (const rank_op& op : p.ops(me_, t)) {
        const piece& pc = p.pieces[op.piece];
        switch (op.kind) {
        case op_kind::intra_recv: up_->expect(pc.src, recv_up_, my_recv_at(pc), pc.bytes, channel::copy); break;
        case op_kind::direct_recv: out_->expect(pc.src, recv_out_, my_recv_at(pc), pc.bytes, channel::rail); break;
        case op_kind::balance_recv: up_->expect(pc.src, stage_up_, pc.stage_out, pc.bytes, channel::balance); break;
        case op_kind::rail_recv:
          if (pc.dst == me_) out_->expect(rail_src(pc), recv_out_, my_recv_at(pc), pc.bytes, channel::rail);
          else out_->expect(rail_src(pc), stage_out_, pc.stage_in, pc.bytes, channel::rail);
          break;
        case op_kind::redistribute_recv:
          up_->expect(rail_dst(pc), recv_up_, my_recv_at(pc), pc.bytes, channel::redistribute);
          break;
        default: break;
        }
      }

    // Self copies, intra-server traffic and (direct plans) every inter-server message.
    const auto first = p.ops(me_, 0);
    for (const rank_op& op : first) {
      const piece& pc = p.pieces[op.piece];
      const bytes_t from = send_displ_[pc.dst] + pc.offset;
      if (op.kind == op_kind::self_copy) {
        std::memcpy(recv.data() + my_recv_at(pc), send.data() + from, pc.bytes);
      } else if (op.kind == op_kind::intra_send) {
        up_->put(pc.dst, send_up_, from, remote_recv_up_[pc.dst], recv_displ(pc.dst, pc.src) + pc.offset, pc.bytes,
                 channel::copy);
      } else if (op.kind == op_kind::direct_send) {
        out_->put(pc.dst, send_out_, from, remote_recv_out_[pc.dst], recv_displ(pc.dst, pc.src) + pc.offset,
                  pc.bytes, channel::rail);
      }
    }
    for (rank_t d : peers_of(first, op_kind::intra_send, dst_of)) up_->signal(d, channel::copy);
    for (rank_t d : peers_of(first, op_kind::direct_send, dst_of)) {
      out_->signal(d, channel::rail);
      ++rail_signals_[d]; // counted like a stage's rail signal, so that sent() counts stay exact
    }

    if (T > 0) run_stages();

    // Everything addressed to this rank's receive buffer has landed.
    for (rank_t s : peers_of(first, op_kind::intra_recv, src_of)) await(*up_, true, s, channel::copy, 0);
    for (rank_t s : peers_of(first, op_kind::direct_recv, src_of)) await(*out_, false, s, channel::rail, 0);
    for (std::size_t t = 0; t < T; ++t)
      for (rank_t s : peers_of(p.ops(me_, t), op_kind::redistribute_recv, rail_dst))
        await(*up_, true, s, channel::redistribute, t);
    up_->flush();
    out_->flush();
  }

  // The staged part, as an event loop over three cursors: balance puts run rail_window stages
  // ahead of the rail; the rail sends of stage t start once t's balance data has arrived and fewer
  // than rail_window earlier stages' rail sends are still leaving this rank; stage r is
  // redistributed as soon as its rail data has arrived. Nothing waits on a condition while another one could progress.
  void run_stages() {
    const plan& p = plan_;
    const std::size_t T = p.stages(), W = opt_.rail_window;
    const auto rail_src = rail_source_of(), rail_dst = rail_target_of();

    auto post_balance = [&](std::size_t t) {
      const auto ops = p.ops(me_, t);
      for (const rank_op& op : ops)
        if (op.kind == op_kind::balance_send) {
          const piece& pc = p.pieces[op.piece];
          const rank_t a = rail_src(pc);
          up_->put(a, send_up_, send_displ_[pc.dst] + pc.offset, remote_stage_up_[a], pc.stage_out, pc.bytes,
                   channel::balance);
        }
      for (rank_t a : peers_of(ops, op_kind::balance_send, rail_src)) up_->signal(a, channel::balance);
    };
    rail_peer_.assign(T, -1);
    rail_count_.assign(T, 0);
    leaving_.clear();
    auto post_rail = [&](std::size_t t) {
      rank_t peer = -1;
      for (const rank_op& op : p.ops(me_, t))
        if (op.kind == op_kind::rail_send) {
          const piece& pc = p.pieces[op.piece];
          peer = rail_dst(pc);
          const bool own = pc.src == me_;
          const auto& from = own ? send_out_ : stage_out_;
          const bytes_t from_at = own ? send_displ_[pc.dst] + pc.offset : pc.stage_out;
          if (pc.dst == peer)
            out_->put(peer, from, from_at, remote_recv_out_[peer], recv_displ(peer, pc.src) + pc.offset, pc.bytes,
                      channel::rail);
          else
            out_->put(peer, from, from_at, remote_stage_out_[peer], pc.stage_in, pc.bytes, channel::rail);
        }
      if (peer >= 0) {
        out_->signal(peer, channel::rail);
        std::uint64_t& n = rail_signals_[peer];
        rail_peer_[t] = peer;
        rail_count_[t] = ++n;
        leaving_.push_back(t);
      }
    };
    auto post_redistribute = [&](std::size_t t) {
      const auto ops = p.ops(me_, t);
      for (const rank_op& op : ops)
        if (op.kind == op_kind::redistribute_send) {
          const piece& pc = p.pieces[op.piece];
          up_->put(pc.dst, stage_up_, pc.stage_in, remote_recv_up_[pc.dst], recv_displ(pc.dst, pc.src) + pc.offset,
                   pc.bytes, channel::redistribute);
        }
      for (rank_t d : peers_of(ops, op_kind::redistribute_send, dst_of)) up_->signal(d, channel::redistribute);
    };

    std::size_t rail = 0, redist = 0, bal_i = 0, in_i = 0;
    const std::size_t ahead = std::min(T, W);
    for (std::size_t t = 0; t < ahead; ++t) post_balance(t);
    peers_into(bal_peers_, p.ops(me_, 0), op_kind::balance_recv, src_of);
    peers_into(in_peers_, p.ops(me_, 0), op_kind::rail_recv, rail_src);

    detail::backoff idle(opt_.waiting);
    auto last = std::chrono::steady_clock::now();
    while (rail < T || redist < T) {
      bool moved = false;
      if (rail < T) {
        while (bal_i < bal_peers_.size() && take(*up_, true, bal_peers_[bal_i], channel::balance)) ++bal_i, moved = true;
        // Stages whose rail sends have left no longer count against the window, in any order:
        // one slow flow (into a busy receiver) holds one slot, not the whole window.
        std::erase_if(leaving_, [&](std::size_t t) {
          const bool gone = out_->sent(rail_peer_[t], channel::rail, rail_count_[t]);
          moved |= gone;
          return gone;
        });
        const bool window_open = leaving_.size() < W;
        if (bal_i == bal_peers_.size() && window_open) {
          post_rail(rail);
          if (rail + W < T) post_balance(rail + W);
          ++rail;
          bal_i = 0;
          if (rail < T) peers_into(bal_peers_, p.ops(me_, rail), op_kind::balance_recv, src_of);
          moved = true;
        }
      }
      if (redist < T) {
        while (in_i < in_peers_.size() && take(*out_, false, in_peers_[in_i], channel::rail)) ++in_i, moved = true;
        if (in_i == in_peers_.size()) {
          post_redistribute(redist);
          ++redist;
          in_i = 0;
          if (redist < T) peers_into(in_peers_, p.ops(me_, redist), op_kind::rail_recv, rail_src);
          moved = true;
        }
      }
      const auto now = std::chrono::steady_clock::now();
      if (moved) {
        idle.reset();
        last = now;
        continue;
      }
      if (now - last >= opt_.timeout) {
        const std::string within = " within " + std::to_string(opt_.timeout.count()) + " ms";
        const std::string who = "rank " + std::to_string(me_) + ": ";
        if (redist < T && in_i < in_peers_.size())
          throw error(who + "no " + to_string(channel::rail) + " signal from rank " + std::to_string(in_peers_[in_i]) +
                      " in stage " + std::to_string(redist) + within);
        if (rail < T && bal_i < bal_peers_.size())
          throw error(who + "no " + to_string(channel::balance) + " signal from rank " +
                      std::to_string(bal_peers_[bal_i]) + " in stage " + std::to_string(rail) + within);
        throw error(who + "its rail sends of stage " + std::to_string(leaving_.front()) + " to rank " +
                    std::to_string(rail_peer_[leaving_.front()]) + " did not leave" + within);
      }
      idle.pause();
    }
  }

  planner<Topo, D> planner_;
  Boot* boot_;
  Up* up_;
  Out* out_;
  engine_options opt_;
  rank_t n_ = 0, me_ = 0;
  plan plan_;
  traffic_matrix traffic_;
  call_stats stats_;
  std::vector<std::uint64_t> mine_, all_, expected_;
  std::vector<bytes_t> send_displ_;
  std::unique_ptr<std::byte[]> staging_;
  bytes_t staging_size_ = 0;
  std::vector<std::byte> handles_, all_handles_;
  std::vector<rank_t> peers_, bal_peers_, in_peers_, rail_peer_;
  std::vector<std::uint64_t> rail_count_;
  std::vector<std::size_t> leaving_; // stages whose rail sends have not yet left this rank
  std::vector<std::uint64_t> rail_signals_; // rail signals sent per peer, over the lifetime
  typename Up::memory send_up_{}, recv_up_{}, stage_up_{};
  typename Out::memory send_out_{}, recv_out_{}, stage_out_{};
  std::vector<typename Up::remote> remote_recv_up_, remote_stage_up_;
  std::vector<typename Out::remote> remote_recv_out_, remote_stage_out_;
};

} // namespace fasta2a
