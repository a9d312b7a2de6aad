// fasta2a libibverbs transport: one reliable-connected (RC) queue pair per peer, puts as RDMA
// writes into the peer's registered memory, signals as zero-byte RDMA writes with a 32-bit
// immediate (connection, channel, sequence: rma::imm32) that the peer's posted receives consume.
// Queue pairs are connected through any fasta2a Bootstrap (LID or GID, QP number and PSN
// exchanged with one allgather). Host memory is registered with ibv_reg_mr, device memory with
// ibv_reg_dmabuf_mr from a dma-buf fd the GPU layer exports. Depends on libibverbs only.
//
// Never run on the project's machines (no RDMA device there): see transports/verbs/README.md
// for what has and has not run.
#pragma once

#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "fasta2a/common.hpp"
#include "fasta2a/rma.hpp"
#include "fasta2a/transport.hpp"

namespace fasta2a {

/// Options of a verbs_transport.
struct verbs_options {
  /// The RDMA device, as ibv_devices names it ("mlx5_0"). Empty: the environment variable
  /// FASTA2A_IB_DEVICE, else the first device with an active port.
  std::string device;
  /// The port (from 1). 0: the environment variable FASTA2A_IB_PORT, else the device's first
  /// active port.
  int port = 0;
  /// The GID index for RoCE (and for InfiniBand routed through global headers). -1: the
  /// environment variable FASTA2A_IB_GID_INDEX, else 0 on an Ethernet port (RoCE v2 is often at
  /// another index: see show_gids) and no GID on an InfiniBand port (the LID is used).
  int gid_index = -1;
  /// How wait() and flush() poll the completion queue.
  wait_policy waiting{};
  /// How long a put waits for room in a full send queue, and flush() for its completions.
  std::chrono::milliseconds timeout{30000};
  /// The largest single RDMA write; longer puts are cut (0: the port's max_msg_sz).
  std::size_t max_put_bytes = 0;
  /// Selective signalling: every k-th work request on a queue pair asks for a completion (and
  /// every signal, and the last before a flush). Clamped to [1, send_depth / 2].
  unsigned signal_every = 16;
  /// Work requests per queue pair: sends in flight, receives posted for immediates (clamped to
  /// the device's max_qp_wr).
  unsigned send_depth = 512;
  unsigned recv_depth = 256;
  /// Queue pair attributes: local ACK timeout exponent (4.096 us x 2^n), transport retries,
  /// service level.
  std::uint8_t ack_timeout = 14;
  std::uint8_t retry_count = 7;
  std::uint8_t service_level = 0;
  /// GPUDirect RDMA through dma-buf: given a device range [p, p + n), returns a dma-buf file
  /// descriptor covering it and sets *offset to p's offset inside it (CUDA:
  /// cuMemGetHandleForAddressRange with CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD), or -1 on failure.
  /// The transport closes the descriptor once the memory is registered. Unset: device memory is
  /// not registered (`registers` is false for device kinds; the engine bounces through host
  /// memory), except through register_dmabuf.
  std::function<int(const void* p, std::size_t n, std::uint64_t* offset)> dmabuf_export;
};

namespace detail {

inline std::string ib_errno(int e) { return std::string(std::strerror(e)) + " (errno " + std::to_string(e) + ")"; }

/// `value` if set, else the environment variable `env` if set, else "".
inline std::string ib_setting(const std::string& value, const char* env) {
  if (!value.empty()) return value;
  if (const char* v = std::getenv(env); v != nullptr && *v != '\0') return v;
  return {};
}
/// `value` if positive (non-negative with `zero_ok`), else the integer in environment variable
/// `env`, else `fallback`. Throws fasta2a::error if the variable is not an integer.
inline int ib_int_setting(int value, bool zero_ok, const char* env, int fallback) {
  if (value > 0 || (zero_ok && value == 0)) return value;
  const char* v = std::getenv(env);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (end == v || *end != '\0' || x < 0 || x > 1 << 16)
    throw error(std::string("verbs_transport: ") + env + "=\"" + v + "\" is not a non-negative integer");
  return static_cast<int>(x);
}

/// An opened device and the chosen port.
struct ib_opened {
  ibv_context* ctx = nullptr;
  std::string name;
  int port = 0;
  ibv_port_attr port_attr{};
};

/// Opens the device (requested, $FASTA2A_IB_DEVICE, or the first with an active port) and finds
/// an active port (requested, $FASTA2A_IB_PORT, or the first). On failure returns no context and
/// says why: "no RDMA device found (ibv_get_device_list: ...)" where there is none at all.
inline ib_opened ib_open(const std::string& requested, int port_requested, std::string* why) {
  ib_opened out;
  const std::string want = ib_setting(requested, "FASTA2A_IB_DEVICE");
  const int want_port = ib_int_setting(port_requested, false, "FASTA2A_IB_PORT", 0);
  int num = 0;
  errno = 0;
  ibv_device** list = ibv_get_device_list(&num);
  if (list == nullptr) {
    const int e = errno;
    *why = "no RDMA device found (ibv_get_device_list: " + (e ? ib_errno(e) : std::string("no device list")) + ")";
    return out;
  }
  struct list_guard {
    ibv_device** l;
    ~list_guard() { ibv_free_device_list(l); }
  } guard{list};
  if (num == 0) {
    *why = "no RDMA device found (ibv_get_device_list: 0 devices)";
    return out;
  }
  std::string seen, problems;
  bool named = false;
  for (int d = 0; d < num; ++d) {
    const char* name = ibv_get_device_name(list[d]);
    const std::string dev_name = name ? name : "?";
    seen += (seen.empty() ? "" : ", ") + dev_name;
    if (!want.empty() && dev_name != want) continue;
    named = true;
    ibv_context* ctx = ibv_open_device(list[d]);
    if (ctx == nullptr) {
      problems += "; " + dev_name + ": ibv_open_device: " + ib_errno(errno);
      continue;
    }
    ibv_device_attr attr{};
    if (const int rc = ibv_query_device(ctx, &attr); rc != 0) {
      problems += "; " + dev_name + ": ibv_query_device: " + ib_errno(rc);
      ibv_close_device(ctx);
      continue;
    }
    for (int p = 1; p <= attr.phys_port_cnt; ++p) {
      if (want_port != 0 && p != want_port) continue;
      ibv_port_attr pa{};
      if (const int rc = ibv_query_port(ctx, static_cast<std::uint8_t>(p), &pa); rc != 0) {
        problems += "; " + dev_name + " port " + std::to_string(p) + ": ibv_query_port: " + ib_errno(rc);
        continue;
      }
      if (pa.state != IBV_PORT_ACTIVE) {
        problems += "; " + dev_name + " port " + std::to_string(p) + " is " + ibv_port_state_str(pa.state);
        continue;
      }
      out.ctx = ctx;
      out.name = dev_name;
      out.port = p;
      out.port_attr = pa;
      return out;
    }
    if (want_port > attr.phys_port_cnt)
      problems += "; " + dev_name + " has " + std::to_string(attr.phys_port_cnt) + " port(s), not port " + std::to_string(want_port);
    ibv_close_device(ctx);
  }
  if (!want.empty() && !named)
    *why = "RDMA device \"" + want + "\" not found (devices: " + seen + "; FASTA2A_IB_DEVICE or verbs_options::device)";
  else
    *why = "no active port on RDMA device(s) " + (want.empty() ? seen : want) + problems;
  return out;
}

} // namespace detail

/// A Transport over libibverbs RC queue pairs. Every rank makes one with the same Bootstrap
/// group; the constructor is collective (one allgather of queue pair addresses, one to agree
/// every queue pair is ready). Non-copyable, non-movable (its connections point to it). Not
/// thread-safe: a transport and its connections are used by one thread at a time.
///
/// - One protection domain, one completion queue for sends and receives, one RC queue pair per
///   rank (this rank's own included: connected to itself, so puts to oneself work the same way).
/// - `register_memory` is ibv_reg_mr (local and remote write); device memory goes through
///   `register_memory(p, n, kind)` (verbs_options::dmabuf_export, then ibv_reg_dmabuf_mr) or
///   `register_dmabuf(p, n, fd, offset)`. A handle is (virtual address, rkey, size).
/// - A put is one IBV_WR_RDMA_WRITE per chunk of at most max_put_bytes(); a signal is a
///   zero-byte IBV_WR_RDMA_WRITE_WITH_IMM after them on the same queue pair, which RC delivers
///   after the writes before it. Its immediate is rma::imm32 (connection, channel, sequence); the
///   receiver counts it per (connection, peer, channel) and checks the sequence.
/// - Selective signalling: one work request in `signal_every` asks for a completion, and every
///   signal; a completion on an RC send queue means every earlier request there completed, so
///   each queue pair keeps one watermark that `sent` and `flush` read.
/// - Progress: every call of a connection polls the completion queue; waits poll it under the
///   wait_policy. Receives are reposted as their immediates are read.
class verbs_transport {
public:
  /// Local memory: the region and its registration (`local` is its lkey, `key` its rkey).
  using memory = rma::memory<ibv_mr, std::uint32_t>;
  /// A peer's registered region: its virtual address (the iova of a dma-buf registration), rkey
  /// and size.
  using remote = rma::remote;
  /// A serialized handle: address, rkey and size, 8 bytes each.
  static constexpr std::size_t handle_bytes = rma::handle_bytes;
  /// Host memory, and device memory through dma-buf: ask `registers(kind)` at run time.
  static constexpr bool can_register(memory_kind) noexcept { return true; }

