"""The backend x capability table the conformance suite fills and prints."""

from __future__ import annotations

TABLE: dict[str, dict[str, str]] = {}


def record(backend: str, capability: str, outcome: str) -> None:
    TABLE.setdefault(backend, {})[capability] = outcome
