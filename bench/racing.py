"""Arithmetic shared by the races against peers: interleaved round order,
per-round ratios and their medians, and the record every result carries.
Kept apart from the benchmarks so unit tests can check it without a server."""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from typing import Iterable, Sequence


def round_order(sides: Sequence[str], round_index: int) -> list[str]:
    """Who runs first in round `round_index`: the sides rotate, so on a
    machine whose speed drifts over minutes no side always gets the same
    slot in the round."""
    k = round_index % len(sides)
    return list(sides[k:]) + list(sides[:k])


def ratios(mine: Iterable[float], theirs: Iterable[float]) -> list[float]:
    """Per-round ratios, mine / theirs; rounds are paired, never pooled."""
    mine, theirs = list(mine), list(theirs)
    if len(mine) != len(theirs):
        raise ValueError(f"{len(mine)} rounds against {len(theirs)}: ratios pair rounds")
    return [m / t for m, t in zip(mine, theirs)]


def median_ratio(mine: Iterable[float], theirs: Iterable[float]) -> float:
    return statistics.median(ratios(mine, theirs))


def goal(value: float, target: float, higher_is_better: bool = True) -> dict:
    met = value >= target if higher_is_better else value <= target
    return {"ratio": value, "goal": f"{'>=' if higher_is_better else '<='} {target}", "met": met}


def machine() -> dict:
    """What the result was measured on; figures from a busy machine say so."""
    return {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0],
            "load_average": list(os.getloadavg()), "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def decode_rate(tokens: int, first_token_at: float, end: float) -> float:
    """Tokens per second after the first (the first is the prompt's cost)."""
    if tokens < 2 or end <= first_token_at:
        return 0.0
    return (tokens - 1) / (end - first_token_at)
