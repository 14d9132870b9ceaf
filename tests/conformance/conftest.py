"""Prints the backend x capability table the conformance suite collects."""

from __future__ import annotations

import pytest

from capability_table import TABLE


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter):
    if not TABLE:
        return
    from modeld.backends.base import Capability

    # every capability row for every backend, so a row no test reached shows
    # as "not checked" instead of going missing; other rows where recorded
    capabilities = sorted(c.value for c in Capability)
    terminalreporter.section("backend conformance (backend x capability)")
    for name, row in sorted(TABLE.items()):
        terminalreporter.write_line(f"{name}:")
        rows = (capabilities if " vs " not in name else []) + sorted(set(row) - set(capabilities))
        for key in rows:
            terminalreporter.write_line(f"    {key:<26} {row.get(key, 'not checked')}")
