#!/usr/bin/env python3
"""Where the simulator's time goes against the runtime's, task kind by task kind.

Reads a trace of `hpmoe run --trace` and one of `hpmoe simulate --trace` of
the same layer, shape and routing (the same tasks, in the same executors)
and prints, per executor and task kind: the count, the measured and the
predicted total time, their ratio, and the median per task. A last row per
executor is the time between tasks (a worker's span less its tasks: waits,
barriers, launch), which the model also predicts. Totals over thousands of
tasks of one step: a burst of interference on a shared machine moves a few
tasks, not the median.

  build/hpmoe run ... --trace run.json && build/hpmoe simulate --machine M ... --trace sim.json
  bench/task_kinds.py run.json sim.json
  bench/task_kinds.py --rows run.json sim.json   # GEMM kinds by their tiles' rows

With --rows, each GEMM kind is broken down by its tiles' row count: the
count, the median measured and predicted time per tile, and their ratio
(a tile's time against its rows shows how the model interpolates between
the calibrated row counts).
"""
import json
import re
import statistics
import sys
from collections import defaultdict


def executor_names(events):
    """pid -> executor name ("serialized", "interleaved"), from a trace's process_name records."""
    return {e["pid"]: e["args"]["name"].split(" (")[0] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}


def load(path):
    events = json.load(open(path))["traceEvents"]
    names = executor_names(events)
    kinds = defaultdict(list)  # (executor, kind) -> durations in us
    spans = defaultdict(lambda: [float("inf"), 0.0, 0.0])  # (executor, worker) -> first start, last end, busy
    for e in events:
        if e.get("ph") != "X":
            continue
        executor = names.get(e["pid"], str(e["pid"]))
        kinds[(executor, e["name"])].append(e["dur"])
        s = spans[(executor, e["tid"])]
        s[0], s[1], s[2] = min(s[0], e["ts"]), max(s[1], e["ts"] + e["dur"]), s[2] + e["dur"]
    between = defaultdict(float)
    for (executor, _), (first, last, busy) in spans.items():
        between[executor] += (last - first) - busy
    return kinds, between


def tile_rows(detail):
    """A GEMM tile's rows from its trace detail: "... rows [a, b) ..." (runtime) or "rows a+n" (simulator)."""
    m = re.search(r"rows \[(\d+), (\d+)\)", detail)
    if m:
        return int(m.group(2)) - int(m.group(1))
    m = re.search(r"rows \d+\+(\d+)", detail)
    return int(m.group(1)) if m else None


def by_rows(path):
    events = json.load(open(path))["traceEvents"]
    names = executor_names(events)
    tiles = defaultdict(list)  # (executor, kind, rows) -> durations in us
    for e in events:
        if e.get("ph") == "X" and e["name"].startswith("gemm_"):
            rows = tile_rows(e.get("args", {}).get("detail", ""))
            if rows is not None:
                tiles[(names.get(e["pid"], str(e["pid"])), e["name"], rows)].append(e["dur"])
    return tiles


def print_rows(run_path, sim_path):
    run, sim = by_rows(run_path), by_rows(sim_path)
    print("| executor | task kind | rows | tiles | median us meas. | pred. | pred./meas. |")
    print("|---|---|---|---|---|---|---|")
    for k in sorted(run):
        m, p = statistics.median(run[k]), statistics.median(sim[k]) if k in sim else float("nan")
        print(f"| {k[0]} | {k[1]} | {k[2]} | {len(run[k])} | {m:.1f} | {p:.1f} | {p / m:.2f} |")


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--rows":
        print_rows(sys.argv[2], sys.argv[3])
        return
    if len(sys.argv) != 3:
        sys.exit("usage: task_kinds.py [--rows] RUN_TRACE.json SIM_TRACE.json")
    (run, run_between), (sim, sim_between) = load(sys.argv[1]), load(sys.argv[2])
    print("| executor | task kind | tasks | measured ms | predicted ms | pred./meas. | median us meas. | pred. |")
    print("|---|---|---|---|---|---|---|---|")
    for executor in sorted({k[0] for k in run}):
        rows = sorted((k for k in run if k[0] == executor), key=lambda k: -sum(run[k]))
        for k in rows:
            m, p = run[k], sim.get(k, [])
            if len(m) != len(p):
                print(f"| {executor} | {k[1]} | {len(m)} measured, {len(p)} predicted: not the same tasks |||||")
                continue
            ms, ps = sum(m) / 1e3, sum(p) / 1e3
            print(f"| {executor} | {k[1]} | {len(m)} | {ms:.2f} | {ps:.2f} | {ps / ms if ms else float('nan'):.2f} | "
                  f"{statistics.median(m):.1f} | {statistics.median(p):.1f} |")
        mb, pb = run_between[executor] / 1e3, sim_between.get(executor, 0.0) / 1e3
        print(f"| {executor} | (between tasks, all workers) | | {mb:.2f} | {pb:.2f} | {pb / mb if mb else float('nan'):.2f} | | |")
        # Stalls: tasks that took 20x their kind's median or more. On a virtual machine whose
        # host takes the core away (a vCPU descheduled), one task of a kind that runs in 140 us
        # took 80 ms; the model has no such time, and the other workers wait for it at the next
        # barrier or event.
        stalls = [d - statistics.median(run[k]) for k in rows for d in run[k] if d >= 20 * statistics.median(run[k])]
        if stalls:
            print(f"| {executor} | (stalls: {len(stalls)} tasks at 20x their kind's median or more, time over it) | | "
                  f"{sum(stalls) / 1e3:.2f} | | | | |")


if __name__ == "__main__":
    main()
