#!/usr/bin/env bash
# The simulator's vector tasks against the runtime's, kind by kind: each
# layer below runs once with its task trace (`hpmoe run --trace`, fp32,
# forward + backward) and is simulated twice on the given model, once as
# it is (each vector kind at its measured rate, "vector.by_kind") and once
# without those rates (every vector kind at "vector.bytes_per_s"). Prints,
# per kind and layer, the predicted over the measured total time of the
# kind's tasks in the interleaved executor's last step.
#   hpmoe calibrate --out M.json && bench/vector_kinds.sh build/hpmoe M.json
set -euo pipefail
cd "$(dirname "$0")/.."
hpmoe=${1:-build/hpmoe}
model=${2:-machines/cpu-local.json}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 - "$model" "$tmp/one-rate.json" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
m["vector"].pop("by_kind", None)
json.dump(m, open(sys.argv[2], "w"))
PY
layers=("--preset qwen3-30b-a3b -P 1 -W 2 -T 256 --routing uniform"
        "--preset deepseek-v2-lite -P 2 -W 1 -T 256 --routing zipf:1.2"
        "--preset mixtral-8x7b --set expert_inter=1792 -P 2 -W 1 -T 256 --routing uniform")
source bench/record_header.sh  # from the repository root (the cd above)
echo "$(record_header "$0 $*") Model: \`$model\`."
echo "Command: \`bench/vector_kinds.sh $hpmoe $model\`. Predicted / measured time of each kind's tasks (interleaved executor, one step):"
echo "one rate = every vector kind at vector.bytes_per_s; by kind = vector.by_kind."
echo
i=0
for layer in "${layers[@]}"; do
  i=$((i + 1))
  "$hpmoe" run $layer --backward --iters 1 --warmup 1 --verify off --trace "$tmp/run$i.json" > /dev/null 2>&1
  "$hpmoe" simulate --machine "$model" $layer --backward --trace "$tmp/kind$i.json" > /dev/null
  "$hpmoe" simulate --machine "$tmp/one-rate.json" $layer --backward --trace "$tmp/one$i.json" > /dev/null
done
python3 - "$tmp" "${#layers[@]}" "${layers[@]}" <<'PY'
import json, sys
from collections import defaultdict
tmp, n, layers = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def kinds(path):
    ev = json.load(open(path))["traceEvents"]
    inter = {e["pid"] for e in ev if e.get("ph") == "M" and e["name"] == "process_name" and e["args"]["name"].startswith("interleaved")}
    out = defaultdict(float)
    for e in ev:
        if e.get("ph") == "X" and e["pid"] in inter:
            out[e["name"]] += e["dur"]
    return out
vector = ["swiglu", "combine_reduce", "shared_swiglu", "gate_grad", "router_bwd", "pack_down_grad", "swiglu_bwd",
          "pack_gate_up_grad", "grad_reduce", "shared_swiglu_bwd", "pack_shared_down_grad", "pack_shared_gate_up_grad"]
cols = []
for i in range(1, n + 1):
    cols.append((kinds(f"{tmp}/run{i}.json"), kinds(f"{tmp}/one{i}.json"), kinds(f"{tmp}/kind{i}.json")))
short = [" ".join(l.split()[1:2] + l.split()[2:]).replace("--set expert_inter=1792 ", "").replace("--routing ", "") for l in layers]
print("| kind | " + " | ".join(f"{s}: one rate | by kind" for s in short) + " |")
print("|---|" + "---|---|" * n)
errs = [[], []]
for k in vector:
    row = []
    for run, one, kind in cols:
        if run.get(k, 0) <= 0:
            row += ["-", "-"]
            continue
        a, b = one[k] / run[k], kind[k] / run[k]
        errs[0].append(abs(a - 1)); errs[1].append(abs(b - 1))
        row += [f"{a:.2f}", f"{b:.2f}"]
    print(f"| {k} | " + " | ".join(row) + " |")
med = lambda v: sorted(v)[len(v) // 2]
print()
print(f"Median |predicted / measured - 1| over the cells: one rate {med(errs[0]) * 100:.0f}%, by kind {med(errs[1]) * 100:.0f}%; "
      f"worst: {max(errs[0]) * 100:.0f}% and {max(errs[1]) * 100:.0f}%.")
PY
