#!/usr/bin/env bash
# The README's demo: builds fasta2a's command-line program, plans the Megatron MoE trace and a
# Zipf workload, prints the table and writes the plan (JSON) and its timeline (SVG), then executes
# the Megatron all-to-allv with real bytes on the host transport and checks every byte.
set -euo pipefail
cd "$(dirname "$0")/.."
bash cmake/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j2 --target fasta2a_cli
trace=../shared/workloads/megatron-4n-32gpu.txt
out=build/demo
mkdir -p "$out"
echo "== Megatron MoE trace, 4 servers x 8 H200, matrix 0 (8192-byte tokens)"
./build/fasta2a plan --servers 4 --gpus 8 --matrix "$trace" --unit 8192 --granule 8192 \
  --json "$out/megatron-0.plan.json" --svg "$out/megatron-0.svg"
echo
echo "== all 600 matrices of the trace (table in $out/megatron-all.txt)"
./build/fasta2a plan --servers 4 --gpus 8 --matrix "$trace" --unit 8192 --granule 8192 --all \
  --repeat 3 --report "$out/megatron-all.jsonl" >"$out/megatron-all.txt"
tail -n 1 "$out/megatron-all.txt"
echo
echo "== Zipf(1.0), 8 servers x 8 H200, 256 MiB per GPU"
./build/fasta2a plan --servers 8 --gpus 8 --zipf 1.0 --bytes-per-rank 256MiB --granule 8K --seed 1 \
  --svg "$out/zipf-8x8.svg"
echo
echo "== executing it: 32 ranks as threads of this process (host transport), real bytes, every byte checked"
./build/fasta2a run --servers 4 --gpus 8 --matrix "$trace" --unit 1024 --granule 1024 --index 0 --iters 3
echo
echo "wrote $out/megatron-0.plan.json, $out/megatron-0.svg, $out/zipf-8x8.svg"
