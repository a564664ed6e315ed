#!/usr/bin/env bash
# Two builds of hpmoe side by side at a real layer size, as shares of the
# machine's peak: deepseek-v2-lite without shared experts, EP 2 x 2048
# tokens, forward + backward, A B B A A B ... (a fresh process each; the
# order turns every round, so neither side always runs second). Prints the
# CPU, then per dtype the medians (and ranges) over the rounds of each
# executor's forward and backward share of the peak `hpmoe run` measures
# (FMA for fp32, the bf16 dot products or AMX for bf16), and each GEMM and
# pack kind's median time and share (the serialized executor's operators).
#   bench/peak_share_ab.sh A/hpmoe B/hpmoe [ROUNDS=3] [ITERS=2]
# AB_DTYPES="bf16 fp32" picks the dtypes (bf16 about 70 s a run on 2 cores
# of AMD Zen 4, fp32 about twice that; 14 GiB).
set -euo pipefail
a=${1:?A/hpmoe}; b=${2:?B/hpmoe}; rounds=${3:-3}; iters=${4:-2}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
source "$(dirname "$0")/record_header.sh"
echo "$(record_header "$0 $*") A: \`$a\`, B: \`$b\`; $rounds rounds x $iters iterations."
for dtype in ${AB_DTYPES:-bf16 fp32}; do
  for ((r = 0; r < rounds; ++r)); do
    order="A B"; ((r % 2)) && order="B A"
    for side in $order; do
      bin=$a; [ $side = B ] && bin=$b
      "$bin" run --preset deepseek-v2-lite -P 2 -W 1 -T 2048 --set shared_experts=0 --set dtype="$dtype" --backward \
        --iters "$iters" --warmup 1 --verify off --json "$tmp/$dtype.$side.$r.json" > /dev/null 2> "$tmp/$dtype.$side.$r.err" ||
        { echo "$side failed ($dtype): $(tail -1 "$tmp/$dtype.$side.$r.err")" >&2; exit 1; }
    done
  done
  python3 - "$tmp" "$dtype" "$rounds" <<'PY'
import json, statistics, sys
tmp, dtype, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
runs = {s: [json.load(open(f"{tmp}/{dtype}.{s}.{r}.json")) for r in range(rounds)] for s in "AB"}
cpu = runs["A"][0]["cpu"]
peak = cpu["fma_peak_flops"] if dtype == "fp32" else (cpu["bf16_tile_peak_flops"] or cpu["fma_peak_flops"])
isa = "FMA" if dtype == "fp32" else (cpu["bf16_isa"] if not cpu["amx_bf16_flops_per_core"] else "AMX-BF16")
print(f"\n{dtype}: peak {peak / 1e9:.1f} GFLOP/s ({isa}, measured by each run; A's first run)\n")
print("| executor | pass | A share (median, range) | B share (median, range) | A ms | B ms |")
print("|---|---|---|---|---|---|")
def fmt(v):
    return f"{100 * statistics.median(v):.1f}% ({100 * min(v):.1f}-{100 * max(v):.1f})"
for ex in ("serialized", "interleaved"):
    for name, field, gf in (("forward", "dispatch_to_combine", "forward_gflops"), ("backward", "backward", "backward_gflops")):
        share, ms = {}, {}
        for s in "AB":
            share[s], ms[s] = [], []
            for r in runs[s]:
                p = r["cpu"]["fma_peak_flops"] if dtype == "fp32" else (r["cpu"]["bf16_tile_peak_flops"] or r["cpu"]["fma_peak_flops"])
                t = r[ex][field]["median_s"]
                flops = r["interleaved"][gf] * 1e9 * r["interleaved"][field]["median_s"]  # the pass's flops
                share[s].append(flops / t / p)
                ms[s].append(t * 1e3)
        print(f"| {ex} | {name} | {fmt(share['A'])} | {fmt(share['B'])} | {statistics.median(ms['A']):.0f} | {statistics.median(ms['B']):.0f} |")
print("\n| kind | A ms | B ms | A share | B share |")
print("|---|---|---|---|---|")
names = [o["name"] for o in runs["A"][0]["operators"] if o["name"].startswith(("gemm_", "pack_"))]
for n in names:
    row = {}
    for s in "AB":
        ops = [next(o for o in r["operators"] if o["name"] == n) for r in runs[s]]
        row[s] = (statistics.median(o["time"]["median_s"] * 1e3 for o in ops),
                  statistics.median(o.get("share_of_peak", 0.0) for o in ops))
    sh = lambda v: f"{100 * v:.0f}%" if v else "-"  # noqa: E731
    print(f"| {n} | {row['A'][0]:.1f} | {row['B'][0]:.1f} | {sh(row['A'][1])} | {sh(row['B'][1])} |")
PY
done
