#!/usr/bin/env bash
# End-to-end tests of the fasta2a command-line program.
#
#   cli_test.sh MODE FASTA2A PYTHON WORKLOADS_DIR
#
# MODE is one of:
#   trace      the Megatron trace plans; --json, --report and --svg files exist and parse
#   generator  every generator, both topology kinds and every decomposer plan; report figures agree
#   errors     every kind of bad input exits 2 with "fasta2a: error: " and a word naming the problem
#   rank       `plan --rank R`: a rank's part only, checked against the whole plan where small, on
#              its own where large; its report; a rank out of range and whole-plan outputs refused
#   robust     issue 12's reproductions (defects 6, 7, 8) and issue 50's (defects 11, 12: input
#              that is not a regular file, generator options that give no traffic): each ends with
#              exit 2 naming the real problem, quickly and within bounded memory; needs no trace
# Exit 0 on success; a missing trace fails, or exits 77 (ctest's SKIP_RETURN_CODE) with
# FASTA2A_SKIP_MISSING_WORKLOADS=1. FASTA2A_CLI_TEST_MATRICES=N (the sanitizer builds set it): the
# runs over every matrix of the trace (--all) take its first N matrices, written to a file of their
# own (under ASan+UBSan at -O0 the 600 took 43 s of cli.trace and most of cli.plan_rank's 31 s).
set -u

mode=$1
bin=$2
python=$3
workloads=$4
megatron=$workloads/megatron-4n-32gpu.txt

work=$(mktemp -d "${TMPDIR:-/tmp}/fasta2a-cli-test.XXXXXX")
trap 'rm -rf "$work"' EXIT

# What --all runs over: the whole trace (600 matrices of 32 x 32 entries, one a line), or its first
# FASTA2A_CLI_TEST_MATRICES.
all_matrices=600
all_trace=$megatron
if [ -n "${FASTA2A_CLI_TEST_MATRICES:-}" ] && [ "$FASTA2A_CLI_TEST_MATRICES" -lt 600 ] && [ -f "$megatron" ]; then
  all_matrices=$FASTA2A_CLI_TEST_MATRICES
  all_trace=$work/megatron-first-$all_matrices.txt
  head -n $((all_matrices * 32 * 32)) "$megatron" > "$all_trace"
fi

failures=0
fail() {
  echo "FAIL: $*" >&2
  failures=$((failures + 1))
}

# run ARGS...: runs the program, leaving its status in $rc and its output in $work/out, $work/err.
run() {
  "$bin" "$@" >"$work/out" 2>"$work/err"
  rc=$?
}

# expect_ok ARGS...: the program succeeds and prints nothing on stderr.
expect_ok() {
  run "$@"
  if [ "$rc" -ne 0 ] || [ -s "$work/err" ]; then
    fail "fasta2a $* exited $rc (want 0); stderr: $(cat "$work/err")"
    return 1
  fi
}

# expect_error WORD ARGS...: the program exits 2, says "fasta2a: error: ..." mentioning WORD
# (case-insensitive) on stderr, and prints nothing on stdout (no partial table, no plan).
expect_error() {
  local word=$1
  shift
  run "$@"
  local err
  err=$(cat "$work/err")
  if [ "$rc" -ne 2 ]; then
    fail "fasta2a $* exited $rc (want 2); stderr: $err"
  elif ! grep -q '^fasta2a: error: ' "$work/err"; then
    fail "fasta2a $*: stderr lacks 'fasta2a: error: ': $err"
  elif ! grep -qi -- "$word" "$work/err"; then
    fail "fasta2a $*: message does not mention '$word': $err"
  elif [ -s "$work/out" ]; then
    fail "fasta2a $*: printed on stdout although it failed: $(head -c 300 "$work/out")"
  fi
}

# py SCRIPT ARGS...: a Python check; its failure message goes to stderr.
py() {
  local script=$1
  shift
  "$python" -c "$script" "$@" || fail "python check failed: ${script:0:80}... $*"
}

report_keys='{"index","ranks","servers","gpus","bytes","stages","scaleup_bytes","staging_bytes","lower_bound_s","lower_bound_alpha_s","predicted_s","predicted_over_lower_bound_alpha","predicted_spreadout_s","predicted_direct_s","synthesis_us","synthesis_rank_us","decomposer","choice","staging_budget","staging_ring","buffer_bytes_max","staging_over_own_buffer_max"}'

