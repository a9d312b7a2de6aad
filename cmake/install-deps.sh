#!/usr/bin/env bash
# Installs the Debian 12 packages fasta2a needs to build its tests, examples and benchmarks.
# Run as root; does nothing for packages already present.
set -euo pipefail
pkgs=(cmake g++ ninja-build libeigen3-dev doctest-dev nlohmann-json3-dev libbenchmark-dev python3 libopenmpi-dev openmpi-bin libfabric-dev pkg-config clang libclang-rt-14-dev hipcc)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "fasta2a: missing packages ${missing[*]}; run as root or install them" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q "${missing[@]}" >/dev/null 2>&1 ||
    { apt-get update -q >/dev/null && apt-get install -y -q "${missing[@]}" >/dev/null; }
fi
