"""Per-call host cost of hpmoe.MoELayer forward + backward on a small layer
(hidden 256, 16 experts, top-2, 512 tokens, 1 rank x 1 worker), where the
tile work is small and what the module does around it shows.

    PYTHONPATH=build/python python3 bench/module_overhead.py [--calls 40] [--update] [--tokens 512]
        [--size small|large] [--check-parameters on|off]

--update: an SGD step between calls (every weight changes, as in training);
without it the weights stay put (evaluation, or several micro-batches per
step). --size large: hidden 1024, 64 experts of 704 (553 MB of weights).
--check-parameters off: MoELayer(check_parameters=False), to price the
content hashes that catch writes the version counters miss. Prints one JSON line: the median and the spread of the calls' wall
times, in milliseconds. bench/module_side_by_side.sh runs two builds alternately.
"""
import argparse
import json
import statistics
import time

import torch

import hpmoe


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--update", action="store_true")
    ap.add_argument("--executor", default="interleaved")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--size", choices=["small", "large"], default="small")
    ap.add_argument("--check-parameters", choices=["on", "off"], default="on")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    H, I, E = (256, 512, 16) if args.size == "small" else (1024, 704, 64)
    cfg = hpmoe.with_fields(hpmoe.preset("mixtral-8x7b"), hidden=H, expert_inter=I, routed_experts=E, top_k=2)
    moe = hpmoe.MoELayer(cfg, ranks=1, workers=1, executor=args.executor,
                         check_parameters=args.check_parameters == "on")
    opt = torch.optim.SGD(moe.parameters(), lr=1e-3)
    x = torch.randn(args.tokens, H)
    times = []
    for i in range(args.warmup + args.calls):
        t0 = time.perf_counter()
        y = moe(x)
        y = y[0] if isinstance(y, tuple) else y
        (y * y).mean().backward()  # bounded: training on it does not diverge
        t1 = time.perf_counter()
        if args.update:
            opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= args.warmup:
            times.append((t1 - t0) * 1e3)
    q = statistics.quantiles(times, n=4)
    print(json.dumps({"update": args.update, "executor": args.executor, "calls": args.calls, "tokens": args.tokens,
                      "size": args.size, "check_parameters": args.check_parameters,
                      "median_ms": statistics.median(times), "q1_ms": q[0], "q3_ms": q[2],
                      "min_ms": min(times), "max_ms": max(times)}))


if __name__ == "__main__":
    main()
