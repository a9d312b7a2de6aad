// fasta2a CLI: `fasta2a run --transport verbs`. The libibverbs transport is not part of this
// program yet: where libibverbs was found at build time, this says whether the machine has an RDMA
// device at all (ibv_get_device_list); either way the command exits 2 with the reason.
#include "commands.hpp"

#ifdef FASTA2A_HAVE_IBVERBS
#include <infiniband/verbs.h>

#include <cerrno>
#include <cstring>
#endif

#include <string>

namespace cli {

int run_verbs(const options&) {
#ifdef FASTA2A_HAVE_IBVERBS
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (list == nullptr)
    throw fa::error(std::string("--transport verbs: no RDMA device found (ibv_get_device_list failed: ") +
                    std::strerror(errno) + "; the kernel may have no RDMA subsystem)");
  std::string names;
  for (int i = 0; i < n; ++i) names += std::string(names.empty() ? "" : ", ") + ibv_get_device_name(list[i]);
  ibv_free_device_list(list);
  if (n == 0)
    throw fa::error("--transport verbs: no RDMA device found (ibv_get_device_list lists none): it needs an "
                    "InfiniBand or RoCE NIC");
  throw fa::error("--transport verbs: RDMA device(s) " + names +
                  " found, but this fasta2a has no verbs transport built in");
#else
  throw fa::error("--transport verbs: this fasta2a is built without verbs support (libibverbs was not found "
                  "when it was built; Debian: libibverbs-dev)");
#endif
}

} // namespace cli
