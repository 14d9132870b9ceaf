"""A model's while_pulling setting: read from its config, refused clearly
when it is neither "route" nor "wait"."""

from __future__ import annotations

import json

import pytest

from modeld.backends.errors import InvalidArgument
from modeld.backends.model_config import WhilePulling, config_from_dict, config_from_json


def test_route_is_the_default_and_wait_is_read_from_toml_and_inline_configs():
    assert config_from_dict("m", {"source": "hf://org/m"}).while_pulling is WhilePulling.ROUTE
    assert config_from_dict("m", {"while_pulling": "wait"}).while_pulling is WhilePulling.WAIT
    inline = config_from_json("m", json.dumps({"source": "hf://org/m", "while_pulling": "wait"}))
    assert inline.while_pulling is WhilePulling.WAIT


@pytest.mark.parametrize("value", ["block", "", 1, True])
def test_another_value_is_refused_naming_the_key_and_its_choices(value):
    with pytest.raises(InvalidArgument, match="while_pulling.*route, wait"):
        config_from_dict("m", {"while_pulling": value})
