"""hpmoe.MoELayer kept over several training steps whose tokens, token counts, routing and weights change, for
every exchange: each step bit for bit a module built fresh for that step on the same parameters (issue 58,
class 1: the per-rank exchange stopped at its second step whose routing differed; tests that build one layer
per step could not see it)."""
import pytest
import torch

import hpmoe
from test_module import small

VARIANTS = {
    "assignment": dict(ranks=2),
    "assignment_serialized": dict(ranks=2, executor="serialized"),
    "rank": dict(ranks=2, exchange="rank"),
    "rank_bf16": dict(ranks=2, exchange="rank", dtype="bf16"),
    "node": dict(ranks=4, exchange="rank", ranks_per_node=2),
    "node_bf16_sums": dict(ranks=4, exchange="rank", ranks_per_node=2, combine_dtype="bf16"),
    "lend_rank": dict(ranks=2, exchange="rank", lend_weights=1),
    "replicas_rank": dict(ranks=3, exchange="rank",
                          placement={"experts_of_rank": [[0, 1, 2, 5], [3, 4, 5, 0], [6, 7, 1]], "replicas": True}),
    # bfloat16 parameters (.bfloat16()): the optimizer's new weights packed from their bits as they are
    "rank_bf16_params": dict(ranks=2, exchange="rank", bf16_params=True),
    "node_bf16_params": dict(ranks=4, exchange="rank", ranks_per_node=2, bf16_params=True),
}

# Tokens per step: the count changes, and so (new tokens, new weights, a shifted router) does the routing.
TOKENS = [24, 60, 8, 36, 12]


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_step_matches_a_fresh_module(name):
    args = dict(VARIANTS[name])
    ranks = args.pop("ranks")
    dtype = torch.bfloat16 if args.pop("bf16_params", False) else torch.float32
    torch.manual_seed(21)
    cfg = small(shared_experts=1, top_k=3)
    kept = hpmoe.MoELayer(cfg, ranks=ranks, workers=1, **args).to(dtype)
    opt = torch.optim.SGD(kept.parameters(), lr=0.5)
    for step, tokens in enumerate(TOKENS):
        fresh = hpmoe.MoELayer(cfg, ranks=ranks, workers=1, **args).to(dtype)
        fresh.load_state_dict(kept.state_dict())
        x = (torch.randn(tokens * ranks, 48) * (1 + step)).to(dtype)  # larger tokens: the router's choice moves further
        xk, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
        yk, yf = kept(xk), fresh(xf)
        assert torch.equal(yk, yf), f"step {step}: output"
        assert torch.equal(kept.last_load, fresh.last_load), f"step {step}: load"
        (yk * yk).mean().backward()
        (yf * yf).mean().backward()
        assert torch.equal(xk.grad, xf.grad), f"step {step}: dx"
        for (n, p), q in zip(kept.named_parameters(), fresh.parameters()):
            assert (p.grad is None) == (q.grad is None), f"step {step}: {n}"
            assert p.grad is None or torch.equal(p.grad, q.grad), f"step {step}: {n}"
        with torch.no_grad():  # a router update that moves the routing, besides the optimizer's
            kept.gate.weight.add_(torch.randn_like(kept.gate.weight))
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert kept._core.engines == 1


def test_online_placement_with_the_rank_exchange_over_steps():
    """online=True revises the placement between steps; with the per-rank exchange every step still equals a
    fresh module on the placement the kept one ran (its ``placement`` before the forward)."""
    torch.manual_seed(22)
    cfg = small(shared_experts=0, top_k=2)
    kept = hpmoe.MoELayer(cfg, ranks=2, workers=1, exchange="rank", online={"every": 1, "window": 1})
    hot = torch.zeros(48)
    hot[0] = 1.0
    for step, tokens in enumerate([32, 48, 16, 40, 24]):
        placement = kept.placement
        fresh = hpmoe.MoELayer(cfg, ranks=2, workers=1, exchange="rank", placement=placement)
        fresh.load_state_dict(kept.state_dict())
        x = torch.randn(tokens * 2, 48) + 4 * hot * (step % 2)  # every other step most tokens want one expert
        xk, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
        yk, yf = kept(xk), fresh(xf)
        assert torch.equal(yk, yf), f"step {step}"
        yk.sum().backward()
        yf.sum().backward()
        assert torch.equal(xk.grad, xf.grad), f"step {step}"
        with torch.no_grad():
            kept.gate.weight.add_(0.5 * torch.randn_like(kept.gate.weight))
    assert kept.revisions > 0, "the load changed and the policy never revised: the test did not test a revision"
