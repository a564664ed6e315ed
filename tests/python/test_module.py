"""hpmoe.MoELayer against a plain PyTorch MoE (hpmoe.reference, written apart from the C++), and its error paths.

Run: PYTHONPATH=build/python /usr/bin/python3 -m pytest tests/python
"""
import copy
import json
import pickle

import pytest
import torch

import hpmoe


def small(**fields):
    base = hpmoe.with_fields(hpmoe.preset("mixtral-8x7b"), hidden=48, expert_inter=40, routed_experts=8, top_k=2,
                             aux_loss_coef=0, z_loss_coef=0)
    return hpmoe.with_fields(base, **fields)


def reference(module, x):
    """The layer in plain PyTorch (fp32 autograd, hpmoe.reference), from the module's own parameters."""
    return hpmoe.reference.moe(module.config, x, module.gate.weight, module.experts,
                               getattr(module, "shared_experts", None), module.gate_bias, module.config["ranks"])


def rel(a, b):
    return float((a - b).norm() / b.norm())


def run(module, x, d_out):
    x = x.clone().requires_grad_(True)
    module.zero_grad()
    y = module(x)
    y = y[0] if isinstance(y, tuple) else y
    y.backward(d_out)
    grads = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in module.named_parameters()}
    return y.detach(), x.grad.clone(), grads


CASES = {
    "softmax": small(),
    "softmax_normalised_shared": small(normalize_topk=True, shared_experts=1, shared_inter=32, route_scale=1.5),
    "softmax_capacity": small(capacity_factor=1.0, top_k=2),
    "sigmoid_groups_bias": small(scoring="sigmoid", groups=4, groups_kept=2, normalize_topk=True, expert_bias=True,
                                 route_scale=2.5),
}


def check_against_plain_pytorch(name, executor, dtype, tolerance):
    torch.manual_seed(0)
    m = hpmoe.MoELayer(CASES[name], ranks=2, workers=1, executor=executor).to(dtype)
    if m.gate_bias is not None:
        m.gate_bias.copy_(torch.randn(m.config["routed_experts"]) * 0.1)
        m.config["bias_update_rate"] = 0.0  # keep the bias for the reference
    x, d_out = torch.randn(40, 48, dtype=dtype), torch.randn(40, 48, dtype=dtype)
    y, dx, grads = run(m, x, d_out)
    assert y.dtype == dtype and dx.dtype == dtype
    xr = x.clone().requires_grad_(True)
    m.zero_grad()
    yr = reference(m, xr)
    yr.backward(d_out)
    assert rel(y, yr.detach()) <= tolerance
    assert rel(dx, xr.grad) <= tolerance
    for n, p in m.named_parameters():
        if p.grad is not None and p.grad.norm() > 0:
            assert rel(grads[n], p.grad) <= tolerance, n
        else:  # an expert no token reached: no gradient in either
            assert grads[n].norm() == 0, n


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("executor", ["interleaved", "serialized"])
def test_matches_plain_pytorch(name, executor):
    check_against_plain_pytorch(name, executor, torch.float32, 1e-5)


@pytest.mark.parametrize("name", sorted(CASES))
def test_float64_reference_matches_plain_pytorch(name):
    """The fp64 oracle (executor="reference") against the PyTorch MoE in float64: every gradient to 1e-10."""
    check_against_plain_pytorch(name, "reference", torch.float64, 1e-10)


