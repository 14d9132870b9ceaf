"""The engine's generation stream (Dispatcher.generate) over a scripted
language model: what it holds while it streams (a daemon stream slot, the
model's memory, the call's in-flight figure) is let go however the stream
ends, including a consumer that drops it after the final event without
closing it, and a failure's final event reaches the caller before its error."""

from __future__ import annotations

import asyncio
import gc
import sys
import types
from pathlib import Path

import pytest

from modeld.backends import registry as registry_module
from modeld.backends.base import Backend, Capability, GenerativeModel, Verdict
from modeld.backends.errors import ErrorKind, ResourceExhausted, Unavailable
from modeld.backends.generation.params import (
    FinalEvent, FinishReason, GenerateRequest, SamplingParams, TokenEvent, Usage,
)
from modeld.backends.model_config import TensorSpec
from modeld.backends.registry import BackendRegistry
from modeld.server.engine import Engine
from modeld.server.memory import MemoryManager
from modeld.server.metrics import Metrics
from modeld.server.repository import ModelRepository
from polling import wait_until_async


class ScriptedLanguageModel(GenerativeModel):
    """Streams `owner.tokens` tokens, then a final event (a failure's when
    `owner.fail` is set); a stream waits before each token while `owner.gate` is closed."""

    def __init__(self, owner: ScriptedGenerationBackend) -> None:
        self.owner, self.loop, self.runner = owner, None, None
        self.nbytes = 100
        self.inputs, self.outputs = (TensorSpec("text_input", "BYTES", (1,)),), (TensorSpec("text_output", "BYTES", (1,)),)

    def set_observer(self, observer) -> None:
        pass

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def generate(self, request):
        owner = self.owner
        owner.started += 1
        try:
            for i in range(owner.tokens):
                await owner.gate.wait()
                yield TokenEvent((i,), f"t{i}")
            usage = Usage(prompt_tokens=1, completion_tokens=owner.tokens)
            if owner.fail:
                yield FinalEvent(FinishReason.ERROR, usage, "the runtime fell over", ErrorKind.UNAVAILABLE)
            else:
                yield FinalEvent(FinishReason.LENGTH, usage)
        finally:
            owner.closed += 1

    def unload(self) -> None:
        pass


class ScriptedGenerationBackend(Backend):
    name, priority = "scripted", 10
    capabilities = frozenset({Capability.GENERATION, Capability.STREAMING})

    def __init__(self) -> None:
        self.tokens, self.fail = 3, False
        self.started = self.closed = 0
        self.gate = asyncio.Event()
        self.gate.set()

    def can_serve(self, config, model_dir) -> Verdict:
        return Verdict.yes()

    def estimate_bytes(self, config, model_dir) -> int:
        return 100

    def load(self, config, model_dir) -> GenerativeModel:
        return ScriptedLanguageModel(self)


@pytest.fixture
def backend(monkeypatch):
    scripted = ScriptedGenerationBackend()
    module = types.ModuleType("scripted_generation")
    module.Scripted = lambda: scripted
    monkeypatch.setitem(sys.modules, "scripted_generation", module)
    monkeypatch.setattr(registry_module, "BACKENDS", {"scripted": "scripted_generation:Scripted"})
    return scripted


def _engine(tmp_path: Path, max_streams: int = 1) -> Engine:
    root = tmp_path / "repo"
    (root / "lm").mkdir(parents=True)
    (root / "lm" / "model.toml").write_text('backends = ["scripted"]\n')
    return Engine(ModelRepository(root, tmp_path / "inline"), BackendRegistry(), MemoryManager(10_000), Metrics(),
                  max_streams=max_streams)


def _request() -> GenerateRequest:
    return GenerateRequest("lm", prompt="hi", params=SamplingParams(max_tokens=3))


def _held(engine: Engine) -> tuple[int, int, int]:
    """(daemon stream slots taken, the model's requests in flight, the call figures' in flight)"""
    key = engine.dispatch.key_for("lm", "")
    served = engine.models.get(key)
    return (engine.dispatch.num_streams, engine.memory.entry(served.key).num_in_flight,
            engine.models.stats(key).num_in_flight)


async def test_a_whole_stream_yields_every_event_and_lets_everything_go(backend, tmp_path):
    engine = _engine(tmp_path)
    events = [e async for e in engine.generate(_request())]
    assert [e.text for e in events[:-1]] == ["t0", "t1", "t2"]
    assert events[-1].finish_reason is FinishReason.LENGTH
    assert _held(engine) == (0, 0, 0) and backend.closed == 1


async def test_nothing_runs_before_the_first_event_is_asked_for(backend, tmp_path):
    engine = _engine(tmp_path)
    stream = engine.generate(_request())
    assert engine.dispatch.num_streams == 0 and backend.started == 0
    await stream.aclose()  # closing one never started holds nothing either
    assert engine.dispatch.num_streams == 0


async def test_the_stream_limit_refuses_a_second_stream_until_the_first_leaves_mid_way(backend, tmp_path):
    engine = _engine(tmp_path, max_streams=1)
    first = engine.generate(_request())
    assert (await anext(first)).text == "t0"
    assert _held(engine) == (1, 1, 1)
    with pytest.raises(ResourceExhausted, match="max_streams=1"):
        await anext(engine.generate(_request()))
    await first.aclose()  # the consumer left: the model's stream is closed too
    assert _held(engine) == (0, 0, 0) and backend.closed == 1
    assert [e async for e in engine.generate(_request())][-1].finish_reason is FinishReason.LENGTH


async def test_a_stream_dropped_after_its_final_event_gives_its_slot_back(backend, tmp_path):
    engine = _engine(tmp_path, max_streams=1)

    async def read_to_the_final_event() -> FinalEvent:
        # as ModelStreamInfer reads it: returns at the final event, never closes the stream
        async for event in engine.generate(_request()):
            if isinstance(event, FinalEvent):
                return event

    assert (await read_to_the_final_event()).finish_reason is FinishReason.LENGTH
    gc.collect()
    await wait_until_async(lambda: _held(engine) == (0, 0, 0), 10, "the dropped stream to let go")
    assert backend.closed == 1
    assert (await read_to_the_final_event()).finish_reason is FinishReason.LENGTH


async def test_a_cancelled_consumer_lets_go_of_everything(backend, tmp_path):
    engine = _engine(tmp_path, max_streams=1)
    backend.gate.clear()  # the first token never comes

    async def consume() -> None:
        async for _ in engine.generate(_request()):
            pass

    task = asyncio.create_task(consume())
    await wait_until_async(lambda: backend.started == 1, 10, "the model's stream to start")
    assert _held(engine) == (1, 1, 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert _held(engine) == (0, 0, 0) and backend.closed == 1


async def test_a_failure_s_final_event_comes_before_its_error_and_counts_once(backend, tmp_path):
    engine = _engine(tmp_path)
    backend.fail = True
    seen = []
    with pytest.raises(Unavailable, match="the runtime fell over"):
        async for event in engine.generate(_request()):
            seen.append(event)
    assert [type(e) for e in seen] == [TokenEvent] * 3 + [FinalEvent] and seen[-1].error
    key = engine.dispatch.key_for("lm", "")
    stats = engine.models.stats(key)
    assert stats.num_server_failures == 1 and stats.fail.count == 1 and stats.success.count == 0
    assert _held(engine) == (0, 0, 0)
