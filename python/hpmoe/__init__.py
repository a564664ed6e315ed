"""hpmoe from PyTorch: the MoE FFN layer as a drop-in ``nn.Module``.

    import hpmoe
    moe = hpmoe.MoELayer(hpmoe.preset("qwen3-30b-a3b"), ranks=2, workers=1)
    moe.load_state_dict(block_state_dict)      # Hugging Face names: gate.weight, experts.{e}.gate_proj.weight, ...
    y = moe(x)                                 # x: float32 [..., hidden]; y always a tensor like x
    y.sum().backward()                         # hpmoe's backward, both executors
    moe.last_losses.aux, moe.last_losses.z     # the balancing losses of the last forward, for logging

The layer runs as ``ranks`` expert-parallel ranks of ``workers`` threads in
this process (the tokens of a call are split evenly over the ranks). The
balancing losses of the last forward are kept on ``last_losses`` (aux, z),
for logging: their gradients, with the configuration's coefficients
(aux_loss_coef, z_loss_coef), are already part of hpmoe's backward, so
adding them to the loss changes nothing. (Earlier versions' forward
returned (y, aux, z) when a coefficient was set; it now always returns y.) With
``expert_bias`` on, the aux-loss-free bias (DeepSeek-V3) is updated after
every backward from that step's expert load.

Each forward keeps its own state until its backward, so several forwards may
be in flight (micro-batches, activation recomputation); each backward uses
the forward that built its graph, and the bias update uses that forward's load.

Memory: float32 contiguous CPU tensors are read without copies (x, d_out
and the parameters, through NumPy views); anything else is converted once.
Outputs and gradients are new tensors over arrays hpmoe writes in place (the
experts' weight gradients by the tiles that compute them, in Hugging Face's
layout and the parameters' dtype).
The layer is kept across calls (hpmoe::Layer): its packed weights, worker
pool and buffers live from one forward to the next, and a forward converts
and repacks, in place, only the parameters whose PyTorch version counter or
storage changed since the last one (an optimizer's step changes them all;
evaluation and gradient accumulation change none). Errors from C++ arrive as
ValueError with hpmoe's message.
"""
import copy
import json
import os
from typing import NamedTuple

import torch
from torch import nn

from . import _core, io, reference
from .reference import SwiGLU  # MoELayer keeps its experts' parameters in these


class Losses(NamedTuple):
    """The balancing losses of a forward (0-d tensors): the aux loss and the router z-loss."""
    aux: torch.Tensor
    z: torch.Tensor

__all__ = ["MoELayer", "SwiGLU", "preset", "preset_names", "from_hf_config", "with_fields", "io", "reference"]


def preset_names():
    return list(_core.preset_names())


def preset(name):
    """A preset layer configuration (a dict in hpmoe's config format)."""
    return json.loads(_core.preset_json(name))