  /// One owner's connection: its own signal counters, sharing the transport's queue pairs.
  /// Move-only; must not outlive its transport.
  using connection = rma::connection<verbs_transport>;

  /// Opens the device, makes a queue pair per rank and connects them through `boot` (collective
  /// over its ranks). Throws fasta2a::error: "no RDMA device found (ibv_get_device_list: ...)"
  /// where there is none, naming the verbs call and errno otherwise, or naming the rank whose
  /// port differs (InfiniBand against Ethernet).
  template <Bootstrap B>
  explicit verbs_transport(B& boot, verbs_options opt = {})
      : opt_(std::move(opt)), rank_(boot.rank()), size_(boot.size()),
        conns_("verbs_transport", size_, rma::imm32::max_connections, rma::imm32::max_channels) {
    if (size_ < 1 || size_ > max_ranks)
      throw error("verbs_transport: " + std::to_string(size_) + " ranks (at most " + std::to_string(max_ranks) + ")");
    try {
      open();
      exchange(boot);
    } catch (...) {
      close();
      throw;
    }
  }
  verbs_transport(const verbs_transport&) = delete;
  verbs_transport& operator=(const verbs_transport&) = delete;

  /// Drains what this rank still has in flight (bounded by the timeout and 2 s), then destroys
  /// the queue pairs and everything under them.
  ~verbs_transport() {
    try {
      ensure_completions();
      const auto deadline = std::chrono::steady_clock::now() + std::min(opt_.timeout, std::chrono::milliseconds(2000));
      detail::backoff b(opt_.waiting);
      while (!all_done() && std::chrono::steady_clock::now() < deadline) {
        progress();
        b.pause();
      }
    } catch (...) { // closing anyway
    }
    close();
  }

