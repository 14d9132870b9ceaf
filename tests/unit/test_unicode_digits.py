"""Numbers read from text a caller or an operator writes take ASCII digits
only: str.isdigit also accepts superscripts and other scripts' digits,
which int() then refuses with a ValueError the caller would meet as an
internal error."""

from __future__ import annotations

import pytest

from modeld.backends.errors import InvalidArgument
from modeld.backends.triton_config import _as_int as triton_int
from modeld.backends.version_policy import parse_version_policy
from modeld.server.gateway.discovery import is_address
from modeld.server.gateway.split import _valid_target
from modeld.server.load_priority import DEFAULT_NICENESS, niceness

DIGITS = ["\u00b9", "8\u00b9", "\u0663"]  # superscript one, an ASCII digit before it, Arabic-Indic three


@pytest.mark.parametrize("text", DIGITS)
def test_unicode_digits_are_not_numbers(text, monkeypatch):
    assert not is_address(f"host:{text}")
    assert not _valid_target(f"m:{text}")
    assert triton_int(text) == text  # left as the text it is, for the config check to name
    monkeypatch.setenv("MODELD_LOAD_NICENESS", text)
    assert niceness() == DEFAULT_NICENESS
    with pytest.raises(InvalidArgument, match="whole numbers"):
        parse_version_policy("m", {"specific": {"versions": [text]}})


def test_ascii_digits_still_are():
    assert is_address("host:8001") and _valid_target("m:2") and triton_int("-3") == -3
    assert parse_version_policy("m", {"specific": {"versions": ["2"]}}).select([1, 2, 3]) == (2,)
