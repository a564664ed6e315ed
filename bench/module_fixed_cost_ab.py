#!/usr/bin/python3
"""The module's cost per call (bench/module_fixed_cost.py) for two builds of the Python module, run alternately
(each run a fresh process): fp32 and bf16, at each T, with the weights unchanged and with an SGD step between
calls. Prints a markdown table of the medians over the rounds, with their range, and new / old.

    bench/module_fixed_cost_ab.py OLD_BUILD/python NEW_BUILD/python [--rounds 3] [--tokens 16 256] [--dtypes fp32 bf16]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 256])
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    args = ap.parse_args()
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "module_fixed_cost.py")
    runs = {}
    for _ in range(args.rounds):
        for dtype in args.dtypes:
            for tokens in args.tokens:
                for update in (False, True):
                    for which, path in (("old", args.old), ("new", args.new)):
                        cmd = [sys.executable, script, dtype, str(tokens), "--calls", "20", "--json"]
                        out = subprocess.run(cmd + (["--update"] if update else []), check=True, text=True,
                                             capture_output=True, env=dict(os.environ, PYTHONPATH=path)).stdout
                        runs.setdefault((dtype, tokens, update), {}).setdefault(which, []).append(
                            json.loads(out)["median_ms"])
    print("| dtype | T | weights between calls | old ms (median, range) | new ms (median, range) | new / old |")
    print("|---|---|---|---|---|---|")
    for (dtype, tokens, update), r in runs.items():
        o, n = r["old"], r["new"]
        print(f"| {dtype} | {tokens} | {'changed (SGD step)' if update else 'unchanged'} | {statistics.median(o):.2f} "
              f"({min(o):.2f}-{max(o):.2f}) | {statistics.median(n):.2f} ({min(n):.2f}-{max(n):.2f}) | "
              f"{statistics.median(n) / statistics.median(o):.2f} |")


if __name__ == "__main__":
    main()
