// Two thread-ranks put 4 KiB into each other over an RDMA transport and signal. libfabric
// (FASTA2A_CONSUMER_LIBFABRIC): exits 77 when the provider (FASTA2A_FI_PROVIDER, else tcp;ofi_rxm)
// is not usable here. libibverbs (FASTA2A_CONSUMER_VERBS): where there is no RDMA device it prints
// why and succeeds: what it checks then is that the installed package's verbs component is found,
// compiles and links.
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include <fasta2a/host.hpp>
#if defined(FASTA2A_CONSUMER_VERBS)
#include <fasta2a/verbs.hpp>
using transport = fasta2a::verbs_transport;
static constexpr const char* name = "consumer_verbs";
/// Whether the transport can run here; if not, says so and gives the exit status.
static bool usable(int* rc) {
  std::string why;
  if (transport::available(&why)) return true;
  std::printf("consumer_verbs: built and linked; %s\n", why.c_str());
  *rc = 0;
  return false;
}
#elif defined(FASTA2A_CONSUMER_LIBFABRIC)
#include <fasta2a/libfabric.hpp>
using transport = fasta2a::libfabric_transport;
static constexpr const char* name = "consumer_libfabric";
static bool usable(int* rc) {
  std::string why;
  if (transport::available({}, &why)) return true;
  std::printf("skipped: %s\n", why.c_str());
  *rc = 77;
  return false;
}
#else
#error "define FASTA2A_CONSUMER_LIBFABRIC or FASTA2A_CONSUMER_VERBS"
#endif

int main() {
  if (int rc = 0; !usable(&rc)) return rc;
  fasta2a::host_fabric fabric(2);
  int bad = 0;
  auto rank = [&](fasta2a::rank_t me) {
    fasta2a::host_bootstrap boot(fabric, me);
    transport t(boot);
    std::vector<std::byte> in(4096), out(4096, static_cast<std::byte>(me + 1));
    auto in_mem = t.register_memory(in.data(), in.size());
    auto out_mem = t.register_memory(out.data(), out.size());
    constexpr std::size_t hb = transport::handle_bytes;
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
  if (bad) std::printf("%s: bytes missing\n", name);
  else std::printf("%s: 2 ranks exchanged 4 KiB, all correct\n", name);
  return bad ? 1 : 0;
}
