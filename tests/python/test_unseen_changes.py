"""Changes the module's version counters do not see (issue 58, class 3): writes through p.data (an EMA or
target-network update, mul_, copy_) and NumPy in-place writes reach the next forward; tokens changed in place
between forward and backward are PyTorch's own error, never wrong router or shared-expert gradients."""
import pytest
import torch

import hpmoe
from test_module import small


def fresh_like(module, **kwargs):
    m = hpmoe.MoELayer(module.config, ranks=module.config["ranks"], workers=1, **kwargs)
    m.load_state_dict(module.state_dict())
    return m


WRITES = {
    "data_mul": lambda m: m.experts[3].down_proj.weight.data.mul_(0.5),
    "data_copy": lambda m: m.gate.weight.data.copy_(torch.randn_like(m.gate.weight)),
    "ema": lambda m: [p.data.mul_(0.9).add_(0.1 * torch.ones_like(p)) for p in m.parameters()],
    "numpy": lambda m: m.shared_experts.up_proj.weight.detach().numpy().__imul__(-1.0),
    # every word's sign bit flipped: a hash whose lanes only multiply and add lets such changes cancel in pairs
    "data_neg": lambda m: [p.data.neg_() for p in m.parameters()],
    "numpy_expert": lambda m: m.experts[0].gate_proj.weight.detach().numpy().__iadd__(0.25),
}


@pytest.mark.parametrize("write", sorted(WRITES))
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_untracked_writes_reach_the_next_forward(write, dtype):
    torch.manual_seed(31)
    moe = hpmoe.MoELayer(small(shared_experts=1), ranks=2, workers=1, dtype=dtype)
    x = torch.randn(32, 48)
    moe(x)  # converted and packed once
    versions = [p._version for p in moe.parameters()]
    with torch.no_grad():
        WRITES[write](moe)
    assert [p._version for p in moe.parameters()] == versions, "the write was seen by the version counters"
    y, ref = moe(x), fresh_like(moe, dtype=dtype)(x)
    assert torch.equal(y, ref), f"{write}: the module computed with stale weights"


def test_without_the_check_the_version_counters_alone_decide():
    torch.manual_seed(32)
    moe = hpmoe.MoELayer(small(), ranks=2, workers=1, check_parameters=False)
    x = torch.randn(32, 48)
    before = moe(x)
    moe.gate.weight.data.mul_(3.0)
    assert torch.equal(moe(x), before)  # documented: False trusts the counters (p.data is not seen)
    with pytest.raises(ValueError, match="check_parameters"):
        hpmoe.MoELayer(small(), check_parameters="yes")


@pytest.mark.parametrize("executor", ["interleaved", "serialized"])
def test_tokens_changed_in_place_before_backward_are_refused(executor):
    torch.manual_seed(33)
    moe = hpmoe.MoELayer(small(shared_experts=1), ranks=2, workers=1, executor=executor)
    a = torch.randn(32, 48, requires_grad=True)
    h = a * 1.0  # an activation buffer the model reuses
    y = moe(h)
    with torch.no_grad():
        h += 1.0
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    # The residual pattern on a fresh activation is fine: h + moe(h) writes a new tensor.
    h2 = a * 1.0
    (h2 + moe(h2)).sum().backward()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_untracked_writes_after_optimizer_steps_reach_the_next_forward(dtype):
    """An optimizer step moves every version counter, and the module then skips hashing what it converts anyway;
    writes the counters miss in the steps after (the first without a hash to compare, then with one) are still
    seen: every forward of a training run mixing both computes what a fresh module does."""
    torch.manual_seed(34)
    moe = hpmoe.MoELayer(small(shared_experts=1), ranks=2, workers=1, dtype=dtype)
    opt = torch.optim.SGD(moe.parameters(), lr=0.05)
    plan = ["sgd", "data_mul", "data_mul", "sgd", "sgd", "numpy_expert", "none", "data_neg", "sgd", "data_copy"]
    for i, what in enumerate(plan):
        x = torch.randn(32, 48)
        y = moe(x)
        assert torch.equal(y, fresh_like(moe, dtype=dtype)(x)), f"step {i} (after {plan[i - 1] if i else 'none'})"
        y.pow(2).mean().backward()
        with torch.no_grad():
            if what == "sgd":
                opt.step()
            elif what != "none":
                WRITES[what](moe)
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("where", ["first", "last"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weight_between_calls_is_named(dtype, where, bad):
    """A weight made NaN or Inf between calls, once the layer is made, is refused naming the parameter: at its first
    element and its last (expert_inter 41, and 42 for bf16, which needs it even: arrays that are not a multiple of the
    content hash's 128-byte blocks, so the last element lies past them), from float32 parameters and from a bf16
    layer's bfloat16 ones (checked on their bits). The finite value put back is taken again, bit for bit."""
    torch.manual_seed(5)
    cfg = hpmoe.with_fields(hpmoe.preset("mixtral-8x7b"), hidden=48, expert_inter=41 if dtype == "fp32" else 42,
                            routed_experts=8, top_k=2, aux_loss_coef=0, z_loss_coef=0)
    m = hpmoe.MoELayer(cfg, ranks=2)
    dt = torch.float32
    if dtype == "bf16":
        m, dt = m.bfloat16(), torch.bfloat16
    x = torch.randn(16, 48, dtype=dt)
    with torch.no_grad():
        before = m(x)
        w = m.experts[5].down_proj.weight
        at = (0, 0) if where == "first" else (w.shape[0] - 1, w.shape[1] - 1)
        kept = w[at].item()
        w[at] = bad
        with pytest.raises(ValueError, match=r"experts\.5\.down_proj\.weight.*NaN or Inf"):
            m(x)
        w[at] = kept
        assert torch.equal(m(x), before)
