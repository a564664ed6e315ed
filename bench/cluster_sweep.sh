#!/usr/bin/env bash
# Serialized vs interleaved across 2 hosts (network namespaces, shaped TCP
# links; scripts/cluster.sh), from compute-bound to communication-bound, and
# what the simulator predicts for the same runs: a model of this cluster
# with each link's measured TCP goodput (bench/cluster_link.py) and what the
# MPI transport's puts cost the sending and the receiving core
# (bench/bench_put_cost, built with MPI). Prints markdown.
#   bench/cluster_sweep.sh [iterations] > docs/results/cluster.md      (root)
set -euo pipefail
cd "$(dirname "$0")/.."
iters=${1:-3}
[ -x build/bench/bench_put_cost ] || { echo "error: build/bench/bench_put_cost is missing: build with MPI (scripts/setup.sh installs it)" >&2; exit 2; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
trace=data/routing/mixtral-8x7b/coding.json

# FLOP per byte of a target cluster's link: its rank's matrix rate over the link.
ratio() {  # ratio MODEL LINK(intra|inter)
  python3 - "$1" "$2" <<'PY'
import json, sys
m = json.load(open(f"machines/{sys.argv[1]}.json"))
flops = m["units"]["matrix"] * max(t.get("bf16_flops") or t["efficiency"] * m["matrix"]["peak"]["bf16_flops"] for t in m["matrix"]["tile_rates"])
print(round(flops / m["links"][sys.argv[2]]["bytes_per_s"]))
PY
}
h800=$(ratio h800 inter)
a3=$(ratio ascend-a3 intra)
core_flops=$(python3 -c "import json; m=json.load(open('machines/cpu-local.json')); print([t for t in m['matrix']['tile_rates'] if t['m']==64 and t['k']==2048][0]['fp32_flops'])")
# The model's core comes from a calibration made now, just before the runs:
# this machine's speed drifts by 20% within an hour (shared hosts), and a
# model calibrated earlier would carry that drift into every error below.
# The links keep the committed model's rates, so shapes compare across runs.
build/hpmoe calibrate -W 1 --out "$tmp/calibrated.json" > /dev/null

echo "# A cluster on one machine: 2 hosts over shaped links"
echo
source bench/record_header.sh  # from the repository root (the cd above)
echo "$(record_header "$0 $*") Each host is a network namespace"
echo "with one core; ranks talk MPI over TCP through veth links shaped with tc (token bucket). Command:"
echo "\`bench/cluster_sweep.sh $iters\` (median of $iters iterations after a warm-up; fp32; forward+backward)."
echo "FLOP per byte: H800 cluster RDMA link $h800 (machines/h800.json: matrix rate / NIC), Ascend A3 fabric $a3"
echo "(machines/ascend-a3.json); the link rate here = one core's fp32 tile rate ($(python3 -c "print(f'{$core_flops/1e9:.0f}')") GFLOP/s, machines/cpu-local.json) / FLOP per byte."
echo "The predictions use a calibration of this machine made at the start of the sweep (\`hpmoe calibrate -W 1\`)."
echo
echo "| link | layer | routing | fwd ser ms | fwd int ms | fwd speedup | bwd ser ms | bwd int ms | bwd speedup | idle ser/int (fwd) | predicted fwd ser / int ms | predicted speedup fwd / bwd | prediction error fwd ser / int, bwd ser / int | bit-identical |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"

# What a shaped link delivers (bench/cluster_link.py: one TCP stream,
# nothing else running, for the goodput; then with a computing process on
# each core, for what the bare stream takes from it), and what the MPI
# transport's puts take from a computing worker on the sending and the
# receiving host, per put and per byte (bench/bench_put_cost through the
# same cluster: Open MPI, the progress thread and the TCP stack together;
# on the unshaped link 2.4x the bare stream's cost per byte on the sender,
# 1.3x on the receiver, 2026-12-02).
#
# A layer's puts go both ways at once (each rank dispatches to and combines
# from the other), and two-way traffic does not cost a core the one-way
# sender's plus the one-way receiver's cost: at the A3 ratio 0.7-0.8x of it
# (likely TCP acknowledgements riding on the data and one wake of the
# progress thread serving both directions; not isolated), unshaped
# 0.8-1.3x (2026-12-03, docs/results/cluster.md). So the put costs are
# measured both ways too (bench_put_cost --direction both: each core's time
# per put and per byte, sending and receiving at once), and the one-way
# split between sender and receiver is scaled to that total, the per-put and
# the per-byte parts each.
measure_link() {  # shaping-args gbit -> "goodput tcp_send tcp_receive send_per_put send_rate receive_per_put receive_rate" (the model's),
                  # then the one-way "send_per_put send_rate receive_per_put receive_rate" and the two-way "per_put rate" measured
  local bytes
  bytes=$(python3 -c "g=float('$2'); print(int(max(64e6, (g * 1e9 / 8 if g > 0 else 1e9) * 4)))")
  # At most 512 MB a transfer: a stream of small puts for a minute starves
  # the receiving progress thread's heartbeats (docs/results/cluster.md).
  local put_bytes=$((bytes < 536870912 ? bytes : 536870912))
  # shellcheck disable=SC2086
  { HPMOE=bench/cluster_link.py scripts/cluster.sh $1 -- --bytes "$bytes" 2>/dev/null
    HPMOE=bench/cluster_link.py scripts/cluster.sh $1 -- --bytes "$bytes" --load 2>/dev/null | sed 's/"side": "/"side": "loaded /g'
    HPMOE=build/bench/bench_put_cost scripts/cluster.sh $1 -- --bytes "$put_bytes" 2>/dev/null
    HPMOE=build/bench/bench_put_cost scripts/cluster.sh $1 -- --bytes "$put_bytes" --direction both 2>/dev/null; } |
    python3 -c "
import json, sys
text, dec, r, i = sys.stdin.read(), json.JSONDecoder(), {}, 0
while (i := text.find('{\"rank\"', i)) >= 0:  # mpirun may join two ranks' lines
    j, i = dec.raw_decode(text, i)
    r[str('fit' if j.get('fit') else j.get('side', j.get('put_bytes'))) + (' both' if j.get('direction') == 'both' else '')] = j
cost = lambda side: r[side]['bytes_per_stolen_s'] or 1e12  # None: nothing measurable was taken
f, b = r['fit'], r['fit both']
def split(send, receive, both):  # the one-way split of a cost, scaled to the two-way total
    share = send / (send + receive) if send + receive > 0 else 0.5
    return share * both, (1 - share) * both
send_put, receive_put = split(f['sender_s_per_put'], f['receiver_s_per_put'], b['sender_s_per_put'])
send_byte, receive_byte = split(1 / f['sender_bytes_per_s'], 1 / f['receiver_bytes_per_s'], 1 / b['sender_bytes_per_s'])
rate = lambda s_per_byte: 1 / s_per_byte if s_per_byte > 0 else 1e15
print(r['receiver']['goodput_bytes_per_s'], cost('loaded sender'), cost('loaded receiver'),
      send_put, rate(send_byte), receive_put, rate(receive_byte),
      f['sender_s_per_put'], f['sender_bytes_per_s'], f['receiver_s_per_put'], f['receiver_bytes_per_s'],
      b['sender_s_per_put'], b['sender_bytes_per_s'])"
}

run() {  # label shaping-args gbit layer-args layer-label routing
  local label=$1 shaping=$2 gbit=$3 layer=$4 llabel=$5 routing=$6
  # shellcheck disable=SC2086
  # Heartbeats share the TCP connection with the data: on a slow link a large
  # gather holds them back for seconds, so the peer timeout is generous.
  if ! scripts/cluster.sh $shaping -- $layer -T 256 --routing "$routing" --backward --iters "$iters" --warmup 1 \
      --verify sample --peer-timeout 120 --watchdog 300 --json "$tmp/run.json" > "$tmp/out.txt" 2> "$tmp/err.txt"; then
    echo "| $label | $llabel | $routing | failed: $(grep -m1 error "$tmp/err.txt" "$tmp/out.txt" | head -1) ||||||||||||"
    return
  fi
  # The simulator on this cluster: the calibrated core, one worker, links at the shaped rate.
  python3 - $link "$tmp/calibrated.json" > "$tmp/model.json" <<'PY'
import json, sys
m = json.load(open(sys.argv[8]))
m["name"] = "cluster-2-hosts"
m["units"] = {"workers": 1}
goodput, _, _, send_per_put, send_rate, receive_per_put, receive_rate = map(float, sys.argv[1:8])  # argv[8]: the calibration
m["links"] = {"ranks_per_node": 1, "intra": {"bytes_per_s": goodput, "latency_s": 1.2e-4},
              "inter": {"bytes_per_s": goodput, "latency_s": 1.2e-4}}
# The sender's core: the put's rows copied into the message, then the
# transport's send path; the receiver's: its receive path and the copy into
# the segment (both measured through the MPI transport, bench_put_cost; the
# one-way split scaled to the two-way total, measure_link).
# One TCP connection per pair of ranks: a rank's puts to a peer go in order.
m["put"] = {"engine": "cpu", "issue_s": send_per_put, "copy_bytes_per_s": send_rate, "stream_per_peer": True,
            "receive": {"per_put_s": receive_per_put, "bytes_per_s": receive_rate}}
m["serialized"]["collective_sync_s"] = 2.4e-4  # a barrier over TCP: a round trip
m["sources"]["links"] = "the shaped link's measured TCP goodput (bench/cluster_link.py); TCP one-way latency from bench_transport"
m["sources"]["put.stream_per_peer"] = "Open MPI's TCP BTL: one connection per pair of processes, messages in order"
m["sources"]["put.issue_s"] = m["sources"]["put.copy_bytes_per_s"] = (
    "core time a computing worker loses per put and per byte on the sending host, through the MPI transport (bench/bench_put_cost), "
    "its share of the one-way cost scaled to the two-way total (bench_put_cost --direction both)")
m["sources"]["put.receive"] = "the same on the receiving host (bench/bench_put_cost, scaled the same way)"
json.dump(m, sys.stdout)
PY
  # shellcheck disable=SC2086
  build/hpmoe simulate --machine "$tmp/model.json" $layer -P 2 -W 1 -T 256 --routing "$routing" --backward \
    --json "$tmp/sim.json" > /dev/null
  python3 - "$tmp/run.json" "$tmp/sim.json" "$label" "$llabel" "$routing" <<'PY'
import json, sys
r, s = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
label, llabel, routing = sys.argv[3:]
fs, fi = r["serialized"]["dispatch_to_combine"]["median_s"], r["interleaved"]["dispatch_to_combine"]["median_s"]
bs, bi = r["serialized"]["backward"]["median_s"], r["interleaved"]["backward"]["median_s"]
same = all(c["pass"] for c in r["verification"]["checks"] if "in-process" in c["tensor"] or c["tensor"].startswith("interleaved"))
print(f"| {label} | {llabel} | {routing} | {fs*1e3:.0f} | {fi*1e3:.0f} | {fs/fi:.2f}x | {bs*1e3:.0f} | {bi*1e3:.0f} | {bs/bi:.2f}x | "
      f"{(1-r['serialized']['busy_share'])*100:.0f}% / {(1-r['interleaved']['busy_share'])*100:.0f}% | "
      f"{s['forward']['serialized_s']*1e3:.0f} / {s['forward']['interleaved_s']*1e3:.0f} | "
      f"{s['forward']['speedup']:.2f}x / {s['backward']['speedup']:.2f}x | "
      + " / ".join(f"{(p / q - 1) * 100:+.0f}%" for p, q in ((s['forward']['serialized_s'], fs), (s['forward']['interleaved_s'], fi),
                                                            (s['backward']['serialized_s'], bs), (s['backward']['interleaved_s'], bi)))
      + f" | {'yes' if same else 'NO'} |")
PY
}
gbit_for() { python3 -c "print(f'{$core_flops / $1 * 8 / 1e9:.6f}')"; }
g_h800=$(gbit_for "$h800")
g_a3=$(gbit_for "$a3")
for shape in "unshaped||0" "A3 fabric ($a3 FLOP/B, $(printf %.0f "$(python3 -c "print($g_a3*1000)")") Mbit/s)|--flop-per-byte $a3|$g_a3" \
             "H800 RDMA ($h800 FLOP/B, $(printf %.0f "$(python3 -c "print($g_h800*1000)")") Mbit/s)|--flop-per-byte $h800|$g_h800"; do
  IFS='|' read -r label shaping gbit <<< "$shape"
  case "$label" in ${SHAPES:-*}) ;; *) continue ;; esac  # e.g. SHAPES='H800*' for one link shape
  measured=$(measure_link "$shaping" "$gbit")
  read -r goodput tcp_send tcp_receive send_per_put send_rate receive_per_put receive_rate \
    one_send_per_put one_send_rate one_receive_per_put one_receive_rate both_per_put both_rate <<< "$measured"
  link="$goodput $tcp_send $tcp_receive $send_per_put $send_rate $receive_per_put $receive_rate"
  info=$(python3 -c "g = float('$gbit'); print(f'goodput {$goodput / 1e6:.1f} MB/s (shaped: ' + (f'{g * 125:.1f} MB/s' if g > 0 else 'none') + f'); a bare TCP stream takes a computing core: sender {$tcp_send / 1e6:.0f} MB per second taken, receiver {$tcp_receive / 1e6:.0f}; the MPI transport\'s puts one way: sender {$one_send_per_put * 1e6:.1f} us + {$one_send_rate / 1e6:.0f} MB per second, receiver {$one_receive_per_put * 1e6:.1f} us + {$one_receive_rate / 1e6:.0f} MB per second; both ways, each core {$both_per_put * 1e6:.1f} us + {$both_rate / 1e6:.0f} MB per second; so the model\'s sender {$send_per_put * 1e6:.1f} us + {$send_rate / 1e6:.0f} MB per second, receiver {$receive_per_put * 1e6:.1f} us + {$receive_rate / 1e6:.0f} MB per second')")
  echo "| $label | link: $info ||||||||||||||"
  # 16 of the 64 experts: every host holds all weights, two hosts must fit in 24 GiB
  run "$label" "$shaping" "$gbit" "--preset deepseek-v2-lite --set routed_experts=16" "deepseek-v2-lite (16 experts)" uniform
  run "$label" "$shaping" "$gbit" "--preset mixtral-8x7b --set expert_inter=1792" "mixtral-8x7b (inter 1792)" "trace:$trace:15"
done
