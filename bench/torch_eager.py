#!/usr/bin/python3
"""hpmoe against PyTorch eager on the same MoE layer, side by side (issue 13, item 5).

One run: hpmoe draws the layer's weights and tokens and runs them (both executors,
forward + backward, checked against its fp64 oracle) and saves them
(safetensors); PyTorch eager then runs the very same weights and tokens as a
Hugging Face DeepseekV2MoE-style block (softmax router, top-k, a Python loop over
the experts with index_add, the shared experts), on the same number of threads.
Both are held against PyTorch in fp32 on the same values (hpmoe to its dtype's
standard: the run stops if it misses), and both timings and their ratio are printed.

    bench/torch_eager.py [--preset deepseek-v2-lite] [-P 2] [-T 2048] [--iters 3] [--threads 2] [--dtype both|fp32|bf16] [--out DIR]

Both dtypes by default, one after the other: the layer's times and their share of the
peak measured by `hpmoe run` (FMA for fp32, the bf16 tile instructions for bf16), each
GEMM kind's rate and share (the serialized executor's operators), and PyTorch beside them.

Debian's python3-torch (1.13) is what it uses; it is installed here on first use
(apt-get), not by the test suite. Results: docs/results/benchmarks.md.
"""
import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def ensure_torch():
    try:
        import torch  # noqa: F401
    except ImportError:
        print("installing python3-torch (Debian) ...", flush=True)
        sudo = [] if os.geteuid() == 0 else ["sudo"]
        subprocess.run(sudo + ["apt-get", "install", "-y", "-qq", "python3-torch"], check=True,
                       env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))


def cpu_model():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def hpmoe_python(cli):
    """The hpmoe package (hpmoe.io, hpmoe.reference) of the build the CLI comes from."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(cli)), "python"))
    import hpmoe
    return hpmoe


def mlp(w, prefix, grad):
    """A SwiGLU MLP with Hugging Face's [out, in] weights, as hpmoe.reference takes it."""
    from types import SimpleNamespace
    return SimpleNamespace(**{p: w[prefix + p + ".weight"].requires_grad_(grad) for p in ("gate_proj", "up_proj", "down_proj")})


def params(m):
    return [m.gate_proj, m.up_proj, m.down_proj]


GEMM_KINDS = ["gemm_gate_up", "gemm_down", "gemm_down_dgrad", "gemm_down_wgrad", "gemm_gate_up_dgrad",
              "gemm_gate_up_wgrad", "shared_gate_up", "shared_down", "shared_down_dgrad", "shared_down_wgrad",
              "shared_gate_up_dgrad", "shared_gate_up_wgrad"]


