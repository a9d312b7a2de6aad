#!/usr/bin/env bash
# The GPU check: on a machine with one NVIDIA GPU it builds the CUDA parts, runs the GPU tests and
# a benchmark, and writes everything under $OUT (default: ./device_check_out), with summary.txt
# written even when a step fails or times out.
#
#   tests/gpu/device_check.sh            # CUDA; falls back to the stand-in when no GPU is found
#   tests/gpu/device_check.sh --standin  # the stand-in runtime (CPU only): the same steps
#
# Steps: configure and build (-j$(nproc)); ctest of the GPU tests (labels gpu_cuda, gpu_standin);
# byte-exact check of the engine, 2 servers x 4 ranks as 8 processes sharing the GPU through CUDA
# IPC (scale-out over MPI, bounced through host memory), against MPI_Alltoallv on the same data;
# the benchmark (time from call to stream completion, engine bytes/s against cudaMemcpy
# device-to-device on the same GPU). Stand-in timings are not GPU figures (the summary says so).
# Every step has a timeout (BUILD_TIMEOUT for the build: on a loaded 2-core machine the stand-in
# build alone took over 15 minutes); the whole script is meant to take a few minutes on 16 cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/device_check_out}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
B=${FASTA2A_DEVICE_BUILD:-build-device}
JOBS=${JOBS:-$(nproc)}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1

mode=cuda
if [ "${1:-}" = "--standin" ] || [ "${FASTA2A_GPU_STANDIN:-0}" = 1 ]; then mode=standin; fi
if [ "$mode" = cuda ] && ! nvidia-smi -L >/dev/null 2>&1; then
  echo "no NVIDIA GPU found (nvidia-smi -L failed): running on the stand-in runtime" | tee "$OUT/mode.txt"
  mode=standin
fi

results=()
start=$(date +%s)
finish() {
  {
    echo "fasta2a device check, mode: $mode ($( [ "$mode" = standin ] && echo 'STAND-IN RUNTIME: no figure here is a GPU figure' || echo 'real CUDA'))"
    echo "date: $(date -u +%FT%TZ), $(( $(date +%s) - start )) s"
    nvidia-smi -L 2>/dev/null || echo "nvidia-smi: none"
    for r in "${results[@]}"; do echo "$r"; done
    if [ -f "$OUT/bench.txt" ]; then echo "--- bench ---"; cat "$OUT/bench.txt"; fi
  } > "$SUMMARY"
  cat "$SUMMARY"
}
trap finish EXIT

# step NAME TIMEOUT_S CMD...: runs CMD with a timeout, its output in $OUT/NAME.log; records the
# outcome; never stops the script.
step() {
  local name=$1 limit=$2
  shift 2
  local t0 rc=0
  t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1 || rc=$?
  local outcome=PASS
  if [ $rc = 77 ]; then outcome=SKIP; elif [ $rc = 124 ]; then outcome="TIMEOUT after ${limit} s"; elif [ $rc != 0 ]; then outcome="FAIL (exit $rc)"; fi
  results+=("$name: $outcome ($(( $(date +%s) - t0 )) s, log $name.log)")
  return 0
}

common=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DFASTA2A_BUILD_EXAMPLES=OFF -DFASTA2A_BUILD_CLI=OFF -DFASTA2A_BUILD_BENCHMARKS=OFF
        -DFASTA2A_INSTALL=OFF -DFASTA2A_WITH_HIP=OFF -DFASTA2A_WITH_LIBFABRIC=OFF)
if [ "$mode" = cuda ]; then
  step configure 300 cmake -S . -B "$B" "${common[@]}" -DFASTA2A_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90
  step build "${BUILD_TIMEOUT:-600}" cmake --build "$B" -j"$JOBS" --target gpu_cuda_smoke gpu_nodevice gpu_engine_mpi_cuda test_gpu_ipc_standin test_gpu_ipc_mutant test_gpu_engine_mpi test_gpu_engine_mpi_mutant
  step ctest_gpu 300 ctest --test-dir "$B" -L "gpu_cuda|gpu_standin" -j"$JOBS" --output-on-failure --timeout 240
  exe="$B/transports/gpu/gpu_engine_mpi_cuda"
else
  step configure 300 cmake -S . -B "$B" "${common[@]}" -DFASTA2A_WITH_CUDA=OFF
  step build "${BUILD_TIMEOUT:-900}" cmake --build "$B" -j"$JOBS" --target test_gpu_ipc_standin test_gpu_ipc_mutant test_gpu_engine_mpi test_gpu_engine_mpi_mutant gpu_nodevice
  step ctest_gpu 600 ctest --test-dir "$B" -L "gpu_cuda|gpu_standin" -j"$JOBS" --output-on-failure --timeout 300
  exe="$B/transports/gpu/test_gpu_engine_mpi"
fi
if command -v mpirun >/dev/null && [ -x "$exe" ]; then
  step engine_2x4_exact 300 mpirun -np 8 "$exe" 4 6 1001
  step bench_2x4 300 sh -c "mpirun -np 8 '$exe' 4 bench > '$OUT/bench.txt' 2>&1"
else
  results+=("engine_2x4_exact, bench_2x4: SKIP (no mpirun or $exe was not built)")
fi
