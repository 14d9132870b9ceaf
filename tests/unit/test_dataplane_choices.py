"""DataPlane.generate_choices: n requests with seed + i, their events merged
and tagged with the choice, one failure ending all, and closing the merged
stream closing every choice's. The engine here is a scripted double of
Engine.generate (the real engine's n-choice behaviour is tested end to end in
tests/integration/test_openai_structured.py)."""

from __future__ import annotations

import asyncio

import pytest

from modeld.backends.errors import InvalidArgument, Unavailable
from modeld.backends.generation.params import (
    FinalEvent, FinishReason, GenerateRequest, SamplingParams, TokenEvent, Usage,
)
from modeld.server.dataplane import DataPlane


class ScriptedEngine:
    """Engine.generate's contract: token events, then one final event; a
    choice whose seed is in `fail_seeds` raises after its first token."""

    def __init__(self, fail_seeds=(), hold: asyncio.Event | None = None) -> None:
        self.requests: list[GenerateRequest] = []
        self.closed: list[str] = []
        self.fail_seeds, self.hold = set(fail_seeds), hold

    def generate(self, request, timeout_s=None):
        self.requests.append(request)
        return self._events(request)

    async def _events(self, request):
        try:
            for i in range(3):
                yield TokenEvent((i,), f"{request.params.seed}:{i} ")
                if request.params.seed in self.fail_seeds:
                    raise Unavailable("choice failed")
                if self.hold is not None:
                    await self.hold.wait()
            yield FinalEvent(FinishReason.LENGTH, Usage(prompt_tokens=4, completion_tokens=3))
        finally:
            self.closed.append(request.request_id)


def _request(seed=None) -> GenerateRequest:
    return GenerateRequest("m", prompt="x", params=SamplingParams(seed=seed), request_id="r")


async def test_choices_get_seed_plus_i_and_their_events_their_index():
    engine = ScriptedEngine()
    events = [e async for e in DataPlane(engine).generate_choices(_request(seed=10), 3)]
    assert [r.params.seed for r in engine.requests] == [10, 11, 12]
    assert [r.request_id for r in engine.requests] == ["r-0", "r-1", "r-2"]
    for index in range(3):
        mine = [e for i, e in events if i == index]
        assert "".join(e.text for e in mine[:-1]) == "".join(f"{10 + index}:{k} " for k in range(3))
        assert isinstance(mine[-1], FinalEvent)


async def test_without_a_seed_the_choices_are_independent_and_one_is_the_plain_stream():
    engine = ScriptedEngine()
    assert [e async for e in DataPlane(engine).generate_choices(_request(), 2)]
    assert [r.params.seed for r in engine.requests] == [None, None]
    engine = ScriptedEngine()
    events = [e async for e in DataPlane(engine).generate_choices(_request(seed=1), 1)]
    assert {i for i, _ in events} == {0} and engine.requests[0].request_id == "r"


async def test_one_failure_fails_all_and_closes_every_choice():
    engine = ScriptedEngine(fail_seeds={6})
    with pytest.raises(Unavailable, match="choice failed"):
        async for _ in DataPlane(engine).generate_choices(_request(seed=5), 3):
            pass
    assert sorted(engine.closed) == ["r-0", "r-1", "r-2"]


async def test_closing_the_stream_cancels_every_choice():
    engine = ScriptedEngine(hold=asyncio.Event())  # every choice waits after its first token
    stream = DataPlane(engine).generate_choices(_request(seed=0), 4)
    seen = set()
    async for index, _ in stream:
        seen.add(index)
        if len(seen) == 4:
            break
    await stream.aclose()
    assert sorted(engine.closed) == ["r-0", "r-1", "r-2", "r-3"]


def test_n_is_bounded():
    with pytest.raises(InvalidArgument, match="n must be in"):
        DataPlane(ScriptedEngine()).generate_choices(_request(), 17)
