"""The four remote backends through the engine, against servers on loopback
that speak each engine's documented wire format (tests/remote_fakes.py):
the same parameters, usage and finish reasons as a local model, faults
mapped by meaning, health, fallback to the local file and recovery.

SGLang's and TGI's own servers need CUDA; set MODELD_TEST_SGLANG_URL or
MODELD_TEST_TGI_URL (and MODELD_TEST_SGLANG_MODEL / MODELD_TEST_TGI_MODEL
when the served name is not the model path's last part) to run the
real-server rows against one you have. The openai backend meets a real
server in test_remote_openai.py, vLLM's in tests/remote (make test-remote).
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import httpx
import numpy as np
import pytest

from modeld.backends.errors import (
    ErrorKind, InvalidArgument, ModeldError, NotFound, ResourceExhausted, Unavailable, Unimplemented,
)
from modeld.backends.generation.params import FinalEvent, FinishReason, GenerateRequest, SamplingParams
from modeld.backends.load_policy import LoadPolicy
from modeld.backends.registry import BackendRegistry
from modeld.gen import generation_pb2 as gpb
from modeld.gen import inference_pb2 as ipb
from modeld.server.dataplane import DataPlane
from modeld.server.engine import Engine
from modeld.server.memory import MemoryManager
from modeld.server.metrics import Metrics
from modeld.server.repository import ModelRepository
from modeld.server.requests import ModelState
from modeld.server.services.convert import encode_bytes
from modeld.server.services.generation import event_to_proto, request_from_proto
from modeld.server.services.kserve_text import complete_text
from polling import wait_until_async
from remote_fakes import SCRIPT, FakeEngine, Fault

ROOT = Path(__file__).resolve().parents[2]
GGUF = ROOT / "models/smollm2/model.gguf"
REGISTRY = BackendRegistry()
# (engine the server is, backend that talks to it)
PAIRS = [("vllm", "vllm"), ("openai", "openai"), ("sglang", "sglang"), ("tgi", "tgi")]
WITH_IDS = {"vllm", "sglang", "tgi"}  # backends that report token ids and logprobs
FAST_PROBES = {"probe_interval_s": 0.1, "max_probe_interval_s": 0.4}


@pytest.fixture
def fake(request):
    server = FakeEngine(request.param).start()
    yield server
    server.stop()


def _engine(tmp_path: Path, budget: int = 2**31) -> Engine:
    return Engine(ModelRepository(tmp_path / "repo", tmp_path / "inline"), REGISTRY, MemoryManager(budget), Metrics())


def _config(fake: FakeEngine, backend: str, **remote) -> dict:
    return {"format": "remote", "backends": [backend],
            "remote": {"engine": fake.engine, "url": fake.url, "model": fake.model, **remote}}


async def _load(engine: Engine, fake: FakeEngine, backend: str, name: str = "m", **remote):
    engine.repository.add_inline(name, json.dumps(_config(fake, backend, **remote)), {})
    return await engine.load(name)


def _with_fallback(engine: Engine, fake: FakeEngine, name: str = "m", **remote) -> None:
    """A repository model: the remote first, the local GGUF (a link) after it."""
    folder = engine.repository.root / name
    folder.mkdir(parents=True)
    (folder / "model.gguf").symlink_to(GGUF.resolve())
    remote = {"engine": fake.engine, "url": fake.url, "model": fake.model, **FAST_PROBES, **remote}
    lines = ['format = "remote"', f'backends = ["{fake.engine}", "llamacpp"]', 'artifact = "model.gguf"',
             "[llamacpp]", "n_ctx = 2048", "n_slots = 2", "context_length = 1024", "n_threads = 1", "[remote]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in remote.items()]
    (folder / "model.toml").write_text("\n".join(lines) + "\n")


async def _collect(engine: Engine, model: str = "m", prompt: str = "Hello", **params):
    request = GenerateRequest(model, prompt=prompt, params=SamplingParams(**{"max_tokens": 5, **params}))
    events = [e async for e in engine.generate(request)]
    return events[:-1], events[-1]


def _text(tokens) -> str:
    return "".join(t.text for t in tokens)


# -- generation ------------------------------------------------------------------------------


@pytest.mark.parametrize("fake, backend", PAIRS, indirect=["fake"])
async def test_generation_usage_and_finish_reasons_like_a_local_model(fake, backend, tmp_path):
    engine = _engine(tmp_path)
    served = await _load(engine, fake, backend)
    assert served.backend.name == backend and served.loaded.nbytes == 0 and engine.memory.used == 0

    tokens, final = await _collect(engine, max_tokens=5)
    assert _text(tokens) == "".join(" " + w for w in SCRIPT[:5])
    assert final.finish_reason is FinishReason.LENGTH and not final.error
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (5, 5)
    assert final.usage.time_to_first_token_s > 0
    if backend in WITH_IDS:
        assert [t for e in tokens for t in e.token_ids] == [1000, 1001, 1002, 1003, 1004]

    tokens, final = await _collect(engine, max_tokens=40)  # the toy model ends after 8 words
    assert final.finish_reason is FinishReason.STOP and len(_text(tokens).split()) == 8

    tokens, final = await _collect(engine, max_tokens=40, stop=(" four",))
    assert _text(tokens) == " one two three" and final.finish_reason is FinishReason.STOP
    await engine.stop()


@pytest.mark.parametrize("fake, backend", PAIRS, indirect=["fake"])
async def test_the_kserve_and_generation_services_serve_it_unchanged(fake, backend, tmp_path):
    engine = _engine(tmp_path)
    await _load(engine, fake, backend)
    msg = ipb.ModelInferRequest(model_name="m", id="r1")
    msg.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    msg.raw_input_contents.append(encode_bytes(np.array([b"Hello"], dtype=object)))
    msg.parameters["max_tokens"].int64_param = 3
    response = await complete_text(DataPlane(engine), msg, "r1")
    assert response.parameters["finish_reason"].string_param == "length"
    assert response.parameters["completion_tokens"].int64_param == 3
    assert response.raw_output_contents[0][4:].decode() == " one two three"

    proto = gpb.GenerateRequest(model="m", prompt="Hello", sampling=gpb.SamplingParams(max_tokens=2))
    replies = [event_to_proto(e) async for e in engine.generate(request_from_proto(proto))]
    assert "".join(r.text for r in replies) == " one two"
    assert replies[-1].finish_reason == gpb.FINISH_REASON_LENGTH and replies[-1].usage.completion_tokens == 2
    await engine.stop()


@pytest.mark.parametrize("fake, backend", PAIRS, indirect=["fake"])
async def test_sampling_parameters_reach_the_engine_in_its_own_terms(fake, backend, tmp_path):
    engine = _engine(tmp_path)
    await _load(engine, fake, backend)
    params = {"temperature": 0.5, "top_p": 0.9, "top_k": 0 if backend in ("openai",) else 7, "max_tokens": 3}
    await _collect(engine, **params)
    path = {"vllm": "/v1/completions", "openai": "/v1/completions", "sglang": "/generate",
            "tgi": "/generate_stream"}[backend]
    sent = fake.bodies(path)[-1]
    if backend in ("vllm", "openai"):
        assert (sent["temperature"], sent["top_p"], sent["max_tokens"]) == (0.5, 0.9, 3)
    if backend == "vllm":
        assert sent["top_k"] == 7 and sent["repetition_penalty"] == 1.0
    if backend == "sglang":
        assert sent["sampling_params"]["top_k"] == 7 and sent["sampling_params"]["max_new_tokens"] == 3
    if backend == "tgi":
        assert sent["parameters"]["do_sample"] is True and sent["parameters"]["top_k"] == 7
    await engine.stop()


@pytest.mark.parametrize("fake, backend", PAIRS, indirect=["fake"])
async def test_logprobs_where_the_engine_names_token_ids(fake, backend, tmp_path):
    engine = _engine(tmp_path)
    await _load(engine, fake, backend)
    if backend not in WITH_IDS:
        with pytest.raises(Unimplemented, match="backend 'openai', which lacks logprobs"):
            await _collect(engine, logprobs=2)
        return
    tokens, _ = await _collect(engine, max_tokens=3, logprobs=2)
    chosen = [lp for e in tokens for lp in e.logprobs]
    tops = [top for e in tokens for top in e.top_logprobs]
    assert [c.token_id for c in chosen] == [1000, 1001, 1002]
    assert [c.logprob for c in chosen] == [-0.05, -0.1, -0.15]
    assert all(len(t) == 2 and t[0].token_id == c.token_id and t[0].logprob >= t[1].logprob
               for c, t in zip(chosen, tops))
    await engine.stop()


@pytest.mark.parametrize("fake, backend", PAIRS, indirect=["fake"])
async def test_tokenize_and_detokenize_where_the_server_has_them(fake, backend, tmp_path):
    engine = _engine(tmp_path)
    await _load(engine, fake, backend)
    if backend == "openai":  # an OpenAI server without a schema naming token endpoints
        with pytest.raises(Unimplemented, match="OpenAI API has no tokenize endpoint"):
            await engine.tokenize("m", "Hi")
        return
    assert await engine.tokenize("m", "Hi") == [72, 105]
    if backend == "tgi":
        with pytest.raises(Unimplemented, match="no detokenize endpoint"):
            await engine.detokenize("m", [72, 105])
    else:
        assert await engine.detokenize("m", [72, 105]) == "Hi"
    await engine.stop()


@pytest.mark.parametrize("fake", ["sglang", "tgi"], indirect=True)
async def test_a_server_without_tokenize_says_so(fake, tmp_path):
    fake.has_tokenize = False
    engine = _engine(tmp_path)
    await _load(engine, fake, fake.engine)
    with pytest.raises(Unimplemented, match="has no working /tokenize"):
        await engine.tokenize("m", "Hi")
    await engine.stop()


@pytest.mark.parametrize("fake, backend", PAIRS, indirect=["fake"])
async def test_cancellation_reaches_the_server(fake, backend, tmp_path):
    fake.token_delay_s = 0.05
    engine = _engine(tmp_path)
    await _load(engine, fake, backend)
    stream = engine.generate(GenerateRequest("m", prompt="Hi", params=SamplingParams(max_tokens=8)))
    await stream.__anext__()
    await stream.aclose()  # the client went away
    await wait_until_async(lambda: fake.num_disconnects, what="the fake server to see the disconnect")
    assert fake.num_disconnects == 1 and fake.num_running == 0
    await engine.stop()


@pytest.mark.parametrize("fake", ["vllm"], indirect=True)
async def test_load_figures_reach_the_models_attributes_and_metrics(fake, tmp_path):
    engine = _engine(tmp_path)
    served = await _load(engine, fake, "vllm", **FAST_PROBES)
    await wait_until_async(lambda: served.loaded.load is not None, what="the first load figures")
    assert (served.loaded.num_waiting, served.loaded.kv_cache_usage) == (1, 0.25)
    assert served.generation.latest.kv_capacity == 1600 and served.generation.latest.kv_used == 400
    metrics = engine.metrics
    assert metrics.remote_kv_cache_usage.labels("m", "vllm")._value.get() == 0.25
    assert metrics.remote_prefix_cache_hit_ratio.labels("m", "vllm")._value.get() == 0.25
    assert metrics.remote_healthy.labels("m", "vllm")._value.get() == 1
    await engine.stop()


# -- faults ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fake, backend", PAIRS, indirect=["fake"])
async def test_the_remote_dying_mid_stream_ends_it_with_an_error(fake, backend, tmp_path):
    engine = _engine(tmp_path)
    await _load(engine, fake, backend)
    fake.fault = Fault("die_after", after=2)
    request = GenerateRequest("m", prompt="Hi", params=SamplingParams(max_tokens=6))
    received = []
    with pytest.raises(Unavailable) as err:
        async for event in engine.generate(request):
            received.append(event)
    assert _text(received[:-1]) == " one two"
    final = received[-1]
    assert isinstance(final, FinalEvent) and final.finish_reason is FinishReason.ERROR
    assert "broke off its answer mid-stream" in final.error and "not replayed" in str(err.value)
    assert len([p for p, _ in fake.requests if p != "/tokenize"]) == 1  # never sent again
    await engine.stop()


@pytest.mark.parametrize("fault, words", [
    (Fault("malformed", after=1), "malformed event"),
    (Fault("truncated", after=1), "before saying how the sequence finished"),
    (Fault("error_event", after=1, message="engine out of memory"), "engine out of memory"),
])
@pytest.mark.parametrize("fake, backend", PAIRS, indirect=["fake"])
async def test_a_broken_stream_is_an_error_finish(fake, backend, fault, words, tmp_path):
    engine = _engine(tmp_path)
    await _load(engine, fake, backend)
    fake.fault = fault
    received = []
    with pytest.raises(ModeldError) as err:
        async for event in engine.generate(GenerateRequest("m", prompt="Hi", params=SamplingParams(max_tokens=6))):
            received.append(event)
    assert received[-1].finish_reason is FinishReason.ERROR and words in received[-1].error
    assert err.value.kind is ErrorKind.UNAVAILABLE
    await engine.stop()


@pytest.mark.parametrize("status, error", [(400, InvalidArgument), (422, InvalidArgument), (404, NotFound),
                                           (429, ResourceExhausted), (500, Unavailable), (503, Unavailable)])
@pytest.mark.parametrize("fake, backend", PAIRS, indirect=["fake"])
async def test_http_errors_map_by_meaning_with_the_remotes_message(fake, backend, status, error, tmp_path):
    engine = _engine(tmp_path)
    served = await _load(engine, fake, backend)
    fake.fault = Fault("http", status=status, message=f"scripted {status} reason")
    with pytest.raises(error, match=f"HTTP {status}: scripted {status} reason"):
        await _collect(engine)
    counted = engine.metrics.remote_failures.labels("m", backend, "server_error")._value.get()
    assert counted == (1 if status >= 500 else 0)  # only the engine's own failures count against its health
    assert served.loaded.health.num_failures == (1 if status >= 500 else 0)
    await engine.stop()


@pytest.mark.parametrize("fake", ["vllm"], indirect=True)
async def test_a_stalled_remote_times_out_as_unavailable(fake, tmp_path):
    engine = _engine(tmp_path)
    await _load(engine, fake, "vllm", timeout_s=0.3)
    fake.fault = Fault("stall", seconds=2.0)
    with pytest.raises(Unavailable, match="did not answer within its timeout.*timeout_s is 0.3"):
        await _collect(engine)
    assert engine.metrics.remote_failures.labels("m", "vllm", "timeout")._value.get() == 1
    await engine.stop()


@pytest.mark.parametrize("fake", ["vllm"], indirect=True)
async def test_max_in_flight_is_resource_exhausted(fake, tmp_path):
    fake.token_delay_s = 0.05
    engine = _engine(tmp_path)
    await _load(engine, fake, "vllm", max_in_flight=1)
    first = engine.generate(GenerateRequest("m", prompt="a", params=SamplingParams(max_tokens=10)))
    await first.__anext__()
    with pytest.raises(ResourceExhausted, match="max_in_flight"):
        await _collect(engine)
    await first.aclose()
    await engine.stop()


@pytest.mark.parametrize("fake, backend", PAIRS, indirect=["fake"])
async def test_a_remote_down_at_load_fails_with_the_reason(fake, backend, tmp_path):
    fake.stop()
    engine = _engine(tmp_path)
    engine.repository.add_inline("m", json.dumps(_config(fake, backend)), {})
    with pytest.raises(InvalidArgument, match=f"{backend}: the {fake.engine} engine at {fake.url}.*unreachable"):
        await engine.load("m")


@pytest.mark.parametrize("fake, backend", PAIRS, indirect=["fake"])
async def test_a_server_that_serves_another_model_fails_the_load(fake, backend, tmp_path):
    engine = _engine(tmp_path)
    config = _config(fake, backend)
    config["remote"]["model"] = "not-this-one"
    engine.repository.add_inline("m", json.dumps(config), {})
    with pytest.raises(InvalidArgument, match="'not-this-one'"):
        await engine.load("m")


@pytest.mark.parametrize("fake", ["vllm"], indirect=True)
async def test_a_missing_key_variable_fails_the_load(fake, tmp_path, monkeypatch):
    monkeypatch.delenv("MODELD_TEST_NO_SUCH_KEY", raising=False)
    engine = _engine(tmp_path)
    engine.use_load_policy(LoadPolicy(remote_api_key_envs=frozenset({"MODELD_TEST_NO_SUCH_KEY"})))
    engine.repository.add_inline("m", json.dumps(_config(fake, "vllm", api_key_env="MODELD_TEST_NO_SUCH_KEY")), {})
    with pytest.raises(InvalidArgument, match="MODELD_TEST_NO_SUCH_KEY, which is not set"):
        await engine.load("m")
    monkeypatch.setenv("MODELD_TEST_NO_SUCH_KEY", "k")
    assert (await engine.load("m")).backend.name == "vllm"
    await engine.stop()


async def test_a_url_that_is_not_http_is_refused_before_any_load(tmp_path):
    engine = _engine(tmp_path)
    config = {"format": "remote", "remote": {"engine": "vllm", "url": "file:///etc/passwd"}}
    with pytest.raises(InvalidArgument, match="remote.url must be an http:// or https:// URL"):
        engine.repository.add_inline("m", json.dumps(config), {})


# -- memory, health, fallback ---------------------------------------------------------------------------


@pytest.mark.parametrize("fake", ["vllm"], indirect=True)
async def test_a_remote_model_holds_no_memory_and_is_never_evicted_for_it(fake, tmp_path):
    engine = _engine(tmp_path, budget=1)
    served = await _load(engine, fake, "vllm")
    assert engine.memory.used == 0 and engine.memory.entry(served.key).nbytes == 0
    with pytest.raises(ResourceExhausted):
        engine.memory.plan(2)  # nothing to evict: the remote frees nothing
    assert engine.served("m") is served
    await engine.stop()


@pytest.mark.parametrize("fake", ["vllm"], indirect=True)
async def test_a_remote_down_at_load_falls_back_to_the_local_file(fake, tmp_path):
    engine = _engine(tmp_path)
    _with_fallback(engine, fake)
    fake.stop()
    served = await engine.load("m")
    assert served.backend.name == "llamacpp"
    assert engine.metrics.fallbacks.labels("m", "vllm", "load")._value.get() == 1
    await engine.stop()


@pytest.mark.parametrize("fake", ["vllm"], indirect=True)
async def test_an_unhealthy_remote_falls_back_to_the_local_backend_and_comes_back(fake, tmp_path):
    engine = _engine(tmp_path)
    states = []
    engine.add_listener(lambda name, state: states.append((name, state)))
    _with_fallback(engine, fake)
    served = await engine.load("m")
    assert served.backend.name == "vllm"
    _, final = await _collect(engine)
    assert final.finish_reason is FinishReason.LENGTH

    fake.stop()  # the engine dies
    await wait_until_async(lambda: not served.loaded.is_healthy and served.standby is not None and served.standby.done(),
                           what="the remote marked down and its standby loaded")
    assert ("m", ModelState.UNAVAILABLE) in states  # health turns NOT_SERVING
    assert engine.metrics.remote_healthy.labels("m", "vllm")._value.get() == 0
    tokens, final = await _collect(engine, prompt="The capital of France is", max_tokens=4)
    assert final.finish_reason is FinishReason.LENGTH and _text(tokens).strip()  # the real model answered
    assert engine.metrics.fallbacks.labels("m", "vllm", "run")._value.get() == 1
    assert engine.memory.used > 0  # the standby's weights are in the budget
    assert engine.served("m") is served  # the remote stays the model's backend

    before = len(fake.requests)
    fake.start()  # it is back, on the same port
    await wait_until_async(lambda: served.loaded.is_healthy and served.standby is None and engine.memory.used == 0,
                           what="the remote back and its standby gone")
    assert served.loaded.is_healthy and states[-1] == ("m", ModelState.READY)
    assert engine.memory.used == 0  # the standby left
    _, final = await _collect(engine)
    assert final.finish_reason is FinishReason.LENGTH and len(fake.requests) > before
    await engine.stop()


@pytest.mark.parametrize("fault", [None, Fault("http", status=503)])
@pytest.mark.parametrize("fake", ["vllm"], indirect=True)
async def test_a_request_the_remote_fails_before_its_first_token_is_served_by_the_standby(fake, fault, tmp_path):
    engine = _engine(tmp_path)
    _with_fallback(engine, fake, probe_interval_s=60.0, max_probe_interval_s=60.0)  # no probe sees it first
    served = await engine.load("m")
    if fault is None:
        fake.stop()  # killed: connection refused
    else:
        fake.fault = fault  # one 5xx: still healthy, yet this request need not fail
    tokens, final = await _collect(engine, prompt="The capital of France is", max_tokens=4)
    assert final.finish_reason is FinishReason.LENGTH and _text(tokens).strip()
    assert engine.metrics.fallbacks.labels("m", "vllm", "run")._value.get() == 1
    assert engine.metrics.requests.labels("m", "llamacpp", "grpc")._value.get() == 1
    assert served.loaded.is_healthy is (fault is not None)
    await engine.stop()


async def test_other_models_keep_serving_while_one_remote_is_down(tmp_path):
    with FakeEngine("sglang") as down, FakeEngine("tgi") as up:
        engine = _engine(tmp_path)
        await _load(engine, down, "sglang", name="a")
        await _load(engine, up, "tgi", name="b")
        down.stop()
        with pytest.raises(Unavailable, match="unreachable"):
            await _collect(engine, model="a")
        _, final = await _collect(engine, model="b")
        assert final.finish_reason is FinishReason.LENGTH
        with pytest.raises(Unavailable):  # no standby in its list: the remote itself is tried again
            await _collect(engine, model="a")
        await engine.stop()


# -- real servers (a user's SGLang or TGI) --------------------------------------------------------------


def _real(engine: str) -> tuple[str, str]:
    url = os.environ.get(f"MODELD_TEST_{engine.upper()}_URL", "")
    if not url:
        pytest.skip(f"{engine}'s server needs CUDA and cannot run here; set MODELD_TEST_{engine.upper()}_URL "
                    "to run this row against one")
    model = os.environ.get(f"MODELD_TEST_{engine.upper()}_MODEL", "")
    if not model:
        info = httpx.get(url.rstrip("/") + ("/get_model_info" if engine == "sglang" else "/info"), timeout=10).json()
        model = str(info.get("model_path") or info.get("model_id")).rstrip("/").rsplit("/", 1)[-1]
    return url, model


@pytest.mark.parametrize("engine_name", ["sglang", "tgi"])
async def test_real_server(engine_name, tmp_path):
    url, model = _real(engine_name)
    engine = _engine(tmp_path)
    config = {"format": "remote", "backends": [engine_name], "remote": {"engine": engine_name, "url": url,
                                                                        "model": model}}
    engine.repository.add_inline("m", json.dumps(config), {})
    await engine.load("m")
    tokens, final = await _collect(engine, prompt="The capital of France is", max_tokens=8)
    assert final.finish_reason in (FinishReason.LENGTH, FinishReason.STOP) and final.usage.prompt_tokens > 0
    assert final.usage.completion_tokens == sum(len(t.token_ids) for t in tokens)
    again, _ = await _collect(engine, prompt="The capital of France is", max_tokens=8)
    assert _text(again) == _text(tokens)  # greedy
    text = _text(tokens)
    if len(text.split()) > 2:
        cut = " " + text.split()[1]
        stopped, final = await _collect(engine, prompt="The capital of France is", max_tokens=8, stop=(cut,))
        assert cut not in _text(stopped) and final.finish_reason is FinishReason.STOP
    try:
        ids = await engine.tokenize("m", "Hello world")
        assert ids
    except Unimplemented as exc:
        assert "/tokenize" in str(exc)
    await engine.stop()
