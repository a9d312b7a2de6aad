// fasta2a cluster emulation: an LD_PRELOAD library that binds every outgoing IPv4 TCP connection
// of a process to the address in FASTA2A_BIND_ADDR (port 0) before it connects, so that programs
// which connect without binding (gloo: its connecting side of a pair never binds) send through the
// rank's own NIC: on the emulated cluster the source address picks the NIC (cluster.sh's
// source-based routing), and without a bind the kernel picks the first NIC of the server for
// every rank. A test-harness tool for baselines, not part of the library.
//
//   LD_PRELOAD=build/examples/cluster/libfasta2a_bind_source.so FASTA2A_BIND_ADDR=10.77.1.2 CMD
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace {

using connect_fn = int (*)(int, const sockaddr*, socklen_t);

connect_fn real_connect() {
  static connect_fn f = reinterpret_cast<connect_fn>(dlsym(RTLD_NEXT, "connect"));
  return f;
}

// Binds fd to FASTA2A_BIND_ADDR where it is an unbound IPv4 stream socket headed elsewhere than
// loopback; leaves every other socket alone.
void bind_source(int fd, const sockaddr* to) {
  const char* want = std::getenv("FASTA2A_BIND_ADDR");
  if (want == nullptr || to == nullptr || to->sa_family != AF_INET) return;
  const auto* dst = reinterpret_cast<const sockaddr_in*>(to);
  if ((ntohl(dst->sin_addr.s_addr) >> 24) == 127) return;
  int type = 0;
  socklen_t tl = sizeof type;
  if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &tl) != 0 || type != SOCK_STREAM) return;
  sockaddr_in self{};
  socklen_t sl = sizeof self;
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&self), &sl) == 0 && self.sin_port != 0) return; // bound
  sockaddr_in a{};
  a.sin_family = AF_INET;
  if (inet_pton(AF_INET, want, &a.sin_addr) != 1) return;
  const int saved = errno;
  (void)bind(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a); // a failure leaves the kernel's choice
  errno = saved;
}

} // namespace

extern "C" int connect(int fd, const sockaddr* addr, socklen_t len) {
  bind_source(fd, addr);
  return real_connect()(fd, addr, len);
}
