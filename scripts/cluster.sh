#!/usr/bin/env bash
# A cluster on one machine: N hosts, each a Linux network namespace with its
# own address in 198.18.0.0/15 (reserved for benchmarking), joined by veth
# pairs to a bridge; each host's link shaped with tc (token bucket: rate in
# both directions; netem delay where the kernel has it); each host's rank
# pinned to a core. hpmoe runs across the hosts with the real mpirun, whose
# launch agent enters a host's namespace instead of ssh, so every rank talks
# MPI over TCP through its shaped link (no shared memory between hosts).
# Everything created is removed on exit, also on failure or Ctrl-C.
#
#   scripts/cluster.sh [options] -- HPMOE-RUN-ARGS...
#     --hosts N            hosts (and ranks), default 2
#     --rate-gbit G        link rate per host and direction (default: unshaped)
#     --flop-per-byte X    link rate = this machine's per-core GEMM rate / X
#                          (machines/cpu-local.json); e.g. the H800 cluster's
#                          RDMA link or an Ascend A3 node's fabric
#     --delay-us D         one-way delay per link (needs netem)
#     --slow-host I:G      host I's link at G Gbit/s instead (a heavily delayed link)
#     --fault kill:I:S     kill host I's rank S seconds into the run
#     --fault linkdown:I:S take host I's link down S seconds into the run
#     --keep-going         exit 0 even if the run fails (fault tests check the output)
#     --time-limit S       stop mpirun after S seconds (default 1800): bounded even if
#                          a daemon behind a dead link never answers
#     --eager-bytes B      messages up to B bytes go without a rendezvous (default
#                          4194304; Open MPI's own default is 65536)
#     --exec               the arguments after -- are a command to run on every host
#                          (mpirun runs it once per host, PYTHONPATH passed on,
#                          gloo on the host's eth0) instead of hpmoe run's arguments
#   Example (2 hosts, H800-like FLOP per byte, forward+backward):
#     scripts/cluster.sh --flop-per-byte 15000 -- --preset deepseek-v2-lite -T 256 --backward
#     scripts/cluster.sh --exec -- /usr/bin/python3 examples/train_moe_lm.py --mpi-path network
set -euo pipefail
cd "$(dirname "$0")/.."
hosts=2 rate_gbit="" fpb="" delay_us=0 slow="" fault="" keep_going=0 time_limit=1800 eager=4194304 exec_mode=0
while [ $# -gt 0 ]; do
  case "$1" in
    --hosts) hosts=$2; shift 2 ;;
    --rate-gbit) rate_gbit=$2; shift 2 ;;
    --flop-per-byte) fpb=$2; shift 2 ;;
    --delay-us) delay_us=$2; shift 2 ;;
    --slow-host) slow=$2; shift 2 ;;
    --fault) fault=$2; shift 2 ;;
    --keep-going) keep_going=1; shift ;;
    --time-limit) time_limit=$2; shift 2 ;;
    --eager-bytes) eager=$2; shift 2 ;;
    --exec) exec_mode=1; shift ;;
    -h|--help) sed -n '2,30s/^# \{0,1\}//p' "$0"; exit 0 ;;
    --) shift; break ;;
    *) echo "error: unknown option '$1' (see the header of scripts/cluster.sh)" >&2; exit 2 ;;
  esac
