"""hpmoe.MoELayer(placement=..., online=...): a placement from PyTorch, and online placement revised between
forwards from the layer's own loads (docs/placement.md "Online placement")."""
import copy
import json

import pytest
import torch

import hpmoe
from test_module import run, small


def hot_layer(hot=0, **kwargs):
    """A layer whose router sends most tokens to expert `hot` (its gate row along the tokens' mean)."""
    torch.manual_seed(3)
    m = hpmoe.MoELayer(small(), ranks=4, workers=1, **kwargs)
    with torch.no_grad():
        m.gate.weight[hot] = 0.3
    return m


def hot_tokens(n):
    return torch.randn(n, 48) + 0.5 * torch.ones(48)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_online_revisions_run_bit_for_bit_as_a_layer_built_on_them(dtype):
    """Training steps with online placement: a revision adds replicas of the hot expert, the next forward runs
    on it, and every step (output, dx, every gradient) is bit for bit that of a fresh layer built with the
    placement the step ran on, from the same parameters: moved replicas give the bits of ones always there."""
    online = hot_layer(dtype=dtype, online=dict(every=2, window=2, drift=0))
    assert online.placement["experts_of_rank"] == [[0, 1], [2, 3], [4, 5], [6, 7]] and online.revisions == 0
    opt = torch.optim.SGD(online.parameters(), lr=0.05)
    torch.manual_seed(4)
    ran_on = []
    for step in range(5):
        x, d_out = hot_tokens(4 * 32), torch.randn(4 * 32, 48)
        placement, state = online.placement, copy.deepcopy(online.state_dict())
        got = run(online, x, d_out)
        fresh = hpmoe.MoELayer(small(), ranks=4, workers=1, dtype=dtype, placement=placement)
        fresh.load_state_dict(state)
        want = run(fresh, x, d_out)
        assert torch.equal(got[0], want[0]), f"step {step}: the output differs from a layer built on its placement"
        assert torch.equal(got[1], want[1]), f"step {step}: dx differs"
        for n in got[2]:
            assert torch.equal(got[2][n], want[2][n]), f"step {step}: the gradient of {n} differs"
        ran_on.append(placement)
        opt.step()
    assert online.revisions >= 1
    r = online.last_revision
    assert r["step"] in (2, 4) and r["added"] + r["moved"] >= 1 and r["bytes_moved"] > 0
    assert any(sum(0 in rank for rank in p["experts_of_rank"]) > 1 for p in ran_on[2:]), \
        "no step ran with a replica of the hot expert"
    assert all(p == ran_on[0] for p in ran_on[:2]), "the placement changed before the first scheduled revision"
    twin = copy.deepcopy(online)  # a copy starts from the revised placement
    assert twin.placement == online.placement and twin.revisions == 0


def test_owners_stay_with_fetch_and_replicas_go_below_them():
    """The last rank's hot expert (7, owned by rank 3). With fetch=True (how an MPI layer revises: a process
    holds the experts it owns) every owner stays where it is, and the hot expert still gets homes on other
    ranks, below its owner: the placement names the owners that are not their experts' first homes. Every
    step is bit for bit a layer built on its placement (the first test), and in process without fetch the
    policy may move owners too."""
    torch.manual_seed(6)
    batches = [hot_tokens(4 * 32) for _ in range(4)]
    free = hot_layer(hot=7, online=dict(every=2, window=2, drift=0))
    fixed = hot_layer(hot=7, online=dict(every=2, window=2, drift=0, fetch=True))
    for x in batches:
        free(x)
        fixed(x)
    homes = lambda m: [r for r, experts in enumerate(m.placement["experts_of_rank"]) if 7 in experts]
    assert len(homes(free)) > 1 and free.revisions >= 1
    p = fixed.placement
    assert len(homes(fixed)) > 1 and min(homes(fixed)) < 3 and p["fetch_replicas"] is True
    owners = p.get("owners") or [min(r for r, ex in enumerate(p["experts_of_rank"]) if e in ex) for e in range(8)]
    assert owners == [0, 0, 1, 1, 2, 2, 3, 3], owners  # every owner where it was
    twin = hpmoe.MoELayer(small(), ranks=4, placement=p)  # the placement, owners included, builds a layer
    assert twin.placement == p


def test_a_placement_with_replicas_from_pytorch():
    """placement= takes a plan's JSON (a dict or a file) or a spec; replicas change where rows run, not the
    output (bit for bit per assignment); serialized = interleaved bit for bit on it."""
    torch.manual_seed(5)
    plan = {"experts_of_rank": [[0, 1], [2, 3, 0], [4, 5, 0], [6, 7]], "replicas": True}
    placed = hpmoe.MoELayer(small(), ranks=4, placement=plan)
    serial = hpmoe.MoELayer(small(), ranks=4, executor="serialized", placement=plan)
    plain = hpmoe.MoELayer(small(), ranks=4, placement="round-robin")
    assert plain.placement["experts_of_rank"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    serial.load_state_dict(placed.state_dict())
    plain.load_state_dict(placed.state_dict())
    assert placed.placement["experts_of_rank"] == plan["experts_of_rank"]
    x, d_out = hot_tokens(4 * 24), torch.randn(4 * 24, 48)
    a, b, c = run(placed, x, d_out), run(serial, x, d_out), run(plain, x, d_out)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and all(torch.equal(a[2][n], b[2][n]) for n in a[2])
    assert torch.equal(a[0], c[0]) and torch.equal(a[1], c[1])


def test_bad_placement_and_online_settings_are_refused_with_the_field_named(tmp_path):
    cfg = small()
    bad_file = tmp_path / "bad.json"
    bad_file.write_text('{"experts_of_rank": [[0, 1], [2, 3], [4, 5], [6]]}')
    for placement, says in [({"experts_of_rank": [[0, 1], [2, 3], [4, 5], [6]]}, "expert 7"),
                            (str(bad_file), "bad.json"),
                            (str(tmp_path / "missing.json"), "missing.json"),
                            ({"experts_of_rank": [[0, 1, 0]], "replicas": True}, "rank"),
                            ({"owner": [0, 1, 2, 3, 0, 1, 2, float("nan")]}, "placement"),
                            (42, "placement"), ("", "placement")]:
        with pytest.raises(ValueError, match=says):
            hpmoe.MoELayer(cfg, ranks=4, placement=placement)
    for online, says in [("yes", "online"), (1, "online"), ({"every": 0}, "every"), ({"window": 1.5}, "window"),
                         ({"drift": -1}, "drift"), ({"drift": float("inf")}, "online"), ({"bogus": 1}, "bogus"),
                         ({"machine": "no-such-machine"}, "no-such-machine"), ({"training": "no"}, "training"),
                         ({"max_changes": -2}, "max_changes"), ({"slots_per_rank": 1}, "slots")]:
        with pytest.raises(ValueError, match=says):
            hpmoe.MoELayer(cfg, ranks=4, online=online)
    with pytest.raises(ValueError, match="reference"):
        hpmoe.MoELayer(cfg, ranks=4, executor="reference", online=True)
    json.dumps(hpmoe.MoELayer(cfg, ranks=4, online=True).placement)  # the placement is plain JSON
