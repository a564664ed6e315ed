"""hpmoe's layer written in plain PyTorch autograd, apart from the C++: the
reference the tests, the benchmark and the training example compare against.

    y = hpmoe.reference.moe(config, x, router, experts, shared, bias, ranks)

router: [E, H]; experts: E objects with gate_proj, up_proj, down_proj, each
an nn.Linear or an [out, in] weight (Hugging Face's layout); shared: the same
or None; bias: the aux-loss-free selection bias [E] or None. It follows the
configuration: softmax or sigmoid scores, group-limited routing, selection
bias, normalised top-k weights, route scale, and capacity (per rank, the
lowest weights dropped). The balancing losses are not part of it.

ReferenceMoE is the same as an nn.Module with MoELayer's parameter names.
"""
import math

import torch
from torch import nn
from torch.nn import functional as F


def _proj(p, x):
    return F.linear(x, p) if isinstance(p, torch.Tensor) else p(x)


def swiglu(mlp, x):
    """down_proj(silu(gate_proj(x)) * up_proj(x))."""
    return _proj(mlp.down_proj, F.silu(_proj(mlp.gate_proj, x)) * _proj(mlp.up_proj, x))


def route(config, x, router, bias=None, ranks=1):
    """(expert index [N, K], weight [N, K]) of every token, dropped assignments weighted 0."""
    c = config
    E, K = c["routed_experts"], c["top_k"]
    logits = x @ router.t()
    scores = logits.softmax(-1) if c["scoring"] == "softmax" else logits.sigmoid()
    sel = scores.detach()
    if bias is not None:
        sel = sel + bias
    if c["groups"] > 1:  # DeepSeek: a group's score is its best expert, or its best two with the bias
        g = sel.view(x.shape[0], c["groups"], -1)
        top = g.topk(2 if bias is not None and g.shape[-1] > 1 else 1, dim=-1).values.sum(-1)
        keep = top.topk(c["groups_kept"], dim=-1).indices
        mask = torch.zeros_like(top, dtype=torch.bool).scatter_(1, keep, True)
        sel = sel.masked_fill(~mask.repeat_interleave(E // c["groups"], dim=1), float("-inf"))
    idx = sel.topk(K, dim=-1).indices
    w = scores.gather(1, idx)
    if c["normalize_topk"]:
        w = w / w.sum(-1, keepdim=True)
    w = w * c["route_scale"]
    if c["capacity_factor"] > 0:  # per rank and expert at most `cap` assignments; the lowest weights drop
        T = x.shape[0] // ranks
        cap = math.ceil(c["capacity_factor"] * T * K / E)
        kept = torch.ones_like(w)
        flat_idx, flat_w = idx.reshape(-1), w.detach().reshape(-1)
        for r in range(ranks):
            for e in range(E):
                a = [i for i in range(r * T * K, (r + 1) * T * K) if flat_idx[i] == e]
                if len(a) > cap:
                    a.sort(key=lambda i: -float(flat_w[i]))  # stable: ties keep (token, k) order
                    for i in a[cap:]:
                        kept.view(-1)[i] = 0
        w = w * kept
    return idx, w


def moe(config, x, router, experts, shared=None, bias=None, ranks=1, load=None):
    """The layer's output [N, H]; `load`, a list, receives the rows each expert computed."""
    idx, w = route(config, x, router, bias, ranks)
    y = torch.zeros_like(x)
    for e, mlp in enumerate(experts):
        rows, slot = (idx == e).nonzero(as_tuple=True)
        if load is not None:
            load.append(rows.numel())
        if rows.numel():
            y = y.index_add(0, rows, (swiglu(mlp, x[rows]) * w[rows, slot].unsqueeze(1)).to(y.dtype))  # autocast: bf16 products
    if shared is not None:
        y = y + swiglu(shared, x)
    return y


class SwiGLU(nn.Module):
    """One expert's MLP with Hugging Face's names: down_proj(silu(gate_proj(x)) * up_proj(x))."""

    def __init__(self, hidden, inter):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return swiglu(self, x)


class ReferenceMoE(nn.Module):
    """The layer as a plain nn.Module, with hpmoe.MoELayer's parameter names (so state dicts move
    between them). With expert_bias, training steps update the bias as hpmoe does:
    bias += rate * sign(mean load - load), in fp32."""

    def __init__(self, config, ranks=1):
        super().__init__()
        self.config, self.ranks = config, ranks
        H, I, E = config["hidden"], config["expert_inter"], config["routed_experts"]
        self.gate = nn.Linear(H, E, bias=False)
        if config["expert_bias"]:
            self.gate.register_buffer("e_score_correction_bias", torch.zeros(E))
        self.experts = nn.ModuleList([SwiGLU(H, I) for _ in range(E)])
        if config["shared_experts"] > 0:
            self.shared_experts = SwiGLU(H, config["shared_experts"] * (config["shared_inter"] or I))
        self.last_load = None

    def forward(self, x):
        bias = getattr(self.gate, "e_score_correction_bias", None)
        load = []
        y = moe(self.config, x, self.gate.weight, self.experts, getattr(self, "shared_experts", None), bias,
                self.ranks, load)
        self.last_load = torch.tensor(load, dtype=torch.long)
        if bias is not None and self.training and torch.is_grad_enabled():
            with torch.no_grad():  # in fp32, as hpmoe updates it, whatever the model's dtype
                lf, b = self.last_load.float(), bias.float()
                b += self.config["bias_update_rate"] * torch.sign(lf.mean() - lf)
                bias.copy_(b)
        return y