# check_report FILE LINES RANKS SERVERS GPUS BYTES: every line is a JSON object with exactly the
# report's keys and the given shape, and the model's predictions respect the lower bound.
check_report() {
  py "
import json, sys
path, lines, ranks, servers, gpus, nbytes = sys.argv[1], int(sys.argv[2]), *map(int, sys.argv[3:])
rows = [json.loads(l) for l in open(path)]
assert len(rows) == lines, f'{len(rows)} report lines, want {lines}'
for k, r in enumerate(rows):
    assert set(r) == $report_keys, f'line {k}: keys {sorted(r)}'
    assert (r['ranks'], r['servers'], r['gpus']) == (ranks, servers, gpus), r
    if nbytes >= 0: assert r['bytes'] == nbytes, (r['bytes'], nbytes)
    lb = r['lower_bound_s']
    for key in ('predicted_s', 'predicted_spreadout_s', 'predicted_direct_s'):
        assert r[key] >= lb * (1 - 1e-9), f'line {k}: {key} {r[key]} below the lower bound {lb}'
    assert r['synthesis_us'] > 0 and r['synthesis_rank_us'] > 0 and r['stages'] >= 0 and r['staging_bytes'] >= 0
    # Staging: within the budget where one is set (and shared only then); the largest buffer holds every rank's bytes.
    assert r['staging_budget'] >= 0 and r['staging_ring'] >= 0 and r['staging_over_own_buffer_max'] >= 0, r
    if r['staging_budget'] == 0: assert r['staging_ring'] == 0, r
    if r['staging_ring'] > 0: assert r['staging_bytes'] <= r['staging_budget'], r
    assert r['buffer_bytes_max'] <= r['bytes'] and (r['bytes'] == 0 or r['buffer_bytes_max'] * r['ranks'] >= r['bytes']), r
    # LB_alpha: at least LB, and a staged plan (one stage per server peer at least) is above it.
    assert r['lower_bound_alpha_s'] >= lb * (1 - 1e-9), r
    if r['decomposer'] != 'direct':
        assert r['predicted_s'] >= r['lower_bound_alpha_s'] * (1 - 1e-9), f'line {k}: staged plan below LB_alpha: {r}'
    if r['lower_bound_alpha_s'] > 0:
        want = r['predicted_s'] / r['lower_bound_alpha_s']
        assert abs(r['predicted_over_lower_bound_alpha'] - want) <= 1e-9 * max(1, want), r
    else:
        assert r['predicted_over_lower_bound_alpha'] == 0, r
" "$@"
}

check_svg() {
  py "
import sys, xml.dom.minidom
doc = xml.dom.minidom.parse(sys.argv[1])
assert doc.documentElement.tagName == 'svg'
text = open(sys.argv[1], encoding='utf-8').read()
assert 'MODEL' in text, 'caption does not say the timeline is a model'
for needle in sys.argv[2:]:
    assert needle in text, f'{needle!r} not in the SVG'
" "$@"
}

check_plan_json() {
  py "
import json, sys
p = json.load(open(sys.argv[1]))
assert p['format'] == 'fasta2a.plan.v1', p.get('format')
assert (p['servers'], p['gpus_per_server']) == (int(sys.argv[2]), int(sys.argv[3])), p
assert isinstance(p['stages'], list) and isinstance(p['pieces'], list)
" "$@"
}

# The trace modes need ../shared/workloads (FASTA2A_WORKLOADS_DIR): a missing trace fails them,
# unless FASTA2A_SKIP_MISSING_WORKLOADS=1 says to skip (exit 77, ctest SKIP_RETURN_CODE).
need_megatron() {
  [ -f "$megatron" ] && return 0
  if [ "${FASTA2A_SKIP_MISSING_WORKLOADS:-}" = 1 ]; then
    echo "skipped (FASTA2A_SKIP_MISSING_WORKLOADS=1): $megatron is missing"
    exit 77
  fi
  echo "FAIL: $megatron is missing (set FASTA2A_WORKLOADS_DIR, or FASTA2A_SKIP_MISSING_WORKLOADS=1 to skip)"
  exit 1
}