@pytest.mark.parametrize("name", ["softmax_capacity", "sigmoid_groups_bias"])
def test_float64_gradcheck(name):
    """torch.autograd.gradcheck (finite differences) on the fp64 oracle, every input and parameter."""
    torch.manual_seed(3)
    cfg = hpmoe.with_fields(CASES[name], hidden=8, expert_inter=6)
    m = hpmoe.MoELayer(cfg, ranks=2, executor="reference").double()
    if m.gate_bias is not None:
        m.config["bias_update_rate"] = 0.0
    names = [n for n, _ in m.named_parameters()]
    params = [p.detach().clone().requires_grad_(True) for _, p in m.named_parameters()]
    x = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
    f = lambda x, *ps: hpmoe._Function.apply(m, m._core, None, names, x, *ps)[0]  # noqa: E731
    assert torch.autograd.gradcheck(f, (x, *params), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_reference_executor_checks_dtypes():
    m = hpmoe.MoELayer(small(), executor="reference")
    with pytest.raises(ValueError, match="float64"):
        m.double()(torch.randn(4, 48))
    with pytest.raises(ValueError, match="cannot hold torch.float32 parameters: call .double"):
        m.float()  # refused at the call, before anything changed
    m.gate.weight = torch.nn.Parameter(m.gate.weight.float())  # a parameter swapped behind the module's back
    with pytest.raises(ValueError, match="parameter 'gate.weight' is torch.float32"):
        m(torch.randn(4, 48, dtype=torch.float64))


@pytest.mark.parametrize("executor", ["interleaved", "serialized", "reference"])
def test_forwards_in_flight(executor):
    """Two forwards, then the first one's backward: it uses its own forward's state."""
    torch.manual_seed(4)
    m = hpmoe.MoELayer(small(shared_experts=1), ranks=2, executor=executor)
    dt = torch.float64 if executor == "reference" else torch.float32
    m = m.to(dt)
    xa, xb, da = (torch.randn(32, 48, dtype=dt) for _ in range(3))
    alone = run(m, xa, da)
    m.zero_grad()
    a = xa.clone().requires_grad_(True)
    ya, yb = m(a), m(xb.clone().requires_grad_(True))
    ya.backward(da)
    assert torch.equal(ya.detach(), alone[0]) and torch.equal(a.grad, alone[1])
    assert all(torch.equal(p.grad, alone[2][n]) for n, p in m.named_parameters())
    yb.sum().backward()  # the second forward's backward still works


def test_idle_experts_get_no_gradient():
    """An expert no token reached has grad None, as in a PyTorch MoE, so Adam leaves it where it is."""
    torch.manual_seed(5)
    m = hpmoe.MoELayer(small(), ranks=1)
    with torch.no_grad():
        m.gate.weight.zero_()
        m.gate.weight[:2] = 1.0  # every token prefers experts 0 and 1
    x = torch.rand(16, 48)
    m(x).sum().backward()
    assert m.experts[0].up_proj.weight.grad is not None and m.experts[1].down_proj.weight.grad is not None
    assert all(m.experts[e].gate_proj.weight.grad is None for e in range(2, 8))
    assert m.gate.weight.grad is not None


def test_fp8_dispatch_matches_the_encoding_oracle():
    """fp8 dispatch: interleaved = serialized bit for bit; both match the fp64 oracle that encodes the dispatched
    tokens the same way (every gradient to 1e-5), and differ from the unencoded plain-PyTorch layer by fp8's error.
    dy goes back as it is here (grad_dispatch_dtype "layer"): in bf16 (the default under an fp32 layer), the
    oracle's own gates, one fp32 rounding away from the fast path's, can round a product the other way (the C++
    tests hand the oracle the fast path's gates; test_fp8_dispatch_default_sends_dy_in_bf16 below)."""
    torch.manual_seed(5)
    cfg = small(hidden=128, grad_dispatch_dtype="layer")
    a = hpmoe.MoELayer(cfg, ranks=2, workers=2, dispatch_dtype="fp8")
    b = hpmoe.MoELayer(cfg, ranks=2, workers=1, executor="serialized", dispatch_dtype="fp8")
    o = hpmoe.MoELayer(cfg, ranks=2, executor="reference", dispatch_dtype="fp8").double()
    assert a.config["dispatch_dtype"] == "fp8"
    b.load_state_dict(a.state_dict())
    o.load_state_dict({k: v.double() for k, v in a.state_dict().items()})
    x, d_out = torch.randn(64, 128), torch.randn(64, 128)
    ra, rb = run(a, x, d_out), run(b, x, d_out)
    assert torch.equal(ra[0], rb[0]) and torch.equal(ra[1], rb[1])
    assert all(torch.equal(ra[2][n], rb[2][n]) for n in ra[2])
    ro = run(o, x.double(), d_out.double())
    assert rel(ra[0].double(), ro[0]) <= 1e-5 and rel(ra[1].double(), ro[1]) <= 1e-5
    for n in ra[2]:
        if ro[2][n].norm() > 0:
            assert rel(ra[2][n].double(), ro[2][n]) <= 1e-5, n
    assert rel(ra[0], reference(a, x).detach()) > 1e-3  # the unencoded layer: the encoding is really applied
    with pytest.raises(ValueError, match="multiple of 128"):
        hpmoe.MoELayer(small(), dispatch_dtype="fp8")


def test_fp8_dispatch_default_sends_dy_in_bf16():
    """Under an fp32 layer, fp8 dispatch sends dy in bf16 unless asked otherwise: the weight gradients move by
    bf16's rounding (beyond 1e-5 of the fp32-dy layer's, within 1e-2)."""
    torch.manual_seed(6)
    a = hpmoe.MoELayer(small(hidden=128), ranks=2, dispatch_dtype="fp8")
    b = hpmoe.MoELayer(small(hidden=128, grad_dispatch_dtype="layer"), ranks=2, dispatch_dtype="fp8")
    assert a.config["grad_dispatch_dtype"] == "auto"
    b.load_state_dict(a.state_dict())
    x, d_out = torch.randn(64, 128), torch.randn(64, 128)
    ra, rb = run(a, x, d_out), run(b, x, d_out)
    assert torch.equal(ra[0], rb[0])  # the forward is the same
    w = "experts.0.down_proj.weight"
    assert 1e-5 < rel(ra[2][w], rb[2][w]) < 1e-2


def test_rank_exchange_matches_the_assignment_exchange_and_its_serialized_run():
    """exchange="rank" sends each token once per rank and one row per (token, rank) back: the same products as the
    per-assignment exchange added in another order (a token's experts on each rank first), so in fp32 it agrees to
    rounding, and bit for bit with its own serialized run; an unknown exchange is a ValueError."""
    torch.manual_seed(7)
    cfg = small(top_k=3, shared_experts=1)
    a = hpmoe.MoELayer(cfg, ranks=3, workers=2, exchange="rank")
    b = hpmoe.MoELayer(cfg, ranks=3, workers=2)
    s = hpmoe.MoELayer(cfg, ranks=3, workers=1, executor="serialized", exchange="rank")
    assert a.config["exchange"] == "rank" and b.config["exchange"] == "assignment"
    b.load_state_dict(a.state_dict())
    s.load_state_dict(a.state_dict())
    x, d_out = torch.randn(96, 48), torch.randn(96, 48)
    ra, rb, rs = run(a, x, d_out), run(b, x, d_out), run(s, x, d_out)
    assert torch.equal(ra[0], rs[0]) and torch.equal(ra[1], rs[1])
    assert all(torch.equal(ra[2][n], rs[2][n]) for n in ra[2])

    def rel(p, q):
        return float((p - q).norm() / q.norm())

    assert rel(ra[0], rb[0]) < 1e-6 and rel(ra[1], rb[1]) < 1e-6
    assert all(rel(ra[2][n], rb[2][n]) < 1e-5 for n in ra[2])
    with pytest.raises(ValueError, match="exchange"):
        hpmoe.MoELayer(small(), exchange="node")


def test_auto_exchange_runs_the_chosen_scheme_bit_for_bit():
    """exchange="auto" asks the simulator which scheme is faster for this layer at its tokens_per_rank and runs that
    one: the layer computes bit for bit what a layer built with the chosen scheme computes, over steps whose tokens and
    weights change, and exchange_choice names the choice and the other scheme's predicted time."""
    torch.manual_seed(9)
    cfg = dict(small(top_k=3), tokens_per_rank=32)
    auto = hpmoe.MoELayer(cfg, ranks=3, workers=1, exchange="auto")
    chosen = auto.config["exchange"]
    assert chosen in ("assignment", "rank")
    assert auto.exchange_choice.startswith("per assignment" if chosen == "assignment" else "per rank")
    assert ("per rank" if chosen == "assignment" else "per assignment") in auto.exchange_choice
    given = hpmoe.MoELayer(cfg, ranks=3, workers=1, exchange=chosen)
    assert given.exchange_choice is None
    given.load_state_dict(auto.state_dict())
    opt_a, opt_g = torch.optim.SGD(auto.parameters(), lr=0.1), torch.optim.SGD(given.parameters(), lr=0.1)
    for step in range(3):
        x, d_out = torch.randn(24 + 3 * step, 48), torch.randn(24 + 3 * step, 48)
        ra, rg = run(auto, x, d_out), run(given, x, d_out)
        assert torch.equal(ra[0], rg[0]) and torch.equal(ra[1], rg[1]), step
        assert all(torch.equal(ra[2][n], rg[2][n]) for n in ra[2]), step
        opt_a.step(), opt_g.step()


def test_node_exchange_is_the_rank_exchange_bit_for_bit():
    """ranks_per_node forwards each token inside its destination node from one copy sent across, and sums the
    node's ranks' rows on the forwarder before one row returns: outputs and every gradient are bit-identical
    to the same exchange sent straight (node_forwarding False: the source adds a node's rows first, as the
    forwarder would), and within fp32 rounding of one node; a ranks_per_node that does not divide the
    ranks is a ValueError."""
    torch.manual_seed(8)
    cfg = small(top_k=3, shared_experts=1)
    straight = dict(cfg, node_forwarding=False)
    a = hpmoe.MoELayer(cfg, ranks=4, workers=1, exchange="rank", ranks_per_node=2)
    b = hpmoe.MoELayer(straight, ranks=4, workers=1, exchange="rank", ranks_per_node=2)
    one = hpmoe.MoELayer(cfg, ranks=4, workers=1, exchange="rank")
    assert a.config["ranks_per_node"] == 2 and a.config["node_forwarding"] and not b.config["node_forwarding"]
    b.load_state_dict(a.state_dict())
    one.load_state_dict(a.state_dict())
    x, d_out = torch.randn(64, 48), torch.randn(64, 48)
    ra, rb, r1 = run(a, x, d_out), run(b, x, d_out), run(one, x, d_out)
    assert torch.equal(ra[0], rb[0]) and torch.equal(ra[1], rb[1])
    assert all(torch.equal(ra[2][n], rb[2][n]) for n in ra[2])

    def rel(p, q):
        return float((p - q).norm() / q.norm())

    assert rel(ra[0], r1[0]) < 1e-6 and rel(ra[1], r1[1]) < 1e-6
    assert all(rel(ra[2][n], r1[2][n]) < 1e-5 for n in ra[2])
    with pytest.raises(ValueError, match="ranks_per_node"):
        hpmoe.MoELayer(cfg, ranks=4, exchange="rank", ranks_per_node=3)


def test_bf16_combine_halves_the_sums_and_stays_close():
    """combine_dtype="bf16" under exchange="rank": the sums travel in bf16, so the output and dx are within bf16's
    tolerance of the float32 combine (the weight gradients do not see it); interleaved = serialized bit for bit;
    without exchange="rank", or with another dtype name, a ValueError."""
    torch.manual_seed(9)
    cfg = small(top_k=3)
    a = hpmoe.MoELayer(cfg, ranks=4, workers=1, exchange="rank", ranks_per_node=2, combine_dtype="bf16")
    s = hpmoe.MoELayer(cfg, ranks=4, workers=1, exchange="rank", ranks_per_node=2, combine_dtype="bf16",
                       executor="serialized")
    f = hpmoe.MoELayer(cfg, ranks=4, workers=1, exchange="rank", ranks_per_node=2)
    assert a.config["combine_dtype"] == "bf16" and f.config["combine_dtype"] == "layer"
    s.load_state_dict(a.state_dict())
    f.load_state_dict(a.state_dict())
    x, d_out = torch.randn(64, 48), torch.randn(64, 48)
    ra, rs, rf = run(a, x, d_out), run(s, x, d_out), run(f, x, d_out)
    assert torch.equal(ra[0], rs[0]) and torch.equal(ra[1], rs[1])

    def rel(p, q):
        return float((p - q).norm() / q.norm())

    assert 0 < rel(ra[0], rf[0]) < 1e-2 and 0 < rel(ra[1], rf[1]) < 1e-2
    with pytest.raises(ValueError, match="combine_dtype"):
        hpmoe.MoELayer(cfg, ranks=2, combine_dtype="bf16")
    with pytest.raises(ValueError, match="combine_dtype"):
        hpmoe.MoELayer(cfg, ranks=2, exchange="rank", combine_dtype="fp8")


def within_bf16_standards(fast, ref, what):
    """hpmoe's bf16 standard: relative L2 <= 1e-2 and max-abs error <= 2% of the reference's max."""
    fast, ref = fast.double(), ref.double()
    assert rel(fast, ref) <= 1e-2, (what, rel(fast, ref))
    assert float((fast - ref).abs().max()) <= 0.02 * float(ref.abs().max()), what


@pytest.mark.parametrize("params", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("executor", ["interleaved", "serialized"])
def test_bf16_within_the_standards_of_the_float64_reference(params, executor):
    """dtype="bf16": bf16 compute with float32 master parameters (gradients float32) or bfloat16 parameters
    (gradients bfloat16), bfloat16 tokens in and out; the output, dx and every parameter's gradient within the
    bf16 standards of the float64 oracle run on the same bf16-rounded values."""
    torch.manual_seed(3)
    cfg = CASES["softmax_normalised_shared"]
    m = hpmoe.MoELayer(cfg, ranks=2, workers=1, executor=executor, dtype="bf16").to(params)
    assert m.config["dtype"] == "bf16"
    ref = hpmoe.MoELayer(cfg, ranks=2, executor="reference").double()
    ref.load_state_dict({k: v.to(torch.bfloat16).double() for k, v in m.state_dict().items()})
    x, d_out = torch.randn(40, 48).to(torch.bfloat16), torch.randn(40, 48).to(torch.bfloat16)
    y, dx, grads = run(m, x, d_out)
    assert y.dtype == torch.bfloat16 and dx.dtype == torch.bfloat16
    yr, dxr, grads_r = run(ref, x.double(), d_out.double())
    within_bf16_standards(y, yr, "out")
    within_bf16_standards(dx, dxr, "dx")
    for n, p in m.named_parameters():
        assert grads[n].dtype == params, n
        if grads_r[n].norm() > 0:
            within_bf16_standards(grads[n], grads_r[n], n)
    # float32 tokens into the bf16 layer: rounded to bf16 inside, so the same output, in float32
    y32 = m(x.float()).detach()
    assert y32.dtype == torch.float32 and torch.equal(y32.to(torch.bfloat16), y)


def test_bf16_executors_bit_identical_and_dtype_errors():
    torch.manual_seed(4)
    a = hpmoe.MoELayer(small(), ranks=2, dtype="bf16").bfloat16()
    s = hpmoe.MoELayer(small(), ranks=2, dtype="bf16", executor="serialized").bfloat16()
    s.load_state_dict(a.state_dict())
    x, d_out = torch.randn(32, 48).to(torch.bfloat16), torch.randn(32, 48).to(torch.bfloat16)
    ra, rs = run(a, x, d_out), run(s, x, d_out)
    assert torch.equal(ra[0], rs[0]) and torch.equal(ra[1], rs[1])
    assert all(torch.equal(ra[2][n], rs[2][n]) for n in ra[2])
    with pytest.raises(ValueError, match='ep must be "inprocess"'):
        hpmoe.MoELayer(small(), ep="nccl")
    with pytest.raises(ValueError, match="unknown MPI path 'infiniband'"):  # checked whatever the transport
        hpmoe.MoELayer(small(), mpi_path="infiniband")
    with pytest.raises(ValueError, match="dtype must be 'fp32' or 'bf16'"):
        hpmoe.MoELayer(small(), dtype="fp16")
    with pytest.raises(ValueError, match="takes torch.bfloat16 or torch.float32 CPU tensors, got torch.float16"):
        a(x.half())
    with pytest.raises(ValueError, match=r"cannot hold torch.float16 parameters: use .bfloat16\(\)"):
        hpmoe.MoELayer(small(), dtype="bf16").half()
    swapped = hpmoe.MoELayer(small(), dtype="bf16")
    swapped.gate.weight = torch.nn.Parameter(swapped.gate.weight.half())
    with pytest.raises(ValueError, match="parameter 'gate.weight' is torch.float16"):
        swapped(x)
    with pytest.raises(ValueError, match="dtype='fp32'.* takes torch.float32 CPU tensors, got torch.bfloat16"):
        hpmoe.MoELayer(small())(x)


def test_executors_bit_identical():
    torch.manual_seed(1)
    cfg = small(shared_experts=1)
    a = hpmoe.MoELayer(cfg, ranks=2, workers=2, executor="interleaved")
    b = hpmoe.MoELayer(cfg, ranks=2, workers=1, executor="serialized")
    b.load_state_dict(a.state_dict())
    x, d_out = torch.randn(64, 48), torch.randn(64, 48)
    ra, rb = run(a, x, d_out), run(b, x, d_out)
    assert torch.equal(ra[0], rb[0]) and torch.equal(ra[1], rb[1])
    assert all(torch.equal(ra[2][n], rb[2][n]) for n in ra[2])


@pytest.mark.parametrize("schedule", ["fill", "rank-rotated", "interleave-wgrad", "ratr"])
def test_schedules_bit_identical(schedule):
    torch.manual_seed(2)
    a = hpmoe.MoELayer(small(), ranks=2, workers=2)
    b = hpmoe.MoELayer(small(), ranks=2, workers=2, schedule=schedule)
    b.load_state_dict(a.state_dict())
    x, d_out = torch.randn(64, 48), torch.randn(64, 48)
    ra, rb = run(a, x, d_out), run(b, x, d_out)
    assert torch.equal(ra[0], rb[0]) and torch.equal(ra[1], rb[1])
    assert all(torch.equal(ra[2][n], rb[2][n]) for n in ra[2])
    with pytest.raises(ValueError):
        hpmoe.MoELayer(small(), schedule="fastest")


def test_losses_and_bias_update():
    cfg = small(scoring="sigmoid", expert_bias=True, aux_loss_coef=0.01, z_loss_coef=0.001, bias_update_rate=0.01)
    m = hpmoe.MoELayer(cfg, ranks=1)
    y = m(torch.randn(32, 48))
    assert isinstance(y, torch.Tensor) and y.shape == (32, 48)  # the same type whatever the coefficients
    aux, z = m.last_losses
    assert aux.item() > 0 and z.item() > 0
    assert m.last_load.shape == (1, 8) and int(m.last_load.sum()) == 32 * 2
    y.sum().backward()
    load = m.last_load.sum(0).float()
    moved = m.gate_bias * torch.sign(load.mean() - load)  # bias rises where load is below the mean
    assert torch.all(moved >= 0) and m.gate_bias.abs().max().item() == pytest.approx(0.01)


def test_hugging_face_names():
    m = hpmoe.MoELayer(small(shared_experts=1, expert_bias=True, scoring="sigmoid"))
    names = set(m.state_dict())
    assert {"gate.weight", "gate.e_score_correction_bias", "experts.7.down_proj.weight",
            "shared_experts.up_proj.weight"} <= names


def test_bad_inputs_raise_value_error():
    m = hpmoe.MoELayer(small(), ranks=2)
    with pytest.raises(ValueError, match=r"shape \[\.\.\., 48\]"):
        m(torch.randn(4, 47))
    with pytest.raises(ValueError, match="float32"):
        m(torch.randn(4, 48, dtype=torch.float64))
    with pytest.raises(ValueError, match="cannot share evenly"):
        m(torch.randn(5, 48))
    with pytest.raises(ValueError, match="top_k"):
        hpmoe.MoELayer(small(top_k=9))
    with pytest.raises(ValueError, match="executor"):
        hpmoe.MoELayer(small(), executor="fast")
    with pytest.raises(ValueError):
        hpmoe.preset("no-such-model")
    with pytest.raises(ValueError, match="unknown"):
        hpmoe.with_fields(small(), no_such_field=1)
    with torch.no_grad():
        m.experts[3].up_proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        m(torch.randn(4, 48))


def test_repeats_bit_for_bit():
    torch.manual_seed(3)
    m = hpmoe.MoELayer(small(), ranks=2)
    x = torch.randn(16, 48)
    with torch.no_grad():
        assert torch.equal(m(x), m(x))
    assert json.loads(json.dumps(m.config))["ranks"] == 2


def load_safetensors(path):
    return hpmoe.io.load_safetensors(path)[0]


@pytest.mark.parametrize("fields", [["routed_experts=8"], ["routed_experts=8", "shared_experts=1", "scoring=sigmoid",
                                                            "expert_bias=true", "aux_loss_coef=0.01"]])
def test_cli_and_module_bit_identical(tmp_path, fields):
    """hpmoe run --save, then the module on the saved weights and tokens: the same bits."""
    import os
    import subprocess
    cli = os.environ.get("HPMOE", "build/hpmoe")
    if not os.path.exists(cli):
        pytest.skip(f"the CLI is not built at {cli} (set HPMOE)")
    layer = ["--preset", "mixtral-8x7b", "--set", "hidden=48", "--set", "expert_inter=40"]
    for f in fields:
        layer += ["--set", f]
    config = json.loads(subprocess.run([cli, "config"] + layer, check=True, capture_output=True, text=True).stdout)
    subprocess.run([cli, "run"] + layer + ["-P", "2", "-T", "12", "--backward", "--iters", "1", "--warmup", "0",
                                           "--verify", "off", "--save", str(tmp_path)], check=True, capture_output=True)
    w = load_safetensors(tmp_path / "weights.safetensors")
    inputs = load_safetensors(tmp_path / "inputs.safetensors")
    saved = load_safetensors(tmp_path / "outputs.safetensors")
    m = hpmoe.MoELayer(config, ranks=2)
    state = {k[len("mlp."):]: v for k, v in w.items()}
    if not config["layer"]["expert_bias"]:  # the CLI saves the (zero) bias either way
        del state["gate.e_score_correction_bias"]
    m.load_state_dict(state)
    m.config["bias_update_rate"] = 0.0
    x = inputs["x"].clone().requires_grad_(True)
    y = m(x)
    y = y[0] if isinstance(y, tuple) else y
    y.backward(inputs["d_out"])
    assert torch.equal(y.detach(), saved["out"])
    assert torch.equal(x.grad, saved["grad.x"])
    for n, p in m.named_parameters():
        assert torch.equal(p.grad, saved["grad.mlp." + n]), n


def test_training_example_runs_matches_its_twin_and_resumes(tmp_path):
    """examples/train_moe_lm.py, tiny: both models, the same losses, a bit-identical resume, the pictures."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, os.path.join(root, "examples", "train_moe_lm.py"), "--steps", "6", "--layers", "1",
                        "--d", "32", "--heads", "2", "--inter", "32", "--experts", "4", "--seq", "16", "--batch", "4",
                        "--out", str(tmp_path), "--check-resume"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    m = json.load(open(tmp_path / "metrics.json"))
    assert m["resume_bit_identical"]
    assert m["max_loss_difference"] <= 1e-4 * max(m["hpmoe"]["loss"])
    assert (tmp_path / "loss.png").stat().st_size > 1000 and (tmp_path / "load.png").stat().st_size > 1000


def train_example(tmp_path, *args):
    """examples/train_moe_lm.py run with `args` into tmp_path: (the completed process, its metrics.json or None)."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, os.path.join(root, "examples", "train_moe_lm.py"), *args, "--out", str(tmp_path)],
                       capture_output=True, text=True)
    return r, (json.load(open(tmp_path / "metrics.json")) if r.returncode == 0 else None)


def test_training_example_float64_curves_agree(tmp_path):
    """--dtype float64 (hpmoe's fp64 oracle against the twin in double): the loss curves agree to 1e-12,
    and the float64 checkpoint resumes bit for bit."""
    r, m = train_example(tmp_path, "--dtype", "float64", "--steps", "12", "--layers", "2", "--d", "32", "--heads", "2",
                         "--inter", "32", "--experts", "8", "--seq", "16", "--batch", "4", "--check-resume")
    assert r.returncode == 0, r.stdout + r.stderr
    assert m["resume_bit_identical"]
    assert m["max_loss_difference"] <= 1e-12
    assert m["hpmoe"]["loss"][-1] < m["hpmoe"]["loss"][0]


def test_training_example_bfloat16_trains_and_resumes(tmp_path):
    """--dtype bfloat16 (float32 masters, bf16 compute: hpmoe's FFNs with dtype="bf16", the rest under autocast):
    the loss falls, follows the twin's within bf16's rounding, and the checkpoint resumes bit for bit."""
    r, m = train_example(tmp_path, "--dtype", "bfloat16", "--steps", "12", "--layers", "1", "--d", "32", "--heads", "2",
                         "--inter", "32", "--experts", "4", "--seq", "16", "--batch", "4", "--check-resume")
    assert r.returncode == 0, r.stdout + r.stderr
    assert m["resume_bit_identical"]
    assert m["hpmoe"]["loss"][-1] < m["hpmoe"]["loss"][0]
    assert 0 < m["max_loss_difference"] <= 2e-2 * max(m["hpmoe"]["loss"])


def test_training_example_refuses_bad_input(tmp_path):
    """A garbage checkpoint or impossible flags: one line naming them, exit code 2."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(os.urandom(100))
    flags = [["--resume", str(garbage)], ["--steps", "0"], ["--batch", "3", "--seq", "5"], ["--dtype", "float16"],
             # issue 43: every number in range, one line (no usage block, no traceback)
             ["--heads", "0"], ["--d", "250", "--heads", "4"], ["--lr", "nan"], ["--lr", "-1"], ["--bias-rate", "inf"],
             ["--top-k", "20"], ["--workers", "1000"], ["--threads", "0"], ["--seq", "0"], ["--log-every", "0"],
             ["--save-every", "-1"], ["--experts", "0"], ["--layers", "0"], ["--inter", "0"], ["--seed", "-1"],
             ["--ranks", "0"], ["--steps", "x"], ["--bogus"], ["--resume", str(tmp_path)]]
    for extra in flags:
        r = subprocess.run([sys.executable, os.path.join(root, "examples", "train_moe_lm.py"), "--out", str(tmp_path)] + extra,
                           capture_output=True, text=True)
        assert r.returncode == 2, (extra, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:"), (extra, r.stderr)


def test_training_example_refuses_corrupt_checkpoints_and_leaves_no_temporaries(tmp_path):
    """A checkpoint that parses but is wrong (a negative step, NaN weights) is one error line and exit code 2;
    a SIGTERM while the example writes leaves no temporary file behind."""
    import os
    import signal
    import subprocess
    import sys
    import time
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    example = os.path.join(root, "examples", "train_moe_lm.py")
    tiny = ["--layers", "1", "--d", "32", "--heads", "2", "--inter", "32", "--experts", "4", "--seq", "16", "--batch", "4",
            "--no-twin"]
    r = subprocess.run([sys.executable, example, "--steps", "2", *tiny, "--out", str(tmp_path / "a")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    tensors, meta = hpmoe.io.load_safetensors(tmp_path / "a" / "checkpoint.safetensors")
    bad_step = dict(meta, step="-5")
    hpmoe.io.save_safetensors(tmp_path / "neg.safetensors", tensors, bad_step)
    poisoned = dict(tensors)
    name = next(k for k in poisoned if k.startswith("model.") and poisoned[k].is_floating_point())
    poisoned[name] = poisoned[name].clone()
    poisoned[name].view(-1)[0] = float("nan")
    hpmoe.io.save_safetensors(tmp_path / "nan.safetensors", poisoned, meta)
    for ckpt, says in (("neg", "step is -5"), ("nan", "holds NaN or Inf")):
        r = subprocess.run([sys.executable, example, "--steps", "4", *tiny, "--resume", str(tmp_path / f"{ckpt}.safetensors"),
                            "--out", str(tmp_path / ckpt)], capture_output=True, text=True)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and says in lines[0], r.stderr
    # SIGTERM at several moments of a run that saves every step: no .tmp files, and what is there loads.
    for delay in (1.0, 2.0, 3.0):
        out = tmp_path / f"term{delay}"
        p = subprocess.Popen([sys.executable, example, "--steps", "400", *tiny, "--save-every", "1", "--out", str(out)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)
        if out.exists():
            assert not [f for f in os.listdir(out) if ".tmp" in f], os.listdir(out)
            if (out / "checkpoint.safetensors").exists():
                hpmoe.io.load_safetensors(out / "checkpoint.safetensors")


@pytest.mark.parametrize("executor", ["interleaved", "serialized"])
def test_kept_layer_follows_training_bit_for_bit(executor):
    """The layer kept across calls repacks what each optimizer step changed (and only that): every step's
    output and gradients equal a freshly built module's on the same parameters, for token counts that change."""
    torch.manual_seed(3)
    kept = hpmoe.MoELayer(small(), ranks=2, workers=1, executor=executor)
    opt = torch.optim.Adam(kept.parameters(), lr=1e-2)
    for step, tokens in enumerate([24, 40, 24, 2]):
        fresh = hpmoe.MoELayer(small(), ranks=2, workers=1, executor=executor)
        fresh.load_state_dict(kept.state_dict())
        x = torch.randn(tokens, 48)
        xk, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
        yk, yf = kept(xk), fresh(xf)
        assert torch.equal(yk, yf), f"step {step}"
        (yk * yk).mean().backward()
        (yf * yf).mean().backward()
        assert torch.equal(xk.grad, xf.grad), f"step {step}"
        for (n, p), q in zip(kept.named_parameters(), fresh.parameters()):
            assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), n
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert kept._core.engines == 1  # one step at a time: one engine, reused


