#!/usr/bin/env bash
# The GPU check from prebuilt programs (tests/gpu/pack_prebuilt.sh made .deps/): for a GPU machine
# with the NVIDIA driver but none of the project's dependencies. Every step has a timeout; logs
# and summary.txt go to $OUT (default ./device_out). Steps:
#   env        the machine: GPU, driver, OS, which libraries the programs resolve
#   smoke      gpu_cuda_smoke: a put into a registered device range, a stream-write signal, a host
#              wait, sent/flush, and the nvcc-compiled unit
#   memcheck   the same under compute-sanitizer (where it runs)
#   np4, np8   the engine, a process per rank on the one GPU, scale-up through CUDA IPC, scale-out
#              over MPI bounced through pinned host mirrors; three stream-ordered calls per seed,
#              byte-exact against MPI_Alltoallv; 2 x 2 ranks (12 seeds) and 2 x 4 (6 seeds)
#   np8_1srv   8 ranks as one server: every byte over CUDA IPC (6 seeds)
#   np4_pinned np4 with the caller's host buffers pinned (FASTA2A_TEST_HOST=pinned)
#   stacks     one seed at 4 ranks; after 25 s every thread's stack (gdb or cuda-gdb, and the
#              kernel's wait channel), then the job is stopped: where a hung run waits (opt-in)
#   bench_*    time from the call to its completion on the caller's stream, against cudaMemcpy
#              device-to-device of the same bytes in the same program
#   bench_1x8_mps  the same with the processes sharing the GPU through MPS
#   STEPS="smoke np4" runs only those.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/device_out}
mkdir -p "$OUT"
D=$PWD/.deps
R=/tmp/fasta2a-deps
BIN=$D/bin
STEPS=${STEPS:-"env smoke np4 np4_pinned np8 bench_2x4 np8_1srv bench_1x8 bench_1x8_mps memcheck"}
start=$(date +%s)
results=()
finish() {
  {
    echo "fasta2a prebuilt GPU check ($(cat "$BIN/commit.txt" 2>/dev/null)), $(date -u +%FT%TZ), $(( $(date +%s) - start )) s"
    for r in "${results[@]}"; do echo "$r"; done
    for f in "$OUT"/bench_*.log; do [ -f "$f" ] && { echo "--- $(basename "$f")"; grep -v '^\[' "$f" | tail -8; }; done
  } > "$OUT/summary.txt"
  cat "$OUT/summary.txt"
}
trap finish EXIT
step() {
  local name=$1 limit=$2
  shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  local t0 rc=0
  t0=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1 || rc=$?
  local outcome=PASS
  if [ $rc = 77 ]; then outcome=SKIP; elif [ $rc = 124 ] || [ $rc = 137 ]; then outcome="TIMEOUT after ${limit} s";
  elif [ $rc != 0 ]; then outcome="FAIL (exit $rc)"; fi
  results+=("$name: $outcome ($(( $(date +%s) - t0 )) s): $(grep -E '^(OK|FAIL|SKIP)|error' "$OUT/$name.log" | tail -2 | tr '\n' ' ' | cut -c1-300)")
  return 0
}

