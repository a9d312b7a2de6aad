#!/usr/bin/env bash
# fasta2a: starts N processes of one command on this machine without MPI, as torchrun would: each
# with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and FASTA2A_JOB_SECRET (drawn for the
# job unless set) set (fasta2a::tcp_bootstrap reads them). Waits for all; if one fails, or the time limit passes, the others are killed (by process
# id). Exits with the worst exit status of the ranks that ended by themselves (124 on the time
# limit).
#
#   launch_ranks.sh [-n N] [-t SECONDS] [-p PORT] [--] COMMAND [ARGS...]
#
#   -n N        processes (default 4)
#   -t SECONDS  time limit for the whole run (default 300)
#   -p PORT     rank 0's port (default: a free one, found with python3)
# MASTER_ADDR is 127.0.0.1 unless set. Each rank's output lines are prefixed "[rank r] ".
set -uo pipefail

n=4 limit=300 port=
while (($# > 0)); do
  case $1 in
    -n) n=$2; shift 2 ;;
    -t) limit=$2; shift 2 ;;
    -p) port=$2; shift 2 ;;
    --) shift; break ;;
    -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) break ;;
  esac
done
(($# >= 1)) || { echo "launch_ranks.sh: error: no command (see --help)" >&2; exit 2; }
[[ $n =~ ^[0-9]+$ && $n -ge 1 ]] || { echo "launch_ranks.sh: error: -n needs a positive integer, got '$n'" >&2; exit 2; }
if [[ -z $port ]]; then
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])') ||
    { echo "launch_ranks.sh: error: cannot find a free port (give -p PORT)" >&2; exit 2; }
fi
export MASTER_ADDR=${MASTER_ADDR:-127.0.0.1} MASTER_PORT=$port WORLD_SIZE=$n
# The job's secret (fasta2a::tcp_bootstrap: only processes that hold it join the job), drawn here
# unless set; in the environment, where other users cannot read it.
if [[ -z ${FASTA2A_JOB_SECRET:-} ]]; then
  FASTA2A_JOB_SECRET=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n') ||
    { echo "launch_ranks.sh: error: cannot draw a job secret from /dev/urandom" >&2; exit 2; }
fi
export FASTA2A_JOB_SECRET

pids=()
for ((r = 0; r < n; ++r)); do
  # Each rank leads a process group of its own (setsid), so that killing it kills its children too.
  (RANK=$r LOCAL_RANK=$r LOCAL_WORLD_SIZE=$n exec setsid "$@") > >(sed -u "s/^/[rank $r] /") 2> >(sed -u "s/^/[rank $r] /" >&2) &
  pids+=($!)
done

killed=0
kill_rest() {
  ((killed)) && return
  killed=1
  local p
  for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null || kill -TERM "$p" 2>/dev/null; done
  sleep 1
  for p in "${pids[@]}"; do kill -KILL -- "-$p" 2>/dev/null || kill -KILL "$p" 2>/dev/null; done
}
trap 'kill_rest; exit 130' INT TERM

worst=0 left=$n start=$SECONDS
declare -A done_=()
while ((left > 0)); do
  for r in "${!pids[@]}"; do
    [[ -n ${done_[$r]:-} ]] && continue
    p=${pids[$r]}
    if ! kill -0 "$p" 2>/dev/null; then
      wait "$p"; rc=$?
      done_[$r]=1
      left=$((left - 1))
      if ((rc != 0 && !killed)); then # the ranks killed here do not count
        echo "launch_ranks.sh: rank $r exited with status $rc; stopping the others" >&2
        ((rc > worst)) && worst=$rc
        kill_rest
      fi
    fi
  done
  if ((left > 0 && SECONDS - start >= limit)); then
    echo "launch_ranks.sh: error: the ranks did not finish within ${limit} s; killing them" >&2
    kill_rest
    worst=124
    break
  fi
  ((left > 0)) && sleep 0.1
done
wait 2>/dev/null
exit "$worst"
