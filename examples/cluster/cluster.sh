#!/usr/bin/env bash
# fasta2a: a two-tier cluster emulated on one Linux machine (run as root).
#
#   cluster.sh up S G RATE_MBIT   S "servers" (network namespaces) x G ranks, one veth "NIC" per rank,
#                                 every NIC shaped to RATE_MBIT Mbit/s on send and on receive
#   cluster.sh run [--] CMD ARGS  one MPI job of S*G ranks across the servers (Open MPI)
#   cluster.sh launch [-t SECONDS] [-p PORT] [--] CMD ARGS
#                                 S*G processes of CMD without MPI, rank (s, k) in server s's
#                                 namespace with torchrun's RANK, WORLD_SIZE, LOCAL_RANK,
#                                 MASTER_ADDR (rank 0's NIC), MASTER_PORT (default 29500),
#                                 FASTA2A_JOB_SECRET (drawn for the job unless set) and
#                                 FI_TCP_IFACE=nic<k>; waits for all, kills the rest when one fails
#                                 or the time limit (default 600 s) passes, exits with the worst
#                                 status of the ranks that ended by themselves (124: time limit)
#   cluster.sh counters           per-NIC bytes sent and received, and packets the shapers dropped
#   cluster.sh status             what is up
#   cluster.sh down               removes everything `up` made and restores every setting it changed
#
# The switch is one Linux bridge in the root namespace. Rank (s, k) owns the veth `nic<k>` in the
# namespace of server s, with its own address; source routing sends its traffic through its own NIC.
# A token-bucket shaper (tc tbf) sits on both ends of every veth: the end in the server limits what
# the rank sends, the end on the bridge what it receives, so many senders into one rank congest its
# NIC (incast) as they would on a real network. Ranks of one server talk through shared memory
# (Open MPI's vader), unshaped: that is the scale-up tier.
#
# Choices measured on this project's 2-core machines (../shared/ENVIRONMENT.md): MTU 9000 with
# offloads off (two cores cannot drive 16 shaped NICs at MTU 1500), TCP congestion control cubic
# (BBR is unfair under incast here), and one Open MPI daemon per server namespace, launched through
# an rsh agent that enters the namespace, so that shared memory is confined to a server.
#
# Environment: FASTA2A_CLUSTER_NAME (default fa2a, at most 6 characters) names the bridge, the
# namespaces and the state directory; FASTA2A_CLUSTER_NET (default 10.77) is the /16 it uses;
# FASTA2A_MPIRUN_ARGS adds arguments to mpirun; FASTA2A_VADER_SINGLE_COPY picks how shared memory
# moves large messages inside a server (default cma: one copy, by the receiver; none: two copies).
# FASTA2A_TCP_FLAGS sets Open MPI's btl_tcp_flags ("default": not set at all, Open MPI's own default,
# which is what a plain mpirun gets). The default here leaves out "put": with it, a large
# point-to-point message over TCP uses an emulated-RDMA pipeline that the receiver drives, and with
# ranks that sleep between polls its transfers stall (measured on 4 x 4 uniform, 64 MiB per rank:
# MPI_Isend/MPI_Irecv 3.61 s with put, 2.09 s without; MPI_Ialltoallv 2.12 s either way). One cluster at a time per machine is the supported
# use (the congestion-control setting it changes is global).
set -Eeuo pipefail

NAME=${FASTA2A_CLUSTER_NAME:-fa2a}
NET=${FASTA2A_CLUSTER_NET:-10.77}
STATE_DIR=/run/fasta2a-cluster-$NAME
STATE=$STATE_DIR/state
SAVED=$STATE_DIR/sysctl.saved
BRIDGE=$NAME-br

die() { echo "cluster.sh: error: $*" >&2; exit 2; }
note() { echo "cluster.sh: $*" >&2; }

usage() {
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
}

ns_name() { echo "$NAME-srv$1"; }           # server s's namespace (also its MPI host name)
host_if() { echo "${NAME}s$1n$2"; }         # rank (s, k)'s veth end on the bridge
rank_ip() { echo "$NET.$(( $1 + 1 )).$(( $2 + 1 ))"; }

need_root() {
  [[ $(id -u) -eq 0 ]] || die "must run as root (network namespaces, tc, sysctl)"
}

