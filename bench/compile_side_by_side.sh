#!/usr/bin/env bash
# Per-step compile (generate + schedule, busiest rank) and verify (per rank)
# cost of two builds of bench_compile, run alternately on the same machine,
# as a markdown table of medians over the rounds.
#   bench/compile_side_by_side.sh OLD/bench_compile NEW/bench_compile [ROUNDS]
# To build the previous commit's binary:
#   git worktree add /tmp/prev HEAD~1 && cmake -S /tmp/prev -B /tmp/prev/build -G Ninja \
#     -DCMAKE_BUILD_TYPE=Release && cmake --build /tmp/prev/build --target bench_compile
set -euo pipefail
old=${1:?old bench_compile}; new=${2:?new bench_compile}; rounds=${3:-3}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
filter='policy:(0|2)/|VerifyAllRanks'
for ((i = 0; i < rounds; ++i)); do
  for which in old new; do
    bin=$old; [ "$which" = new ] && bin=$new
    "$bin" --benchmark_filter="$filter" --benchmark_min_time=0.2 --benchmark_format=json > "$tmp/$which.$i.json" 2> /dev/null
  done
done
python3 - "$tmp" "$rounds" <<'PY'
import json, statistics, sys, glob, re
tmp, rounds = sys.argv[1], int(sys.argv[2])
def load(which):
    out = {}
    for i in range(rounds):
        for b in json.load(open(f"{tmp}/{which}.{i}.json"))["benchmarks"]:
            key = b["name"]
            value = b["per_rank_ms"] if "per_rank_ms" in b else b["real_time"] / 1000.0  # ms
            out.setdefault(key, []).append(value)
    return {k: statistics.median(v) for k, v in out.items()}
old, new = load("old"), load("new")
def label(name):
    z = "Zipf 1.2" if "zipf:1" in name else "uniform"
    p = "backward" if "backward:1" in name else "forward"
    m = "accel:24:48 (128x256)" if "accel:1" in name else "cpu:2 (64x64)"
    what = "verify, per rank" if "Verify" in name else ("generate + schedule, fill" if "policy:0" in name else "generate + schedule, critical-path")
    return m, p, z, what
print("| what | machine | pass | routing | before (ms) | after (ms) | after / before |")
print("|---|---|---|---|---|---|---|")
for name in sorted(new, key=lambda n: label(n)[::-1]):
    if name not in old: continue
    m, p, z, what = label(name)
    print(f"| {what} | {m} | {p} | {z} | {old[name]:.2f} | {new[name]:.2f} | {new[name] / old[name]:.2f} |")
PY
