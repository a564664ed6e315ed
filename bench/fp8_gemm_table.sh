#!/usr/bin/env bash
# What fp8 GEMMs change (issue 42, item 4): DeepSeek-V3 (bf16 layer, 4096 tokens a rank, forward +
# backward) on the H800 and H200 models with the GEMMs at the bf16 and at the fp8 rates
# (`--gemm-dtype fp8`: matrix.peak.fp8_flops x each tile class's efficiency), one MoE layer and the
# whole 61-layer step, the fused schedule against the machine's framework baseline (DeepEP-style on
# H800; the H200 model has none, so there it is the serialized operators).
# Two `hpmoe sweep`s; deterministic. Prints markdown.
#   bench/fp8_gemm_table.sh [build/hpmoe] >> docs/results/simulation.md
set -euo pipefail
cd "$(dirname "$0")/.."
hpmoe=${1:-build/hpmoe}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
source bench/record_header.sh
record_header "bench/fp8_gemm_table.sh $hpmoe"
echo
for gemm in layer fp8; do
  "$hpmoe" sweep --machine h800,h200 --model deepseek-v3 --dtype bf16 -P 16,64 -T 4096 --routing uniform,zipf:1.2 \
    --backward --gemm-dtype "$gemm" --layers 61 --dense-layers 3 --dense-inter 18432 --attention-params 187e6 \
    --attention-width 20480 --out "$tmp/$gemm" > /dev/null 2>&1
done
python3 - "$tmp/layer/sweep.json" "$tmp/fp8/sweep.json" <<'PY'
import json, sys
bf16, fp8 = (json.load(open(p))["points"] for p in sys.argv[1:])
print("| machine | EP | routing | GEMMs | baseline | MoE layer fwd+bwd ms: serialized / baseline / fused | fused vs baseline | step s: baseline / fused / fused + 2 micro-batches | step: fused vs baseline, + micro-batches |")
print("|---|---|---|---|---|---|---|---|---|")
for a, b in zip(bf16, fp8):
    for label, p in (("bf16", a), ("fp8", b)):
        L = p["layer"]
        t = lambda k: (L["forward"][k] + L["backward"][k]) * 1e3
        ways = {w["name"]: w["step_s"] for w in p["step"]["ways"]}
        name = p["step"]["baseline"]
        key = {"DeepEP-style": "deepep_s", "MindSpore-style": "mindspore_s"}.get(name, "serialized_s")
        base, fused, micro = ways[name], ways["fused (hpmoe)"], ways["fused (hpmoe) + 2 micro-batches"]
        print(f"| {p['machine']} | {p['ranks']} | {p['routing']} | {label} | {name} | {t('serialized_s'):.1f} / {t(key):.1f} / "
              f"{t('interleaved_s'):.1f} | {t(key) / t('interleaved_s'):.2f}x | {base:.2f} / {fused:.2f} / {micro:.2f} | "
              f"{base / fused:.2f}x, {base / micro:.2f}x |")
PY