case "$mode" in
trace)
  need_megatron
  args=(plan --servers 4 --gpus 8 --matrix "$megatron" --unit 8192 --index 0)
  if expect_ok "${args[@]}" --json "$work/plan.json" --report "$work/report.jsonl" --svg "$work/timeline.svg"; then
    cat "$work/out"
    # The row of matrix 0: 32 ranks of 8192 tokens of 8 KiB each, 2 GiB in all.
    grep -Eq '^ +0 +32 +4x8 +2048\.00 ' "$work/out" || fail "no table row for matrix 0 of 4x8, 2048 MiB"
    grep -q 'MODEL' "$work/out" || fail "the table does not say its times are a model's"
    for f in plan.json report.jsonl timeline.svg; do
      [ -s "$work/$f" ] || fail "$f was not written"
    done
    check_plan_json "$work/plan.json" 4 8
    check_report "$work/report.jsonl" 1 32 4 8 $((32 * 8192 * 8192))
    check_svg "$work/timeline.svg" "server 3" "nic 7" "up 7"
  fi
  # Every matrix: one row and one report line each, then the summary.
  if expect_ok plan --servers 4 --gpus 8 --matrix "$all_trace" --unit 8192 --all --repeat 1 \
      --report "$work/all.jsonl" --json "$work/all.json"; then
    tail -n 2 "$work/out"
    [ "$(grep -Ec '^ +[0-9]+ +32 +4x8 ' "$work/out")" -eq "$all_matrices" ] || fail "--all did not print $all_matrices rows"
    grep -Eq "^# summary over $all_matrices matrices \\(medians\\): direct/FAST [0-9.]+x, FAST/LB [0-9.]+x" "$work/out" ||
      fail "--all printed no summary line"
    check_report "$work/all.jsonl" "$all_matrices" 32 4 8 -1
    py "
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
n = int(sys.argv[2])
assert [r['index'] for r in rows] == list(range(n)), f'indexes are not 0..{n - 1} in order'
assert all(r['bytes'] == 32 * 8192 * 8192 for r in rows)
" "$work/all.jsonl" "$all_matrices"
    check_plan_json "$work/all.json" 4 8
    # The plan written with --all is the first matrix's: the same as planning matrix 0 alone.
    cmp -s "$work/all.json" "$work/plan.json" || fail "--all --json did not write matrix 0's plan"
  fi
  # The engine's default staging budget on the trace: a quarter of each matrix's largest buffer,
  # every plan verified (exit 0), staging shared where the plan's own layout needs more.
  if expect_ok plan --servers 4 --gpus 8 --matrix "$all_trace" --unit 8192 --granule 8192 --all --repeat 1 \
      --staging-fraction 0.25 --report "$work/budget.jsonl"; then
    check_report "$work/budget.jsonl" "$all_matrices" 32 4 8 -1
    py "
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for r in rows:
    assert r['staging_budget'] == r['buffer_bytes_max'] // 4, r
    assert r['staging_bytes'] <= r['buffer_bytes_max'] / 4, r
assert 6 * sum(r['staging_ring'] > 0 for r in rows) >= 5 * len(rows), 'staging was shared on too few matrices'
" "$work/budget.jsonl"
  fi
  # A trace file whose name needs escaping in XML still gives a well-formed SVG.
  odd="$work/odd & <name> \"quoted\" 'x'.txt"
  printf '0 5\n7 0\n' >"$odd"
  if expect_ok plan --servers 2 --gpus 1 --matrix "$odd" --svg "$work/odd.svg"; then
    check_svg "$work/odd.svg" "&amp;" "&lt;name&gt;"
  fi
  ;;

generator)
  # Zipf on 4 x 8 (the compile-time topology) with every output.
  if expect_ok plan --servers 4 --gpus 8 --zipf 1.2 --bytes-per-rank 1MiB --seed 7 --repeat 3 \
      --json "$work/z.json" --report "$work/z.jsonl" --svg "$work/z.svg"; then
    cat "$work/out"
    check_plan_json "$work/z.json" 4 8
    check_report "$work/z.jsonl" 1 32 4 8 $((32 * 1024 * 1024))
    check_svg "$work/z.svg"
  fi
  # The staging floor: a call of 1 MiB per rank gets the engine's 8 MiB floor, more than its own
  # layout needs (nothing shared); without a floor a tenth of its largest buffer, shared.
  if expect_ok plan --servers 4 --gpus 8 --zipf 1.2 --bytes-per-rank 1MiB --seed 7 --repeat 1 \
      --staging-fraction 0.1 --report "$work/floor.jsonl" &&
     expect_ok plan --servers 4 --gpus 8 --zipf 1.2 --bytes-per-rank 1MiB --seed 7 --repeat 1 \
      --staging-fraction 0.1 --staging-floor 0 --report "$work/nofloor.jsonl"; then
    py "
import json, sys
f = json.loads(open(sys.argv[1]).readline())
n = json.loads(open(sys.argv[2]).readline())
assert f['staging_budget'] == 8 << 20 and f['staging_ring'] == 0, f
assert f['buffer_bytes_max'] / 10 < 8 << 20, f
assert abs(n['staging_budget'] - n['buffer_bytes_max'] / 10) <= 1 and n['staging_ring'] > 0, n
assert n['stages'] > f['stages'] and n['staging_bytes'] <= n['staging_budget'], (f, n)
" "$work/floor.jsonl" "$work/nofloor.jsonl" || fail "the staging floor"
  fi
  # The same seed gives the same plan; another seed another matrix.
  expect_ok plan --servers 4 --gpus 8 --zipf 1.2 --bytes-per-rank 1MiB --seed 7 --json "$work/z2.json" &&
    { cmp -s "$work/z.json" "$work/z2.json" || fail "the same seed gave another plan"; }
  # A per-rail plan's document: every stage has each rail's weight and permutation, the stage's own
  # weight the heaviest rail's and its perm -1 everywhere.
  if expect_ok plan --servers 4 --gpus 8 --zipf 1.2 --bytes-per-rank 1MiB --seed 7 --rails per-rail \
      --json "$work/rails.json"; then
    check_plan_json "$work/rails.json" 4 8
    py "
