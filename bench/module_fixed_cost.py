"""The module's cost per call at a small size (issue 61 item 1): hidden 256, 16 experts of 512, top-2, 2 ranks x 1
worker, T tokens a call, forward + backward, with or without an SGD step between calls (weights that change every
call are converted and repacked every call). Prints the median and range of the calls' wall time and the median of
each part the module reports (moe.last_times: the host's parts and the launches), largest first.

    PYTHONPATH=build/python python3 bench/module_fixed_cost.py fp32|bf16 [T] [--update] [--calls 25] [--json]

--json: one line (the call's median, range and the parts' medians) instead of the text; what
bench/module_fixed_cost_ab.py reads. opt.zero_grad() keeps the gradients (PyTorch 1.13's default,
set_to_none=False), so each backward's gradients are added into them, as in gradient accumulation.
"""
import argparse
import json
import statistics
import time

import torch

import hpmoe


def small_layer():
    """Issue 61's small size (hidden 256, 16 experts of 512, top-2), seeded, on 2 threads; module_vs_torch.py
    uses it too."""
    torch.manual_seed(0)
    torch.set_num_threads(2)
    return hpmoe.with_fields(hpmoe.preset("mixtral-8x7b"), hidden=256, expert_inter=512, routed_experts=16, top_k=2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dtype", choices=["fp32", "bf16"])
    ap.add_argument("tokens", type=int, nargs="?", default=16)
    ap.add_argument("--update", action="store_true")
    ap.add_argument("--calls", type=int, default=25)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    moe = hpmoe.MoELayer(small_layer(), ranks=2, workers=1)
    if args.dtype == "bf16":
        moe = moe.bfloat16()
    opt = torch.optim.SGD(moe.parameters(), lr=1e-3)
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    times, parts = [], {}
    for i in range(args.calls + 5):
        x = torch.randn(args.tokens, 256, dtype=dtype, requires_grad=True)
        t0 = time.perf_counter()
        y = moe(x).float()
        (y * y).mean().backward()  # bounded: the SGD steps do not diverge at any T
        t1 = time.perf_counter()
        if args.update:
            opt.step()
        opt.zero_grad()
        if i < 5:
            continue
        times.append((t1 - t0) * 1e3)
        for p in ("forward", "backward"):
            for k, v in (moe.last_times or {}).get(p, {}).items():
                parts.setdefault(f"{p}.{k}", []).append(v * 1e3)
    if args.json:
        print(json.dumps({"dtype": args.dtype, "tokens": args.tokens, "update": args.update,
                          "median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times),
                          "parts_ms": {k: statistics.median(v) for k, v in parts.items()}}))
        return
    print(f"{args.dtype}, T {args.tokens}, {'an SGD step between calls' if args.update else 'weights unchanged'}: "
          f"{statistics.median(times):.2f} ms a call ({min(times):.2f}-{max(times):.2f})")
    accounted = 0.0
    for k, v in sorted(parts.items(), key=lambda kv: -statistics.median(kv[1])):
        accounted += statistics.median(v)
        if statistics.median(v) >= 0.05:
            print(f"  {k:<36} {statistics.median(v):7.3f} ms")
    print(f"  {'(the rest: Python, autograd, the repack)':<36} {statistics.median(times) - accounted:7.3f} ms")


if __name__ == "__main__":
    main()
