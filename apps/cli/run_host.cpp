// fasta2a CLI: `fasta2a run --transport host`. Executes all-to-allv calls with real bytes through
// the engine, every rank a thread of this process sharing its memory, checks every received byte,
// and measures the calls against direct execution on the same transport.
#include "commands.hpp"
#include "options.hpp"
#include "report.hpp"
#include "run.hpp"
#include "workload.hpp"

#include <fasta2a/cost_model.hpp>
#include <fasta2a/decompose.hpp>
#include <fasta2a/engine.hpp>
#include <fasta2a/host.hpp>
#include <fasta2a/pattern.hpp>
#include <fasta2a/planner.hpp>
#include <fasta2a/registry.hpp>
#include <fasta2a/topology.hpp>
#include <fasta2a/traffic.hpp>

#include <algorithm>
#include <system_error>
#include <mutex>
#include <condition_variable>
#include <atomic>
#include <barrier>
#include <chrono>
#include <exception>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace cli {
namespace {

/// What running one matrix on one engine type measured.
struct run_figures {
  double call_s = 0;          // median over iterations of (last rank's return - first rank's start)
  fa::call_stats stats{};     // rank 0's breakdown of the median call
  bytes_t bytes_checked = 0;  // received bytes compared with the pattern, all iterations
  std::size_t stages = 0;
  bytes_t staging_max = 0;
};

/// Runs `iters` timed calls (after one warm-up) of the engine with decomposer D on the host
/// transport, every rank a thread, and checks every received byte of every call.
template <fa::Decomposer D, fa::Topology Topo>
run_figures run_host(const Topo& topo, const fa::traffic_matrix& t, const options& o, D dec = D(), bool dump = false) {
  using clock = std::chrono::steady_clock;
  const rank_t n = topo.ranks();
  const unsigned calls = o.iters + 1;
  fa::host_fabric fabric(n);
  std::barrier sync(n);
  std::vector<clock::time_point> start(static_cast<std::size_t>(n) * calls), stop(start.size());
  std::vector<std::string> errors(n);
  std::vector<char> timed_out(n, 0); // a rank that waited for a failed one: its error is not the cause
  std::vector<fa::call_stats> stats(calls);
  std::atomic<bytes_t> checked{0};
  run_figures f;
  std::vector<std::thread> threads;
  // Every rank waits for the word to start: if the system cannot give one rank its thread, the
  // ones already made leave at once instead of waiting for it until their timeout.
  std::mutex gate_mutex;
  std::condition_variable gate_cv;
  int gate = 0; // 0 waiting, 1 go, -1 abandon
  auto open_gate = [&](int word) {
    {
      std::lock_guard lock(gate_mutex);
      gate = word;
    }
    gate_cv.notify_all();
  };
  std::string spawn_error;
  for (rank_t r = 0; r < n && spawn_error.empty(); ++r) try {
    threads.emplace_back([&, r] {
      {
        std::unique_lock lock(gate_mutex);
        gate_cv.wait(lock, [&] { return gate != 0; });
        if (gate < 0) return;
      }
      try {
        fa::host_bootstrap boot(fabric, r);
        fa::host_transport tr(fabric, r);
        fa::engine<Topo, fa::host_bootstrap, fa::host_transport, fa::host_transport, D> eng(
            topo, boot, tr, tr, engine_options_of(o), dec);
        const fa::packed_layout l(t, r);
        std::vector<std::byte> send(l.send_bytes), recv(l.recv_bytes);
        l.fill(send, r);
        for (unsigned c = 0; c < calls; ++c) {
          std::fill(recv.begin(), recv.end(), std::byte{0});
          sync.arrive_and_wait();
          start[c * n + r] = clock::now();
          eng.alltoallv(send, l.send_counts, l.send_displs, recv, l.recv_counts, l.recv_displs);
          stop[c * n + r] = clock::now();
          if (r == 0) stats[c] = eng.last_stats();
          if (dump && c == 0 && r == o.dump_program) eng.last_program().print(std::cout);
          check_delivery(l, recv, r, c);
          checked += l.recv_bytes;
          sync.arrive_and_wait(); // nobody refills while another rank still checks
        }
        if (r == 0) {
          f.stages = eng.last_plan().stages();
          for (bytes_t b : eng.last_plan().staging_bytes) f.staging_max = std::max(f.staging_max, b);
        }
      } catch (const std::bad_alloc&) {
        errors[r] = "rank " + std::to_string(r) + " ran out of memory (every rank is a thread of this process: run fewer "
                    "ranks, smaller messages, or a larger --staging-budget)";
        sync.arrive_and_drop();
      } catch (const std::exception& e) {
        errors[r] = e.what();
        timed_out[r] = dynamic_cast<const fa::timeout_error*>(&e) != nullptr;
        // Leave the barrier so that the other ranks fail on their timeouts instead of waiting here.
        sync.arrive_and_drop();
      }
    });
  } catch (const std::system_error& e) {
    spawn_error = "cannot start the thread of rank " + std::to_string(r) + " of " + std::to_string(n) + " (" + e.what() +
                  "): every rank is a thread here; run fewer ranks or raise the process's thread and memory limits";
  }
  open_gate(spawn_error.empty() ? 1 : -1);
  for (auto& th : threads) th.join();
  if (!spawn_error.empty()) throw fa::error(spawn_error);
  for (const bool timeouts : {false, true}) // the first error that is not a timeout: the others waited for it
    for (rank_t r = 0; r < n; ++r)
      if (!errors[r].empty() && static_cast<bool>(timed_out[r]) == timeouts) {
        if (errors[r].find("are wrong") != std::string::npos) throw delivery_failure(errors[r]);
        throw fa::error(errors[r]);
      }
  std::vector<std::pair<double, unsigned>> per_call;
  for (unsigned c = 1; c < calls; ++c) { // call 0 is the warm-up
    auto first = start[c * n], last = stop[c * n];
    for (rank_t r = 0; r < n; ++r) {
      first = std::min(first, start[c * n + r]);
      last = std::max(last, stop[c * n + r]);
    }
    per_call.emplace_back(std::chrono::duration<double>(last - first).count(), c);
  }
  std::sort(per_call.begin(), per_call.end());
  const auto& mid = per_call[per_call.size() / 2];
  f.call_s = mid.first;
  f.stats = stats[mid.second];
  f.bytes_checked = checked.load();
  return f;
}

/// `fasta2a run --transport host` on one topology type.
template <fa::Topology Topo> int run_on(const Topo& topo, const options& o) {
  const rank_t n = topo.ranks();
  const workload w = load_workload(o, n);
  // Every rank's buffers and engine live in this process: refuse what cannot fit before starting.
  const fa::decomposer_params dp = decomposer_params_of(fa::scaleout_of(topo));
  const long double engine_bytes = fa::with_decomposer(o.decomposer, dp, [&](auto dec) {
    return engine_bytes_per_rank<decltype(dec)>(topo.servers(), topo.gpus_per_server());
  });
  long double others = 0;
  for (const fa::traffic_matrix& t : w.matrices) others = std::max(others, check_run_memory(t, 0, n, engine_bytes, "this process"));
  // Every thread rank plans its own part of each call and holds it: a staging budget of a few
  // bytes cuts a call into millions of pieces (issue 50, defect 10). Each rank's planner gets an
  // equal share of the memory left (at most --max-plan-bytes), and the busiest rank's part is
  // planned here first, so that a run whose plans cannot fit is refused before any rank starts.
  options ro = o;
  ro.max_plan_bytes = plan_limit_per_rank(o, n, others);
  for (const fa::traffic_matrix& t : w.matrices)
    fa::with_decomposer(o.decomposer, dp, [&](auto dec) { check_run_plans(topo, t, o, dec, ro.max_plan_bytes, strf("each of the %d ranks of this process", n)); });
  const fa::cost_params cp{o.alpha_s};
  std::ofstream report;
  if (!o.report_path.empty()) {
    report.open(o.report_path, std::ios::binary | std::ios::trunc);
    if (!report) throw fa::error("cannot open report file '" + o.report_path + "' for writing");
  }
  std::cout << "# fasta2a run: " << topo.servers() << " servers x " << topo.gpus_per_server()
            << " GPUs as threads of one process (host transport); decomposer " << o.decomposer << ", granule "
            << o.granule << " B\n"
            << "# input: " << input_description(o) << "\n"
            << "# call, direct: measured wall time per all-to-allv (median of " << o.iters
            << " after a warm-up), every received byte checked; model: alpha-beta prediction for the\n"
            << "# NVLink/NIC cluster the plan is made for (this machine has neither)\n"
            << strf("%5s %5s %5s %11s %6s %10s %10s %8s %9s %9s %9s %9s %12s\n", "index", "ranks", "SxG", "bytes",
                    "stages", "call", "direct", "direct/", "plan", "execute", "FAST", "direct", "checked")
            << strf("%5s %5s %5s %11s %6s %10s %10s %8s %9s %9s %9s %9s %12s\n", "", "", "", "MiB", "", "ms",
                    "ms", "call", "us", "ms", "ms model", "ms model", "MiB");
  bytes_t all_checked = 0;
  for (std::size_t k = 0; k < w.matrices.size(); ++k) {
    const fa::traffic_matrix& t = w.matrices[k];
    const run_figures fast =
        fa::with_decomposer(o.decomposer, dp, [&](auto dec) { return run_host(topo, t, ro, dec, true); });
    const run_figures direct = run_host<fa::direct_decomposer>(topo, t, ro);
    const fa::plan_options popt{o.granule, o.max_plan_bytes};
    const double model_fast = fa::with_decomposer(o.decomposer, dp, [&](auto dec) {
      // The plan the engine made: with the engine's staging budget for this call.
      const fa::engine_options eo = engine_options_of(o);
      fa::plan_options po = planning_options(o);
      if (eo.staging_fraction) po.staging_budget = fa::staging_budget_for(fa::largest_buffer(t), *eo.staging_fraction, po, eo.staging_floor);
      return fa::predict(topo, fa::planner<Topo, decltype(dec)>(topo, po, dec).make(t), cp).total_s;
    });
    const double model_direct = fa::predict(topo, fa::make_plan<fa::direct_decomposer>(topo, t, popt), cp).total_s;
    const double lb = fa::lower_bound(topo, t).overall_s();
    const bytes_t total = t.sum();
    const std::string shape = std::to_string(topo.servers()) + "x" + std::to_string(topo.gpus_per_server());
    std::cout << strf("%5zu %5d %5s %11.2f %6zu %10.3f %10.3f %8.2f %9.1f %9.3f %9.4f %9.4f %12.2f\n",
                      w.first_index + k, n, shape.c_str(), total / mib, fast.stages, fast.call_s * 1e3,
                      direct.call_s * 1e3, ratio(direct.call_s, fast.call_s), fast.stats.plan_s * 1e6,
                      fast.stats.execute_s * 1e3, model_fast * 1e3, model_direct * 1e3,
                      (fast.bytes_checked + direct.bytes_checked) / mib);
    all_checked += fast.bytes_checked + direct.bytes_checked;
    if (report.is_open()) {
      std::string line;
      fa::json_writer j(line);
      j.begin_object();
      report_call_fields(j, w.first_index + k, n, topo, total, fast.stages, fast.staging_max, fast.call_s,
                         direct.call_s, fast.stats);
      j.field("predicted_s", model_fast)
          .field("predicted_direct_s", model_direct)
          .field("lower_bound_s", lb)
          .field("bytes_checked", fast.bytes_checked + direct.bytes_checked)
          .end_object();
      report << line << '\n';
    }
  }
  if (report.is_open() && !report.flush()) throw fa::error("cannot write report file '" + o.report_path + "'");
  std::cout << "# every received byte checked: " << strf("%.2f MiB", all_checked / mib) << ", all correct\n";
  return 0;
}

} // namespace

int run_host_command(const options& o) {
  if (o.dump_program >= o.servers * o.gpus)
    throw fa::error("--dump-program " + std::to_string(o.dump_program) + " is not a rank of " + std::to_string(o.servers) + " x " + std::to_string(o.gpus));
  if (o.gpus == 8) return run_on(fa::fixed_topology<8>(o.servers, o.links), o);
  return run_on(fa::two_tier_topology(o.servers, o.gpus, o.links), o);
}

} // namespace cli
