// fasta2a_torch._C: fasta2a as a torch.distributed (c10d) backend, and the Group object for
// runtimes that own their buffers. The Python package (fasta2a_torch/__init__.py) registers the
// backend and checks the topology; this file moves the tensors' bytes with fasta2a's engine.
//
// torch releases the GIL before it calls a backend's collective, and the bindings below release it
// before blocking: nothing here touches Python objects.
#include "communicator.hpp"

#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

namespace fasta2a_torch {
namespace {

namespace py = pybind11;

/// A c10d Work that the communicator's thread completes.
class work final : public c10d::Work {
public:
  work(int rank, c10d::OpType op, std::vector<at::Tensor> outputs)
      : c10d::Work(rank, op), outputs_(std::move(outputs)),
        future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

  void complete(std::exception_ptr e) {
    if (e) future_->setError(e);
    else future_->markCompleted(c10::IValue(outputs_));
    finish(e);
  }
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

std::string shape_text(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + "]";
}

/// What one all_to_all_single moves, in bytes, checked before anything moves.
struct a2a_args {
  at::Tensor send;  // contiguous input (the caller's, or a copy)
  at::Tensor recv;  // contiguous output (the caller's, or a temporary copied back)
  at::Tensor out;   // the caller's output
  bool copy_back = false;
  std::vector<std::uint64_t> send_counts, send_displs, recv_counts, recv_displs;
};

/// Bytes per row (dimension 0) of t: the product of its other dimensions times its element size.
std::uint64_t row_bytes(const at::Tensor& t) {
  std::uint64_t r = t.element_size();
  for (int64_t d = 1; d < t.dim(); ++d) r *= static_cast<std::uint64_t>(t.size(d));
  return r;
}

/// Split sizes (rows) as byte counts and packed displacements; `splits` empty means equal splits.
void counts_of(const at::Tensor& t, const std::vector<int64_t>& splits, int n, const char* which,
               std::vector<std::uint64_t>& counts, std::vector<std::uint64_t>& displs) {
  const int64_t rows = t.size(0);
  std::vector<int64_t> s = splits;
  if (s.empty()) {
    TORCH_CHECK_VALUE(rows % n == 0, "fasta2a: ", which, " tensor's first dimension ", rows,
                      " cannot be split equally among ", n, " ranks (pass ", which, "_split_sizes)");
    s.assign(static_cast<std::size_t>(n), rows / n);
  }
  TORCH_CHECK_VALUE(static_cast<int>(s.size()) == n, "fasta2a: ", s.size(), " ", which, " split sizes for a group of ",
                    n, " ranks");
  int64_t sum = 0;
  for (std::size_t j = 0; j < s.size(); ++j) {
    TORCH_CHECK_VALUE(s[j] >= 0, "fasta2a: ", which, " split size ", j, " is negative (", s[j], ")");
    TORCH_CHECK_VALUE(s[j] <= rows - sum, "fasta2a: ", which, " split sizes sum past the ", which,
                      " tensor's first dimension ", rows, " (at split ", j, ")");
    sum += s[j];
  }
  TORCH_CHECK_VALUE(sum == rows, "fasta2a: ", which, " split sizes sum to ", sum, " but the ", which,
                    " tensor's first dimension is ", rows, " (shape ", shape_text(t), ")");
  const std::uint64_t rb = row_bytes(t);
  counts.resize(s.size());
  displs.resize(s.size());
  std::uint64_t at = 0;
  for (std::size_t j = 0; j < s.size(); ++j) {
    counts[j] = static_cast<std::uint64_t>(s[j]) * rb;
    displs[j] = at;
    at += counts[j];
  }
}

a2a_args check_alltoall(at::Tensor& out, at::Tensor& in, const std::vector<int64_t>& out_splits,
                        const std::vector<int64_t>& in_splits, int n) {
  TORCH_CHECK_VALUE(in.dim() >= 1 && out.dim() >= 1, "fasta2a: all_to_all_single needs tensors of at least one dimension "
                    "(input ", shape_text(in), ", output ", shape_text(out), ")");
  TORCH_CHECK_VALUE(in.scalar_type() == out.scalar_type(), "fasta2a: input dtype ", in.scalar_type(),
                    " and output dtype ", out.scalar_type(), " differ");
  TORCH_CHECK_VALUE(in.device() == out.device(), "fasta2a: input on ", in.device(), " and output on ", out.device());
  TORCH_CHECK(in.device().is_cpu(), "fasta2a: tensors on ", in.device(),
              " are served by fasta2a_torch.Group's stream-ordered calls, not yet by the c10d backend; "
              "this build moves CPU tensors");
  TORCH_CHECK_VALUE(row_bytes(in) == row_bytes(out), "fasta2a: a row of the input (shape ", shape_text(in),
                    ") and of the output (shape ", shape_text(out), ") differ in size");
  a2a_args a;
  counts_of(in, in_splits, n, "input", a.send_counts, a.send_displs);
  counts_of(out, out_splits, n, "output", a.recv_counts, a.recv_displs);
  a.send = in.contiguous();
  a.out = out;
  if (out.is_contiguous()) {
    a.recv = out;
  } else {
    a.recv = at::empty(out.sizes(), out.options());
    a.copy_back = true;
  }
  return a;
}

/// check_alltoall, and where it raises, the refusal that tells every other rank (communicator::refuse)
/// queued before the error reaches the caller: nothing hangs waiting for this rank.
a2a_args checked_or_refused(communicator& c, at::Tensor& out, at::Tensor& in, const std::vector<int64_t>& out_splits,
                            const std::vector<int64_t>& in_splits) {
  try {
    return check_alltoall(out, in, out_splits, in_splits, c.size());
  } catch (...) {
    communicator* p = &c;
    c.submit([p] { p->refuse(); });
    throw;
  }
}

std::span<const std::byte> bytes_of(const at::Tensor& t) {
  return {static_cast<const std::byte*>(t.data_ptr()), static_cast<std::size_t>(t.numel()) * t.element_size()};
}
std::span<std::byte> writable_bytes_of(const at::Tensor& t) {
  return {static_cast<std::byte*>(t.data_ptr()), static_cast<std::size_t>(t.numel()) * t.element_size()};
}

/// The operation that runs an a2a_args on the communicator's thread.
std::function<void()> alltoall_op(communicator* c, a2a_args a) {
  return [c, a = std::move(a)]() mutable {
    c->alltoallv(bytes_of(a.send), a.send_counts, a.send_displs, writable_bytes_of(a.recv), a.recv_counts,
                 a.recv_displs);
    if (a.copy_back) a.out.copy_(a.recv);
  };
}

std::shared_ptr<communicator> make_communicator(const c10::intrusive_ptr<c10d::Store>& store, const comm_config& cfg,
                                                const std::string& root_host) {
  // The secret is published before the address: a rank that reads the address finds it.
  const std::string key = "fasta2a/bootstrap", secret_key = "fasta2a/secret";
  if (cfg.rank == 0) {
    fa::tcp_listener listener = group_listener(root_host);
    const std::string id = listener.id(root_host), secret = new_secret();
    store->set(secret_key, std::vector<uint8_t>(secret.begin(), secret.end()));
    store->set(key, std::vector<uint8_t>(id.begin(), id.end()));
    return std::make_shared<communicator>(cfg, rendezvous{.listener = &listener, .secret = secret});
  }
  store->wait({key}, cfg.timeout);
  const std::vector<uint8_t> v = store->get(key), s = store->get(secret_key);
  return std::make_shared<communicator>(
      cfg, rendezvous{.root_id = std::string(v.begin(), v.end()), .secret = std::string(s.begin(), s.end())});
}

/// The c10d backend "fasta2a": all_to_all_single, all-gathers and barrier on fasta2a's engine and
/// bootstrap; every other collective on an inner gloo group made from the same store.
class process_group final : public c10d::ProcessGroup {
public:
  process_group(std::shared_ptr<communicator> comm, c10::intrusive_ptr<c10d::ProcessGroup> inner)
      : c10d::ProcessGroup(comm->rank(), comm->size()), comm_(std::move(comm)), inner_(std::move(inner)) {}

