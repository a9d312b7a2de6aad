#!/usr/bin/env bash
# Builds fasta2a's libFuzzer targets with clang (tests/fuzz/CMakeLists.txt, into build-fuzz/) and
# fuzzes each for SECONDS (default 60), starting from its committed seeds (tests/fuzz/corpus/<t>/).
# Fails on any crash, sanitizer report, property violation, undocumented exception, hang (an input
# running past 60 s), leak or input using more than 2 GiB. New inputs go to build-fuzz/corpus/<t>/
# (not committed); a failing input is saved as build-fuzz/artifacts/<t>-crash-... (or -timeout-,
# -oom-, -leak-) and its log is printed.
#   tests/fuzz/run.sh [SECONDS] [TARGET...]     e.g. tests/fuzz/run.sh 600 fuzz_planner
# FASTA2A_FUZZ_BUILD: the build folder (default build-fuzz); FASTA2A_FUZZ_NICE: nice level for the
# fuzzing (default 0); FASTA2A_FUZZ_AT_ONCE: 1 (default) runs the targets at the same time, sharing
# the machine's cores (CI: four minutes of fuzzing in one of wall time), 0 one after another, each
# with a core to itself (the longer runs).
set -euo pipefail
cd "$(dirname "$0")/../.."
seconds=${1:-60}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(fuzz_plan_reader fuzz_trace_reader fuzz_planner fuzz_bootstrap_handshake)
build=${FASTA2A_FUZZ_BUILD:-build-fuzz}
nice_level=${FASTA2A_FUZZ_NICE:-0}

command -v clang++ >/dev/null || { echo "fuzz: clang++ not found (Debian 12: apt-get install clang libclang-rt-14-dev)" >&2; exit 1; }
CXX=clang++ cmake -S tests/fuzz -B "$build" -G Ninja >/dev/null
cmake --build "$build" -j2 --target "${targets[@]}"

mkdir -p "$build/artifacts"
at_once=${FASTA2A_FUZZ_AT_ONCE:-1}

# Fuzzes target $1; its exit status goes to $build/$1.rc.
fuzz_one() {
  local t=$1 rc=0
  local seeds=tests/fuzz/corpus/${t#fuzz_} work=$build/corpus/${t#fuzz_} log=$build/$t.log
  mkdir -p "$work"
  echo "fuzz: $t for ${seconds} s (seeds $seeds, log $log)"
  # The first folder receives new inputs; the seeds are read only. -timeout: a hang; -rss_limit_mb
  # and -malloc_limit_mb: memory; leaks are detected by default (ASan's LeakSanitizer).
  nice -n "$nice_level" "$build/$t" "$work" "$seeds" -max_total_time="$seconds" -timeout=60 \
    -rss_limit_mb=2048 -malloc_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$build/artifacts/$t-" >"$log" 2>&1 || rc=$?
  echo "$rc" >"$build/$t.rc"
}

for t in "${targets[@]}"; do
  rm -f "$build/$t.rc"
  if [ "$at_once" = 1 ]; then fuzz_one "$t" & else fuzz_one "$t"; fi
done
wait

status=0
summary=()
for t in "${targets[@]}"; do
  log=$build/$t.log
  rc=$(cat "$build/$t.rc" 2>/dev/null || echo "no exit status")
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  secs=$(sed -n 's/^Done [0-9]* runs in \([0-9]*\) second.*/\1/p' "$log" | tail -1)
  if [ "$rc" != 0 ]; then
    status=1
    echo "fuzz: $t FAILED (exit $rc); the end of its log:" >&2
    tail -n 60 "$log" >&2
    summary+=("$t: FAILED after ${runs:-?} executions; input in $build/artifacts/")
  else
    summary+=("$t: ${runs:-?} executions in ${secs:-?} s, no failure")
  fi
done
printf 'fuzz: %s\n' "${summary[@]}"
exit $status
