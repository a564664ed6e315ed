#!/usr/bin/python3
"""hpmoe against PyTorch eager on the same MoE layer, side by side (issue 13, item 5).

One run: hpmoe draws the layer's weights and tokens and runs them (both executors,
forward + backward, checked against its fp64 oracle) and saves them
(safetensors); PyTorch eager then runs the very same weights and tokens as a
Hugging Face DeepseekV2MoE-style block (softmax router, top-k, a Python loop over
the experts with index_add, the shared experts), on the same number of threads,
checks its output against hpmoe's, and both timings and their ratio are printed.

    bench/torch_eager.py [--preset deepseek-v2-lite] [-P 2] [-T 2048] [--iters 3] [--threads 2] [--dtype fp32|bf16] [--out DIR]

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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hpmoe", default=os.environ.get("HPMOE", "build/hpmoe"))
    ap.add_argument("--preset", default="deepseek-v2-lite")
    ap.add_argument("-P", "--ranks", type=int, default=2)
    ap.add_argument("-T", "--tokens", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                    help="bf16: both run bf16 weights and tokens with fp32 accumulation (PyTorch: torch.bfloat16 tensors)")
    ap.add_argument("--set", action="append", default=[], help="hpmoe --set overrides (e.g. shared_experts=0)")
    ap.add_argument("--out", help="keep the saved layer and reports here")
    args = ap.parse_args()
    ensure_torch()
    import torch
    hpmoe = hpmoe_python(args.hpmoe)

    def load_safetensors(path):
        return hpmoe.io.load_safetensors(path)[0]

    def moe_forward(x, router, experts, shared):
        """The layer in plain PyTorch, eager: a loop over the experts (hpmoe.reference)."""
        return hpmoe.reference.moe(config, x, router, experts, shared)
    torch.set_num_threads(args.threads)
    out = args.out or tempfile.mkdtemp(prefix="hpmoe-torch-")
    os.makedirs(out, exist_ok=True)
    layer = ["--preset", args.preset, "-P", str(args.ranks), "-T", str(args.tokens)]
    if args.dtype == "bf16":
        args.set.append("dtype=bf16")
    for s in args.set:
        layer += ["--set", s]
    config = json.loads(subprocess.run([args.hpmoe, "config", "--preset", args.preset] + sum((["--set", s] for s in args.set), []),
                                       check=True, capture_output=True, text=True).stdout)
    if config["scoring"] != "softmax" or config.get("capacity_factor", 0) or config.get("groups", 1) != 1:
        sys.exit("torch_eager.py models softmax top-k routing without groups or capacity (DeepseekV2MoE); "
                 f"{args.preset} has scoring {config['scoring']}")
    cpu = cpu_model()
    print(f"CPU: {cpu}, {os.cpu_count()} cores; {args.threads} threads each; layer {args.preset} "
          f"{' '.join(layer[2:])}, {args.dtype}, forward + backward", flush=True)

    # hpmoe: both executors, timed, checked against its oracle by sampling, and the layer saved.
    report = os.path.join(out, "hpmoe.json")
    subprocess.run([args.hpmoe, "run"] + layer + ["-W", str(max(1, args.threads // args.ranks)), "--backward",
                    "--iters", str(args.iters), "--warmup", "1", "--verify", "sample", "--sample", "4",
                    "--json", report, "--save", os.path.join(out, "layer")], check=True, stdout=subprocess.DEVNULL)
    rep = json.load(open(report))
    ser = rep["serialized"]
    inter = rep.get("interleaved", {})

    def secs(block, key):
        return block[key]["median_s"] if key in block else float("nan")

    h = {"serialized": (secs(ser, "dispatch_to_combine"), secs(ser, "backward")),
         "interleaved": (secs(inter, "dispatch_to_combine"), secs(inter, "backward"))}
    router_s = ser.get("router", {}).get("median_s", 0.0)

    # PyTorch eager on the same weights and tokens.
    w = load_safetensors(os.path.join(out, "layer", "weights.safetensors"))
    inputs = load_safetensors(os.path.join(out, "layer", "inputs.safetensors"))
    saved = load_safetensors(os.path.join(out, "layer", "outputs.safetensors"))
    x, d_out = inputs["x"], inputs["d_out"]
    if args.dtype == "bf16":  # hpmoe saved its bf16-rounded values as F32: exact in bfloat16
        w = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in w.items()}
        x, d_out = x.to(torch.bfloat16), d_out.to(torch.bfloat16)
    E = config["routed_experts"]
    router = w["mlp.gate.weight"]
    experts = [mlp(w, f"mlp.experts.{e}.", True) for e in range(E)]
    shared = mlp(w, "mlp.shared_experts.", True) if config["shared_experts"] > 0 else None
    with torch.no_grad():
        y = moe_forward(x, router, experts, shared)
    ref = saved["out"]
    rel = float((y.float() - ref).norm() / ref.norm())
    xg = x.clone().requires_grad_(True)
    moe_forward(xg, router, experts, shared).backward(d_out)
    # hpmoe's dx also carries its balancing losses' gradient (aux / z-loss), which this block leaves out.
    rel_dx = float((xg.grad.float() - saved["grad.x"]).norm() / saved["grad.x"].norm())
    for p in sum((params(m) for m in experts), []) + (params(shared) if shared else []):
        p.grad = None
    forward_s, step_s = [], []
    for i in range(args.iters + 1):
        t0 = time.perf_counter()
        with torch.no_grad():
            moe_forward(x, router, experts, shared)
        t1 = time.perf_counter()
        xg = x.clone().requires_grad_(True)
        router.requires_grad_(True)
        yy = moe_forward(xg, router, experts, shared)
        yy.backward(d_out)
        t2 = time.perf_counter()
        router.requires_grad_(False)
        for p in [router] + sum((params(m) for m in experts), []) + (params(shared) if shared else []):
            p.grad = None
        if i > 0:  # the first is warm-up
            forward_s.append(t1 - t0)
            step_s.append(t2 - t1)
    tf, ts = statistics.median(forward_s), statistics.median(step_s)

    print(f"PyTorch {torch.__version__} eager vs hpmoe: output relative L2 {rel:.2e}, dx {rel_dx:.2e} "
          f"(hpmoe's dx includes the aux loss, coefficient {config['aux_loss_coef']})")
    print("| executor | forward (s) | forward + backward (s) | forward vs torch | fwd+bwd vs torch |")
    print("|---|---|---|---|---|")
    print(f"| PyTorch eager (HF per-expert loop) | {tf:.3f} | {ts:.3f} | 1.00x | 1.00x |")
    for name, (f, b) in h.items():
        f += router_s  # hpmoe reports its router apart from Dispatch-to-Combine
        print(f"| hpmoe {name} | {f:.3f} | {f + b:.3f} | {tf / f:.2f}x | {ts / (f + b):.2f}x |")
    json.dump({"cpu": cpu, "threads": args.threads, "dtype": args.dtype, "layer": layer, "torch": torch.__version__, "rel_l2_vs_hpmoe": rel, "dx_rel_l2_vs_hpmoe": rel_dx,
               "torch_forward_s": tf, "torch_step_s": ts,
               "hpmoe": {k: {"forward_s": f + router_s, "step_s": f + router_s + b} for k, (f, b) in h.items()}},
              open(os.path.join(out, "torch_eager.json"), "w"), indent=1)
    if not args.out:
        shutil.rmtree(out, ignore_errors=True)
    if rel > (1e-4 if args.dtype == "fp32" else 3e-2):
        sys.exit(f"PyTorch's output differs from hpmoe's (relative L2 {rel:.2e}): not the same layer")


if __name__ == "__main__":
    main()
