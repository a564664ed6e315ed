#!/usr/bin/env bash
# Load-aware placement at EP 256, simulated (docs/results/placement.md):
# deepseek-v3 layer sizes, bf16, no shared expert, 4096 tokens per rank,
# Zipf 1.2 routing, on the A3 and H800 machine models, forward + backward.
# For each slot budget (experts a rank may hold: 2 = one spare slot per
# rank, 3, 4): `hpmoe plan` from 8 steps of history, its placement
# simulated on a ninth step it did not see. The force-balanced ideal is
# the same layer with exactly equal counts (--routing balanced), contiguous.
# Predicted times are deterministic (no timing noise); ~4 min a plan.
#   bench/placement_ep256.sh [OUTDIR] [BUDGETS...]
set -euo pipefail
hpmoe=${HPMOE:-build/hpmoe}
out=${1:-placement-ep256}
shift || true
budgets=("${@:-2 3 4}")
read -r -a budgets <<< "${budgets[*]}"
mkdir -p "$out"
layer=(--preset deepseek-v3 --set shared_experts=0 --dtype bf16 -P 256 -T 4096)
for machine in ascend-a3 h800; do
  "$hpmoe" simulate --machine "$machine" "${layer[@]}" --routing balanced --backward --json "$out/$machine-ideal.json" > /dev/null
  for b in "${budgets[@]}"; do
    "$hpmoe" plan --machine "$machine" "${layer[@]}" --routing zipf:1.2 --slots-per-rank "$b" \
      --out "$out/$machine-b$b-placement.json" --json "$out/$machine-b$b-plan.json" > "$out/$machine-b$b-plan.txt"
  done
done
python3 - "$out" "${budgets[@]}" <<'PY'
import json, sys
out, budgets = sys.argv[1], sys.argv[2:]
def both(d):
    return ((d["forward"]["serialized_s"] + d["backward"]["serialized_s"]) * 1e3,
            (d["forward"]["interleaved_s"] + d["backward"]["interleaved_s"]) * 1e3)
print("| machine | slots per rank | replicas | rank max/mean before -> after | unbalanced ser / int (ms) | planned ser / int (ms) | ideal ser / int (ms) | ideal ser / planned ser | best ideal / best planned |")
print("|---|---|---|---|---|---|---|---|---|")
for machine in ("ascend-a3", "h800"):
    iser, iint = both(json.load(open(f"{out}/{machine}-ideal.json")))
    for b in budgets:
        p = json.load(open(f"{out}/{machine}-b{b}-plan.json"))
        bf, af = p["before"], p["after"]
        pser, pint = af["simulated_serialized_s"] * 1e3, af["simulated_interleaved_s"] * 1e3
        print(f"| {machine} | {b} | {p['replicas_added']} | {bf['rank_max_over_mean']:.2f} -> {af['rank_max_over_mean']:.3f} "
              f"| {bf['simulated_serialized_s']*1e3:.1f} / {bf['simulated_interleaved_s']*1e3:.1f} | {pser:.1f} / {pint:.1f} "
              f"| {iser:.1f} / {iint:.1f} | {iser / pser:.1%} | {min(iser, iint) / min(pser, pint):.1%} |")
PY
