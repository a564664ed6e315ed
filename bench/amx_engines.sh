#!/usr/bin/env bash
# The two AMX engines side by side (issue 61 item 2): hpmoe's AMX kernel
# against oneDNN's matmul, on the layer (bf16, forward + backward,
# interleaved; deepseek-v2-lite EP 2 x 2048 tokens, about 384 rows an
# expert, and qwen3-30b-a3b EP 1 x 256 tokens, about 16: the weight
# gradients' K) in alternating runs, and on single tiles (bench_kernels,
# one thread). Percentages are of the AMX
# peak each run measures itself. Nothing else may run meanwhile.
#   bench/amx_engines.sh [BUILD] [ROUNDS]
set -euo pipefail
build=${1:-build}; rounds=${2:-3}
grep -qw amx_bf16 /proc/cpuinfo || { echo "amx_engines: this CPU has no AMX-BF16" >&2; exit 2; }
source "$(dirname "$0")/record_header.sh"
record_header "$0 $*"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
for round in $(seq "$rounds"); do
  for engine in amx onednn; do
    HPMOE_BF16_ENGINE=$engine "$build/hpmoe" run --preset deepseek-v2-lite -P 2 -T 2048 --dtype bf16 --backward \
      --iters 2 --warmup 1 --verify off --mode interleaved --json "$tmp/v2.$engine.$round.json" > /dev/null 2>&1
    HPMOE_BF16_ENGINE=$engine "$build/hpmoe" run --preset qwen3-30b-a3b -P 1 -W 2 -T 256 --dtype bf16 --backward \
      --iters 2 --warmup 1 --verify off --mode interleaved --json "$tmp/q3.$engine.$round.json" > /dev/null 2>&1
  done
done
for engine in amx onednn; do
  HPMOE_BF16_ENGINE=$engine taskset -c 1 "$build/bench/bench_kernels" --benchmark_filter='BM_Tile_bf16' \
    --benchmark_min_time=0.2 --benchmark_repetitions=3 --benchmark_report_aggregates_only=true --benchmark_format=json \
    > "$tmp/tiles.$engine.json" 2> /dev/null
done
python3 - "$tmp" "$rounds" <<'PY'
import json, statistics, sys
tmp, rounds = sys.argv[1], int(sys.argv[2])
print("\n| layer | engine | pass | ms (median, range) | GFLOP/s | % of the AMX peak (both cores) |")
print("|---|---|---|---|---|---|")
for layer, name in (("v2", "deepseek-v2-lite EP 2 x 2048"), ("q3", "qwen3-30b-a3b EP 1 x 256")):
  for engine in ("amx", "onednn"):
    runs = [json.load(open(f"{tmp}/{layer}.{engine}.{r}.json")) for r in range(1, rounds + 1)]
    for pass_, key in (("forward", "dispatch_to_combine"), ("backward", "backward")):
        ms = [1e3 * r["interleaved"][key]["median_s"] for r in runs]
        gf = [r["interleaved"][f"{pass_}_gflops"] for r in runs]
        share = [g * 1e9 / r["cpu"]["bf16_tile_peak_flops"] for g, r in zip(gf, runs)]
        print(f"| {name} | {engine} | {pass_} | {statistics.median(ms):.1f} ({min(ms):.1f}-{max(ms):.1f}) | {statistics.median(gf):.0f} | "
              f"{100 * statistics.median(share):.1f}% |")
print("\n| tile (m/n/k) | hpmoe AMX GFLOP/s | oneDNN GFLOP/s | ratio |")
print("|---|---|---|---|")
def tiles(engine):
    out = {}
    for b in json.load(open(f"{tmp}/tiles.{engine}.json"))["benchmarks"]:
        if b.get("aggregate_name") == "median":
            out[b["run_name"].split("BM_Tile_bf16/")[1].split("/manual_time")[0]] = b["GFLOP/s"]
    return out
a, o = tiles("amx"), tiles("onednn")
for shape in a:
    print(f"| {shape} | {a[shape]:.0f} | {o.get(shape, 0):.0f} | {a[shape] / o[shape]:.2f}x |" if o.get(shape) else f"| {shape} | {a[shape]:.0f} | - | - |")
PY