  const std::string getBackendName() const override { return "fasta2a"; }

  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
                                               std::vector<int64_t>& in_splits,
                                               const c10d::AllToAllOptions& /*opts*/) override {
    a2a_args a = checked_or_refused(*comm_, out, in, out_splits, in_splits);
    auto w = c10::make_intrusive<work>(getRank(), c10d::OpType::ALLTOALL_BASE, std::vector<at::Tensor>{out});
    return submit(w, alltoall_op(comm_.get(), std::move(a)));
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                                 const c10d::AllgatherOptions& /*opts*/) override {
    TORCH_CHECK_VALUE(in.scalar_type() == out.scalar_type(), "fasta2a: _allgather_base: input dtype ", in.scalar_type(),
                      " and output dtype ", out.scalar_type(), " differ");
    TORCH_CHECK(in.device().is_cpu() && out.device().is_cpu(), "fasta2a: _allgather_base moves CPU tensors");
    TORCH_CHECK_VALUE(out.numel() == in.numel() * getSize(), "fasta2a: _allgather_base: output of ", out.numel(),
                      " elements for ", getSize(), " ranks of ", in.numel());
    at::Tensor src = in.contiguous();
    at::Tensor dst = out.is_contiguous() ? out : at::empty(out.sizes(), out.options());
    auto w = c10::make_intrusive<work>(getRank(), c10d::OpType::_ALLGATHER_BASE, std::vector<at::Tensor>{out});
    communicator* c = comm_.get();
    return submit(w, [c, src, dst, out]() mutable {
      c->allgather(bytes_of(src), writable_bytes_of(dst));
      if (!dst.is_same(out)) out.copy_(dst);
    });
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outs, std::vector<at::Tensor>& ins,
                                           const c10d::AllgatherOptions& /*opts*/) override {
    TORCH_CHECK_VALUE(ins.size() == 1 && outs.size() == 1, "fasta2a: allgather takes one input tensor and one list");
    const at::Tensor& in = ins[0];
    std::vector<at::Tensor>& list = outs[0];
    TORCH_CHECK_VALUE(static_cast<int>(list.size()) == getSize(), "fasta2a: allgather into ", list.size(),
                      " tensors for a group of ", getSize());
    TORCH_CHECK(in.device().is_cpu(), "fasta2a: allgather moves CPU tensors");
    for (const at::Tensor& o : list) {
      TORCH_CHECK_VALUE(o.numel() == in.numel() && o.scalar_type() == in.scalar_type(),
                        "fasta2a: allgather: an output tensor (", shape_text(o), ", ", o.scalar_type(),
                        ") differs from the input (", shape_text(in), ", ", in.scalar_type(), ")");
      TORCH_CHECK(o.device().is_cpu(), "fasta2a: allgather moves CPU tensors");
    }
    at::Tensor src = in.contiguous();
    at::Tensor all = at::empty({static_cast<int64_t>(getSize()) * in.numel()}, in.options());
    auto w = c10::make_intrusive<work>(getRank(), c10d::OpType::ALLGATHER, list);
    communicator* c = comm_.get();
    std::vector<at::Tensor> dsts = list;
    return submit(w, [c, src, all, dsts]() mutable {
      c->allgather(bytes_of(src), writable_bytes_of(all));
      const int64_t k = src.numel();
      for (std::size_t r = 0; r < dsts.size(); ++r)
        dsts[r].copy_(all.narrow(0, static_cast<int64_t>(r) * k, k).view(dsts[r].sizes()));
    });
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& /*opts*/) override {
    auto w = c10::make_intrusive<work>(getRank(), c10d::OpType::BARRIER, std::vector<at::Tensor>{});
    communicator* c = comm_.get();
    return submit(w, [c] { c->barrier(); });
  }

