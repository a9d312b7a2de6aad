// fasta2a_torch: one group's fasta2a machinery in a process (bootstrap, transports, engine) and
// the thread that runs its collectives in order. Knows nothing of torch: the c10d backend and the
// Group object (module.cpp) hand it byte spans and counts.
#pragma once

#include <fasta2a/engine.hpp>
#include <fasta2a/libfabric.hpp>
#include <fasta2a/registry.hpp>
#include <fasta2a/tcp_bootstrap.hpp>
#include <fasta2a/topology.hpp>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

namespace fasta2a_torch {

namespace fa = fasta2a;

/// How a communicator is made; every rank of the group passes the same values but `rank`.
struct comm_config {
  int rank = 0;
  int size = 1;
  int servers = 1;
  int gpus_per_server = 1;
  std::chrono::milliseconds timeout{1800000};
  std::string decomposer = "birkhoff";
  std::string scaleup_provider;  ///< libfabric provider inside a server ("" chooses: see choose_providers)
  std::string scaleout_provider; ///< libfabric provider between servers
  std::size_t plans_kept = 1;
  std::optional<double> staging_fraction = 0.25;
};

/// A comm_config from the values the Python side passes (the timeout in seconds; a staging fraction
/// of 0 for no budget).
inline comm_config config_of(int rank, int size, int servers, int gpus, double timeout_s, const std::string& decomposer,
                             const std::string& up, const std::string& out, std::size_t plans_kept,
                             double staging_fraction) {
  comm_config c;
  c.rank = rank;
  c.size = size;
  c.servers = servers;
  c.gpus_per_server = gpus;
  c.timeout = std::chrono::milliseconds(static_cast<long long>(timeout_s * 1000.0));
  c.decomposer = decomposer;
  c.scaleup_provider = up;
  c.scaleout_provider = out;
  c.plans_kept = plans_kept;
  if (staging_fraction > 0) c.staging_fraction = staging_fraction;
  else c.staging_fraction.reset(); // staging as the plan lays it out, no budget
  return c;
}

/// A completion that a caller can wait for: set once by the communicator's thread.
class completion {
public:
  void finish(std::exception_ptr e) {
    {
      std::lock_guard l(m_);
      done_ = true;
      error_ = std::move(e);
    }
    cv_.notify_all();
    if (then_) then_(error_);
  }
  bool done() const {
    std::lock_guard l(m_);
    return done_;
  }
  /// Waits; rethrows the operation's error.
  void wait() {
    std::unique_lock l(m_);
    cv_.wait(l, [&] { return done_; });
    if (error_) std::rethrow_exception(error_);
  }
  std::exception_ptr error() const {
    std::lock_guard l(m_);
    return error_;
  }
  /// Called once, on the communicator's thread, when the operation ends (set before submitting).
  std::function<void(std::exception_ptr)> then_;

private:
  mutable std::mutex m_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

/// How rank 0 of a group is found: rank 0 listens (a tcp_listener bound beforehand, its id
/// published through the job's store), the others connect to the id they read there.
struct rendezvous {
  fa::tcp_listener* listener = nullptr; ///< rank 0
  std::string root_id;                  ///< the others: "host:port"
  /// The group's secret, which every connection of the bootstrap proves it holds: rank 0 draws
  /// it and publishes it in the job's store beside the address (new_secret()).
  std::string secret;
};

/// A fresh random secret for a group's bootstrap (64 hex digits, from OpenSSL's generator).
inline std::string new_secret() {
  static constexpr char hex[] = "0123456789abcdef";
  std::string s;
  for (const std::byte b : fa::detail::tcp_random_nonce()) {
    s += hex[std::to_integer<unsigned>(b) >> 4];
    s += hex[std::to_integer<unsigned>(b) & 15];
  }
  return s;
}

/// Where rank 0 of a group listens: on `host` where it is a numeric address (the address of
/// this host towards the job's store, as the Python side finds it), else on every address.
inline fa::tcp_listener group_listener(const std::string& host) {
  in6_addr a6{};
  in_addr a4{};
  const bool numeric = ::inet_pton(AF_INET, host.c_str(), &a4) == 1 || ::inet_pton(AF_INET6, host.c_str(), &a6) == 1;
  return fa::tcp_listener(0, numeric ? host : std::string());
}

/// How a communicator makes a scale-up transport that is not libfabric: specialised where such a
/// transport is used (device_module.cpp: the GPU IPC transport), with
/// `static void make(std::optional<Up>&, fa::tcp_bootstrap&, M&, const comm_config&)` and
/// `static std::string describe()`.
template <class Up, class M>
struct scaleup_of;

/// The bootstrap, transports and engine of one group on this rank, and one thread that runs the
/// group's collectives in the order they were submitted (the engine and the bootstrap serve one
/// thread at a time; torch calls a backend from whichever thread the user is on).
///
/// `Up` is the scale-up transport and `M` the memory space: libfabric and host memory for CPU
/// tensors (communicator), the GPU IPC transport and gpu_memory for device buffers
/// (device_module.cpp). Scale-out is always the libfabric transport.
template <class Up, class M>
class basic_communicator {
public:
  using topology = fa::two_tier_topology;
  using bootstrap = fa::tcp_bootstrap;
  using transport = fa::libfabric_transport;
  using engine_type = fa::engine_core<topology, bootstrap, Up, transport, M>;

