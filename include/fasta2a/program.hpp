// fasta2a: a rank's part of a plan as a small flat program of batched operations (local copy, put
// of a contiguous run, expect, signal, wait), in sections a runner executes. The host runner is the
// engine's event loop; a stream-ordered GPU runner enqueues the same program.
#pragma once

#include <algorithm>
#include <cstdint>
#include <ostream>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "fasta2a/common.hpp"
#include "fasta2a/plan.hpp"
#include "fasta2a/transport.hpp"

namespace fasta2a {

/// The channels the engine opens on each connection: one per phase of FAST, so that a rank always
/// knows how many signals of each kind to wait for.
namespace engine_channel {
inline constexpr channel_id copy = 0;         ///< self and intra-server copies (scale-up)
inline constexpr channel_id balance = 1;      ///< balance, before a rail hop (scale-up)
inline constexpr channel_id rail = 2;         ///< rail hops and direct sends (scale-out)
inline constexpr channel_id redistribute = 3; ///< redistribution, after a rail hop (scale-up)
/// Staging credits, where a plan shares staging across stages (plan::staging_ring): a rail rank
/// tells the ranks that write into its slots that a slot is free again (both tiers).
inline constexpr channel_id credit = 4;
inline constexpr channel_id count = 5;
} // namespace engine_channel

/// The engine's name of one of its channels, for errors and program listings.
inline const char* engine_channel_name(channel_id c) noexcept {
  switch (c) {
  case engine_channel::copy: return "intra-server copy";
  case engine_channel::balance: return "balance";
  case engine_channel::rail: return "rail";
  case engine_channel::redistribute: return "redistribute";
  case engine_channel::credit: return "staging credit";
  }
  return "?";
}

/// Which of a rank's three buffers an operation reads or writes.
enum class buffer_id : std::uint8_t { send, recv, staging };
/// Which transport an operation uses.
enum class tier : std::uint8_t { scaleup, scaleout };
/// What an operation does.
enum class instr_op : std::uint8_t {
  copy,   ///< local copy src -> dst on this rank (memory space)
  put,    ///< bytes [src, src + bytes) of this rank's src_buf into peer's dst_buf at dst
  expect, ///< peer's put of bytes into this rank's dst_buf at dst (src: where it comes from)
  signal, ///< peer's counter for (this rank, channel) grows by one, after the puts before
  wait,   ///< the next signal from (peer, channel), and the expects it covers
};

inline const char* to_string(buffer_id b) noexcept {
  return b == buffer_id::send ? "send" : b == buffer_id::recv ? "recv" : "staging";
}
inline const char* to_string(tier t) noexcept { return t == tier::scaleup ? "up" : "out"; }
inline const char* to_string(instr_op o) noexcept {
  switch (o) {
  case instr_op::copy: return "copy";
  case instr_op::put: return "put";
  case instr_op::expect: return "expect";
  case instr_op::signal: return "signal";
  case instr_op::wait: return "wait";
  }
  return "?";
}

/// One operation. Offsets are bytes from the start of the buffer the user passed (send, recv) or
/// of the staging buffer; for an expect, `src` is where the bytes start at the sender (both sides
/// coalesce the same runs).
struct instr {
  instr_op op = instr_op::copy;
  tier via = tier::scaleup;
  buffer_id src_buf = buffer_id::send;
  buffer_id dst_buf = buffer_id::recv;
  channel_id channel = 0;
  rank_t peer = -1;
  std::int32_t stage = 0;
  bytes_t src = 0, dst = 0, bytes = 0;
  friend bool operator==(const instr&, const instr&) = default;
};

/// A rank's program: sections of instructions, each run in order.
/// - post: every expect of the call, in stage order (two-sided transports post their receives);
/// - start: self copies, intra-server puts and (direct plans) every inter-server put, then signals;
/// - per stage t: balance (puts, signals), await_balance (waits), rail (puts, one signal),
///   await_rail (waits), redistribute (puts, signals);
/// - finish: waits for everything addressed to this rank's receive buffer.
/// Where the plan shares staging across stages (plan::staging_ring K > 0), each stage t >= K also
/// has: credit_balance (waits: every rail rank this rank writes balance bytes into in stage t has
/// freed its balance slot t mod K, run before the balance puts), credit_rail (a wait: the rail
/// target has freed its arrival slot, run before the rail puts), release_out (signals to the ranks
/// that write balance bytes into this rank in stage t, run once this rank's rail sends of stage
/// t - K have left it) and release_in (a signal to the rank whose rail sends into this rank in stage
/// t, run once this rank's redistribution of stage t - K has left it). Credits are sent and awaited
/// in stage order, one per (stage, peer), whether or not that peer's bytes touch the slot, so both
/// sides count them from their own part of the plan.
/// A runner may interleave stages (the host runner keeps rail_window rail stages in flight) but
/// runs each section's instructions in order.
class rank_program {
public:
  enum class section : std::uint8_t {
    post, start, finish, balance, await_balance, rail, await_rail, redistribute,
    credit_balance, credit_rail, release_out, release_in
  };

