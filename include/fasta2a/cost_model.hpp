// fasta2a: lower bounds and an alpha-beta cost model of plans. Everything here is a MODEL of
// time, computed from bytes and bandwidths; nothing is measured.
#pragma once

#include <algorithm>
#include <optional>
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

/// What the model predicts for a plan.
struct prediction {
  double total_s = 0;    ///< predicted completion time
  double scaleout_s = 0; ///< time of the scale-out phase alone (stages with alpha, or fluid direct)
  double scaleup_s = 0;  ///< busiest scale-up port's (or pair's) total work
  std::size_t stages = 0;
  std::vector<timeline_block> blocks; ///< filled when asked for (the SVG timeline)
};

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

} // namespace detail

/// Predicts plan p on topo with the alpha-beta model: the topology's scale-out model
/// (scaleout_of), its alpha replaced by cp.alpha where set.
///
/// Staged plans, pipelined: step j runs stage j's balance, stage j-1's rail transfer and stage
/// j-2's redistribution at once, and lasts as long as the slowest of them (a rail stage costs
/// scaleout_model::stage_time, alpha + weight / b_out; scale-up work costs the busiest port's, or
/// mesh pair's, bytes / b_up). Intra-server traffic fills scale-up slack, so the total is at least
/// every port's whole work. Direct plans (fluid model): scaleout_model::direct_time of the busiest
/// NIC's inter-server bytes (send or receive), beside the busiest scale-up port. Throws
/// fasta2a::error if the plan is for another shape or cp.alpha is negative or not finite.
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
  pr.total_s = std::max(now, pr.scaleup_s);
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