done
[ "$(id -u)" = 0 ] || { echo "error: cluster.sh needs root (network namespaces, tc)" >&2; exit 2; }
[[ "$eager" =~ ^[0-9]+$ ]] && [ "$eager" -ge 1024 ] || { echo "error: --eager-bytes must be a whole number of bytes, at least 1024" >&2; exit 2; }
[[ "$hosts" =~ ^[0-9]+$ ]] && [ "$hosts" -ge 1 ] && [ "$hosts" -le 64 ] || { echo "error: --hosts must be 1..64" >&2; exit 2; }
if [ -n "$fault" ] && ! [[ "$fault" =~ ^(kill|linkdown):[0-9]+:[0-9.]+$ && ${fault#*:} =~ ^([0-9]+): && ${BASH_REMATCH[1]} -lt $hosts ]]; then
  echo "error: --fault takes kill:HOST:SECONDS or linkdown:HOST:SECONDS with HOST < $hosts (got '$fault')" >&2; exit 2
fi
if [ "$exec_mode" = 1 ] && [ $# -eq 0 ]; then
  echo "error: --exec needs a command after -- (scripts/cluster.sh --exec -- COMMAND ARGS...)" >&2; exit 2
fi
if [ -n "$slow" ] && ! [[ "$slow" =~ ^([0-9]+):[0-9.]+$ && ${BASH_REMATCH[1]} -lt $hosts ]]; then
  echo "error: --slow-host takes HOST:GBIT with HOST < $hosts (got '$slow')" >&2; exit 2
fi
hpmoe=${HPMOE:-build/hpmoe}
prefix=hpmoe-c$$  # unique per invocation: parallel clusters do not collide
bridge=${prefix}br
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

if [ -n "$fpb" ]; then  # bytes/s = FLOP/s of one core / (FLOP per byte)
  rate_gbit=$(python3 - "$fpb" <<'PY'
import json, sys
m = json.load(open("machines/cpu-local.json"))
r = [t for t in m["matrix"]["tile_rates"] if t["m"] == 64 and t["k"] == 2048][0]["fp32_flops"]
print(f"{r / float(sys.argv[1]) * 8 / 1e9:.6f}")
PY
)
fi

cleanup() {
  set +e
  for i in $(seq 0 $((hosts - 1))); do
    ns=${prefix}h$i
    if ip netns list | grep -w "$ns" > /dev/null; then
      for pid in $(ip netns pids "$ns"); do kill -9 "$pid" 2>/dev/null; done
      ip netns del "$ns"
    fi
    ip link del "${prefix}v$i" 2>/dev/null
  done
  ip link del "$bridge" 2>/dev/null
  rm -rf "$tmp"
}
tmp=$(mktemp -d)
trap cleanup EXIT INT TERM

shape() {  # shape DEV GBIT [NS]: token bucket at GBIT (and netem delay) on DEV's egress
  local dev=$1 gbit=$2 exec=()
  [ -n "${3:-}" ] && exec=(ip netns exec "$3")
  if [ "$delay_us" != 0 ]; then
    "${exec[@]}" tc qdisc add dev "$dev" root handle 1: netem delay "${delay_us}us" 2>/dev/null ||
      { echo "error: this kernel has no netem qdisc, so --delay-us cannot be shaped by tc here" >&2; exit 2; }
    [ -n "$gbit" ] && "${exec[@]}" tc qdisc add dev "$dev" parent 1: handle 2: tbf rate "${gbit}gbit" burst 64kb latency 1s
  elif [ -n "$gbit" ]; then
    "${exec[@]}" tc qdisc add dev "$dev" root tbf rate "${gbit}gbit" burst 64kb latency 1s
  fi
}

ip link add "$bridge" type bridge
ip addr add 198.18.255.254/15 dev "$bridge"
ip link set "$bridge" up
cores=$(nproc)
: > "$tmp/hostfile"
for i in $(seq 0 $((hosts - 1))); do
  ns=${prefix}h$i
  ip netns add "$ns"
  ip link add "${prefix}v$i" type veth peer name eth0 netns "$ns"
  ip link set "${prefix}v$i" master "$bridge" up
  ip -n "$ns" addr add "198.18.0.$((i + 1))/15" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
  g=$rate_gbit
  if [ -n "$slow" ] && [ "${slow%%:*}" = "$i" ]; then g=${slow#*:}; fi
  shape eth0 "$g" "$ns"             # the host's uplink
  shape "${prefix}v$i" "$g"         # its downlink
  echo "198.18.0.$((i + 1)) slots=1" >> "$tmp/hostfile"
  echo "198.18.0.$((i + 1)) $ns $((i % cores))" >> "$tmp/hosts"
done

# The launch agent: mpirun calls it as `agent HOST COMMAND...` (in place of
# ssh); it runs the command inside HOST's namespace, pinned to HOST's core.
# Each host's daemon gets its own session directory base: they all have
# this machine's hostname, and sharing one base they race on creating the
# same directories (orte_init fails with "File exists" or "No such file").
cat > "$tmp/agent" <<EOF
#!/bin/sh
host=\$1; shift
set -- \$(grep "^\$host " "$tmp/hosts") "\$@"
ns=\$2; core=\$3; shift 3
mkdir -p "$tmp/ompi/\$ns"
exec ip netns exec "\$ns" taskset -c "\$core" sh -c "\$(printf "%s" "\$*" | sed "s|$tmp/ompi|$tmp/ompi/\$ns|g")"
EOF
chmod +x "$tmp/agent"

echo "cluster: $hosts hosts, link ${rate_gbit:-unshaped}${rate_gbit:+ Gbit/s}${fpb:+ (FLOP per byte $fpb)}, delay ${delay_us} us${slow:+, slow host $slow}" >&2
# Open MPI's session directories of this job in its own place: every "host"
# shares this machine's /tmp and hostname, and another mpirun finishing at
# the same moment may remove the shared /tmp/ompi.<host>.<uid> under it.
mkdir -p "$tmp/ompi"
mpirun_args=(--hostfile "$tmp/hostfile" -np "$hosts" --mca plm_rsh_agent "$tmp/agent" --mca orte_tmpdir_base "$tmp/ompi"
  --mca btl self,tcp --mca btl_tcp_if_include 198.18.0.0/15 --mca oob_tcp_if_include 198.18.0.0/15
  --mca rtc ^hwloc  # orted segfaults in hwloc_shmem_topology_write on some starts; pinning is taskset's
  # Messages up to 4 MB (every put here) go eagerly, as an RDMA put would
  # (--eager-bytes).
  # With the TCP BTL's default rendezvous above 64 KB, each message's
  # remainder waits for the receiver's acknowledgement, which queues behind
  # the other direction's data on the same connection and shaped link: an
  # all-to-all of 6 MB each way at the A3 ratio took 440 ms instead of 240.
  --mca btl_tcp_eager_limit "$eager" --mca btl_tcp_rndv_eager_limit "$eager")
if [ "$exec_mode" = 1 ]; then
  command=("$@")
  mpirun_args+=(-x GLOO_SOCKET_IFNAME=eth0)  # torch.distributed's gloo on the host's link
  [ -n "${PYTHONPATH:-}" ] && mpirun_args+=(-x PYTHONPATH)
else
  command=("$(realpath "$hpmoe")" run -P "$hosts" --transport mpi --mpi-path network "$@")
fi
rank_process=$(basename "${command[0]}")  # what --fault looks for in a host's namespace
set +e
# Open MPI's daemons, one per host but all with this machine's hostname, now
# and then race on their session directories and fail to start (orte_init,
# before any rank runs); such a launch is tried once more, fresh.
for attempt in 1 2; do
rm -rf "$tmp/ompi" && mkdir -p "$tmp/ompi"
: > "$tmp/launch.err"
timeout -k 5 "$time_limit" mpirun "${mpirun_args[@]}" "${command[@]}" \
  2> >(tee -a "$tmp/launch.err" >&2) &
run=$!
if [ -n "$fault" ]; then
  IFS=: read -r kind host after <<< "$fault"
  # The fault's seconds count from the moment the host's rank runs: a loaded
  # machine (or a sanitizer build) can take seconds to start it.
  for ((i = 0; i < 300; ++i)); do
    for pid in $(ip netns pids "${prefix}h$host"); do [ "$(ps -o comm= -p "$pid")" = "$rank_process" ] && break 2; done
    sleep 0.2
  done
  sleep "$after"
  case "$kind" in
    kill) for pid in $(ip netns pids "${prefix}h$host"); do
            [ "$(ps -o comm= -p "$pid")" = "$rank_process" ] && kill -9 "$pid" 2>/dev/null
          done
          echo "cluster: killed host $host's rank" >&2 ;;
    linkdown) ip link set "${prefix}v$host" down; echo "cluster: took host $host's link down" >&2 ;;
    *) echo "error: --fault takes kill:HOST:SECONDS or linkdown:HOST:SECONDS" >&2 ;;
  esac
fi
wait $run
status=$?
sleep 0.2  # the tee's last lines
if [ $status -ne 0 ] && [ $attempt = 1 ] && [ -z "$fault" ] &&
   grep -qE "orte_init failed|orte_session_dir failed|ORTE was unable to reliably start" "$tmp/launch.err"; then
  echo "cluster: Open MPI's daemons failed to start (a session-directory race); launching once more" >&2
  for i in $(seq 0 $((hosts - 1))); do
    for pid in $(ip netns pids "${prefix}h$i"); do kill -9 "$pid" 2>/dev/null; done
  done
  continue
fi
break
done
# What crossed each host's link (the bridge side's counters: received from
# the host = what it sent, and the reverse), TCP/IP headers included.
for ((i = 0; i < hosts; ++i)); do
  stats=/sys/class/net/${prefix}v$i/statistics
  [ -r "$stats/rx_bytes" ] && echo "cluster: host $i link bytes sent $(cat "$stats/rx_bytes") received $(cat "$stats/tx_bytes")" >&2
done
set -e
[ $keep_going = 1 ] && exit 0
exit $status
