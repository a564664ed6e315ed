#!/usr/bin/env bash
# What the bound on puts in flight does to a machine model's verdict: the
# same H800 (or another accelerator) model with put.in_flight set to each
# value in turn, DeepSeek-V3 sizes at EP 16, 32 and 64, the paper's kernel
# scope, forward + backward. Every accelerator model must state a bound
# (machines/*.json, with its source); this shows how much the choice moves
# the fused schedule against the serialized and DeepEP-style baselines.
# "unbounded" is 1000000 puts (more than a step issues).
#   bench/put_bound_sweep.sh [build/hpmoe] [machine] [bounds...]
set -euo pipefail
cd "$(dirname "$0")/.."
hpmoe=${1:-build/hpmoe}
machine=${2:-h800}
shift $(( $# > 2 ? 2 : $# ))
bounds=("$@")
[ ${#bounds[@]} -gt 0 ] || bounds=(4 8 16 20 32 64 1000000)
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
model=$machine; [ -f "$model" ] || model=machines/$machine.json
layer="--preset deepseek-v3 --set shared_experts=0 --dtype bf16 --kernel-scope -T 4096 --routing uniform"

source bench/record_header.sh
record_header "bench/put_bound_sweep.sh $hpmoe $machine ${bounds[*]}"
echo
echo "| EP | put.in_flight | serialized ms | DeepEP-style ms | fused ms, critical-path | fused ms, ratr | best fused vs serialized | best fused vs DeepEP-style |"
echo "|---|---|---|---|---|---|---|---|"
for P in 16 32 64; do
  for b in "${bounds[@]}"; do
    python3 - "$model" "$b" "$tmp/m.json" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
m["put"]["in_flight"] = int(sys.argv[2])
json.dump(m, open(sys.argv[3], "w"))
PY
    "$hpmoe" simulate --machine "$tmp/m.json" $layer -P "$P" --backward --schedule ratr --json "$tmp/r.json" > /dev/null
    "$hpmoe" simulate --machine "$tmp/m.json" $layer -P "$P" --backward --schedule critical-path --json "$tmp/c.json" > /dev/null
    python3 - "$tmp/r.json" "$tmp/c.json" "$P" "$b" <<'PY'
import json, sys
r, c, P, b = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])), sys.argv[3], int(sys.argv[4])
tot = lambda j, k: (j["forward"][k] + j["backward"][k]) * 1e3
s, i, cp = tot(r, "serialized_s"), tot(r, "interleaved_s"), tot(c, "interleaved_s")
d = tot(r, "deepep_s") if "deepep_s" in r["forward"] else float("nan")
best = min(i, cp)
label = "unbounded" if b >= 1000000 else str(b)
print(f"| {P} | {label} | {s:.2f} | {d:.2f} | {cp:.2f} | {i:.2f} | {s / best:.2f}x | {d / best:.2f}x |")
PY
  done
done
