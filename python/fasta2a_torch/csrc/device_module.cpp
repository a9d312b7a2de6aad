// fasta2a_torch's device engines: all-to-allv between device buffers, stream-ordered, with the GPU
// IPC transport inside a server and libfabric between servers (device bytes cross through pinned
// host mirrors where the provider cannot register device memory). Buffers and streams come in as
// integers (a tensor's data_ptr(), torch.cuda.current_stream().cuda_stream), so this module needs
// no torch headers: one build serves a CPU-only torch and a CUDA torch alike.
//
// Compiled twice (python/CMakeLists.txt): against the project's stand-in of the GPU runtime
// (FASTA2A_GPU_STANDIN: device memory in POSIX shared memory, streams as threads with random
// delays; the module _device_standin, tested on CPU machines), and against CUDA's runtime (the
// module _device_cuda, where the CUDA toolkit is found; on a machine without a GPU it loads and
// reports no device).
#include <fasta2a/gpu_ipc.hpp>
#include <fasta2a/gpu_memory.hpp>

#include "communicator.hpp"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#ifndef FASTA2A_DEVICE_MODULE
#error "FASTA2A_DEVICE_MODULE names the module (_device_standin, _device_cuda)"
#endif

namespace fasta2a_torch {

using ipc = fa::gpu_ipc_transport<fa::tcp_bootstrap>;

template <>
struct scaleup_of<ipc, fa::gpu_memory> {
  static void make(std::optional<ipc>& up, fa::tcp_bootstrap& boot, fa::gpu_memory& mem, const comm_config& c) {
    up.emplace(boot, mem.shared_stream(), fa::gpu_ipc_options{.node_ranks = c.gpus_per_server});
  }
  static std::string describe() { return std::string("GPU IPC (") + fa::gpu::runtime_name + ")"; }
};

using device_communicator = basic_communicator<ipc, fa::gpu_memory>;

namespace {

namespace py = pybind11;

std::byte* as_pointer(std::uintptr_t p) { return reinterpret_cast<std::byte*>(p); }

fa::gpu::stream_t as_stream(std::uintptr_t s) {
  static_assert(sizeof(fa::gpu::stream_t) == sizeof(std::uintptr_t));
  return reinterpret_cast<fa::gpu::stream_t>(s);
}

std::vector<std::uint64_t> packed(const std::vector<std::uint64_t>& counts, std::uint64_t limit, const char* which) {
  std::vector<std::uint64_t> d(counts.size());
  std::uint64_t at = 0;
  for (std::size_t j = 0; j < counts.size(); ++j) {
    d[j] = at;
    at += counts[j];
  }
  if (at > limit)
    throw fa::error(std::string("fasta2a: the ") + which + " counts sum to " + std::to_string(at) + " bytes, past the " +
                    which + " buffer's " + std::to_string(limit));
  return d;
}

/// One group's device engine, stream-ordered.
class device_engine {
public:
  device_engine(fa::tcp_listener* listener, const std::string& root_id, const std::string& secret, int rank, int size,
                int servers, int gpus, double timeout_s, const std::string& decomposer, const std::string& out,
                std::size_t plans_kept) {
    std::string why;
    if (fa::gpu::device_count(&why) < 1) throw fa::error("fasta2a: no device: " + why);
    // Device memory is scarce: the engine's staging budget (25% of the call's largest buffer).
    const comm_config c = config_of(rank, size, servers, gpus, timeout_s, decomposer, "", out, plans_kept, 0.25);
    comm_ = std::make_unique<device_communicator>(c, rendezvous{.listener = listener, .root_id = root_id, .secret = secret});
  }

  /// Queues an all-to-all of byte counts on `stream`: returns once the counts are exchanged and the
  /// call planned; work enqueued on `stream` later sees every byte received.
  void all_to_all(std::uintptr_t out, std::uint64_t out_bytes, std::uintptr_t in, std::uint64_t in_bytes,
                  const std::vector<std::uint64_t>& out_counts, const std::vector<std::uint64_t>& in_counts,
                  std::uintptr_t stream) {
    const std::vector<std::uint64_t> od = packed(out_counts, out_bytes, "output"), id = packed(in_counts, in_bytes, "input");
    device_communicator* c = comm_.get();
    comm_->submit([=] {
           c->alltoallv_on(std::span<const std::byte>(as_pointer(in), in_bytes), in_counts, id,
                           std::span<std::byte>(as_pointer(out), out_bytes), out_counts, od, as_stream(stream));
         })
        ->wait();
  }
  void synchronize() {
    device_communicator* c = comm_.get();
    comm_->submit([c] { c->synchronize(); })->wait();
  }
  void forget(std::uintptr_t p) {
    device_communicator* c = comm_.get();
    comm_->submit([c, p] { c->forget(as_pointer(p)); })->wait();
  }
  std::string describe() const { return comm_->describe(); }

private:
  std::unique_ptr<device_communicator> comm_;
};

} // namespace
} // namespace fasta2a_torch

