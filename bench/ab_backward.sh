#!/usr/bin/env bash
# Two builds of hpmoe side by side on the same backward passes: for each
# configuration, A then B then A then B (each a fresh process, 3 iterations
# after a warm-up), the median of each executor's backward. Prints the CPU
# model and one table row per configuration with B's speedup over A.
#   bench/ab_backward.sh A/hpmoe B/hpmoe [tokens...]
set -euo pipefail
cd "$(dirname "$0")/.."
a=$1 b=$2; shift 2
tokens=${*:-256}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
source bench/record_header.sh  # from the repository root (the cd above)
echo "$(record_header "$0 $*") A: \`$a\`, B: \`$b\`."
echo
echo "| layer | P x W | tokens | serialized A ms | B ms | B/A speedup | interleaved A ms | B ms | B/A speedup |"
echo "|---|---|---|---|---|---|---|---|---|"
for T in $tokens; do
  for layer in "deepseek-v2-lite" "qwen3-30b-a3b" "mixtral-8x7b --set expert_inter=1792"; do
    for pw in "1 2" "2 1"; do
      set -- $pw
      for round in 1 2; do
        for side in a b; do
          bin=$a; [ $side = b ] && bin=$b
          "$bin" run --preset $layer -P "$1" -W "$2" -T "$T" --routing uniform --backward --iters 3 --warmup 1 \
            --verify off --json "$tmp/$side$round.json" > /dev/null 2>&1
        done
      done
      python3 - "$tmp" "${layer%% *}" "$1 x $2" "$T" <<'PY'
import json, statistics, sys
tmp, label, pw, T = sys.argv[1:]
def med(side, ex):
    return statistics.median(json.load(open(f"{tmp}/{side}{r}.json"))[ex]["backward"]["median_s"] for r in (1, 2)) * 1e3
row = [label, pw, T]
for ex in ("serialized", "interleaved"):
    a, b = med("a", ex), med("b", ex)
    row += [f"{a:.1f}", f"{b:.1f}", f"{a / b:.2f}x"]
print("| " + " | ".join(row) + " |")
PY
    done
  done
done
