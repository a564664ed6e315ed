#!/usr/bin/env bash
# Load-aware placement measured on this machine (docs/results/placement.md): for
# P = 2 and 4 under hot-expert (share 0.3) and trace routing, `hpmoe plan`
# chooses replicas on the calibrated CPU model; then, alternating for ROUNDS
# rounds, the unbalanced layer (contiguous placement) runs serialized and the
# planned one serialized and interleaved, forward only (Dispatch-to-Combine)
# and checked against the oracle by sampling. Medians over rounds of each
# run's median, next to the simulator's prediction on this machine's model
# (`hpmoe calibrate`, run first into OUTDIR). One worker per rank: at P = 4
# four ranks share the two cores.
#   bench/placement_side_by_side.sh [ROUNDS] [OUTDIR]
#   PLAN_FLAGS="--splits --no-replicas" bench/placement_side_by_side.sh ...   (hybrid TP/EP splits instead of replicas)
set -euo pipefail
hpmoe=${HPMOE:-build/hpmoe}
rounds=${1:-3}
out=${2:-placement-side-by-side}
mkdir -p "$out"
source "$(dirname "$0")/record_header.sh"
record_header "$0 $*" | tee "$out/cpu.txt"
model="$out/cpu-local.json"
[ -s "$model" ] || "$hpmoe" calibrate -W 1 --out "$model" > /dev/null
# deepseek-v2-lite's expert sizes with 8 experts, top-2 (the Mixtral traces'
# shape), no shared expert: the routed experts are the whole layer.
layer=(--preset deepseek-v2-lite --set routed_experts=8 --set top_k=2 --set shared_experts=0 -T 256)
trace="trace:data/routing/mixtral-8x7b/coding.json:8"
for np in 2 4; do
  for routing in hot:0.3 "$trace"; do
    tag="p$np-$(echo "${routing%%:*}")"
    "$hpmoe" plan "${layer[@]}" -P "$np" --routing "$routing" --machine "$model" --inference ${PLAN_FLAGS:-} \
      --out "$out/$tag-placement.json" --json "$out/$tag-plan.json" > "$out/$tag-plan.txt"
    for placement in contiguous "$out/$tag-placement.json"; do
      which=$([ "$placement" = contiguous ] && echo unbalanced || echo balanced)
      "$hpmoe" simulate "${layer[@]}" -P "$np" --routing "$routing" --placement "$placement" --machine "$model" \
        --workers 1 --json "$out/$tag-$which-sim.json" > /dev/null
    done
    for round in $(seq "$rounds"); do
      "$hpmoe" run "${layer[@]}" -P "$np" --routing "$routing" -W 1 --mode serialized --iters 5 --warmup 1 \
        --verify sample --sample 4 --json "$out/$tag-unbalanced-$round.json" > /dev/null
      "$hpmoe" run "${layer[@]}" -P "$np" --routing "$routing" --placement "$out/$tag-placement.json" -W 1 --mode both \
        --iters 5 --warmup 1 --verify sample --sample 4 --json "$out/$tag-balanced-$round.json" > /dev/null
    done
  done
done
python3 - "$out" "$rounds" <<'EOF'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def load(p): return json.load(open(p))
print("| P | routing | rank max/mean before -> after | unbalanced serialized | balanced serialized | balanced interleaved | predicted (same three) |")
print("|---|---|---|---|---|---|---|")
for np in (2, 4):
    for routing in ("hot", "trace"):
        tag = f"p{np}-{routing}"
        ub = [load(f"{out}/{tag}-unbalanced-{r}.json") for r in range(1, rounds + 1)]
        bal = [load(f"{out}/{tag}-balanced-{r}.json") for r in range(1, rounds + 1)]
        med = lambda runs, ex: statistics.median(j[ex]["dispatch_to_combine"]["median_s"] for j in runs) * 1e3
        su = load(f"{out}/{tag}-unbalanced-sim.json"); sb = load(f"{out}/{tag}-balanced-sim.json")
        before = ub[0]["routing"]["rank_max_over_mean"]; after = bal[0]["routing"]["rank_max_over_mean"]
        for j in ub + bal: assert j["verification"]["pass"], f"{tag}: verification failed"
        print(f"| {np} | {routing} | {before:.3f} -> {after:.3f} | {med(ub, 'serialized'):.1f} ms | {med(bal, 'serialized'):.1f} ms "
              f"| {med(bal, 'interleaved'):.1f} ms | {su['forward']['serialized_s']*1e3:.1f} / {sb['forward']['serialized_s']*1e3:.1f}"
              f" / {sb['forward']['interleaved_s']*1e3:.1f} ms |")
EOF
