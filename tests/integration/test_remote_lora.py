"""LoRA adapters over a base on a remote engine (docs/remote.md, "LoRA
adapters"), through the engine, against servers on loopback speaking vLLM's
and SGLang's wire formats (tests/remote_fakes.py): the adapter's requests
name it as the engine serves it, modeld's load and unload reach the
engine's own routes with their documented bodies, and an engine that
cannot pass adapters through is refused naming it. vLLM's real server with
--enable-lora is in tests/remote/test_vllm_lora.py (make test-remote).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from modeld.backends.errors import ErrorKind, ModeldError
from modeld.backends.generation.params import FinishReason, GenerateRequest, SamplingParams
from modeld.backends.registry import BackendRegistry
from modeld.server.engine import Engine
from modeld.server.memory import MemoryManager
from modeld.server.metrics import Metrics
from modeld.server.repository import ModelRepository
from remote_fakes import SCRIPT, FakeEngine, adapter_shift

REGISTRY = BackendRegistry()


def _engine(tmp_path: Path) -> Engine:
    return Engine(ModelRepository(tmp_path / "repo", tmp_path / "inline"), REGISTRY, MemoryManager(2**31), Metrics())


def _base(engine: Engine, fake: FakeEngine, backend: str | None = None, name: str = "base") -> None:
    remote = {"engine": fake.engine, "url": fake.url, "model": fake.model}
    engine.repository.add_inline(name, json.dumps({"format": "remote", "backends": [backend or fake.engine],
                                                   "remote": remote}), {})


def _adapter(engine: Engine, name: str, base: str = "base", **keys) -> Path:
    """A repository adapter whose folder holds its model.toml only: the engine reads its own copy."""
    folder = engine.repository.root / name
    folder.mkdir(parents=True)
    lines = ['format = "lora"', f'base = "{base}"'] + [f"{k} = {json.dumps(v)}" for k, v in keys.items()]
    (folder / "model.toml").write_text("\n".join(lines) + "\n")
    return folder


def _peft_folder(tmp_path: Path, name: str) -> str:
    """Where the engine reads an adapter from (its own file system; here the same one)."""
    folder = tmp_path / "engine-side" / name
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16}))
    return str(folder)


async def _text(engine: Engine, model: str, max_tokens: int = 3) -> str:
    request = GenerateRequest(model, prompt="Hello", params=SamplingParams(max_tokens=max_tokens))
    events = [e async for e in engine.generate(request)]
    assert events[-1].finish_reason is FinishReason.LENGTH, events[-1]
    return "".join(e.text for e in events[:-1])


def _script(shift: int, n: int = 3) -> str:
    return "".join(" " + SCRIPT[(i + shift) % len(SCRIPT)] for i in range(n))


@pytest.fixture
def vllm():
    with FakeEngine("vllm", model="qwen-base", loras={"sql": "/srv/adapters/sql"}) as server:
        yield server


@pytest.fixture
def vllm_runtime():
    with FakeEngine("vllm", model="qwen-base", runtime_lora=True) as server:
        yield server


# -- vLLM ------------------------------------------------------------------------------------


async def test_an_adapter_vllm_serves_already_runs_under_its_remote_name(vllm, tmp_path):
    engine = _engine(tmp_path)
    _base(engine, vllm)
    _adapter(engine, "acme-sql", remote_name="sql")
    served = await engine.load("acme-sql")
    assert served.backend.name == "vllm" and served.loaded.nbytes == 0
    assert engine.models.get("base") is not None  # its base loaded with it

    assert await _text(engine, "acme-sql") == _script(adapter_shift("sql"))
    assert await _text(engine, "base") == _script(0)
    assert [b["model"] for b in vllm.bodies("/v1/completions")] == ["sql", "qwen-base"]
    await engine.unload("acme-sql")  # modeld did not load it there: nothing to unload on the engine
    assert "sql" in vllm.loras and await _text(engine, "base") == _script(0)
    await engine.stop()


async def test_the_remote_name_defaults_to_the_adapters_own_name(tmp_path):
    with FakeEngine("vllm", model="qwen-base", loras={"sql": "/srv/adapters/sql"}) as fake:
        engine = _engine(tmp_path)
        _base(engine, fake)
        _adapter(engine, "sql")
        await engine.load("sql")
        assert await _text(engine, "sql") == _script(adapter_shift("sql"))
        assert fake.bodies("/v1/completions")[-1]["model"] == "sql"
        await engine.stop()


async def test_modeld_loads_and_unloads_the_adapter_through_vllms_runtime_routes(vllm_runtime, tmp_path):
    engine = _engine(tmp_path)
    _base(engine, vllm_runtime)
    path = _peft_folder(tmp_path, "sql")
    _adapter(engine, "acme-sql", remote_name="acme-sql-v2", remote_path=path)
    await engine.load("acme-sql")
    assert vllm_runtime.bodies("/v1/load_lora_adapter") == [{"lora_name": "acme-sql-v2", "lora_path": path}]
    assert vllm_runtime.loras == {"acme-sql-v2": path}

    assert await _text(engine, "acme-sql") == _script(adapter_shift("acme-sql-v2"))
    assert vllm_runtime.bodies("/v1/completions")[-1]["model"] == "acme-sql-v2"

    await engine.unload("acme-sql")
    assert vllm_runtime.bodies("/v1/unload_lora_adapter") == [{"lora_name": "acme-sql-v2"}]
    assert vllm_runtime.loras == {}
    assert await _text(engine, "base") == _script(0)
    await engine.stop()


async def test_unloading_the_base_unloads_its_adapters_from_the_engine(vllm_runtime, tmp_path):
    engine = _engine(tmp_path)
    _base(engine, vllm_runtime)
    for name in ("a1", "a2"):
        _adapter(engine, name, remote_path=_peft_folder(tmp_path, name))
        await engine.load(name)
    assert set(vllm_runtime.loras) == {"a1", "a2"}
    await engine.unload("base")
    assert sorted(b["lora_name"] for b in vllm_runtime.bodies("/v1/unload_lora_adapter")) == ["a1", "a2"]
    assert vllm_runtime.loras == {} and engine.models.get("a1") is None
    await engine.stop()


async def test_an_adapter_vllm_kept_from_an_earlier_run_is_served_and_left_there(vllm_runtime, tmp_path):
    path = _peft_folder(tmp_path, "sql")
    vllm_runtime.loras["sql"] = path  # loaded by a daemon that has since restarted
    engine = _engine(tmp_path)
    _base(engine, vllm_runtime)
    _adapter(engine, "sql", remote_path=path)
    await engine.load("sql")
    assert await _text(engine, "sql") == _script(adapter_shift("sql"))
    await engine.unload("sql")
    assert vllm_runtime.bodies("/v1/unload_lora_adapter") == [] and "sql" in vllm_runtime.loras
    await engine.stop()


async def _refused(engine: Engine, name: str) -> ModeldError:
    with pytest.raises(ModeldError) as info:
        await engine.load(name)
    assert await _text(engine, "base") == _script(0)  # the base keeps serving
    return info.value


async def test_an_adapter_vllm_does_not_serve_is_refused_naming_it_and_the_fix(vllm, tmp_path):
    engine = _engine(tmp_path)
    _base(engine, vllm)
    _adapter(engine, "acme-chat")
    error = await _refused(engine, "acme-chat")
    assert error.kind is ErrorKind.FAILED_PRECONDITION
    message = str(error)
    assert "adapter 'acme-chat'" in message and "vllm engine" in message and "'sql'" in message
    assert "--lora-modules acme-chat=PATH" in message and "remote_path" in message
    await engine.stop()


async def test_a_remote_name_that_is_a_base_model_is_refused(vllm, tmp_path):
    engine = _engine(tmp_path)
    _base(engine, vllm)
    _adapter(engine, "oops", remote_name="qwen-base")
    error = await _refused(engine, "oops")
    assert error.kind is ErrorKind.FAILED_PRECONDITION and "as a base model, not as an adapter" in str(error)
    await engine.stop()


async def test_remote_path_on_a_vllm_without_runtime_lora_is_refused_with_the_setting(vllm, tmp_path):
    engine = _engine(tmp_path)
    _base(engine, vllm)
    _adapter(engine, "acme-sql", remote_path=_peft_folder(tmp_path, "x"))
    error = await _refused(engine, "acme-sql")
    assert error.kind is ErrorKind.FAILED_PRECONDITION
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in str(error) and "adapter 'acme-sql'" in str(error)
    await engine.stop()


async def test_a_remote_path_vllm_cannot_read_is_refused_without_the_path(vllm_runtime, tmp_path):
    engine = _engine(tmp_path)
    _base(engine, vllm_runtime)
    missing = str(tmp_path / "nowhere" / "adapter")
    _adapter(engine, "acme-sql", remote_path=missing)
    error = await _refused(engine, "acme-sql")
    assert error.kind is ErrorKind.INVALID_ARGUMENT
    message = str(error)
    assert "adapter 'acme-sql'" in message and "remote_path" in message and "No adapter found" in message
    assert str(tmp_path) not in message  # a machine path never reaches a caller
    assert vllm_runtime.loras == {}
    await engine.stop()


# -- SGLang ----------------------------------------------------------------------------------


async def test_sglang_runs_an_adapter_by_lora_path_and_loads_it_at_run_time(tmp_path):
    with FakeEngine("sglang", model="qwen-base", loras={"sql": "/srv/sql"}, runtime_lora=True) as fake:
        engine = _engine(tmp_path)
        _base(engine, fake)
        _adapter(engine, "sql")
        path = _peft_folder(tmp_path, "chat")
        _adapter(engine, "acme-chat", remote_name="chat", remote_path=path)
        await engine.load("sql")
        await engine.load("acme-chat")
        assert fake.bodies("/load_lora_adapter") == [{"lora_name": "chat", "lora_path": path}]

        assert await _text(engine, "sql") == _script(adapter_shift("sql"))
        assert await _text(engine, "acme-chat") == _script(adapter_shift("chat"))
        assert await _text(engine, "base") == _script(0)
        streamed = [b for b in fake.bodies("/generate") if b.get("stream")]
        assert [b.get("lora_path") for b in streamed] == ["sql", "chat", None]

        await engine.unload("acme-chat")
        assert fake.bodies("/unload_lora_adapter") == [{"lora_name": "chat"}] and set(fake.loras) == {"sql"}
        await engine.stop()


async def test_an_adapter_sglang_does_not_run_is_refused_naming_it(tmp_path):
    with FakeEngine("sglang", model="qwen-base") as fake:
        engine = _engine(tmp_path)
        _base(engine, fake)
        _adapter(engine, "sql")
        error = await _refused(engine, "sql")
        assert error.kind is ErrorKind.FAILED_PRECONDITION
        assert "sglang engine" in str(error) and "--lora-paths sql=PATH" in str(error)

        _adapter(engine, "chat", remote_path=_peft_folder(tmp_path, "chat"))
        error = await _refused(engine, "chat")  # no /load_lora_adapter on this one
        assert error.kind is ErrorKind.FAILED_PRECONDITION and "/load_lora_adapter" in str(error)
        await engine.stop()


# -- engines that cannot ------------------------------------------------------------------------


@pytest.mark.parametrize("engine_kind, backend", [("tgi", "tgi"), ("openai", "openai"), ("vllm", "openai")])
async def test_an_engine_modeld_cannot_pass_adapters_to_is_refused_naming_it(engine_kind, backend, tmp_path):
    with FakeEngine(engine_kind, model="qwen-base", loras={"sql": "/srv/sql"}) as fake:
        engine = _engine(tmp_path)
        _base(engine, fake, backend)
        _adapter(engine, "sql")
        error = await _refused(engine, "sql")
        assert error.kind is ErrorKind.FAILED_PRECONDITION
        assert f"{backend} backend" in str(error) and "adapter 'sql'" in str(error)
        assert not [b for b in fake.requests if b[1].get("model") == "sql" or "lora_path" in b[1]]
        await engine.stop()
