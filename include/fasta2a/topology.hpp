// fasta2a: two-tier cluster topologies (scale-up inside a server, rail-optimised scale-out).
#pragma once

#include <cmath>
#include <concepts>
#include <span>
#include <string>

#include "fasta2a/common.hpp"

namespace fasta2a {

/// How the GPUs of one server are connected.
enum class scaleup_kind {
  switch_fabric, ///< NVLink/NVSwitch: every GPU has one port of `scaleup_bandwidth()` per direction.
  mesh,          ///< AMD xGMI: every GPU pair has its own link of `scaleup_bandwidth()` per direction.
};

inline const char* to_string(scaleup_kind k) noexcept {
  return k == scaleup_kind::switch_fabric ? "switch" : "mesh";
}

/// The alpha-beta model of the scale-out tier (DESIGN.md section 3): a rail stage whose rails carry
/// up to w bytes each costs one synchronisation, alpha_s, plus w / bandwidth. Every figure that
/// prices scale-out time (the cost model, the best-of and quantised decomposers, the planner's
/// direct fallback) computes it here, so that they agree to the last bit. A topology supplies its
/// model (scaleout_of); a default-constructed one is an H200 NIC at the default alpha.
struct scaleout_model {
  /// Seconds per stage by default: a synchronisation over RDMA costs roughly 5-20 us.
  static constexpr double default_alpha_s = 10e-6;
  /// Bytes per second per direction of one 400 Gb/s NIC, what H200 and MI300X servers have per GPU.
  static constexpr double default_bandwidth = 50e9;

  double alpha_s = default_alpha_s;     ///< seconds per stage: the synchronisation each rail stage costs
  double bandwidth = default_bandwidth; ///< bytes/s per direction per NIC

