#!/usr/bin/env bash
# Installs the Debian 12 packages fasta2a needs to build its tests, examples and benchmarks.
# Run as root; does nothing for packages already present. The PyTorch package (python/) needs
# python3-torch, libtorch-dev and pybind11-dev: installed without their recommended packages
# (a desktop's worth of GUI libraries that torch does not need).
set -euo pipefail
pkgs=(cmake g++ ninja-build libeigen3-dev libssl-dev doctest-dev nlohmann-json3-dev libbenchmark-dev python3 libopenmpi-dev openmpi-bin libfabric-dev pkg-config clang libclang-rt-14-dev hipcc)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
torch_pkgs=(python3-torch libtorch-dev pybind11-dev python3-numpy)
torch_missing=()
for p in "${torch_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || torch_missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ] || [ ${#torch_missing[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "fasta2a: missing packages ${missing[*]} ${torch_missing[*]}; run as root or install them" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt_install() { apt-get install -y -q "$@" >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q "$@" >/dev/null; }; }
  if [ ${#missing[@]} -gt 0 ]; then apt_install "${missing[@]}"; fi
  if [ ${#torch_missing[@]} -gt 0 ]; then apt_install --no-install-recommends "${torch_missing[@]}"; fi
fi