def test_kept_layer_converts_only_changed_parameters():
    torch.manual_seed(4)
    moe = hpmoe.MoELayer(small(), ranks=1)
    x = torch.randn(16, 48)
    moe(x)
    first = moe._core.conversions
    assert first == len(list(moe.parameters()))  # all of them, once
    with torch.no_grad():
        moe(x)
    assert moe._core.conversions == first  # nothing changed: nothing converted
    with torch.no_grad():
        moe.experts[3].down_proj.weight.mul_(0.5)  # in place: its version counter moves
    y = moe(x)
    assert moe._core.conversions == first + 1
    moe.experts[5].up_proj.weight.data = moe.experts[5].up_proj.weight.data.clone() * 2  # new storage
    y2 = moe(x)
    assert moe._core.conversions == first + 2
    fresh = hpmoe.MoELayer(small(), ranks=1)
    fresh.load_state_dict(moe.state_dict())
    assert torch.equal(y2, fresh(x)) and not torch.equal(y, y2)


def test_io_round_trip_and_refuses_malformed_files(tmp_path):
    """hpmoe.io: what it writes reads back bit for bit; a mutated or cut file gives ValueError, nothing else
    (a bounded random fuzz of the reader: the header's JSON, lengths, offsets and dtypes)."""
    import random
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(4).to(torch.bfloat16),
               "d": torch.randn(2, 2, dtype=torch.float64)}
    path = tmp_path / "t.safetensors"
    hpmoe.io.save_safetensors(path, tensors, {"step": 3})
    back, meta = hpmoe.io.load_safetensors(path)
    assert meta == {"step": "3"} and set(back) == set(tensors)
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)
    good = path.read_bytes()
    rng = random.Random(5)
    bad = tmp_path / "bad.safetensors"
    for i in range(300):
        data = bytearray(good)
        kind = i % 3
        if kind == 0:
            data = data[:rng.randrange(len(data))]
        elif kind == 1:
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(min(len(data), 200))] = rng.randrange(256)
        else:
            text = good[8:8 + int.from_bytes(good[:8], "little")].decode()
            word = rng.choice(['"F32"', '"I64"', '[3, 5]', '"data_offsets"', '0', '60'])
            text = text.replace(word, rng.choice(['"F16"', '-1', '[99]', '"x"', '1e30', '[]']), 1)
            data = len(text.encode()).to_bytes(8, "little") + text.encode() + good[8 + int.from_bytes(good[:8], "little"):]
        bad.write_bytes(bytes(data))
        try:
            hpmoe.io.load_safetensors(bad)
        except ValueError:
            pass


