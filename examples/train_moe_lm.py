#!/usr/bin/python3
"""Train a small MoE language model whose FFNs are hpmoe layers, next to its plain-PyTorch twin.

    PYTHONPATH=build/python examples/train_moe_lm.py [--steps 200] [--out train-out] [--resume CKPT]

The model: a byte-level decoder-only transformer (4 layers, d = 256, 4
heads, 16 experts top-2 with sigmoid scores, DeepSeek-V3's aux-loss-free
expert bias, and one shared expert). Attention is plain PyTorch, and each
layer's FFN is hpmoe.MoELayer (2 in-process expert-parallel ranks).

The twin is the same model with a plain-PyTorch MoE FFN (a loop over the
experts, the same routing rule and bias update), started from the same
weights. Both train on the same batches with the same optimiser, and the
example prints both loss curves, their largest difference, and each model's
MoE time per step. The MoE time is measured by timers around the FFN, in
forward and in backward. The output directory gets:
  - loss.png: the two loss curves overlaid;
  - load.png: expert load (max/mean per layer over the steps);
  - metrics.json: every figure above;
  - checkpoint.safetensors: the hpmoe model and its optimiser state, at
    --save-every steps and at the end.
--dtype bfloat16 trains in mixed precision: float32 master weights and
optimiser state, the compute in bf16 (hpmoe's FFNs made with dtype="bf16",
the rest of both models under torch.autocast).
--resume continues from a checkpoint (bit for bit the curve a run without
the stop gives; --check-resume verifies that in one go).

The text: the licence texts Debian ships in /usr/share/common-licenses
(package base-files, present on every Debian system; the texts themselves
permit verbatim copying). Bytes are tokens (a vocabulary of 256).
"""
import argparse
import json
import math
import os
import platform
import sys
import time

import torch
from torch import nn
import torch.nn.functional as F

try:
    import hpmoe
except ImportError:
    sys.exit("import hpmoe failed: build hpmoe (cmake --build build) and run with PYTHONPATH=build/python")

TEXT_DIR = "/usr/share/common-licenses"


def load_text():
    names = sorted(n for n in os.listdir(TEXT_DIR) if not os.path.islink(os.path.join(TEXT_DIR, n)))
    if not names:
        sys.exit(f"no texts in {TEXT_DIR} (Debian's base-files ships them)")
    data = b"\n\n".join(open(os.path.join(TEXT_DIR, n), "rb").read() for n in names)
    return torch.tensor(list(data), dtype=torch.long), names


# --- checkpoints: hpmoe.io's safetensors (written whole or not at all) ---

save_safetensors = hpmoe.io.save_safetensors
load_safetensors = hpmoe.io.load_safetensors


# --- timers around a module: forward and backward seconds ---

class Timer:
    def __init__(self):
        self.forward = self.backward = 0.0


class _Mark(torch.autograd.Function):
    """Identity; records when the gradient passes (the MoE's backward starts at the output mark)."""

    @staticmethod
    def forward(ctx, x, timer, is_output):
        ctx.timer, ctx.is_output = timer, is_output
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        now = time.perf_counter()
        if ctx.is_output:
            ctx.timer._bwd_start = now
        else:
            ctx.timer.backward += now - ctx.timer._bwd_start
        return g, None, None


class TimedFfn(nn.Module):
    def __init__(self, ffn, timer):
        super().__init__()
        self.ffn, self.timer = ffn, timer

    def forward(self, x):
        x = _Mark.apply(x, self.timer, False)
        t0 = time.perf_counter()
        y = self.ffn(x)
        if isinstance(y, tuple):
            y = y[0]
        self.timer.forward += time.perf_counter() - t0
        return _Mark.apply(y, self.timer, True)


# --- the plain-PyTorch MoE (the twin's FFN): hpmoe.reference.ReferenceMoE, the same layer as hpmoe's:
# sigmoid scores, top-k on scores + bias, normalised weights, route scale, one shared expert, and the
# aux-loss-free bias update (bias += rate * sign(mean load - load)) ---

TorchMoE = hpmoe.reference.ReferenceMoE


# --- the language model ---

class Block(nn.Module):
    def __init__(self, d, heads, ffn, timer):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.heads = heads
        self.ffn = TimedFfn(ffn, timer)

    def forward(self, x):
        B, S, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, S, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(D // self.heads)
        att = att.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(B, S, D))
        h = self.ln2(x)
        return x + self.ffn(h.reshape(B * S, D)).view(B, S, D)


class LM(nn.Module):
    def __init__(self, args, make_ffn, timer):
        super().__init__()
        self.embed = nn.Embedding(256, args.d)  # N(0, 1): a byte's identity dominates its first hidden state
        self.head = nn.Linear(args.d, 256, bias=False)  # small at init: the loss starts near ln 256
        self.pos = nn.Parameter(torch.zeros(args.seq, args.d))
        self.blocks = nn.ModuleList([Block(args.d, args.heads, make_ffn(), timer) for _ in range(args.layers)])
        self.ln = nn.LayerNorm(args.d)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))

    def moe_layers(self):
        return [b.ffn.ffn for b in self.blocks]


