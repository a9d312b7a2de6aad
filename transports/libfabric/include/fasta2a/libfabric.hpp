// fasta2a libfabric transport: one-sided RMA writes over a libfabric reliable-datagram endpoint
// (FI_EP_RDM), signals as zero-byte writes carrying remote CQ data. The provider is chosen at run
// time (tcp;ofi_rxm, shm, sockets here; verbs;ofi_rxm, efa, cxi on clusters). Addresses are
// exchanged through any fasta2a Bootstrap. Depends on libfabric only.
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "fasta2a/common.hpp"
#include "fasta2a/rma.hpp"
#include "fasta2a/transport.hpp"

namespace fasta2a {

/// How a signal is kept behind the puts it covers.
enum class fi_signal_ordering : std::uint8_t {
  /// provider_order where the provider orders write after write for puts of the chunk size,
  /// wait_for_completion otherwise (shm).
  automatic,
  /// Post the signal right after the puts: the endpoint is opened with FI_ORDER_WAW, so the
  /// peer's provider applies the writes in the order they were posted.
  provider_order,
  /// Post the signal only once every put it covers has completed locally (with
  /// FI_DELIVERY_COMPLETE where libfabric_options::delivery_complete asks for it). Deferred, never
  /// blocking: the signal waits in a queue that every call of the transport advances.
  wait_for_completion,
};

inline const char* to_string(fi_signal_ordering o) noexcept {
  switch (o) {
  case fi_signal_ordering::automatic: return "automatic";
  case fi_signal_ordering::provider_order: return "provider write-after-write order";
  case fi_signal_ordering::wait_for_completion: return "signal after the puts' completions";
  }
  return "?";
}

/// Options of a libfabric_transport.
struct libfabric_options {
  /// The libfabric provider, as fi_getinfo names it ("tcp;ofi_rxm", "shm", "verbs;ofi_rxm").
  /// Empty: the environment variable FASTA2A_FI_PROVIDER, else "tcp;ofi_rxm". Every rank must
  /// choose the same one (checked when the transport is made).
  std::string provider;
  /// How signals are ordered after puts (see fi_signal_ordering).
  fi_signal_ordering ordering = fi_signal_ordering::automatic;
  /// With wait_for_completion, whether puts ask for FI_DELIVERY_COMPLETE (the bytes are placed
  /// at the peer when the put completes) rather than the provider's default transmit completion.
  /// Off by default because shm 1.17 never completes such writes between endpoints of one process
  /// (fi_writemsg returns -FI_EAGAIN for good, measured); shm's default completion suffices there:
  /// writes under 4096 bytes complete once queued in the receiver's command queue, which it
  /// processes in order (so ahead of a later signal), larger ones only once the receiver has
  /// processed them (fi_shm(7)). Turn it on for providers whose transmit completion promises
  /// neither.
  bool delivery_complete = false;
  /// How wait() and flush() poll the completion queue.
  wait_policy waiting{};
  /// How long a put or signal retries a busy endpoint (-FI_EAGAIN) and flush() waits for its
  /// completions before throwing.
  std::chrono::milliseconds timeout{30000};
  /// The largest single RMA write; longer puts are cut (0: the provider's max_msg_size, and where
  /// order is relied on, its max_order_waw_size).
  std::size_t max_put_bytes = 0;
  /// Whether to open the endpoint with FI_HMEM where the provider offers it, so that device
  /// memory can be registered directly (`registers`, `register_memory(p, n, kind, device)`).
  /// Where the provider does not offer it, the endpoint is opened without (host memory only).
  bool hmem = true;
};

namespace detail {

/// "call failed: <fi_strerror> (-code)" as a fasta2a::error.
[[noreturn]] inline void fi_fail(const std::string& what, long rc) {
  const int code = static_cast<int>(rc < 0 ? -rc : rc);
  throw error("libfabric_transport: " + what + " failed: " + fi_strerror(code) + " (-" + std::to_string(code) + ")");
}
inline void fi_check(long rc, const std::string& what) {
  if (rc != 0) fi_fail(what, rc);
}

/// The provider a transport made with `requested` uses: requested, else $FASTA2A_FI_PROVIDER,
/// else "tcp;ofi_rxm".
inline std::string fi_resolve_provider(const std::string& requested) {
  if (!requested.empty()) return requested;
  if (const char* env = std::getenv("FASTA2A_FI_PROVIDER"); env != nullptr && *env != '\0') return env;
  return "tcp;ofi_rxm";
}

/// libfabric 1.17's tcp provider copies a small send (under FI_TCP_STAGING_SBUF_SIZE bytes, a
/// signal's header among them) into a staging buffer of the process and reports it complete even
/// when the socket is full, so the bytes leave only at the sender's next progress call. A rank
/// that has finished a call makes no such call until its next one: the last signal behind a large
/// put then sat in its process while the peer waited for it (measured on 16 ranks without a staging
/// budget: 3 benchmark runs of 25, about 300 calls, each lost one signal until the timeout; made to
/// call progress while idle, a sender's stalled signal reached its peer 1 ms after that call:
/// docs/TORCH.md). Without the staging buffer a send completes only once the kernel holds it. Sets FI_TCP_STAGING_SBUF_SIZE=0 where the environment does not set it, before
/// libfabric first reads it (its first fi_getinfo in the process); returns the value in effect.
inline std::string fi_tcp_send_staging() {
  ::setenv("FI_TCP_STAGING_SBUF_SIZE", "0", 0);
  const char* v = std::getenv("FI_TCP_STAGING_SBUF_SIZE");
  return v != nullptr ? v : "";
}

/// Removes the shared-memory regions that libfabric's shm provider left in `dir` for processes
/// that are gone: a rank killed before it closed its endpoint leaves its region (16 MiB in 1.17)
/// until someone removes it. The provider names a region "<pid>:<n>:<m>" (1.17, measured); only
/// regular files of this user so named whose process does not exist (kill(pid, 0) fails with
/// ESRCH) are removed. Returns how many. FASTA2A_SHM_SWEEP=0 turns it off: where /dev/shm is shared
/// between PID namespaces (containers), a live process of another namespace would look gone.
inline std::size_t fi_sweep_dead_shm(const char* dir = "/dev/shm") {
  if (const char* v = std::getenv("FASTA2A_SHM_SWEEP"); v != nullptr && std::string_view(v) == "0") return 0;
  DIR* d = ::opendir(dir);
  if (d == nullptr) return 0;
  std::size_t removed = 0;
  const uid_t me = ::geteuid();
  while (const dirent* e = ::readdir(d)) {
    const std::string_view name(e->d_name);
    // digits ':' digits ':' digits, the pid first
    std::size_t colons = 0, digits = 0;
    bool shape = !name.empty();
    for (const char c : name) {
      if (c == ':') {
        if (digits == 0) shape = false;
        ++colons;
        digits = 0;
      } else if (std::isdigit(static_cast<unsigned char>(c)) != 0) {
        ++digits;
      } else {
        shape = false;
      }
    }
    if (!shape || colons != 2 || digits == 0) continue;
    const long long pid = std::atoll(std::string(name.substr(0, name.find(':'))).c_str());
    if (pid <= 0 || pid > std::numeric_limits<pid_t>::max()) continue;
    struct stat st {};
    if (::fstatat(::dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode) || st.st_uid != me) continue;
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue; // alive (or not ours to know)
    if (::unlinkat(::dirfd(d), e->d_name, 0) == 0) ++removed;
  }
  ::closedir(d);
  return removed;
}

/// Owns an fi_info list.
struct fi_info_deleter {
  void operator()(fi_info* i) const noexcept { fi_freeinfo(i); }
};
using fi_info_ptr = std::unique_ptr<fi_info, fi_info_deleter>;

/// What fi_getinfo offers for `provider` with RMA writes and remote CQ data on an RDM endpoint;
/// with `ordered`, only endpoints that order write after write; otherwise ones whose writes can
/// be asked to complete on delivery; with neither, what the provider offers by default. Null with
/// `why` set if there is none.
inline fi_info_ptr fi_query(const std::string& provider, std::optional<bool> ordered, std::string* why, bool hmem = false) {
  fi_info_ptr hints(fi_allocinfo());
  if (!hints) throw error("libfabric_transport: fi_allocinfo failed (out of memory)");
  hints->caps = FI_RMA | FI_WRITE | FI_REMOTE_WRITE;
  // Every operation's context is a struct fi_context2 the transport keeps until completion.
  hints->mode = FI_CONTEXT | FI_CONTEXT2;
  hints->ep_attr->type = FI_EP_RDM;
  hints->domain_attr->threading = FI_THREAD_DOMAIN;
  hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
  if (hmem) {
    hints->caps |= FI_HMEM;
    hints->domain_attr->mr_mode |= FI_MR_HMEM;
  }
  hints->fabric_attr->prov_name = strdup(provider.c_str());
  if (ordered == true) {
    hints->tx_attr->msg_order = FI_ORDER_WAW;
    hints->rx_attr->msg_order = FI_ORDER_WAW;
  } else if (ordered == false) {
    hints->tx_attr->op_flags = FI_DELIVERY_COMPLETE;
  }
  fi_tcp_send_staging();
  fi_info* info = nullptr;
  const int rc = fi_getinfo(FI_VERSION(1, 9), nullptr, nullptr, 0, hints.get(), &info);
  if (rc != 0) {
    if (why) *why = std::string("fi_getinfo for provider \"") + provider + "\"" + (hmem ? " with FI_HMEM" : "") + (ordered == true ? " with FI_ORDER_WAW" : ordered == false ? " with FI_DELIVERY_COMPLETE" : "") + ": " + fi_strerror(-rc);
    return nullptr;
  }
  return fi_info_ptr(info);
}

} // namespace detail

/// A Transport over libfabric RMA (host memory; device memory where FI_HMEM allows). Every rank
/// makes one with the same Bootstrap group; the constructor is collective (it allgathers endpoint
/// names). Non-copyable, non-movable (its connections point to it). Not thread-safe: a transport
/// and its connections are used by one thread at a time (the endpoint is opened with
/// FI_THREAD_DOMAIN).
///
/// - One endpoint, one completion queue, one address vector (every rank's fi_getname blob).
/// - `register_memory` is fi_mr_reg with FI_WRITE | FI_REMOTE_WRITE; a handle is (base, key,
///   size), the base being the virtual address where the provider uses FI_MR_VIRT_ADDR and 0
///   where it takes offsets.
/// - A put is one fi_writemsg per chunk; a signal is a zero-byte write (into a small region every
///   transport registers for that) carrying 64 bits of remote CQ data: sender rank (24 bits),
///   connection id (16 bits), channel (24 bits). The receiver demultiplexes its completion queue
///   into per-connection, per-(peer, channel) counters; local completions advance per-(peer,
///   channel) watermarks that `sent` and the deferred signals read.
/// - Ordering of a signal after its puts: see fi_signal_ordering and `ordering()`.
/// - Progress is manual: every call of a connection reads the completion queue, and waits poll
///   it under the wait_policy; a rank must keep calling wait/test while peers write to it.
class libfabric_transport {
public:
  /// Local memory: the region and its registration (`local` is its fi_mr_desc, `key` its
  /// fi_mr_key).
  using memory = rma::memory<fid_mr, void*>;
  /// A peer's registered region: where writes go (addr + offset), its key and size.
  using remote = rma::remote;
  /// A serialized handle: base, key and size, 8 bytes each.
  static constexpr std::size_t handle_bytes = rma::handle_bytes;
  /// Host memory always; device memory (CUDA, ROCr) where the provider registers it (FI_HMEM):
  /// ask `registers(kind)` at run time, and register it with register_memory(p, n, kind, device).
  static constexpr bool can_register(memory_kind) noexcept { return true; }

