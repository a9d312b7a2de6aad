#!/usr/bin/env bash
# A killed rank's shared memory is removed (issue 50, defect 8): libfabric's shm provider keeps a
# 16 MiB region per rank in /dev/shm, named "<pid>:<n>:<m>", which a rank killed with SIGKILL never
# removes. Starts a 2-rank shm job of `fasta2a run --bootstrap tcp`, kills both ranks mid-run, checks
# that their regions are left, runs a short job, and checks that it removed them (and only regions
# of processes that are gone).
#   tests/shm_sweep.sh FASTA2A_BINARY
set -uo pipefail
bin=${1:?usage: shm_sweep.sh FASTA2A_BINARY}
here=$(cd "$(dirname "$0")/.." && pwd)
launch=$here/examples/launch_ranks.sh
export FASTA2A_FI_PROVIDER=shm FASTA2A_BOOTSTRAP_TIMEOUT=30
fail() { echo "shm_sweep: FAILED: $*" >&2; exit 1; }
regions_of() { # the shm regions of process $1
  local f
  for f in /dev/shm/"$1":*; do [[ -e $f ]] && echo "${f#/dev/shm/}"; done
}

# A region of a live process that is not a rank (this shell's pid): must survive the sweep.
live="/dev/shm/$$:0:0"
: > "$live" || fail "cannot write $live"
trap 'rm -f "$live"' EXIT

bash "$launch" -n 2 -t 120 -- "$bin" run --bootstrap tcp --transport libfabric --gpus 2 --uniform \
  --bytes-per-rank 16M --iters 100000 > /dev/null 2>&1 &
launcher=$!
pids=()
for _ in $(seq 1 300); do # up to 30 s for both ranks' regions
  mapfile -t pids < <(pgrep -f -- "--iters 100000" | while read -r p; do [[ -n $(regions_of "$p") ]] && echo "$p"; done)
  ((${#pids[@]} >= 2)) && break
  sleep 0.1
done
((${#pids[@]} >= 2)) || { kill "$launcher" 2>/dev/null; fail "the ranks' shm regions did not appear"; }
kill -9 "${pids[@]}"
wait "$launcher" 2>/dev/null
left=()
for p in "${pids[@]}"; do mapfile -t -O "${#left[@]}" left < <(regions_of "$p"); done
echo "shm_sweep: killed ranks ${pids[*]}; regions left: ${left[*]:-none}"
((${#left[@]} >= 2)) || fail "the killed ranks left no region (nothing to test)"

out=$(bash "$launch" -n 2 -t 120 -- "$bin" run --bootstrap tcp --transport libfabric --gpus 2 --uniform \
  --bytes-per-rank 64K --iters 1 2>&1) || fail "the next job failed: $out"
for r in "${left[@]}"; do [[ -e /dev/shm/$r ]] && fail "/dev/shm/$r is still there after the next job"; done
[[ -e $live ]] || fail "a region of a live process ($live) was removed"
echo "shm_sweep: the next job removed ${#left[@]} region(s) of processes gone and kept the live one"
