"""hpmoe.MoELayer(lend_weights=...): weights instead of tokens from PyTorch (docs/placement.md)."""
import pytest
import torch

import hpmoe
from test_module import rel, run, small


def test_lent_weights_change_where_rows_run_not_the_output():
    """lend_weights lends hot experts' weights to the ranks whose own rows of them reach the threshold: the
    output and dx are bit for bit the layer's without lending (per assignment a token's rows are added in k
    order wherever they ran), the weight gradients within fp32 rounding (a lent copy's partial is summed onto
    the owner), serialized = interleaved bit for bit, and the exchange says what was lent."""
    torch.manual_seed(9)
    cfg = small(shared_experts=1)
    lend = hpmoe.MoELayer(cfg, ranks=3, workers=2, lend_weights=6)
    plain = hpmoe.MoELayer(cfg, ranks=3, workers=2)
    serial = hpmoe.MoELayer(cfg, ranks=3, workers=1, executor="serialized", lend_weights=6)
    assert lend.config["lend_weights"] == 6 and plain.config["lend_weights"] == "off"
    plain.load_state_dict(lend.state_dict())
    serial.load_state_dict(lend.state_dict())
    x, d_out = torch.randn(96, 48), torch.randn(96, 48)
    rl, rp, rs = run(lend, x, d_out), run(plain, x, d_out), run(serial, x, d_out)
    assert lend.last_exchange["lent_experts"] > 0 and lend.last_exchange["forward_lent_bytes"] > 0
    assert plain.last_exchange["lent_experts"] == 0
    assert torch.equal(rl[0], rp[0]) and torch.equal(rl[1], rp[1])
    assert all(rel(rl[2][n], rp[2][n]) < 1e-5 for n in rl[2])
    assert torch.equal(rl[0], rs[0]) and torch.equal(rl[1], rs[1])
    assert all(torch.equal(rl[2][n], rs[2][n]) for n in rl[2])
    for bad in (0, -1, "sometimes", True, 2.5):
        with pytest.raises(ValueError, match="lend_weights"):
            hpmoe.MoELayer(cfg, lend_weights=bad)
