#!/usr/bin/env bash
# Packs what tests/gpu/run_prebuilt.sh needs on a GPU machine that has the NVIDIA driver and
# nothing of this project's dependencies (the device machines of this workplace: no MPI, no
# Eigen, nothing to install from): the CUDA test programs built here, the CUDA runtime they link,
# and Debian's Open MPI packages (unpacked there into a folder of their own; Open MPI is
# relocatable through OPAL_PREFIX). Everything goes to .deps/ (ignored by git; carry it).
#
#   tests/gpu/pack_prebuilt.sh [BUILD_DIR]     # default: build (configured with FASTA2A_WITH_CUDA=ON)
set -euo pipefail
cd "$(dirname "$0")/../.."
B=${1:-build}
D=.deps
grep -qx '/.deps/' .git/info/exclude 2>/dev/null || echo '/.deps/' >> .git/info/exclude
targets=(gpu_cuda_smoke gpu_engine_mpi_cuda gpu_nodevice)
cmake --build "$B" --target "${targets[@]}"
mkdir -p "$D/bin" "$D/debs"
for t in "${targets[@]}"; do cp "$B/transports/gpu/$t" "$D/bin/"; done
cp -L "$(ldd "$D/bin/gpu_engine_mpi_cuda" | awk '/libcudart/ {print $3}')" "$D/bin/"
# The runtime closure of Debian 12's Open MPI 4.1 (what ldd finds for orterun, libmpi and the MCA
# components, by package).
(cd "$D/debs" && apt-get download openmpi-bin openmpi-common libopenmpi3 libpmix2 libhwloc15 \
  libevent-core-2.1-7 libevent-pthreads-2.1-7 libevent-2.1-7 libfabric1 libibverbs1 librdmacm1 \
  libnl-3-200 libnl-route-3-200 libnuma1 libpsm-infinipath1 libpsm2-2 libucx0 libmunge2 libatomic1 \
  libltdl7 >/dev/null 2>&1)
git rev-parse HEAD > "$D/bin/commit.txt"
du -sh "$D"
