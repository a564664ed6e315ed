"""Errors that name what was wrong (issue 58, class 8): a config that is not one is a ValueError naming the
two forms a config takes, not a TypeError from deep inside."""
import pytest

import hpmoe


@pytest.mark.parametrize("config", [42, 3.5, None, ["tiny"], b"tiny"])
def test_a_config_that_is_not_one_is_a_value_error(config):
    with pytest.raises(ValueError, match="config must be a preset's name .* or a layer config dict"):
        hpmoe.MoELayer(config)