import json, sys
p = json.load(open(sys.argv[1]))
assert p['stages'], 'no stages'
for st in p['stages']:
    assert len(st['rails']) == 8, st
    assert st['weight'] == max(r['weight'] for r in st['rails']), st
    assert st['perm'] == [-1] * 4, st
    for r in st['rails']:
        assert len(r['perm']) == 4 and all(d == -1 or 0 <= d < 4 for d in r['perm']), r
" "$work/rails.json" || fail "the per-rail plan's document"
  fi
  # Runtime-sized topology (G != 8), mesh scale-up, each generator and each decomposer.
  expect_ok plan --servers 3 --gpus 4 --uniform --bytes-per-rank 12K --report "$work/u.jsonl" &&
    check_report "$work/u.jsonl" 1 12 3 4 $((12 * 12 * 1024))
  expect_ok plan --servers 3 --gpus 4 --hotspot 2 --hot-share 0.9 --bytes-per-rank 1M --scaleup mesh \
    --report "$work/h.jsonl" && check_report "$work/h.jsonl" 1 12 3 4 $((12 * 1024 * 1024))
  expect_ok plan --servers=5 --gpus=2 --lognormal=1.5 --bytes-per-rank=3G --seed=2 --report="$work/l.jsonl" &&
    check_report "$work/l.jsonl" 1 10 5 2 -1
  for d in birkhoff spread-out direct; do
    expect_ok plan --servers 4 --gpus 8 --zipf 1 --bytes-per-rank 1M --granule 4K --decomposer "$d" \
      --json "$work/$d.json" --svg "$work/$d.svg" && check_plan_json "$work/$d.json" 4 8 && check_svg "$work/$d.svg"
  done
  # Past 64 ranks the timeline draws the first 64 and says so.
  expect_ok plan --servers 9 --gpus 8 --uniform --bytes-per-rank 1M --repeat 1 --svg "$work/big.svg" &&
    check_svg "$work/big.svg" "first 64 of 72 ranks"
  # One server: nothing crosses a NIC.
  expect_ok plan --servers 1 --gpus 8 --uniform --bytes-per-rank 1M --svg "$work/one.svg" --report "$work/one.jsonl" &&
    check_svg "$work/one.svg" && check_report "$work/one.jsonl" 1 8 1 8 $((8 * 1024 * 1024))
  # No traffic at all still plans (zero bytes, zero stages) and draws.
  expect_ok plan --servers 2 --gpus 2 --uniform --bytes-per-rank 0 --svg "$work/zero.svg" --report "$work/zero.jsonl" &&
    check_svg "$work/zero.svg" && check_report "$work/zero.jsonl" 1 4 2 2 0
  # Help.
  expect_ok --help && { grep -q 'usage: fasta2a plan' "$work/out" || fail "--help shows no usage"; }
  expect_ok plan --help && { grep -q -- '--servers S' "$work/out" || fail "plan --help shows no options"; }
  ;;

