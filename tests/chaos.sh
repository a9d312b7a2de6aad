#!/usr/bin/env bash
# Chaos test (issue 12): `fasta2a run --transport mpi` on 8 ranks under mpirun, and one rank (5)
# stopped (SIGSTOP, held past the timeout) or killed (SIGKILL) in the middle of the run.
#
#   chaos.sh stop|kill FASTA2A MPIEXEC [MPIEXEC FLAGS...]
#
# Asserts, from the moment of the signal:
#   - mpirun and every other rank end within --timeout plus SLACK seconds, mpirun with a nonzero
#     status; every survivor that ends by itself (not killed by mpirun's abort) exits nonzero;
#   - the job's output names the missing rank: stop, an engine or CLI timeout error ("fasta2a: error:
#     ... rank 5 ..."); kill, that or Open MPI's own notice that rank 5 died;
#   - no survivor spins while it waits: from half a second after the signal to its end, its CPU time
#     is under CPU_SHARE percent of that wall time, and it blocks (sleeps) at least 50 times a second;
#   - nothing is left behind: every process of the job is killed at the end, whatever happens.
# Prints each survivor's end time (seconds after the signal), CPU share and how it ended.
# Exit 0 pass, 1 fail, 77 skipped (no mpirun, or not Open MPI: ranks are found by
# OMPI_COMM_WORLD_RANK and the output is split by --tag-output).
set -u

mode=$1
cli=$2
shift 2
launcher=("$@")
ranks=8
victim=5
timeout_ms=${CHAOS_TIMEOUT_MS:-3000}
slack_s=${CHAOS_SLACK_S:-6}
cpu_share=${CHAOS_CPU_SHARE:-15}

case $mode in stop | kill) ;; *) echo "chaos.sh: mode must be stop or kill, got '$mode'" >&2; exit 1 ;; esac
if ! command -v "${launcher[0]:-mpirun}" >/dev/null 2>&1; then
  echo "chaos.sh: skipped: ${launcher[0]:-mpirun} not found"
  exit 77
