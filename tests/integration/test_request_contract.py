"""What every call gets, over a real daemon: one request id (the client's
x-request-id or a made one) in the logs and the trailing metadata, a
failure counted by model and status, parameters honoured or refused,
timeouts, and language models warmed up before they report ready."""

from __future__ import annotations

import json
import re
import struct
import urllib.request

import grpc
import pytest

from daemon import MODELS
from modeld.backends.generation.params import GenerateRequest, SamplingParams
from modeld.backends.registry import BackendRegistry
from modeld.gen import generation_pb2 as g
from modeld.gen import generation_pb2_grpc as gg
from modeld.gen import inference_pb2 as pb
from modeld.gen import inference_pb2_grpc as pb_grpc
from modeld.server.engine import Engine
from modeld.server.memory import MemoryManager
from modeld.server.metrics import Metrics
from modeld.server.repository import ModelRepository
from modeld.server.requests import ModelState


@pytest.fixture(scope="module")
def channel(daemon):
    with grpc.insecure_channel(daemon.address) as channel:
        yield channel


def _metrics(daemon) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics").read().decode()


def _sample(daemon, name: str, **labels) -> float:
    labels.setdefault("protocol", "grpc")
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    match = re.search(re.escape(f"{name}{{{wanted}}}") + r" ([0-9.e+]+)", _metrics(daemon))
    return float(match.group(1)) if match else 0.0


def _embed_request(text: bytes = b"hello", input_name: str = "text", **parameters) -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(model_name="minilm", id="c1")
    msg.inputs.add(name=input_name, datatype="BYTES", shape=[1])
    msg.raw_input_contents.append(struct.pack("<I", len(text)) + text)
    for key, value in parameters.items():
        if isinstance(value, int):
            msg.parameters[key].int64_param = value
        else:
            msg.parameters[key].string_param = value
    return msg


def _text_request(prompt: str, **parameters) -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(model_name="smollm2", id="t1")
    msg.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    data = prompt.encode()
    msg.raw_input_contents.append(struct.pack("<I", len(data)) + data)
    for key, value in parameters.items():
        if isinstance(value, bool):
            msg.parameters[key].bool_param = value
        else:
            msg.parameters[key].int64_param = value
    return msg


def test_the_clients_request_id_comes_back_and_tags_the_calls_log_lines(daemon, channel):
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    _, call = stub.ModelInfer.with_call(_embed_request(), metadata=[("x-request-id", "it-ok-1")], timeout=30)
    assert ("x-request-id", "it-ok-1") in call.trailing_metadata()
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(_embed_request(input_name="nope"), metadata=[("x-request-id", "it-bad-1")], timeout=30)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert ("x-request-id", "it-bad-1") in err.value.trailing_metadata()
    failed = [e for e in daemon.events("rpc_failed") if e.get("request_id") == "it-bad-1"]
    assert failed and failed[0]["status"] == "INVALID_ARGUMENT"


def test_a_call_without_an_id_gets_a_fresh_one_each_time(channel):
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    ids = set()
    for _ in range(2):
        _, call = stub.ModelInfer.with_call(_embed_request(), timeout=30)
        ids |= {v for k, v in call.trailing_metadata() if k == "x-request-id"}
    assert len(ids) == 2 and all(re.fullmatch(r"[0-9a-f]{16}", i) for i in ids)


def test_failed_calls_are_counted_by_model_and_status(daemon, channel):
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    before = _sample(daemon, "modeld_request_failures_total", model="minilm", status="INVALID_ARGUMENT")
    for _ in range(3):
        with pytest.raises(grpc.RpcError):
            stub.ModelInfer(_embed_request(input_name="nope"), timeout=30)
    after = _sample(daemon, "modeld_request_failures_total", model="minilm", status="INVALID_ARGUMENT")
    assert after - before == 3
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(pb.ModelInferRequest(model_name="no-such-model"), timeout=30)
    assert err.value.code() is grpc.StatusCode.NOT_FOUND
    assert _sample(daemon, "modeld_request_failures_total", model="", status="NOT_FOUND") >= 1


def test_a_parameter_a_tensor_model_does_not_understand_is_refused(channel):
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(_embed_request(temperature="0.5"), timeout=30)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "temperature" in err.value.details()
    response = stub.ModelInfer(_embed_request(priority=1, timeout=30_000_000), timeout=30)
    assert response.outputs[0].name == "embedding"


