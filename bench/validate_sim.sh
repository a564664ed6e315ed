#!/usr/bin/env bash
# The simulator against this machine: `hpmoe simulate --machine cpu-local`
# predicts what `hpmoe run` measures, over the runtime issue's sweep at 256
# and 1024 tokens per rank (serialized and interleaved, forward and backward).
# Prints a markdown report: one row per configuration, then the errors
# against the targets (median |error| <= 10%, worst <= 20%, and the predicted
# speedup on the same side of 1.0 as the measured one wherever the measured
# one is clearly outside the noise: an exact sign test over the iterations'
# pairs (serialized and interleaved run back to back in each) gives p <= 0.05,
# and a repeat run, after the whole sweep, shows the same).
#   hpmoe calibrate --out machines/cpu-local.json   # first, on an idle machine
#   bench/validate_sim.sh [build/hpmoe] [machines/cpu-local.json] > docs/results/simulation.md
# ITERS (default 9): iterations per executor; TOKENS (default "256 1024");
# RUNS=dir keeps every run's report and prediction, and the configurations
# (bench/resimulate.py predicts them again with another build or model).
set -euo pipefail
cd "$(dirname "$0")/.."
hpmoe=${1:-build/hpmoe}
model=${2:-machines/cpu-local.json}
iters=${ITERS:-9}
runs=${RUNS:-}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
# Whether a speedup is outside the noise, for the sweep and for its repeat.
cat > "$tmp/signs.py" <<'PY'
def paired_side(serialized, interleaved, alpha=0.05):
    """+1 (interleaved faster) or -1 (slower) where an exact two-sided sign test over the
    iterations' pairs (the executors run one after the other in every iteration, so a
    phase of the machine touches both) puts the effect outside the noise; else 0."""
    from math import comb
    wins = sum(1 for s, i in zip(serialized, interleaved) if s > i)
    losses = sum(1 for s, i in zip(serialized, interleaved) if s < i)
    n, k = wins + losses, max(wins, losses)
    p = min(1.0, 2 * sum(comb(n, j) for j in range(k, n + 1)) / 2 ** n) if n else 1.0
    return 0 if p > alpha else (1 if wins > losses else -1)
PY
export PYTHONPATH="$tmp${PYTHONPATH:+:$PYTHONPATH}"
trace=data/routing/mixtral-8x7b/coding.json

echo "# The simulator against this machine"
echo
source bench/record_header.sh  # from the repository root (the cd above)
echo "$(record_header "$0 $*") Model: \`$model\`."
echo "Command: \`bench/validate_sim.sh $hpmoe $model\` (fp32; $iters iterations of each executor after a warm-up, the executors"
echo "alternating step by step). Measured: the median of the iterations; the errors are against it, and, in the last"
echo "column, against the fastest iteration (the time of a step that nothing else on the machine disturbed: interference"
echo "only adds time, so the fastest is its best estimate; the Python documentation's advice for timeit's repeat)."
echo
echo "| layer | P x W | tokens | routing | pass | serialized meas. ms | pred. ms | err | interleaved meas. ms | pred. ms | err | speedup meas. | pred. | err vs fastest ser / int |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
measure() {  # layer-args P W T routing json
  "$hpmoe" run $1 -P "$2" -W "$3" -T "$4" --routing "$5" --backward --iters "$iters" --warmup 1 --verify off \
    --json "$6" > /dev/null 2>&1
}
configs=0
one() {  # layer-args label P W T routing
  configs=$((configs + 1))
  measure "$1" "$3" "$4" "$5" "$6" "$tmp/run.json" || { echo "| $2 | $3 x $4 | $5 | $6 | run failed ||||||||||"; return; }
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$configs" "$1" "$3" "$4" "$5" "$6" >> "$tmp/configs.tsv"
  "$hpmoe" simulate --machine "$model" $1 -P "$3" -W "$4" -T "$5" --routing "$6" --backward \
    --json "$tmp/sim.json" > /dev/null
  if [ -n "$runs" ]; then
    mkdir -p "$runs"; cp "$tmp/run.json" "$runs/$configs-run.json"; cp "$tmp/sim.json" "$runs/$configs-sim.json"
    cp "$tmp/configs.tsv" "$runs/configs.tsv"  # what bench/resimulate.py reads
  fi
  python3 - "$tmp/run.json" "$tmp/sim.json" "$2" "$3" "$4" "$5" "$6" "$tmp/rows.jsonl" "$configs" <<'PY'
import json, sys
from signs import paired_side
run, sim = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
label, P, W, T, routing, rows, config = sys.argv[3:]
for pas, mkey, skey in (("forward", "dispatch_to_combine", "forward"), ("backward", "backward", "backward")):
    ms, mi = run["serialized"][mkey]["median_s"], run["interleaved"][mkey]["median_s"]
    ps, pi = sim[skey]["serialized_s"], sim[skey]["interleaved_s"]
    es, ei = ps / ms - 1, pi / mi - 1
    rs, ri = run["serialized"][mkey], run["interleaved"][mkey]
    fs, fi = ps / rs["min_s"] - 1, pi / ri["min_s"] - 1
    print(f"| {label} | {P} x {W} | {T} | {routing} | {pas} | {ms*1e3:.1f} | {ps*1e3:.1f} | {es*100:+.1f}% | "
          f"{mi*1e3:.1f} | {pi*1e3:.1f} | {ei*100:+.1f}% | {ms/mi:.3f} | {ps/pi:.3f} | {fs*100:+.1f}% / {fi*100:+.1f}% |")
    clear = paired_side(rs["samples_s"], ri["samples_s"])
    with open(rows, "a") as f:
        f.write(json.dumps({"config": int(config), "label": f"{label}, {P} x {W}, {T} tokens, {routing}", "pass": pas, "errors": [es, ei], "measured_speedup": ms / mi,
                            "predicted_speedup": ps / pi, "clear_side": clear,
                            "errors_vs_fastest": [fs, fi]}) + "\n")
PY
}
for T in ${TOKENS:-256 1024}; do
  for pw in "1 2" "2 1"; do
    set -- $pw
    for routing in uniform zipf:1.2; do
      one "--preset deepseek-v2-lite" deepseek-v2-lite "$1" "$2" "$T" "$routing"
      one "--preset qwen3-30b-a3b" qwen3-30b-a3b "$1" "$2" "$T" "$routing"
    done
    for routing in uniform "trace:$trace:15"; do
      one "--preset mixtral-8x7b --set expert_inter=1792" "mixtral-8x7b (inter 1792)" "$1" "$2" "$T" "$routing"
    done
  done