def with_fields(config, **fields):
    """The configuration with fields set as ``hpmoe --set field=value`` sets them (checked)."""
    text = {k: (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in fields.items()}
    return json.loads(_core.config_with(json.dumps(config), text))


def from_hf_config(path, base=None):
    """A layer configuration read from a Hugging Face config.json (or hpmoe's own format)."""
    return json.loads(_core.config_file_json(str(path), json.dumps(base or preset("mixtral-8x7b"))))


def _rebuild(init_args, state, training, bf16=False):
    """A pickled MoELayer made again: the same arguments (and .bfloat16() if it had been called), then its
    parameters."""
    layer = MoELayer(**init_args)
    if bf16:
        layer.bfloat16()
    layer.load_state_dict(state)
    layer.train(training)
    return layer


class _Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, module, core, out_dtype, names, x, *params):
        arrays = {n: _array(p) for n, p in zip(names, params)}
        # (storage address, version counter): which parameters changed since the last forward, so that
        # the kept layer converts and repacks only those
        versions = {n: (p.data_ptr(), p._version) for n, p in zip(names, params)}
        if module.gate_bias is not None:
            arrays["gate.e_score_correction_bias"] = _array(module.gate_bias)
            versions["gate.e_score_correction_bias"] = (module.gate_bias.data_ptr(), module.gate_bias._version)
        # bfloat16 tokens go in widened to float32 (exact); the layer rounds them as its dtype says
        wide = x.detach().float() if x.dtype == torch.bfloat16 else x.detach()
        out, aux, z, load, step = core.forward(wide.numpy(), arrays, versions)
        ctx.module, ctx.names, ctx.tokens, ctx.dtype, ctx.step = module, names, x.shape[0], x.dtype, step
        # The backward reads the tokens where the forward found them (the router's and the shared experts'
        # weight gradients): saved, so that PyTorch refuses a backward after they were changed in place
        # ("modified by an inplace operation"), as it does for its own layers.
        ctx.save_for_backward(x)
        ctx.param_dtypes = [p.dtype for p in params]
        ctx.load = module.last_load = torch.from_numpy(load)
        module.last_times = step.times()
        module.last_exchange = step.exchange()
        # The output in the tokens' dtype; under autocast in its dtype (bf16), as autocast's matmuls give.
        y_dtype = out_dtype or x.dtype
        return torch.from_numpy(out).to(y_dtype), torch.tensor(aux, dtype=y_dtype), torch.tensor(z, dtype=y_dtype)

    @staticmethod
    def backward(ctx, d_out, d_aux, d_z):
        module = ctx.module
        # Grad mode is on in a backward only under create_graph=True: hpmoe's backward is not itself
        # differentiable, so a double backward (a gradient penalty, Hessian-vector products) is an error,
        # not a silently dropped second-order term.
        if torch.is_grad_enabled():
            raise ValueError("hpmoe.MoELayer's backward is not differentiable: create_graph=True (double backward, "
                             "gradient penalties) is not supported")
        if ctx.step is None:
            raise ValueError("this forward's backward has already run (the float32 executors run one backward "
                             "per forward: call backward once, or use executor='reference' for repeated "
                             "backwards with retain_graph=True)")
        _ = ctx.saved_tensors  # raises PyTorch's error if the tokens changed in place since the forward
        if d_out is None:  # only the losses were used
            d_out = torch.zeros(ctx.tokens, module.config["hidden"], dtype=ctx.dtype)
        wide = torch.float64 if ctx.dtype == torch.float64 else torch.float32
        # bfloat16 experts get their gradients rounded in C++ (as bfloat16 bits), not by a .to per tensor
        bf16_experts = all(dt == torch.bfloat16 for n, dt in zip(ctx.names, ctx.param_dtypes) if n.startswith("experts."))
        grads = ctx.step.backward(d_out.to(wide).contiguous().numpy(), bf16_experts and module.executor != "reference")
        module.last_times = ctx.step.times()
        module.last_exchange = ctx.step.exchange()
        if module.executor != "reference":
            ctx.step = None  # its one backward has run: free the packed weights and activations
        if module.gate_bias is not None:  # DeepSeek-V3's aux-loss-free update, after the step
            with torch.no_grad():
                bias = module.gate_bias.to(torch.float32).contiguous()  # selection runs on fp32 biases
                _core.update_expert_bias(bias.numpy(), ctx.load.sum(dim=0).numpy(),
                                         module.config["bias_update_rate"])
                module.gate_bias.copy_(bias)
        # An expert that computed nothing this step gets no gradient (None), as in a PyTorch MoE where it
        # is not in the graph: optimisers then leave it alone (Adam's momentum does not move an idle expert).
        idle = {str(e) for e, n in enumerate(ctx.load.sum(dim=0).tolist()) if n == 0}
        # Gradients come in float32 (fp32 accumulation) and leave in each tensor's own dtype.
        def grad(n, dt):
            g = torch.from_numpy(grads[n])
            return g.view(torch.bfloat16) if g.dtype == torch.int16 else g.to(dt)
        return (None, None, None, None, torch.from_numpy(grads["x"]).to(ctx.dtype)) + tuple(
            None if n.startswith("experts.") and n.split(".")[1] in idle else grad(n, dt)
            for n, dt in zip(ctx.names, ctx.param_dtypes))


_MPI_HOOKS = []


def _end_job_on_uncaught_errors():
    """Under ep="mpi" an exception that escapes on one process would leave the others waiting for it (in a
    collective, or for its rows in a step) while its own exit waits for them in MPI_Finalize. An uncaught
    exception, in the main thread or any other, ends the whole job instead: the traceback as usual, then
    one line naming this process and the cause, then MPI_Abort (mpirun stops every process). Installed once,
    in front of whatever hooks were there (they still run first)."""
    if _MPI_HOOKS:
        return
    import sys
    import threading
    before, before_thread = sys.excepthook, threading.excepthook

    def end(kind, value, previous, *args):
        try:
            previous(*args)
        finally:
            if kind is not None and not issubclass(kind, SystemExit):
                _core.mpi_abort(f"{kind.__name__}: {value} (uncaught; hpmoe ends the MPI job)", 2)

    def hook(kind, value, tb):
        end(kind, value, before, kind, value, tb)

    def thread_hook(args):
        end(args.exc_type, args.exc_value, before_thread, args)

    sys.excepthook = hook
    threading.excepthook = thread_hook
    _MPI_HOOKS.append((hook, thread_hook))


