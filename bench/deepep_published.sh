#!/usr/bin/env bash
# The H800 model's DeepEP-style exchange beside DeepEP's own published
# figures (issue 60 item 5). DeepEP V1's normal kernels on H800
# (https://github.com/deepseek-ai/DeepEP/blob/main/docs/legacy.md, "Normal
# kernels with NVLink and RDMA forwarding"): 4096 tokens per rank, hidden 7168, 256 experts, top-8,
# top-4 groups, FP8 dispatch, BF16 combine: 153 / 158 GB/s (NVLink) at EP 8,
# 43 / 43, 58 / 57 and 51 / 50 GB/s (RDMA) at EP 16, 32 and 64.
#
# Its benchmark (test_internode.py and test_intranode.py in DeepEP's tests) divides by the
# kernel's time the rows rank 0 receives ("NVL": one per token and rank, its
# own rank's included) or rank 0's tokens times the nodes each reaches
# ("RDMA": its own node included): logical figures, which this prints the
# same way from `hpmoe simulate`'s "exchange DeepEP-style alone" line. Its
# routing: random scores, groups = nodes, top-min(nodes, 4) groups: every
# expert open at EP 8, 16 and 32 (`--routing uniform`), 4 of 8 nodes at EP 64
# (DeepSeek-V3's 8 groups of 32 experts, one a node: `--routing grouped`).
#   bench/deepep_published.sh [BIN] [MACHINE ...]   (default: build/hpmoe machines/h800.json)
set -euo pipefail
bin=${1:-build/hpmoe}
shift || true
machines=("$@")
[ ${#machines[@]} -eq 0 ] && machines=(machines/h800.json)
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
source "$(dirname "$0")/record_header.sh"
echo "$(record_header "$0 $bin ${machines[*]}")"
echo
for m in "${machines[@]}"; do
  for ep in 8 16 32 64; do
    routing=uniform; [ "$ep" = 64 ] && routing=grouped
    "$bin" simulate --machine "$m" --preset deepseek-v3 --set shared_experts=0 --dtype bf16 -P "$ep" -T 4096 \
      --routing "$routing" --json "$tmp/$(basename "$m").$ep.json" > /dev/null
  done
done
python3 - "$tmp" "${machines[@]}" <<'PY'
import json, os, sys
tmp, machines = sys.argv[1], sys.argv[2:]
published = {8: (153, 158, "NVL"), 16: (43, 43, "RDMA"), 32: (58, 57, "RDMA"), 64: (51, 50, "RDMA")}
print("| machine model | EP | routing | dispatch ms | combine ms | kind | dispatch GB/s: model / DeepEP | combine GB/s: model / DeepEP | rank 0 across nodes MB | within 15% |")
print("|---|---|---|---|---|---|---|---|---|---|")
for m in machines:
    for ep, (pd, pc, kind) in published.items():
        j = json.load(open(f"{tmp}/{os.path.basename(m)}.{ep}.json"))
        x = j["deepep_exchange"]
        d = x["dispatch_nvl_gbps" if kind == "NVL" else "dispatch_rdma_gbps"]
        c = x["combine_nvl_gbps" if kind == "NVL" else "combine_rdma_gbps"]
        ok = all(abs(v / p - 1) <= 0.15 for v, p in ((d, pd), (c, pc)))
        mb = x["rank0_cross_node_rows"] * x["dispatch_row_bytes"] / 1e6
        print(f"| {m} | {ep} | {j['routing']} | {x['dispatch_s']*1e3:.3f} | {x['combine_s']*1e3:.3f} | {kind} | "
              f"{d:.1f} / {pd} ({d/pd:.2f}x) | {c:.1f} / {pc} ({c/pc:.2f}x) | {mb:.1f} | {'yes' if ok else 'no'} |")
PY
