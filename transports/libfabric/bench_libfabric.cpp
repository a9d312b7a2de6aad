// Ping-pong between two ranks (threads of this process, each with its own libfabric endpoint):
// rank 0 puts n bytes into rank 1 and signals, rank 1 waits and answers the same way. Prints the
// median round trip per provider and signal ordering, so that the cost of ordering a signal after
// its puts by waiting for their completions can be compared with the provider's own order.
//
//   bench_libfabric [iterations]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include <fasta2a/host.hpp>
#include <fasta2a/libfabric.hpp>

namespace {

using clk = std::chrono::steady_clock;

/// Median round trip in microseconds of `iters` ping-pongs of n bytes.
double ping_pong(const fasta2a::libfabric_options& opt, std::size_t n, int iters) {
  fasta2a::host_fabric fabric(2);
  std::vector<double> rtt;
  std::string failure;
  auto rank = [&](fasta2a::rank_t me) {
    try {
      fasta2a::host_bootstrap boot(fabric, me);
      fasta2a::libfabric_transport t(boot, opt);
      std::vector<std::byte> in(std::max<std::size_t>(n, 1)), out(std::max<std::size_t>(n, 1), std::byte{1});
      auto in_mem = t.register_memory(in.data(), in.size());
      auto out_mem = t.register_memory(out.data(), out.size());
      std::vector<std::byte> mine = t.serialize(in_mem), all(2 * fasta2a::libfabric_transport::handle_bytes);
      boot.allgather(mine, all);
      const fasta2a::rank_t peer = 1 - me;
      const auto dst = t.deserialize(peer, std::span(all).subspan(static_cast<std::size_t>(peer) * fasta2a::libfabric_transport::handle_bytes,
                                                                   fasta2a::libfabric_transport::handle_bytes));
      auto c = t.connect(1);
      const auto limit = std::chrono::milliseconds(10000);
      for (int k = 1; k <= iters + 5; ++k) {
        const auto t0 = clk::now();
        if (me == 0) {
          c.put(peer, out_mem, 0, dst, 0, n, 0);
          c.signal(peer, 0);
          if (!c.wait(peer, 0, static_cast<std::uint64_t>(k), limit)) throw fasta2a::error("no answer");
          if (k > 5) rtt.push_back(std::chrono::duration<double, std::micro>(clk::now() - t0).count());
        } else {
          if (!c.wait(peer, 0, static_cast<std::uint64_t>(k), limit)) throw fasta2a::error("no ping");
          c.put(peer, out_mem, 0, dst, 0, n, 0);
          c.signal(peer, 0);
        }
      }
      c.flush();
      boot.allgather({}, {});
      t.deregister(in_mem);
      t.deregister(out_mem);
    } catch (const std::exception& e) {
      failure = e.what();
    }
  };
  std::thread other(rank, 1);
  rank(0);
  other.join();
  if (!failure.empty() || rtt.empty()) {
    std::fprintf(stderr, "bench_libfabric: %s\n", failure.c_str());
    return -1;
  }
  std::sort(rtt.begin(), rtt.end());
  return rtt[rtt.size() / 2];
}

} // namespace

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 200;
  struct mode {
    const char* provider;
    fasta2a::fi_signal_ordering ordering;
    bool delivery;
  };
  const mode modes[] = {{"tcp;ofi_rxm", fasta2a::fi_signal_ordering::provider_order, false},
                        {"tcp;ofi_rxm", fasta2a::fi_signal_ordering::wait_for_completion, false},
                        {"tcp;ofi_rxm", fasta2a::fi_signal_ordering::wait_for_completion, true},
                        {"shm", fasta2a::fi_signal_ordering::wait_for_completion, false}};
  std::printf("| provider | signal ordering | 8 B us | 64 KiB us | 1 MiB us |\n|---|---|---|---|---|\n");
  for (const mode& m : modes) {
    if (!fasta2a::libfabric_transport::available(m.provider)) continue;
    fasta2a::libfabric_options opt;
    opt.provider = m.provider;
    opt.ordering = m.ordering;
    opt.delivery_complete = m.delivery;
    std::printf("| %s | %s%s |", m.provider, fasta2a::to_string(m.ordering),
                m.ordering == fasta2a::fi_signal_ordering::wait_for_completion ? (m.delivery ? ", delivery complete" : ", transmit complete") : "");
    for (std::size_t n : {std::size_t{8}, std::size_t{65536}, std::size_t{1} << 20}) std::printf(" %.1f |", ping_pong(opt, n, iters));
    std::printf("\n");
    std::fflush(stdout);
  }
}
