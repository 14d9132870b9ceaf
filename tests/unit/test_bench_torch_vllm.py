"""bench_torch_vllm's summary: the medians, the goal, and where the goal
sits against the decode floor measured in the same rounds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
bench = pytest.importorskip("bench_torch_vllm")


def _side(rate: float, text: str = "t", ttft: float = 100.0) -> dict:
    return {"tokens_per_s": rate, "ttft_p50_ms": ttft, "texts": [text]}


def _round(modeld: float, vllm: float, floor: float, ttfts: tuple[float, float] = (100.0, 100.0),
           bound: float = 1.0, overhead_ms: float = 1.0) -> dict:
    scenario = {"modeld": _side(modeld, ttft=ttfts[0]), "vllm": _side(vllm, ttft=ttfts[1])}
    ceiling = {"tokens_per_s": floor, "forward_bound_tokens_per_s": bound, "overhead_ms": overhead_ms}
    return {"streams8": scenario, "streams1": dict(scenario),
            "ceiling": {"streams8": ceiling, "streams1": ceiling}}


def test_the_goal_is_placed_against_the_floor_at_vllms_own_fraction():
    rounds = [_round(70, 80, 100), _round(75, 70, 100), _round(90, 60, 100)]
    medians, ratios, agreement, ceiling = bench.summarise(rounds)
    c = ceiling["streams8"]
    assert c["modeld_over_floor"] == 0.75 and c["vllm_over_floor"] == 0.7
    # beating vLLM by 1.25x at 0.7 of the floor needs 0.875 of it
    assert c["goal_needs_modeld_over_floor"] == 0.875
    assert ratios["streams8"]["rounds"] == [0.875, 1.071, 1.5]
    assert ratios["streams8"]["ratio"] == pytest.approx(75 / 70) and not ratios["streams8"]["met"]
    assert agreement["streams8"] == {"identical_texts": 3, "of": 3}
    assert medians["streams1"]["modeld"]["tokens_per_s"] == 75


def test_modeld_is_placed_against_its_forward_bound_of_the_same_rounds():
    # the floor plus the step's overhead beyond its products: modeld's rate in
    # each round over that round's bound, the median of those
    rounds = [_round(70, 80, 100, bound=80, overhead_ms=6), _round(75, 70, 100, bound=100, overhead_ms=8),
              _round(90, 60, 100, bound=90, overhead_ms=7)]
    c = bench.summarise(rounds)[3]["streams8"]
    assert c["modeld_over_forward_bound"] == 0.875  # 70/80, 75/100, 90/90
    assert c["forward_bound_tokens_per_s"] == 90 and c["step_overhead_ms"] == 7


def test_the_first_token_goal_is_the_median_of_the_rounds_ratios_and_lower_is_better():
    rounds = [_round(1, 1, 1, (50, 100)), _round(1, 1, 1, (90, 100)), _round(1, 1, 1, (120, 100))]
    ttft = bench.summarise(rounds)[1]["streams1"]["ttft"]
    assert ttft["rounds"] == [0.5, 0.9, 1.2]
    assert ttft["ratio"] == pytest.approx(0.9) and ttft["met"] and ttft["goal"] == "<= 1.0"
    slower = [_round(1, 1, 1, (110, 100))] * 3
    assert not bench.summarise(slower)[1]["streams1"]["ttft"]["met"]


def test_http_completion_times_the_first_text_and_counts_the_usage_tokens():
    """--protocol http: one client for both servers; a chunk whose text is
    empty (a special token, as vLLM sends one) does not end the first-token
    wait, and the usage chunk gives the count."""
    import asyncio
    import json
    import types

    aiohttp = pytest.importorskip("aiohttp")
    from aiohttp import web

    seen = {}

    async def completions(request):
        seen.update(await request.json())
        reply = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await reply.prepare(request)
        for text in ("", "Hello", " world"):
            await reply.write(b"data: " + json.dumps({"choices": [{"index": 0, "text": text}]}).encode() + b"\n\n")
            await asyncio.sleep(0.05 if not text else 0)
        usage = {"choices": [], "usage": {"completion_tokens": 3}}
        await reply.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        return reply

    async def main():
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        sides = types.SimpleNamespace(tokens=3)
        try:
            async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
                return await bench.Sides.completion(sides, session, {"model": "m", "prompt": "p", "cache_prompt": False})
        finally:
            await runner.cleanup()

    got = asyncio.run(main())
    assert got["text"] == "Hello world" and got["tokens"] == 3
    assert got["ttft_s"] >= 0.05  # after the empty chunk's pause, at "Hello"
    assert seen["max_tokens"] == 3 and seen["ignore_eos"] and not seen["cache_prompt"] and seen["temperature"] == 0