  /// One owner's connection: its own signal counters, sharing the transport's endpoint. Move-only;
  /// must not outlive its transport.
  using connection = rma::connection<libfabric_transport>;

  /// Opens an endpoint of the chosen provider and exchanges addresses through `boot` (collective
  /// over its ranks). Throws fasta2a::error naming the libfabric call and its fi_strerror if the
  /// provider is not there or lacks what is needed (RMA, 8 bytes of remote CQ data), or if the
  /// ranks chose different providers.
  template <Bootstrap B>
  explicit libfabric_transport(B& boot, libfabric_options opt = {})
      : opt_(std::move(opt)), rank_(boot.rank()), size_(boot.size()),
        conns_("libfabric_transport", size_, max_connections, max_channels) {
    if (size_ < 1 || size_ > max_ranks)
      throw error("libfabric_transport: " + std::to_string(size_) + " ranks (at most " + std::to_string(max_ranks) + ")");
    provider_ = detail::fi_resolve_provider(opt_.provider);
    try {
      open();
      exchange(boot);
    } catch (...) {
      close();
      throw;
    }
  }
  libfabric_transport(const libfabric_transport&) = delete;
  libfabric_transport& operator=(const libfabric_transport&) = delete;

  /// Drains what this rank still has in flight (bounded by the timeout), then closes the
  /// endpoint and everything under it. Registrations not deregistered are closed too.
  ~libfabric_transport() {
    try {
      const auto deadline = std::chrono::steady_clock::now() + std::min(opt_.timeout, std::chrono::milliseconds(2000));
      detail::backoff b(opt_.waiting);
      while (outstanding_total() > 0 && std::chrono::steady_clock::now() < deadline) {
        progress();
        b.pause();
      }
    } catch (...) { // closing anyway: a peer already gone is not this destructor's error
    }
    close();
  }