def _promote_mpi():
    """Open MPI loads its components as plugins that look up libmpi's symbols globally; a Python extension's
    libraries are loaded locally, so make libmpi global first (as mpi4py does)."""
    import ctypes
    import ctypes.util
    for name in ("libmpi.so.40", ctypes.util.find_library("mpi")):
        if name:
            try:
                ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
                return
            except OSError:
                continue


def _array(p):
    """A parameter as NumPy sees it: float arrays as they are; bfloat16 (which NumPy lacks) as its int16
    bits, which the C++ side widens exactly."""
    p = p.detach()
    return p.view(torch.int16).numpy() if p.dtype == torch.bfloat16 else p.numpy()


def _json_of(name, value):
    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must hold only JSON values (numbers, strings, lists, dicts): {e}") from None


def _placement_text(placement):
    if placement is None:
        return ""
    if isinstance(placement, dict):
        return _json_of("placement", placement)
    if isinstance(placement, (str, os.PathLike)) and str(placement):
        return str(placement)
    raise ValueError(f"placement must be None, a spec ('contiguous', 'round-robin', 'random:SEED'), a placement "
                     f"file's path or a placement dict, got {placement!r}")


def _online_text(online):
    if online is None or online is False:
        return ""
    if online is True:
        return "{}"
    if isinstance(online, dict):
        return _json_of("online", online)
    raise ValueError(f"online must be None, True or a dict of settings (every, window, drift, max_changes, "
                     f"slots_per_rank, machine, training), got {online!r}")


