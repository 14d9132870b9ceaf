"""The backend contract for the remote engines, through the engine (no
daemon), each against a server: `openai` against llama-cpp-python's real
OpenAI server; `vllm`, `sglang` and `tgi` against servers speaking their
documented wire formats (tests/remote_fakes.py), with a row saying where
the real server is tested (or why it is not).

Load reports 0 bytes, generation streams with usage, what the engine or
server cannot do fails closed with UNIMPLEMENTED and the reason, and a
client that leaves cancels the engine's request.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from capability_table import record

from modeld.backends.base import Capability
from modeld.backends.errors import Unimplemented
from modeld.backends.generation.params import GenerateRequest, SamplingParams
from modeld.backends.registry import BackendRegistry
from modeld.server.engine import Engine
from modeld.server.memory import MemoryManager
from modeld.server.metrics import Metrics
from modeld.server.repository import ModelRepository
from polling import wait_until_async
from remote_fakes import FakeEngine, LlamaCppPythonServer
from test_backend_contract import _NOT_REQUESTABLE, _REQUEST_NEEDING

ROOT = Path(__file__).resolve().parents[2]
GGUF = (ROOT / "models/smollm2/model.gguf").resolve()
REGISTRY = BackendRegistry()
REMOTE_BACKENDS = ["openai", "vllm", "sglang", "tgi"]
REAL_SERVER = {
    "openai": "llama-cpp-python's own server (python -m llama_cpp.server), in this run",
    "vllm": "vLLM's CPU build in tests/remote: `make test-remote` (its own environment, minutes to build)",
    "sglang": ("set MODELD_TEST_SGLANG_URL (tests/integration/test_remote_protocols.py::test_real_server)"
               if os.environ.get("MODELD_TEST_SGLANG_URL") else
               "skipped: SGLang's server needs CUDA; this row ran against its documented wire format"),
    "tgi": ("set MODELD_TEST_TGI_URL (tests/integration/test_remote_protocols.py::test_real_server)"
            if os.environ.get("MODELD_TEST_TGI_URL") else
            "skipped: TGI's server needs CUDA; this row ran against its documented wire format"),
}


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory):
    if not GGUF.is_file():
        pytest.skip("models/smollm2/model.gguf is missing: run `make models`")
    server = LlamaCppPythonServer(GGUF, tmp_path_factory.mktemp("llama") / "server.log").start()
    yield server
    server.kill()


@pytest.fixture
def remote(request, llama_server):
    """(url, engine, model name, how to count the engine's disconnects)."""
    backend = request.param
    if backend == "openai":
        yield llama_server.url, "openai", llama_server.model_id, lambda: llama_server.log().count(
            "Disconnected from client")
        return
    fake = FakeEngine(backend, token_delay_s=0.02).start()
    yield fake.url, backend, fake.model, lambda: fake.num_disconnects
    fake.stop()


def _engine(tmp_path: Path) -> Engine:
    return Engine(ModelRepository(None, tmp_path), REGISTRY, MemoryManager(2**31), Metrics())


async def _collect(engine: Engine, **params):
    request = GenerateRequest("llm", prompt="The capital of France is",
                              params=SamplingParams(**{"max_tokens": 8, **params}))
    events = [e async for e in engine.generate(request)]
    return events[:-1], events[-1]


@pytest.mark.parametrize("remote", REMOTE_BACKENDS, indirect=True)
async def test_remote_backend_contract(remote, tmp_path):
    url, engine_name, model, disconnects = remote
    backend = REGISTRY.get(engine_name).name
    engine = _engine(tmp_path)
    config = {"format": "remote", "backends": [backend], "remote": {"engine": engine_name, "url": url,
                                                                      "model": model}}
    engine.repository.add_inline("llm", json.dumps(config), {})
    served = await engine.load("llm")
    caps = REGISTRY.get(backend).capabilities
    assert served.loaded.nbytes == 0 and engine.memory.used == 0
    record(backend, "load/unload bytes", "0: the engine holds the weights (checked the server serves the model)")
    record(backend, "real server", REAL_SERVER[backend])

    tokens, final = await _collect(engine)
    assert len(tokens) >= 2 and final.usage.completion_tokens >= len(tokens) and not final.error
    assert final.usage.prompt_tokens > 0
    ids = sum(len(t.token_ids) for t in tokens)
    record(backend, "generation", f"yes: {final.usage.completion_tokens} tokens, finish {final.finish_reason.value}")
    record(backend, "streaming", f"yes: {len(tokens)} events; token ids {'streamed' if ids else 'not in the wire format'}")
    for feature, verdict in served.loaded.server_capabilities.items():
        record(backend, f"server: {feature}", verdict)

    for capability in (Capability.CONTINUOUS_BATCHING, Capability.PREFIX_CACHE):
        if capability in caps:
            record(backend, capability.value, "yes: the engine's own (declared for the engine, not observed here)")
    if Capability.PREFIX_CACHE in caps:
        _, again = await _collect(engine)
        record(backend, "prefix_cache", f"the engine's own; it reported {again.usage.cached_prompt_tokens} of "
               f"{again.usage.prompt_tokens} prompt tokens cached on a repeat")
    if Capability.LOGPROBS in caps:
        tokens, _ = await _collect(engine, logprobs=2, max_tokens=3)
        assert all(len(e.logprobs) == len(e.token_ids) for e in tokens) and any(e.top_logprobs for e in tokens)
        record(backend, "logprobs", "yes: token ids with their logprobs and top-n, from the engine")

    failed_closed = 0
    for capability in sorted(set(Capability) - caps, key=lambda c: c.value):
        if capability is Capability.GPU:
            record(backend, capability.value, "not claimed: the engine's server picks its device, unseen from here")
            continue
        if capability in (Capability.CONTINUOUS_BATCHING, Capability.PREFIX_CACHE):
            record(backend, capability.value, "not claimed: any OpenAI-compatible server may or may not (llama-cpp-"
                   "python's serves one request at a time); no request can ask for it")
            continue
        if capability in _NOT_REQUESTABLE:
            record(backend, capability.value, f"no: {_NOT_REQUESTABLE[capability]}")
            continue
        with pytest.raises(Unimplemented) as err:
            await _REQUEST_NEEDING[capability](engine, "llm")
        assert f"backend {backend!r}" in str(err.value) and capability.value in str(err.value)
        record(backend, capability.value, "no: the request fails UNIMPLEMENTED naming it")
        failed_closed += 1
    assert failed_closed >= 4  # tensor inference, sequences, shared memory, per-request speculation

    before = disconnects()
    stream = engine.generate(GenerateRequest("llm", prompt="Count from one to one thousand: one, two,",
                                             params=SamplingParams(max_tokens=400)))
    await stream.__anext__()
    await stream.aclose()  # the client went away
    await wait_until_async(lambda: disconnects() > before, what="the server to see the disconnect")
    assert disconnects() == before + 1
    record(backend, "cancellation", "yes: the HTTP stream closed and the engine dropped the request")

    await engine.unload("llm")
    assert engine.served("llm") is None and engine.memory.used == 0