  /// Completes every operation and deferred signal of every connection (flush of them all), up
  /// to the timeout. Where ranks share a process (threads, each its own endpoint), call it and
  /// then synchronise the ranks before destroying transports: with shm, test runs whose ranks
  /// closed their endpoints at different times crashed inside libfabric (SIGSEGV in 3 of about 25
  /// runs, two of them runs already failing), none since the ranks quiesce and synchronise first
  /// (0 of 9 shm runs); presumably a peer endpoint of the same process is touched after its close.
  void quiesce() {
    if (!detail::poll_until([&] { progress(); return outstanding_total() == 0; }, opt_.waiting, opt_.timeout))
      throw timeout_error("libfabric_transport::quiesce: " + std::to_string(outstanding_total()) + " operation(s) on rank " +
                  std::to_string(rank_) + " did not complete within " + std::to_string(opt_.timeout.count()) + " ms");
  }

  /// Whether `provider` (resolved as the constructor does) offers what this transport needs here;
  /// if not, `why` says what fi_getinfo answered.
  static bool available(const std::string& provider = {}, std::string* why = nullptr) {
    const std::string p = detail::fi_resolve_provider(provider);
    std::string w;
    if (detail::fi_query(p, std::nullopt, &w)) return true;
    if (why) *why = w;
    return false;
  }

  /// The provider in use, as fi_getinfo names it ("tcp;ofi_rxm", "shm").
  const std::string& provider() const noexcept { return provider_; }
  /// How signals are kept behind their puts on this endpoint (never `automatic`).
  fi_signal_ordering ordering() const noexcept { return ordering_; }
  /// The largest single write this transport posts.
  std::size_t max_put_bytes() const noexcept { return chunk_; }
  /// One line for logs: provider, fabric, domain, how memory is addressed, how signals are ordered.
  std::string describe() const {
    return "libfabric provider " + provider_ + " (fabric " + fabric_name_ + ", domain " + domain_name_ + "), " +
           (virt_addr_ ? "virtual addresses" : "offsets") + " as remote addresses, " + to_string(ordering_) +
           (ordering_ == fi_signal_ordering::wait_for_completion ? (delivery_ ? " (delivery complete)" : " (transmit complete)") : "") +
           ", writes of at most " + std::to_string(chunk_) + " bytes, " +
           (hmem_ ? std::string("FI_HMEM (CUDA ") + (hmem_cuda_ ? "yes" : "no") + ", ROCr " + (hmem_rocr_ ? "yes" : "no") + ")"
                  : std::string("no FI_HMEM")) +
           " device memory registration" + tcp_staging_note() +
           (shm_swept_ > 0 ? ", removed " + std::to_string(shm_swept_) + " shm region(s) that processes gone had left in /dev/shm" : "");
  }
  rank_t rank() const noexcept { return rank_; }
  rank_t size() const noexcept { return size_; }
  /// For tcp: the send staging set when the endpoint was opened (see detail::fi_tcp_send_staging),
  /// and a warning where the environment turned it on.
  std::string tcp_staging_note() const {
    if (provider_.rfind("tcp", 0) != 0) return "";
    const std::string& v = tcp_staging_;
    if (v == "0") return ", no tcp send staging (FI_TCP_STAGING_SBUF_SIZE=0)";
    return ", WARNING: FI_TCP_STAGING_SBUF_SIZE=" + v + " from the environment: a signal may stay in its sender's process "
           "until the sender's next call and its peer time out waiting (unset it)";
  }

