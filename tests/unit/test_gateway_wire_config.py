"""The gateway's wire reader (model names read off serialized requests) and
its settings (flags over a TOML file over defaults)."""

from __future__ import annotations

import numpy as np
import pytest

from modeld.clients.client import build_infer_request
from modeld.gen import generation_pb2 as gen
from modeld.gen import inference_pb2 as pb
from modeld.server.gateway import wire
from modeld.server.gateway.config import GatewayConfigError, load_gateway_settings


def test_the_model_name_is_read_off_real_requests():
    infer = build_infer_request("minilm", {"text": np.array(["a", "b"], dtype=object)}).SerializeToString()
    assert wire.string_field(infer, 1) == "minilm"
    # fields before and after the name, of every wire type proto3 writes
    request = pb.ModelInferRequest(id="r1", model_version="3", model_name="ünïcode-model")
    request.parameters["priority"].int64_param = 7
    request.raw_input_contents.append(b"\x00" * 100)
    assert wire.string_field(request.SerializeToString(), 1) == "ünïcode-model"
    assert wire.string_field(request.SerializeToString(), 3) == "r1"
    load = pb.RepositoryModelLoadRequest(model_name="m").SerializeToString()
    assert wire.string_field(load, 2) == "m" and wire.string_field(load, 1) == ""
    assert wire.string_field(gen.TokenizeRequest(model="smollm2", text="hi").SerializeToString(), 1) == "smollm2"
    assert wire.string_field(b"", 1) == ""


@pytest.mark.parametrize("data", [
    b"\x0a\xff\xff\xff\xff\x0f",  # a length past the end
    b"\x0a\x05abc",  # truncated string
    b"\x08",  # a varint cut short
    b"\x0b\x00",  # group start: proto3 never writes it
    b"\x00\x01",  # field number 0
    b"\x0a\x02\xff\xfe",  # not UTF-8
    b"\x09\x00\x00",  # a fixed64 cut short
])
def test_malformed_bytes_are_refused(data):
    with pytest.raises(wire.WireError):
        wire.string_field(data, 1)


def test_settings_take_flags_over_the_file_over_defaults(tmp_path):
    config = tmp_path / "gateway.toml"
    config.write_text('[gateway]\nreplicas = 3\nhedge_models = ["minilm"]\nhedge_ratio = 0.1\n'
                      '[gateway.breaker]\nconsecutive_failures = 3\n[gateway.weights]\nerrors = 1\n')
    s = load_gateway_settings({"nodes": ["127.0.0.1:1", "127.0.0.1:2"], "replicas": 2, "grpc_port": None},
                              config_file=config)
    assert s.nodes == ("127.0.0.1:1", "127.0.0.1:2") and s.replicas == 2  # the flag wins
    assert s.hedge_models == ("minilm",) and s.hedge_ratio == 0.1 and s.grpc_port == 8001
    assert s.breaker.consecutive_failures == 3 and s.weights.errors == 1.0 and s.weights.latency == 0.3


@pytest.mark.parametrize("flags, text, message", [
    ({}, "", "--node HOST:PORT"),
    ({"nodes": ["a:1"], "dns": "b:2"}, "", "one of the two"),
    ({"nodes": ["no-port"]}, "", "not HOST:PORT"),
    ({"dns": "svc:99999"}, "", "not HOST:PORT"),
    ({"nodes": ["a:1"], "replicas": 0}, "", "at least 1"),
    ({"nodes": ["a:1"]}, "[gateway]\nreplica = 2\n", "unknown key gateway.replica"),
    ({"nodes": ["a:1"]}, "[gateway]\nreplicas = 'two'\n", "gateway.replicas must be int"),
    ({"nodes": ["a:1"]}, "[gateway]\nhedge_ratio = 2.0\n", "hedge_ratio"),
    ({"nodes": ["a:1"]}, "[gateway]\nload_bound = 0.9\n", "load_bound"),
    ({"nodes": ["a:1"]}, "[gateway.breaker]\nwindow = 3\n", "unknown key gateway.breaker.window"),
    ({"nodes": ["a:1"]}, "[gateway\n", "cannot read"),
    ({"nodes": ["a:1"]}, "[gateway.breaker]\nerror_rate = 3.0\n", "gateway.breaker:"),
])
def test_bad_settings_are_refused_with_the_reason(tmp_path, flags, text, message):
    config = tmp_path / "gateway.toml"
    config.write_text(text)
    with pytest.raises(GatewayConfigError) as err:
        load_gateway_settings(flags, config_file=config if text else None)
    assert message in str(err.value)
