"""Prints the backend x capability table the conformance suite collects."""

from __future__ import annotations

import pytest

from capability_table import TABLE


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter):
    if not TABLE:
        return
    backends = {name: row for name, row in TABLE.items() if " vs " not in name}
    capabilities = sorted({c for row in backends.values() for c in row})
    terminalreporter.section("backend conformance (backend x capability)")
    for name, row in sorted(TABLE.items()):
        terminalreporter.write_line(f"{name}:")
        for capability in capabilities if name in backends else sorted(row):
            terminalreporter.write_line(f"    {capability:<24} {row.get(capability, 'not checked')}")