  /// Registers [p, p + n) as a put source and target (fi_mr_reg, FI_WRITE | FI_REMOTE_WRITE).
  /// An empty region needs no registration. Throws fasta2a::error if p is null while n > 0 or
  /// fi_mr_reg fails.
  memory register_memory(void* p, std::size_t n) {
    if (p == nullptr && n > 0) throw error("libfabric_transport::register_memory: null pointer for " + std::to_string(n) + " bytes");
    memory m{static_cast<std::byte*>(p), n, nullptr, nullptr, 0};
    if (n == 0) return m;
    reg(m);
    return m;
  }
  /// Whether this endpoint registers memory of kind k: host always; CUDA or ROCr device memory
  /// only where the endpoint was opened with FI_HMEM (the provider offers it and
  /// libfabric_options::hmem) and this libfabric has that interface: a build without CUDA or
  /// ROCr support answers a registration attempt with -FI_ENOSYS or -FI_EOPNOTSUPP, checked once
  /// at start-up (see describe()). Where it is false the engine bounces device memory through
  /// host buffers.
  bool registers(memory_kind k) const noexcept {
    switch (k) {
    case memory_kind::host: return true;
    case memory_kind::cuda_device: return hmem_cuda_;
    case memory_kind::hip_device: return hmem_rocr_;
    }
    return false;
  }
  /// Registers [p, p + n) of memory of kind k on device `device` (the CUDA device ordinal or
  /// ROCr agent index; ignored for host memory) with fi_mr_regattr (iface FI_HMEM_CUDA or
  /// FI_HMEM_ROCR). Throws fasta2a::error if this endpoint does not register that kind
  /// (`registers(k)` is false) or the registration fails.
  memory register_memory(void* p, std::size_t n, memory_kind k, int device = 0) {
    if (k == memory_kind::host) return register_memory(p, n);
    if (!registers(k))
      throw error(std::string("libfabric_transport::register_memory: provider \"") + provider_ + "\" cannot register " +
                  to_string(k) + " memory here (" + (hmem_ ? "this libfabric lacks that FI_HMEM interface" : "no FI_HMEM") +
                  "): bounce it through host memory");
    if (p == nullptr && n > 0) throw error("libfabric_transport::register_memory: null pointer for " + std::to_string(n) + " bytes");
    memory m{static_cast<std::byte*>(p), n, nullptr, nullptr, 0};
    if (n == 0) return m;
    reg(m, k == memory_kind::cuda_device ? FI_HMEM_CUDA : FI_HMEM_ROCR, device);
    return m;
  }
  /// Closing a registration invalidates its key: a peer's late fi_write into it fails (an error
  /// completion at the writer) instead of landing.
  static constexpr bool late_writes_revoked = true;
  /// But the provider may treat such a write as a protocol error and close its link between the
  /// two processes (tcp;ofi_rxm does: later operations between them fail with "Transport endpoint
  /// is not connected"), so an engine cannot recover over this transport after a late write:
  /// later calls fail with that error (no hang), and the transports must be made anew.
  static constexpr bool survives_revoked_writes = false;
  /// Closes the registration (fi_close). Safe on an empty or already deregistered memory.
  void deregister(memory& m) {
    if (m.mr != nullptr) {
      const int rc = fi_close(&m.mr->fid);
      m.mr = nullptr;
      m.local = nullptr;
      detail::fi_check(rc, "fi_close of a memory registration");
    }
  }

  std::vector<std::byte> serialize(const memory& m) const {
    return rma::serialize_handle(virt_addr_ ? static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(m.ptr)) : 0, m.key,
                                 m.size);
  }
  remote deserialize(rank_t peer, std::span<const std::byte> blob) const {
    return rma::deserialize_handle("libfabric_transport", peer, size_, blob);
  }
  /// Nothing was opened for a remote region.
  void forget(remote&) const noexcept {}

  /// A connection with its own counters for channels [0, channels). Collective in the sense of
  /// the concept: every rank makes its connections in the same order, and the k-th of each meet
  /// (their signals carry k). Signals that arrive for a connection not yet made here are kept.
  connection connect(channel_id channels) { return connection(this, conns_.make(channels)); }

private:
  friend connection;
  // Signals carry rma::code64: sender rank (24 bits), connection (16), channel (24).
  static constexpr rank_t max_ranks = static_cast<rank_t>(rma::code64::max_ranks);
  static constexpr std::uint64_t max_channels = rma::code64::max_channels;
  static constexpr std::uint64_t max_connections = rma::code64::max_connections;

  /// What an operation in flight belongs to. The provider may use `ctx` (FI_CONTEXT modes), so it
  /// comes first and the op stays put until its completion.
  struct op {
    fi_context2 ctx;
    std::uint32_t conn = 0;
    std::size_t lane = 0;
    std::uint64_t seq = 0; ///< the put's number on its lane; 0 for a signal
    rank_t peer = 0;
    channel_id ch = 0;
  };

  void check(std::uint32_t id, rank_t peer, channel_id ch, const char* what) const { conns_.check(id, peer, ch, what); }

  // --------------------------------------------------------------------------------------------
  // Opening and closing
  // --------------------------------------------------------------------------------------------

