// Two thread-ranks put 4 KiB into each other over libibverbs and signal. Where there is no RDMA
// device it prints why and succeeds: what it checks then is that the installed package's verbs
// component is found, compiles and links.
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include <fasta2a/host.hpp>
#include <fasta2a/verbs.hpp>

int main() {
  std::string why;
  if (!fasta2a::verbs_transport::available(&why)) {
    std::printf("consumer_verbs: built and linked; %s\n", why.c_str());
    return 0;
  }
  fasta2a::host_fabric fabric(2);
  int bad = 0;
  auto rank = [&](fasta2a::rank_t me) {
    fasta2a::host_bootstrap boot(fabric, me);
    fasta2a::verbs_transport t(boot);
    std::vector<std::byte> in(4096), out(4096, static_cast<std::byte>(me + 1));
    auto in_mem = t.register_memory(in.data(), in.size());
    auto out_mem = t.register_memory(out.data(), out.size());
    constexpr std::size_t hb = fasta2a::verbs_transport::handle_bytes;
    std::vector<std::byte> mine = t.serialize(in_mem), all(2 * hb);
    boot.allgather(mine, all);
    const fasta2a::rank_t peer = 1 - me;
    auto dst = t.deserialize(peer, std::span(all).subspan(static_cast<std::size_t>(peer) * hb, hb));
    auto c = t.connect(1);
    c.put(peer, out_mem, 0, dst, 0, out.size(), 0);
    c.signal(peer, 0);
    if (!c.wait(peer, 0, 1, std::chrono::milliseconds(10000)) || in[4095] != static_cast<std::byte>(peer + 1)) ++bad;
    c.flush();
    boot.allgather({}, {});
    t.deregister(in_mem);
    t.deregister(out_mem);
    if (me == 0) std::printf("%s\n", t.describe().c_str());
  };
  std::thread other(rank, 1);
  rank(0);
  other.join();
  std::printf(bad ? "consumer_verbs: bytes missing\n" : "consumer_verbs: 2 ranks exchanged 4 KiB, all correct\n");
  return bad ? 1 : 0;
}
