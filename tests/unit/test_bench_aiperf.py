"""bench_aiperf's summary: the llama.cpp pair's goals, and the torch
runtime's pair (modeld-torch against vLLM) where vLLM ran in the rounds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
bench = pytest.importorskip("bench_aiperf")


def _figures(tok_s: float, ttft_ms: float, itl_ms: float) -> dict:
    return {"output_token_throughput": {"avg": tok_s}, "time_to_first_token": {"p50": ttft_ms},
            "inter_token_latency": {"p50": itl_ms}}


def _round(sides: dict[str, tuple[float, float, float]]) -> dict:
    return {f"{side} c8 unpinned": _figures(*figures) for side, figures in sides.items()}


def test_the_torch_pair_is_summarised_against_vllm_beside_the_llama_pair():
    rounds = [_round({"modeld": (110, 90, 40), "llama-server": (100, 100, 50),
                      "vllm": (80, 100, 60), "modeld-torch": (100, 80, 66)}),
              _round({"modeld": (90, 120, 55), "llama-server": (100, 100, 50),
                      "vllm": (100, 50, 50), "modeld-torch": (90, 60, 40)})]
    row = bench.summarise(rounds, [8], ["unpinned"], [""], with_vllm=True)["c8 unpinned"]
    assert row["goals"]["output throughput vs llama-server"]["ratio"] == pytest.approx((1.1 + 0.9) / 2)
    torch_pair = row["modeld-torch vs vllm"]
    assert torch_pair["output_token_throughput"] == pytest.approx((1.25 + 0.9) / 2)
    assert torch_pair["time_to_first_token_p50"] == pytest.approx((0.8 + 1.2) / 2)
    assert torch_pair["inter_token_latency_p50"] == pytest.approx((1.1 + 0.8) / 2)
    assert row["medians"]["vllm output_token_throughput"] == 90
    assert row["medians"]["modeld-torch time_to_first_token"] == 70


def test_without_vllm_the_rounds_need_no_torch_pair():
    rounds = [_round({"modeld": (110, 90, 40), "llama-server": (100, 100, 50)})]
    row = bench.summarise(rounds, [8], ["unpinned"], [""])["c8 unpinned"]
    assert "modeld-torch vs vllm" not in row
    assert row["goals"]["itl p50 vs llama-server"] == {"ratio": 0.8, "goal": "<= 1.0", "met": True}


def test_every_cell_of_the_race_gets_prompts_of_its_own():
    cells = [(r, c, p) for r in range(3) for c in (8, 32) for p in ("unpinned", "pinned")]
    seeds = [bench.cell_seed(*cell) for cell in cells]
    assert len(set(seeds)) == len(cells)
    assert bench.cell_seed(1, 8, "pinned") == bench.cell_seed(1, 8, "pinned")


def test_failed_requests_are_recorded_with_their_cause():
    data = {"error_summary": [{"count": 2, "error_details": {"code": 500, "type": "HTTPError",
                                                             "message": "the context is full"}}]}
    assert bench.errors(data) == [{"count": 2, "code": 500, "type": "HTTPError", "message": "the context is full"}]
    assert bench.errors({}) == [] == bench.errors({"error_summary": None})