  void open() {
    tcp_staging_ = detail::fi_tcp_send_staging(); // before the queries below read the environment
    if (provider_.rfind("shm", 0) == 0) shm_swept_ = detail::fi_sweep_dead_shm(); // what killed jobs left
    std::string why_ordered, why_any;
    // With FI_HMEM where the provider offers it (libfabric_options::hmem), else without.
    auto query = [&](std::optional<bool> ordered, std::string* why) {
      if (opt_.hmem)
        if (detail::fi_info_ptr i = detail::fi_query(provider_, ordered, nullptr, true)) return i;
      return detail::fi_query(provider_, ordered, why);
    };
    if (opt_.ordering == fi_signal_ordering::provider_order) {
      info_ = query(true, &why_ordered);
    } else if (opt_.ordering == fi_signal_ordering::automatic) {
      // Rely on order only where the provider offers it unasked: shm 1.17 answers a request for
      // FI_ORDER_WAW with an info that claims it, while its own default reports
      // max_order_waw_size 0 (and the project's measurements say shm does not order writes).
      detail::fi_info_ptr plain = query(std::nullopt, &why_ordered);
      if (plain && (plain->tx_attr->msg_order & FI_ORDER_WAW) != 0 && plain->ep_attr->max_order_waw_size > 0)
        info_ = query(true, &why_ordered);
    }
    if (info_ && info_->ep_attr->max_order_waw_size == 0) info_.reset(); // ordered in name only
    if (info_) {
      ordering_ = fi_signal_ordering::provider_order;
    } else {
      if (opt_.ordering == fi_signal_ordering::provider_order)
        throw error("libfabric_transport: provider \"" + provider_ + "\" does not order write after write (" +
                    (why_ordered.empty() ? "max_order_waw_size is 0" : why_ordered) +
                    "); use fi_signal_ordering::automatic or wait_for_completion");
      info_ = query(opt_.delivery_complete ? std::optional<bool>(false) : std::nullopt, &why_any);
      if (!info_)
        throw error("libfabric_transport: provider \"" + provider_ + "\" is not available for RMA on reliable-datagram "
                    "endpoints: " + why_any + " (choose one with FASTA2A_FI_PROVIDER; fi_info -l lists them)");
      ordering_ = fi_signal_ordering::wait_for_completion;
    }
    fi_info* i = info_.get();
    if (i->domain_attr->cq_data_size < 8)
      throw error("libfabric_transport: provider \"" + provider_ + "\" carries " + std::to_string(i->domain_attr->cq_data_size) +
                  " bytes of remote CQ data; signals need 8");
    if (i->fabric_attr->prov_name) provider_ = i->fabric_attr->prov_name;
    if (i->fabric_attr->name) fabric_name_ = i->fabric_attr->name;
    if (i->domain_attr->name) domain_name_ = i->domain_attr->name;
    const int mr_mode = i->domain_attr->mr_mode;
    virt_addr_ = (mr_mode & FI_MR_VIRT_ADDR) != 0;
    prov_key_ = (mr_mode & FI_MR_PROV_KEY) != 0;
    mr_endpoint_ = (mr_mode & FI_MR_ENDPOINT) != 0;
    chunk_ = static_cast<std::size_t>(std::min<std::uint64_t>(i->ep_attr->max_msg_size, std::numeric_limits<std::size_t>::max()));
    if (ordering_ == fi_signal_ordering::provider_order)
      chunk_ = static_cast<std::size_t>(std::min<std::uint64_t>(chunk_, i->ep_attr->max_order_waw_size));
    if (opt_.max_put_bytes > 0) chunk_ = std::min(chunk_, opt_.max_put_bytes);
    if (chunk_ == 0) throw error("libfabric_transport: provider \"" + provider_ + "\" reports max_msg_size 0");
    delivery_ = ordering_ == fi_signal_ordering::wait_for_completion && opt_.delivery_complete;
    write_flags_ = FI_COMPLETION | (delivery_ ? FI_DELIVERY_COMPLETE : 0);

    detail::fi_check(fi_fabric(i->fabric_attr, &fabric_, nullptr), "fi_fabric");
    detail::fi_check(fi_domain(fabric_, i, &domain_, nullptr), "fi_domain");
    fi_cq_attr cq_attr{};
    cq_attr.format = FI_CQ_FORMAT_DATA;
    cq_attr.wait_obj = FI_WAIT_NONE; // polled under the wait_policy
    detail::fi_check(fi_cq_open(domain_, &cq_attr, &cq_, nullptr), "fi_cq_open");
    fi_av_attr av_attr{};
    av_attr.type = FI_AV_TABLE; // fi_addr_t = rank
    av_attr.count = static_cast<std::size_t>(size_);
    detail::fi_check(fi_av_open(domain_, &av_attr, &av_, nullptr), "fi_av_open");
    detail::fi_check(fi_endpoint(domain_, i, &ep_, nullptr), "fi_endpoint");
    detail::fi_check(fi_ep_bind(ep_, &cq_->fid, FI_TRANSMIT | FI_RECV), "fi_ep_bind (completion queue)");
    detail::fi_check(fi_ep_bind(ep_, &av_->fid, 0), "fi_ep_bind (address vector)");
    detail::fi_check(fi_enable(ep_), "fi_enable");
    landing_ = register_memory(landing_bytes_.data(), landing_bytes_.size());
    hmem_ = (i->caps & FI_HMEM) != 0;
    hmem_cuda_ = hmem_ && hmem_interface(FI_HMEM_CUDA);
    hmem_rocr_ = hmem_ && hmem_interface(FI_HMEM_ROCR);
  }

