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
bash tests/sanitize.sh asan  # engine, transport and reader tests under ASan+UBSan (build-asan/), fails on any report
bash tests/sanitize.sh tsan  # the engine and transport tests under TSan (build-tsan/), fails on any report