class MoELayer(nn.Module):
    """An MoE FFN layer (router, routed experts with SwiGLU, shared experts) run by hpmoe.

    config: a dict (``hpmoe.preset(name)``, ``hpmoe.from_hf_config(path)``) or a preset name;
    ranks: expert-parallel ranks in this process; workers: threads per rank;
    executor: "interleaved" (the single-launch taskflow) or "serialized" (operator by operator),
    both float32 unless dtype="bf16"; or "reference", the fp64 oracle on float64 tensors (call
    ``.double()``), for gradient checks tighter than float32 allows (plain loops: slow);
    ep: "inprocess" (the ranks are thread groups of this process, each holding every expert) or "mpi" (one
    process per rank under ``mpirun -np ranks``: this process holds only its experts, the contiguous block
    ``held_experts``, under their global names ``experts.{e}.*``, and passes only its own tokens; bit for bit
    the in-process layer); mpi_path: with ep="mpi", how rows reach a peer (hpmoe run --mpi-path): "auto"
    (shared memory on one machine, hybrid where machines hold several processes, else network), "shared",
    "network" (messages over TCP), "hybrid";
    dtype: None keeps the config's ("fp32" unless set); "bf16" computes in bf16 with float32
    accumulation (AMX where the CPU has it, AVX512-BF16 or widened to FMA elsewhere). Parameters may
    then be float32 (master weights: rounded to bf16 when packed, gradients float32, the usual mixed
    precision) or bfloat16 (``.bfloat16()``: gradients bfloat16); tokens float32 or bfloat16, the
    output and dx in the tokens' dtype. Within bf16's tolerance of the float64 reference on the same
    rounded values (relative L2 <= 1e-2). As PyTorch modules do, a float32 layer follows its parameters:
    ``.to(torch.bfloat16)`` / ``.bfloat16()`` make it compute in bf16, ``.float()`` back; under
    ``torch.autocast("cpu", dtype=torch.bfloat16)`` it computes in bf16 with its float32 parameters as
    masters and returns bfloat16; ``.half()``, ``.double()`` and other devices are ValueErrors;
    schedule: the interleaved runtime's task order per worker ("critical-path", "fill",
    "rank-rotated", "interleave-wgrad", "ratr"; hpmoe run --policy). Results are bit-identical for all.
    dispatch_dtype: what the dispatch sends tokens to their experts in (hpmoe run --dispatch-dtype):
    None keeps the config's ("layer" unless set), "fp8" (e4m3 with one scale per 128 channels; hidden a
    multiple of 128), "bf16", "fp32". The experts compute on the decoded tokens; every executor,
    "reference" included, applies the same encoding.
    exchange: how tokens travel to their experts (hpmoe run --exchange): None keeps the config's
    ("assignment": a row per token and expert), "rank" (each token once per rank that holds one of its
    experts, the experts' rows gathered there). Same results as "assignment" in fp32; fewer bytes.
    "auto": the one the simulator predicts fastest for this layer at its tokens_per_rank (cpu-local
    machine model, uniform routing, forward + backward); ``exchange_choice`` says which and why.
    ranks_per_node: with exchange="rank", the ranks in each node (must divide ranks): a token crosses to
    another node once, to the rank there with its own local index, which forwards it inside the node and
    sums the node's ranks' outputs (and dx) for it before one row goes back. The source adds each node's
    sum in node order, so the results differ from one node's only in that order (bit for bit those of
    config node_forwarding=False, which sends the same rows straight). None keeps the config's (one node).
    combine_dtype: with exchange="rank", what the combine's sums (and the backward's dx sums) travel in:
    None keeps the config's ("layer"), "bf16" halves their bytes (each rank's and node's sum rounded to bf16:
    results within bf16's tolerance of the float32 path).
    lend_weights: weights instead of tokens (hpmoe run --lend): None keeps the config's ("off"); "auto" lends an
    expert's weights for the step to every rank whose own rows of it would carry more bytes than the weights,
    and those rows stay home; an integer N lends where a rank has N rows or more. Outputs are bit-identical to
    not lending (the per-assignment exchange; the per-rank one to rounding), gradients to rounding (a lent
    copy's weight gradient is summed onto the owner). ``last_exchange`` says what was lent.
    placement: where the experts live (hpmoe run --placement): None (contiguous blocks of experts), a spec
    ("contiguous", "round-robin", "random:SEED"), a placement file's path (``hpmoe plan`` writes them), or the
    same JSON as a dict, replicas included. Over MPI a process holds the experts it owns (an expert's first
    home) and its replicas fetch their weights from the owner every step (``"fetch_replicas": true``, set for
    you: bit for bit the results of held replicas).
    online: online placement (docs/placement.md): None or False (the placement stays), True (the defaults) or
    a dict of settings: "every" (revise every N forwards, 10), "window" (from the last N forwards' loads, 8),
    "drift" (also revise at once after a forward whose slowest rank was more than 1 + drift times what the
    placement was expected to take; 0.25, 0 turns it off), "max_changes" (per revision, 16),
    "slots_per_rank" (experts a rank may hold, 0: one more than the start's largest rank), "machine" (the
    cost model's machine model, "cpu-local"), "training" (replicas pay their gradient reduction, True) and
    "fetch" (replicas fetch their weights from their owner every step; always over MPI, off in process by
    default, where every rank reads the process's one copy: True makes an in-process layer revise as an
    MPI one does, owners staying).
    Every forward's expert load feeds the policy; a revision adds, drops or moves replicas (in process also
    owners: which rank sums an expert's gradient; over MPI owners stay, so parameters and optimizer state
    never move; replicas go anywhere, below their owner too) and is the next forward's
    placement, proven like any other. Every process computes the same revision from the same loads, with no extra communication.
    ``placement`` is the current one, ``revisions`` and ``last_revision`` what the policy did.
    check_finite: the fast executors refuse (ValueError) tokens x and gradients d_out holding NaN or Inf, and
    an output or dx that overflowed, as the CLI and the reference executor do; a bits test that vectorises,
    well under 1% of a step. False skips it (a measured training loop that checks its loss itself).

    check_parameters: the layer keeps its parameters converted and packed between calls, and converts again
    what changed. PyTorch's version counters see in-place updates (optimisers, ``load_state_dict``, ``p.add_``
    under ``no_grad``) but not writes through ``p.data`` or NumPy; True (the default) also hashes every
    parameter's bytes at each forward (at memory speed; ``last_times["forward"]["convert_and_repack"]``
    includes it), so the layer always computes with the parameters as they are at the call. False trusts
    the version counters alone. The tokens are saved for backward as PyTorch's layers save theirs: a backward
    after they changed in place is PyTorch's "modified by an inplace operation" error.

    The module is deep-copyable and picklable (``copy.deepcopy``, ``torch.save(module)``): a copy is a new
    layer with the same arguments and a copy of the parameters (in process only; ep="mpi" refuses).
    """

    def __init__(self, config, ranks=1, workers=1, executor="interleaved", schedule="critical-path",
                 dispatch_dtype=None, exchange=None, ranks_per_node=None, combine_dtype=None, dtype=None,
                 ep="inprocess", mpi_path="auto", check_finite=True, lend_weights=None, placement=None, online=None,
                 check_parameters=True):
        super().__init__()
        self._init_args = dict(config=config, ranks=ranks, workers=workers, executor=executor, schedule=schedule,
                               dispatch_dtype=dispatch_dtype, exchange=exchange, ranks_per_node=ranks_per_node,
                               combine_dtype=combine_dtype, dtype=dtype, ep=ep, mpi_path=mpi_path,
                               check_finite=check_finite, lend_weights=lend_weights, placement=placement,
                               online=online, check_parameters=check_parameters)
        if not isinstance(workers, int) or isinstance(workers, bool) or not 1 <= workers <= 256:
            raise ValueError(f"workers must be an integer from 1 to 256 (threads per rank), got {workers!r}")
        if not isinstance(check_finite, bool):
            raise ValueError(f"check_finite must be True or False, got {check_finite!r}")
        if not isinstance(check_parameters, bool):
            raise ValueError(f"check_parameters must be True or False, got {check_parameters!r}")
        if ep == "mpi":
            _promote_mpi()
        if not isinstance(config, (str, dict)):
            raise ValueError(f"config must be a preset's name (hpmoe.preset_names()) or a layer config dict "
                             f"(hpmoe.preset(...), hpmoe.from_hf_config(...)), got {type(config).__name__} {config!r}")
        cfg = dict(preset(config) if isinstance(config, str) else config)
        if "layer" in cfg or "run" in cfg:  # `hpmoe config`'s two sections: one object of fields
            cfg = json.loads(_core.flat_config(json.dumps(cfg)))
        if dtype is not None:
            if dtype not in ("fp32", "bf16"):
                raise ValueError(f"dtype must be 'fp32' or 'bf16', got {dtype!r}")
            cfg["dtype"] = dtype
        if dispatch_dtype is not None:
            cfg["dispatch_dtype"] = dispatch_dtype
        # exchange="auto": the scheme the simulator predicts fastest for this layer at its tokens_per_rank,
        # on the cpu-local machine model, uniform routing, forward + backward (exchange_choice says why).
        self.exchange_choice = None
        if exchange is not None and exchange != "auto":
            cfg["exchange"] = exchange
        if combine_dtype is not None:
            cfg["combine_dtype"] = combine_dtype
        if lend_weights is not None:
            if lend_weights not in ("off", "auto") and (not isinstance(lend_weights, int) or isinstance(lend_weights, bool)
                                                          or lend_weights < 1):
                raise ValueError(f"lend_weights must be 'off', 'auto' or a count of rows >= 1, got {lend_weights!r}")
            cfg["lend_weights"] = lend_weights
        if ranks_per_node is not None:
            if not isinstance(ranks_per_node, int) or isinstance(ranks_per_node, bool):
                raise ValueError(f"ranks_per_node must be an integer, got {ranks_per_node!r}")
            cfg["ranks_per_node"] = ranks_per_node
        if not isinstance(ranks, int) or ranks < 1:
            raise ValueError(f"ranks must be a positive integer, got {ranks!r}")
        cfg["ranks"] = ranks
        cfg["tokens_per_rank"] = max(1, int(cfg.get("tokens_per_rank", 1)))
        if exchange == "auto":
            chosen, self.exchange_choice = _core.choose_exchange(json.dumps(cfg), "cpu-local", "uniform", True)
            cfg["exchange"] = chosen
        if ep == "mpi":
            _end_job_on_uncaught_errors()
        self._core_args = (int(workers), executor, schedule, ep, mpi_path)
        self._core = _core.Layer(json.dumps(cfg), *self._core_args, _placement_text(placement), _online_text(online))
        self._core.check_finite = check_finite
        self._core.check_parameters = check_parameters
        self.config = json.loads(self._core.config_json)
        # .to(torch.bfloat16) / .bfloat16() switch a float32 layer to bf16 compute (and .float() back);
        # a layer made with dtype="bf16" keeps computing in bf16 whatever its parameters' dtype.
        self._switched_to_bf16 = False
        self._autocast_core = None  # under torch.autocast("cpu", torch.bfloat16): a bf16 twin, made on first use
        self.executor = executor
        self.ep = ep
        self.rank = self._core.rank  # over MPI: this process's rank; in process: 0
        H, I, E = self.config["hidden"], self.config["expert_inter"], self.config["routed_experts"]
        self.gate = nn.Linear(H, E, bias=False)
        if self.config["expert_bias"]:
            self.gate.register_buffer("e_score_correction_bias", torch.zeros(E))
        if ep == "mpi":  # only this process's experts, under their global indices (experts.{e}.*)
            self.held_experts = list(self._core.held_experts)
            self.experts = nn.ModuleDict({str(e): SwiGLU(H, I) for e in self.held_experts})
        else:
            self.held_experts = list(range(E))
            self.experts = nn.ModuleList([SwiGLU(H, I) for _ in range(E)])
        shared = self.config["shared_experts"]
        if shared > 0:
            self.shared_experts = SwiGLU(H, shared * (self.config["shared_inter"] or I))
        self.last_load = None  # [ranks, experts] kept rows of the last forward
        self.last_losses = None  # Losses(aux, z) of the last forward
        # Seconds by part of the last forward (and, once it ran, its backward): {"forward": {"convert_and_repack",
        # "router", "compile", "verify", "prepare", "launch", ...}, "backward": {..., "gradients_to_hf"}};
        # "launch" is the layer's own work, the rest the host's. Empty for executor="reference".
        self.last_times = None
        # What the last step's exchange moved: {"forward_put_bytes", "backward_put_bytes", "lent_experts",
        # "forward_lent_bytes", "backward_lent_bytes"} (the fast executors; over MPI this process's rank).
        self.last_exchange = None

    @property
    def placement(self):
        """The placement the next forward runs on, as a placement file holds it (a dict)."""
        return json.loads(self._core.placement_json)

    @property
    def revisions(self):
        """How many times the online policy changed the placement."""
        return self._core.revisions

    @property
    def last_revision(self):
        """The online policy's last change: {"step" (the forward after which it was made), "added", "dropped",
        "moved" (replicas), "bytes_moved" (what the change itself moved; fetched replicas pay every step
        instead)}, or None."""
        return self._core.last_revision

    def _copy_args(self):
        # A copy starts from the placement this layer has now (an online policy's revisions included); the
        # policy's window of recent loads starts empty.
        args = dict(self._init_args)
        if args["placement"] is not None or args["online"]:
            args["placement"] = self.placement
        return args

    def __deepcopy__(self, memo):
        if self.ep == "mpi":
            raise ValueError("an hpmoe.MoELayer with ep='mpi' cannot be copied: each copy would be another set "
                             "of MPI ranks; copy its state_dict() instead")
        twin = MoELayer(**self._copy_args())
        if self._switched_to_bf16:  # made float32, then .bfloat16(): the copy too
            twin.bfloat16()
        twin.load_state_dict(copy.deepcopy(self.state_dict(), memo))
        twin.train(self.training)
        return twin

    def __reduce__(self):
        if self.ep == "mpi":
            raise ValueError("an hpmoe.MoELayer with ep='mpi' cannot be pickled; save its state_dict() instead")
        return (_rebuild, (self._copy_args(), self.state_dict(), self.training, self._switched_to_bf16))

    @property
    def gate_bias(self):
        return getattr(self.gate, "e_score_correction_bias", None)

    def _twin_core(self, dtype):
        """An engine for the same layer in `dtype`, on the placement this layer has now (an online policy's
        window of recent loads starts empty there)."""
        cfg = dict(self.config, dtype=dtype)
        core = _core.Layer(json.dumps(cfg), *self._core_args, _placement_text(self.placement),
                           _online_text(self._init_args["online"]))
        core.check_finite = self._core.check_finite
        core.check_parameters = self._core.check_parameters
        return core

    def _apply(self, fn, *args, **kwargs):
        """nn.Module.to / .bfloat16() / .float() / .double() / .cuda() all come here. What this layer computes
        in follows its parameters, as a PyTorch module's does: bfloat16 parameters make a float32 layer compute
        in bf16, float32 ones bring it back; other dtypes and devices are refused here, at the call that asks
        for them, before anything changed."""
        # What fn does to a tensor like the parameters (a dtype change, a move, or nothing: .cpu(), .to("cpu")).
        current = next((p.dtype for p in self.parameters() if p.is_floating_point()), torch.float32)
        probe = fn(torch.zeros(1, dtype=current))
        name = f"hpmoe.MoELayer(executor={self.executor!r})"
        if probe.device.type != "cpu":
            raise ValueError(f"{name} runs on the CPU: it cannot move to {probe.device} (keep it on the CPU, or use "
                             f"a GPU MoE layer there)")
        allowed = (torch.float64,) if self.executor == "reference" else (torch.float32, torch.bfloat16)
        if probe.dtype not in allowed:
            fix = ("call .double() on it" if self.executor == "reference"
                   else "use .bfloat16() (bf16 compute) or .float() (float32), or executor='reference' for float64")
            raise ValueError(f"{name} cannot hold {probe.dtype} parameters: {fix}")
        if self.executor != "reference" and probe.dtype != torch.float32 and self.ep == "mpi" \
                and self.config["dtype"] == "fp32":
            raise ValueError(f"{name} with ep='mpi' cannot change its dtype after it was made (every process would "
                             f"have to rebuild its engine at once): make it with dtype='bf16'")
        result = super()._apply(fn, *args, **kwargs)
        if self.executor != "reference" and probe.dtype != current:
            if probe.dtype == torch.bfloat16 and self.config["dtype"] == "fp32":
                self._core = self._twin_core("bf16")
                self.config = json.loads(self._core.config_json)
                self._switched_to_bf16 = True
            elif probe.dtype == torch.float32 and self._switched_to_bf16:
                self._core = self._twin_core("fp32")
                self.config = json.loads(self._core.config_json)
                self._switched_to_bf16 = False
        return result

    def _core_for_this_call(self):
        """The engine a forward runs on: the layer's own, or under torch.autocast("cpu", torch.bfloat16) a
        float32 layer's bf16 twin (bf16 compute, the float32 parameters as masters, output in bfloat16)."""
        if (self.executor != "reference" and self.config["dtype"] == "fp32" and torch.is_autocast_cpu_enabled()
                and torch.get_autocast_cpu_dtype() == torch.bfloat16):
            if self.ep == "mpi":
                raise ValueError("hpmoe.MoELayer with ep='mpi' cannot follow torch.autocast (every process would "
                                 "have to build a bf16 engine at once): make it with dtype='bf16'")
            if self._autocast_core is None:
                self._autocast_core = self._twin_core("bf16")
            return self._autocast_core, torch.bfloat16
        return self._core, None

    def forward(self, x):
        H = self.config["hidden"]
        core, autocast_dtype = self._core_for_this_call()
        if self.executor == "reference":
            dtypes, fix = (torch.float64,), "call .double() on the module"
        elif self.config["dtype"] == "bf16" or autocast_dtype is not None:
            dtypes, fix = (torch.bfloat16, torch.float32), "call .bfloat16() or .float() on the module"
        else:
            dtypes, fix = (torch.float32,), "call .float() on the module, or make it with dtype='bf16'"
        takes = " or ".join(str(d) for d in dtypes)
        name = f"hpmoe.MoELayer(executor={self.executor!r}, dtype={self.config['dtype']!r})"
        if not isinstance(x, torch.Tensor) or x.dtype not in dtypes or x.device.type != "cpu":
            raise ValueError(f"{name} takes {takes} CPU tensors, got "
                             f"{getattr(x, 'dtype', type(x))} on {getattr(x, 'device', '?')}")
        named = list(self.named_parameters())  # once: walking the module tree costs ~0.2 ms at 50 parameters
        for n, p in named:
            if p.dtype not in dtypes:
                raise ValueError(f"parameter '{n}' is {p.dtype}; {name} needs {takes} parameters ({fix})")
        if x.dim() < 1 or x.shape[-1] != H:
            raise ValueError(f"hpmoe.MoELayer needs inputs of shape [..., {H}] (hidden {H}), got {list(x.shape)}")
        flat = x.reshape(-1, H).contiguous()
        out, aux, z = _Function.apply(self, core, autocast_dtype, [n for n, _ in named], flat,
                                      *[p.contiguous() for _, p in named])
        self.last_losses = Losses(aux.detach(), z.detach())
        return out.reshape(x.shape)
