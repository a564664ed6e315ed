#!/usr/bin/env bash
# Load-aware placement with tensor-parallel splits, simulated
# (docs/results/placement.md, "Hybrid TP/EP"):
#  1. A3 and H800, deepseek-v3 layer sizes, bf16, no shared expert, 4096
#     tokens per rank, EP 16 / 64 / 256 under Zipf 1.2 (and EP 64 under Zipf
#     1.1 and 1.4): no balancing (contiguous), replicas + per-step quotas
#     (`hpmoe plan`), hybrid splits only (`plan --splits --no-replicas`),
#     and both (`plan --splits`), against the force-balanced ideal.
#  2. The NMP mesh model (HDA-MoE's setting) on the Mixtral-8x7B traces:
#     TP (every expert split over all 8 ranks), EP (one expert per rank),
#     a static hybrid mapping from the history (splits only, HD-MoE-like),
#     and static + online (splits or replicas, with per-step quotas,
#     HDA-MoE-like).
# Forward + backward, serialized and interleaved, on a step the plan did not
# see. Predicted times are deterministic (no timing noise).
#   bench/hybrid_sim.sh [OUTDIR]
set -euo pipefail
hpmoe=${HPMOE:-build/hpmoe}
out=${1:-hybrid-sim}
mkdir -p "$out"
v3=(--preset deepseek-v3 --set shared_experts=0 --dtype bf16 -T 4096)
for machine in ascend-a3 h800; do
  for setting in 16:zipf:1.2 64:zipf:1.1 64:zipf:1.2 64:zipf:1.4 256:zipf:1.2; do
    P=${setting%%:*}
    routing=${setting#*:}
    tag="$machine-P$P-${routing/:/}"
    "$hpmoe" simulate --machine "$machine" "${v3[@]}" -P "$P" --routing balanced --backward --json "$out/$tag-ideal.json" > /dev/null
    for variant in replicas splits both; do
      case $variant in
        replicas) flags=() ;;
        splits) flags=(--splits --no-replicas) ;;
        both) flags=(--splits) ;;
      esac
      "$hpmoe" plan --machine "$machine" "${v3[@]}" -P "$P" --routing "$routing" "${flags[@]}" \
        --out "$out/$tag-$variant.placement.json" --json "$out/$tag-$variant.json" > /dev/null
    done
  done
done
# The mesh: 8 experts on 8 ranks; TP puts 1/8 of every expert's columns on every rank.
python3 - "$out/mesh-tp.json" <<'PY'
import json, sys
inter = 14336
cols = [inter * j // 8 for j in range(9)]
json.dump({"experts_of_rank": [list(range(8)) for _ in range(8)],
           "splits": [{"expert": e, "columns": cols} for e in range(8)]}, open(sys.argv[1], "w"))
PY
mix=(--preset mixtral-8x7b --dtype bf16 -P 8 -T 512)
for trace in coding roleplay writing; do
  routing="trace:data/routing/mixtral-8x7b/$trace.json"
  for placement in contiguous "$out/mesh-tp.json"; do
    name=$([ "$placement" = contiguous ] && echo ep || echo tp)
    "$hpmoe" simulate --machine nmp-mesh "${mix[@]}" --routing "$routing" --placement "$placement" --backward \
      --json "$out/mesh-$trace-$name.json" > /dev/null
  done
  "$hpmoe" plan --machine nmp-mesh "${mix[@]}" --routing "$routing" --splits --no-replicas \
    --json "$out/mesh-$trace-static.json" > /dev/null
  "$hpmoe" plan --machine nmp-mesh "${mix[@]}" --routing "$routing" --splits \
    --json "$out/mesh-$trace-online.json" > /dev/null
done
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
def total(rep, kind):
    return (rep["forward"][kind] + rep["backward"][kind]) * 1e3
print("| machine | EP | routing | ideal int (ms) | unbalanced ser / int | replicas + quotas ser / int | splits only ser / int | both ser / int | best int / ideal int | best int speedup over unbalanced ser |")
print("|---|---|---|---|---|---|---|---|---|---|")
for machine in ("ascend-a3", "h800"):
    for setting in ("16:zipf1.2", "64:zipf1.1", "64:zipf1.2", "64:zipf1.4", "256:zipf1.2"):
        P, routing = setting.split(":")
        tag = f"{out}/{machine}-P{P}-{routing}"
        ideal = json.load(open(f"{tag}-ideal.json"))
        plans = {v: json.load(open(f"{tag}-{v}.json")) for v in ("replicas", "splits", "both")}
        before = plans["replicas"]["before"]
        cells = []
        for v in ("replicas", "splits", "both"):
            a = plans[v]["after"]
            note = f" ({plans[v]['replicas_added']} r, {plans[v]['split_parts_added']} p)"
            cells.append(f"{a['simulated_serialized_s']*1e3:.1f} / {a['simulated_interleaved_s']*1e3:.1f}{note}")
        best = min(plans[v]["after"]["simulated_interleaved_s"] for v in plans) * 1e3
        print(f"| {machine} | {P} | {routing.replace('zipf', 'Zipf ')} | {total(ideal, 'interleaved_s'):.1f} "
              f"| {before['simulated_serialized_s']*1e3:.1f} / {before['simulated_interleaved_s']*1e3:.1f} | " + " | ".join(cells) +
              f" | {total(ideal, 'interleaved_s') / best:.1%} | {before['simulated_serialized_s']*1e3 / best:.2f}x |")
print()
print("| Mixtral trace | TP ser / int (ms) | EP ser / int | static hybrid ser / int | static + online ser / int | static+online int over TP / EP / static |")
print("|---|---|---|---|---|---|")
for trace in ("coding", "roleplay", "writing"):
    tp = json.load(open(f"{out}/mesh-{trace}-tp.json"))
    ep = json.load(open(f"{out}/mesh-{trace}-ep.json"))
    st = json.load(open(f"{out}/mesh-{trace}-static.json"))["after"]
    on = json.load(open(f"{out}/mesh-{trace}-online.json"))["after"]
    on_int = on["simulated_interleaved_s"] * 1e3
    print(f"| {trace} | {total(tp, 'serialized_s'):.1f} / {total(tp, 'interleaved_s'):.1f} | {total(ep, 'serialized_s'):.1f} / {total(ep, 'interleaved_s'):.1f} "
          f"| {st['simulated_serialized_s']*1e3:.1f} / {st['simulated_interleaved_s']*1e3:.1f} | {on['simulated_serialized_s']*1e3:.1f} / {on_int:.1f} "
          f"| {total(tp, 'interleaved_s') / on_int:.2f}x / {total(ep, 'interleaved_s') / on_int:.2f}x / {st['simulated_interleaved_s']*1e3 / on_int:.2f}x |")
PY
