"""LoRA adapters over a remote vLLM base, against the real vLLM CPU server
(`make test-remote`; the session's server runs with --enable-lora and
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True): modeld loads a peft adapter there
through /v1/load_lora_adapter, its requests run under it (the same greedy
text as vLLM gives asked directly for the adapter, not the base's), and
unloading it in modeld removes it from vLLM; what vLLM cannot serve is
refused naming the engine and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lora_fixtures import RECIPES, hf_base, make_adapter
from modeld.backends.errors import ErrorKind, ModeldError
from modeld.backends.generation.params import GenerateRequest, SamplingParams
from modeld.backends.registry import BackendRegistry
from modeld.server.engine import Engine
from modeld.server.memory import MemoryManager
from modeld.server.metrics import Metrics
from modeld.server.repository import ModelRepository
from remote_setup import remote_config
from vllm_server import SERVED_NAME

pytestmark = pytest.mark.remote

PROMPT = "The capital of France is"
TOKENS = 16


@pytest.fixture(scope="module")
def peft_folder(tmp_path_factory) -> Path:
    """A peft adapter (rank 8 on q and v, random non-zero A and B) in the PEFT layout vLLM reads."""
    folder = tmp_path_factory.mktemp("peft") / RECIPES[0].name
    make_adapter(hf_base(), RECIPES[0], folder)
    return folder


@pytest.fixture
async def engine(vllm, tmp_path):
    engine = Engine(ModelRepository(tmp_path / "repo", tmp_path / "inline"), BackendRegistry(), MemoryManager(2**31),
                    Metrics())
    engine.repository.add_inline("base", json.dumps(remote_config(vllm.url, fallback=False)), {})
    yield engine
    await engine.stop()


def _adapter(engine: Engine, name: str, **keys) -> None:
    folder = engine.repository.root / name
    folder.mkdir(parents=True)
    lines = ['format = "lora"', 'base = "base"'] + [f"{k} = {json.dumps(v)}" for k, v in keys.items()]
    (folder / "model.toml").write_text("\n".join(lines) + "\n")


async def _text(engine: Engine, model: str) -> str:
    request = GenerateRequest(model, prompt=PROMPT, params=SamplingParams(max_tokens=TOKENS, temperature=0.0,
                                                                          ignore_eos=True))
    events = [e async for e in engine.generate(request)]
    assert not events[-1].error, events[-1].error
    return "".join(e.text for e in events[:-1])


def _direct(direct, model: str) -> str:
    reply = direct.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": TOKENS,
                                                 "temperature": 0.0, "ignore_eos": True})
    reply.raise_for_status()
    return reply.json()["choices"][0]["text"]


def _listed(direct) -> dict[str, str | None]:
    return {m["id"]: m.get("parent") for m in direct.get("/v1/models").json()["data"]}


async def test_modeld_loads_the_adapter_on_vllm_runs_under_it_and_unloads_it(engine, direct, peft_folder):
    _adapter(engine, "acme-sql", remote_name="sql-v1", remote_path=str(peft_folder))
    served = await engine.load("acme-sql")
    assert served.backend.name == "vllm" and served.loaded.nbytes == 0
    assert _listed(direct).get("sql-v1") == SERVED_NAME  # vLLM serves it over the base

    adapted = await _text(engine, "acme-sql")
    assert adapted == _direct(direct, "sql-v1")
    assert adapted != await _text(engine, "base") == _direct(direct, SERVED_NAME)

    await engine.unload("acme-sql")
    assert "sql-v1" not in _listed(direct)
    assert await _text(engine, "base") == _direct(direct, SERVED_NAME)


async def test_what_vllm_cannot_serve_is_refused_and_the_base_keeps_serving(engine, direct, tmp_path):
    _adapter(engine, "unknown")  # not on vLLM, and no remote_path
    with pytest.raises(ModeldError) as info:
        await engine.load("unknown")
    assert info.value.kind is ErrorKind.FAILED_PRECONDITION and "--lora-modules unknown=PATH" in str(info.value)

    _adapter(engine, "broken", remote_path=str(tmp_path / "no-such-adapter"))
    with pytest.raises(ModeldError) as info:
        await engine.load("broken")
    assert info.value.kind is ErrorKind.INVALID_ARGUMENT and "remote_path" in str(info.value)
    assert str(tmp_path) not in str(info.value)
    assert "broken" not in _listed(direct)
    assert await _text(engine, "base") == _direct(direct, SERVED_NAME)