fi
if ! "${launcher[0]}" --version 2>&1 | grep -q "Open MPI\|OpenRTE"; then
  echo "chaos.sh: skipped: ${launcher[0]} is not Open MPI's (this test finds ranks by OMPI_COMM_WORLD_RANK)"
  exit 77
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/fasta2a-chaos.XXXXXX")
mpi_pid=""
declare -a pid=()
# Everything started here is killed at the end, whatever happened: the ranks one by one (a stopped
# process dies of SIGKILL too), then mpirun's whole session.
cleanup() {
  for p in "${pid[@]}"; do kill -KILL "$p" 2>/dev/null; done
  if [ -n "$mpi_pid" ]; then
    kill -KILL -- "-$mpi_pid" 2>/dev/null
    kill -KILL "$mpi_pid" 2>/dev/null
  fi
  wait 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

failures=0
fail() {
  echo "FAIL: $*" >&2
  failures=$((failures + 1))
}
# No command substitution in what the watch loop calls (a fork per value is slow on a loaded
# machine): the results are left in variables.
# cpu_of PID: CPU=user + system time in clock ticks; empty when the process is gone or a zombie.
cpu_of() {
  CPU=""
  local line
  read -r line <"/proc/$1/stat" 2>/dev/null || return 0
  line=${line##*) } # the fields after "(comm) "
  read -r -a f <<<"$line"
  [ "${f[0]}" = Z ] && return 0
  CPU=$((f[11] + f[12]))
}
tick_us=$((1000000 / $(getconf CLK_TCK)))
# sleeps_of PID: SLEEPS=how many times it has blocked (voluntary context switches). A process that
# waits by sleeping blocks hundreds of times a second; one that spins (or only yields) almost never,
# whatever the load of the machine: the load-independent sign of spinning.
sleeps_of() {
  SLEEPS=""
  local k v
  while read -r k v; do [ "$k" = voluntary_ctxt_switches: ] && SLEEPS=$v; done <"/proc/$1/status" 2>/dev/null
}

# A run long enough to be interrupted mid-way: many calls of a small uniform all-to-allv on 4
# servers x 2 GPUs, the engine's (and the CLI's collectives') timeout short.
setsid "${launcher[@]}" -np "$ranks" --tag-output "$cli" run --transport mpi --gpus 2 --uniform \
  --bytes-per-rank 256K --iters 1000000 --timeout "$timeout_ms" >"$work/log" 2>&1 &
mpi_pid=$!

# Find the ranks (mpirun's children, named by OMPI_COMM_WORLD_RANK), then wait for the calls to run.
deadline=$((${EPOCHREALTIME/./} + 120000000))
while :; do
  for p in $(pgrep -P "$mpi_pid"); do
    r=$(tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | sed -n 's/^OMPI_COMM_WORLD_RANK=//p')
    [ -n "$r" ] && pid[r]=$p
  done
  [ ${#pid[@]} -eq "$ranks" ] && grep -q "<stdout>:# call" "$work/log" && break
  if ! kill -0 "$mpi_pid" 2>/dev/null || [ "${EPOCHREALTIME/./}" -gt "$deadline" ]; then
    echo "FAIL: the run did not start (ranks found: ${!pid[*]}); its output:" >&2
    cat "$work/log" >&2
    exit 1
  fi
  sleep 0.2
done
sleep 1.5 # in the timed calls
for r in "${!pid[@]}"; do
  cpu_of "${pid[r]}"
  [ -n "$CPU" ] || { echo "FAIL: rank $r ended before the signal:" >&2; cat "$work/log" >&2; exit 1; }
done

# The signal, then every rank watched every 100 ms: its CPU time and when it ends.
if [ "$mode" = stop ]; then sig=STOP; else sig=KILL; fi
t0=${EPOCHREALTIME/./}
kill "-$sig" "${pid[victim]}"
declare -a end_us=() cpu_first=() cpu_last=() first_us=() last_us=() sleeps_first=() sleeps_last=()
mpi_end_us=""
bound_us=$((timeout_ms * 1000 + slack_s * 1000000))
while :; do
  t=${EPOCHREALTIME/./}
  alive=0
  for r in "${!pid[@]}"; do
    [ "$r" -eq "$victim" ] && continue
    [ -n "${end_us[r]:-}" ] && continue
    cpu_of "${pid[r]}"
    c=$CPU
    if [ -z "$c" ]; then
      end_us[r]=$t
      continue
    fi
    alive=1
    if [ $((t - t0)) -ge 500000 ] && [ -z "${cpu_first[r]:-}" ]; then
      cpu_first[r]=$c
      first_us[r]=$t
      sleeps_of "${pid[r]}"
      sleeps_first[r]=$SLEEPS
    fi
    if [ -n "${cpu_first[r]:-}" ]; then
      sleeps_of "${pid[r]}"
      v=$SLEEPS
      [ -n "$v" ] && sleeps_last[r]=$v
    fi
    cpu_last[r]=$c
    last_us[r]=$t
  done
  if [ -z "$mpi_end_us" ] && ! kill -0 "$mpi_pid" 2>/dev/null; then mpi_end_us=$t; fi
  [ "$alive" -eq 0 ] && [ -n "$mpi_end_us" ] && break
  [ $((t - t0)) -gt $((bound_us + 20000000)) ] && break # give up well past the bound
  sleep 0.05
done
mpi_rc=0
if [ -n "$mpi_end_us" ]; then wait "$mpi_pid"; mpi_rc=$?; fi

secs() { awk -v u="$1" 'BEGIN { printf "%.2f", u / 1e6 }'; }
echo "chaos.sh: rank $victim got SIG$sig; --timeout ${timeout_ms} ms; bound $(secs "$bound_us") s after the signal"
if [ -z "$mpi_end_us" ]; then
  fail "mpirun still running $(secs $((${EPOCHREALTIME/./} - t0))) s after the signal"
else
  echo "  mpirun: ended after $(secs $((mpi_end_us - t0))) s, exit status $mpi_rc"
  [ $((mpi_end_us - t0)) -le "$bound_us" ] || fail "mpirun ended $(secs $((mpi_end_us - t0))) s after the signal"
  [ "$mpi_rc" -ne 0 ] || fail "mpirun exited 0 although rank $victim was ${mode}ped"
fi
for r in "${!pid[@]}"; do
  [ "$r" -eq "$victim" ] && continue
  # What this rank said (Open MPI's --tag-output: "[1,R]<stderr>:...").
  said=$(grep -a "^\[[0-9]*,$r\]<stderr>:" "$work/log" | sed 's/\[[0-9]*,[0-9]*\]<std[a-z]*>://g' | head -3 | tr '\n' ' ')
  line="  rank $r:"
  if [ -z "${end_us[r]:-}" ]; then
    fail "rank $r still running $(secs $((${EPOCHREALTIME/./} - t0))) s after the signal"
    line+=" still running;"
  else
    e=$((end_us[r] - t0))
    line+=" ended after $(secs "$e") s;"
    [ "$e" -le "$bound_us" ] || fail "rank $r ended $(secs "$e") s after the signal (bound $(secs "$bound_us") s)"
  fi
  if [ -n "${cpu_first[r]:-}" ] && [ "${last_us[r]}" -gt "${first_us[r]}" ]; then
    wall=$((last_us[r] - first_us[r]))
    used=$(((cpu_last[r] - cpu_first[r]) * tick_us))
    share=$((used * 100 / wall))
    blocked=$(((${sleeps_last[r]:-0} - ${sleeps_first[r]:-0}) * 1000000 / wall))
    line+=" CPU $(secs "$used") s over $(secs "$wall") s waiting (${share}%, blocked ${blocked}/s);"
    if [ "$wall" -ge 300000 ]; then
      [ "$share" -lt "$cpu_share" ] || fail "rank $r used ${share}% of a core while waiting (bound ${cpu_share}%): it spins"
      # A rank that used under 1% of a core did not spin, however seldom it blocked (its sleeps ran
      # long: once 25 a second at 0.00 s of CPU in a clean-clone CI run).
      [ "$blocked" -ge 50 ] || [ "$share" -lt 1 ] || fail "rank $r blocked only ${blocked} times a second while waiting: it spins"
    fi
  else
    line+=" (ended before its CPU time could be sampled);"
  fi
  echo "$line ${said:-(said nothing: ended by mpirun)}"
done

# The missing rank is named: by a survivor's error (the CLI's barrier or the engine's wait), or for
# a killed rank by Open MPI itself.
named="rank(s|\\(s\\))? ([0-9]+, )*$victim([^0-9]|$)" # "rank 5", "ranks 2, 5", "rank(s) 5"
if grep -aE "<stderr>:fasta2a: error: .*$named" "$work/log" >/dev/null; then
  echo "  named by: $(grep -aE "<stderr>:fasta2a: error: .*$named" "$work/log" | head -1)"
elif [ "$mode" = kill ] && grep -aE "process rank $victim .*(exited on signal|killed)" "$work/log" >/dev/null; then
  echo "  named by mpirun: $(grep -aE "process rank $victim " "$work/log" | head -1)"
else
  fail "no error names rank $victim"
  if grep -aq "mpi_bootstrap::allgather: .*some rank did not reach the allgather" "$work/log"; then
    echo "  (the stop landed in the engine's per-call allgather, and its roll call did not name the" \
      "missing rank: see mpi_bootstrap::roll_call)" >&2
  fi
fi
# A survivor that failed by itself exits with its error's status (MPI_Abort(2)), never 0.
if grep -aE "MPI_ABORT was invoked on rank [0-9]+ in communicator MPI_COMM_WORLD" "$work/log" >/dev/null; then
  code=$(grep -aoE "with errorcode [0-9]+" "$work/log" | head -1 | grep -oE "[0-9]+$")
  echo "  $(grep -aoE "MPI_ABORT was invoked on rank [0-9]+ .* errorcode [0-9]+" "$work/log" | head -1)"
  [ "${code:-0}" -ne 0 ] || fail "a rank aborted with error code 0"
fi
if [ "$failures" -ne 0 ] || [ -n "${CHAOS_VERBOSE:-}" ]; then
  echo "--- the job's output ---" >&2
  tail -n 60 "$work/log" >&2
  exit 1
fi
echo "chaos.sh $mode: pass"
exit 0
