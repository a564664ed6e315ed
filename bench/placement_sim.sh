#!/usr/bin/env bash
# Load-aware placement on the accelerator clusters, simulated
# (docs/results/placement.md): deepseek-v3 layer sizes, bf16, no shared expert,
# 4096 tokens per rank, EP 64, on the A3 and H800 machine models, under
# Zipf routing. For each: the contiguous placement ("unbalanced"), the
# placement `hpmoe plan` chooses from 8 steps of the same routing (replicas
# plus per-step quotas, one spare slot per rank), and the force-balanced
# ideal (the same layer with exactly equal counts: --routing balanced);
# forward + backward, serialized and interleaved. Predicted times are
# deterministic (no timing noise).
#   bench/placement_sim.sh [OUTDIR]
set -euo pipefail
hpmoe=${HPMOE:-build/hpmoe}
out=${1:-placement-sim}
mkdir -p "$out"
layer=(--preset deepseek-v3 --set shared_experts=0 --dtype bf16 -P 64 -T 4096)
for machine in ascend-a3 h800; do
  "$hpmoe" simulate --machine "$machine" "${layer[@]}" --routing balanced --backward --json "$out/$machine-ideal.json" > /dev/null
  for routing in zipf:1.1 zipf:1.2 zipf:1.4; do
    tag="$machine-${routing/:/}"
    "$hpmoe" plan --machine "$machine" "${layer[@]}" --routing "$routing" --out "$out/$tag-placement.json" \
      --json "$out/$tag-plan.json" > "$out/$tag-plan.txt"
  done
done
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
print("| machine | routing | replicas | rank max/mean before -> after | unbalanced ser / int (ms) | balanced ser / int (ms) | ideal ser / int (ms) | balanced int / ideal int | speedup over unbalanced serialized |")
print("|---|---|---|---|---|---|---|---|---|")
for machine in ("ascend-a3", "h800"):
    ideal = json.load(open(f"{out}/{machine}-ideal.json"))
    iser = (ideal["forward"]["serialized_s"] + ideal["backward"]["serialized_s"]) * 1e3
    iint = (ideal["forward"]["interleaved_s"] + ideal["backward"]["interleaved_s"]) * 1e3
    for routing in ("zipf1.1", "zipf1.2", "zipf1.4"):
        p = json.load(open(f"{out}/{machine}-{routing}-plan.json"))
        b, a = p["before"], p["after"]
        print(f"| {machine} | {routing.replace('zipf', 'Zipf ')} | {p['replicas_added']} | {b['rank_max_over_mean']:.2f} -> {a['rank_max_over_mean']:.3f} "
              f"| {b['simulated_serialized_s']*1e3:.1f} / {b['simulated_interleaved_s']*1e3:.1f} "
              f"| {a['simulated_serialized_s']*1e3:.1f} / {a['simulated_interleaved_s']*1e3:.1f} | {iser:.1f} / {iint:.1f} "
              f"| {iint / (a['simulated_interleaved_s']*1e3):.1%} | {b['simulated_serialized_s'] / a['simulated_interleaved_s']:.2f}x |")
PY