@pytest.mark.parametrize("executor", ["interleaved", "serialized"])
def test_non_finite_tokens_and_gradients_are_refused(executor):
    """The fast executors refuse NaN/Inf in x and d_out, and an output or dx that overflowed, as the CLI and
    the reference executor do; check_finite=False skips the check (issue 43)."""
    torch.manual_seed(0)
    moe = hpmoe.MoELayer("tiny", ranks=2, executor=executor)
    x = torch.randn(8, moe.config["hidden"])
    bad = x.clone()
    bad[3, 5] = float("nan")
    with pytest.raises(ValueError, match="x holds NaN or Inf at token 3, channel 5"):
        moe(bad)
    bad[3, 5] = float("-inf")
    with pytest.raises(ValueError, match="x holds NaN or Inf at token 3"):
        moe(bad)
    with pytest.raises(ValueError, match="overflowed"):
        moe(x * 1e38)
    y = moe(x)
    d = torch.ones_like(y)
    d[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"d_out .* holds NaN or Inf at token 1, channel 2"):
        y.backward(d)
    # The expert bias is not moved by a refused step.
    biased = hpmoe.MoELayer(hpmoe.with_fields(hpmoe.preset("tiny"), expert_bias=True), ranks=2, executor=executor)
    before = biased.gate_bias.clone()
    with pytest.raises(ValueError, match="x holds NaN"):
        biased(bad).sum().backward()
    assert torch.equal(before, biased.gate_bias)
    unchecked = hpmoe.MoELayer("tiny", ranks=2, executor=executor, check_finite=False)
    unchecked.load_state_dict(moe.state_dict())
    assert not torch.isfinite(unchecked(bad)).all()
    with pytest.raises(ValueError, match="check_finite must be True or False"):
        hpmoe.MoELayer("tiny", check_finite=1)


