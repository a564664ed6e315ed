"""hpmoe.MoELayer(ep="mpi") under mpirun: each process holds only its experts and its own tokens, and its output,
dx and gradients (its experts', and the replicated router's, shared experts' and bias's) are bit for bit those of
the same layer run in one process with every rank in it. Run by tests/python/test_mpi.py:

    mpirun -np 2 python3 tests/python/mpi_module.py [interleaved|serialized] [LEND|online]

With LEND (lend_weights), hot experts' weights are lent to the other process for each step: a process computes its
own rows of them on weights that came by puts (it holds only its own experts), refreshed every step after the
optimizer's update. With online, both layers revise their placement after every forward (online placement): each
process computes the same revision from the same loads, its new replicas fetch their weights from their owner, and
every step stays bit for bit the in-process layer's, which revises alike.
"""
import sys

import torch

import hpmoe


def run(module, x, d_out):
    x = x.clone().requires_grad_(True)
    module.zero_grad()
    y = module(x)
    y.backward(d_out)
    return y.detach(), x.grad.clone(), {n: p.grad.clone() if p.grad is not None else None
                                         for n, p in module.named_parameters()}


def main():
    executor = sys.argv[1] if len(sys.argv) > 1 else "interleaved"
    mode = sys.argv[2] if len(sys.argv) > 2 else None
    lend = int(mode) if mode and mode != "online" else None
    online = dict(every=1, window=1, drift=0, fetch=True) if mode == "online" else None
    P, T = 2, 24
    cfg = hpmoe.with_fields(hpmoe.preset("mixtral-8x7b"), hidden=48, expert_inter=40, routed_experts=8, top_k=2,
                            shared_experts=1, shared_inter=32, scoring="sigmoid", normalize_topk=True,
                            expert_bias=True, aux_loss_coef=0.01, z_loss_coef=0.001)
    sharded = hpmoe.MoELayer(cfg, ranks=P, workers=1, executor=executor, ep="mpi", lend_weights=lend, online=online)
    me = sharded.rank
    whole = hpmoe.MoELayer(cfg, ranks=P, workers=1, executor=executor, lend_weights=lend, online=online)
    torch.manual_seed(0)  # the same on every process
    with torch.no_grad():
        for p in whole.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
        whole.gate_bias.copy_(torch.randn(8) * 0.1)
    own = sharded.state_dict().keys()
    experts = sorted({int(k.split(".")[1]) for k in own if k.startswith("experts.")})
    assert experts == list(range(me * 4, me * 4 + 4)), (me, experts)
    sharded.load_state_dict({k: v for k, v in whole.state_dict().items() if k in own})
    opt_s = torch.optim.SGD(sharded.parameters(), lr=0.1)
    opt_w = torch.optim.SGD(whole.parameters(), lr=0.1)
    mine = slice(me * T, (me + 1) * T)
    for step in range(3):  # training steps: the repack after each update and the bias update stay in step
        x, d_out = torch.randn(P * T, 48), torch.randn(P * T, 48)
        y, dx, g = run(sharded, x[mine], d_out[mine])
        yw, dxw, gw = run(whole, x, d_out)
        assert torch.equal(y, yw[mine]), f"rank {me} step {step}: out differs"
        assert torch.equal(dx, dxw[mine]), f"rank {me} step {step}: dx differs"
        for n, grad in g.items():
            assert (grad is None) == (gw[n] is None) and (grad is None or torch.equal(grad, gw[n])), \
                f"rank {me} step {step}: gradient of {n} differs"
        assert torch.equal(sharded.gate_bias, whole.gate_bias), f"rank {me} step {step}: bias differs"
        assert torch.equal(sharded.last_losses.aux, whole.last_losses.aux)
        if lend:
            assert whole.last_exchange["lent_experts"] > 0, f"step {step}: nothing was lent"
        assert sharded.placement["experts_of_rank"] == whole.placement["experts_of_rank"], \
            f"rank {me} step {step}: the online revisions differ"
        opt_s.step()
        opt_w.step()
    try:
        hpmoe.MoELayer(hpmoe.with_fields(cfg, ranks=P + 1), ranks=P + 1, ep="mpi")
        raise AssertionError("a layer of more ranks than processes was accepted")
    except ValueError as e:
        assert "one process per rank" in str(e), e
    try:  # every process must pass the same number of tokens: one clear error on each, no hang
        sharded(torch.randn(T if me == 0 else T - 8, 48))
        raise AssertionError("processes with different token counts were accepted")
    except ValueError as e:
        assert "the same number of tokens" in str(e), e
    lent = f", lending at {lend} rows" if lend else ""
    if online:
        assert whole.revisions > 0 and sharded.revisions == whole.revisions, "no online revision"
        assert sharded.placement.get("fetch_replicas") is True
        lent = f", {whole.revisions} online revisions: {whole.placement['experts_of_rank']}"
    print(f"rank {me}: {executor}: 3 steps bit-identical to the in-process layer ({len(experts)} experts held{lent})",
          flush=True)


if __name__ == "__main__":
    main()