  void close() noexcept {
    // Children before parents: registrations and the endpoint before the domain.
    if (landing_.mr) fi_close(&landing_.mr->fid);
    landing_.mr = nullptr;
    if (ep_) fi_close(&ep_->fid);
    if (av_) fi_close(&av_->fid);
    if (cq_) fi_close(&cq_->fid);
    if (domain_) fi_close(&domain_->fid);
    if (fabric_) fi_close(&fabric_->fid);
    ep_ = nullptr;
    av_ = nullptr;
    cq_ = nullptr;
    domain_ = nullptr;
    fabric_ = nullptr;
    // A peer killed during the job left its region: the survivors remove it as they close.
    if (provider_.rfind("shm", 0) == 0) detail::fi_sweep_dead_shm();
  }

  void reg(memory& m, fi_hmem_iface iface = FI_HMEM_SYSTEM, int device = 0) {
    const std::uint64_t requested = prov_key_ ? 0 : next_key_++;
    fid_mr* mr = nullptr;
    if (iface == FI_HMEM_SYSTEM) {
      detail::fi_check(fi_mr_reg(domain_, m.ptr, m.size, FI_WRITE | FI_REMOTE_WRITE, 0, requested, 0, &mr, nullptr),
                       "fi_mr_reg of " + std::to_string(m.size) + " bytes");
    } else {
      detail::fi_check(regattr(m.ptr, m.size, iface, device, requested, &mr),
                       std::string("fi_mr_regattr of ") + std::to_string(m.size) + " bytes of " +
                           (iface == FI_HMEM_CUDA ? "CUDA" : "ROCr") + " device memory (device " + std::to_string(device) + ")");
    }
    if (mr_endpoint_) {
      int rc = fi_mr_bind(mr, &ep_->fid, 0);
      if (rc == 0) rc = fi_mr_enable(mr);
      if (rc != 0) {
        fi_close(&mr->fid);
        detail::fi_fail("fi_mr_bind/fi_mr_enable", rc);
      }
    }
    m.mr = mr;
    m.local = fi_mr_desc(mr);
    m.key = fi_mr_key(mr);
    if (m.key == FI_KEY_NOTAVAIL) {
      fi_close(&mr->fid);
      m.mr = nullptr;
      throw error("libfabric_transport: fi_mr_key gave no key (FI_MR_RAW keys are not supported)");
    }
  }

  int regattr(void* p, std::size_t n, fi_hmem_iface iface, int device, std::uint64_t requested, fid_mr** mr) {
    iovec iov{p, n};
    fi_mr_attr attr{};
    attr.mr_iov = &iov;
    attr.iov_count = 1;
    attr.access = FI_WRITE | FI_REMOTE_WRITE;
    attr.requested_key = requested;
    attr.iface = iface;
    if (iface == FI_HMEM_CUDA) attr.device.cuda = device;
    else attr.device.reserved = static_cast<std::uint64_t>(device);
    return fi_mr_regattr(domain_, &attr, 0, mr);
  }

  /// Whether this libfabric has the FI_HMEM interface at all: a build without it answers
  /// -FI_ENOSYS or -FI_EOPNOTSUPP before looking at the memory, so a host buffer serves as the
  /// probe (any other answer, success included, means the interface is there).
  bool hmem_interface(fi_hmem_iface iface) {
    fid_mr* mr = nullptr;
    const int rc = regattr(landing_bytes_.data(), landing_bytes_.size(), iface, 0, prov_key_ ? 0 : next_key_++, &mr);
    if (rc == 0 && mr != nullptr) fi_close(&mr->fid);
    return rc != -FI_ENOSYS && rc != -FI_EOPNOTSUPP;
  }

