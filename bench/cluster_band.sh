#!/usr/bin/env bash
# How far the cluster model's predictions move over the range of its measured
# link figures: for each layer of bench/cluster_sweep.sh, the simulator on the
# 2-host model (as cluster_sweep.sh builds it) at every combination of the
# given goodputs, sender and receiver costs (bytes per second; the ranges two
# sweeps measured), and per receiver cost the range of the interleaved
# forward. No root or cluster needed: it only simulates.
#   bench/cluster_band.sh [hpmoe] [calibration.json]   (a `hpmoe calibrate -W 1` of this machine)
#   GOODPUT="59.3e6 59.9e6" SENDER="572e6 788e6" RECEIVER="60e6 62e6 64e6 66e6 68e6" bench/cluster_band.sh
set -euo pipefail
cd "$(dirname "$0")/.."
hpmoe=${1:-build/hpmoe}
calibration=${2:-machines/cpu-local.json}
goodputs=${GOODPUT:-59.3e6 59.9e6}
senders=${SENDER:-572e6 788e6}
receivers=${RECEIVER:-60e6 62e6 64e6 66e6 68e6}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
trace=data/routing/mixtral-8x7b/coding.json
layers=("deepseek-v2-lite (16 experts)|--preset deepseek-v2-lite --set routed_experts=16 --routing uniform"
        "mixtral-8x7b (inter 1792)|--preset mixtral-8x7b --set expert_inter=1792 --routing trace:$trace:15")
echo "Calibration: \`$calibration\`; goodput $goodputs B/s; sender $senders; receiver $receivers (bytes per second of core time)."
echo
echo "| layer | predicted fwd ser ms | predicted fwd int ms | fwd int at each receiver cost | predicted bwd ser ms | predicted bwd int ms |"
echo "|---|---|---|---|---|---|"
for entry in "${layers[@]}"; do
  IFS='|' read -r label args <<< "$entry"
  : > "$tmp/rows.txt"
  for g in $goodputs; do for s in $senders; do for r in $receivers; do
    # The same model as bench/cluster_sweep.sh's.
    python3 - "$g" "$s" "$r" "$calibration" > "$tmp/model.json" <<'PY'
import json, sys
m = json.load(open(sys.argv[4]))
m["name"] = "cluster-2-hosts"
m["units"] = {"workers": 1}
goodput, send_rate, receive_rate = map(float, sys.argv[1:4])
m["links"] = {"ranks_per_node": 1, "intra": {"bytes_per_s": goodput, "latency_s": 1.2e-4},
              "inter": {"bytes_per_s": goodput, "latency_s": 1.2e-4}}
copy = 1 / (1 / m["put"]["copy_bytes_per_s"] + 1 / send_rate)
m["put"] = {"engine": "cpu", "issue_s": 2e-6, "copy_bytes_per_s": copy, "stream_per_peer": True,
            "receive": {"per_put_s": 0.0, "bytes_per_s": receive_rate}}
m["serialized"]["collective_sync_s"] = 2.4e-4
json.dump(m, sys.stdout)
PY
    # shellcheck disable=SC2086
    "$hpmoe" simulate --machine "$tmp/model.json" $args -P 2 -W 1 -T 256 --backward --json "$tmp/sim.json" > /dev/null
    python3 -c "
import json; s = json.load(open('$tmp/sim.json'))
print($r, s['forward']['serialized_s'], s['forward']['interleaved_s'], s['backward']['serialized_s'], s['backward']['interleaved_s'])" >> "$tmp/rows.txt"
  done; done; done
  python3 - "$label" "$tmp/rows.txt" <<'PY'
import sys
rows = [list(map(float, l.split())) for l in open(sys.argv[2])]
span = lambda xs: f"{min(xs) * 1e3:.0f}-{max(xs) * 1e3:.0f}"
col = lambda i: [r[i] for r in rows]
per_receiver = " / ".join(span([r[2] for r in rows if r[0] == x]) for x in sorted({r[0] for r in rows}))
print(f"| {sys.argv[1]} | {span(col(1))} | {span(col(2))} | {per_receiver} | {span(col(3))} | {span(col(4))} |")
PY
done