errors)
  need_megatron
  trace=(--matrix "$megatron" --unit 8192)
  ok=(plan --servers 4 --gpus 8)
  expect_error 'usage'
  expect_error 'unknown command' frobnicate
  expect_error 'unknown option' "${ok[@]}" --uniform --frobnicate
  expect_error 'needs a value' plan --gpus 8 --uniform --servers
  expect_error 'needs a value' plan --servers --gpus 8 --uniform
  expect_error 'takes no value' "${ok[@]}" --uniform=yes
  expect_error 'non-negative integer' plan --servers 4 --gpus eight --uniform
  expect_error 'non-negative integer' "${ok[@]}" --uniform --bytes-per-rank 1.5M
  expect_error 'negative' plan --servers -4 --gpus 8 --uniform
  expect_error 'negative' "${ok[@]}" --uniform --alpha -1
  expect_error 'negative' "${ok[@]}" --zipf -1
  expect_error 'non-negative number' "${ok[@]}" --zipf nan
  expect_error 'non-negative number' "${ok[@]}" --lognormal abc
  expect_error 'at least 1' plan --servers 0 --gpus 8 --uniform
  expect_error 'at least 1' plan --servers 4 --gpus 0 --uniform
  expect_error 'at least 1' "${ok[@]}" --uniform --repeat 0
  expect_error 'at least 1' "${ok[@]}" --uniform --granule 0
  expect_error 'too large' plan --servers 99999999999 --gpus 8 --uniform
  expect_error 'required' plan --gpus 8 --uniform
  expect_error 'more than once' "${ok[@]}" --uniform --seed 1 --seed 2
  expect_error 'switch or mesh' "${ok[@]}" --uniform --scaleup torus
  expect_error 'birkhoff' "${ok[@]}" --uniform --decomposer greedy
  expect_error 'unexpected argument' "${ok[@]}" --uniform stray
  # Inputs: none, two, options of the other kind of input.
  expect_error 'no input' "${ok[@]}"
  expect_error 'two inputs' "${ok[@]}" --uniform --zipf 1
  expect_error 'two inputs' "${ok[@]}" "${trace[@]}" --hotspot 2
  expect_error 'matrix only' "${ok[@]}" --uniform --unit 8192
  expect_error 'matrix only' "${ok[@]}" --zipf 1 --all
  expect_error 'generators only' "${ok[@]}" "${trace[@]}" --bytes-per-rank 1M
  expect_error 'hotspot only' "${ok[@]}" --uniform --hot-share 0.2
  expect_error 'cannot be combined' "${ok[@]}" "${trace[@]}" --all --index 3
  expect_error 'hot' "${ok[@]}" --hotspot 33
  expect_error 'hot-share' "${ok[@]}" --hotspot 2 --hot-share 1.5
  # Trace files: missing, malformed, truncated, empty, past the end, not of S x G ranks.
  expect_error 'cannot open' "${ok[@]}" --matrix "$work/no-such-file.txt"
  printf '1 2 3\n4 x 6\n' >"$work/malformed.txt"
  expect_error 'not a non-negative decimal integer' plan --servers 1 --gpus 2 --matrix "$work/malformed.txt"
  head -n 1000 "$megatron" >"$work/truncated.txt"
  expect_error 'truncated' "${ok[@]}" --matrix "$work/truncated.txt"
  : >"$work/empty.txt"
  expect_error 'empty' "${ok[@]}" --matrix "$work/empty.txt"
  expect_error 'past the end' "${ok[@]}" "${trace[@]}" --index 600
  expect_error 'past the end' "${ok[@]}" "${trace[@]}" --index 18446744073709551615
  expect_error 'whole number' plan --servers 3 --gpus 8 "${trace[@]}"
  # Sizes and sums past 64 bits.
  expect_error 'too large' "${ok[@]}" --uniform --bytes-per-rank 99999999999999999999
  expect_error 'overflows' "${ok[@]}" --uniform --bytes-per-rank 17179869184G
  expect_error 'overflows' "${ok[@]}" --uniform --bytes-per-rank 16000000000000000000
  expect_error 'overflows' "${ok[@]}" --hotspot 1 --bytes-per-rank 1000000000000000000
  expect_error 'overflows' "${ok[@]}" --matrix "$megatron" --unit 18446744073709551615
  expect_error 'overflows' "${ok[@]}" --matrix "$megatron" --unit 4000000000000000
  # A plan whose bytes fit in 64 bits but whose scale-up traffic does not (bytes that take two
  # scale-up hops count twice): rank 0 sends nearly 2^64 bytes to rank 5 of the other server.
  "$python" -c "
n = 8
m = [[0] * n for _ in range(n)]
m[0][5] = 18000000000000000000
print('\\n'.join(' '.join(map(str, r)) for r in m))" >"$work/scaleup-overflow.txt"
  expect_error 'overflows' plan --servers 2 --gpus 4 --matrix "$work/scaleup-overflow.txt"
  # Plans past the size limit.
  expect_error 'limit' "${ok[@]}" "${trace[@]}" --max-plan-bytes 64K
  expect_error 'limit' plan --servers 100000 --gpus 8 --uniform
  # Output files that cannot be written.
  expect_error 'cannot open' "${ok[@]}" --uniform --json "$work/no-such-dir/plan.json"
  expect_error 'cannot open' "${ok[@]}" --uniform --report "$work/no-such-dir/report.jsonl"
  expect_error 'cannot open' "${ok[@]}" --uniform --svg "$work/no-such-dir/t.svg"
  ;;

