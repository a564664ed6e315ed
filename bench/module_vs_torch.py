#!/usr/bin/python3
"""hpmoe.MoELayer against the same layer in PyTorch eager (hpmoe.reference.ReferenceMoE: a Hugging Face-style
loop over the experts with index_add), same parameters and tokens, forward + backward a call, at the small size
of issue 61 (hidden 256, 16 experts of 512, top-2; hpmoe as 2 ranks x 1 worker; PyTorch on 2 threads). Rounds
alternate the two; each round's figure is the median of its calls; printed: the median and range over the rounds
and PyTorch / hpmoe (> 1: hpmoe faster). --update adds an SGD step between calls (outside the timed call).

    PYTHONPATH=build/python python3 bench/module_vs_torch.py [--dtypes fp32 bf16] [--tokens 16 256 2048]
        [--rounds 5] [--calls 15] [--update]
"""
import argparse
import statistics
import time

import torch

import hpmoe
from hpmoe.reference import ReferenceMoE
from module_fixed_cost import small_layer  # the same layer, beside this file


def calls(layer, x, n, update):
    opt = torch.optim.SGD(layer.parameters(), lr=1e-4)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        y = layer(x).float()
        (y * y).mean().backward()
        times.append((time.perf_counter() - t0) * 1e3)
        if update:
            opt.step()
        opt.zero_grad(set_to_none=True)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 256, 2048])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=15)
    ap.add_argument("--update", action="store_true")
    args = ap.parse_args()
    cfg = small_layer()
    print(f"| dtype | T | hpmoe ms (median, range) | PyTorch eager ms (median, range) | PyTorch / hpmoe |")
    print("|---|---|---|---|---|")
    for dtype in args.dtypes:
        for tokens in args.tokens:
            ours = hpmoe.MoELayer(cfg, ranks=2, workers=1)
            twin = ReferenceMoE(cfg)
            twin.load_state_dict(ours.state_dict())
            if dtype == "bf16":
                ours, twin = ours.bfloat16(), twin.bfloat16()
            x = torch.randn(tokens, 256, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32,
                            requires_grad=True)
            calls(ours, x, 3, args.update)  # warm: the first forward packs the weights
            calls(twin, x, 3, args.update)
            a, b = [], []
            for _ in range(args.rounds):
                a.append(calls(ours, x, args.calls, args.update))
                b.append(calls(twin, x, args.calls, args.update))
            print(f"| {dtype} | {tokens} | {statistics.median(a):.2f} ({min(a):.2f}-{max(a):.2f}) | "
                  f"{statistics.median(b):.2f} ({min(b):.2f}-{max(b):.2f}) | "
                  f"{statistics.median(b) / statistics.median(a):.2f} |", flush=True)


if __name__ == "__main__":
    main()