# Open MPI from Debian's packages (the one the programs were linked with), unpacked into a folder
# of its own and relocated; any MPI the machine has is not used.
rm -rf "$R" && mkdir -p "$R"
for f in "$D"/debs/*.deb; do dpkg -x "$f" "$R"; done
export OPAL_PREFIX=$R/usr PATH=$R/usr/bin:$PATH
export LD_LIBRARY_PATH=$R/usr/lib/x86_64-linux-gnu:$R/usr/lib/x86_64-linux-gnu/openmpi/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PMIX_INSTALL_PREFIX=$R/usr/lib/x86_64-linux-gnu/pmix2 PMIX_MCA_pcompress_base_silence_warning=1
export PMIX_MCA_mca_base_component_path=$R/usr/lib/x86_64-linux-gnu/pmix2/lib/pmix
MPIRUN=$R/usr/bin/orterun
# The CUDA runtime the programs were linked with (13.0) where the machine has none.
ldconfig -p | grep -q libcudart.so.13 || export LD_LIBRARY_PATH=$BIN${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
# No single-copy (CMA) in Open MPI's shared memory: a rank's large sends then move only while it
# calls MPI, as over TCP between servers (the first run on an H200 deadlocked this way).
export OMPI_MCA_btl_vader_single_copy_mechanism=none

envinfo() {
  nvidia-smi; nvidia-smi -L; nvidia-smi topo -m 2>&1 | head -5
  grep PRETTY /etc/os-release; uname -r; nproc
  echo "mpirun: $MPIRUN"; "$MPIRUN" --version | head -1
  ldd "$BIN/gpu_engine_mpi_cuda" | grep -E 'mpi|cudart|open-'
  command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer
}
export MPIRUN BIN
export -f envinfo
step env 20 bash -c envinfo
step smoke 30 "$BIN/gpu_cuda_smoke"
step np4 70 "$MPIRUN" -np 4 "$BIN/gpu_engine_mpi_cuda" 2 12 1
# The same with the caller's host buffers pinned (the default is pageable, as most callers have).
step np4_pinned 70 env FASTA2A_TEST_HOST=pinned "$MPIRUN" -x FASTA2A_TEST_HOST -np 4 "$BIN/gpu_engine_mpi_cuda" 2 12 1
# Where the ranks of a hung seeds run wait: every thread's stack after 25 s (gdb, cuda-gdb, or
# the kernel's view), then the job is stopped.
stacks() {
  "$MPIRUN" -np 4 "$BIN/gpu_engine_mpi_cuda" 2 1 7 &
  local job=$!
  sleep 25
  local dbg; dbg=$(command -v gdb || command -v cuda-gdb || ls /usr/local/cuda/bin/cuda-gdb 2>/dev/null || true)
  echo "debugger: ${dbg:-none}"
  for p in $(pgrep -x gpu_engine_mpi_); do
    echo "=== pid $p: $(tr '\0' ' ' < /proc/$p/cmdline | cut -c1-80)"
    for t in /proc/$p/task/*; do echo "task ${t##*/} $(cat $t/comm) wchan=$(cat $t/wchan 2>/dev/null)"; done
    [ -n "$dbg" ] && timeout 40 "$dbg" -p "$p" -batch -ex "thread apply all bt 25" 2>&1 | grep -E '^(#|Thread)' | cut -c1-220 | head -150
  done
  kill "$job" 2>/dev/null; sleep 1; pkill -f gpu_engine_mpi_cuda; return 0
}
export -f stacks
step np8 70 "$MPIRUN" -np 8 "$BIN/gpu_engine_mpi_cuda" 4 6 1001
step bench_2x4 50 "$MPIRUN" -np 8 "$BIN/gpu_engine_mpi_cuda" 4 bench
step np8_1srv 60 "$MPIRUN" -np 8 "$BIN/gpu_engine_mpi_cuda" 8 6 2001
step bench_1x8 40 "$MPIRUN" -np 8 "$BIN/gpu_engine_mpi_cuda" 8 bench
# The same benchmark with the processes sharing the GPU through MPS (one context, no time slices).
mps_bench() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/fasta2a-mps CUDA_MPS_LOG_DIRECTORY=/tmp/fasta2a-mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d || return 3
  "$MPIRUN" -np 8 "$BIN/gpu_engine_mpi_cuda" "$@"
  local rc=$?
  echo quit | nvidia-cuda-mps-control
  return $rc
}
export -f mps_bench
step bench_1x8_mps 45 bash -c 'mps_bench 8 bench'
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
step memcheck 60 "$CS" --tool memcheck --error-exitcode 3 "$BIN/gpu_cuda_smoke"
step stacks 120 bash -c stacks