  /// Collective over the group (every rank makes its communicators in the same order). With
  /// libfabric for scale-up, the scale-out endpoint serves both tiers unless the configuration
  /// names another provider for scale-up.
  basic_communicator(const comm_config& c, const rendezvous& rv, M mem = M{})
      : cfg_(c), topo_(c.servers, c.gpus_per_server), mem_(std::move(mem)) {
    if (c.servers * c.gpus_per_server != c.size)
      throw fa::error("fasta2a_torch: " + std::to_string(c.servers) + " servers x " + std::to_string(c.gpus_per_server) +
                      " GPUs is not the group's " + std::to_string(c.size) + " ranks");
    fa::tcp_bootstrap_options bo;
    bo.rank = c.rank;
    bo.size = c.size;
    bo.timeout = bootstrap_timeout(c.timeout);
    bo.secret = rv.secret;
    if (c.rank == 0) {
      if (rv.listener == nullptr) throw fa::error("fasta2a_torch: rank 0 needs a listener");
      boot_.emplace(*rv.listener, bo);
    } else {
      bo.id = rv.root_id;
      boot_.emplace(bo);
    }
    fa::libfabric_options lo;
    lo.timeout = c.timeout;
    lo.provider = c.scaleout_provider;
    out_.emplace(*boot_, lo);
    if constexpr (std::is_same_v<Up, transport>) {
      if (c.scaleup_provider == out_->provider() || c.scaleup_provider.empty()) {
        up_ = &*out_;
      } else {
        lo.provider = c.scaleup_provider;
        up_own_.emplace(*boot_, lo);
        up_ = &*up_own_;
      }
    } else {
      scaleup_of<Up, M>::make(up_own_, *boot_, mem_, c);
      up_ = &*up_own_;
    }
    fa::engine_options eo;
    eo.timeout = c.timeout;
    eo.plans_kept = c.plans_kept;
    eo.staging_fraction = c.staging_fraction;
    const fa::decomposer_params dp{.scaleout = fa::scaleout_of(topo_)};
    engine_ = fa::with_decomposer(c.decomposer, dp, [&](auto dec) -> std::shared_ptr<engine_type> {
      using D = decltype(dec);
      return std::make_shared<fa::engine<topology, bootstrap, Up, transport, D, M>>(topo_, *boot_, *up_, *out_, eo,
                                                                                   std::move(dec), mem_);
    });
    thread_ = std::thread([this] { run(); });
  }
  basic_communicator(const basic_communicator&) = delete;
  basic_communicator& operator=(const basic_communicator&) = delete;