  /// The allgather of endpoint names: provider (so that ranks that chose differently fail
  /// together), the name, the signal landing region.
  template <class B>
  void exchange(B& boot) {
    constexpr std::size_t prov_len = 64, name_max = 400, blob = prov_len + 8 * 4 + name_max;
    std::array<std::byte, blob> mine{};
    std::size_t len = name_max;
    detail::fi_check(fi_getname(&ep_->fid, mine.data() + prov_len + 32, &len), "fi_getname");
    std::memcpy(mine.data(), provider_.data(), std::min(provider_.size(), prov_len - 1));
    const std::uint64_t words[4] = {static_cast<std::uint64_t>(len),
                                    virt_addr_ ? static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(landing_.ptr)) : 0,
                                    landing_.key, static_cast<std::uint64_t>(ordering_)};
    std::memcpy(mine.data() + prov_len, words, sizeof(words));
    std::vector<std::byte> all(blob * static_cast<std::size_t>(size_));
    boot.allgather(std::span<const std::byte>(mine), std::span<std::byte>(all));
    landings_.resize(static_cast<std::size_t>(size_));
    for (rank_t r = 0; r < size_; ++r) {
      const std::byte* b = all.data() + blob * static_cast<std::size_t>(r);
      const std::string theirs(reinterpret_cast<const char*>(b), strnlen(reinterpret_cast<const char*>(b), prov_len));
      std::uint64_t w[4];
      std::memcpy(w, b + prov_len, sizeof(w));
      if (theirs != provider_ || w[3] != words[3])
        throw error("libfabric_transport: rank " + std::to_string(r) + " uses provider \"" + theirs + "\" (" +
                    to_string(static_cast<fi_signal_ordering>(w[3])) + "), rank " + std::to_string(rank_) + " \"" +
                    provider_ + "\" (" + to_string(ordering_) + "): every rank must use the same");
      fi_addr_t addr = FI_ADDR_NOTAVAIL;
      const int n = fi_av_insert(av_, b + prov_len + 32, 1, &addr, 0, nullptr);
      if (n != 1) detail::fi_fail("fi_av_insert of rank " + std::to_string(r) + "'s address", n < 0 ? n : -FI_EINVAL);
      if (addr != static_cast<fi_addr_t>(r))
        throw error("libfabric_transport: fi_av_insert put rank " + std::to_string(r) + " at " + std::to_string(addr));
      landings_[static_cast<std::size_t>(r)] = remote{w[1], w[2], landing_bytes_.size(), r};
    }
  }

  // --------------------------------------------------------------------------------------------
  // Operations
  // --------------------------------------------------------------------------------------------

  op* new_op() {
    if (free_ops_.empty()) {
      ops_.emplace_back();
      return &ops_.back();
    }
    op* o = free_ops_.back();
    free_ops_.pop_back();
    return o;
  }

  /// Posts one write (data or, with `data_flag`, a signal); -FI_EAGAIN when the endpoint is busy.
  ssize_t post(op* o, const void* buf, std::size_t len, void* desc, std::uint64_t addr, std::uint64_t key,
               bool is_signal, std::uint64_t data) {
    iovec iov{const_cast<void*>(buf), len};
    fi_rma_iov rma{addr, len, key};
    fi_msg_rma msg{};
    msg.msg_iov = &iov;
    msg.desc = &desc;
    msg.iov_count = 1;
    msg.addr = static_cast<fi_addr_t>(o->peer);
    msg.rma_iov = &rma;
    msg.rma_iov_count = 1;
    msg.context = &o->ctx;
    msg.data = data;
    return fi_writemsg(ep_, &msg, write_flags_ | (is_signal ? FI_REMOTE_CQ_DATA : 0));
  }

  /// Posts, retrying a busy endpoint while driving progress, up to the timeout.
  void post_blocking(op* o, const void* buf, std::size_t len, void* desc, std::uint64_t addr, std::uint64_t key,
                     bool is_signal, std::uint64_t data, const char* what) {
    const auto deadline = std::chrono::steady_clock::now() + opt_.timeout;
    detail::backoff b(opt_.waiting);
    for (;;) {
      const ssize_t rc = post(o, buf, len, desc, addr, key, is_signal, data);
      if (rc == 0) return;
      if (rc != -FI_EAGAIN) {
        free_ops_.push_back(o);
        detail::fi_fail(std::string("fi_writemsg (") + what + " to rank " + std::to_string(o->peer) + ")", rc);
      }
      progress();
      if (std::chrono::steady_clock::now() >= deadline) {
        free_ops_.push_back(o);
        throw timeout_error(std::string("libfabric_transport: fi_writemsg (") + what + " to rank " +
                            std::to_string(o->peer) + ") kept returning -FI_EAGAIN for " + std::to_string(opt_.timeout.count()) + " ms");
      }
      b.pause();
    }
  }

  void put(std::uint32_t id, rank_t peer, const memory& src, std::size_t src_off, const remote& dst, std::size_t dst_off,
           std::size_t n, channel_id ch) {
    check(id, peer, ch, "put");
    if (n == 0) return;
    rma::check_put_bounds("libfabric_transport", peer, src_off, src.size, dst_off, dst.size, n);
    const std::size_t li = conns_.index(id, peer, ch);
    rma::for_each_chunk(n, chunk_, [&](std::size_t off, std::size_t len) {
      rma::lane& l = conns_.at(id).lanes[li];
      op* o = new_op();
      *o = op{};
      o->conn = id;
      o->lane = li;
      o->peer = peer;
      o->ch = ch;
      o->seq = l.puts.next();
      post_blocking(o, src.ptr + src_off + off, len, src.local, dst.addr + dst_off + off, dst.key, false, 0, "put");
      // Counted only once posted: a failed post leaves the lane as it was.
      l.puts.post();
      ++conns_.at(id).outstanding;
    });
  }

  void signal(std::uint32_t id, rank_t peer, channel_id ch) {
    check(id, peer, ch, "signal");
    rma::lane& l = conns_.lane_of(id, peer, ch);
    if (ordering_ == fi_signal_ordering::provider_order) {
      post_signal(id, conns_.index(id, peer, ch), peer, ch);
      l.signals.add(l.puts.posted(), true, l.puts.done());
    } else {
      // Deferred until its puts are delivered; progress() posts it.
      l.signals.add(l.puts.posted(), false, l.puts.done());
      ++deferred_;
      progress();
    }
  }

  void post_signal(std::uint32_t id, std::size_t li, rank_t peer, channel_id ch) {
    op* o = new_op();
    *o = op{};
    o->conn = id;
    o->lane = li;
    o->peer = peer;
    o->ch = ch;
    const remote& land = landings_[static_cast<std::size_t>(peer)];
    post_blocking(o, landing_.ptr, 0, landing_.local, land.addr, land.key, true, rma::code64::encode(rank_, id, ch), "signal");
    ++conns_.at(id).outstanding;
  }

  /// Posts deferred signals whose puts have all completed, in order per lane; stops at a busy
  /// endpoint (the next progress() tries again).
  void post_deferred() {
    for (std::uint32_t id = 0; id < conns_.made() && deferred_ > 0; ++id) {
      auto& c = conns_.at(id);
      for (std::size_t li = 0; li < c.lanes.size(); ++li) {
        rma::lane& l = c.lanes[li];
        if (l.signals.deferred() == 0) continue;
        bool busy = false;
        const rank_t peer = static_cast<rank_t>(li / c.channels);
        const channel_id ch = static_cast<channel_id>(li % c.channels);
        deferred_ -= l.signals.post_due(l.puts.done(), [&](std::uint64_t) {
          op* o = new_op();
          *o = op{};
          o->conn = id;
          o->lane = li;
          o->peer = peer;
          o->ch = ch;
          const remote& land = landings_[static_cast<std::size_t>(peer)];
          const ssize_t rc = post(o, landing_.ptr, 0, landing_.local, land.addr, land.key, true, rma::code64::encode(rank_, id, ch));
          if (rc == -FI_EAGAIN) {
            free_ops_.push_back(o);
            busy = true;
            return false;
          }
          if (rc != 0) {
            free_ops_.push_back(o);
            detail::fi_fail("fi_writemsg (signal to rank " + std::to_string(peer) + ")", rc);
          }
          ++c.outstanding;
          return true;
        });
        if (busy) return;
      }
    }
  }

  void complete(op* o) {
    auto& c = conns_.at(o->conn);
    --c.outstanding;
    if (o->seq != 0) {
      rma::lane& l = c.lanes[o->lane];
      l.puts.complete(o->seq);
      // Signals already posted whose puts are now all complete have been sent.
      l.signals.settle(l.puts.done());
    }
    free_ops_.push_back(o);
  }

  void arrive(std::uint64_t data) {
    const rma::signal_fields f = rma::code64::decode(data);
    conns_.arrive(f.conn, f.from, f.ch);
  }

  /// Reads the completion queue (which also drives a manual-progress provider): remote CQ data
  /// counts signals, local completions advance lanes; then posts the deferred signals now due.
  void progress() {
    fi_cq_data_entry e[32];
    for (;;) {
      const ssize_t n = fi_cq_read(cq_, e, 32);
      if (n == -FI_EAGAIN) break;
      if (n == -FI_EAVAIL) fail_from_cq();
      if (n < 0) detail::fi_fail("fi_cq_read", n);
      for (ssize_t k = 0; k < n; ++k) {
        if (e[k].flags & FI_REMOTE_CQ_DATA) arrive(e[k].data);
        else if (e[k].op_context != nullptr) complete(static_cast<op*>(e[k].op_context));
      }
      if (n < 32) break;
    }
    if (deferred_ > 0) post_deferred();
  }

  [[noreturn]] void fail_from_cq() {
    fi_cq_err_entry err{};
    const ssize_t rc = fi_cq_readerr(cq_, &err, 0);
    if (rc < 0) detail::fi_fail("fi_cq_readerr", rc);
    char text[256] = {0};
    const char* detail_text = fi_cq_strerror(cq_, err.prov_errno, err.err_data, text, sizeof(text));
    std::string what = "a completion";
    if (err.op_context != nullptr) {
      op* o = static_cast<op*>(err.op_context);
      what = std::string(o->seq != 0 ? "a put" : "a signal") + " to rank " + std::to_string(o->peer) + " on channel " +
             std::to_string(o->ch);
      // The operation is over, if failed: the lane never counts it as done.
      --conns_.at(o->conn).outstanding;
      free_ops_.push_back(o);
    }
    throw error("libfabric_transport: " + what + " failed: " + fi_strerror(err.err) + " (" +
                (detail_text ? detail_text : "no provider detail") + ")");
  }

  bool idle(std::uint32_t id) const {
    if (conns_.at(id).outstanding > 0) return false;
    for (const rma::lane& l : conns_.at(id).lanes)
      if (!l.signals.idle()) return false;
    return true;
  }

  void flush(std::uint32_t id) {
    if (!detail::poll_until([&] { progress(); return idle(id); }, opt_.waiting, opt_.timeout))
      throw timeout_error("libfabric_transport::flush: " + std::to_string(conns_.at(id).outstanding) +
                  " operation(s) of connection " + std::to_string(id) + " on rank " + std::to_string(rank_) +
                  " did not complete within " + std::to_string(opt_.timeout.count()) + " ms");
  }

  std::uint64_t outstanding_total() const { return deferred_ + conns_.outstanding(); }

  libfabric_options opt_;
  rank_t rank_, size_;
  std::string provider_, fabric_name_, domain_name_;
  fi_signal_ordering ordering_ = fi_signal_ordering::automatic;
  detail::fi_info_ptr info_;
  fid_fabric* fabric_ = nullptr;
  fid_domain* domain_ = nullptr;
  fid_cq* cq_ = nullptr;
  fid_av* av_ = nullptr;
  fid_ep* ep_ = nullptr;
  bool virt_addr_ = false, prov_key_ = false, mr_endpoint_ = false;
  bool delivery_ = false;        ///< puts ask for FI_DELIVERY_COMPLETE
  std::string tcp_staging_;      ///< FI_TCP_STAGING_SBUF_SIZE when the endpoint was opened
  std::size_t shm_swept_ = 0;    ///< shm regions of processes gone, removed when the endpoint was opened
  bool hmem_ = false, hmem_cuda_ = false, hmem_rocr_ = false; ///< FI_HMEM opened; its interfaces
  std::uint64_t write_flags_ = 0;
  std::size_t chunk_ = 0;
  std::uint64_t next_key_ = 1;
  std::array<std::byte, 8> landing_bytes_{};   ///< what signals (zero-byte writes) target
  memory landing_;
  std::vector<remote> landings_;               ///< every rank's landing region
  rma::connection_table<> conns_;              ///< connections, lanes, arrived signals
  std::uint64_t deferred_ = 0;                 ///< signals queued, not yet posted
  std::deque<op> ops_;                         ///< every op ever allocated (stable addresses)
  std::vector<op*> free_ops_;
};

static_assert(Transport<libfabric_transport>);

} // namespace fasta2a
