#!/usr/bin/env bash
# The simulator against this machine: `hpmoe simulate --machine cpu-local`
# predicts what `hpmoe run` measures, over the runtime issue's sweep at 256
# and 1024 tokens per rank (serialized and interleaved, forward and backward).
# Prints a markdown report: one row per configuration, then the errors
# against the targets (median |error| <= 10%, worst <= 20%, and the predicted
# speedup on the same side of 1.0 as the measured one wherever the measured
# one is clearly outside the noise: an exact sign test over the iterations'
# pairs (serialized and interleaved run back to back in each) gives p <= 0.05
# in every round, on the same side).
# Each configuration is measured in ROUNDS separate runs (default 3), the
# rounds interleaved over the sweep (round 1 of every configuration, then
# round 2, ...) so that a slow phase of a shared machine does not fall on one
# configuration's every run. A latency's measurement is the median of its
# rounds' medians, and its spread the range of those over that median; a
# miss whose prediction lies inside the rounds' range (|error| within the
# spread) is reported as inside the spread, a miss of the noise, not of the
# model, and is not chased.
#   hpmoe calibrate --out machines/cpu-local.json   # first, on an idle machine
#   bench/validate_sim.sh [build/hpmoe] [machines/cpu-local.json] > docs/results/simulation.md
# ITERS (default 9): iterations per executor; ROUNDS (default 3, at least 2);
# TOKENS (default "256 1024");
# RUNS=dir keeps every run's report and prediction, and the configurations
# (bench/resimulate.py predicts them again with another build or model).
set -euo pipefail
cd "$(dirname "$0")/.."
hpmoe=${1:-build/hpmoe}
model=${2:-machines/cpu-local.json}
iters=${ITERS:-9}
rounds=${ROUNDS:-3}
[ "$rounds" -ge 2 ] || { echo "error: ROUNDS must be at least 2 (the rounds are each other's repeat)" >&2; exit 2; }
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
echo "Command: \`bench/validate_sim.sh $hpmoe $model\` (fp32; $rounds rounds of $iters iterations of each executor after a warm-up,"
echo "the executors alternating step by step, the rounds interleaved over the sweep). Measured: the median over the rounds of"
echo "each round's median iteration, and its spread: the range of the rounds' medians over it. The errors are against that"
echo "median; \"in spread\" marks a prediction inside the rounds' range. The last column: against the fastest iteration of"
echo "all rounds (a step that nothing else on the machine disturbed: interference only adds time)."
echo
echo "| layer | P x W | tokens | routing | pass | serialized meas. ms (spread) | pred. ms | err | interleaved meas. ms (spread) | pred. ms | err | speedup meas. | pred. | err vs fastest ser / int |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
measure() {  # layer-args P W T routing json
  "$hpmoe" run $1 -P "$2" -W "$3" -T "$4" --routing "$5" --backward --iters "$iters" --warmup 1 --verify off \
    --json "$6" > /dev/null 2>&1
}
configs=0
add() {  # layer-args label P W T routing: a configuration, and its prediction (deterministic: once)
  configs=$((configs + 1))
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$configs" "$1" "$3" "$4" "$5" "$6" "$2" >> "$tmp/configs.tsv"
  "$hpmoe" simulate --machine "$model" $1 -P "$3" -W "$4" -T "$5" --routing "$6" --backward \
    --json "$tmp/sim-$configs.json" > /dev/null
}
for T in ${TOKENS:-256 1024}; do
  for pw in "1 2" "2 1"; do
    set -- $pw
    for routing in uniform zipf:1.2; do
      add "--preset deepseek-v2-lite" deepseek-v2-lite "$1" "$2" "$T" "$routing"
      add "--preset qwen3-30b-a3b" qwen3-30b-a3b "$1" "$2" "$T" "$routing"
    done
    for routing in uniform "trace:$trace:15"; do
      add "--preset mixtral-8x7b --set expert_inter=1792" "mixtral-8x7b (inter 1792)" "$1" "$2" "$T" "$routing"
    done
  done
done
for round in $(seq 1 "$rounds"); do
  while IFS=$'\t' read -r id args P W T routing label; do
    measure "$args" "$P" "$W" "$T" "$routing" "$tmp/run-$id-$round.json" || rm -f "$tmp/run-$id-$round.json"
  done < "$tmp/configs.tsv"
done
if [ -n "$runs" ]; then  # every run's report and prediction, and the configurations (bench/resimulate.py reads them)
  mkdir -p "$runs"; cp "$tmp"/run-*.json "$tmp"/sim-*.json "$tmp/configs.tsv" "$runs/"
