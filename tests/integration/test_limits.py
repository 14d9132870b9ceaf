"""Resource limits through a real daemon: the daemon-wide cap on generations
in progress (`max_streams`), the per-model request size cap
(`[limits] max_request_bytes`, default the daemon's `max_request_bytes`)
and gRPC's own message cap (`max_message_bytes`). Each refusal is
RESOURCE_EXHAUSTED naming the limit and its value, and the daemon serves
on."""

from __future__ import annotations

import struct
from pathlib import Path

import grpc
import numpy as np
import pytest

import onnx_fixtures
from daemon import add_small_smollm2, start_daemon
from polling import wait_until
from modeld.backends.errors import InvalidArgument
from modeld.backends.model_config import config_from_dict, config_from_json
from modeld.gen import generation_pb2 as g
from modeld.gen import generation_pb2_grpc as gg
from modeld.gen import inference_pb2 as pb
from modeld.gen import inference_pb2_grpc as pb_grpc
from modeld.server.config import ConfigError, load_settings

DAEMON_CAP = 4096
MESSAGE_CAP = 64 * 1024


def _tensor_model(root: Path, name: str, limits: str = "") -> None:
    (root / name).mkdir()
    (root / name / "model.onnx").write_bytes(onnx_fixtures.add_fp32())
    (root / name / "model.toml").write_text(f'format = "onnx"\nbackends = ["onnx"]\n{limits}\n')


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("repo")
    _tensor_model(root, "plain")
    _tensor_model(root, "capped", '[limits]\nmax_request_bytes = "1KiB"')
    _tensor_model(root, "roomy", '[limits]\nmax_request_bytes = "32KiB"')
    add_small_smollm2(root)
    proc = start_daemon("--max-streams", "2", repository=root,
                        env={"MODELD_MAX_REQUEST_BYTES": str(DAEMON_CAP), "MODELD_MAX_MESSAGE_BYTES": "64KiB",
                             "MODELD_DRAIN_DELAY_S": "0"})
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def channel(daemon):
    with grpc.insecure_channel(daemon.address, options=[("grpc.max_send_message_length", 2**31 - 1)]) as channel:
        yield channel


@pytest.fixture(scope="module")
def stub(channel):
    return pb_grpc.GRPCInferenceServiceStub(channel)


def _rows(model: str, rows: int) -> pb.ModelInferRequest:
    """An FP32 [rows, 4] request: 16 bytes a row plus about 30 of framing."""
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="x", datatype="FP32", shape=[rows, 4])
    request.raw_input_contents.append(np.zeros((rows, 4), np.float32).tobytes())
    return request


def _refusal(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


def _long_generation(stub, max_tokens: int = 1000):
    request = g.GenerateRequest(model="smollm2", prompt="Count from one to a thousand: one, two,",
                                sampling=g.SamplingParams(max_tokens=max_tokens, ignore_eos=True, cache_prompt=False))
    return stub.Generate(request, timeout=120)


def _text_request(prompt: bytes, max_tokens: int = 4) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="smollm2")
    request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(struct.pack("<I", len(prompt)) + prompt)
    request.parameters["max_tokens"].int64_param = max_tokens
    return request


def test_generations_beyond_max_streams_are_resource_exhausted(channel, stub):
    generation = gg.GenerationStub(channel)
    running = [_long_generation(generation) for _ in range(2)]
    try:
        for stream in running:
            next(stream)  # both generations are in progress
        code, details = _refusal(lambda: list(_long_generation(generation, max_tokens=4)))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "daemon stream limit 2 reached (max_streams=2)" in details
        # the KServe text path counts against the same limit
        code, details = _refusal(lambda: stub.ModelInfer(_text_request(b"Hello"), timeout=60))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_streams=2" in details
        # tensor models are not generations: unaffected
        stub.ModelInfer(_rows("plain", 1), timeout=30)
    finally:
        running[0].cancel()

    def one_more():
        try:
            return list(_long_generation(generation, max_tokens=4))
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            return None  # the cancel has not reached the daemon yet: it frees the slot when it does

    # one slot free again: a new generation runs
    done = wait_until(one_more, 60, "the cancelled generation's slot to free")
    assert done[-1].usage.completion_tokens == 4
    running[1].cancel()


def test_a_request_over_its_models_cap_is_resource_exhausted(stub):
    code, details = _refusal(lambda: stub.ModelInfer(_rows("capped", 80), timeout=30))  # about 1.3 KB
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    assert "request size limit 1024" in details and "limits.max_request_bytes" in details
    assert stub.ModelInfer(_rows("capped", 8), timeout=30).outputs[0].shape == [8, 4]


def test_the_daemons_cap_applies_unless_the_model_sets_its_own(stub):
    big = _rows("plain", 400)  # about 6.4 KB: over the daemon's 4 KiB, under roomy's 32 KiB
    code, details = _refusal(lambda: stub.ModelInfer(big, timeout=30))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"daemon's request size limit {DAEMON_CAP}" in details and "max_request_bytes" in details
    big.model_name = "roomy"
    assert stub.ModelInfer(big, timeout=30).outputs[0].shape == [400, 4]


def test_the_cap_covers_generation_and_stream_requests(channel, stub):
    code, details = _refusal(lambda: list(gg.GenerationStub(channel).Generate(
        g.GenerateRequest(model="smollm2", prompt="x" * 5000), timeout=30)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and f"limit {DAEMON_CAP}" in details
    responses = list(stub.ModelStreamInfer(iter([_rows("capped", 80), _rows("capped", 2)]), timeout=30))
    errors = [r.error_message for r in responses if r.error_message]
    assert len(errors) == 1 and errors[0].startswith("RESOURCE_EXHAUSTED:") and "limit 1024" in errors[0]
    assert [r.infer_response.outputs[0].shape for r in responses if not r.error_message] == [[2, 4]]


def test_a_message_over_max_message_bytes_is_refused_by_grpc(stub):
    code, details = _refusal(lambda: stub.ModelInfer(_rows("roomy", 5000), timeout=30))  # 80 KB
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(MESSAGE_CAP) in details  # grpc names its cap: "larger than max (80045 vs. 65536)"
    assert stub.ModelInfer(_rows("roomy", 1), timeout=30).outputs[0].shape == [1, 4]


def test_limits_are_checked_when_read(tmp_path):
    with pytest.raises(InvalidArgument, match="unknown key limits.max_bytes"):
        config_from_dict("m", {"limits": {"max_bytes": 3}})
    with pytest.raises(InvalidArgument, match="limits.max_request_bytes must be a size"):
        config_from_dict("m", {"limits": {"max_request_bytes": "lots"}})
    assert config_from_dict("m", {"limits": {"max_request_bytes": "2KiB"}}).max_request_bytes == 2048
    assert config_from_json("m", '{"limits": {"max_request_bytes": 10}}').max_request_bytes == 10
    with pytest.raises(ConfigError, match="max_request_bytes .* up to max_message_bytes"):
        load_settings({"model_repository": str(tmp_path)}, environ={"MODELD_MAX_REQUEST_BYTES": "1GiB",
                                                                     "MODELD_MAX_MESSAGE_BYTES": "1MiB"})
    with pytest.raises(ConfigError, match="max_streams 0 must be at least 1"):
        load_settings({"model_repository": str(tmp_path), "max_streams": 0}, environ={})
    settings = load_settings({"model_repository": str(tmp_path), "max_streams": 3}, environ={})
    assert settings.max_streams == 3 and settings.max_request_bytes == 0  # 0: max_message_bytes
