"""The module's dtype conventions (issue 61 item 3): .to(torch.bfloat16) / .bfloat16() / .float() switch the
layer's compute dtype, torch.autocast gives bf16 compute with float32 masters, and what the layer cannot take is
refused at the call."""
import copy
import pickle

import pytest
import torch

import hpmoe
from test_module import run, small


def test_to_bfloat16_makes_the_layer_compute_in_bf16_and_float_brings_it_back():
    """A PyTorch module computes in the dtype of its parameters: .to(torch.bfloat16) / .bfloat16() switch a float32
    hpmoe layer to bf16 compute (bit for bit a layer made with dtype="bf16" holding the same bfloat16 parameters,
    over steps whose tokens, routing and weights change), and .float() brings it back (bit for bit a fresh float32
    layer on the same values)."""
    torch.manual_seed(11)
    cfg = small(top_k=2, shared_experts=1)
    moe = hpmoe.MoELayer(cfg, ranks=2, workers=1)
    moe.to(torch.bfloat16)
    assert moe.config["dtype"] == "bf16" and all(p.dtype == torch.bfloat16 for p in moe.parameters())
    twin = hpmoe.MoELayer(cfg, ranks=2, workers=1, dtype="bf16").bfloat16()
    twin.load_state_dict(moe.state_dict())
    opt_m, opt_t = torch.optim.SGD(moe.parameters(), lr=0.5), torch.optim.SGD(twin.parameters(), lr=0.5)
    for step in range(3):
        x, d_out = torch.randn(20 + 4 * step, 48).bfloat16(), torch.randn(20 + 4 * step, 48).bfloat16()
        rm, rt = run(moe, x, d_out), run(twin, x, d_out)
        assert rm[0].dtype == torch.bfloat16 and torch.equal(rm[0], rt[0]) and torch.equal(rm[1], rt[1]), step
        assert all(torch.equal(rm[2][n], rt[2][n]) for n in rm[2]), step
        opt_m.step(), opt_t.step()
    moe.float()
    assert moe.config["dtype"] == "fp32" and all(p.dtype == torch.float32 for p in moe.parameters())
    fresh = hpmoe.MoELayer(cfg, ranks=2, workers=1)
    fresh.load_state_dict(moe.state_dict())
    x, d_out = torch.randn(24, 48), torch.randn(24, 48)
    rm, rf = run(moe, x, d_out), run(fresh, x, d_out)
    assert rm[0].dtype == torch.float32 and torch.equal(rm[0], rf[0]) and torch.equal(rm[1], rf[1])
    assert all(torch.equal(rm[2][n], rf[2][n]) for n in rm[2])
    # A move that changes no dtype changes nothing; a container's .to() reaches the layer.
    moe.bfloat16()
    moe.to("cpu"), moe.cpu()
    assert moe.config["dtype"] == "bf16" and moe(torch.randn(4, 48).bfloat16()).dtype == torch.bfloat16
    model = torch.nn.Sequential(torch.nn.Linear(48, 48), moe)
    model.float()
    assert moe.config["dtype"] == "fp32" and model(torch.randn(4, 48)).dtype == torch.float32
    model.to(torch.bfloat16)
    assert moe.config["dtype"] == "bf16"
    # A copy and a pickle keep the switch.
    assert copy.deepcopy(moe).config["dtype"] == "bf16"
    assert pickle.loads(pickle.dumps(moe)).config["dtype"] == "bf16"


def test_autocast_computes_in_bf16_with_float32_masters():
    """torch.autocast("cpu", dtype=torch.bfloat16) around a float32 layer: bf16 compute with the float32
    parameters as masters (float32 gradients), the output in bfloat16 as autocast's matmuls give it; bit for bit a
    layer made with dtype="bf16" on the same float32 parameters, its output rounded to bfloat16. Outside the
    autocast the layer is float32 again."""
    torch.manual_seed(12)
    cfg = small(top_k=2)
    moe = hpmoe.MoELayer(cfg, ranks=2, workers=1)
    mixed = hpmoe.MoELayer(cfg, ranks=2, workers=1, dtype="bf16")
    mixed.load_state_dict(moe.state_dict())
    for step in range(2):
        x, d_out = torch.randn(16, 48), torch.randn(16, 48).bfloat16().float()  # d_out exact in bf16
        with torch.autocast("cpu", dtype=torch.bfloat16):
            xa = x.clone().requires_grad_(True)
            moe.zero_grad()
            y = moe(xa)
        assert y.dtype == torch.bfloat16 and moe.config["dtype"] == "fp32"
        y.backward(d_out.bfloat16())
        rm = run(mixed, x, d_out)
        assert torch.equal(y.detach(), rm[0].bfloat16()), step
        assert xa.grad.dtype == torch.float32 and torch.equal(xa.grad, rm[1]), step
        grads = {n: p.grad for n, p in moe.named_parameters()}
        assert all(g is None or (g.dtype == torch.float32 and torch.equal(g, rm[2][n])) for n, g in grads.items()), step
        with torch.no_grad():  # an update between steps: both engines see it
            for p, q in zip(moe.parameters(), mixed.parameters()):
                p.mul_(0.9), q.mul_(0.9)
    assert moe(torch.randn(8, 48)).dtype == torch.float32


def test_dtypes_and_devices_the_layer_cannot_take_are_refused_at_the_call():
    """.half(), .double() (outside executor='reference') and a move off the CPU are ValueErrors naming what to do
    instead, raised before anything changed: the parameters keep their dtype and the layer keeps working."""
    moe = hpmoe.MoELayer(small(), ranks=2)
    with pytest.raises(ValueError, match=r"\.bfloat16\(\)"):
        moe.half()
    with pytest.raises(ValueError, match="reference"):
        moe.double()
    with pytest.raises(ValueError, match="CPU"):
        moe.to("meta")
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in moe.parameters())
    assert moe(torch.randn(4, 48)).shape == (4, 48)
