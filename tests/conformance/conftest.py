"""Collects the backend x capability table and prints it after the run."""

from __future__ import annotations

import pytest

TABLE: dict[str, dict[str, str]] = {}


def record(backend: str, capability: str, outcome: str) -> None:
    TABLE.setdefault(backend, {})[capability] = outcome


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter):
    if not TABLE:
        return
    capabilities = sorted({c for row in TABLE.values() for c in row})
    terminalreporter.section("backend conformance (backend x capability)")
    for backend, row in sorted(TABLE.items()):
        terminalreporter.write_line(f"{backend}:")
        for capability in capabilities:
            terminalreporter.write_line(f"    {capability:<24} {row.get(capability, 'not checked')}")
