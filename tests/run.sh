#!/usr/bin/env bash
# Builds fasta2a and runs its whole test suite (the README's test command; .ci/run runs this), then
# the fuzzers and the sanitizer jobs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash cmake/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build -j2
ctest --test-dir build -j2 --output-on-failure
bash tests/fuzz/run.sh 60   # each libFuzzer target for a minute (tests/fuzz/, clang)
# The sanitizer jobs (tests/sanitize.sh) are not yet part of the default run: on these 2-core
# machines they take longer than CI allows and their timing-bound tests (300 ms timeouts) are not
# yet reliable under TSan's slowdown. FASTA2A_SANITIZERS=1 runs them here too.
if [[ ${FASTA2A_SANITIZERS:-0} == 1 ]]; then
  bash tests/sanitize.sh asan  # engine, transport and reader tests under ASan+UBSan (build-asan/), fails on any report
  bash tests/sanitize.sh tsan  # the engine and transport tests under TSan (build-tsan/), fails on any report
fi
