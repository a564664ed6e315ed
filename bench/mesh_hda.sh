#!/usr/bin/env bash
# Why the hybrid TP/EP mapping loses to TP on the near-memory mesh while
# HDA-MoE reports 1.1-3.4x over TP (docs/results/placement.md): the mappings
# at HDA-MoE's own operating point. Mixtral-8x7B (bf16, forward, as HDA-MoE
# evaluates inference), 32 nodes in a 4 x 8 mesh, 128 tokens in all (4 per
# node), the recorded coding trace at layer 15, on two machine models:
# nmp-mesh (hpmoe's) and nmp-mesh-hda (HDA-MoE's defaults: 10 TFLOPS per node
# at any row count, 25 GB/s links). Mappings: TP (every expert's columns in
# 32 parts, one per node), HDA-MoE's EP (with more nodes than experts each
# expert in 4 column parts on 4 nodes: its EP_deployment), and the hybrid
# `hpmoe plan --splits --no-replicas --inference` makes from that EP.
# Serialized is an operator-by-operator run (compute, then the exchange: no
# overlap, as HDA-MoE's objective t_comp + 2 t_comm); interleaved is hpmoe's
# fused schedule. Predicted times are deterministic.
#   bench/mesh_hda.sh [OUTDIR]
set -euo pipefail
hpmoe=${HPMOE:-build/hpmoe}
out=${1:-mesh-hda}
mkdir -p "$out"
python3 - "$out" <<'PY'
import json, sys
out, inter, P = sys.argv[1], 14336, 32
def split(e, parts):
    return {"expert": e, "columns": [inter * j // parts // 64 * 64 for j in range(parts)] + [inter]}
json.dump({"experts_of_rank": [list(range(8))] * P, "replicas": True, "splits": [split(e, P) for e in range(8)]},
          open(f"{out}/tp.json", "w"))
json.dump({"experts_of_rank": [[r // 4] for r in range(P)], "replicas": True, "splits": [split(e, 4) for e in range(8)]},
          open(f"{out}/ep.json", "w"))
PY
layer=(--preset mixtral-8x7b --dtype bf16 -P 32 -T 4 --routing trace:data/routing/mixtral-8x7b/coding.json:15)
echo "| machine | TP ser / int (ms) | HDA's EP ser / int | hybrid (plan) ser / int | hybrid over TP, ser / int | hybrid over EP, ser / int |"
echo "|---|---|---|---|---|---|"
for machine in nmp-mesh nmp-mesh-hda; do
  "$hpmoe" plan --machine "$machine" "${layer[@]}" --placement "$out/ep.json" --splits --no-replicas --inference \
    --out "$out/hybrid-$machine.json" > /dev/null
  row="| $machine"
  declare -A ser int
  for p in tp ep "hybrid-$machine"; do
    "$hpmoe" simulate --machine "$machine" "${layer[@]}" --placement "$out/$p.json" --json "$out/$p-$machine-sim.json" > /dev/null
    read -r s i < <(python3 -c "import json; f = json.load(open('$out/$p-$machine-sim.json'))['forward']; print(f['serialized_s'] * 1e3, f['interleaved_s'] * 1e3)")
    ser[$p]=$s int[$p]=$i
    row+=$(printf " | %.3f / %.3f" "$s" "$i")
  done
  h="hybrid-$machine"
  row+=$(python3 -c "print(' | %.2fx / %.2fx | %.2fx / %.2fx |' % (${ser[tp]} / ${ser[$h]}, ${int[tp]} / ${int[$h]}, ${ser[ep]} / ${ser[$h]}, ${int[ep]} / ${int[$h]}))")
  echo "$row"
done
