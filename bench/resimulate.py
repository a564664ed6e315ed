#!/usr/bin/env python3
"""Predicts a kept validation sweep again: the runs of `RUNS=dir bench/validate_sim.sh`
against another build of hpmoe or another machine model, without measuring again.

  bench/resimulate.py BIN MODEL RUNS_DIR

Prints, per configuration and pass, the error of each executor's prediction
against the median and the fastest measured iteration, then the summary the
sweep prints (median and worst |error|, latencies over 20%), then the
errors by tokens and pass beside the length of the fastest step (a longer
step is likelier to hold a stall of the machine's, even at its fastest). The measured
runs stay what they were, so two builds or two models are compared on the
same measurements (the machine's phases do not move between them).
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile


def main():
    if len(sys.argv) != 4:
        sys.exit("usage: resimulate.py BIN MODEL RUNS_DIR")
    hpmoe, model, runs = sys.argv[1:]
    table = os.path.join(runs, "configs.tsv")
    if not os.path.exists(table):
        sys.exit(f"{table}: not found (a RUNS dir of bench/validate_sim.sh keeps it)")
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")  # the trace paths are the repository's
    errors, fastest = [], []
    groups = {}  # (tokens, pass) -> [(error vs fastest, error vs median, fastest step s)]
    print("| config | layer | P x W | tokens | routing | pass | serialized err (median / fastest) | interleaved err |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for line in open(table):
            config, args, P, W, T, routing = line.rstrip("\n").split("\t")[:6]
            # The first round's run (kept as run-ID-ROUND.json; an older sweep kept ID-run.json).
            first = os.path.join(runs, f"run-{config}-1.json")
            run = json.load(open(first if os.path.exists(first) else os.path.join(runs, f"{config}-run.json")))
            out = os.path.join(tmp, "sim.json")
            subprocess.run([hpmoe, "simulate", "--machine", os.path.abspath(model), *args.split(), "-P", P, "-W", W, "-T", T,
                            "--routing", routing, "--backward", "--json", out], check=True, stdout=subprocess.DEVNULL, cwd=root)
            sim = json.load(open(out))
            for pas, measured, predicted in (("forward", "dispatch_to_combine", "forward"), ("backward", "backward", "backward")):
                cells = []
                for executor in ("serialized", "interleaved"):
                    p, m = sim[predicted][executor + "_s"], run[executor][measured]
                    e, f = p / m["median_s"] - 1, p / m["min_s"] - 1
                    errors.append(abs(e))
                    fastest.append(abs(f))
                    groups.setdefault((int(T), pas), []).append((f, e, m["min_s"]))
                    cells.append(f"{e * 100:+.1f}% / {f * 100:+.1f}%")
                print(f"| {config} | {args} | {P} x {W} | {T} | {routing} | {pas} | {cells[0]} | {cells[1]} |")
    print()
    for name, v in (("median", errors), ("fastest", fastest)):
        print(f"- Against the {name} iteration: median |error| {statistics.median(v) * 100:.1f}%, worst {max(v) * 100:.1f}%, "
              f"over 20%: {sum(x > 0.2 for x in v)} of {len(v)}.")
    print()
    print("| tokens | pass | fastest step ms | median error vs fastest | range vs fastest | median error vs median |")
    print("|---|---|---|---|---|---|")
    for (tokens, pas), v in sorted(groups.items(), key=lambda g: (g[0][0], g[0][1] != "forward")):
        f, e, t = zip(*v)
        print(f"| {tokens} | {pas} | {min(t) * 1e3:.0f}-{max(t) * 1e3:.0f} | {statistics.median(f) * 100:+.1f}% | "
              f"{min(f) * 100:+.1f}% to {max(f) * 100:+.1f}% | {statistics.median(e) * 100:+.1f}% |")


if __name__ == "__main__":
    main()
