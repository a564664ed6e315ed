#!/usr/bin/env bash
# Rank imbalance on the project's recorded routing (docs/results/placement.md):
# Mixtral-8x7B's MT-Bench traces (data/routing/mixtral-8x7b, 5 categories),
# layers 7, 15 and 23, 8 experts top-2 at EP 4, 512 tokens per rank. For each:
# `hpmoe plan` with its defaults (mixtral sizes, machine cpu-local, 8 steps
# of history, one spare slot per rank), then `hpmoe run --placement` on the
# trace's first step, which reports the rank max/mean of the rows each rank
# computes under the per-step quota plan. Rows depend on the routing and the
# placement only, so the run uses small hidden sizes (the plan prices the
# real ones). Prints a markdown table and the mean.
#   bench/placement_traces.sh [OUTDIR]
set -euo pipefail
hpmoe=${HPMOE:-build/hpmoe}
out=${1:-placement-traces}
mkdir -p "$out"
layer=(--preset mixtral-8x7b -P 4 -T 512)
small=(--set hidden=128 --set expert_inter=64 --iters 1 --warmup 0)
imbalance() { sed -n 's/.*rank max\/mean \([0-9.]*\),.*/\1/p' | head -1; }
echo "| trace | layer | replicas | predicted before -> after (plan, 8 steps) | run: rank max/mean before -> after |"
echo "|---|---|---|---|---|"
for category in coding extraction humanities roleplay writing; do
  for l in 7 15 23; do
    routing="trace:data/routing/mixtral-8x7b/$category.json:$l"
    tag="$category-$l"
    "$hpmoe" plan "${layer[@]}" --routing "$routing" --out "$out/$tag.json" --json "$out/$tag-plan.json" > /dev/null
    before=$("$hpmoe" run "${layer[@]}" "${small[@]}" --routing "$routing" | imbalance)
    after=$("$hpmoe" run "${layer[@]}" "${small[@]}" --routing "$routing" --placement "$out/$tag.json" | imbalance)
    predicted=$(python3 -c "import json; p = json.load(open('$out/$tag-plan.json')); print(p['replicas_added'], '|', '%.3f -> %.3f' % (p['before']['rank_max_over_mean'], p['after']['rank_max_over_mean']))")
    echo "| $category | $l | $predicted | $before -> $after |"
    echo "$before $after" >> "$out/pairs.txt"
  done
done
python3 - "$out/pairs.txt" <<'PY'
import sys
pairs = [tuple(map(float, line.split())) for line in open(sys.argv[1])]
before, after = zip(*pairs)
print(f"\n{len(pairs)} cases: before mean {sum(before)/len(before):.3f} (max {max(before):.3f}); "
      f"after mean {sum(after)/len(after):.3f} (max {max(after):.3f}, cases above 1.05: {sum(a > 1.05 for a in after)})")
PY
rm -f "$out/pairs.txt"
