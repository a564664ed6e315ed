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
Under mpirun -np N (N = --ranks) each process holds its experts (hpmoe's
ep="mpi") and one shard of the batch; the dense parts are data-parallel over
torch.distributed (gloo), their gradients summed in rank order, so the loss
curve is the one-process run's bit for bit. Each process writes its shard
of the checkpoint and rank 0 an index (checkpoint.index.json).
--resume continues from a checkpoint (bit for bit the curve a run without
the stop gives; --check-resume verifies that in one go).

The text: the licence texts Debian ships in /usr/share/common-licenses
(package base-files, present on every Debian system; the texts themselves
permit verbatim copying). Bytes are tokens (a vocabulary of 256).
"""
import argparse
import io
import json
import math
import os
import platform
import sys
import time


def _blas_threads_from_argv():
    """OpenBLAS (Debian torch's BLAS) reads its thread count once, when loaded, and a GEMM's bits depend on
    it (it splits the reduction across threads): so --threads sets it too, before torch is imported, and a
    run's curve depends only on its arguments (under mpirun, each process is bound to a core, and OpenBLAS
    would otherwise take one thread there and two in a one-process run)."""
    for i, a in enumerate(sys.argv):
        if a == "--threads" and i + 1 < len(sys.argv):
            return sys.argv[i + 1]
        if a.startswith("--threads="):
            return a.split("=", 1)[1]
    return "2"  # the default of --threads


os.environ.setdefault("OPENBLAS_NUM_THREADS", _blas_threads_from_argv())

import torch  # noqa: E402
from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

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
write_atomically = hpmoe.io.write_atomically  # the index, metrics and pictures: whole or not at all


# --- timers around a module: forward and backward seconds ---

class Timer:
    def __init__(self):
        self.forward = self.backward = 0.0
        self.parts = {}  # hpmoe's own account of its layers' time, "forward.launch" etc. (MoELayer.last_times)
        self.host_shares = []  # per step after the first: the share of the MoE layers' time outside their launches
        self.moe_before = 0.0


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

    def attend(self, x):
        B, S, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, S, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(D // self.heads)
        att = att.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        return x + self.proj((att @ v).transpose(1, 2).reshape(B, S, D))

    def forward(self, xs):
        """xs: this process's shards of the batch (one per expert-parallel rank it hosts). The dense parts run
        shard by shard, as each rank's process runs its own; the FFN takes all the shards' tokens at once."""
        xs = [self.attend(x) for x in xs]
        hs = [self.ln2(x).reshape(-1, x.shape[-1]) for x in xs]
        ys = self.ffn(torch.cat(hs)).split([h.shape[0] for h in hs])
        return [x + y.view_as(x) for x, y in zip(xs, ys)]


class LM(nn.Module):
    def __init__(self, args, make_ffn, timer):
        super().__init__()
        self.embed = nn.Embedding(256, args.d)  # N(0, 1): a byte's identity dominates its first hidden state
        self.head = nn.Linear(args.d, 256, bias=False)  # small at init: the loss starts near ln 256
        self.pos = nn.Parameter(torch.zeros(args.seq, args.d))
        self.blocks = nn.ModuleList([Block(args.d, args.heads, make_ffn(), timer) for _ in range(args.layers)])
        self.ln = nn.LayerNorm(args.d)

    def forward(self, shards):
        """shards: token blocks [b, S], one per rank this process hosts; their logits, in the same order."""
        xs = [self.embed(t) + self.pos[: t.shape[1]] for t in shards]
        for b in self.blocks:
            xs = b(xs)
        return [self.head(self.ln(x)) for x in xs]

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


def build(args, torch_twin=False, ep="inprocess"):
    torch.manual_seed(args.seed)
    timer = Timer()
    config = moe_config(args)
    if torch_twin:
        model = LM(args, lambda: TorchMoE(config), timer)
    else:
        executor = "reference" if args.dtype == "float64" else "interleaved"
        dtype = "bf16" if args.dtype == "bfloat16" else None
        model = LM(args, lambda: hpmoe.MoELayer(config, ranks=args.ranks, workers=args.workers, executor=executor,
                                                dtype=dtype, ep=ep, mpi_path=args.mpi_path), timer)
    if ep == "mpi":  # the one-process model's initial weights, this process's share of them
        own = model.state_dict().keys()
        model.load_state_dict({k: v for k, v in build(args)[0].state_dict().items() if k in own})
    # bfloat16: float32 master weights (and optimiser state), the compute in bf16 (autocast in train())
    model = model.to(torch.float32 if args.dtype == "bfloat16" else getattr(torch, args.dtype))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    return model, opt, timer


class OneLineErrors(argparse.ArgumentParser):
    """Bad flags as one "error:" line and exit code 2 (hpmoe's promise for every surface), not the usage."""

    def error(self, message):
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


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


def save_checkpoint(path, model, opt, step):
    """One file from one process. From several: each process its own file (its experts, the replicated
    parameters, its optimiser state), then rank 0 an index naming them (path's .index.json); returns what
    --resume takes."""
    dist = Distributed.get()
    tensors, meta = state_of(model, opt, step)
    if dist.world == 1:
        save_safetensors(path, tensors, meta)
        return path
    # Shards named by their step: a save that fails on some process (or a signal) leaves the index naming the
    # last whole set, whose files this save did not touch; the old set goes once the new index is in place.
    base = path[: -len(".safetensors")]
    files = [f"{os.path.basename(base)}.step{step}.rank{r}-of-{dist.world}.safetensors" for r in range(dist.world)]
    meta = dict(meta, shard=f"{dist.rank} of {dist.world}")
    save_safetensors(os.path.join(os.path.dirname(path), files[dist.rank]), tensors, meta)
    dist.td.barrier()  # every shard is whole before the index names it
    index = base + ".index.json"
    if dist.rank == 0:
        before = []
        if os.path.exists(index):
            try:
                with open(index) as f:
                    before = [n for n in json.load(f).get("files", []) if n not in files]
            except (OSError, ValueError, AttributeError):
                before = []
        write_atomically(index, json.dumps({"processes": dist.world, "step": step, "files": files}, indent=1))
        for name in before:  # the previous set, no longer named
            if os.path.basename(name) == name and name.startswith(os.path.basename(base) + "."):
                try:
                    os.remove(os.path.join(os.path.dirname(path), name))
                except FileNotFoundError:
                    pass
    dist.td.barrier()
    return index


def restore(model, opt, path):
    """A checkpoint (one file, or an index of per-process files) into this model: the tensors it holds. A
    sharded checkpoint resumes on one process, and a one-file checkpoint on several (each takes its share)."""
    files, index_step = [path], None
    if path.endswith(".index.json"):
        with open(path) as f:
            index = json.load(f)
        if not isinstance(index, dict) or not isinstance(index.get("files"), list) or not index["files"]:
            raise ValueError("its index has no list of files")
        if not isinstance(index.get("step"), int) or isinstance(index.get("step"), bool):
            raise ValueError(f"its index's step {index.get('step')!r} is not an integer")
        index_step = index["step"]
        files = [os.path.join(os.path.dirname(path), str(name)) for name in index["files"]]
    tensors, meta = {}, None
    for i, name in enumerate(files):
        t, m = load_safetensors(name)
        # Every shard is of the index's step and its own place: a shard from another save (one that did not
        # finish on every process) would mix two steps' parameters and optimiser state.
        if index_step is not None:
            shard_step = m.get("step") if isinstance(m, dict) else None
            if shard_step != str(index_step):
                raise ValueError(f"shard {os.path.basename(name)} is of step {shard_step}, its index of step "
                                 f"{index_step}: the shards are not one save (resume from a checkpoint whose save "
                                 "finished on every process)")
            shard = m.get("shard")
            if shard is not None and shard != f"{i} of {len(files)}":
                raise ValueError(f"shard {os.path.basename(name)} says it is shard {shard}, the index lists it as "
                                 f"{i} of {len(files)}")
        tensors.update(t)
        meta = meta or m
    own = model.state_dict()
    missing = [k for k in own if "model." + k not in tensors]
    if missing:
        raise KeyError(f"it has no tensor model.{missing[0]}")
    if not isinstance(meta, dict) or "step" not in meta:
        raise ValueError("its header has no step")
    try:
        step = int(meta["step"])
    except ValueError:
        raise ValueError(f"its header's step {meta['step']!r} is not an integer") from None
    if step < 0:
        raise ValueError(f"its header's step is {step}, not a step count (0 or more)")
    for k in own:
        t = tensors["model." + k]
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise ValueError(f"tensor model.{k} holds NaN or Inf")
    model.load_state_dict({k: tensors["model." + k] for k in own})
    for n, p in model.named_parameters():
        if "opt.exp_avg." + n in tensors:
            if "opt.step." + n not in tensors or "opt.exp_avg_sq." + n not in tensors:
                raise KeyError(f"it has opt.exp_avg.{n} without its opt.step or opt.exp_avg_sq")
            adam_step = int(tensors["opt.step." + n].reshape(-1)[0])
            if adam_step < 0 or adam_step > step:
                raise ValueError(f"opt.step.{n} is {adam_step}, outside 0..{step} (the checkpoint's step)")
            for kind in ("exp_avg", "exp_avg_sq"):
                if tensors[f"opt.{kind}.{n}"].shape != p.shape:
                    raise ValueError(f"opt.{kind}.{n} has shape {list(tensors[f'opt.{kind}.{n}'].shape)}, "
                                     f"the parameter {list(p.shape)}")
                if not torch.isfinite(tensors[f"opt.{kind}.{n}"]).all():  # else blamed later on the parameter
                    raise ValueError(f"tensor opt.{kind}.{n} holds NaN or Inf")
            if (tensors[f"opt.exp_avg_sq.{n}"] < 0).any():
                raise ValueError(f"tensor opt.exp_avg_sq.{n} holds negative values (a second moment cannot)")
            opt.state[p] = {"step": torch.tensor(float(adam_step)),
                            "exp_avg": tensors["opt.exp_avg." + n], "exp_avg_sq": tensors["opt.exp_avg_sq." + n]}
    return step


class Distributed:
    """The processes of an mpirun (one per expert-parallel rank), or just this one. hpmoe's layers exchange
    tokens over MPI and reduce their replicated parameters' gradients themselves; the dense parts around
    them are data-parallel over torch.distributed (gloo), their gradients summed in rank order."""
    _instance = None

    def __init__(self):
        self.rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", 0))
        self.world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", 1))
        if self.world > 1:
            import torch.distributed as td
            self.td = td
            # a file beside the run, named by the mpirun job: every process of the job finds it, and no other job
            self.init_file = os.path.abspath(os.path.join(Distributed.out, f".dist-init-{os.environ.get('PMIX_NAMESPACE', 'job')}"))
            td.init_process_group("gloo", init_method="file://" + self.init_file, rank=self.rank, world_size=self.world)

    @classmethod
    def get(cls):
        if cls._instance is None:
            cls._instance = Distributed()
        return cls._instance

    def gather(self, t):
        parts = [torch.empty_like(t) for _ in range(self.world)]
        self.td.all_gather(parts, t.contiguous())
        total = parts[0]
        for p in parts[1:]:  # rank order: the order one process's autograd adds the shards in
            total = total + p
        return total

    def sum_dense_gradients(self, model):
        if self.world == 1:
            return
        moe = {id(p) for m in model.moe_layers() for p in m.parameters()}  # hpmoe's: already reduced or its own
        for p in model.parameters():
            if id(p) not in moe and p.grad is not None:
                p.grad = self.gather(p.grad)

    def sum_scalar(self, t):
        return (self.gather(t.reshape(1)) if self.world > 1 else t).item()

    def finish(self):
        if self.world > 1:
            self.td.barrier()
            if self.rank == 0 and os.path.exists(self.init_file):
                os.remove(self.init_file)


def train(model, opt, timer, data, args, first, last, log, ckpt=None):
    """Steps [first, last); returns the loss of every step and the per-layer load max/mean of every step."""
    losses, loads, step_s = [], [], []
    model.train()
    dist = Distributed.get()
    for step in range(first, last):
        x, y = batch(data, step, args)
        # The batch's rows in one shard per expert-parallel rank; this process takes the shards of its ranks.
        xs, ys = x.chunk(args.ranks), y.chunk(args.ranks)
        mine = range(args.ranks) if dist.world == 1 else [dist.rank]
        t0 = time.perf_counter()
        # bfloat16: PyTorch's CPU autocast runs the dense layers in bf16 (the twin's experts too); hpmoe's
        # FFNs were made with dtype="bf16" and take the float32 or bfloat16 activations they are given.
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bfloat16"):
            logits = model([xs[r] for r in mine])
        # The mean over the batch as the sum over shards of each shard's mean / ranks, in rank order: what
        # the processes of a data-parallel run sum, so one process and several give the same bits.
        parts = [F.cross_entropy(l.float().reshape(-1, 256), ys[r].reshape(-1)) / args.ranks for l, r in zip(logits, mine)]
        loss = parts[0]
        for part in parts[1:]:
            loss = loss + part
        opt.zero_grad(set_to_none=True)
        loss.backward()
        dist.sum_dense_gradients(model)
        opt.step()
        step_s.append(time.perf_counter() - t0)
        losses.append(dist.sum_scalar(loss.detach()))
        launch = 0.0
        for moe in model.moe_layers():
            for pass_, parts_ in (getattr(moe, "last_times", None) or {}).items():
                for name, sec in parts_.items():
                    timer.parts[f"{pass_}.{name}"] = timer.parts.get(f"{pass_}.{name}", 0.0) + sec
                launch += parts_.get("launch", 0.0)
        moe_now = timer.forward + timer.backward
        if timer.parts and step > first:  # the first step allocates and packs everything: a warm-up
            timer.host_shares.append(1 - launch / (moe_now - timer.moe_before))
        timer.moe_before = moe_now
        per_layer = []
        for moe in model.moe_layers():
            load = moe.last_load.reshape(-1, args.experts).sum(0).float()
            per_layer.append(float(load.max() / load.mean()))
        loads.append(per_layer)
        if log and (step % args.log_every == 0 or step == last - 1):
            log(step, losses[-1], per_layer)
        if ckpt and args.save_every and (step + 1) % args.save_every == 0:
            save_checkpoint(ckpt, model, opt, step + 1)
    return losses, loads, step_s


def plots(out, steps, curves, loads):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    def save(fig, name):  # whole or not at all
        fig.tight_layout()
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=110)
        write_atomically(os.path.join(out, name), png.getvalue())

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
    ap = OneLineErrors(description=__doc__.splitlines()[0])
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
    ap.add_argument("--mpi-path", default="auto", choices=["auto", "shared", "network", "hybrid"],
                    help="under mpirun: how hpmoe's rows reach other processes (network: over TCP, as between hosts)")
    ap.add_argument("--check-resume", action="store_true",
                    help="also train to half the steps, save, load into a fresh model and finish: the losses must match bit for bit")
    args = ap.parse_args()
    # Every number in range before anything is built (ap.error: one line, exit code 2).
    for flag, value, low in [("--steps", args.steps, 1), ("--layers", args.layers, 1), ("--d", args.d, 1),
                             ("--heads", args.heads, 1), ("--inter", args.inter, 1), ("--experts", args.experts, 1),
                             ("--top-k", args.top_k, 1), ("--seq", args.seq, 1), ("--batch", args.batch, 1),
                             ("--ranks", args.ranks, 1), ("--workers", args.workers, 1), ("--threads", args.threads, 1),
                             ("--seed", args.seed, 0), ("--log-every", args.log_every, 1), ("--save-every", args.save_every, 0)]:
        if value < low:
            ap.error(f"{flag} must be at least {low}, got {value}")
    for flag, value, high in [("--workers", args.workers, 256), ("--threads", args.threads, 256), ("--steps", args.steps, 10**7),
                              ("--d", args.d, 65536), ("--inter", args.inter, 1 << 20), ("--layers", args.layers, 1024),
                              ("--experts", args.experts, 4096), ("--seq", args.seq, 1 << 20), ("--batch", args.batch, 1 << 20),
                              ("--seed", args.seed, 2**63 - 1)]:
        if value > high:
            ap.error(f"{flag} must be at most {high}, got {value}")
    if args.d % args.heads:
        ap.error(f"--d {args.d} must be a multiple of --heads {args.heads}")
    if args.top_k > args.experts:
        ap.error(f"--top-k {args.top_k} must not exceed --experts {args.experts}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        ap.error(f"--lr must be a positive finite number, got {args.lr}")
    if not (math.isfinite(args.bias_rate) and args.bias_rate >= 0):
        ap.error(f"--bias-rate must be a finite number >= 0, got {args.bias_rate}")
    if args.batch % args.ranks:
        ap.error("--batch must be divisible by --ranks (a shard of the batch per rank)")
    Distributed.out = args.out
    os.makedirs(args.out, exist_ok=True)
    dist = Distributed.get()
    ep = "mpi" if dist.world > 1 else "inprocess"
    if dist.world > 1 and args.ranks != dist.world:
        ap.error(f"mpirun started {dist.world} processes; run one per expert-parallel rank (--ranks {dist.world}), "
                 f"got --ranks {args.ranks}")
    if dist.world > 1:
        args.no_twin = True  # the twin runs in one process
    root = dist.rank == 0
    say = print if root else (lambda *a, **k: None)
    torch.set_num_threads(args.threads)
    data, names = load_text()
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
    say(f"CPU: {cpu}; {args.threads} threads; text: {len(names)} files of {TEXT_DIR}, {data.numel()} bytes", flush=True)
    say(f"model: {args.layers} layers, d {args.d}, {args.experts} experts top-{args.top_k} + 1 shared (inter {args.inter}), "
        f"{args.batch} x {args.seq} bytes a step; hpmoe on {args.ranks} ranks x {args.workers} workers"
        + (f", one process each (mpirun), the dense parts data-parallel (gloo)" if dist.world > 1 else ""), flush=True)

    ckpt = os.path.join(args.out, "checkpoint.safetensors")
    model, opt, timer = build(args, ep=ep)
    try:
        first = restore(model, opt, args.resume) if args.resume else 0
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RuntimeError) as e:
        ap.error(f"--resume {args.resume}: not a checkpoint of this model ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
    if first >= args.steps:
        ap.error(f"the checkpoint is at step {first}, not before --steps {args.steps}")

    def log(name):
        if not root:
            return None
        return lambda step, loss, lm: print(f"{name:7s} step {step:5d}  loss {loss:.4f}  load max/mean "
                                            + " ".join(f"{v:.2f}" for v in lm), flush=True)

    losses, loads, step_s = train(model, opt, timer, data, args, first, args.steps, log("hpmoe"), ckpt)
    written = save_checkpoint(ckpt, model, opt, args.steps)
    tokens = args.batch * args.seq
    n = args.steps - first
    metrics = {"cpu": cpu, "threads": args.threads, "processes": dist.world, "args": vars(args), "text_bytes": data.numel(),
               "first_step": first, "checkpoint": os.path.basename(written),
               "hpmoe": {"loss": losses, "load_max_over_mean": loads, "tokens_per_s": tokens * n / sum(step_s),
                         "moe_forward_s_per_step": timer.forward / n, "moe_backward_s_per_step": timer.backward / n}}
    curves = {"hpmoe": losses}
    if timer.parts:  # the launches are the layers' work; everything else in their timers is the host's
        moe_s = timer.forward + timer.backward
        launch = timer.parts.get("forward.launch", 0.0) + timer.parts.get("backward.launch", 0.0)
        metrics["hpmoe"]["moe_parts_s_per_step"] = {k: v / n for k, v in sorted(timer.parts.items())}
        share = sorted(timer.host_shares)[len(timer.host_shares) // 2] if timer.host_shares else 1 - launch / moe_s
        metrics["hpmoe"]["moe_host_share_median"] = share
        top = sorted(((v, k) for k, v in timer.parts.items() if not k.endswith(".launch")), reverse=True)[:4]
        say(f"hpmoe's MoE layers: {moe_s / n * 1e3:.1f} ms a step, of which launches {launch / n * 1e3:.1f} ms; host work "
            f"{100 * share:.0f}% of a step (median after the first; largest parts on average: "
            + ", ".join(f"{k} {v / n * 1e3:.1f} ms" for v, k in top) + ", the rest PyTorch glue)")
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
        say(f"losses: largest difference {diff:.2e} over {n} steps (first {losses[0]:.4f} -> last {losses[-1]:.4f})")
        say(f"tokens/s: hpmoe {h['tokens_per_s']:.0f}, PyTorch twin {p['tokens_per_s']:.0f}; MoE layers per step "
            f"(forward + backward, layer timers): hpmoe {hm * 1e3:.1f} ms, PyTorch {pm * 1e3:.1f} ms ({pm / hm:.2f}x)")
        metrics["moe_speedup"] = pm / hm
    if args.check_resume:
        half = first + n // 2
        m2, o2, t2 = build(args, ep=ep)
        if args.resume:
            restore(m2, o2, args.resume)
        train(m2, o2, t2, data, args, first, half, None)
        part = save_checkpoint(os.path.join(args.out, "resume-check.safetensors"), m2, o2, half)
        m3, o3, t3 = build(args, ep=ep)
        step = restore(m3, o3, part)
        rest, _, _ = train(m3, o3, t3, data, args, step, args.steps, None)
        same = rest == losses[half - first:]
        metrics["resume_bit_identical"] = same
        say(f"resume at step {half}: the remaining {len(rest)} losses are {'bit-identical' if same else 'DIFFERENT'}")
        if not same:
            sys.exit(1)
    dist.finish()
    if not root:
        return
    plots(args.out, list(range(first, args.steps)), curves, loads)
    write_atomically(os.path.join(args.out, "metrics.json"), json.dumps(metrics, indent=1))
    print(f"wrote {args.out}/loss.png, load.png, metrics.json, {os.path.basename(written)}")


def _exit_on_signal(signum, frame):
    """SIGTERM/SIGHUP as an exit that runs the cleanups (a checkpoint's temporary is removed, not left)."""
    sys.exit(128 + signum)


if __name__ == "__main__":
    import signal
    for _s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(_s, _exit_on_signal)
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
    except (ValueError, OSError, KeyError, RuntimeError, TypeError, IndexError, json.JSONDecodeError) as e:
        # hpmoe's own checks and the file system's say what is wrong: one line, exit code 2, no traceback
        print(f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", file=sys.stderr)
        sys.exit(2)