def batch(data, step, args):
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)  # a function of the step: resumable
    starts = torch.randint(0, data.numel() - args.seq - 1, (args.batch,), generator=g)
    window = torch.stack([data[s: s + args.seq + 1] for s in starts.tolist()])
    return window[:, :-1], window[:, 1:]


def moe_config(args):
    return hpmoe.with_fields(hpmoe.preset("mixtral-8x7b"), name="train-moe-lm", hidden=args.d, expert_inter=args.inter,
                             routed_experts=args.experts, top_k=args.top_k, shared_experts=1, shared_inter=args.inter,
                             scoring="sigmoid", normalize_topk=True, route_scale=1.0, expert_bias=True,
                             bias_update_rate=args.bias_rate, aux_loss_coef=0, z_loss_coef=0, capacity_factor=0)


def build(args, torch_twin=False):
    torch.manual_seed(args.seed)
    timer = Timer()
    config = moe_config(args)
    if torch_twin:
        model = LM(args, lambda: TorchMoE(config), timer)
    else:
        executor = "reference" if args.dtype == "float64" else "interleaved"
        dtype = "bf16" if args.dtype == "bfloat16" else None
        model = LM(args, lambda: hpmoe.MoELayer(config, ranks=args.ranks, workers=args.workers, executor=executor,
                                                dtype=dtype), timer)
    # bfloat16: float32 master weights (and optimiser state), the compute in bf16 (autocast in train())
    model = model.to(torch.float32 if args.dtype == "bfloat16" else getattr(torch, args.dtype))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    return model, opt, timer


def state_of(model, opt, step):
    tensors = {"model." + k: v for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p)
            if st:
                tensors["opt.exp_avg." + names[id(p)]] = st["exp_avg"]
                tensors["opt.exp_avg_sq." + names[id(p)]] = st["exp_avg_sq"]
                tensors["opt.step." + names[id(p)]] = torch.tensor([int(st["step"])], dtype=torch.int64)
    return tensors, {"step": str(step)}