  // Everything else: the inner gloo group.
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& t, const c10d::BroadcastOptions& o) override {
    return inner_->broadcast(t, o);
  }
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& t, const c10d::AllreduceOptions& o) override {
    return inner_->allreduce(t, o);
  }
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& t,
                                                     const c10d::AllreduceCoalescedOptions& o) override {
    return inner_->allreduce_coalesced(t, o);
  }
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& t, const c10d::ReduceOptions& o) override {
    return inner_->reduce(t, o);
  }
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& out,
                                                     std::vector<at::Tensor>& in,
                                                     const c10d::AllgatherOptions& o) override {
    return inner_->allgather_coalesced(out, in, o);
  }
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                                        const c10d::GatherOptions& o) override {
    return inner_->gather(out, in, o);
  }
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in,
                                         const c10d::ScatterOptions& o) override {
    return inner_->scatter(out, in, o);
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in,
                                                const c10d::ReduceScatterOptions& o) override {
    return inner_->reduce_scatter(out, in, o);
  }
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                      const c10d::ReduceScatterOptions& o) override {
    return inner_->_reduce_scatter_base(out, in, o);
  }
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                                          const c10d::AllToAllOptions& o) override {
    return inner_->alltoall(out, in, o);
  }
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& t, int dst, int tag) override {
    return inner_->send(t, dst, tag);
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& t, int src, int tag) override {
    return inner_->recv(t, src, tag);
  }
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& t, int tag) override {
    return inner_->recvAnysource(t, tag);
  }
  void monitoredBarrier(const c10d::BarrierOptions& o, bool wait_all_ranks) override {
    inner_->monitoredBarrier(o, wait_all_ranks);
  }
  void setSequenceNumberForGroup() override { inner_->setSequenceNumberForGroup(); }
  uint64_t getSequenceNumberForGroup() override { return inner_->getSequenceNumberForGroup(); }

  communicator& comm() { return *comm_; }
  const c10::intrusive_ptr<c10d::ProcessGroup>& inner() const { return inner_; }

private:
  c10::intrusive_ptr<c10d::Work> submit(const c10::intrusive_ptr<work>& w, std::function<void()> op) {
    auto done = std::make_shared<completion>();
    done->then_ = [w](std::exception_ptr e) { w->complete(e); };
    comm_->submit(std::move(op), done);
    return w;
  }

  std::shared_ptr<communicator> comm_;
  c10::intrusive_ptr<c10d::ProcessGroup> inner_;
};