  rank_t rank() const noexcept { return rank_; }
  std::size_t stages() const noexcept { return stages_; }
  /// Slots per staging ring where the plan shares staging across stages (plan::staging_ring), else 0.
  std::size_t ring() const noexcept { return ring_; }
  /// The instructions of one section (t: the stage, for per-stage sections).
  std::span<const instr> at(section s, std::size_t t = 0) const noexcept {
    const std::size_t k = index(s, t);
    return {code_.data() + offsets_[k], offsets_[k + 1] - offsets_[k]};
  }
  /// The peer this rank sends to on its rail in stage t, or -1.
  rank_t rail_peer(std::size_t t) const noexcept {
    for (const instr& i : at(section::rail, t))
      if (i.op == instr_op::signal) return i.peer;
    return -1;
  }
  /// Every instruction, section after section.
  std::span<const instr> code() const noexcept { return code_; }
  /// Puts (after coalescing) and the plan's pieces this rank sends (one put each before).
  std::size_t puts() const noexcept { return count(instr_op::put); }
  std::size_t pieces_sent() const noexcept { return pieces_sent_; }
  std::size_t count(instr_op o) const noexcept {
    return static_cast<std::size_t>(std::count_if(code_.begin(), code_.end(), [&](const instr& i) { return i.op == o; }));
  }

  /// A listing, one instruction per line, for debugging (`fasta2a run --dump-program RANK`).
  void print(std::ostream& os) const {
    os << "rank " << rank_ << ": " << stages_ << " stages, " << code_.size() << " instructions, " << puts()
       << " puts for " << pieces_sent_ << " pieces sent, " << count(instr_op::expect) << " expects\n";
    auto list = [&](const char* name, section s, std::size_t t, bool staged) {
      const auto ins = at(s, t);
      if (ins.empty()) return;
      os << name;
      if (staged) os << " stage " << t;
      os << ":\n";
      for (const instr& i : ins) {
        os << "  " << to_string(i.op);
        if (i.op != instr_op::copy) os << ' ' << to_string(i.via) << ' ' << engine_channel_name(i.channel) << " peer " << i.peer;
        if (i.op == instr_op::copy || i.op == instr_op::put || i.op == instr_op::expect)
          os << ' ' << i.bytes << " B " << to_string(i.src_buf) << '@' << i.src << " -> " << to_string(i.dst_buf) << '@'
             << i.dst;
        if (s == section::post) os << " (stage " << i.stage << ')';
        os << '\n';
      }
    };
    list("post", section::post, 0, false);
    list("start", section::start, 0, false);
    for (std::size_t t = 0; t < stages_; ++t) {
      list("release out", section::release_out, t, true);
      list("release in", section::release_in, t, true);
      list("credit balance", section::credit_balance, t, true);
      list("balance", section::balance, t, true);
      list("await balance", section::await_balance, t, true);
      list("credit rail", section::credit_rail, t, true);
      list("rail", section::rail, t, true);
      list("await rail", section::await_rail, t, true);
      list("redistribute", section::redistribute, t, true);
    }
    list("finish", section::finish, 0, false);
  }

private:
  template <class Layout>
  friend class program_builder;
  static constexpr std::size_t per_stage = 9;
  static std::size_t index(section s, std::size_t t) noexcept {
    switch (s) {
    case section::post: return 0;
    case section::start: return 1;
    case section::finish: return 2;
    default: return 3 + per_stage * t + (static_cast<std::size_t>(s) - static_cast<std::size_t>(section::balance));
    }
  }