robust)
  # Issue 12, defect 8: each of these named the wrong problem (or read gigabytes first).
  ok=(plan --servers 2 --gpus 2)
  printf '1 1 1 1\n1 1 1 1\n1 1 1 1\n1 1 1 1\n' >"$work/ones4.txt"
  expect_ok "${ok[@]}" --matrix "$work/ones4.txt"
  # A directory is not "out of memory".
  mkdir "$work/adir"
  expect_error 'is a directory' "${ok[@]}" --matrix "$work/adir"
  # Issue 50, defect 11: nor is anything else that is not a regular file, and each is refused
  # before it is opened (a FIFO nobody writes blocked in open() for ever; `timeout` turns that into
  # status 124), naming what it is, by plan and run alike.
  mkfifo "$work/fifo"
  "$python" -c 'import socket, sys; socket.socket(socket.AF_UNIX).bind(sys.argv[1])' "$work/sock"
  not_regular=("$work/fifo" "/dev/zero" "/dev/null" "$work/sock" "$work/adir")
  kinds=("a FIFO" "a character device" "a character device" "a socket" "a directory")
  for k in "${!not_regular[@]}"; do
    for cmd in plan run; do
      ( exec timeout 20 "$bin" $cmd --servers 2 --gpus 2 --matrix "${not_regular[$k]}" ) >"$work/out" 2>"$work/err"
      rc=$?
      want="fasta2a: error: trace file '${not_regular[$k]}' is ${kinds[$k]}, not a regular file"
      if [ "$rc" -ne 2 ] || ! grep -qxF "$want" "$work/err" || [ -s "$work/out" ]; then
        fail "$cmd --matrix ${not_regular[$k]}: exit $rc (want 2 within 20 s), stderr: $(head -c 300 "$work/err") (want: $want)"
      fi
    done
  done
  # A symbolic link to a regular file is read as the file.
  ln -s "$work/ones4.txt" "$work/link.txt"
  expect_ok "${ok[@]}" --matrix "$work/link.txt"
  # Issue 50, defect 12: generator options whose every count rounds down to 0 made an all-zero
  # matrix and exited 0; every generator now says so, naming the options, for plan and run.
  for gen in --uniform "--zipf 1.2" "--hotspot 1" "--lognormal 0.5"; do
    # shellcheck disable=SC2086 # the generator's flag and value are two words
    expect_error "$gen with --bytes-per-rank 1K rounded down to a multiple of --granule 1G gives no traffic: every count is 0" \
      "${ok[@]}" $gen --granule 1G --bytes-per-rank 1K
    # shellcheck disable=SC2086
    expect_error "$gen with --bytes-per-rank 4095 rounded down to a multiple of --granule 4K gives no traffic" \
      run --servers 2 --gpus 2 $gen --granule 4K --bytes-per-rank 4095 --iters 1
  done
  # Log-normal loads with a huge SIGMA: every rank's draw is a tiny fraction of the mean.
  expect_error "--lognormal 1e+06 with --bytes-per-rank 64M and --granule 1 gives no traffic: every rank's load" \
    "${ok[@]}" --lognormal 1e6
  # Still planned: one granule per rank, --bytes-per-rank 0 (no traffic asked for), and a trace's
  # all-zero matrix (what was recorded).
  expect_ok "${ok[@]}" --uniform --granule 1G --bytes-per-rank 1G
  expect_ok "${ok[@]}" --zipf 1.2 --bytes-per-rank 0
  printf '0 0 0 0\n0 0 0 0\n0 0 0 0\n0 0 0 0\n' >"$work/zeros4.txt"
  expect_ok "${ok[@]}" --matrix "$work/zeros4.txt"
  # A 2 GB sparse file (NUL bytes) is refused at its first byte, not read whole: 20 s and 200 MB
  # of address space are far less than reading it takes.
  truncate -s 2G "$work/sparse.txt"
  ( ulimit -v 200000; exec timeout 20 "$bin" "${ok[@]}" --matrix "$work/sparse.txt" ) >"$work/out" 2>"$work/err"
  rc=$?
  if [ "$rc" -ne 2 ] || ! grep -q "fasta2a: error: .*'\\\\x00.*' is not a non-negative decimal integer" "$work/err"; then
    fail "2 GB sparse file: exit $rc (want 2 within 20 s), stderr: $(head -c 300 "$work/err")"
  fi
  rm -f "$work/sparse.txt"
  # A NUL byte inside a token is shown escaped; the message goes on past it.
  printf '1 1 1 1\n1 1 1 1\n1 1\0002 1 1\n1 1 1 1\n' >"$work/nul.txt"
  run "${ok[@]}" --matrix "$work/nul.txt"
  if [ "$rc" -ne 2 ] || ! grep -qa "'1 1\\\\x002' is not a non-negative decimal integer\|'1\\\\x002' is not a non-negative decimal integer" "$work/err"; then
    fail "NUL byte: exit $rc, stderr: $(cat -v "$work/err")"
  fi
  if [ "$(tr -dc '\000' <"$work/err" | wc -c)" -ne 0 ]; then fail "NUL byte: the message holds a raw NUL"; fi
  # One 2^64-1-byte message: refused before allocating, naming the rank and the message.
  printf '0 18446744073709551615 0 0\n0 0 0 0\n0 0 0 0\n0 0 0 0\n' >"$work/big.txt"
  run run --servers 2 --gpus 2 --matrix "$work/big.txt" --iters 1
  if [ "$rc" -ne 2 ] || ! grep -q "fasta2a: error: rank 0 would send 18446744073709551615 bytes (its largest message: 18446744073709551615 bytes to rank 1)" "$work/err" || [ -s "$work/out" ]; then
    fail "2^64-1-byte message: exit $rc, stdout $(head -c 100 "$work/out"), stderr: $(cat "$work/err")"
  fi
  expect_error 'rank 0 would send 18446744073709551615 bytes' run --servers 2 --gpus 2 --uniform \
    --bytes-per-rank 18446744073709551615 --iters 1
  expect_error 'overflows 64 bits' plan --servers 2 --gpus 2 --uniform --bytes-per-rank 18446744073709551615
  # Defect 6: the planner's S^2 x G scratch is counted against --max-plan-bytes before it is made.
  ( ulimit -v 800000; exec timeout 60 "$bin" plan --servers 4096 --gpus 1 --uniform --bytes-per-rank 0 \
      --max-plan-bytes 256M ) >"$work/out" 2>"$work/err"
  rc=$?
  if [ "$rc" -ne 2 ] || ! grep -q "fasta2a: error: 4096 servers x 1 GPUs need about [0-9]* bytes to plan .* limit of 268435456 bytes" "$work/err"; then
    fail "4096 x 1 with --max-plan-bytes 256M: exit $rc, stderr: $(cat "$work/err")"
  fi
  # Under the limit it plans; a planner limit below its own scratch is refused by the library too.
  expect_ok plan --servers 64 --gpus 1 --uniform --bytes-per-rank 64K --max-plan-bytes 16M
  expect_error 'scratch' plan --servers 16 --gpus 8 --uniform --bytes-per-rank 64K --max-plan-bytes 200K
  # Defect 7: `run` refuses what cannot fit in this process (the engine state of 4096 ranks).
  ( ulimit -v 4000000; exec timeout 60 "$bin" run --servers 512 --gpus 8 --uniform --bytes-per-rank 1K --iters 1 ) \
      >"$work/out" 2>"$work/err"
  rc=$?
  if [ "$rc" -ne 2 ] || ! grep -q "fasta2a: error: 4096 ranks need about [0-9]* bytes here .* grows as ranks^2" "$work/err"; then
    fail "run 512 x 8: exit $rc, stderr: $(cat "$work/err")"
  fi
  ;;

