#!/usr/bin/env bash
# Weights instead of tokens in the simulator: where lending pays. One
# `hpmoe sweep` with --lend off,auto over models (hidden and expert sizes),
# tokens per rank, routings and the inter-node link rate (x0.5, x1, x2 of the
# model's), on the A3 and H800 models at EP 16, forward and backward; each
# point with lending against the same point without: the pairs lent, the
# put bytes, the fused times, and whether lending was chosen and slower.
# Deterministic. Prints markdown.
#   bench/lend_table.sh [build/hpmoe] [JOBS] >> docs/results/placement.md
set -euo pipefail
cd "$(dirname "$0")/.."
hpmoe=${1:-build/hpmoe}
jobs=${2:-2}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
source bench/record_header.sh
record_header "bench/lend_table.sh $hpmoe $jobs"
"$hpmoe" sweep --machine h800,ascend-a3 --model deepseek-v3,qwen3-235b-a22b,qwen3-30b-a3b --dtype bf16 -P 16 \
  -T 4096,16384 --routing uniform,zipf:1.2 --lend off,auto --backward --vary links.inter.bytes_per_s=x0.5,x1,x2 \
  -j "$jobs" --out "$tmp/sweep" 2> "$tmp/progress.txt" > /dev/null || { cat "$tmp/progress.txt" >&2; exit 1; }
python3 - "$tmp/sweep/sweep.csv" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
key = lambda r: (r["machine"], r["model"], r["tokens"], r["routing"], r["links.inter.bytes_per_s"])
off = {key(r): r for r in rows if r["lend"] == "off"}
print()
print("| machine | model | tokens/rank | routing | inter-node link | lent pairs | put GB fwd off -> auto | fused fwd ms off -> auto | fused bwd ms off -> auto | fwd+bwd gain |")
print("|---|---|---|---|---|---|---|---|---|---|")
slower, chosen, skipped = 0, 0, 0
for r in rows:
    if r["lend"] != "auto":
        continue
    o = off[key(r)]
    if r["error"] or o["error"]:
        skipped += 1
        print(f'| {r["machine"]} | {r["model"]} | {r["tokens"]} | {r["routing"]} | {r["links.inter.bytes_per_s"]} | | | | | {(r["error"] or o["error"])[:60]} |')
        continue
    lent = int(r["forward_lent"])
    f0, f1 = float(o["forward_fused_ms"]), float(r["forward_fused_ms"])
    b0, b1 = float(o["backward_fused_ms"]), float(r["backward_fused_ms"])
    gain = (f0 + b0) / (f1 + b1)
    if lent:
        chosen += 1
        slower += gain < 1.0
    g = lambda x: f"{float(x) / 1e3:.1f}"
    print(f'| {r["machine"]} | {r["model"]} | {r["tokens"]} | {r["routing"]} | {r["links.inter.bytes_per_s"]} | {lent} | '
          f'{g(o["forward_put_mb"])} -> {g(r["forward_put_mb"])} | {f0:.2f} -> {f1:.2f} | {b0:.2f} -> {b1:.2f} | '
          f'{gain:.3f}x{" (slower)" if lent and gain < 1 else ""} |')
print()
print(f"{chosen} points lend (auto); {slower} of them are slower than not lending; {skipped} points not simulated (memory).")
PY
