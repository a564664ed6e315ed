#!/usr/bin/env bash
# What dispatching in fp8 does to the fused schedule against the serialized
# and DeepEP-style baselines: DeepSeek-V3 sizes (no shared expert, bf16,
# the paper's kernel scope), 4096 tokens per rank, uniform routing, forward
# + backward, EP 8 to 64, with hpmoe's dispatch in the layer's dtype and in
# fp8 (e4m3 + one fp32 scale per 128 channels: --dispatch-dtype fp8). The
# DeepEP-style baseline always dispatches in fp8 (baselines.deepep) and runs
# no decode; the fused schedule pays its decode tasks. Cross-node MB: bytes
# leaving the nodes in the forward pass, all ranks. The last row of each EP
# sends fp8 under the per-rank exchange (--exchange rank: a token once per
# destination rank, gathered there; one row per token and rank back),
# first straight to every rank (node_forwarding=false), then once per
# destination node, forwarded there by the rank with the source's local
# index (the machine's ranks per node).
#   bench/dispatch_dtype_sweep.sh [build/hpmoe] [machine]
set -euo pipefail
cd "$(dirname "$0")/.."
hpmoe=${1:-build/hpmoe}
machine=${2:-h800}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
layer="--preset deepseek-v3 --set shared_experts=0 --dtype bf16 --kernel-scope -T 4096 --routing uniform"

source bench/record_header.sh
record_header "bench/dispatch_dtype_sweep.sh $hpmoe $machine"
echo
echo "| EP | exchange, dispatch | serialized ms | DeepEP-style ms | fused ms, critical-path | fused ms, ratr | best fused vs serialized | best fused vs DeepEP-style | fwd cross-node MB fused / DeepEP-style |"
echo "|---|---|---|---|---|---|---|---|---|"
for P in 8 16 32 64; do
  for xd in assignment/layer assignment/fp8 rank/fp8 node/fp8; do
    x=${xd%/*} d=${xd#*/} fw=false
    [ "$x" = node ] && x=rank fw=true
    label="$x, $d"; [ "$x" = rank ] && label="$x ($([ $fw = true ] && echo "once per node" || echo "straight")), $d"
    for s in ratr critical-path; do
      "$hpmoe" simulate --machine "$machine" $layer -P "$P" --exchange "$x" --set node_forwarding=$fw --dispatch-dtype "$d" --backward \
        --schedule $s --json "$tmp/$s.json" > /dev/null
    done
    python3 - "$tmp/ratr.json" "$tmp/critical-path.json" "$P" "$label" <<'PY'
import json, sys
r, c, P, d = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])), sys.argv[3], sys.argv[4]
tot = lambda j, k: (j["forward"][k] + j["backward"][k]) * 1e3
s, i, cp = tot(r, "serialized_s"), tot(r, "interleaved_s"), tot(c, "interleaved_s")
dp = tot(r, "deepep_s") if "deepep_s" in r["forward"] else float("nan")
best = min(i, cp)
f = r["forward"]
cross = "-" if f["cross_node_bytes"] == 0 else f"{f['cross_node_bytes']/1e6:.0f} / {f['deepep_cross_node_bytes']/1e6:.0f}"
print(f"| {P} | {d} | {s:.2f} | {dp:.2f} | {cp:.2f} | {i:.2f} | {s / best:.2f}x | {dp / best:.2f}x | {cross} |")
PY
  done
done
