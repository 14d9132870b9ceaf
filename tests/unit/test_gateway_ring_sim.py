"""bench/ring_sim.py on a small fleet: sane figures, fast."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "ring_sim.py"


def load_ring_sim():
    spec = importlib.util.spec_from_file_location("ring_sim", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ring_simulation_on_a_small_fleet():
    result = load_ring_sim().ring_simulation(nodes=20, models=2000)
    assert result["nodes"] == 20 and result["models"] == 2000
    assert 1.0 < result["max_over_mean"] < 1.6  # 100 models a node: sampling noise alone is ~1.25
    assert 0.4 < result["min_over_mean"] < 1.0
    assert 1.0 < result["max_over_mean_k2"] < 1.6
    assert result["max_over_mean_bounded"] <= 1.1 + 1e-9
    assert result["bound"] == 1 / 21 + 0.05
    assert 0.5 / 21 < result["moved_fraction"] <= result["bound"]
    assert result["moved_goal_met"]
    assert result["moved_only_to_new_node"]
    assert result["left_moved_only_its_own"]
    assert 0.5 / 20 < result["left_moved_fraction"] < 2 / 20