rank)
  rank_keys='{"index","ranks","servers","gpus","rank","bytes","stages","pieces","ops","staging_bytes","staging_bytes_max","lower_bound_s","lower_bound_alpha_s","predicted_scaleout_s","synthesis_rank_us","decomposer","choice","checked"}'
  # check_rank_report FILE RANK CHECKED [WHOLE]: one line with the --rank keys, for rank RANK,
  # checked as CHECKED; with WHOLE (a report of the same input without --rank), the same stages,
  # bytes, bounds and largest staging buffer, and a scale-out time no more than the whole prediction.
  check_rank_report() {
    py "
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
assert len(rows) == 1, f'{len(rows)} report lines, want 1'
r = rows[0]
assert set(r) == $rank_keys, f'keys {sorted(r)}'
assert r['rank'] == int(sys.argv[2]) and r['checked'] == sys.argv[3], r
assert r['pieces'] > 0 and r['ops'] >= r['pieces'] and r['synthesis_rank_us'] > 0, r
assert 0 <= r['staging_bytes'] <= r['staging_bytes_max'], r
assert r['lower_bound_alpha_s'] >= r['lower_bound_s'] > 0, r
if r['decomposer'] != 'direct':
    assert r['predicted_scaleout_s'] >= r['lower_bound_alpha_s'] * (1 - 1e-9), r
if len(sys.argv) > 4:
    w = json.loads(open(sys.argv[4]).readline())
    for k in ('ranks', 'servers', 'gpus', 'bytes', 'stages', 'lower_bound_s', 'lower_bound_alpha_s', 'decomposer', 'choice'):
        assert r[k] == w[k], (k, r[k], w[k])
    assert r['staging_bytes_max'] == w['staging_bytes'], (r, w)
    assert r['predicted_scaleout_s'] <= w['predicted_s'] * (1 + 1e-9), (r, w)
" "$@"
  }
  # Small: the part is compared with the whole plan, for several ranks, decomposers and both
  # topology kinds (8 GPUs: compile-time sized; 3: runtime sized, mesh).
  for d in slack quantized birkhoff spread-out direct; do
    for r in 0 13 31; do
      expect_ok plan --servers 4 --gpus 8 --zipf 1.2 --bytes-per-rank 1M --granule 4K --decomposer "$d" \
        --rank "$r" --repeat 1 --report "$work/r.jsonl" || continue
      grep -q "rank $r's part checked, and equal to the whole plan's part for that rank" "$work/out" ||
        fail "--rank $r ($d): the part was not compared with the whole plan: $(cat "$work/out")"
      expect_ok plan --servers 4 --gpus 8 --zipf 1.2 --bytes-per-rank 1M --granule 4K --decomposer "$d" \
        --repeat 1 --report "$work/w.jsonl" && check_rank_report "$work/r.jsonl" "$r" "whole plan" "$work/w.jsonl"
    done
  done
  for r in 0 7 14; do
    expect_ok plan --servers 5 --gpus 3 --hotspot 2 --bytes-per-rank 768K --scaleup mesh --decomposer best \
      --adaptive --rank "$r" --repeat 1 --report "$work/m.jsonl" && check_rank_report "$work/m.jsonl" "$r" "whole plan"
  done
  # Every matrix of a trace, rank 5's part of each (where the trace is there).
  if [ -f "$megatron" ]; then
    if expect_ok plan --servers 4 --gpus 8 --matrix "$all_trace" --unit 8192 --all --repeat 1 --rank 5 \
        --decomposer slack --report "$work/all.jsonl"; then
      [ "$(grep -Ec '^ +[0-9]+ +32 +4x8 +5 ' "$work/out")" -eq "$all_matrices" ] ||
        fail "--all --rank 5 did not print $all_matrices rows"
      [ "$(grep -c 'equal to the whole plan' "$work/out")" -eq "$all_matrices" ] ||
        fail "--all --rank 5: not every part compared"
      grep -Eq "^# summary over $all_matrices matrices \(medians\): synthesis [0-9.]+ us rank 5's part" "$work/out" ||
        fail "--all --rank 5 printed no summary line"
    fi
  fi
  # Past 256 ranks the whole plan is not built: the part is checked on its own.
  if expect_ok plan --servers 64 --gpus 8 --zipf 1.0 --granule 8192 --decomposer slack --rank 300 --repeat 1 \
      --report "$work/big.jsonl"; then
    grep -q "rank 300's part checked on its own" "$work/out" || fail "64 x 8 --rank 300: $(cat "$work/out")"
    check_rank_report "$work/big.jsonl" 300 "own messages"
  fi
  # Below 256 ranks but past --max-plan-bytes for the whole plan: on its own too.
  expect_ok plan --servers 16 --gpus 8 --uniform --bytes-per-rank 64K --rank 3 --repeat 1 --max-plan-bytes 300K &&
    { grep -q "rank 3's part checked on its own" "$work/out" || fail "16 x 8 under 300K: $(cat "$work/out")"; }
  # Errors: ranks out of range, outputs of the whole plan, run.
  expect_error 'not a rank of 4 servers x 8 GPUs (ranks 0 to 31)' plan --servers 4 --gpus 8 --uniform --rank 32
  expect_error 'not a rank of 2 servers x 3 GPUs' plan --servers 2 --gpus 3 --uniform --rank 1000000
  expect_error 'negative' plan --servers 4 --gpus 8 --uniform --rank -1
  expect_error 'non-negative integer' plan --servers 4 --gpus 8 --uniform --rank x
  expect_error 'too large' plan --servers 4 --gpus 8 --uniform --rank 99999999999
  expect_error '--json needs the whole plan' plan --servers 4 --gpus 8 --uniform --rank 1 --json "$work/x.json"
  expect_error '--svg needs the whole plan' plan --servers 4 --gpus 8 --uniform --rank 1 --svg "$work/x.svg"
  expect_error 'does not apply to fasta2a run' run --servers 4 --gpus 8 --uniform --rank 1
  expect_error 'rank 3.s part' plan --servers 64 --gpus 8 --uniform --rank 3 --max-plan-bytes 1M
  ;;

*)
  echo "unknown mode '$mode' (trace, generator, errors, rank or robust)" >&2
  exit 2
  ;;
esac

if [ "$failures" -gt 0 ]; then
  echo "$failures check(s) failed" >&2
  exit 1
fi
echo "all $mode checks passed"