need_tools() {
  local t missing=()
  for t in "$@"; do command -v "$t" >/dev/null 2>&1 || missing+=("$t"); done
  ((${#missing[@]} == 0)) ||
    die "missing ${missing[*]} (Debian: apt-get install iproute2 ethtool openmpi-bin libopenmpi-dev)"
}

state_get() { # key -> value from the state file, empty when absent
  [[ -f $STATE ]] || return 0
  sed -n "s/^$1=//p" "$STATE" | tail -n1
}

# Sets a sysctl, first saving its old value (once: a second `up` does not save our own value).
set_sysctl() {
  local key=$1 value=$2 path=/proc/sys/${1//.//}
  [[ -e $path ]] || return 0
  if ! grep -q "^$key=" "$SAVED" 2>/dev/null; then
    printf '%s=%s\n' "$key" "$(tr '\t' ' ' <"$path")" >>"$SAVED"
  fi
  sysctl -q -w "$key=$value" >/dev/null
}

restore_sysctls() {
  [[ -f $SAVED ]] || return 0
  local line key value
  while IFS= read -r line; do
    key=${line%%=*}
    value=${line#*=}
    sysctl -q -w "$key=$value" >/dev/null 2>&1 || note "could not restore $key to '$value'"
  done <"$SAVED"
  rm -f "$SAVED"
}

# Kills the processes still running in the cluster's namespaces (left by a job that was killed):
# only processes inside our own namespaces, by process id.
kill_ns_processes() {
  local ns pids
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$NAME-srv[0-9]+$" || true); do
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [[ -n $pids ]] || continue
    kill -TERM $pids 2>/dev/null || true
  done
  sleep 0.3
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$NAME-srv[0-9]+$" || true); do
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [[ -n $pids ]] || continue
    kill -KILL $pids 2>/dev/null || true
  done
}

# Removes everything of this cluster whether or not the state file says it exists: a half-made
# cluster (set-up interrupted) or a stale one (state directory lost) is cleaned as well.
cmd_down() {
  need_root
  kill_ns_processes
  local ns link
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$NAME-srv[0-9]+$" || true); do
    ip netns del "$ns" 2>/dev/null || note "could not delete namespace $ns"
  done
  # Deleting a namespace deletes its veth ends and so both ends; remove any stray bridge ends.
  for link in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' |
                grep -E "^${NAME}s[0-9]+n[0-9]+$" || true); do
    ip link del "$link" 2>/dev/null || true
  done
  if ip link show "$BRIDGE" >/dev/null 2>&1; then
    ip link del "$BRIDGE" 2>/dev/null || note "could not delete bridge $BRIDGE"
  fi
  restore_sysctls
  rm -rf "$STATE_DIR"
}

# The rsh agent through which mpirun starts one Open MPI daemon per server: it enters the server's
# namespace, and a UTS namespace of its own whose host name is the server's (Open MPI tells
# servers apart by host name).
write_rsh_agent() {
  cat >"$STATE_DIR/rsh-agent" <<'EOF'
#!/bin/sh
# Open MPI rsh agent of the fasta2a emulated cluster: $1 is a server (namespace) name, the rest
# the command to run there, as ssh would take it.
host=$1
shift
case $host in
  *[!A-Za-z0-9_-]*) echo "rsh-agent: bad host name '$host'" >&2; exit 2 ;;
esac
exec ip netns exec "$host" unshare --uts sh -c "hostname $host; $*"
EOF
  chmod +x "$STATE_DIR/rsh-agent"
}

# The per-rank wrapper: Open MPI's TCP transport of rank (s, k) uses only NIC k of its server, so
# that every byte between servers leaves and enters through the rank's own shaped NIC.
write_rank_wrapper() {
  cat >"$STATE_DIR/rank-wrapper" <<'EOF'
#!/bin/sh
# Per-rank environment of the fasta2a emulated cluster: rank (s, k) talks TCP only over nic<k>,
# through Open MPI's TCP transport and through libfabric's tcp provider alike.
k=${OMPI_COMM_WORLD_LOCAL_RANK:?not started by Open MPI}
export OMPI_MCA_btl_tcp_if_include=nic$k
export FI_TCP_IFACE=nic$k
export FASTA2A_NIC=nic$k
exec "$@"
EOF
  chmod +x "$STATE_DIR/rank-wrapper"
}

shape() { # [netns] dev rate: tbf with a bucket of 64 KB (7 jumbo frames), 20 ms of queue
  local prefix=() dev rate
  if (($# == 3)); then prefix=(-n "$1"); shift; fi
  dev=$1 rate=$2
  tc "${prefix[@]}" qdisc replace dev "$dev" root tbf rate "${rate}mbit" burst 64kb latency 20ms
}

offloads_off() { # [netns] dev
  command -v ethtool >/dev/null 2>&1 || return 0
  if (($# == 2)); then
    ip netns exec "$1" ethtool -K "$2" tso off gso off gro off >/dev/null 2>&1 || true
  else
    ethtool -K "$1" tso off gso off gro off >/dev/null 2>&1 || true
  fi
}

cmd_up() {
  (($# == 3)) || die "usage: cluster.sh up SERVERS GPUS RATE_MBIT"
  local S=$1 G=$2 RATE=$3
  [[ $S =~ ^[0-9]+$ && $S -ge 1 && $S -le 250 ]] || die "SERVERS must be 1..250, got '$S'"
  [[ $G =~ ^[0-9]+$ && $G -ge 1 && $G -le 250 ]] || die "GPUS must be 1..250, got '$G'"
  [[ $RATE =~ ^[0-9]+$ && $RATE -ge 1 ]] || die "RATE_MBIT must be a positive integer, got '$RATE'"
  ((${#NAME} <= 6)) || die "FASTA2A_CLUSTER_NAME must have at most 6 characters"
  need_root
  need_tools ip tc sysctl unshare mpirun
  command -v ethtool >/dev/null 2>&1 ||
    note "ethtool not found: offloads stay on (slower at many NICs; apt-get install ethtool)"
  cmd_down # a half-made or stale cluster of the same name goes first
  mkdir -p "$STATE_DIR"
  # Any failure from here on removes what was made, restores the settings, and says so.
  trap 'rc=$?; trap - ERR INT TERM; note "set-up failed; removing the partial cluster"; cmd_down; exit $(( rc ? rc : 1 ))' ERR
  trap 'trap - ERR INT TERM; note "interrupted; removing the partial cluster"; cmd_down; exit 130' INT TERM
  printf 'servers=%s\ngpus=%s\nrate_mbit=%s\nnet=%s\n' "$S" "$G" "$RATE" "$NET" >"$STATE"

  # A namespace may only choose a congestion control listed as allowed (a global setting).
  local allowed
  allowed=$(cat /proc/sys/net/ipv4/tcp_allowed_congestion_control)
  if ! grep -qw cubic /proc/sys/net/ipv4/tcp_available_congestion_control; then
    modprobe tcp_cubic 2>/dev/null || true
  fi
  grep -qw cubic <<<"$allowed" || set_sysctl net.ipv4.tcp_allowed_congestion_control "$allowed cubic"
  # Bridged frames must not pass through iptables where br_netfilter is loaded.
  set_sysctl net.bridge.bridge-nf-call-iptables 0
  set_sysctl net.bridge.bridge-nf-call-ip6tables 0

  ip link add "$BRIDGE" type bridge stp_state 0 forward_delay 0
  ip link set "$BRIDGE" mtu 9000
  ip addr add "$NET.255.254/16" dev "$BRIDGE"
  ip link set "$BRIDGE" up

  local s k ns hif ip table
  for ((s = 0; s < S; ++s)); do
    ns=$(ns_name "$s")
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    for key in net.ipv4.conf.all.arp_ignore=1 net.ipv4.conf.default.arp_ignore=1 \
               net.ipv4.conf.all.arp_announce=2 net.ipv4.conf.default.arp_announce=2 \
               net.ipv4.conf.all.rp_filter=0 net.ipv4.conf.default.rp_filter=0 \
               net.ipv4.tcp_congestion_control=cubic; do
      ip netns exec "$ns" sysctl -q -w "$key" >/dev/null
    done
    for ((k = 0; k < G; ++k)); do
      hif=$(host_if "$s" "$k")
      ip=$(rank_ip "$s" "$k")
      table=$((100 + k))
      ip link add "$hif" mtu 9000 type veth peer name "nic$k" netns "$ns"
      ip link set "$hif" master "$BRIDGE"
      ip link set "$hif" up
      offloads_off "$hif"
      shape "$hif" "$RATE"                 # towards the rank: what it receives
      ip -n "$ns" link set "nic$k" mtu 9000 up
      ip -n "$ns" addr add "$ip/16" dev "nic$k"
      ip netns exec "$ns" sysctl -q -w "net.ipv4.conf.nic$k.rp_filter=0" >/dev/null
      offloads_off "$ns" "nic$k"
      shape "$ns" "nic$k" "$RATE"          # from the rank: what it sends
      # Traffic from the rank's address leaves through the rank's own NIC.
      ip -n "$ns" route add "$NET.0.0/16" dev "nic$k" src "$ip" table "$table"
      ip -n "$ns" rule add from "$ip" table "$table" priority "$table"
    done
  done

  local hosts=$STATE_DIR/hostfile
  : >"$hosts"
  for ((s = 0; s < S; ++s)); do echo "$(ns_name "$s") slots=$G" >>"$hosts"; done
  write_rsh_agent
  write_rank_wrapper
  trap - ERR INT TERM
  echo "cluster.sh: up: $S servers x $G ranks, $RATE Mbit/s per NIC each way, bridge $BRIDGE ($NET.0.0/16)"
}

need_up() {
  [[ -f $STATE ]] || die "no cluster is up (cluster.sh up S G RATE_MBIT first)"
}

# Launches one MPI job on the cluster. Whatever happens (the job fails, the user interrupts), no
# daemon or rank is left running in the server namespaces when this returns.
cmd_run() {
  need_root
  need_up
  [[ ${1:-} == -- ]] && shift
  (($# >= 1)) || die "usage: cluster.sh run [--] COMMAND [ARGS...]"
  local S G
  MPIRUN_PID=
  S=$(state_get servers)
  G=$(state_get gpus)
  cleanup_run() {
    local rc=$?
    trap - EXIT INT TERM
    if [[ -n $MPIRUN_PID ]] && kill -0 "$MPIRUN_PID" 2>/dev/null; then
      kill -TERM "$MPIRUN_PID" 2>/dev/null || true
      sleep 1
      kill -KILL "$MPIRUN_PID" 2>/dev/null || true
    fi
    kill_ns_processes
    exit "$rc"
  }
  trap cleanup_run EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  local extra=() flags=()
  # shellcheck disable=SC2206
  [[ -n ${FASTA2A_MPIRUN_ARGS:-} ]] && extra=(${FASTA2A_MPIRUN_ARGS})
  # "default": Open MPI's own btl_tcp_flags (not passed at all), as under a plain mpirun.
  local tcp_flags=${FASTA2A_TCP_FLAGS:-send,inplace,need-ack,need-csum}
  [[ $tcp_flags == default ]] || flags=(--mca btl_tcp_flags "$tcp_flags")
  # mpirun runs in the background so that the traps run at once on a signal.
  mpirun --allow-run-as-root --oversubscribe --bind-to none \
    -np $((S * G)) --hostfile "$STATE_DIR/hostfile" --map-by "ppr:$G:node" \
    --mca plm_rsh_agent "$STATE_DIR/rsh-agent" --mca plm_rsh_no_tree_spawn 1 \
    --mca oob_tcp_if_include "$NET.0.0/16" --mca btl self,vader,tcp \
    --mca btl_vader_single_copy_mechanism "${FASTA2A_VADER_SINGLE_COPY:-cma}" --mca mpi_yield_when_idle 1 \
    "${flags[@]}" "${extra[@]}" "$STATE_DIR/rank-wrapper" "$@" &
  MPIRUN_PID=$!
  local rc=0
  wait "$MPIRUN_PID" || rc=$?
  MPIRUN_PID=
  return "$rc"
}

# Starts one process per rank without MPI (fasta2a::tcp_bootstrap reads the variables), each in its
# server's namespace and UTS namespace (host name = the server's), its libfabric tcp provider pinned
# to its own NIC. No process is left running in the server namespaces when this returns.
cmd_launch() {
  need_root
  need_up
  local limit=600 port=29500
  while (($# > 0)); do
    case $1 in
      -t) limit=$2; shift 2 ;;
      -p) port=$2; shift 2 ;;
      --) shift; break ;;
      *) break ;;
    esac
  done
  [[ $limit =~ ^[0-9]+$ && $limit -ge 1 ]] || die "launch: -t needs a positive number of seconds, got '$limit'"
  [[ $port =~ ^[0-9]+$ && $port -ge 1 && $port -le 65535 ]] || die "launch: -p needs a port, got '$port'"
  (($# >= 1)) || die "usage: cluster.sh launch [-t SECONDS] [-p PORT] [--] COMMAND [ARGS...]"
  local S G n s k r ns
  # The job's secret (fasta2a::tcp_bootstrap: only processes that hold it join the job): drawn
  # here unless set, and passed in the environment, where other users cannot read it.
  if [[ -z ${FASTA2A_JOB_SECRET:-} ]]; then
    FASTA2A_JOB_SECRET=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')
  fi
  export FASTA2A_JOB_SECRET
  S=$(state_get servers)
  G=$(state_get gpus)
  n=$((S * G))
  LAUNCH_PIDS=()
  LAUNCH_KILLED=0
  launch_kill() {
    ((LAUNCH_KILLED)) && return 0
    LAUNCH_KILLED=1
    local p
    for p in "${LAUNCH_PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    sleep 1
    kill_ns_processes
  }
  cleanup_launch() {
    local rc=$?
    trap - EXIT INT TERM
    launch_kill
    exit "$rc"
  }
  trap cleanup_launch EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  for ((s = 0; s < S; ++s)); do
    ns=$(ns_name "$s")
    for ((k = 0; k < G; ++k)); do
      r=$((s * G + k))
      ip netns exec "$ns" unshare --uts -- sh -c 'hostname "$0" && exec "$@"' "$ns" \
        env RANK=$r WORLD_SIZE=$n LOCAL_RANK=$k LOCAL_WORLD_SIZE=$G MASTER_ADDR="$(rank_ip 0 0)" MASTER_PORT="$port" \
            FI_TCP_IFACE="nic$k" FASTA2A_NIC="nic$k" "$@" \
        > >(sed -u "s/^/[rank $r] /") 2> >(sed -u "s/^/[rank $r] /" >&2) &
      LAUNCH_PIDS+=($!)
    done
  done
  local worst=0 left=$n start=$SECONDS i p rc
  local -A finished=()
  while ((left > 0)); do
    for i in "${!LAUNCH_PIDS[@]}"; do
      [[ -n ${finished[$i]:-} ]] && continue
      p=${LAUNCH_PIDS[$i]}
      kill -0 "$p" 2>/dev/null && continue
      rc=0
      wait "$p" || rc=$?
      finished[$i]=1
      left=$((left - 1))
      if ((rc != 0 && !LAUNCH_KILLED)); then # ranks killed here do not count
        note "launch: rank $i exited with status $rc; stopping the others"
        ((rc > worst)) && worst=$rc
        launch_kill
      fi
    done
    if ((left > 0 && SECONDS - start >= limit)); then
      note "launch: the ranks did not finish within $limit s; killing them"
      worst=124
      launch_kill
      break
    fi
    ((left > 0)) && sleep 0.1
  done
  return "$worst"
}

# Per NIC: bytes the rank sent (tx) and received (rx), read from the kernel's counters of the
# NIC's bridge end (its rx is the rank's tx), and packets dropped by the shapers on each side.
cmd_counters() {
  need_root
  need_up
  local S G s k hif ns tx rx dsend drecv
  S=$(state_get servers)
  G=$(state_get gpus)
  printf '%-6s %-5s %-5s %-12s %15s %15s %10s %10s\n' server local rank nic tx_bytes rx_bytes tx_drops rx_drops
  for ((s = 0; s < S; ++s)); do
    ns=$(ns_name "$s")
    for ((k = 0; k < G; ++k)); do
      hif=$(host_if "$s" "$k")
      rx=$(<"/sys/class/net/$hif/statistics/tx_bytes")
      tx=$(<"/sys/class/net/$hif/statistics/rx_bytes")
      drecv=$(tc -s qdisc show dev "$hif" | sed -n 's/.*dropped \([0-9]*\).*/\1/p' | head -n1)
      dsend=$(tc -n "$ns" -s qdisc show dev "nic$k" | sed -n 's/.*dropped \([0-9]*\).*/\1/p' | head -n1)
      printf '%-6s %-5s %-5s %-12s %15s %15s %10s %10s\n' "$s" "$k" $((s * G + k)) "$hif" "$tx" "$rx" \
        "${dsend:-0}" "${drecv:-0}"
    done
  done
}

cmd_status() {
  if [[ -f $STATE ]]; then
    echo "cluster $NAME: $(state_get servers) servers x $(state_get gpus) ranks, $(state_get rate_mbit) Mbit/s per NIC"
  else
    echo "cluster $NAME: down"
  fi
  ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$NAME-srv[0-9]+$" || true
}

main() {
  local cmd=${1:-}
  (($# > 0)) && shift
  case $cmd in
    up) cmd_up "$@" ;;
    down) cmd_down ;;
    run) cmd_run "$@" ;;
    launch) cmd_launch "$@" ;;
    counters) cmd_counters ;;
    status) cmd_status ;;
    state-dir) echo "$STATE_DIR" ;;
    -h | --help | help) usage ;;
    *) usage >&2; exit 2 ;;
  esac
}

main "$@"
