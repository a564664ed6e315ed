#!/usr/bin/env bash
# The dispatch's format on real links: 2 hosts (network namespaces, TCP over
# veth links shaped to the H800 cluster's FLOP per byte; scripts/cluster.sh),
# deepseek-v2-lite with 16 experts (top-6), fp32, 256 tokens per rank,
# forward + backward, with the dispatch in the layer's dtype, in bf16 and in
# fp8 (dy then in bf16: grad_dispatch_dtype auto), under the per-assignment
# exchange (a row per token and expert) and the per-rank one (a token once
# per rank: --exchange rank). Bytes on the wire per
# step come from the links' counters (both hosts, TCP/IP headers included;
# they also carry the run's gathers of every result to rank 0, the same in
# every row, so the saving against the layer's dtype is the exchange's):
# the difference between a run of N + 2 iterations and
# one of N (which takes the start's weights and routing out), per iteration,
# halved (every iteration runs the serialized and the interleaved executor).
# Times: medians over the longer run. Root only.
#   bench/dispatch_cluster.sh [iterations] [exchanges] > record.md
# exchanges: "assignment rank" (the default), or one of them.
set -euo pipefail
cd "$(dirname "$0")/.."
iters=${1:-1}
exchanges=${2:-assignment rank}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
h800=$(python3 - <<'PY'
import json
m = json.load(open("machines/h800.json"))
print(round(m["units"]["matrix"] * max(t.get("bf16_flops") or t["efficiency"] * m["matrix"]["peak"]["bf16_flops"] for t in m["matrix"]["tile_rates"]) / m["links"]["inter"]["bytes_per_s"]))
PY
)
layer="--preset deepseek-v2-lite --set routed_experts=16 -T 256 --routing uniform --backward --warmup 1 --verify off"

source bench/record_header.sh
record_header "bench/dispatch_cluster.sh $iters '$exchanges'"
echo
echo "2 hosts, links at the H800 cluster's $h800 FLOP per byte (scripts/cluster.sh --flop-per-byte $h800); $layer; medians of $((iters + 2)) iterations."
echo
echo "| exchange | dispatch | dy | fwd ser ms | fwd int ms | bwd ser ms | bwd int ms | step (fwd + bwd) int ms | wire MB per step (with the result gathers) | saved vs assignment/layer MB per step | step vs assignment/layer |"
echo "|---|---|---|---|---|---|---|---|---|---|---|"
for x in $exchanges; do
for d in layer bf16 fp8; do
  for n in "$iters" $((iters + 2)); do
    # shellcheck disable=SC2086
    scripts/cluster.sh --flop-per-byte "$h800" -- $layer --iters "$n" --dispatch-dtype "$d" --exchange "$x" --peer-timeout 120 \
      --watchdog 300 --json "$tmp/$x-$d-$n.json" > "$tmp/$x-$d-$n.out" 2> "$tmp/$x-$d-$n.err" ||
      { echo "$x|$d|failed: $(grep -m1 -i error "$tmp/$x-$d-$n.err" "$tmp/$x-$d-$n.out" | head -1)"; continue 2; }
  done
  python3 - "$tmp" "$x-$d" "$iters" <<'PY'
import json, re, sys
tmp, d, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
def wire(k):
    total = 0
    for line in open(f"{tmp}/{d}-{k}.err"):
        m = re.search(r"link bytes sent (\d+) received (\d+)", line)
        if m: total += int(m.group(1))
    return total
per_step = (wire(n + 2) - wire(n)) / 2 / 2
r = json.load(open(f"{tmp}/{d}-{n + 2}.json"))
fs, fi = r["serialized"]["dispatch_to_combine"]["median_s"], r["interleaved"]["dispatch_to_combine"]["median_s"]
bs, bi = r["serialized"]["backward"]["median_s"], r["interleaved"]["backward"]["median_s"]
x, disp = d.split("-", 1)
dy = "bf16" if disp in ("bf16", "fp8") else "fp32"
print(f"{x}|{disp}|{dy}|{fs*1e3:.0f}|{fi*1e3:.0f}|{bs*1e3:.0f}|{bi*1e3:.0f}|{(fi+bi)*1e3:.0f}|{per_step/1e6:.2f}")
PY
done
done > "$tmp/rows"
python3 - "$tmp/rows" <<'PY'
import sys
rows = [l.strip().split("|") for l in open(sys.argv[1]) if "|" in l]
base = {(r[0], r[1]): r for r in rows}.get(("assignment", "layer"))
for r in rows:
    if len(r) < 9:
        print("| " + " | ".join(r) + " |"); continue
    wire_ratio = f"{float(base[8]) - float(r[8]):.2f}" if base else "-"
    step_ratio = f"{float(base[7]) / float(r[7]):.2f}x faster" if base else "-"
    print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[5]} | {r[6]} | {r[7]} | {r[8]} | {wire_ratio} | {step_ratio} |")
PY
