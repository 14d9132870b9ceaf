"""The race arithmetic the benchmarks report (bench/racing.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from racing import decode_rate, goal, median_ratio, ratios, round_order  # noqa: E402


def test_round_order_rotates_so_no_side_always_runs_first():
    sides = ["modeld", "peer", "ceiling"]
    firsts = [round_order(sides, r)[0] for r in range(6)]
    assert firsts == ["modeld", "peer", "ceiling", "modeld", "peer", "ceiling"]
    assert sorted(round_order(sides, 4)) == sorted(sides)


def test_ratios_pair_rounds_and_the_median_is_of_the_ratios():
    mine, theirs = [100, 50, 90], [100, 100, 60]
    assert ratios(mine, theirs) == [1.0, 0.5, 1.5]
    # the median of per-round ratios, not the ratio of medians (90/100)
    assert median_ratio(mine, theirs) == 1.0
    with pytest.raises(ValueError, match="pair rounds"):
        ratios([1, 2], [1])


def test_goal_direction():
    assert goal(1.02, 1.0)["met"] and not goal(0.98, 1.0)["met"]
    assert goal(0.9, 1.0, higher_is_better=False)["met"]
    assert goal(1.1, 1.0, higher_is_better=False) == {"ratio": 1.1, "goal": "<= 1.0", "met": False}


def test_decode_rate_leaves_out_the_first_token():
    assert decode_rate(11, first_token_at=2.0, end=3.0) == 10.0
    assert decode_rate(1, 2.0, 3.0) == 0.0