  /// Completes every work request this rank posted, up to the timeout. Where ranks share a
  /// process, call it and synchronise them before destroying transports.
  void quiesce() {
    ensure_completions();
    if (!detail::poll_until([&] { progress(); return all_done(); }, opt_.waiting, opt_.timeout))
      throw timeout_error("verbs_transport::quiesce: work requests on rank " + std::to_string(rank_) + " to " + pending_peers() +
                  " did not complete within " + std::to_string(opt_.timeout.count()) + " ms");
  }

  /// Whether an RDMA device with an active port is there (the device and port chosen as the
  /// constructor would: the arguments, else FASTA2A_IB_DEVICE and FASTA2A_IB_PORT); if not, `why`
  /// says what libibverbs answered ("no RDMA device found (ibv_get_device_list: ...)").
  static bool available(std::string* why = nullptr, const std::string& device = {}, int port = 0) {
    std::string w;
    detail::ib_opened o;
    try {
      o = detail::ib_open(device, port, &w);
    } catch (const error& e) {
      w = e.what();
    }
    if (o.ctx != nullptr) {
      ibv_close_device(o.ctx);
      return true;
    }
    if (why) *why = w;
    return false;
  }

  /// Whether this device registers memory of kind k: host always; device memory where the
  /// device and driver take dma-buf registrations (ibv_reg_dmabuf_mr probed once at start-up)
  /// and verbs_options::dmabuf_export is set to obtain the fd. False: the engine bounces device
  /// memory through host buffers.
  bool registers(memory_kind k) const noexcept {
    return k == memory_kind::host || (dmabuf_ok_ && static_cast<bool>(opt_.dmabuf_export));
  }

  /// Device, port and addressing, queue pair sizes, largest write, dma-buf support: one line.
  std::string describe() const {
    return "verbs device " + device_ + " port " + std::to_string(port_) + " (" +
           (ethernet_ ? "RoCE" : "InfiniBand") + (use_gid_ ? ", GID index " + std::to_string(gid_index_) : ", LID " + std::to_string(lid_)) +
           "), RC queue pairs to " + std::to_string(size_) + " ranks (" + std::to_string(send_depth_) + " sends, " +
           std::to_string(recv_depth_) + " receives each, a completion every " + std::to_string(signal_every_) +
           "), writes of at most " + std::to_string(chunk_) + " bytes, dma-buf registration " + (dmabuf_ok_ ? "yes" : "no");
  }
  const std::string& device() const noexcept { return device_; }
  int port() const noexcept { return port_; }
  std::size_t max_put_bytes() const noexcept { return chunk_; }
  rank_t rank() const noexcept { return rank_; }
  rank_t size() const noexcept { return size_; }

  /// Registers host memory [p, p + n) for local and remote writes (ibv_reg_mr). An empty region
  /// needs no registration. Throws fasta2a::error if p is null while n > 0 or ibv_reg_mr fails.
  memory register_memory(void* p, std::size_t n) {
    if (p == nullptr && n > 0) throw error("verbs_transport::register_memory: null pointer for " + std::to_string(n) + " bytes");
    memory m{static_cast<std::byte*>(p), n, nullptr, 0, 0};
    if (n == 0) return m;
    ibv_mr* mr = ibv_reg_mr(pd_, p, n, access);
    if (mr == nullptr) throw error("verbs_transport: ibv_reg_mr of " + std::to_string(n) + " bytes failed: " + detail::ib_errno(errno));
    m.mr = mr;
    m.local = mr->lkey;
    m.key = mr->rkey;
    return m;
  }
  /// Registers [p, p + n) of memory of kind k: host memory as above; device memory through a
  /// dma-buf fd from verbs_options::dmabuf_export (which knows the device: the last argument, the
  /// device ordinal, is there so that every RDMA transport takes the same call). Throws
  /// fasta2a::error if `registers(k)` is false, the export fails or ibv_reg_dmabuf_mr does.
  memory register_memory(void* p, std::size_t n, memory_kind k, int /*device*/ = 0) {
    if (k == memory_kind::host) return register_memory(p, n);
    if (!registers(k))
      throw error(std::string("verbs_transport::register_memory: cannot register ") + to_string(k) + " memory on " + device_ +
                  (dmabuf_ok_ ? ": verbs_options::dmabuf_export is not set" : ": the device or driver takes no dma-buf registrations") +
                  "; bounce it through host memory");
    if (n == 0) return memory{static_cast<std::byte*>(p), 0, nullptr, 0, 0};
    std::uint64_t offset = 0;
    const int fd = opt_.dmabuf_export(p, n, &offset);
    if (fd < 0) throw error("verbs_transport::register_memory: dmabuf_export gave no fd for " + std::to_string(n) + " bytes of " + to_string(k) + " memory");
    try {
      memory m = register_dmabuf(p, n, fd, offset);
      ::close(fd);
      return m;
    } catch (...) {
      ::close(fd);
      throw;
    }
  }
  /// Registers device memory [p, p + n), exported by its driver as dma-buf `fd` at `offset`
  /// (ibv_reg_dmabuf_mr, iova p: peers address it by p as host memory). The caller keeps and
  /// closes fd (the registration holds its own reference).
  memory register_dmabuf(void* p, std::size_t n, int fd, std::uint64_t offset) {
    if (p == nullptr && n > 0) throw error("verbs_transport::register_dmabuf: null pointer for " + std::to_string(n) + " bytes");
    memory m{static_cast<std::byte*>(p), n, nullptr, 0, 0};
    if (n == 0) return m;
    ibv_mr* mr = ibv_reg_dmabuf_mr(pd_, offset, n, static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(p)), fd, access);
    if (mr == nullptr)
      throw error("verbs_transport: ibv_reg_dmabuf_mr of " + std::to_string(n) + " bytes (fd " + std::to_string(fd) +
                  ", offset " + std::to_string(offset) + ") failed: " + detail::ib_errno(errno));
    m.mr = mr;
    m.local = mr->lkey;
    m.key = mr->rkey;
    return m;
  }
  /// Deregistration invalidates the rkey: a peer's late RDMA write fails at the NIC (remote access
  /// error on the peer's queue pair) instead of landing. Never run here (no RDMA device).
  static constexpr bool late_writes_revoked = true;
  /// Deregisters (ibv_dereg_mr). Safe on an empty or already deregistered memory.
  void deregister(memory& m) {
    if (m.mr != nullptr) {
      const int rc = ibv_dereg_mr(m.mr);
      m.mr = nullptr;
      if (rc != 0) throw error("verbs_transport: ibv_dereg_mr failed: " + detail::ib_errno(rc));
    }
  }