def test_language_model_calls_count_as_requests_with_latency(daemon, channel):
    stub = gg.GenerationStub(channel)
    labels = {"model": "smollm2", "backend": "llamacpp"}
    before = (_sample(daemon, "modeld_requests_total", **labels),
              _sample(daemon, "modeld_request_seconds_count", **labels))
    list(stub.Generate(g.GenerateRequest(model="smollm2", prompt="Hi", sampling=g.SamplingParams(max_tokens=2)),
                       timeout=120))
    after = (_sample(daemon, "modeld_requests_total", **labels),
             _sample(daemon, "modeld_request_seconds_count", **labels))
    assert after[0] - before[0] == 1 and after[1] - before[1] == 1


def test_an_unknown_speculative_mode_is_invalid_argument(channel):
    stub = gg.GenerationStub(channel)
    request = g.GenerateRequest(model="smollm2", prompt="Hi", sampling=g.SamplingParams(max_tokens=2))
    request.sampling.speculative = 7  # a value this daemon's proto does not know
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request, timeout=60))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "speculative" in err.value.details()


def test_kserve_timeout_ends_a_long_generation_with_deadline_exceeded_and_serving_goes_on(daemon, channel):
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(_text_request("Count to a thousand:", max_tokens=1500, ignore_eos=True, timeout=300_000),
                        timeout=120)
    assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED and "timeout" in err.value.details()
    response = stub.ModelInfer(_text_request("Hello", max_tokens=2), timeout=120)
    assert response.parameters["completion_tokens"].int64_param == 2


def test_kserve_logprobs_equal_the_generation_services(channel):
    prompt = "The capital of France is"
    response = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
        _text_request(prompt, max_tokens=4, logprobs=2, cache_prompt=False), timeout=120)
    entries = json.loads(response.parameters["logprobs"].string_param)
    streamed = list(gg.GenerationStub(channel).Generate(g.GenerateRequest(
        model="smollm2", prompt=prompt, sampling=g.SamplingParams(max_tokens=4, logprobs=2, cache_prompt=False)),
        timeout=120))
    chosen = [lp for r in streamed for lp in r.logprobs]
    tops = [top for r in streamed for top in r.top_logprobs]
    assert [e["token_id"] for e in entries] == [lp.token_id for lp in chosen] and len(entries) == 4
    for entry, lp, top in zip(entries, chosen, tops):
        assert entry["logprob"] == pytest.approx(lp.logprob, abs=1e-4)
        assert [t for t, _ in entry["top"]] == [c.token_id for c in top.candidates]


def test_stream_infer_failures_carry_the_unary_status_and_are_counted(daemon, channel):
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    before = _sample(daemon, "modeld_request_failures_total", model="minilm", status="INVALID_ARGUMENT")
    requests = [_embed_request(), _embed_request(input_name="nope"), _embed_request(temperature="1")]
    call = stub.ModelStreamInfer(iter(requests), metadata=[("x-request-id", "stream-7")], timeout=60)
    answers = list(call)
    errors = sorted(a.error_message for a in answers if a.error_message)
    assert len(answers) == 3 and len(errors) == 2
    assert all(e.startswith("INVALID_ARGUMENT: ") for e in errors)
    assert ("x-request-id", "stream-7") in call.trailing_metadata()
    assert _sample(daemon, "modeld_request_failures_total", model="minilm", status="INVALID_ARGUMENT") - before == 2


async def test_a_language_model_warms_up_before_it_reports_ready_and_the_warm_up_is_not_counted(tmp_path):
    root = tmp_path / "repo"
    (root / "llm").mkdir(parents=True)
    (root / "llm" / "model.gguf").symlink_to((MODELS / "smollm2" / "model.gguf").resolve())
    (root / "llm" / "model.toml").write_text(
        'format = "gguf"\nbackends = ["llamacpp"]\nwarmup = true\n[llamacpp]\nn_ctx = 2048\nn_slots = 2\n')
    engine = Engine(ModelRepository(root, tmp_path / "inline"), BackendRegistry(["llamacpp"]),
                    MemoryManager(2**32), Metrics())
    seen_at_ready = []

    def on_state(name: str, state: ModelState) -> None:
        served = engine.served(name)
        if state is ModelState.READY and served is not None:
            seen_at_ready.append(served.loaded.loop.step_counts.steps)

    engine.add_listener(on_state)
    served = await engine.load("llm")
    assert seen_at_ready and seen_at_ready[0] >= 1  # the one-token generation ran first
    stats = engine.stats("llm")
    assert stats.success.count == 0 and stats.fail.count == 0
    async for _ in engine.generate(GenerateRequest("llm", prompt="Hi", params=SamplingParams(max_tokens=2))):
        pass
    assert engine.stats("llm").success.count == 1
    assert served.loaded.loop.step_counts.steps > seen_at_ready[0]
    await engine.stop()
