#!/usr/bin/env bash
# The simulator's memory check in the paper's settings: for DeepSeek-V3 (bf16, 4096 tokens a rank,
# forward + backward, with and without Adam's state) on the A3 and H800 models at EP 8-256, what the
# rank that holds the most needs, for uniform routing and for the worst routing, against the machine's
# memory per rank. Deterministic. Prints markdown.
#   bench/memory_table.sh [build/hpmoe] >> docs/results/simulation.md
set -euo pipefail
cd "$(dirname "$0")/.."
hpmoe=${1:-build/hpmoe}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
source bench/record_header.sh
record_header "bench/memory_table.sh $hpmoe"
echo
echo "| machine | EP | optimizer state | weights GB | gradients GB | optimizer GB | buffers GB (uniform) | total GB | of GB | worst routing total GB | worst fits |"
echo "|---|---|---|---|---|---|---|---|---|---|---|"
for machine in ascend-a3 h800; do
  for P in 8 16 64 256; do
    for opt in "" --optimizer-state; do
      if ! "$hpmoe" simulate --machine "$machine" --preset deepseek-v3 --dtype bf16 -P "$P" -T 4096 --backward $opt \
           --json "$tmp/m.json" > /dev/null 2> "$tmp/err.txt"; then
        echo "| $machine | $P | ${opt:+Adam} | $(sed 's/^error: //' "$tmp/err.txt" | tr '|' '/') | | | | | | | |"
        continue
      fi
      python3 - "$tmp/m.json" "$machine" "$P" "${opt:+Adam}" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))["memory"]
g = lambda k: f"{m[k] / 1e9:.1f}"
print(f"| {sys.argv[2]} | {sys.argv[3]} | {sys.argv[4] or 'no'} | {g('weights_bytes')} | {g('gradients_bytes')} | {g('optimizer_bytes')} | "
      f"{g('buffers_bytes')} | {g('total_bytes')} | {g('capacity_bytes')} | {g('worst_routing_total_bytes')} | "
      f"{'yes' if m.get('worst_routing_fits') else 'no'} |")
PY
    done
  done
done
