#!/usr/bin/env bash
# The MoE example (examples/torch/moe_train.py) trained twice with the same seed, on gloo and on
# fasta2a, 4 processes under torchrun: the loss of every step must be equal bit for bit (an
# all-to-all only moves bytes; every other collective is gloo's in both runs).
#   torch_moe_equal.sh BUILD_PYTHON_DIR [STEPS]
set -euo pipefail
pydir=$1 steps=${2:-50}
here=$(cd "$(dirname "$0")" && pwd)
example="$here/../../examples/torch/moe_train.py"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for b in gloo fasta2a; do
  "$here/torchrun.sh" "$pydir" 4 "$example" --backend "$b" --steps "$steps" --losses "$out/$b.txt" \
    --json "$out/$b.json" > "$out/$b.log" 2>&1 || { cat "$out/$b.log"; echo "torch_moe_equal: the $b run failed"; exit 1; }
  grep -v '^\[W\|^W20' "$out/$b.log" | grep -i "step\|loss\|tokens" | tail -4
done
lines=$(wc -l < "$out/gloo.txt")
[[ $lines -eq $steps ]] || { echo "torch_moe_equal: $lines losses for $steps steps"; exit 1; }
if cmp -s "$out/gloo.txt" "$out/fasta2a.txt"; then
  echo "torch_moe_equal: $steps losses equal bit for bit on gloo and fasta2a (first $(head -1 "$out/gloo.txt"), last $(tail -1 "$out/gloo.txt"))"
  echo "1 passed, 0 failed"
else
  diff "$out/gloo.txt" "$out/fasta2a.txt" | head
  echo "torch_moe_equal: the losses differ"
  exit 1
fi