def restore(model, opt, path):
    tensors, meta = load_safetensors(path)
    model.load_state_dict({k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")})
    for n, p in model.named_parameters():
        if "opt.exp_avg." + n in tensors:
            opt.state[p] = {"step": torch.tensor(float(tensors["opt.step." + n][0])),
                            "exp_avg": tensors["opt.exp_avg." + n], "exp_avg_sq": tensors["opt.exp_avg_sq." + n]}
    return int(meta["step"])


def train(model, opt, timer, data, args, first, last, log, ckpt=None):
    """Steps [first, last); returns the loss of every step and the per-layer load max/mean of every step."""
    losses, loads, step_s = [], [], []
    model.train()
    for step in range(first, last):
        x, y = batch(data, step, args)
        t0 = time.perf_counter()
        # bfloat16: PyTorch's CPU autocast runs the dense layers in bf16 (the twin's experts too); hpmoe's
        # FFNs were made with dtype="bf16" and take the float32 or bfloat16 activations they are given.
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bfloat16"):
            logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, 256), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step_s.append(time.perf_counter() - t0)
        losses.append(loss.item())
        per_layer = []
        for moe in model.moe_layers():
            load = moe.last_load.reshape(-1, args.experts).sum(0).float()
            per_layer.append(float(load.max() / load.mean()))
        loads.append(per_layer)
        if log and (step % args.log_every == 0 or step == last - 1):
            log(step, losses[-1], per_layer)
        if ckpt and args.save_every and (step + 1) % args.save_every == 0:
            save_safetensors(ckpt, *state_of(model, opt, step + 1))
    return losses, loads, step_s


def plots(out, steps, curves, loads):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    def save(fig, name):  # whole or not at all
        fig.tight_layout()
        fig.savefig(os.path.join(out, name + ".tmp"), format="png", dpi=110)
        os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, ls in curves.items():
        ax.plot(steps, ls, label=label, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.set_title("byte-level MoE LM: hpmoe FFN vs plain-PyTorch FFN")
    ax.legend()
    save(fig, "loss.png")
    fig, ax = plt.subplots(figsize=(7, 4))
    for layer in range(len(loads[0])):
        ax.plot(steps, [l[layer] for l in loads], label=f"layer {layer}", linewidth=1)
    ax.axhline(1.0, color="gray", linewidth=0.5)
    ax.set_xlabel("step")
    ax.set_ylabel("expert load, max / mean")
    ax.set_title("expert load under the aux-loss-free bias update (hpmoe model)")
    ax.legend()
    save(fig, "load.png")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--inter", type=int, default=256, help="intermediate size of each expert and of the shared one")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--bias-rate", type=float, default=1e-2,
                    help="aux-loss-free bias step (DeepSeek-V3 uses 1e-3 over far longer runs)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--save-every", type=int, default=0)
    ap.add_argument("--out", default="train-out")
    ap.add_argument("--resume", help="a checkpoint.safetensors of this example to continue from")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float64"], default="float32",
                    help="bfloat16: mixed precision, float32 master weights and optimiser state, the compute in "
                         "bf16 (hpmoe's FFNs with dtype='bf16', the rest under torch.autocast); "
                         "float64: both models in double, hpmoe's FFNs by its fp64 oracle (executor=reference; "
                         "plain loops, for small models): shows how closely the two curves follow each other "
                         "when rounding is not amplified")
    ap.add_argument("--no-twin", action="store_true", help="train the hpmoe model only")
    ap.add_argument("--check-resume", action="store_true",
                    help="also train to half the steps, save, load into a fresh model and finish: the losses must match bit for bit")
    args = ap.parse_args()
    if args.steps < 1 or args.batch * args.seq % args.ranks:
        ap.error("--steps must be >= 1 and --batch x --seq divisible by --ranks")  # one line, exit code 2
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    data, names = load_text()
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
    print(f"CPU: {cpu}; {args.threads} threads; text: {len(names)} files of {TEXT_DIR}, {data.numel()} bytes", flush=True)
    print(f"model: {args.layers} layers, d {args.d}, {args.experts} experts top-{args.top_k} + 1 shared (inter {args.inter}), "
          f"{args.batch} x {args.seq} bytes a step; hpmoe on {args.ranks} ranks x {args.workers} workers", flush=True)

    ckpt = os.path.join(args.out, "checkpoint.safetensors")
    model, opt, timer = build(args)
    try:
        first = restore(model, opt, args.resume) if args.resume else 0
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RuntimeError) as e:
        ap.error(f"--resume {args.resume}: not a checkpoint of this model ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
    if first >= args.steps:
        ap.error(f"the checkpoint is at step {first}, not before --steps {args.steps}")

    def log(name):
        return lambda step, loss, lm: print(f"{name:7s} step {step:5d}  loss {loss:.4f}  load max/mean "
                                            + " ".join(f"{v:.2f}" for v in lm), flush=True)

    losses, loads, step_s = train(model, opt, timer, data, args, first, args.steps, log("hpmoe"), ckpt)
    save_safetensors(ckpt, *state_of(model, opt, args.steps))
    tokens = args.batch * args.seq
    n = args.steps - first
    metrics = {"cpu": cpu, "threads": args.threads, "args": vars(args), "text_bytes": data.numel(), "first_step": first,
               "hpmoe": {"loss": losses, "load_max_over_mean": loads, "tokens_per_s": tokens * n / sum(step_s),
                         "moe_forward_s_per_step": timer.forward / n, "moe_backward_s_per_step": timer.backward / n}}
    curves = {"hpmoe": losses}
    if not args.no_twin:
        twin, topt, ttimer = build(args, torch_twin=True)
        twin.load_state_dict(build(args)[0].state_dict())  # the same initial weights as the hpmoe model
        if args.resume:
            restore(twin, topt, args.resume)
        tl, _, ts = train(twin, topt, ttimer, data, args, first, args.steps, log("pytorch"))
        diff = max(abs(a - b) for a, b in zip(losses, tl))
        metrics["pytorch"] = {"loss": tl, "tokens_per_s": tokens * n / sum(ts),
                              "moe_forward_s_per_step": ttimer.forward / n, "moe_backward_s_per_step": ttimer.backward / n}
        metrics["max_loss_difference"] = diff
        curves["PyTorch twin"] = tl
        h, p = metrics["hpmoe"], metrics["pytorch"]
        hm, pm = h["moe_forward_s_per_step"] + h["moe_backward_s_per_step"], p["moe_forward_s_per_step"] + p["moe_backward_s_per_step"]
        print(f"losses: largest difference {diff:.2e} over {n} steps (first {losses[0]:.4f} -> last {losses[-1]:.4f})")
        print(f"tokens/s: hpmoe {h['tokens_per_s']:.0f}, PyTorch twin {p['tokens_per_s']:.0f}; MoE layers per step "
              f"(forward + backward, layer timers): hpmoe {hm * 1e3:.1f} ms, PyTorch {pm * 1e3:.1f} ms ({pm / hm:.2f}x)")
        metrics["moe_speedup"] = pm / hm
    if args.check_resume:
        half = first + n // 2
        m2, o2, t2 = build(args)
        if args.resume:
            restore(m2, o2, args.resume)
        train(m2, o2, t2, data, args, first, half, None)
        part = os.path.join(args.out, "resume-check.safetensors")
        save_safetensors(part, *state_of(m2, o2, half))
        m3, o3, t3 = build(args)
        step = restore(m3, o3, part)
        rest, _, _ = train(m3, o3, t3, data, args, step, args.steps, None)
        same = rest == losses[half - first:]
        metrics["resume_bit_identical"] = same
        print(f"resume at step {half}: the remaining {len(rest)} losses are {'bit-identical' if same else 'DIFFERENT'}")
        if not same:
            sys.exit(1)
    plots(args.out, list(range(first, args.steps)), curves, loads)
    with open(os.path.join(args.out, "metrics.json.tmp"), "w") as f:
        json.dump(metrics, f, indent=1)
    os.replace(os.path.join(args.out, "metrics.json.tmp"), os.path.join(args.out, "metrics.json"))
    print(f"wrote {args.out}/loss.png, load.png, metrics.json, checkpoint.safetensors")


if __name__ == "__main__":
    main()
