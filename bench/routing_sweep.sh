#!/usr/bin/env bash
# Serialized baseline under different routing on one layer shape (Mixtral-8x7B
# routing layout: 8 experts, top-2, hidden 4096; expert inter reduced to 1792
# so a step takes about a second here), EP 2, 1024 tokens per rank, fp32 and
# bf16, forward + backward. Prints one line per run.
#   bench/routing_sweep.sh [build/hpmoe]
set -euo pipefail
cd "$(dirname "$0")/.."
hpmoe=${1:-build/hpmoe}
trace=data/routing/mixtral-8x7b/coding.json
for dtype in fp32 bf16; do
  for routing in uniform zipf:1.2 hot:0.3 "trace:$trace:0" "trace:$trace:15" "trace:$trace:31"; do
    out=$("$hpmoe" run --preset mixtral-8x7b --set expert_inter=1792 -P 2 -T 1024 --dtype $dtype \
           --routing "$routing" --backward --iters 5 --warmup 1 --verify sample 2>/dev/null)
    printf '%s | %-42s | %s | %s | %s\n' "$dtype" "$routing" \
      "$(grep -o 'rank max/mean [0-9.]*' <<<"$out")" \
      "$(grep -o 'dispatch-to-combine [0-9.]* ms' <<<"$out"), $(grep 'serialized router' <<<"$out" | grep -o '[0-9.]* GFLOP/s')" \
      "$(grep -o 'serialized backward [0-9.]* ms' <<<"$out"), $(grep 'serialized backward' <<<"$out" | grep -o '[0-9.]* GFLOP/s'); verify $(grep -o 'PASS\|FAIL' <<<"$out" | head -1)"
  done
done
