"""Constraints and the sampling extensions through the engine to remote
servers on loopback: the wire-format servers of tests/remote_fakes.py
receive each in their engine's own fields (they follow the engines' API
documentation; SGLang's and TGI's servers need CUDA), what an engine's API
lacks is refused naming it before anything is sent, and llama-cpp-python's
real server honours a GBNF grammar and a JSON schema sent by modeld (slow:
it loads the GGUF)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from modeld.backends.errors import Unimplemented
from modeld.backends.generation.params import (
    ChatMessage, Constraint, ConstraintKind, FinishReason, GenerateRequest, SamplingParams,
)
from modeld.backends.registry import BackendRegistry
from modeld.server.engine import Engine
from modeld.server.memory import MemoryManager
from modeld.server.metrics import Metrics
from modeld.server.repository import ModelRepository
from remote_fakes import FakeEngine, LlamaCppPythonServer

ROOT = Path(__file__).resolve().parents[2]
GGUF = ROOT / "models/smollm2/model.gguf"
REGISTRY = BackendRegistry()
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12}}, "required": ["answer"]}
PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.1, logit_bias=((5, -2.0),),
                 min_tokens=1)


@pytest.fixture
def fake(request):
    server = FakeEngine(request.param).start()
    yield server
    server.stop()


def _engine(tmp_path: Path) -> Engine:
    return Engine(ModelRepository(tmp_path / "repo", tmp_path / "inline"), REGISTRY, MemoryManager(2**31), Metrics())


async def _load(engine: Engine, url: str, engine_name: str, model: str, backend: str) -> None:
    config = {"format": "remote", "backends": [backend],
              "remote": {"engine": engine_name, "url": url, "model": model, "timeout_s": 120}}
    engine.repository.add_inline("m", json.dumps(config), {})
    await engine.load("m")


async def _generate(engine: Engine, messages: bool = False, prompt: str = "Hello", **params):
    request = GenerateRequest("m", **({"messages": (ChatMessage("user", "Hi"),)} if messages else {"prompt": prompt}),
                              params=SamplingParams(**{"max_tokens": 3, **params}))
    events = [e async for e in engine.generate(request)]
    return "".join(e.text for e in events[:-1]), events[-1]


@pytest.mark.parametrize("fake", ["vllm"], indirect=True)
async def test_vllm_receives_structured_outputs_and_the_penalties(fake, tmp_path):
    engine = _engine(tmp_path)
    await _load(engine, fake.url, "vllm", fake.model, "vllm")
    await _generate(engine, constraint=Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA)), **PENALTIES)
    sent = fake.bodies("/v1/completions")[-1]
    assert sent["structured_outputs"] == {"json": SCHEMA}
    assert (sent["presence_penalty"], sent["frequency_penalty"], sent["repetition_penalty"], sent["logit_bias"],
            sent["min_tokens"]) == (0.5, 0.25, 1.1, {"5": -2.0}, 1)
    await _generate(engine, constraint=Constraint(ConstraintKind.CHOICE, json.dumps(["a", "b"])))
    assert fake.bodies("/v1/completions")[-1]["structured_outputs"] == {"choice": ["a", "b"]}
    await engine.stop()


@pytest.mark.parametrize("fake", ["sglang"], indirect=True)
async def test_sglang_receives_its_sampling_params(fake, tmp_path):
    engine = _engine(tmp_path)
    await _load(engine, fake.url, "sglang", fake.model, "sglang")
    await _generate(engine, constraint=Constraint(ConstraintKind.REGEX, "[a-z]+"), **PENALTIES)
    sampling = fake.bodies("/generate")[-1]["sampling_params"]
    assert sampling["regex"] == "[a-z]+" and sampling["min_new_tokens"] == 1 and sampling["presence_penalty"] == 0.5
    with pytest.raises(Unimplemented, match="SGLang"):
        await _generate(engine, constraint=Constraint(ConstraintKind.LARK, 'start: "a"'))
    await engine.stop()


@pytest.mark.parametrize("fake", ["tgi"], indirect=True)
async def test_tgi_receives_its_grammar_and_refuses_what_it_lacks(fake, tmp_path):
    engine = _engine(tmp_path)
    await _load(engine, fake.url, "tgi", fake.model, "tgi")
    await _generate(engine, constraint=Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA)),
                    repetition_penalty=1.2)
    parameters = fake.bodies("/generate_stream")[-1]["parameters"]
    assert parameters["grammar"] == {"type": "json", "value": SCHEMA} and parameters["repetition_penalty"] == 1.2
    before = len(fake.bodies("/generate_stream"))
    for params in (dict(logit_bias=((1, 1.0),)), dict(presence_penalty=0.5),
                   dict(constraint=Constraint(ConstraintKind.GBNF, 'root ::= "a"'))):
        with pytest.raises(Unimplemented, match="TGI"):
            await _generate(engine, **params)
    assert len(fake.bodies("/generate_stream")) == before  # refused before anything was sent
    await engine.stop()


@pytest.mark.slow
async def test_llama_cpp_python_honours_a_grammar_and_a_schema_sent_through_modeld(tmp_path):
    if not GGUF.is_file():
        pytest.skip("models/smollm2/model.gguf is missing: run `make models`")
    server = LlamaCppPythonServer(GGUF.resolve(), tmp_path / "server.log").start()
    try:
        engine = _engine(tmp_path)
        await _load(engine, server.url, "openai", server.model_id, "openai")
        text, final = await _generate(engine, max_tokens=8,
                                      constraint=Constraint(ConstraintKind.GBNF, 'root ::= " yes" | " no"'))
        assert text in (" yes", " no") and final.finish_reason is FinishReason.STOP
        text, final = await _generate(engine, messages=True, max_tokens=48,
                                      constraint=Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA)))
        assert isinstance(json.loads(text)["answer"], str), text
        repeating = "one two one two one two one two one two"
        text, _ = await _generate(engine, prompt=repeating, max_tokens=8, frequency_penalty=2.0)
        plain, _ = await _generate(engine, prompt=repeating, max_tokens=8)
        assert text != plain  # the penalty reached the server
        with pytest.raises(Unimplemented, match="regex"):
            await _generate(engine, constraint=Constraint(ConstraintKind.REGEX, "[0-9]+"))
        await engine.stop()
    finally:
        server.kill()
