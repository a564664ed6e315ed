#!/usr/bin/env bash
# The simulator's prediction for the namespace cluster of
# bench/dispatch_cluster.sh (issue 60 item 5: does the model predict overlap
# the runtime does not deliver?). This machine calibrated as one worker per
# rank (each cluster host runs its rank on one core), its links set to the
# cluster's (2 hosts, one rank each; the rate scripts/cluster.sh derives
# from --flop-per-byte; the latency an ESTIMATE, LATENCY_US, default 50),
# then the layer dispatch_cluster.sh runs, per-rank exchange, for each
# dispatch dtype: serialized and fused, forward and backward.
#   bench/cluster_sim.sh [FLOP_PER_BYTE] [BIN]     (default: the H800 cluster's, build/hpmoe)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${2:-build/hpmoe}
fpb=${1:-$(python3 - <<'PY'
import json
m = json.load(open("machines/h800.json"))
print(round(m["units"]["matrix"] * max(t.get("bf16_flops") or t["efficiency"] * m["matrix"]["peak"]["bf16_flops"] for t in m["matrix"]["tile_rates"]) / m["links"]["inter"]["bytes_per_s"]))
PY
)}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
source bench/record_header.sh
record_header "bench/cluster_sim.sh $fpb $bin"
"$bin" calibrate -W 1 --out "$tmp/cal.json" > /dev/null 2>&1
python3 - "$tmp/cal.json" "$fpb" "${LATENCY_US:-50}" <<'PY'
import json, sys
path, fpb, latency_us = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
local = json.load(open("machines/cpu-local.json"))  # what scripts/cluster.sh shapes the links from
rate = [t for t in local["matrix"]["tile_rates"] if t["m"] == 64 and t["k"] == 2048][0]["fp32_flops"] / fpb
m = json.load(open(path))
m["name"] = "namespace-cluster"
m["links"] = {"ranks_per_node": 1, "intra": {"bytes_per_s": 0.0, "latency_s": m["links"]["intra"]["latency_s"]},
              "inter": {"bytes_per_s": rate, "latency_s": latency_us * 1e-6}}
json.dump(m, open(path, "w"), indent=1)
print(f"\nlinks: {rate * 8 / 1e9:.6f} Gbit/s (FLOP per byte {fpb:.0f}), latency {latency_us:.0f} us (ESTIMATE)\n")
PY
echo "| dispatch | simulated fwd ser / int ms | simulated bwd ser / int ms | simulated fused vs serialized (step) |"
echo "|---|---|---|---|"
for d in layer bf16 fp8; do
  "$bin" simulate --machine "$tmp/cal.json" --preset deepseek-v2-lite --set routed_experts=16 -P 2 -T 256 --routing uniform \
    --backward --exchange rank --dispatch-dtype "$d" --json "$tmp/$d.json" > /dev/null
  python3 - "$tmp/$d.json" "$d" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
f, b = j["forward"], j["backward"]
step = (f["serialized_s"] + b["serialized_s"]) / (f["interleaved_s"] + b["interleaved_s"])
print(f"| {sys.argv[2]} | {f['serialized_s']*1e3:.1f} / {f['interleaved_s']*1e3:.1f} | {b['serialized_s']*1e3:.1f} / {b['interleaved_s']*1e3:.1f} | {step:.2f}x |")
PY
done