/// The Group object's engine handle: the same communicator, called synchronously.
class group {
public:
  explicit group(std::shared_ptr<communicator> c) : comm_(std::move(c)) {}

  void all_to_all_single(at::Tensor out, at::Tensor in, std::vector<int64_t> out_splits,
                         std::vector<int64_t> in_splits) {
    a2a_args a = checked_or_refused(*comm_, out, in, out_splits, in_splits);
    comm_->submit(alltoall_op(comm_.get(), std::move(a)))->wait();
  }
  /// Every rank's split sizes: row r of the result is rank r's `splits` (n x n, int64).
  at::Tensor gather_splits(at::Tensor splits) {
    TORCH_CHECK_VALUE(splits.dim() == 1 && splits.size(0) == comm_->size(), "fasta2a: ", comm_->size(),
                      " split sizes expected, got shape ", shape_text(splits));
    at::Tensor mine = splits.to(at::kLong).contiguous();
    at::Tensor all = at::empty({comm_->size(), comm_->size()}, mine.options());
    communicator* c = comm_.get();
    comm_->submit([c, mine, all] { c->allgather(bytes_of(mine), writable_bytes_of(all)); })->wait();
    return all;
  }
  void barrier() {
    communicator* c = comm_.get();
    comm_->submit([c] { c->barrier(); })->wait();
  }
  communicator& comm() { return *comm_; }

private:
  std::shared_ptr<communicator> comm_;
};

py::dict stats_of(communicator& c) {
  const auto s = c.stats();
  py::dict d;
  d["calls"] = s.calls;
  d["plan_s"] = s.last.plan_s;
  d["exchange_s"] = s.last.exchange_s;
  d["execute_s"] = s.last.execute_s;
  d["total_s"] = s.last.total_s;
  d["plan_from"] = std::string(fa::to_string(s.last.plan_from));
  d["recovered"] = s.last.recovered;
  d["puts"] = s.last.puts;
  d["stages"] = c.last_stages();
  d["staging_bytes"] = c.staging_bytes();
  return d;
}

} // namespace
} // namespace fasta2a_torch

PYBIND11_MODULE(_C, m) {
  using namespace fasta2a_torch;
  m.doc() = "fasta2a's c10d backend and Group engine (see the fasta2a_torch package)";
  py::register_exception<fa::timeout_error>(m, "TimeoutError", PyExc_RuntimeError);

  py::class_<process_group, c10d::ProcessGroup, c10::intrusive_ptr<process_group>>(m, "ProcessGroupFasta2a")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, int servers, int gpus,
                       double timeout_s, const std::string& decomposer, const std::string& up,
                       const std::string& out, std::size_t plans_kept, double staging_fraction,
                       const std::string& root_host, const c10::intrusive_ptr<c10d::ProcessGroup>& inner) {
             auto cfg = config_of(rank, size, servers, gpus, timeout_s, decomposer, up, out, plans_kept, staging_fraction);
             return c10::make_intrusive<process_group>(make_communicator(store, cfg, root_host), inner);
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("servers"), py::arg("gpus_per_server"),
           py::arg("timeout_s"), py::arg("decomposer"), py::arg("scaleup_provider"), py::arg("scaleout_provider"),
           py::arg("plans_kept"), py::arg("staging_fraction"), py::arg("root_host"), py::arg("inner"),
           py::call_guard<py::gil_scoped_release>())
      .def("describe", [](process_group& pg) { return pg.comm().describe(); })
      .def("stats", [](process_group& pg) { return stats_of(pg.comm()); })
      .def_property_readonly("inner", [](process_group& pg) { return pg.inner(); });

  py::class_<group>(m, "Engine")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, int servers, int gpus,
                       double timeout_s, const std::string& decomposer, const std::string& up,
                       const std::string& out, std::size_t plans_kept, double staging_fraction,
                       const std::string& root_host) {
             auto cfg = config_of(rank, size, servers, gpus, timeout_s, decomposer, up, out, plans_kept, staging_fraction);
             return std::make_unique<group>(make_communicator(store, cfg, root_host));
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("servers"), py::arg("gpus_per_server"),
           py::arg("timeout_s"), py::arg("decomposer"), py::arg("scaleup_provider"), py::arg("scaleout_provider"),
           py::arg("plans_kept"), py::arg("staging_fraction"), py::arg("root_host"),
           py::call_guard<py::gil_scoped_release>())
      .def("all_to_all_single", &group::all_to_all_single, py::call_guard<py::gil_scoped_release>())
      .def("gather_splits", &group::gather_splits, py::call_guard<py::gil_scoped_release>())
      .def("barrier", &group::barrier, py::call_guard<py::gil_scoped_release>())
      .def("describe", [](group& g) { return g.comm().describe(); })
      .def("stats", [](group& g) { return stats_of(g.comm()); });
}