fi
python3 - "$tmp" "$rounds" <<'PY'
import json, os, sys
from statistics import median
from signs import paired_side
tmp, rounds = sys.argv[1], int(sys.argv[2])
out = open(os.path.join(tmp, "rows.jsonl"), "w")
for line in open(os.path.join(tmp, "configs.tsv")):
    cid, args, P, W, T, routing, label = line.rstrip("\n").split("\t")
    runs = [json.load(open(p)) for r in range(1, rounds + 1)
            if os.path.exists(p := os.path.join(tmp, f"run-{cid}-{r}.json"))]
    if len(runs) < 2:
        print(f"| {label} | {P} x {W} | {T} | {routing} | run failed in {rounds - len(runs)} of {rounds} rounds ||||||||||")
        continue
    sim = json.load(open(os.path.join(tmp, f"sim-{cid}.json")))
    for pas, mkey in (("forward", "dispatch_to_combine"), ("backward", "backward")):
        got = {}
        for x in ("serialized", "interleaved"):
            meds = [r[x][mkey]["median_s"] for r in runs]
            m = median(meds)
            pred = sim[pas][f"{x}_s"]
            got[x] = {"median": m, "spread": (max(meds) - min(meds)) / m, "pred": pred, "err": pred / m - 1,
                      "inside": min(meds) <= pred <= max(meds), "fastest": min(r[x][mkey]["min_s"] for r in runs)}
        s, i = got["serialized"], got["interleaved"]
        mark = lambda g: " (in spread)" if g["inside"] else ""
        fs, fi = s["pred"] / s["fastest"] - 1, i["pred"] / i["fastest"] - 1
        print(f"| {label} | {P} x {W} | {T} | {routing} | {pas} | {s['median']*1e3:.1f} ({s['spread']*100:.0f}%) | {s['pred']*1e3:.1f} | "
              f"{s['err']*100:+.1f}%{mark(s)} | {i['median']*1e3:.1f} ({i['spread']*100:.0f}%) | {i['pred']*1e3:.1f} | {i['err']*100:+.1f}%{mark(i)} | "
              f"{s['median']/i['median']:.3f} | {s['pred']/i['pred']:.3f} | {fs*100:+.1f}% / {fi*100:+.1f}% |")
        sides = [paired_side(r["serialized"][mkey]["samples_s"], r["interleaved"][mkey]["samples_s"]) for r in runs]
        clear = sides[0] if sides[0] != 0 and all(x == sides[0] for x in sides) else 0
        out.write(json.dumps({"config": int(cid), "label": f"{label}, {P} x {W}, {T} tokens, {routing}", "pass": pas,
                              "errors": [s["err"], i["err"]], "spreads": [s["spread"], i["spread"]],
                              "inside": [s["inside"], i["inside"]], "measured_speedup": s["median"] / i["median"],
                              "predicted_speedup": s["pred"] / i["pred"], "clear_side": clear, "first_side": sides[0],
                              "errors_vs_fastest": [fs, fi]}) + "\n")
PY
echo
python3 - "$tmp/rows.jsonl" "$rounds" <<'PY'
import json, os, sys
from statistics import median
rows = [json.loads(l) for l in open(sys.argv[1])]
rounds = int(sys.argv[2])
errs = sorted(abs(e) for r in rows for e in r["errors"])
fast = sorted(abs(e) for r in rows for e in r["errors_vs_fastest"])
def side(x, eps=0.01):  # within 1% of 1.0 counts as a tie, on neither side
    return 0 if abs(x - 1) <= eps else (1 if x > 1 else -1)
first = [r for r in rows if r["first_side"] != 0]
clear = [r for r in rows if r["clear_side"] != 0]
agree = sum(1 for r in clear if side(r["predicted_speedup"]) == r["clear_side"])
agree_first = sum(1 for r in first if side(r["predicted_speedup"]) == r["first_side"])
spreads = sorted(x for r in rows for x in r["spreads"])
print("## Summary")
print()
print(f"- {len(errs)} predicted latencies (serialized and interleaved, forward and backward).")
print(f"- Against the median over {rounds} rounds: median |error| {median(errs)*100:.1f}% (target <= 10%), worst {errs[-1]*100:.1f}% (target <= 20%).")
print(f"- The rounds' spread (range of their medians over the median): median {median(spreads)*100:.1f}%, largest {spreads[-1]*100:.1f}%.")
print(f"- Against the fastest iteration: median |error| {median(fast)*100:.1f}%, worst {fast[-1]*100:.1f}%.")
for key, what in (("errors", "the median"), ("errors_vs_fastest", "the fastest")):
    over = [(r, j, x, e) for r in rows for j, (x, e) in enumerate(zip(("serialized", "interleaved"), r[key])) if abs(e) > 0.20]
    inside = [o for o in over if key == "errors" and o[0]["inside"][o[1]]]
    print(f"- Over 20% against {what}: {len(over)} of {len(errs)}" +
          (f"; {len(inside)} of them inside the rounds' spread (a miss of the noise: not chased)." if key == "errors" else "."))
    for r, j, x, e in over:
        note = f" (spread {r['spreads'][j]*100:.0f}%, inside)" if key == "errors" and r["inside"][j] else ""
        print(f"  - {r['label']}, {x} {r['pass']}: {e*100:+.1f}%{note}")
print(f"- Measured speedups outside the noise in the first round (a sign test over the iterations' pairs, p <= 0.05): {len(first)} of {len(rows)}; "
      f"the prediction is on the same side of 1.0 in {agree_first} of them (a prediction within 1% of 1.0 counts as neither side).")
print(f"- Outside the noise on the same side in every round (clearly outside the noise): {len(clear)}; "
      f"the prediction is on the same side of 1.0 in {agree} of them.")
for r in clear:
    print(f"  - {r['label']}, {r['pass']}: measured {r['measured_speedup']:.3f}, predicted {r['predicted_speedup']:.3f}")
PY