done
# The repeat: every configuration with a pass clearly outside the noise runs
# once more, after the whole sweep (minutes later), and its sign must hold.
python3 - "$tmp/rows.jsonl" > "$tmp/clear.txt" <<'PY'
import json, sys
print("\n".join(sorted({str(r["config"]) for r in map(json.loads, open(sys.argv[1])) if r["clear_side"] != 0})))
PY
while IFS=$'\t' read -r id args P W T routing; do
  grep -qx "$id" "$tmp/clear.txt" || continue
  measure "$args" "$P" "$W" "$T" "$routing" "$tmp/repeat-$id.json" || true
done < "$tmp/configs.tsv"
echo
python3 - "$tmp/rows.jsonl" "$tmp" <<'PY'
import json, os, sys
from statistics import median
from signs import paired_side
rows = [json.loads(l) for l in open(sys.argv[1])]
for r in rows:  # the repeat's side for the same pass (0: within the noise, or no repeat)
    path = os.path.join(sys.argv[2], f"repeat-{r['config']}.json")
    r["repeat_side"] = 0
    if r["clear_side"] != 0 and os.path.exists(path):
        key = "dispatch_to_combine" if r["pass"] == "forward" else "backward"
        rep = json.load(open(path))
        rs, ri = rep["serialized"][key], rep["interleaved"][key]
        r["repeat_side"] = paired_side(rs["samples_s"], ri["samples_s"])
errs = sorted(abs(e) for r in rows for e in r["errors"])
fast = sorted(abs(e) for r in rows for e in r["errors_vs_fastest"])
def side(x, eps=0.01):  # within 1% of 1.0 counts as a tie, on neither side
    return 0 if abs(x - 1) <= eps else (1 if x > 1 else -1)
first = [r for r in rows if r["clear_side"] != 0]
clear = [r for r in first if r["repeat_side"] == r["clear_side"]]
agree = sum(1 for r in clear if side(r["predicted_speedup"]) == r["clear_side"])
agree_first = sum(1 for r in first if side(r["predicted_speedup"]) == r["clear_side"])
print("## Summary")
print()
print(f"- {len(errs)} predicted latencies (serialized and interleaved, forward and backward).")
print(f"- Against the median iteration: median |error| {median(errs)*100:.1f}% (target <= 10%), worst {errs[-1]*100:.1f}% (target <= 20%).")
print(f"- Against the fastest iteration: median |error| {median(fast)*100:.1f}%, worst {fast[-1]*100:.1f}%.")
for key, what in (("errors", "the median"), ("errors_vs_fastest", "the fastest")):
    over = [(r, x, e) for r in rows for x, e in zip(("serialized", "interleaved"), r[key]) if abs(e) > 0.20]
    print(f"- Over 20% against {what}: {len(over)} of {len(errs)}.")
    for r, x, e in over:
        print(f"  - {r['label']}, {x} {r['pass']}: {e*100:+.1f}%")
print(f"- Measured speedups outside the noise in the sweep (a sign test over the iterations' pairs, p <= 0.05): {len(first)} of {len(rows)}; "
      f"the prediction is on the same side of 1.0 in {agree_first} of them (a prediction within 1% of 1.0 counts as neither side).")
print(f"- Of those, shown again by a repeat run after the sweep (clearly outside the noise): {len(clear)}; "
      f"the prediction is on the same side of 1.0 in {agree} of them.")
for r in clear:
    print(f"  - {r['label']}, {r['pass']}: measured {r['measured_speedup']:.3f}, predicted {r['predicted_speedup']:.3f}")
PY
