// fasta2a: lower bounds and an alpha-beta cost model of plans. Everything here is a MODEL of
// time, computed from bytes and bandwidths; nothing is measured.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "fasta2a/plan.hpp"
#include "fasta2a/topology.hpp"
#include "fasta2a/traffic.hpp"

namespace fasta2a {

/// What `predict` changes in the topology's scale-out model (scaleout_of) for one prediction.
struct cost_params {
  /// Seconds per stage in place of the topology's scaleout_alpha(), to ask "what if stages cost
  /// this much"; unset, the topology's alpha.
  std::optional<double> alpha{};
  /// Also run the pipelined model (prediction::pipelined_s) with this many rail stages in flight
  /// per sender, the engine's engine_options::rail_window; 0 (the default): only the
  /// step-synchronous model runs.
  std::size_t rail_window = 0;
};

/// The scale-out model `predict` uses: the topology's, with cp's alpha where set.
template <Topology Topo>
scaleout_model scaleout_of(const Topo& topo, const cost_params& cp) {
  scaleout_model net = scaleout_of(topo);
  if (cp.alpha) net.alpha_s = *cp.alpha;
  return net;
}

/// Lower bounds on the time of any schedule (docs/DESIGN.md section 3), in seconds.
struct lower_bounds {
  double scaleout_s = 0; ///< LB_out: busiest server's out or in bytes / (G * b_out)
  double scaleup_s = 0;  ///< LB_up: busiest GPU port (switch) or GPU pair (mesh) of intra traffic
  /// The most server peers one server exchanges bytes with (sending or receiving): a staged
  /// one-to-one schedule needs at least this many stages (S - 1 when every server pair carries
  /// traffic).
  int peer_degree = 0;
  double overall_s() const noexcept { return std::max(scaleout_s, scaleup_s); }
  /// LB_alpha, the stage-aware bound of a staged plan whose stages cost alpha each: LB_out plus
  /// peer_degree stages of alpha (each stage a server sends to one server and receives from one),
  /// or LB_up if larger. Direct sending has no stages and is not bounded by it.
  double staged_s(double alpha_s) const noexcept {
    return std::max(scaleout_s + peer_degree * alpha_s, scaleup_s);
  }
};

template <Topology Topo>
lower_bounds lower_bound(const Topo& topo, const traffic_matrix& t) {
  const rank_t n = topo.ranks();
  check_traffic(t, n);
  const int S = topo.servers(), G = topo.gpus_per_server();
  std::vector<bytes_t> out(S, 0), in(S, 0), up_send(n, 0), up_recv(n, 0);
  bytes_t pair_max = 0;
  for (rank_t i = 0; i < n; ++i)
    for (rank_t j = 0; j < n; ++j) {
      const bytes_t v = t(i, j);
      if (i / G != j / G) {
        out[i / G] += v;
        in[j / G] += v;
      } else if (i != j) {
        up_send[i] += v;
        up_recv[j] += v;
        pair_max = std::max(pair_max, v);
      }
    }
  lower_bounds lb;
  bytes_t busiest = 0;
  for (int s = 0; s < S; ++s) busiest = std::max({busiest, out[s], in[s]});
  // Server peers: pairs (s, d), s != d, with any bytes between their GPUs.
  std::vector<int> sends_to(S, 0), receives_from(S, 0);
  for (int s = 0; s < S; ++s)
    for (int d = 0; d < S; ++d) {
      if (s == d) continue;
      bool any = false;
      for (int i = 0; i < G && !any; ++i)
        for (int j = 0; j < G && !any; ++j) any = t(s * G + i, d * G + j) != 0;
      if (any) {
        ++sends_to[s];
        ++receives_from[d];
      }
    }
  for (int s = 0; s < S; ++s) lb.peer_degree = std::max({lb.peer_degree, sends_to[s], receives_from[s]});
  lb.scaleout_s = static_cast<double>(busiest) / (G * topo.scaleout_bandwidth());
  if (topo.scaleup() == scaleup_kind::switch_fabric) {
    bytes_t port = 0;
    for (rank_t r = 0; r < n; ++r) port = std::max({port, up_send[r], up_recv[r]});
    lb.scaleup_s = static_cast<double>(port) / topo.scaleup_bandwidth();
  } else {
    lb.scaleup_s = static_cast<double>(pair_max) / topo.scaleup_bandwidth();
  }
  return lb;
}

/// A block of modelled activity on one lane: the NIC or the scale-up port of a rank.
struct timeline_block {
  enum lane_kind : unsigned char { nic, scaleup } lane;
  rank_t rank;
  double start_s, end_s;
  /// NIC blocks: the rail stage. Scale-up blocks: the pipeline step (step j holds stage j's
  /// balance and stage j-2's redistribution). -1 for intra-server and direct traffic.
  std::int32_t stage;
};

/// What the model predicts for a plan. Two models of the same plan, both MODELS (bytes over
/// bandwidths, nothing measured):
/// - step-synchronous (total_s): the stages run in lock step, step j = stage j's balance, stage
///   j-1's rail transfer and stage j-2's redistribution, each step as long as its slowest part;
/// - pipelined (pipelined_s, when cost_params::rail_window > 0): the engine's schedule, up to
///   rail_window stages' rail sends in flight per sender, balance run rail_window stages ahead,
///   each stage redistributed as soon as its rail data has arrived; NICs shared fairly (max-min)
///   between the flows in flight. See predict.
struct prediction {
  double total_s = 0;    ///< predicted completion time, step-synchronous model
  double scaleout_s = 0; ///< time of the scale-out phase alone (stages with alpha, or fluid direct)
  double scaleup_s = 0;  ///< busiest scale-up port's (or pair's) total work
  std::size_t stages = 0;
  std::vector<timeline_block> blocks; ///< filled when asked for (the SVG timeline)
  /// Predicted completion time in the pipelined model with cost_params::rail_window stages in
  /// flight; unset unless a window (> 0) was given. Direct plans: the step-synchronous figure (no
  /// stages, nothing to pipeline).
  std::optional<double> pipelined_s{};
  /// The step-synchronous model's completion time (total_s, named).
  double step_synchronous_s() const noexcept { return total_s; }
};

/// The scale-out phase of a staged plan in model net, stages one after another, alpha + weight /
/// b_out each (scaleout_model::stages_time of plan::stage_weight); in a per-rail plan
/// (plan::per_rail) each rail follows its own stages, so the phase lasts as long as the slowest
/// rail's (its stages of weight 0 are ones it does not have).
inline double scaleout_time(const plan& p, const scaleout_model& net) {
  if (!p.per_rail()) return net.stages_time(p.stage_weight);
  double most = 0;
  const std::size_t T = p.stages();
  for (int k = 0; k < p.gpus_per_server; ++k) {
    double t = 0;
    for (std::size_t st = 0; st < T; ++st)
      if (const bytes_t w = p.weight(st, k); w > 0) t += net.stage_time(w);
    most = std::max(most, t);
  }
  return most;
}

/// What plan_options::rails = rail_schedule::automatic compares (the planner computes the same from
/// its stage lists): the scale-out phase (scaleout_time) plus the scale-up work at its two ends that
/// no stage hides, estimated as gather_time of the heaviest stage's rail bytes twice (the first
/// balance and the last redistribution). Per-rail plans gather whole server pairs onto one rail, so
/// their ends weigh more per stage than FAST's, which keeps most bytes on their own rails: the
/// estimate takes both at their worst, every byte of the stage gathered.
template <Topology Topo>
double rails_choice_time(const Topo& topo, const plan& p, const scaleout_model& net) {
  bytes_t heaviest = 0;
  for (bytes_t w : p.stage_weight) heaviest = std::max(heaviest, w); // per-rail: each stage's heaviest rail
  return scaleout_time(p, net) + 2 * gather_time(topo, heaviest);
}

namespace detail {

struct port_load {
  std::size_t step;
  std::size_t key; // switch: rank * 2 + direction; mesh: src * N + dst (ordered pair)
  bytes_t bytes;
};

// Sums loads per (step, key); returns the per-step busiest key's seconds and, optionally, per
// step and rank the busiest key touching that rank.
template <Topology Topo>
std::vector<double> step_times(const Topo& topo, std::vector<port_load>& loads, std::size_t steps,
                               std::vector<std::vector<double>>* per_rank) {
  const bool sw = topo.scaleup() == scaleup_kind::switch_fabric;
  const rank_t n = topo.ranks();
  const double bw = topo.scaleup_bandwidth();
  std::sort(loads.begin(), loads.end(), [](const port_load& x, const port_load& y) {
    return x.step != y.step ? x.step < y.step : x.key < y.key;
  });
  std::vector<double> out(steps, 0.0);
  if (per_rank) per_rank->assign(steps, std::vector<double>(n, 0.0));
  for (std::size_t i = 0; i < loads.size();) {
    const std::size_t st = loads[i].step, key = loads[i].key;
    bytes_t sum = 0;
    for (; i < loads.size() && loads[i].step == st && loads[i].key == key; ++i) sum += loads[i].bytes;
    const double sec = static_cast<double>(sum) / bw;
    out[st] = std::max(out[st], sec);
    if (per_rank) {
      auto& row = (*per_rank)[st];
      if (sw) {
        row[key / 2] = std::max(row[key / 2], sec);
      } else {
        row[key / n] = std::max(row[key / n], sec);
        row[key % n] = std::max(row[key % n], sec);
      }
    }
  }
  return out;
}

template <Topology Topo>
void add_scaleup(const Topo& topo, std::vector<port_load>& loads, std::size_t step, rank_t from,
                 rank_t to, bytes_t bytes) {
  if (topo.scaleup() == scaleup_kind::switch_fabric) {
    loads.push_back({step, static_cast<std::size_t>(from) * 2, bytes});
    loads.push_back({step, static_cast<std::size_t>(to) * 2 + 1, bytes});
  } else {
    loads.push_back({step, static_cast<std::size_t>(from) * topo.ranks() + to, bytes});
  }
}

// The pipelined model of a staged plan (prediction::pipelined_s): an event simulation of the
// engine's run_stages on every rank at once.
// - Scale-up hops (intra-server copies, balance, redistribution) are served in the order they are
//   posted, each taking bytes / b_up on its sender's and its receiver's port (switch), or on its
//   GPU pair's link (mesh), once both are free.
// - Intra-server copies are posted at time 0, then every rank's balance for the first W stages.
// - A rank posts its rail sends of stage t once its balance data for t has arrived and fewer than
//   W of its earlier stages' rail sends are still leaving; it then posts its balance for stage
//   t + W. A rail flow (one per stage, sender and receiver) waits alpha (the stage's
//   synchronisation) before its bytes flow, then shares its sender's and its receiver's NIC
//   (b_out each way) max-min fairly with every other flow in flight.
// - A rank redistributes stage t, stages in order, once every rail flow of t into it has arrived.
// The prediction is the time the last byte lands. A model: it leaves out CPU time, packet headers,
// congestion control and any cost a transport adds per message.
template <Topology Topo>
double pipelined_time(const Topo& topo, const plan& p, const scaleout_model& net, std::size_t W) {
  const rank_t n = topo.ranks();
  const std::size_t N = static_cast<std::size_t>(n);
  const std::size_t T = p.stages();
  const bool sw = topo.scaleup() == scaleup_kind::switch_fabric;
  const double bup = topo.scaleup_bandwidth();

  struct up_hop {
    rank_t from, to;
    bytes_t bytes;
  };
  struct flow {
    rank_t from, to;
    std::size_t stage;
    double bytes, left = 0, live_at = 0, rate = 0;
    bool posted = false, done = false;
  };
  std::vector<up_hop> intra;
  std::vector<std::vector<up_hop>> bal(T * N), red(T * N); // [stage * n + poster]
  std::vector<int> bal_pending(T * N, 0);                   // [stage * n + receiver]
  std::vector<std::tuple<std::size_t, rank_t, rank_t, bytes_t>> rails;
  for (const piece& pc : p.pieces) {
    if (pc.src == pc.dst || pc.bytes == 0) continue;
    for (const hop& h : p.route_of(pc)) {
      const std::size_t st = static_cast<std::size_t>(std::max<std::int32_t>(h.stage, 0));
      switch (h.kind) {
      case hop_kind::intra: intra.push_back({h.from, h.to, pc.bytes}); break;
      case hop_kind::balance:
        bal[st * N + h.from].push_back({h.from, h.to, pc.bytes});
        ++bal_pending[st * N + h.to];
        break;
      case hop_kind::redistribute: red[st * N + h.from].push_back({h.from, h.to, pc.bytes}); break;
      case hop_kind::rail: rails.emplace_back(st, h.from, h.to, pc.bytes); break;
      default: break;
      }
    }
  }
  // One flow per (stage, sender, receiver).
  std::sort(rails.begin(), rails.end());
  std::vector<flow> flows;
  for (std::size_t i = 0; i < rails.size();) {
    const auto [st, from, to, b0] = rails[i];
    bytes_t sum = 0;
    for (; i < rails.size() && std::get<0>(rails[i]) == st && std::get<1>(rails[i]) == from &&
           std::get<2>(rails[i]) == to;
         ++i)
      sum += std::get<3>(rails[i]);
    static_cast<void>(b0);
    flows.push_back({from, to, st, static_cast<double>(sum)});
  }
  std::vector<std::vector<std::size_t>> out_of(T * N); // flows a rank sends in a stage
  std::vector<int> in_pending(T * N, 0), out_pending(T * N, 0);
  for (std::size_t f = 0; f < flows.size(); ++f) {
    out_of[flows[f].stage * N + flows[f].from].push_back(f);
    ++in_pending[flows[f].stage * N + flows[f].to];
    ++out_pending[flows[f].stage * N + flows[f].from];
  }
  std::vector<double> bal_ready(T * N, 0.0), in_arrived(T * N, 0.0);

  // Scale-up ports (switch: per rank and direction) or links (mesh: per ordered pair).
  std::vector<double> tx_free(sw ? N : 0, 0.0), rx_free(sw ? N : 0, 0.0);
  std::unordered_map<std::size_t, double> link_free;
  double finish = 0;
  auto post_up = [&](const up_hop& h, double now) {
    double start = now;
    if (sw) start = std::max({start, tx_free[h.from], rx_free[h.to]});
    else start = std::max(start, link_free[static_cast<std::size_t>(h.from) * N + h.to]);
    const double end = start + static_cast<double>(h.bytes) / bup;
    if (sw) tx_free[h.from] = rx_free[h.to] = end;
    else link_free[static_cast<std::size_t>(h.from) * N + h.to] = end;
    finish = std::max(finish, end);
    return end;
  };
  auto post_balance = [&](std::size_t st, rank_t r, double now) {
    for (const up_hop& h : bal[st * N + r]) {
      const std::size_t k = st * N + h.to;
      bal_ready[k] = std::max(bal_ready[k], post_up(h, now));
      --bal_pending[k];
    }
  };

  for (const up_hop& h : intra) post_up(h, 0.0);
  for (std::size_t st = 0; st < std::min(T, W); ++st)
    for (rank_t r = 0; r < n; ++r) post_balance(st, r, 0.0);

  std::vector<std::size_t> rail(N, 0), redist(N, 0), leaving(N, 0);
  std::vector<std::size_t> live; // posted, not done
  std::vector<double> cap(2 * N);
  std::vector<std::size_t> cnt(2 * N);
  double now = 0;
  for (;;) {
    // Everything that can happen at `now`.
    for (bool moved = true; moved;) {
      moved = false;
      for (rank_t r = 0; r < n; ++r) {
        for (std::size_t& t = rail[r]; t < T;) {
          const std::size_t k = t * N + r;
          if (bal_pending[k] > 0 || bal_ready[k] > now) break;
          const bool sends = !out_of[k].empty();
          if (sends && leaving[r] >= W) break;
          for (std::size_t f : out_of[k]) {
            flows[f].posted = true;
            flows[f].left = flows[f].bytes;
            flows[f].live_at = now + net.alpha_s;
            live.push_back(f);
          }
          if (sends) ++leaving[r];
          if (t + W < T) post_balance(t + W, r, now);
          ++t;
          moved = true;
        }
        for (std::size_t& t = redist[r]; t < T;) {
          const std::size_t k = t * N + r;
          if (in_pending[k] > 0 || in_arrived[k] > now) break;
          for (const up_hop& h : red[k]) post_up(h, now);
          ++t;
          moved = true;
        }
      }
    }
    bool all = true;
    for (rank_t r = 0; r < n && all; ++r) all = rail[r] == T && redist[r] == T;
    if (all) break;

    // Max-min fair rates of the flows whose bytes are moving: fill the tightest NIC first.
    std::fill(cap.begin(), cap.end(), net.bandwidth);
    std::fill(cnt.begin(), cnt.end(), 0);
    std::vector<std::size_t> moving;
    for (std::size_t f : live)
      if (flows[f].live_at <= now) {
        moving.push_back(f);
        flows[f].rate = -1;
        ++cnt[flows[f].from];
        ++cnt[N + flows[f].to];
      }
    for (std::size_t fixed = 0; fixed < moving.size();) {
      std::size_t best = 2 * N;
      for (std::size_t k = 0; k < 2 * N; ++k)
        if (cnt[k] > 0 && (best == 2 * N || cap[k] * cnt[best] < cap[best] * cnt[k])) best = k;
      const double share = std::max(0.0, cap[best] / static_cast<double>(cnt[best]));
      for (std::size_t f : moving) {
        flow& fl = flows[f];
        if (fl.rate >= 0 || (static_cast<std::size_t>(fl.from) != best && N + fl.to != best)) continue;
        fl.rate = share;
        cap[fl.from] -= share;
        cap[N + fl.to] -= share;
        --cnt[fl.from];
        --cnt[N + fl.to];
        ++fixed;
      }
    }
    // The next event: a flow starts moving or ends, balance data or rail data arrives.
    double next = std::numeric_limits<double>::infinity();
    for (std::size_t f : live) {
      const flow& fl = flows[f];
      if (fl.live_at > now) next = std::min(next, fl.live_at);
      else if (fl.rate > 0) next = std::min(next, now + fl.left / fl.rate);
    }
    for (rank_t r = 0; r < n; ++r) {
      if (rail[r] < T && bal_pending[rail[r] * N + r] == 0 && bal_ready[rail[r] * N + r] > now)
        next = std::min(next, bal_ready[rail[r] * N + r]);
      if (redist[r] < T && in_pending[redist[r] * N + r] == 0 && in_arrived[redist[r] * N + r] > now)
        next = std::min(next, in_arrived[redist[r] * N + r]);
    }
    if (!std::isfinite(next)) throw error("predict: the pipelined model made no progress (a defect)");
    const double dt = next - now;
    now = next;
    std::erase_if(live, [&](std::size_t f) {
      flow& fl = flows[f];
      if (fl.live_at >= now || fl.rate <= 0) return false;
      fl.left -= fl.rate * dt;
      if (fl.left > 1e-9 * fl.bytes && fl.left / fl.rate > 1e-12 * std::max(1.0, now)) return false;
      fl.done = true;
      const std::size_t ko = fl.stage * N + fl.from, ki = fl.stage * N + fl.to;
      if (--out_pending[ko] == 0) --leaving[fl.from];
      --in_pending[ki];
      in_arrived[ki] = std::max(in_arrived[ki], now);
      finish = std::max(finish, now);
      return true;
    });
  }
  return std::max(finish, now);
}

} // namespace detail

/// Predicts plan p on topo with the alpha-beta model: the topology's scale-out model
/// (scaleout_of), its alpha replaced by cp.alpha where set.
///
/// Staged plans, step-synchronous model (total_s): step j runs stage j's balance, stage j-1's rail
/// transfer and stage j-2's redistribution at once, and lasts as long as the slowest of them (a
/// rail stage costs scaleout_model::stage_time, alpha + weight / b_out; scale-up work costs the
/// busiest port's, or mesh pair's, bytes / b_up). Intra-server traffic fills scale-up slack, so the
/// total is at least every port's whole work. Direct plans (fluid model): scaleout_model::direct_time
/// of the busiest NIC's inter-server bytes (send or receive), beside the busiest scale-up port.
///
/// With cp.rail_window > 0, also the pipelined model (pipelined_s): the engine's schedule with that
/// many stages in flight per sender, simulated event by event (detail::pipelined_time). Each rank
/// paces itself, so a rank's stage t + 1 need not wait for other ranks' stage t: with a window of 1
/// it equals the step-synchronous figure when every rail of a stage carries the stage's weight
/// (and scale-up is fast), and is smaller when rails differ; with a window of at least the stage
/// count every rail send is posted at once and the scale-out part tends to one alpha plus the
/// busiest NIC's rail bytes / b_out. It costs an event loop over the plan's rail flows (stages x
/// ranks flows, a max-min share per event): fine for the emulated cluster's and tests' sizes, slow
/// for thousands of stages at thousands of ranks.
///
/// Throws fasta2a::error if the plan is for another shape or cp.alpha is negative or not finite.
template <Topology Topo>
prediction predict(const Topo& topo, const plan& p, cost_params cp = {}, bool timeline = false) {
  if (topo.servers() != p.servers || topo.gpus_per_server() != p.gpus_per_server)
    throw error("plan is for " + std::to_string(p.servers) + " x " +
                std::to_string(p.gpus_per_server) + ", topology is " +
                std::to_string(topo.servers()) + " x " + std::to_string(topo.gpus_per_server()));
  const rank_t n = topo.ranks();
  const scaleout_model net = scaleout_of(topo, cp);
  net.check("predict");
  prediction pr;
  pr.stages = p.stages();
  std::vector<detail::port_load> per_step, whole;

  if (!p.staged) {
    std::vector<bytes_t> send(n, 0), recv(n, 0);
    for (const piece& pc : p.pieces) {
      if (pc.src == pc.dst) continue;
      if (p.server_of(pc.src) == p.server_of(pc.dst)) {
        detail::add_scaleup(topo, whole, 0, pc.src, pc.dst, pc.bytes);
      } else {
        send[pc.src] += pc.bytes;
        recv[pc.dst] += pc.bytes;
      }
    }
    bytes_t nic = 0;
    for (rank_t r = 0; r < n; ++r) nic = std::max({nic, send[r], recv[r]});
    pr.scaleout_s = net.direct_time(nic);
    std::vector<std::vector<double>> lanes;
    pr.scaleup_s = detail::step_times(topo, whole, 1, timeline ? &lanes : nullptr)[0];
    pr.total_s = std::max(pr.scaleout_s, pr.scaleup_s);
    if (cp.rail_window > 0) pr.pipelined_s = pr.total_s;
    if (timeline) {
      for (rank_t r = 0; r < n; ++r) {
        bytes_t b = std::max(send[r], recv[r]);
        if (b > 0) pr.blocks.push_back({timeline_block::nic, r, 0.0, net.stage_time(b), -1});
        if (lanes[0][r] > 0) pr.blocks.push_back({timeline_block::scaleup, r, 0.0, lanes[0][r], -1});
      }
    }
    return pr;
  }

  const std::size_t T = p.stages();
  const std::size_t steps = T + 2;
  std::vector<bytes_t> nic_bytes; // per stage and rail-sending rank, for the timeline
  if (timeline) nic_bytes.assign(T * n, 0);
  for (const piece& pc : p.pieces) {
    if (pc.src == pc.dst) continue;
    for (const hop& h : p.route_of(pc)) {
      switch (h.kind) {
      case hop_kind::intra: detail::add_scaleup(topo, whole, 0, h.from, h.to, pc.bytes); break;
      case hop_kind::balance:
        detail::add_scaleup(topo, per_step, h.stage, h.from, h.to, pc.bytes);
        detail::add_scaleup(topo, whole, 0, h.from, h.to, pc.bytes);
        break;
      case hop_kind::redistribute:
        detail::add_scaleup(topo, per_step, h.stage + 2, h.from, h.to, pc.bytes);
        detail::add_scaleup(topo, whole, 0, h.from, h.to, pc.bytes);
        break;
      case hop_kind::rail:
        if (timeline) {
          nic_bytes[static_cast<std::size_t>(h.stage) * n + h.from] += pc.bytes;
          nic_bytes[static_cast<std::size_t>(h.stage) * n + h.to] += 0; // receiver mirrors sender
        }
        break;
      default: break;
      }
    }
  }
  std::vector<std::vector<double>> lanes;
  const std::vector<double> up = detail::step_times(topo, per_step, steps, timeline ? &lanes : nullptr);
  std::vector<std::vector<double>> whole_lanes;
  pr.scaleup_s = detail::step_times(topo, whole, 1, nullptr)[0];
  double now = 0;
  for (std::size_t j = 0; j < steps; ++j) {
    const double out = (j >= 1 && j <= T) ? net.stage_time(p.stage_weight[j - 1]) : 0.0;
    if (j >= 1 && j <= T) pr.scaleout_s += out;
    const double len = std::max(out, up[j]);
    if (timeline) {
      for (rank_t r = 0; r < n; ++r) {
        if (lanes[j][r] > 0)
          pr.blocks.push_back({timeline_block::scaleup, r, now, now + lanes[j][r],
                               static_cast<std::int32_t>(j)});
        if (j >= 1 && j <= T && nic_bytes[(j - 1) * n + r] > 0)
          pr.blocks.push_back({timeline_block::nic, r, now,
                               now + net.stage_time(nic_bytes[(j - 1) * n + r]),
                               static_cast<std::int32_t>(j - 1)});
      }
    }
    now += len;
  }
  // Rails that switch on their own (per-rail plans): each rail's stages, the slowest rail's. The
  // steps above keep every rail in step, each step as long as its heaviest rail; here each rail
  // runs its own steps instead, each as long as its own stage or the step's scale-up work (the
  // busiest port of any rail: scale-up ports serve every rail), whichever is longer.
  if (p.per_rail()) {
    pr.scaleout_s = scaleout_time(p, net);
    now = 0;
    for (int k = 0; k < p.gpus_per_server; ++k) {
      double mine = 0;
      for (std::size_t j = 0; j < steps; ++j) {
        const bytes_t w = j >= 1 && j <= T ? p.weight(j - 1, k) : 0;
        mine += std::max(w > 0 ? net.stage_time(w) : 0.0, up[j]);
      }
      now = std::max(now, mine);
    }
  }
  pr.total_s = std::max(now, pr.scaleup_s);
  if (cp.rail_window > 0) pr.pipelined_s = detail::pipelined_time(topo, p, net, cp.rail_window);
  if (timeline) {
    // Intra-server traffic, drawn where the model puts it: in the slack beside the first stages.
    std::vector<bytes_t> intra(n, 0);
    for (const piece& pc : p.pieces)
      if (pc.src != pc.dst && pc.rail < 0) intra[pc.src] += pc.bytes;
    const double start = steps > 0 ? up[0] : 0.0;
    for (rank_t r = 0; r < n; ++r)
      if (intra[r] > 0)
        pr.blocks.push_back({timeline_block::scaleup, r, start,
                             start + intra[r] / topo.scaleup_bandwidth(), -1});
  }
  return pr;
}

} // namespace fasta2a
