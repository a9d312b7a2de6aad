#!/usr/bin/env bash
# The GPU transport's checks on a machine with a CUDA GPU and driver: configure with CUDA, build the
# CUDA program and the stand-in tests, run both. Exit 77 from gpu_cuda_smoke means no device/driver.
set -euo pipefail
cd "$(dirname "$0")/../.."
B=${1:-build-gpu}
cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFASTA2A_WITH_CUDA=ON -DFASTA2A_WITH_MPI=OFF \
      -DFASTA2A_BUILD_EXAMPLES=OFF -DFASTA2A_BUILD_BENCHMARKS=OFF -DFASTA2A_INSTALL=OFF
cmake --build "$B" --target gpu_cuda_smoke test_gpu_ipc_standin
nvidia-smi -L || true
"$B"/transports/gpu/gpu_cuda_smoke
"$B"/transports/gpu/test_gpu_ipc_standin
