#!/usr/bin/env bash
# The README's test command (.ci/run runs exactly this): builds fasta2a and runs its whole test
# suite, fuzzes, then runs the sanitizer jobs, and fails on any failing test, fuzzer finding or
# sanitizer report. Each part prints its time (docs/TESTING.md, "Sanitizers and chaos tests", has a run's).
#   plain   Release build of everything (build/, the system's g++), ctest -j2: what users build
#   fuzz    the four libFuzzer targets for a minute, at the same time (tests/fuzz/, clang, build-fuzz/)
#   asan    the whole suite under ASan+UBSan (tests/sanitize.sh asan, clang, build-asan/): every test
#           but the two that limit the address space (ulimit -v) and the chaos tests, which the plain
#           build runs, MPI worlds up to 4 ranks, and of the worlds that run the same code one
#           (tests/sanitize.sh says which)
#   tsan    the engine and transport tests under TSan (tests/sanitize.sh tsan, clang, build-tsan/)
# About 31 minutes on 2 cores (docs/TESTING.md, "Sanitizers and chaos tests"; CI asks for under 45).
# FASTA2A_SANITIZERS=0 leaves the two sanitizer jobs out (a quicker local run; CI runs them).
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
times=()
lap() { times+=("$1 $((SECONDS - t0)) s"); t0=$SECONDS; }
bash cmake/install-deps.sh
lap deps
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build -j2
lap "plain build"
ctest --test-dir build -j2 --output-on-failure
lap "plain tests"
bash tests/fuzz/run.sh 60   # the four libFuzzer targets for a minute, at once (tests/fuzz/, clang)
lap "fuzz (build and 60 s)"
if [[ ${FASTA2A_SANITIZERS:-1} != 0 ]]; then
  bash tests/sanitize.sh asan  # the whole suite under ASan+UBSan (build-asan/), fails on any report
  lap "asan (build and tests)"
  bash tests/sanitize.sh tsan  # the engine and transport tests under TSan (build-tsan/), fails on any report
  lap "tsan (build and tests)"
else
  echo "tests/run.sh: the sanitizer jobs are left out (FASTA2A_SANITIZERS=0)"
fi
printf 'tests/run.sh: %s\n' "${times[@]}"
