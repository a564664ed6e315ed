#!/usr/bin/env bash
# Weights instead of tokens on this machine: the CPU runtime (in-process
# ranks, one worker each) with --lend off and auto side by side, alternating
# in ROUNDS rounds, under uniform and skewed routing, tokens per rank and
# expert sizes (16 experts, top-2, fp32; a case is "EP routing tokens hidden
# inter"). Each run's interleaved forward (dispatch to combine) and backward
# medians; the table gives the median over rounds and the rounds' spread
# (min-max), and the bytes put. Nothing else heavy may run meanwhile.
#   ROUNDS=5 bench/lend_cpu.sh [build/hpmoe] >> docs/results/placement.md
set -euo pipefail
cd "$(dirname "$0")/.."
hpmoe=${1:-build/hpmoe}
rounds=${ROUNDS:-5}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
source bench/record_header.sh
record_header "ROUNDS=$rounds bench/lend_cpu.sh $hpmoe"
layer=(--set routed_experts=16 --set shared_experts=0 --backward --mode interleaved -W 1 --iters 10 --warmup 2 --verify off)
cases=("2 uniform 2048 512 128" "2 zipf:1.2 2048 512 128" "2 hot:0.4 2048 512 128" "4 zipf:1.2 2048 512 128"
       "2 hot:0.4 512 512 128" "2 hot:0.4 512 512 256" "2 hot:0.4 2048 512 256" "2 hot:0.4 2048 1024 128")
for ((round = 0; round < rounds; ++round)); do
  for c in "${cases[@]}"; do
    set -- $c
    for lend in off auto; do
      "$hpmoe" run "${layer[@]}" -P "$1" --routing "$2" -T "$3" --set hidden="$4" --set expert_inter="$5" --lend "$lend" \
        --json "$tmp/${c// /_}_${lend}_$round.json" > /dev/null 2>&1
    done
  done
done
python3 - "$tmp" "$rounds" "${cases[@]}" <<'PY'
import json, statistics, sys
tmp, rounds, cases = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
print()
print("| EP | routing | tokens/rank | hidden | inter | threshold rows | lent pairs | put MB fwd off -> auto | fwd ms off | fwd ms auto | bwd ms off | bwd ms auto | fwd+bwd off/auto |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for c in cases:
    P, routing, T, H, I = c.split()
    name = c.replace(" ", "_")
    runs = {l: [json.load(open(f"{tmp}/{name}_{l}_{r}.json")) for r in range(rounds)] for l in ("off", "auto")}
    def times(l, part):
        return [j["interleaved"][part]["median_s"] * 1e3 for j in runs[l]]
    def cell(v):
        return f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})"
    ratio = [(a + b) / (c + d) for a, b, c, d in zip(times("off", "dispatch_to_combine"), times("off", "backward"),
                                                     times("auto", "dispatch_to_combine"), times("auto", "backward"))]
    lent = runs["auto"][0]["exchange_bytes"].get("lent", {}).get("experts", 0)
    threshold = runs["auto"][0]["exchange_bytes"].get("lent", {}).get("threshold_rows", "")
    mb = lambda l: runs[l][0]["exchange_bytes"]["forward"] / 1e6
    print(f"| {P} | {routing} | {T} | {H} | {I} | {threshold} | {lent} | {mb('off'):.1f} -> {mb('auto'):.1f} | {cell(times('off', 'dispatch_to_combine'))} | "
          f"{cell(times('auto', 'dispatch_to_combine'))} | {cell(times('off', 'backward'))} | {cell(times('auto', 'backward'))} | "
          f"{cell(ratio)}x |")
PY