  /// Seconds to move `bytes` through one NIC, synchronisation not included.
  double transfer_time(bytes_t bytes) const noexcept { return static_cast<double>(bytes) / bandwidth; }
  /// One rail stage whose rails carry up to `weight` bytes each.
  double stage_time(bytes_t weight) const noexcept { return alpha_s + transfer_time(weight); }
  /// The scale-out phase of a staged plan: stage_time summed over the stage weights, in order.
  double stages_time(std::span<const bytes_t> weights) const noexcept {
    double t = 0;
    for (bytes_t w : weights) t += stage_time(w);
    return t;
  }
  /// The same phase from its totals, `stages` stages of `total` per-rail bytes in all: what a
  /// search over decompositions compares before it has the weights. Equals stages_time up to
  /// rounding.
  double phase_time(bytes_t total, std::size_t stages) const noexcept {
    return transfer_time(total) + alpha_s * static_cast<double>(stages);
  }
  /// Direct sending in the fluid model: every NIC sends at once, so the phase lasts one
  /// synchronisation plus the busiest NIC's bytes (sent or received); nothing to send costs 0.
  double direct_time(bytes_t busiest_nic) const noexcept {
    return busiest_nic > 0 ? stage_time(busiest_nic) : 0.0;
  }
  /// Throws fasta2a::error, its message starting with `who`, unless alpha_s is finite and
  /// non-negative and the bandwidth finite and positive.
  void check(const char* who) const {
    if (!std::isfinite(alpha_s) || alpha_s < 0)
      throw error(std::string(who) + ": alpha must be a finite, non-negative number of seconds, got " +
                  std::to_string(alpha_s));
    if (!std::isfinite(bandwidth) || bandwidth <= 0)
      throw error(std::string(who) + ": the scale-out bandwidth must be finite and positive, got " +
                  std::to_string(bandwidth));
  }
};

/// What the planner needs to know of a cluster: S servers of G GPUs, rank r = s * G + k on server s
/// with local index k, which is also its rail (NIC k of every server talks to NIC k of the others).
/// Bandwidths are bytes per second per direction: per GPU port (switch) or per GPU pair (mesh) for
/// scale-up, per NIC for scale-out; the scale-out alpha is seconds per stage (scaleout_model).
template <class T>
concept Topology = requires(const T& t, rank_t r, int s, int k) {
  { t.servers() } -> std::convertible_to<int>;
  { t.gpus_per_server() } -> std::convertible_to<int>;
  { t.ranks() } -> std::convertible_to<rank_t>;
  { t.server_of(r) } -> std::convertible_to<int>;
  { t.local_of(r) } -> std::convertible_to<int>;
  { t.rank_of(s, k) } -> std::convertible_to<rank_t>;
  { t.scaleup() } -> std::same_as<scaleup_kind>;
  { t.scaleup_bandwidth() } -> std::convertible_to<double>;
  { t.scaleout_bandwidth() } -> std::convertible_to<double>;
  { t.scaleout_alpha() } -> std::convertible_to<double>;
};

/// The scale-out model of a topology: its per-stage alpha and NIC bandwidth.
template <Topology T>
scaleout_model scaleout_of(const T& t) {
  return {static_cast<double>(t.scaleout_alpha()), static_cast<double>(t.scaleout_bandwidth())};
}

/// Link figures of one server type; shared by both topology templates. The scale-out figures
/// default to scaleout_model's: one 400 Gb/s NIC per GPU, 10 us per stage.
struct link_model {
  scaleup_kind kind = scaleup_kind::switch_fabric;
  double scaleup_bandwidth = 450e9; ///< bytes/s per direction, per port (switch) or per pair (mesh)
  double scaleout_bandwidth = scaleout_model::default_bandwidth; ///< bytes/s per direction per NIC
  double scaleout_alpha = scaleout_model::default_alpha_s;       ///< seconds per rail stage
};

/// NVIDIA H200 server: 8 GPUs on NVSwitch (about 450 GB/s per direction per GPU), one 400 Gb/s
/// NIC per GPU (the scale-out defaults).
inline constexpr link_model h200_links{scaleup_kind::switch_fabric, 450e9};
/// AMD MI300X server: 8 GPUs in an xGMI full mesh (about 64 GB/s per direction per pair, 7 links
/// per GPU), one 400 Gb/s NIC per GPU (the scale-out defaults).
inline constexpr link_model mi300x_links{scaleup_kind::mesh, 64e9};

namespace detail {
inline void check_shape(long long servers, long long gpus) {
  if (servers < 1)
    throw error("topology needs at least one server (got " + std::to_string(servers) + ")");
  if (gpus < 1)
    throw error("topology needs at least one GPU per server (got " + std::to_string(gpus) + ")");
  if (servers * gpus > (1LL << 30))
    throw error("topology of " + std::to_string(servers) + " x " + std::to_string(gpus) +
                " ranks is too large");
}
inline void check_links(const link_model& l) {
  if (!(l.scaleup_bandwidth > 0) || !(l.scaleout_bandwidth > 0))
    throw error("topology bandwidths must be positive");
  scaleout_model{l.scaleout_alpha, l.scaleout_bandwidth}.check("topology");
}
/// What both topology templates share: the server count and the link figures, checked once.
class topology_base {
public:
  int servers() const noexcept { return servers_; }
  scaleup_kind scaleup() const noexcept { return links_.kind; }
  double scaleup_bandwidth() const noexcept { return links_.scaleup_bandwidth; }
  double scaleout_bandwidth() const noexcept { return links_.scaleout_bandwidth; }
  double scaleout_alpha() const noexcept { return links_.scaleout_alpha; }
  const link_model& links() const noexcept { return links_; }

protected:
  topology_base(int servers, int gpus, const link_model& links) : servers_(servers), links_(links) {
    check_shape(servers, gpus);
    check_links(links);
  }
  int servers_;
  link_model links_;
};

} // namespace detail

/// A two-tier topology whose sizes are chosen at run time.
class two_tier_topology : public detail::topology_base {
public:
  /// Throws fasta2a::error if servers < 1, gpus_per_server < 1, a bandwidth is not positive or the
  /// scale-out alpha is negative.
  two_tier_topology(int servers, int gpus_per_server, link_model links = h200_links)
      : topology_base(servers, gpus_per_server, links), gpus_(gpus_per_server) {}
  int gpus_per_server() const noexcept { return gpus_; }
  rank_t ranks() const noexcept { return servers_ * gpus_; }
  int server_of(rank_t r) const noexcept { return r / gpus_; }
  int local_of(rank_t r) const noexcept { return r % gpus_; }
  rank_t rank_of(int s, int k) const noexcept { return s * gpus_ + k; }

private:
  int gpus_;
};

/// A two-tier topology with G GPUs per server fixed at compile time: the planner's per-server loops
/// and scratch arrays are then sized by a constant, so they unroll and live on the stack.
template <int G>
class fixed_topology : public detail::topology_base {
  static_assert(G >= 1, "fixed_topology needs at least one GPU per server");

public:
  static constexpr int static_gpus = G;
  explicit fixed_topology(int servers, link_model links = h200_links)
      : topology_base(servers, G, links) {}
  static constexpr int gpus_per_server() noexcept { return G; }
  rank_t ranks() const noexcept { return servers_ * G; }
  static constexpr int server_of(rank_t r) noexcept { return r / G; }
  static constexpr int local_of(rank_t r) noexcept { return r % G; }
  static constexpr rank_t rank_of(int s, int k) noexcept { return s * G + k; }
};

/// S servers of 8 H200 GPUs on NVSwitch.
inline fixed_topology<8> h200_cluster(int servers) { return fixed_topology<8>(servers, h200_links); }
/// S servers of 8 MI300X GPUs in an xGMI mesh.
inline fixed_topology<8> mi300x_cluster(int servers) {
  return fixed_topology<8>(servers, mi300x_links);
}

/// GPUs per server if the topology fixes it at compile time, else 0.
template <class T>
inline constexpr int static_gpus_v = 0;
template <class T>
  requires requires { T::static_gpus; }
inline constexpr int static_gpus_v<T> = T::static_gpus;

/// The time for one GPU to gather `bytes` that start spread evenly over its server's G GPUs (its
/// own share needs no hop), or to scatter them again, over scale-up: through its one port on a
/// switch, over its G - 1 links to the others in a mesh. An estimate of the scale-up work a staged
/// plan cannot hide under its rail stages: the first stage's balance and the last stage's
/// redistribution, each at most one stage's rail bytes into or out of a rail GPU.
template <Topology Topo>
double gather_time(const Topo& topo, bytes_t bytes) {
  const int G = topo.gpus_per_server();
  if (G <= 1 || bytes == 0) return 0;
  const double b = static_cast<double>(bytes);
  return topo.scaleup() == scaleup_kind::mesh ? b / G / topo.scaleup_bandwidth()
                                              : b * (G - 1) / G / topo.scaleup_bandwidth();
}

static_assert(Topology<two_tier_topology>);
static_assert(Topology<fixed_topology<8>>);

} // namespace fasta2a