  rank_t rank_ = -1;
  std::size_t stages_ = 0, pieces_sent_ = 0, ring_ = 0;
  std::vector<instr> code_;
  std::vector<std::uint32_t> offsets_;
};

/// Turns a rank's part of a plan (a whole plan or the rank's view) into its rank_program.
/// `Layout` says where messages sit in the users' buffers, for every rank (the engine knows it from
/// the counts exchange): `send_offset(src, dst)` is the byte offset of message src -> dst in src's
/// send buffer, `recv_offset(dst, src)` that of the same message in dst's receive buffer.
///
/// Coalescing: within a section, transfers are ordered by (stage, tier, channel, peer, destination
/// buffer, destination offset), and a transfer that continues the previous one on both sides (same
/// peer, channel and buffers, source and destination contiguous) is merged into it. Sender and
/// receiver compute the same order and the same merges from the same plan and layout, so every
/// put meets exactly one expect. Reuse one builder across calls: it keeps its scratch memory.
template <class Layout>
class program_builder {
public:
  /// Fills `out` with rank `me`'s program of plan p.
  void build(const plan& p, rank_t me, const Layout& L, rank_program& out) {
    raw_.clear();
    out.rank_ = me;
    out.stages_ = p.stages();
    out.ring_ = p.staged ? p.staging_ring : 0;
    out.pieces_sent_ = 0;
    credits_.clear();
    const std::size_t K = out.ring_;
    const std::size_t T = p.stages(), slots = p.op_stages();
    const std::size_t sections = 3 + rank_program::per_stage * T;
    using sec = rank_program::section;
    auto emit = [&](sec s, std::size_t t, const instr& i) { raw_.push_back({static_cast<std::uint32_t>(rank_program::index(s, t)), i}); };
    auto transfer = [](instr_op op, tier via, channel_id ch, rank_t peer, std::int32_t stage, buffer_id sb, bytes_t so,
                       buffer_id db, bytes_t d, bytes_t n) {
      instr i;
      i.op = op, i.via = via, i.channel = ch, i.peer = peer, i.stage = stage;
      i.src_buf = sb, i.src = so, i.dst_buf = db, i.dst = d, i.bytes = n;
      return i;
    };
    for (std::size_t t = 0; t < slots; ++t)
      for (const rank_op& op : p.ops(me, t)) {
        const piece& pc = p.pieces[op.piece];
        const std::int32_t st = static_cast<std::int32_t>(t);
        const bytes_t from = L.send_offset(pc.src, pc.dst) + pc.offset; // in src's send buffer
        const bytes_t to = L.recv_offset(pc.dst, pc.src) + pc.offset;   // in dst's receive buffer
        const rank_t a = pc.rail >= 0 ? p.rail_source(pc) : -1, b = pc.rail >= 0 ? p.rail_target(pc) : -1;
        // Where a rail hop reads at a and writes at b.
        const buffer_id rail_sb = a == pc.src ? buffer_id::send : buffer_id::staging;
        const bytes_t rail_so = a == pc.src ? from : pc.stage_out;
        const buffer_id rail_db = b == pc.dst ? buffer_id::recv : buffer_id::staging;
        const bytes_t rail_do = b == pc.dst ? to : pc.stage_in;
        switch (op.kind) {
        case op_kind::self_copy:
          emit(sec::start, 0, transfer(instr_op::copy, tier::scaleup, 0, me, 0, buffer_id::send, from, buffer_id::recv, to, pc.bytes));
          break;
        case op_kind::intra_send:
          ++out.pieces_sent_;
          emit(sec::start, 0, transfer(instr_op::put, tier::scaleup, engine_channel::copy, pc.dst, 0, buffer_id::send, from,
                                       buffer_id::recv, to, pc.bytes));
          break;
        case op_kind::intra_recv:
          emit(sec::post, 0, transfer(instr_op::expect, tier::scaleup, engine_channel::copy, pc.src, 0, buffer_id::send, from,
                                      buffer_id::recv, to, pc.bytes));
          break;
        case op_kind::direct_send:
          ++out.pieces_sent_;
          emit(sec::start, 0, transfer(instr_op::put, tier::scaleout, engine_channel::rail, pc.dst, 0, buffer_id::send, from,
                                       buffer_id::recv, to, pc.bytes));
          break;
        case op_kind::direct_recv:
          emit(sec::post, 0, transfer(instr_op::expect, tier::scaleout, engine_channel::rail, pc.src, 0, buffer_id::send,
                                      from, buffer_id::recv, to, pc.bytes));
          break;
        case op_kind::balance_send:
          ++out.pieces_sent_;
          emit(sec::balance, t, transfer(instr_op::put, tier::scaleup, engine_channel::balance, a, st, buffer_id::send, from,
                                         buffer_id::staging, pc.stage_out, pc.bytes));
          break;
        case op_kind::balance_recv:
          emit(sec::post, 0, transfer(instr_op::expect, tier::scaleup, engine_channel::balance, pc.src, st, buffer_id::send,
                                      from, buffer_id::staging, pc.stage_out, pc.bytes));
          break;
        case op_kind::rail_send:
          ++out.pieces_sent_;
          emit(sec::rail, t, transfer(instr_op::put, tier::scaleout, engine_channel::rail, b, st, rail_sb, rail_so, rail_db,
                                      rail_do, pc.bytes));
          break;
        case op_kind::rail_recv:
          emit(sec::post, 0, transfer(instr_op::expect, tier::scaleout, engine_channel::rail, a, st, rail_sb, rail_so, rail_db,
                                      rail_do, pc.bytes));
          break;
        case op_kind::redistribute_send:
          ++out.pieces_sent_;
          emit(sec::redistribute, t, transfer(instr_op::put, tier::scaleup, engine_channel::redistribute, pc.dst, st,
                                              buffer_id::staging, pc.stage_in, buffer_id::recv, to, pc.bytes));
          break;
        case op_kind::redistribute_recv:
          emit(sec::post, 0, transfer(instr_op::expect, tier::scaleup, engine_channel::redistribute, b, st, buffer_id::staging,
                                      pc.stage_in, buffer_id::recv, to, pc.bytes));
          break;
        }
        if (K > 0 && t >= K) { // staging credits of stage t (see rank_program)
          instr c;
          c.channel = engine_channel::credit, c.stage = st, c.bytes = 0;
          sec where = sec::post;
          switch (op.kind) {
          case op_kind::balance_send: c.op = instr_op::wait, c.via = tier::scaleup, c.peer = a, where = sec::credit_balance; break;
          case op_kind::rail_send: c.op = instr_op::wait, c.via = tier::scaleout, c.peer = b, where = sec::credit_rail; break;
          case op_kind::balance_recv: c.op = instr_op::signal, c.via = tier::scaleup, c.peer = pc.src, where = sec::release_out; break;
          case op_kind::rail_recv: c.op = instr_op::signal, c.via = tier::scaleout, c.peer = a, where = sec::release_in; break;
          default: break;
          }
          if (where != sec::post) credits_.push_back({static_cast<std::uint32_t>(rank_program::index(where, t)), c});
        }
      }
    std::sort(credits_.begin(), credits_.end(), [](const entry& x, const entry& y) {
      return std::tie(x.section, x.i.peer) < std::tie(y.section, y.i.peer);
    });
    credits_.erase(std::unique(credits_.begin(), credits_.end(),
                               [](const entry& x, const entry& y) { return x.section == y.section && x.i.peer == y.i.peer; }),
                   credits_.end());
    std::sort(raw_.begin(), raw_.end(), [](const entry& x, const entry& y) {
      const instr &a = x.i, &b = y.i;
      if (x.section != y.section) return x.section < y.section;
      if (a.stage != b.stage) return a.stage < b.stage;
      if (a.op != b.op) return a.op < b.op; // copies before puts in the start section
      if (a.via != b.via) return a.via < b.via;
      if (a.channel != b.channel) return a.channel < b.channel;
      if (a.peer != b.peer) return a.peer < b.peer;
      if (a.dst_buf != b.dst_buf) return a.dst_buf < b.dst_buf;
      return a.dst < b.dst;
    });

    // Waits: one per (peer, channel) whose expects a section depends on, per stage.
    waits_.clear();
    for (const entry& e : raw_) {
      if (e.i.op != instr_op::expect) continue;
      const instr& x = e.i;
      std::uint32_t target;
      if (x.channel == engine_channel::balance) target = static_cast<std::uint32_t>(rank_program::index(sec::await_balance, x.stage));
      else if (x.channel == engine_channel::rail && p.staged) target = static_cast<std::uint32_t>(rank_program::index(sec::await_rail, x.stage));
      else target = static_cast<std::uint32_t>(rank_program::index(sec::finish, 0));
      instr w;
      w.op = instr_op::wait, w.via = x.via, w.channel = x.channel, w.peer = x.peer, w.stage = x.stage;
      w.bytes = 0;
      waits_.push_back({target, w});
    }
    std::sort(waits_.begin(), waits_.end(), [](const entry& x, const entry& y) {
      if (x.section != y.section) return x.section < y.section;
      if (x.i.stage != y.i.stage) return x.i.stage < y.i.stage;
      if (x.i.via != y.i.via) return x.i.via < y.i.via;
      if (x.i.channel != y.i.channel) return x.i.channel < y.i.channel;
      return x.i.peer < y.i.peer;
    });
    waits_.erase(std::unique(waits_.begin(), waits_.end(),
                             [](const entry& x, const entry& y) {
                               return x.section == y.section && x.i.stage == y.i.stage && x.i.via == y.i.via &&
                                      x.i.channel == y.i.channel && x.i.peer == y.i.peer;
                             }),
                 waits_.end());

    out.code_.clear();
    out.offsets_.assign(sections + 1, 0);
    std::size_t r = 0, w = 0, c = 0;
    for (std::size_t s = 0; s < sections; ++s) {
      out.offsets_[s] = static_cast<std::uint32_t>(out.code_.size());
      const std::size_t first = out.code_.size();
      for (; r < raw_.size() && raw_[r].section == s; ++r) {
        const instr& x = raw_[r].i;
        if (out.code_.size() > first) {
          instr& prev = out.code_.back();
          if (prev.op == x.op && prev.via == x.via && prev.channel == x.channel && prev.peer == x.peer &&
              prev.stage == x.stage && prev.src_buf == x.src_buf && prev.dst_buf == x.dst_buf &&
              prev.src + prev.bytes == x.src && prev.dst + prev.bytes == x.dst) {
            prev.bytes += x.bytes;
            continue;
          }
        }
        out.code_.push_back(x);
      }
      // One signal per (tier, channel, peer) that this section put to, after its puts.
      const std::size_t puts_end = out.code_.size();
      for (std::size_t k = first; k < puts_end; ++k) {
        const instr& x = out.code_[k];
        if (x.op != instr_op::put) continue;
        bool seen = false;
        for (std::size_t m = puts_end; m < out.code_.size() && !seen; ++m)
          seen = out.code_[m].via == x.via && out.code_[m].channel == x.channel && out.code_[m].peer == x.peer;
        if (seen) continue;
        instr sg;
        sg.op = instr_op::signal, sg.via = x.via, sg.channel = x.channel, sg.peer = x.peer, sg.stage = x.stage;
        out.code_.push_back(sg);
      }
      for (; w < waits_.size() && waits_[w].section == s; ++w) out.code_.push_back(waits_[w].i);
      for (; c < credits_.size() && credits_[c].section == s; ++c) out.code_.push_back(credits_[c].i);
    }
    out.offsets_[sections] = static_cast<std::uint32_t>(out.code_.size());
  }

private:
  struct entry {
    std::uint32_t section;
    instr i;
  };
  std::vector<entry> raw_, waits_, credits_;
};

} // namespace fasta2a
