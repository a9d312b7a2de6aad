// An all-to-allv among 8 threads (2 servers x 4 GPUs) through fasta2a::host, every received byte
// checked against its sender's pattern.
#include <fasta2a/engine.hpp>
#include <fasta2a/host.hpp>
#include <fasta2a/pattern.hpp>
#include <fasta2a/traffic.hpp>

#include <atomic>
#include <cstdio>
#include <exception>
#include <thread>
#include <vector>

namespace fa = fasta2a;

// One rank's part: build its engine, run the call, count the bytes that came out wrong.
std::uint64_t run_rank(fa::host_fabric& fabric, fa::rank_t me, const fa::traffic_matrix& t) {
  fa::host_bootstrap boot(fabric, me);
  fa::host_transport link(fabric, me);
  fa::engine<fa::two_tier_topology, fa::host_bootstrap, fa::host_transport, fa::host_transport> eng(
      fa::two_tier_topology(2, 4), boot, link /*scale-up*/, link /*scale-out*/);
  const fa::packed_layout l(t, me);
  std::vector<std::byte> send(l.send_bytes), recv(l.recv_bytes);
  l.fill(send, me);
  eng.alltoallv(send, l.send_counts, l.send_displs, recv, l.recv_counts, l.recv_displs);
  return l.mismatches(recv, me);
}

int main() {
  const fa::traffic_matrix t = fa::zipf_traffic(8, 1.0, 256 << 10, 7); // same matrix for every rank
  fa::host_fabric fabric(8);
  std::atomic<std::uint64_t> wrong{0}, failed{0};
  std::vector<std::thread> ranks;
  for (fa::rank_t r = 0; r < 8; ++r)
    ranks.emplace_back([&, r] {
      try {
        wrong += run_rank(fabric, r, t);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", r, e.what());
        ++failed;
      }
    });
  for (auto& th : ranks) th.join();
  std::printf("consumer_host: %llu bytes among 8 threads, %llu wrong, %llu ranks failed\n",
              static_cast<unsigned long long>(t.sum()), static_cast<unsigned long long>(wrong.load()),
              static_cast<unsigned long long>(failed.load()));
  return wrong == 0 && failed == 0 ? 0 : 1;
}