def run_dtype(args, dtype, torch, hpmoe):
    """One dtype: hpmoe (both executors, checked against its oracle), then PyTorch eager on the same layer."""
    sets = list(args.set) + (["dtype=bf16"] if dtype == "bf16" else [])
    layer = ["--preset", args.preset, "-P", str(args.ranks), "-T", str(args.tokens)] + sum((["--set", s] for s in sets), [])
    config = json.loads(subprocess.run([args.hpmoe, "config", "--flat", "--preset", args.preset] + sum((["--set", s] for s in sets), []),
                                       check=True, capture_output=True, text=True).stdout)
    if config["scoring"] != "softmax" or config.get("capacity_factor", 0) or config.get("groups", 1) != 1:
        sys.exit("torch_eager.py models softmax top-k routing without groups or capacity (DeepseekV2MoE); "
                 f"{args.preset} has scoring {config['scoring']}")
    out = os.path.join(args.workdir, dtype)
    os.makedirs(out, exist_ok=True)
    print(f"{dtype}: hpmoe run {' '.join(layer)} ...", flush=True)
    report = os.path.join(out, "hpmoe.json")
    subprocess.run([args.hpmoe, "run"] + layer + ["-W", str(max(1, args.threads // args.ranks)), "--backward",
                    "--iters", str(args.iters), "--warmup", "1", "--verify", "sample", "--sample", "4",
                    "--json", report, "--save", os.path.join(out, "layer")], check=True, stdout=subprocess.DEVNULL)
    rep = json.load(open(report))
    if not rep["verification"]["pass"]:
        sys.exit(f"{dtype}: hpmoe's run failed its fp64 oracle check: see {report}")

    def secs(block, key):
        return block[key]["median_s"] if key in block else float("nan")

    ser, inter = rep["serialized"], rep.get("interleaved", {})
    router_s = ser.get("router", {}).get("median_s", 0.0)  # hpmoe reports its router apart from dispatch-to-combine
    executors = {"serialized": (secs(ser, "dispatch_to_combine"), secs(ser, "backward")),
                 "interleaved": (secs(inter, "dispatch_to_combine"), secs(inter, "backward"))}
    cpu = rep["cpu"]
    peak = cpu["bf16_tile_peak_flops"] if dtype == "bf16" and cpu["bf16_tile_peak_flops"] > 0 else cpu["fma_peak_flops"]
    peak_name = f"{cpu['bf16_isa'] if not cpu['amx_bf16_flops_per_core'] else 'amx-bf16'} peak" if dtype == "bf16" else "FMA peak"
    layer_flops = {"forward": rep["interleaved"]["forward_gflops"] * secs(inter, "dispatch_to_combine") * 1e9 if inter else 0.0,
                   "backward": rep["interleaved"].get("backward_gflops", 0.0) * secs(inter, "backward") * 1e9 if inter else 0.0}
    gemms = {op["name"]: op for op in rep["operators"] if op["name"] in GEMM_KINDS and "gflops" in op}

    # PyTorch eager on the same weights and tokens.
    load = lambda name: hpmoe.io.load_safetensors(os.path.join(out, "layer", name))[0]  # noqa: E731
    w, inputs, saved = load("weights.safetensors"), load("inputs.safetensors"), load("outputs.safetensors")
    x, d_out = inputs["x"], inputs["d_out"]
    E = config["routed_experts"]

    def build(wts):
        experts = [mlp(wts, f"mlp.experts.{e}.", True) for e in range(E)]
        shared = mlp(wts, "mlp.shared_experts.", True) if config["shared_experts"] > 0 else None
        return wts["mlp.gate.weight"], experts, shared

    def forward(x, router, experts, shared):
        """The layer in plain PyTorch, eager: a loop over the experts (hpmoe.reference)."""
        return hpmoe.reference.moe(config, x, router, experts, shared)

    # The reference both are held to: PyTorch in fp32 on the layer's values (for bf16,
    # hpmoe saved them bf16-rounded as F32, so the reference sees exactly the bf16 layer).
    with torch.no_grad():
        ref = forward(x, *build({k: v.clone() for k, v in w.items()}))
    if dtype == "bf16":
        w = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in w.items()}
        x, d_out = x.to(torch.bfloat16), d_out.to(torch.bfloat16)
    router, experts, shared = build(w)
    with torch.no_grad():
        y = forward(x, router, experts, shared)
    rel = lambda a, b: float((a.float() - b).norm() / b.norm())  # noqa: E731
    rel_torch, rel_hpmoe = rel(y, ref), rel(saved["out"], ref)
    xg = x.clone().requires_grad_(True)
    forward(xg, router, experts, shared).backward(d_out)
    # hpmoe's dx also carries its balancing losses' gradient (aux / z-loss), which this block leaves out.
    rel_dx = rel(xg.grad, saved["grad.x"])
    everything = [router] + sum((params(m) for m in experts), []) + (params(shared) if shared else [])
    for p in everything:
        p.grad = None
    forward_s, step_s = [], []
    for i in range(args.iters + 1):
        t0 = time.perf_counter()
        with torch.no_grad():
            forward(x, router, experts, shared)
        t1 = time.perf_counter()
        xg = x.clone().requires_grad_(True)
        router.requires_grad_(True)
        forward(xg, router, experts, shared).backward(d_out)
        t2 = time.perf_counter()
        router.requires_grad_(False)
        for p in everything:
            p.grad = None
        if i > 0:  # the first is warm-up
            forward_s.append(t1 - t0)
            step_s.append(t2 - t1)
    tf, ts = statistics.median(forward_s), statistics.median(step_s)
    # The same layer: hpmoe within the standards of its dtype of the fp32 reference.
    if rel_hpmoe > (1e-5 if dtype == "fp32" else 1e-2):
        sys.exit(f"{dtype}: hpmoe's output is {rel_hpmoe:.2e} (relative L2) from PyTorch's fp32 on the same layer")
    return {"dtype": dtype, "layer": layer, "peak_flops": peak, "peak_name": peak_name,
            "torch_forward_s": tf, "torch_step_s": ts, "torch_out_rel_l2": rel_torch, "hpmoe_out_rel_l2": rel_hpmoe,
            "dx_rel_l2_hpmoe_vs_torch": rel_dx, "aux_loss_coef": config["aux_loss_coef"],
            "hpmoe": {k: {"forward_s": f + router_s, "step_s": f + router_s + b, "dispatch_to_combine_s": f, "backward_s": b}
                      for k, (f, b) in executors.items()},
            "layer_flops": layer_flops,
            "gemms": {k: {"seconds": v["time"]["median_s"], "gflops": v["gflops"], "share_of_peak": v.get("share_of_peak")}
                      for k, v in gemms.items()},
            "cpu": cpu}


def report(results, torch):
    cpu = results[0]["cpu"]
    print(f"\nCPU: {cpu_model()} ({cpu['cores']} cores used); peaks measured by hpmoe run: FMA "
          f"{cpu['fma_peak_flops'] / 1e9:.1f} GFLOP/s fp32, {cpu['bf16_tile_peak_flops'] / 1e9:.1f} bf16 ({cpu['bf16_engine']}); "
          f"PyTorch {torch.__version__}, {torch.get_num_threads()} threads")
    print("\n| dtype | executor | forward (s) | fwd + bwd (s) | forward share of peak | backward share of peak | vs PyTorch fwd | vs PyTorch fwd + bwd |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        tf, ts, pk = r["torch_forward_s"], r["torch_step_s"], r["peak_flops"]
        fl = r["layer_flops"]
        print(f"| {r['dtype']} | PyTorch eager (HF per-expert loop) | {tf:.3f} | {ts:.3f} | {fl['forward'] / tf / pk:.0%} | "
              f"{fl['backward'] / (ts - tf) / pk:.0%} (step less forward) | 1.00x | 1.00x |")
        for name, h in r["hpmoe"].items():
            print(f"| {r['dtype']} | hpmoe {name} | {h['forward_s']:.3f} | {h['step_s']:.3f} | "
                  f"{fl['forward'] / h['dispatch_to_combine_s'] / pk:.0%} | {fl['backward'] / h['backward_s'] / pk:.0%} | "
                  f"{tf / h['forward_s']:.2f}x | {ts / h['step_s']:.2f}x |")
    print("\nhpmoe's GEMMs by kind (the serialized executor runs one operator at a time on every core), GFLOP/s and share of the peak of the dtype's instructions:")
    print("\n| GEMM kind | " + " | ".join(f"{r['dtype']} ({r['peak_name']})" for r in results) + " |")
    print("|---|" + "---|" * len(results))
    for kind in GEMM_KINDS:
        if all(kind not in r["gemms"] for r in results):
            continue
        cells = []
        for r in results:
            g = r["gemms"].get(kind)
            cells.append(f"{g['gflops']:.0f} ({g['share_of_peak']:.0%})" if g and g["share_of_peak"] is not None else "-")
        print(f"| {kind} | " + " | ".join(cells) + " |")
    print("\nOutput against PyTorch fp32 on the same layer (relative L2): " +
          "; ".join(f"{r['dtype']}: hpmoe {r['hpmoe_out_rel_l2']:.1e}, PyTorch {r['torch_out_rel_l2']:.1e}" for r in results) +
          " (hpmoe's dx includes its aux loss' gradient: " +
          ", ".join(f"{r['dtype']} dx {r['dx_rel_l2_hpmoe_vs_torch']:.1e} from PyTorch's" for r in results) + ")")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hpmoe", default=os.environ.get("HPMOE", "build/hpmoe"))
    ap.add_argument("--preset", default="deepseek-v2-lite")
    ap.add_argument("-P", "--ranks", type=int, default=2)
    ap.add_argument("-T", "--tokens", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["fp32", "bf16", "both"], default="both",
                    help="bf16: both run bf16 weights and tokens with fp32 accumulation (PyTorch: torch.bfloat16 tensors); "
                         "both (default): fp32, then bf16, in one run")
    ap.add_argument("--set", action="append", default=[], help="hpmoe --set overrides (e.g. shared_experts=0)")
    ap.add_argument("--out", help="keep the saved layers and reports here (torch_eager.json: every figure)")
    args = ap.parse_args()
    ensure_torch()
    import torch
    hpmoe = hpmoe_python(args.hpmoe)
    torch.set_num_threads(args.threads)
    args.workdir = args.out or tempfile.mkdtemp(prefix="hpmoe-torch-")
    os.makedirs(args.workdir, exist_ok=True)
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; {args.threads} threads each; {args.preset} EP {args.ranks} x "
          f"{args.tokens}, forward + backward, medians of {args.iters}", flush=True)
    results = [run_dtype(args, d, torch, hpmoe) for d in (["fp32", "bf16"] if args.dtype == "both" else [args.dtype])]
    report(results, torch)
    json.dump({"cpu_model": cpu_model(), "threads": args.threads, "torch": torch.__version__, "results": results},
              open(os.path.join(args.workdir, "torch_eager.json"), "w"), indent=1)
    if not args.out:
        shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
