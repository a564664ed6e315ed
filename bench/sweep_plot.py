#!/usr/bin/env python3
"""Pictures of an `hpmoe sweep` folder: PNGs next to its sweep.csv.

  speedup_vs_ep.png    the fused schedule's speedup (forward + backward where
                       simulated) over the serialized operators, solid, and over
                       the machine's framework baseline, dashed, against EP
  memory_per_rank.png  what the fullest rank holds against EP, with each
                       machine's memory per rank
  step_ways.png        (a sweep of whole steps, --layers) each way's step time

  bench/sweep_plot.py DIR
"""
import csv
import math
import os
import sys
import tempfile

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

GRID = {"machine", "model", "ranks", "tokens", "routing", "schedule"}


def number(text):
    try:
        return float(text)
    except ValueError:
        return math.nan


def save(fig, path):
    """Written whole or not at all: a temporary beside the target, renamed."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", suffix=".png.tmp")
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110, format="png")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would hide the picture from the folder's other readers
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    plt.close(fig)


def series(rows, varied):
    """Rows grouped by everything but the EP degree, each sorted by EP."""
    groups = {}
    for r in rows:
        key = tuple((k, r[k]) for k in ["machine", "model", "tokens", "routing", "schedule"] + varied)
        groups.setdefault(key, []).append(r)
    for g in groups.values():
        g.sort(key=lambda r: int(r["ranks"]))
    return groups


def label(key):
    single = {k for k, _ in key}
    return ", ".join(v for k, v in key if k in single and v)


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: bench/sweep_plot.py DIR (a folder written by hpmoe sweep --out DIR)")
    folder = sys.argv[1]
    path = os.path.join(folder, "sweep.csv")
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as e:
        sys.exit(f"error: cannot read {path}: {e.strerror}")
    if not rows or "ranks" not in rows[0]:
        sys.exit(f"error: {path} is not an hpmoe sweep (no rows, or no ranks column)")
    ok = [r for r in rows if not r["error"]]
    if not ok:
        sys.exit(f"error: {path}: no point was simulated (see its error column)")
    known = GRID | {"error", "baseline"}
    varied = [k for k in rows[0] if k not in known and "." in k]
    backward = "backward_fused_ms" in rows[0]
    written = []

    def total(r, kind):
        t = number(r[f"forward_{kind}_ms"])
        return t + number(r[f"backward_{kind}_ms"]) if backward else t

    fig, ax = plt.subplots(figsize=(8, 5))
    for key, g in series(ok, varied).items():
        eps = [int(r["ranks"]) for r in g]
        line, = ax.plot(eps, [total(r, "serialized") / total(r, "fused") for r in g], marker="o", label=label(key))
        if g[0]["baseline"]:
            ax.plot(eps, [total(r, "baseline") / total(r, "fused") for r in g], marker="x", linestyle="--",
                    color=line.get_color(), label=f"{label(key)} vs {g[0]['baseline']}")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("EP degree")
    ax.set_ylabel("fused speedup" + (" (forward + backward)" if backward else " (forward)"))
    ax.set_title("hpmoe sweep: fused over serialized (solid) and the framework baseline (dashed)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save(fig, os.path.join(folder, "speedup_vs_ep.png"))
    written.append("speedup_vs_ep.png")

    fig, ax = plt.subplots(figsize=(8, 5))
    capacities = {}
    for key, g in series(ok, varied).items():
        ax.plot([int(r["ranks"]) for r in g], [number(r["memory_gb"]) for r in g], marker="o", label=label(key))
        if g[0]["capacity_gb"]:
            capacities[g[0]["machine"]] = number(g[0]["capacity_gb"])
    for machine, cap in capacities.items():
        ax.axhline(cap, linestyle=":", color="black", linewidth=0.8)
        ax.text(0.01, cap, f"{machine}: {cap:.0f} GB", transform=ax.get_yaxis_transform(), fontsize=7, va="bottom")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("EP degree")
    ax.set_ylabel("GB on the fullest rank (one MoE layer)")
    ax.set_title("hpmoe sweep: memory per rank")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save(fig, os.path.join(folder, "memory_per_rank.png"))
    written.append("memory_per_rank.png")

    if "step_fused_ms" in rows[0]:
        ways = [("serialized", "step_serialized_ms"), ("serialized + 2 micro-batches", "step_serialized_micro_ms"),
                ("framework baseline", "step_baseline_ms"), ("baseline + 2 micro-batches", "step_baseline_micro_ms"),
                ("fused", "step_fused_ms"), ("fused + 2 micro-batches", "step_fused_micro_ms")]
        fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(ok)), 5))
        width = 0.8 / len(ways)
        for i, (name, column) in enumerate(ways):
            ax.bar([p + i * width for p in range(len(ok))], [number(r[column]) / 1e3 for r in ok], width, label=name)
        ax.set_xticks([p + 0.4 - width / 2 for p in range(len(ok))])
        ax.set_xticklabels([f"{r['machine']}\nEP {r['ranks']}, {r['routing']}" for r in ok], fontsize=7)
        ax.set_ylabel("step (s)")
        ax.set_title("hpmoe sweep: a training step, six ways")
        ax.legend(fontsize=7)
        fig.tight_layout()
        save(fig, os.path.join(folder, "step_ways.png"))
        written.append("step_ways.png")
    print(f"{folder}: " + ", ".join(written))


if __name__ == "__main__":
    main()
