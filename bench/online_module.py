"""Online placement from PyTorch, measured on this machine (docs/results/placement.md): hpmoe.MoELayer with and
without online=..., side by side, on a layer whose router sends a large share of the tokens to one expert.

Both layers get the same parameters and the same batches. A warm-up of WARMUP steps lets the online policy see the
load and revise; then ROUNDS rounds alternate the two layers, STEPS forward+backward steps each, and the medians of
the rounds' per-step medians are reported with their spread (min-max over rounds). The online layer's time
includes its policy (observing each step's load, and any revision).

    /usr/bin/python3 bench/online_module.py [--ranks 2] [--tokens 2048] [--hidden 512] [--inter 256] [--experts 8]
        [--hot 0.3] [--rounds 5] [--steps 8] [--warmup 12] [--dtype fp32|bf16]
(PYTHONPATH=build/python; run nothing else meanwhile.)
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

import hpmoe


def cpu_name():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
        fam = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("CPU family")), "")
        model = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model:")), "")
        return f"{name} (family {fam} model {model})"
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--inter", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--hot", type=float, default=1.0, help="how strongly the router favours expert 0 (its gate row); with top-2 it takes at most "
                         "half the rows, which the default already reaches")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=12)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = hpmoe.with_fields(hpmoe.preset("mixtral-8x7b"), hidden=args.hidden, expert_inter=args.inter,
                            routed_experts=args.experts, top_k=2, aux_loss_coef=0, z_loss_coef=0)
    H, N = args.hidden, args.ranks * args.tokens
    torch.manual_seed(0)
    plain = hpmoe.MoELayer(cfg, ranks=args.ranks, workers=1, dtype=args.dtype)
    online = hpmoe.MoELayer(cfg, ranks=args.ranks, workers=1, dtype=args.dtype,
                            online=dict(every=4, window=4, drift=0.25))
    with torch.no_grad():  # expert 0 hot: its gate row along the tokens' mean direction
        plain.gate.weight[0] = args.hot * torch.ones(H) / H ** 0.5
    online.load_state_dict(plain.state_dict())
    batches = [(torch.randn(N, H) + 0.5, torch.randn(N, H)) for _ in range(4)]

    def step(layer, k):
        x, d = batches[k % len(batches)]
        t = time.perf_counter()
        layer(x).backward(d)
        return time.perf_counter() - t

    for k in range(args.warmup):
        step(plain, k)
        step(online, k)
    load = plain.last_load.sum(0)
    share = float(load.max() / load.sum())
    per = {"contiguous": [], "online": []}
    for r in range(args.rounds):
        for name, layer in (("contiguous", plain), ("online", online)) if r % 2 == 0 else \
                (("online", online), ("contiguous", plain)):
            per[name].append(statistics.median(step(layer, k) for k in range(args.steps)))
    med = {n: statistics.median(v) * 1e3 for n, v in per.items()}
    ratios = [a / b for a, b in zip(per["contiguous"], per["online"])]
    print(f"{cpu_name()}, {os.cpu_count()} cores; {time.strftime('%Y-%m-%d')}")
    print(f"layer: hidden {H}, inter {args.inter}, {args.experts} experts top-2, {args.dtype}, {args.ranks} ranks x "
          f"1 worker in process, {args.tokens} tokens a rank; the hottest expert takes {share:.0%} of the rows")
    print(f"online: {online.revisions} revisions in the warm-up, placement {online.placement['experts_of_rank']}")
    print("| layer | fwd+bwd per step (ms), median of rounds | min-max over rounds |")
    print("|---|---|---|")
    for n, v in per.items():
        print(f"| {n} | {med[n]:.2f} | {min(v) * 1e3:.2f}-{max(v) * 1e3:.2f} |")
    print(f"speedup contiguous/online per round: median {statistics.median(ratios):.2f}x "
          f"(min {min(ratios):.2f}x, max {max(ratios):.2f}x)")
    print(json.dumps({"median_ms": med, "ratios": ratios, "revisions": online.revisions,
                      "placement": online.placement, "hot_share": share}))


if __name__ == "__main__":
    sys.exit(main())