  ~basic_communicator() {
    {
      std::lock_guard l(m_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
    // Every rank's puts complete before the endpoints close (a peer may still read them).
    try {
      if (!failed_) {
        engine_->synchronize();
        out_->quiesce();
        if constexpr (std::is_same_v<Up, transport>)
          if (up_own_) up_own_->quiesce();
      }
    } catch (...) {
    }
    engine_.reset();
  }

  /// The bootstrap's own timeout for a group timeout t: a rank that is not the root waits for the
  /// root's verdict up to the bootstrap's timeout plus its grace (tcp_bootstrap_options::grace),
  /// so the bootstrap gets less than t where that sum would pass t + 1.5 s: every rank then raises
  /// within the group's timeout + 1.5 s, whichever rank stopped (the root included).
  static std::chrono::milliseconds bootstrap_timeout(std::chrono::milliseconds t) {
    using ms = std::chrono::milliseconds;
    const ms slack(1500), most_grace(5000);
    const ms a = (t + slack) * 2 / 3, b = t > most_grace - slack ? t - (most_grace - slack) : ms(0);
    return std::min(t, std::max(a, b));
  }

  int rank() const noexcept { return cfg_.rank; }
  int size() const noexcept { return cfg_.size; }
  const comm_config& config() const noexcept { return cfg_; }
  std::string describe() const {
    std::string s = std::to_string(cfg_.servers) + " servers x " + std::to_string(cfg_.gpus_per_server) +
                    " ranks, decomposer " + cfg_.decomposer + "; scale-out: " + out_->describe();
    if constexpr (std::is_same_v<Up, transport>) {
      if (up_own_) s += "; scale-up: " + up_own_->describe();
      else s += "; scale-up: the same endpoint";
    } else {
      s += "; scale-up: " + scaleup_of<Up, M>::describe();
    }
    return s;
  }

  /// Runs `op` on the communicator's thread after everything submitted before it.
  std::shared_ptr<completion> submit(std::function<void()> op, std::shared_ptr<completion> c = nullptr) {
    if (!c) c = std::make_shared<completion>();
    {
      std::lock_guard l(m_);
      queue_.push_back({std::move(op), c});
    }
    cv_.notify_all();
    return c;
  }

  // What the operations do, on the communicator's thread.

  void alltoallv(std::span<const std::byte> send, const std::vector<std::uint64_t>& send_counts,
                 const std::vector<std::uint64_t>& send_displs, std::span<std::byte> recv,
                 const std::vector<std::uint64_t>& recv_counts, const std::vector<std::uint64_t>& recv_displs) {
    // A timeout names the peer waited for; the roll call adds the ranks that are not there.
    fa::with_roll_call(*boot_, [&] { engine_->alltoallv(send, send_counts, send_displs, recv, recv_counts, recv_displs); });
    const fa::call_stats& s = engine_->last_stats();
    const std::size_t stages = engine_->last_plan().stages();
    const std::size_t staging = engine_->staging_bytes();
    std::lock_guard l(stats_m_);
    ++calls_;
    last_ = s;
    stages_ = stages;
    staging_ = staging;
  }
  /// The stream-ordered form (memory spaces with streams): returns once the call is queued on
  /// `stream`; the bytes move later (fasta2a::engine's stream form).
  template <class S>
  void alltoallv_on(std::span<const std::byte> send, const std::vector<std::uint64_t>& send_counts,
                    const std::vector<std::uint64_t>& send_displs, std::span<std::byte> recv,
                    const std::vector<std::uint64_t>& recv_counts, const std::vector<std::uint64_t>& recv_displs,
                    S stream) {
    fa::with_roll_call(*boot_, [&] { engine_->alltoallv(send, send_counts, send_displs, recv, recv_counts, recv_displs, stream); });
    std::lock_guard l(stats_m_);
    ++calls_;
  }
  /// Waits until every stream-ordered call has executed; raises an asynchronous error.
  void synchronize() {
    fa::with_roll_call(*boot_, [&] { engine_->synchronize(); });
  }
  /// Forgets the engine's registrations of memory containing `p` (before that memory is freed and
  /// its addresses possibly handed out again: fasta2a::engine::forget_buffer).
  void forget(const void* p) { engine_->forget_buffer(p); }

  /// Takes part in an all-to-all whose arguments this rank refused (split sizes that do not match
  /// its tensors): the engine's counts exchange carries the refusal, so every other rank raises
  /// "rank r refused its all-to-allv arguments; nothing was sent" instead of waiting for it.
  void refuse() {
    const std::vector<std::uint64_t> counts(static_cast<std::size_t>(cfg_.size), 0);
    std::vector<std::uint64_t> bad = counts;
    bad[0] = 1; // one byte from an empty buffer: the engine refuses it on this rank
    try {
      engine_->alltoallv(std::span<const std::byte>{}, bad, counts, std::span<std::byte>{}, counts, counts);
    } catch (const fa::error&) { // this rank's own error is the caller's ValueError
    }
  }
  void allgather(std::span<const std::byte> mine, std::span<std::byte> all) { boot_->allgather(mine, all); }
  void barrier() { boot_->allgather({}, {}); }

  /// The engine's figures of the last all-to-all: plan, exchange, execute seconds; where the plan
  /// came from; stages.
  struct stats_view {
    std::uint64_t calls = 0;
    fa::call_stats last{};
  };
  stats_view stats() const {
    std::lock_guard l(stats_m_);
    return {calls_, last_};
  }
  /// Stages of the last all-to-all's plan.
  std::size_t last_stages() const {
    std::lock_guard l(stats_m_);
    return stages_;
  }
  /// Staging memory this rank's engine holds (the most any call needed so far), in bytes.
  std::size_t staging_bytes() const {
    std::lock_guard l(stats_m_);
    return staging_;
  }

private:
  struct task {
    std::function<void()> op;
    std::shared_ptr<completion> done;
  };

  void run() {
    for (;;) {
      task t;
      {
        std::unique_lock l(m_);
        cv_.wait(l, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        t = std::move(queue_.front());
        queue_.pop_front();
      }
      std::exception_ptr e;
      try {
        t.op();
      } catch (...) {
        e = std::current_exception();
        failed_ = true;
      }
      t.done->finish(e);
    }
  }

  comm_config cfg_;
  topology topo_;
  M mem_;
  std::optional<bootstrap> boot_;
  std::optional<transport> out_;
  std::optional<Up> up_own_;
  Up* up_ = nullptr;
  std::shared_ptr<engine_type> engine_;

  std::mutex m_;
  std::condition_variable cv_;
  std::deque<task> queue_;
  bool stop_ = false;
  bool failed_ = false;
  std::thread thread_;

  mutable std::mutex stats_m_;
  std::uint64_t calls_ = 0;
  std::size_t stages_ = 0;
  std::size_t staging_ = 0;
  fa::call_stats last_{};
};

/// CPU tensors: libfabric for both tiers (one endpoint, or a second for scale-up), host memory.
using communicator = basic_communicator<fa::libfabric_transport, fa::host_memory>;

} // namespace fasta2a_torch
