#!/usr/bin/env bash
# Serialized vs interleaved Dispatch-to-Combine, forward, side by side in one
# process per configuration (the executors alternate on the same inputs; the
# outputs are checked bit-identical). Prints one table row per run.
#   bench/side_by_side.sh [build/hpmoe] [iterations]
set -euo pipefail
cd "$(dirname "$0")/.."
hpmoe=${1:-build/hpmoe}
iters=${2:-5}
trace=data/routing/mixtral-8x7b/coding.json
echo "| layer | P x W | tokens/rank | routing | serialized ms | interleaved ms | speedup | bit-identical |"
echo "|---|---|---|---|---|---|---|---|"
run() {  # layer-args label P W T routing
  local out
  out=$("$hpmoe" run $1 -P "$3" -W "$4" -T "$5" --routing "$6" --iters "$iters" --warmup 1 --verify sample 2>/dev/null) || true
  local s i sp same
  s=$(grep -oE '^serialized router .* dispatch-to-combine [0-9.]+' <<<"$out" | grep -oE '[0-9.]+$' || echo "-")
  i=$(grep -oE '^interleaved \([a-z-]+\) dispatch-to-combine [0-9.]+' <<<"$out" | grep -oE '[0-9.]+$' || echo "-")
  sp=$(grep -oE 'speedup [0-9.]+x' <<<"$out" | grep -oE '[0-9.]+x' || echo "-")
  if grep -q 'interleaved = serialized: bit-identical' <<<"$out"; then same=yes; else same=NO; fi
  echo "| $2 | $3 x $4 | $5 | $6 | $s | $i | $sp | $same |"
}
for T in 256 1024; do
  for pw in "1 2" "2 1"; do
    set -- $pw
    for routing in uniform zipf:1.2; do
      run "--preset deepseek-v2-lite" "deepseek-v2-lite" "$1" "$2" "$T" "$routing"
      run "--preset qwen3-30b-a3b" "qwen3-30b-a3b" "$1" "$2" "$T" "$routing"
    done
    for routing in uniform zipf:1.2 "trace:$trace:15"; do
      run "--preset mixtral-8x7b --set expert_inter=1792" "mixtral-8x7b (inter 1792)" "$1" "$2" "$T" "$routing"
    done
  done
done