  std::vector<std::byte> serialize(const memory& m) const {
    return rma::serialize_handle(static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(m.ptr)), m.key, m.size);
  }
  remote deserialize(rank_t peer, std::span<const std::byte> blob) const {
    return rma::deserialize_handle("verbs_transport", peer, size_, blob);
  }
  /// Nothing was opened for a remote region.
  void forget(remote&) const noexcept {}

  /// A connection with its own counters for channels [0, channels) (at most 256; at most 4096
  /// connections over the transport's life: the immediate's fields). Every rank makes its
  /// connections in the same order. Signals arriving for a connection not yet made are kept.
  connection connect(channel_id channels) {
    const std::uint32_t id = conns_.make(channels);
    if (last_wr_.size() <= id) last_wr_.resize(id + 1);
    last_wr_[id].assign(static_cast<std::size_t>(size_), 0);
    return connection(this, id);
  }

private:
  friend connection;
  static constexpr rank_t max_ranks = rank_t{1} << 23;    ///< the peer field of a work request id
  static constexpr unsigned seq_bits = 40;                 ///< the sequence field of a work request id
  static constexpr std::uint64_t recv_flag = std::uint64_t{1} << 63;
  static constexpr int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;

  struct lane {
    rma::signal_track signals;
  };
  enum class wr_kind : std::uint8_t { put, signal, flush };
  /// A work request in flight, for error messages.
  struct wr_info {
    std::uint64_t seq;
    wr_kind kind;
    std::uint32_t conn;
    channel_id ch;
  };
  /// The queue pair to one rank: its send queue's watermark (cumulative completions).
  struct peer_qp {
    ibv_qp* qp = nullptr;
    std::uint32_t psn = 0;
    rma::watermark wrs;
    std::uint64_t last_signalled = 0;
    unsigned since_signal = 0;
    std::deque<wr_info> info; ///< work requests past wrs.done(), in order
  };

  // --------------------------------------------------------------------------------------------
  // Opening, connecting, closing
  // --------------------------------------------------------------------------------------------

  void open() {
    std::string why;
    detail::ib_opened o = detail::ib_open(opt_.device, opt_.port, &why);
    if (o.ctx == nullptr) throw error("verbs_transport: " + why);
    ctx_ = o.ctx;
    device_ = o.name;
    port_ = o.port;
    port_attr_ = o.port_attr;
    ethernet_ = port_attr_.link_layer == IBV_LINK_LAYER_ETHERNET;
    lid_ = port_attr_.lid;
    const int gid_env = detail::ib_int_setting(opt_.gid_index, true, "FASTA2A_IB_GID_INDEX", -1);
    use_gid_ = ethernet_ || gid_env >= 0;
    gid_index_ = gid_env >= 0 ? gid_env : 0;
    if (use_gid_) {
      if (gid_index_ >= port_attr_.gid_tbl_len)
        throw error("verbs_transport: GID index " + std::to_string(gid_index_) + " on " + device_ + " port " +
                    std::to_string(port_) + ", which has " + std::to_string(port_attr_.gid_tbl_len) + " GIDs");
      if (const int rc = ibv_query_gid(ctx_, static_cast<std::uint8_t>(port_), gid_index_, &gid_); rc != 0)
        throw error("verbs_transport: ibv_query_gid (index " + std::to_string(gid_index_) + ") failed: " + detail::ib_errno(rc));
    }
    ibv_device_attr dev{};
    if (const int rc = ibv_query_device(ctx_, &dev); rc != 0) throw error("verbs_transport: ibv_query_device failed: " + detail::ib_errno(rc));
    send_depth_ = std::max(2u, std::min<unsigned>(opt_.send_depth, static_cast<unsigned>(dev.max_qp_wr)));
    recv_depth_ = std::max(1u, std::min<unsigned>(opt_.recv_depth, static_cast<unsigned>(dev.max_qp_wr)));
    signal_every_ = std::clamp(opt_.signal_every, 1u, send_depth_ / 2);
    chunk_ = port_attr_.max_msg_sz;
    if (opt_.max_put_bytes > 0) chunk_ = std::min(chunk_, opt_.max_put_bytes);
    if (chunk_ == 0) throw error("verbs_transport: " + device_ + " port " + std::to_string(port_) + " reports max_msg_sz 0");

    pd_ = ibv_alloc_pd(ctx_);
    if (pd_ == nullptr) throw error("verbs_transport: ibv_alloc_pd failed: " + detail::ib_errno(errno));
    // Every send (signals always ask for a completion, so a burst of them may all be signalled)
    // and every receive of every queue pair may sit in the queue at once.
    const std::uint64_t cqe = static_cast<std::uint64_t>(size_) * (send_depth_ + recv_depth_);
    if (cqe > static_cast<std::uint64_t>(dev.max_cqe))
      throw error("verbs_transport: " + std::to_string(size_) + " queue pairs need " + std::to_string(cqe) +
                  " completion queue entries, " + device_ + " offers " + std::to_string(dev.max_cqe) +
                  " (lower verbs_options::recv_depth or send_depth)");
    cq_ = ibv_create_cq(ctx_, static_cast<int>(cqe), nullptr, nullptr, 0);
    if (cq_ == nullptr) throw error("verbs_transport: ibv_create_cq of " + std::to_string(cqe) + " entries failed: " + detail::ib_errno(errno));
    landing_ = register_memory(landing_bytes_.data(), landing_bytes_.size());
    dmabuf_ok_ = probe_dmabuf();

    std::mt19937 rng(std::random_device{}() ^ static_cast<std::uint32_t>(rank_));
    qps_.resize(static_cast<std::size_t>(size_));
    for (rank_t r = 0; r < size_; ++r) {
      peer_qp& q = qps_[static_cast<std::size_t>(r)];
      ibv_qp_init_attr init{};
      init.send_cq = cq_;
      init.recv_cq = cq_;
      init.cap.max_send_wr = send_depth_;
      init.cap.max_recv_wr = recv_depth_;
      init.cap.max_send_sge = 1;
      init.cap.max_recv_sge = 1;
      init.qp_type = IBV_QPT_RC;
      init.sq_sig_all = 0;
      q.qp = ibv_create_qp(pd_, &init);
      if (q.qp == nullptr) throw error("verbs_transport: ibv_create_qp (to rank " + std::to_string(r) + ") failed: " + detail::ib_errno(errno));
      q.psn = rng() & 0xFFFFFF;
      ibv_qp_attr a{};
      a.qp_state = IBV_QPS_INIT;
      a.pkey_index = 0;
      a.port_num = static_cast<std::uint8_t>(port_);
      a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE;
      modify(r, a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, "INIT");
      for (unsigned k = 0; k < recv_depth_; ++k) post_recv(r);
    }
  }

  /// Whether the device and driver take dma-buf registrations: with an fd that is not one, a
  /// provider without support answers EOPNOTSUPP or EPROTONOSUPPORT (or the library ENOSYS),
  /// one with support EBADF or similar.
  bool probe_dmabuf() {
    errno = 0;
    ibv_mr* mr = ibv_reg_dmabuf_mr(pd_, 0, 4096, 0, -1, access);
    if (mr != nullptr) {
      ibv_dereg_mr(mr);
      return true;
    }
    const int e = errno;
    return e != EOPNOTSUPP && e != EPROTONOSUPPORT && e != ENOSYS && e != 0;
  }

  void modify(rank_t r, ibv_qp_attr& a, int mask, const char* state) {
    if (const int rc = ibv_modify_qp(qps_[static_cast<std::size_t>(r)].qp, &a, mask); rc != 0)
      throw error(std::string("verbs_transport: ibv_modify_qp to ") + state + " (queue pair to rank " + std::to_string(r) +
                  ") failed: " + detail::ib_errno(rc));
  }

  /// What every rank tells every other: its port's addressing, its signal landing region, and
  /// per rank the number and first PSN of the queue pair it made for that rank.
  struct header {
    std::uint32_t magic;
    std::uint16_t lid;
    std::uint8_t ethernet, use_gid;
    std::uint8_t gid[16];
    std::uint64_t landing_addr;
    std::uint32_t landing_rkey;
    std::uint32_t mtu;
  };
  static constexpr std::uint32_t magic = 0xFA2A1B01u;

  template <class B>
  void exchange(B& boot) {
    const std::size_t blob = sizeof(header) + 8 * static_cast<std::size_t>(size_);
    std::vector<std::byte> mine(blob), all(blob * static_cast<std::size_t>(size_));
    header h{};
    h.magic = magic;
    h.lid = lid_;
    h.ethernet = ethernet_;
    h.use_gid = use_gid_;
    std::memcpy(h.gid, gid_.raw, 16);
    h.landing_addr = static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(landing_.ptr));
    h.landing_rkey = static_cast<std::uint32_t>(landing_.key);
    h.mtu = static_cast<std::uint32_t>(port_attr_.active_mtu);
    std::memcpy(mine.data(), &h, sizeof h);
    for (rank_t r = 0; r < size_; ++r) {
      const std::uint32_t w[2] = {qps_[static_cast<std::size_t>(r)].qp->qp_num, qps_[static_cast<std::size_t>(r)].psn};
      std::memcpy(mine.data() + sizeof(header) + 8 * static_cast<std::size_t>(r), w, 8);
    }
    boot.allgather(std::span<const std::byte>(mine), std::span<std::byte>(all));
    landings_.resize(static_cast<std::size_t>(size_));
    for (rank_t r = 0; r < size_; ++r) {
      const std::byte* b = all.data() + blob * static_cast<std::size_t>(r);
      header t{};
      std::memcpy(&t, b, sizeof t);
      std::uint32_t w[2];
      std::memcpy(w, b + sizeof(header) + 8 * static_cast<std::size_t>(rank_), 8);
      if (t.magic != magic) throw error("verbs_transport: rank " + std::to_string(r) + " sent no verbs address (another transport or version?)");
      if (t.ethernet != h.ethernet || t.use_gid != h.use_gid)
        throw error("verbs_transport: rank " + std::to_string(r) + "'s port is " + (t.ethernet ? "Ethernet (RoCE)" : "InfiniBand") +
                    (t.use_gid ? " addressed by GID" : " addressed by LID") + ", rank " + std::to_string(rank_) + "'s " +
                    (h.ethernet ? "Ethernet (RoCE)" : "InfiniBand") + (h.use_gid ? " addressed by GID" : " addressed by LID") +
                    ": every rank must use the same kind of port and FASTA2A_IB_GID_INDEX setting");
      landings_[static_cast<std::size_t>(r)] = remote{t.landing_addr, t.landing_rkey, landing_bytes_.size(), r};
      ibv_qp_attr a{};
      a.qp_state = IBV_QPS_RTR;
      a.path_mtu = static_cast<ibv_mtu>(std::min(t.mtu, h.mtu));
      a.dest_qp_num = w[0];
      a.rq_psn = w[1];
      a.max_dest_rd_atomic = 1;
      a.min_rnr_timer = 12;
      a.ah_attr.dlid = t.lid;
      a.ah_attr.sl = opt_.service_level;
      a.ah_attr.port_num = static_cast<std::uint8_t>(port_);
      if (use_gid_) {
        a.ah_attr.is_global = 1;
        std::memcpy(a.ah_attr.grh.dgid.raw, t.gid, 16);
        a.ah_attr.grh.sgid_index = static_cast<std::uint8_t>(gid_index_);
        a.ah_attr.grh.hop_limit = 64;
      }
      modify(r, a,
             IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
                 IBV_QP_MIN_RNR_TIMER,
             "RTR");
      ibv_qp_attr s{};
      s.qp_state = IBV_QPS_RTS;
      s.timeout = opt_.ack_timeout;
      s.retry_cnt = opt_.retry_count;
      s.rnr_retry = 7; // receives are reposted as immediates are read: retry without limit
      s.sq_psn = qps_[static_cast<std::size_t>(r)].psn;
      s.max_rd_atomic = 1;
      modify(r, s, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC, "RTS");
    }
    // Nobody writes before every queue pair can receive.
    boot.allgather({}, {});
  }

  void close() noexcept {
    for (peer_qp& q : qps_)
      if (q.qp) ibv_destroy_qp(q.qp);
    qps_.clear();
    if (landing_.mr) ibv_dereg_mr(landing_.mr);
    landing_.mr = nullptr;
    if (cq_) ibv_destroy_cq(cq_);
    if (pd_) ibv_dealloc_pd(pd_); // fails (EBUSY) while registrations remain: they are the caller's
    if (ctx_) ibv_close_device(ctx_);
    cq_ = nullptr;
    pd_ = nullptr;
    ctx_ = nullptr;
  }

  // --------------------------------------------------------------------------------------------
  // Work requests
  // --------------------------------------------------------------------------------------------

  static const char* kind_name(wr_kind k) noexcept {
    switch (k) {
    case wr_kind::put: return "a put";
    case wr_kind::signal: return "a signal";
    case wr_kind::flush: return "a flush";
    }
    return "a work request";
  }

  void post_recv(rank_t r) {
    ibv_recv_wr wr{};
    wr.wr_id = recv_flag | static_cast<std::uint64_t>(r);
    wr.sg_list = nullptr;
    wr.num_sge = 0; // an immediate needs no buffer
    ibv_recv_wr* bad = nullptr;
    if (const int rc = ibv_post_recv(qps_[static_cast<std::size_t>(r)].qp, &wr, &bad); rc != 0)
      throw error("verbs_transport: ibv_post_recv (queue pair to rank " + std::to_string(r) + ") failed: " + detail::ib_errno(rc));
  }

  /// Posts one send work request to `peer`, waiting (polling, up to the timeout) for room in its
  /// send queue; asks for a completion every signal_every-th request or with `signalled`.
  /// Returns its number on that queue pair.
  std::uint64_t post_send(rank_t peer, ibv_send_wr& wr, wr_kind kind, std::uint32_t conn, channel_id ch, bool signalled) {
    peer_qp& q = qps_[static_cast<std::size_t>(peer)];
    if (q.wrs.posted() - q.wrs.done() >= send_depth_ &&
        !detail::poll_until([&] { progress(); return q.wrs.posted() - q.wrs.done() < send_depth_; }, opt_.waiting, opt_.timeout))
      throw error(std::string("verbs_transport: ") + kind_name(kind) + " to rank " + std::to_string(peer) + " on channel " +
                  std::to_string(ch) + ": the send queue stayed full for " + std::to_string(opt_.timeout.count()) +
                  " ms (no completions from rank " + std::to_string(peer) + ")");
    const std::uint64_t seq = q.wrs.next();
    if (seq >> seq_bits) throw error("verbs_transport: more than 2^40 work requests to rank " + std::to_string(peer));
    const bool sig = signalled || q.since_signal + 1 >= signal_every_;
    wr.wr_id = (static_cast<std::uint64_t>(peer) << seq_bits) | seq;
    wr.send_flags = sig ? static_cast<unsigned>(IBV_SEND_SIGNALED) : 0u;
    wr.next = nullptr;
    ibv_send_wr* bad = nullptr;
    if (const int rc = ibv_post_send(q.qp, &wr, &bad); rc != 0)
      throw error(std::string("verbs_transport: ibv_post_send (") + kind_name(kind) + " to rank " + std::to_string(peer) +
                  " on channel " + std::to_string(ch) + ") failed: " + detail::ib_errno(rc));
    q.wrs.post();
    q.info.push_back({seq, kind, conn, ch});
    if (sig) {
      q.since_signal = 0;
      q.last_signalled = seq;
    } else {
      ++q.since_signal;
    }
    return seq;
  }

  void put(std::uint32_t id, rank_t peer, const memory& src, std::size_t src_off, const remote& dst, std::size_t dst_off,
           std::size_t n, channel_id ch) {
    check(id, peer, ch, "put");
    if (n == 0) return;
    rma::check_put_bounds("verbs_transport", peer, src_off, src.size, dst_off, dst.size, n);
    rma::for_each_chunk(n, chunk_, [&](std::size_t off, std::size_t len) {
      ibv_sge sge{};
      sge.addr = static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(src.ptr + src_off + off));
      sge.length = static_cast<std::uint32_t>(len);
      sge.lkey = src.local;
      ibv_send_wr wr{};
      wr.opcode = IBV_WR_RDMA_WRITE;
      wr.sg_list = &sge;
      wr.num_sge = 1;
      wr.wr.rdma.remote_addr = dst.addr + dst_off + off;
      wr.wr.rdma.rkey = static_cast<std::uint32_t>(dst.key);
      last_wr_[id][static_cast<std::size_t>(peer)] = post_send(peer, wr, wr_kind::put, id, ch, false);
    });
  }

  void signal(std::uint32_t id, rank_t peer, channel_id ch) {
    check(id, peer, ch, "signal");
    rma::signal_track& s = conns_.lane_of(id, peer, ch).signals;
    const remote& land = landings_[static_cast<std::size_t>(peer)];
    ibv_send_wr wr{};
    wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    wr.sg_list = nullptr;
    wr.num_sge = 0;
    wr.imm_data = htonl(rma::imm32::encode(id, ch, s.signals() + 1));
    wr.wr.rdma.remote_addr = land.addr;
    wr.wr.rdma.rkey = static_cast<std::uint32_t>(land.key);
    // RC places it after every write posted before it on this queue pair; it asks for a
    // completion, which says those writes have completed too (`sent`).
    const std::uint64_t seq = post_send(peer, wr, wr_kind::signal, id, ch, true);
    s.add(seq, true, qps_[static_cast<std::size_t>(peer)].wrs.done());
    last_wr_[id][static_cast<std::size_t>(peer)] = seq;
  }

  /// A zero-byte write that asks for a completion, so that the queue pair's last work request
  /// is covered by one (selective signalling leaves the tail unreported otherwise).
  void post_flush(rank_t peer) {
    const remote& land = landings_[static_cast<std::size_t>(peer)];
    ibv_send_wr wr{};
    wr.opcode = IBV_WR_RDMA_WRITE;
    wr.sg_list = nullptr;
    wr.num_sge = 0;
    wr.wr.rdma.remote_addr = land.addr;
    wr.wr.rdma.rkey = static_cast<std::uint32_t>(land.key);
    post_send(peer, wr, wr_kind::flush, 0, 0, true);
  }

  /// Every queue pair whose last work request asks for no completion gets one that does.
  void ensure_completions() {
    for (rank_t r = 0; r < size_ && static_cast<std::size_t>(r) < qps_.size(); ++r) {
      const peer_qp& q = qps_[static_cast<std::size_t>(r)];
      if (q.qp != nullptr && q.last_signalled < q.wrs.posted() && q.wrs.done() < q.wrs.posted()) post_flush(r);
    }
  }

  // --------------------------------------------------------------------------------------------
  // Completions
  // --------------------------------------------------------------------------------------------

  /// Polls the completion queue: immediates count signals (and their receives are reposted),
  /// send completions advance their queue pair's watermark and settle its lanes' signals.
  void progress() {
    ibv_wc wc[32];
    for (;;) {
      const int n = ibv_poll_cq(cq_, 32, wc);
      if (n < 0) throw error("verbs_transport: ibv_poll_cq failed (" + std::to_string(n) + ")");
      for (int k = 0; k < n; ++k) handle(wc[k]);
      if (n < 32) break;
    }
  }

  void handle(const ibv_wc& wc) {
    if (wc.status != IBV_WC_SUCCESS) fail(wc);
    if (wc.wr_id & recv_flag) {
      const auto peer = static_cast<rank_t>(wc.wr_id & ~recv_flag);
      if (wc.opcode != IBV_WC_RECV_RDMA_WITH_IMM || !(wc.wc_flags & IBV_WC_WITH_IMM))
        throw error("verbs_transport: a receive from rank " + std::to_string(peer) + " completed with opcode " +
                    std::to_string(static_cast<int>(wc.opcode)) + ", not an RDMA write with immediate");
      const rma::signal_fields f = rma::imm32::decode(ntohl(wc.imm_data), peer);
      const std::uint64_t count = conns_.arrive(f.conn, peer, f.ch);
      if (rma::imm32::seq_of(count) != f.seq)
        throw error("verbs_transport: signal " + std::to_string(count) + " from rank " + std::to_string(peer) + " on channel " +
                    std::to_string(f.ch) + " of connection " + std::to_string(f.conn) + " carries sequence " +
                    std::to_string(f.seq) + ", expected " + std::to_string(rma::imm32::seq_of(count)) +
                    " (a signal lost or delivered twice)");
      post_recv(peer);
      return;
    }
    const auto peer = static_cast<rank_t>(wc.wr_id >> seq_bits);
    const std::uint64_t seq = wc.wr_id & ((std::uint64_t{1} << seq_bits) - 1);
    peer_qp& q = qps_[static_cast<std::size_t>(peer)];
    q.wrs.complete_upto(seq);
    while (!q.info.empty() && q.info.front().seq <= q.wrs.done()) q.info.pop_front();
    for (std::uint32_t id = 0; id < conns_.made(); ++id) {
      auto& c = conns_.at(id);
      for (channel_id ch = 0; ch < c.channels; ++ch) conns_.lane_of(id, peer, ch).signals.settle(q.wrs.done());
    }
  }

  [[noreturn]] void fail(const ibv_wc& wc) {
    std::string what;
    if (wc.wr_id & recv_flag) {
      what = "a receive for signals from rank " + std::to_string(static_cast<rank_t>(wc.wr_id & ~recv_flag));
    } else {
      const auto peer = static_cast<rank_t>(wc.wr_id >> seq_bits);
      const std::uint64_t seq = wc.wr_id & ((std::uint64_t{1} << seq_bits) - 1);
      what = "a work request to rank " + std::to_string(peer);
      if (peer >= 0 && peer < size_)
        for (const wr_info& i : qps_[static_cast<std::size_t>(peer)].info)
          if (i.seq == seq) {
            what = std::string(kind_name(i.kind)) + " to rank " + std::to_string(peer) + " on channel " + std::to_string(i.ch) +
                   " of connection " + std::to_string(i.conn);
            break;
          }
    }
    throw error("verbs_transport: " + what + " failed: " + ibv_wc_status_str(wc.status) + " (status " +
                std::to_string(static_cast<int>(wc.status)) + ", vendor error " + std::to_string(wc.vendor_err) + ")");
  }

  void check(std::uint32_t id, rank_t peer, channel_id ch, const char* what) const { conns_.check(id, peer, ch, what); }

  bool conn_done(std::uint32_t id) const {
    for (std::size_t r = 0; r < qps_.size(); ++r)
      if (qps_[r].wrs.done() < last_wr_[id][r]) return false;
    return true;
  }
  bool all_done() const {
    for (const peer_qp& q : qps_)
      if (!q.wrs.idle()) return false;
    return true;
  }
  std::string pending_peers() const {
    std::string s;
    for (std::size_t r = 0; r < qps_.size(); ++r)
      if (!qps_[r].wrs.idle()) s += (s.empty() ? "rank " : ", rank ") + std::to_string(r);
    return s.empty() ? "no rank" : s;
  }

  void flush(std::uint32_t id) {
    for (std::size_t r = 0; r < qps_.size(); ++r) {
      const peer_qp& q = qps_[r];
      if (q.wrs.done() < last_wr_[id][r] && q.last_signalled < last_wr_[id][r]) post_flush(static_cast<rank_t>(r));
    }
    if (!detail::poll_until([&] { progress(); return conn_done(id); }, opt_.waiting, opt_.timeout)) {
      std::string who;
      for (std::size_t r = 0; r < qps_.size(); ++r)
        if (qps_[r].wrs.done() < last_wr_[id][r]) who += (who.empty() ? "rank " : ", rank ") + std::to_string(r);
      throw timeout_error("verbs_transport::flush: work requests of connection " + std::to_string(id) + " on rank " +
                  std::to_string(rank_) + " to " + who + " did not complete within " + std::to_string(opt_.timeout.count()) + " ms");
    }
  }

  verbs_options opt_;
  rank_t rank_, size_;
  rma::connection_table<lane> conns_;
  std::string device_;
  int port_ = 0;
  ibv_port_attr port_attr_{};
  bool ethernet_ = false, use_gid_ = false, dmabuf_ok_ = false;
  std::uint16_t lid_ = 0;
  int gid_index_ = 0;
  ibv_gid gid_{};
  unsigned send_depth_ = 0, recv_depth_ = 0, signal_every_ = 1;
  std::size_t chunk_ = 0;
  ibv_context* ctx_ = nullptr;
  ibv_pd* pd_ = nullptr;
  ibv_cq* cq_ = nullptr;
  std::vector<peer_qp> qps_;                      ///< by rank (this rank's own connected to itself)
  std::array<std::byte, 8> landing_bytes_{};      ///< what signals (zero-byte writes) target
  memory landing_;
  std::vector<remote> landings_;                  ///< every rank's landing region
  std::vector<std::vector<std::uint64_t>> last_wr_; ///< [connection][rank] its last work request there
};

static_assert(Transport<verbs_transport>);

} // namespace fasta2a