def test_second_and_double_backward_are_errors():
    moe = hpmoe.MoELayer("tiny", ranks=2)
    x = torch.randn(8, moe.config["hidden"], requires_grad=True)
    y = moe(x)
    y.sum().backward(retain_graph=True)
    with pytest.raises(ValueError, match="backward has already run"):
        y.sum().backward()
    y = moe(x)
    with pytest.raises(ValueError, match="not differentiable: create_graph=True"):
        torch.autograd.grad(y.sum(), x, create_graph=True)


def test_constructor_arguments_are_checked_and_the_module_copies():
    with pytest.raises(ValueError, match="workers must be an integer from 1 to 256"):
        hpmoe.MoELayer("tiny", workers=10**12)
    with pytest.raises(ValueError, match="workers must be an integer"):
        hpmoe.MoELayer("tiny", workers=2.5)
    with pytest.raises(ValueError, match="hidden must be positive"):
        hpmoe.with_fields(hpmoe.preset("tiny"), hidden=-1)
    torch.manual_seed(1)
    moe = hpmoe.MoELayer("tiny", ranks=2, schedule="fill")
    x = torch.randn(8, moe.config["hidden"])
    twin = copy.deepcopy(moe)
    assert twin is not moe and torch.equal(twin(x), moe(x))
    twin.gate.weight.data.add_(1.0)  # a copy, not a view
    assert not torch.equal(twin.gate.weight, moe.gate.weight)
    restored = pickle.loads(pickle.dumps(moe))
    assert torch.equal(restored(x), moe(x)) and restored._init_args["schedule"] == "fill"
