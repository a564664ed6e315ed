#!/usr/bin/env bash
# Issue 60's table: the fused layer against a DeepEP-style exchange on the
# simulated H800, DeepSeek-V3 without shared experts, bf16, fp8 dispatch,
# kernel scope, RATR, 4096 tokens per rank, forward + backward; per
# assignment and per node (--exchange rank, 8 ranks a node). For each EP and
# routing: fused vs DeepEP-style (time), fused vs its own serialized run, and
# the fused schedule's cross-node bytes against DeepEP's.
#   bench/node_exchange_table.sh [BIN] [MACHINE]     EPS="16 32 64" ROUTINGS="uniform" pick the grid
set -euo pipefail
bin=${1:-build/hpmoe}; machine=${2:-h800}
eps=${EPS:-16 32 64}; routings=${ROUTINGS:-uniform}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
source "$(dirname "$0")/record_header.sh"
echo "$(record_header "EPS='$eps' ROUTINGS='$routings' $0 $bin $machine")"
echo
common=(--machine "$machine" --preset deepseek-v3 --set shared_experts=0 --dtype bf16 --kernel-scope -T 4096
        --schedule ratr --backward --dispatch-dtype fp8)
for routing in $routings; do
  for ep in $eps; do
    # A point that does not fit (a hot expert's rows past the H800's memory) is a row with the reason.
    "$bin" simulate "${common[@]}" -P "$ep" --routing "$routing" --json "$tmp/assignment.$routing.$ep.json" \
      > /dev/null 2> "$tmp/assignment.$routing.$ep.err" || true
    "$bin" simulate "${common[@]}" -P "$ep" --routing "$routing" --exchange rank --set ranks_per_node=8 \
      --json "$tmp/node.$routing.$ep.json" > /dev/null 2> "$tmp/node.$routing.$ep.err" || true
  done
done
python3 - "$tmp" "$eps" "$routings" <<'PY'
import json, sys
tmp, eps, routings = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()
def both(j, key):
    return j["forward"][key] + j["backward"][key]
print("| routing | EP | per assignment: fused vs DeepEP-style | its cross-node bytes vs DeepEP's | per node: fused vs DeepEP-style | per node: fused vs its serialized | its cross-node bytes vs DeepEP's | per node fused / DeepEP-style ms |")
print("|---|---|---|---|---|---|---|---|")
for routing in routings:
    for ep in eps:
        try:
            a = json.load(open(f"{tmp}/assignment.{routing}.{ep}.json"))
            n = json.load(open(f"{tmp}/node.{routing}.{ep}.json"))
        except OSError:
            why = " ".join(open(f"{tmp}/{w}.{routing}.{ep}.err").read().strip() for w in ("assignment", "node"))
            print(f"| {routing} | {ep} | {why[:160]} |||||| ")
            continue
        row = [routing, ep,
               f"{both(a, 'deepep_s') / both(a, 'interleaved_s'):.2f}x",
               f"{both(a, 'cross_node_bytes') / both(a, 'deepep_cross_node_bytes'):.2f}x",
               f"{both(n, 'deepep_s') / both(n, 'interleaved_s'):.2f}x",
               f"{both(n, 'serialized_s') / both(n, 'interleaved_s'):.2f}x",
               f"{both(n, 'cross_node_bytes') / both(n, 'deepep_cross_node_bytes'):.2f}x",
               f"{both(n, 'interleaved_s') * 1e3:.1f} / {both(n, 'deepep_s') * 1e3:.1f}"]
        print("| " + " | ".join(str(x) for x in row) + " |")
PY
