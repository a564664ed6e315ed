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
values=$(IFS=,; echo "${bounds[*]}")

source bench/record_header.sh
record_header "bench/put_bound_sweep.sh $hpmoe $machine ${bounds[*]}"
echo
# One `hpmoe sweep` over EP x bound x schedule (in parallel over the cores), then the table.
"$hpmoe" sweep --machine "$machine" --model deepseek-v3 --set shared_experts=0 --dtype bf16 --kernel-scope -T 4096 \
  --routing uniform -P 16,32,64 --backward --schedule ratr,critical-path --vary "put.in_flight=$values" \
  --out "$tmp/sweep" > /dev/null 2>&1
python3 - "$tmp/sweep/sweep.csv" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
print("| EP | put.in_flight | serialized ms | DeepEP-style ms | fused ms, critical-path | fused ms, ratr | best fused vs serialized | best fused vs DeepEP-style |")
print("|---|---|---|---|---|---|---|---|")
at = {(r["ranks"], r["put.in_flight"], r["schedule"]): r for r in rows}
tot = lambda r, k: float(r[f"forward_{k}_ms"]) + float(r[f"backward_{k}_ms"]) if r[f"forward_{k}_ms"] else float("nan")
for (P, b, schedule), r in at.items():
    if schedule != "ratr":
        continue
    c = at[(P, b, "critical-path")]
    s, i, cp, d = tot(r, "serialized"), tot(r, "fused"), tot(c, "fused"), tot(r, "baseline")
    best = min(i, cp)
    label = "unbounded" if int(b) >= 1000000 else b
    print(f"| {P} | {label} | {s:.2f} | {d:.2f} | {cp:.2f} | {i:.2f} | {s / best:.2f}x | {d / best:.2f}x |")
PY
