"""Errors that name what was wrong (issue 58, class 8): a config that is not one is a ValueError naming the
two forms a config takes, not a TypeError from deep inside."""
import pytest

import hpmoe


@pytest.mark.parametrize("config", [42, 3.5, None, ["tiny"], b"tiny"])
def test_a_config_that_is_not_one_is_a_value_error(config):
    with pytest.raises(ValueError, match="config must be a preset's name .* or a layer config dict"):
        hpmoe.MoELayer(config)


def test_the_cli_configs_sections_load_and_a_misplaced_field_is_named():
    """`hpmoe config` prints the layer and how it runs as two sections (issue 59): the module takes them, and
    a field under the other part's section is a ValueError naming it."""
    flat = hpmoe.preset("tiny")
    run_fields = {"tokens_per_rank", "ranks", "dispatch_dtype", "grad_dispatch_dtype", "exchange", "combine_dtype",
                  "ranks_per_node", "node_forwarding", "lend_weights"}
    sections = {"layer": {k: v for k, v in flat.items() if k not in run_fields},
                "run": {k: v for k, v in flat.items() if k in run_fields}}
    m = hpmoe.MoELayer(sections, ranks=2)
    assert m.config["hidden"] == flat["hidden"] and m.config["ranks"] == 2
    sections["layer"]["ranks"] = 2
    with pytest.raises(ValueError, match="'ranks' is how the layer runs: put it under \"run\""):
        hpmoe.MoELayer(sections)


def test_an_unknown_bf16_engine_is_a_value_error_naming_the_variable():
    """HPMOE_BF16_ENGINE is read once per process by its first bf16 tile: a value hpmoe does not know is a
    ValueError naming the variable and the values it takes (in a fresh process, as the choice is made once)."""
    import os
    import subprocess
    import sys
    code = ("import torch, hpmoe\n"
            "m = hpmoe.MoELayer('tiny', ranks=2, dtype='bf16')\n"
            "try:\n"
            "    m(torch.randn(8, m.config['hidden']))\n"
            "except ValueError as e:\n"
            "    print('ValueError:', e)\n")
    env = dict(os.environ, HPMOE_BF16_ENGINE="bogus")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ValueError: HPMOE_BF16_ENGINE='bogus': expected amx, onednn or libxsmm" in out.stdout, out.stdout + out.stderr
