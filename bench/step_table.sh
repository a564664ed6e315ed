#!/usr/bin/env bash
# `hpmoe step` in the paper's settings: a whole DeepSeek-style training step (61 layers, 3 dense; MLA
# attention of DeepSeek-V3: 187 M weights a layer, scores 20480 wide over a 4096-token sequence), bf16,
# 4096 tokens a rank, on the A3 model (against the MindSpore-style framework, the paper's baseline) and
# on the H800 model (against DeepEP-style), each way's step against the machine's framework step, the
# MoE layers' share of that step, and the time the rest of the step (optimizer, gradient reduction,
# pipeline bubbles: what this model leaves out) would need for the fused step to be the paper's ~1.08x
# end to end. Deterministic. Prints markdown.
#   bench/step_table.sh [build/hpmoe] >> docs/results/simulation.md
set -euo pipefail
cd "$(dirname "$0")/.."
hpmoe=${1:-build/hpmoe}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
source bench/record_header.sh
record_header "bench/step_table.sh $hpmoe"
echo
echo "| machine | layer | EP | routing | framework step ms | MoE share | serialized | framework + 2 micro-batches | fused | fused + 2 micro-batches | rest of the step for 1.08x, ms |"
echo "|---|---|---|---|---|---|---|---|---|---|---|"
model=(--dtype bf16 --layers 61 --dense-layers 3 --dense-inter 18432 --attention-params 187e6 --attention-width 20480 --seq-len 4096)
row() {  # machine, label, EP, routing, layer options...
  local machine=$1 label=$2 P=$3 routing=$4; shift 4
  local tokens=(-T 4096); [[ " $* " == *" -T "* ]] && tokens=()
  "$hpmoe" step --machine "$machine" -P "$P" --routing "$routing" "${model[@]}" "${tokens[@]}" "$@" --json "$tmp/s.json" > /dev/null
  python3 - "$tmp/s.json" "$machine" "$label" "$P" "$routing" <<'PY'
import json, sys
j = json.load(open(sys.argv[1])); ways = {w["name"]: w for w in j["ways"]}
base = ways[j["baseline"]]; fused = ways["fused (hpmoe)"]
moe = (j["layers"] - j["dense_layers"]) * (base["moe_forward_s"] + base["moe_backward_s"]) / base["step_s"]
rest = max(0.0, (base["step_s"] - 1.08 * fused["step_s"]) / 0.08)
s = lambda n: f'{ways[n]["speedup"]:.2f}x'
print(f'| {sys.argv[2]} | {sys.argv[3]} | {sys.argv[4]} | {sys.argv[5]} | {base["step_s"] * 1e3:.0f} | {moe * 100:.0f}% | '
      f'{s("serialized")} | {s(j["baseline"] + " + 2 micro-batches")} | {s("fused (hpmoe)")} | {s("fused (hpmoe) + 2 micro-batches")} | {rest * 1e3:.0f} |')
PY
}
for P in 16 64; do
  for routing in uniform zipf:1.2; do row ascend-a3 deepseek-v3 "$P" "$routing" --preset deepseek-v3; done
done
row ascend-a3 deepseek-v3 16 router --preset deepseek-v3
row ascend-a3 "hyper-parallel EP4 (32 experts, H 7168, I 2048), 2048 tokens" 4 uniform \
  --preset deepseek-v3 --set routed_experts=32 -T 2048
row ascend-a3 "hyper-parallel EP8 (48 experts, H 5120, I 1792)" 8 uniform \
  --preset deepseek-v3 --set routed_experts=48 --set hidden=5120 --set expert_inter=1792
for P in 16 64; do
  for routing in uniform zipf:1.2; do row h800 deepseek-v3 "$P" "$routing" --preset deepseek-v3; done
done
