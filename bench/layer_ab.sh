#!/usr/bin/env bash
# Two builds of hpmoe side by side on the whole layer, forward and backward,
# both executors: for each configuration A B A B ... (a fresh process each,
# ITERS iterations after a warm-up), the medians over the rounds of each
# executor's forward (Dispatch-to-Combine) and backward. Prints the CPU and
# one table row per configuration and dtype with B / A (below 1: B faster).
#   bench/layer_ab.sh A/hpmoe B/hpmoe [ROUNDS] [ITERS]
# AB_DTYPES="fp32 bf16" and AB_LAYERS="deepseek qwen3 node" pick a subset
# (deepseek-v2-lite: about 90 s a run on 2 cores, 13 GiB).
set -euo pipefail
a=${1:?A/hpmoe}; b=${2:?B/hpmoe}; rounds=${3:-3}; iters=${4:-5}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
source "$(dirname "$0")/record_header.sh"
echo "$(record_header "$0 $*") A: \`$a\`, B: \`$b\`; $rounds rounds x $iters iterations."
echo
echo "| layer | dtype | executor | pass | A ms (median, range) | B ms (median, range) | B / A |"
echo "|---|---|---|---|---|---|---|"
for dtype in ${AB_DTYPES:-fp32 bf16}; do
  for short in ${AB_LAYERS:-deepseek qwen3}; do
    case $short in
      deepseek) layer="deepseek-v2-lite -P 2 -W 1 -T 512" ;;
      qwen3) layer="qwen3-30b-a3b -P 1 -W 2 -T 256" ;;
      # the per-node exchange in process: 4 ranks in 2 nodes
      node) layer="deepseek-v2-lite -P 4 -W 1 -T 256 --exchange rank --set ranks_per_node=2" ;;
      *) echo "AB_LAYERS: unknown layer '$short' (deepseek, qwen3, node)" >&2; exit 2 ;;
    esac
    key=$(echo "$layer $dtype" | tr ' :' '__')
    for ((r = 0; r < rounds; ++r)); do
      for side in A B; do
        bin=$a; [ $side = B ] && bin=$b
        # shellcheck disable=SC2086
        "$bin" run --preset $layer --set dtype=$dtype --routing zipf:1.2 --backward --iters "$iters" --warmup 1 \
          --verify off --json "$tmp/$key.$side.$r.json" > /dev/null 2> "$tmp/$key.$side.$r.err" || true
      done
    done
    python3 - "$tmp" "$key" "$rounds" "$layer" "$dtype" <<'PY'
import json, os, statistics, sys
tmp, key, rounds, layer, dtype = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
def runs(side):
    out = []
    for r in range(rounds):
        p = f"{tmp}/{key}.{side}.{r}.json"
        if os.path.exists(p) and os.path.getsize(p):
            out.append(json.load(open(p)))
    return out
A, B = runs("A"), runs("B")
if not A or not B:
    err = open(f"{tmp}/{key}.{'A' if not A else 'B'}.0.err").read().strip().splitlines()
    print(f"| {layer} | {dtype} | - | - | {'failed: ' + err[-1][:80] if not A and err else '-'} | "
          f"{'failed: ' + err[-1][:80] if not B and err else '-'} | - |")
    sys.exit(0)
for ex in ("serialized", "interleaved"):
    for name, field in (("forward", "dispatch_to_combine"), ("backward", "backward")):
        a = [r[ex][field]["median_s"] * 1e3 for r in A if ex in r and field in r[ex]]
        b = [r[ex][field]["median_s"] * 1e3 for r in B if ex in r and field in r[ex]]
        if a and b:
            print(f"| {layer} | {dtype} | {ex} | {name} | {statistics.median(a):.1f} ({min(a):.1f}-{max(a):.1f}) | "
                  f"{statistics.median(b):.1f} ({min(b):.1f}-{max(b):.1f}) | {statistics.median(b) / statistics.median(a):.3f} |")
PY
  done
done