PYBIND11_MODULE(FASTA2A_DEVICE_MODULE, m) {
  using namespace fasta2a_torch;
  namespace gpu = fa::gpu;
  m.doc() = "fasta2a's stream-ordered device engine (see fasta2a_torch.DeviceGroup)";
  m.attr("runtime") = gpu::runtime_name;
  m.def("device_count", [] {
    std::string why;
    const int n = gpu::device_count(&why);
    return py::make_tuple(n, why);
  });
  py::class_<fa::tcp_listener>(m, "Listener")
      .def(py::init([](const std::string& host) { return std::make_unique<fa::tcp_listener>(group_listener(host)); }),
           py::arg("host") = "")
      .def("id", &fa::tcp_listener::id, py::arg("host") = "");
  py::class_<device_engine>(m, "Engine")
      .def(py::init<fa::tcp_listener*, const std::string&, const std::string&, int, int, int, int, double,
                    const std::string&, const std::string&, std::size_t>(),
           py::arg("listener").none(true), py::arg("root_id"), py::arg("secret"), py::arg("rank"), py::arg("size"), py::arg("servers"),
           py::arg("gpus_per_server"), py::arg("timeout_s"), py::arg("decomposer"), py::arg("scaleout_provider"),
           py::arg("plans_kept"), py::call_guard<py::gil_scoped_release>())
      .def("all_to_all", &device_engine::all_to_all, py::arg("out_ptr"), py::arg("out_bytes"), py::arg("in_ptr"),
           py::arg("in_bytes"), py::arg("out_counts"), py::arg("in_counts"), py::arg("stream"),
           py::call_guard<py::gil_scoped_release>())
      .def("synchronize", &device_engine::synchronize, py::call_guard<py::gil_scoped_release>())
      .def("forget", &device_engine::forget, py::arg("ptr"), py::call_guard<py::gil_scoped_release>())
      .def("describe", &device_engine::describe);
  // Device memory and streams of the runtime this module was built for: what the stand-in's tests
  // allocate (a torch CUDA tensor brings its own).
  py::class_<gpu::device_buffer>(m, "DeviceBuffer")
      .def(py::init<std::size_t>())
      .def_property_readonly("ptr", [](const gpu::device_buffer& b) { return reinterpret_cast<std::uintptr_t>(b.data()); })
      .def_property_readonly("size", &gpu::device_buffer::size);
  py::class_<gpu::stream>(m, "Stream")
      .def(py::init<>())
      .def_property_readonly("handle", [](const gpu::stream& s) { return reinterpret_cast<std::uintptr_t>(s.get()); })
      .def("synchronize", &gpu::stream::synchronize, py::call_guard<py::gil_scoped_release>());
  m.def(
      "memcpy_async",
      [](std::uintptr_t dst, std::uintptr_t src, std::size_t n, std::uintptr_t stream) {
        gpu::memcpy_async(as_pointer(dst), as_pointer(src), n, as_stream(stream));
      },
      py::arg("dst"), py::arg("src"), py::arg("bytes"), py::arg("stream"));
  m.def(
      "set_standin_delays",
      [](std::uint32_t max_delay_us, std::uint64_t seed) {
#ifdef FASTA2A_GPU_STANDIN
        fa::gpu_standin::settings().max_delay_us = max_delay_us;
        fa::gpu_standin::settings().seed = seed;
        fa::gpu_standin::settings().host_pointers_in_process = false;
#else
        (void)max_delay_us;
        (void)seed;
        throw fa::error("fasta2a: set_standin_delays is for the stand-in runtime only");
#endif
      },
      py::arg("max_delay_us"), py::arg("seed"));
}
