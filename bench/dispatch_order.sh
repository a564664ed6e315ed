#!/usr/bin/env bash
# Two builds of hpmoe side by side on one simulated grid (docs/results/placement.md): the fused
# layer's forward + backward predicted by each, and the ratio. Used to record what a change to
# the generator or the schedule did (deterministic: no timing noise).
#   bench/dispatch_order.sh BEFORE_HPMOE AFTER_HPMOE [OUTDIR]
# The grid: A3 and H800, deepseek-v3 and qwen3-235b-a22b (bf16, no shared expert), EP 4-64,
# 4096 tokens a rank, uniform and Zipf 1.2 routing, contiguous placement.
set -euo pipefail
before=${1:?usage: bench/dispatch_order.sh BEFORE_HPMOE AFTER_HPMOE [OUTDIR]}
after=${2:?usage: bench/dispatch_order.sh BEFORE_HPMOE AFTER_HPMOE [OUTDIR]}
out=${3:-dispatch-order}
grid=(--machine ascend-a3,h800 --model deepseek-v3,qwen3-235b-a22b --set shared_experts=0 --dtype bf16
      -P 4,8,16,32,64 -T 4096 --routing uniform,zipf:1.2 --backward -j "${JOBS:-2}")
"$before" sweep "${grid[@]}" --out "$out/before" > /dev/null
"$after" sweep "${grid[@]}" --out "$out/after" > /dev/null
python3 - "$out" <<'PY'
import csv, statistics, sys
out = sys.argv[1]
rows = [list(csv.DictReader(open(f"{out}/{w}/sweep.csv"))) for w in ("before", "after")]
fused = lambda r: float(r["forward_fused_ms"]) + float(r["backward_fused_ms"])
print("| machine | model | EP | routing | fused fwd+bwd before (ms) | after (ms) | before / after |")
print("|---|---|---|---|---|---|---|")
ratios = {}
for b, a in zip(*rows):
    assert (b["machine"], b["model"], b["ranks"], b["routing"]) == (a["machine"], a["model"], a["ranks"], a["routing"])
    x = fused(b) / fused(a)
    ratios.setdefault(a["routing"], []).append(x)
    print(f"| {a['machine']} | {a['model']} | {a['ranks']} | {a['routing']} | {fused(b):.2f} | {fused(a):.2f} | {x:.3f}x |")
for routing, xs in ratios.items():
    print(f"{routing}: before / after min {min(xs):.3f}x, median {statistics.median(xs):.3f}x, max {max(xs):.3f}x over {len(xs)} points")
PY
