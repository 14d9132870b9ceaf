"""The gateway's weighted traffic splits (server/gateway/split.py): a canary
gets its share, a session keeps its target, bad tables are refused."""

from __future__ import annotations

import random

import pytest

from modeld.gen import generation_pb2, inference_pb2
from modeld.server.gateway import wire
from modeld.server.gateway.split import SplitConfigError, parse_splits, retarget, target_model


def test_a_canary_gets_its_share_and_a_session_keeps_its_target():
    split = parse_splits({"chat": {"chat-v1": 95, "chat-v2": 5}})
    picks = [split.choose("chat", f"session-{i}") for i in range(20_000)]
    share = picks.count("chat-v2") / len(picks)
    assert 0.04 < share < 0.06, share
    assert all(split.choose("chat", f"session-{i}") == picks[i] for i in range(0, 20_000, 97))
    assert split.choose("other", "session-1") == "other"  # an unsplit model is itself


def test_calls_without_a_session_are_drawn_by_weight():
    split = parse_splits({"m": {"a": 1, "b": 3}})
    split._rng = random.Random(7)
    picks = [split.choose("m") for _ in range(8_000)]
    assert 0.72 < picks.count("b") / len(picks) < 0.78


@pytest.mark.parametrize("raw, reason", [
    ({"chat": {}}, "1 to 16 targets"),
    ({"chat": {"a": -1}}, "must be a number >= 0"),
    ({"chat": {"a": 0, "b": 0}}, "add up to 0"),
    ({"../x": {"a": 1}}, "not a model name"),
    ({"chat": {"a/b": 1}}, "not a model name"),
    ({"chat": {"a": True}}, "must be a number"),
    ({"chat": {"chat:0": 1}}, "model name and version"),
    ({"chat": {"chat:01": 1}}, "model name and version"),
    ({"chat": {"chat:v2": 1}}, "model name and version"),
    ({"chat": {"chat:": 1}}, "model name and version"),
    ({"chat": {":2": 1}}, "model name and version"),
])
def test_bad_split_tables_are_refused(raw, reason):
    with pytest.raises(SplitConfigError, match=reason):
        parse_splits(raw)


def test_a_request_is_retargeted_with_everything_else_kept():
    request = inference_pb2.ModelInferRequest(model_name="chat", id="r1")
    request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    request.raw_input_contents.append(b"\0" * 16)
    data = request.SerializeToString()
    moved = inference_pb2.ModelInferRequest.FromString(wire.with_string_field(data, 1, "chat-v2"))
    assert moved.model_name == "chat-v2" and moved.id == "r1" and moved.raw_input_contents == [b"\0" * 16]
    assert wire.string_field(wire.with_string_field(data, 1, "chat-v2"), 1) == "chat-v2"  # what routing reads
    long_name = "m" * 300  # a length past one varint byte
    prompt = generation_pb2.GenerateRequest(model="chat", prompt="hello").SerializeToString()
    moved = generation_pb2.GenerateRequest.FromString(wire.with_string_field(prompt, 1, long_name))
    assert moved.model == long_name and moved.prompt == "hello"


def test_the_gateway_settings_read_the_splits_table(tmp_path):
    from modeld.server.gateway.config import GatewayConfigError, load_gateway_settings

    config = tmp_path / "gateway.toml"
    config.write_text('[gateway]\nnodes = ["127.0.0.1:1"]\n[gateway.splits.chat]\nchat-v1 = 95\nchat-v2 = 5\n')
    settings = load_gateway_settings({}, config)
    assert settings.splits.splits["chat"].targets == ("chat-v1", "chat-v2")
    assert "traffic splits for chat" in settings.describe()
    config.write_text('[gateway]\nnodes = ["127.0.0.1:1"]\n[gateway.splits.chat]\nchat-v1 = -1\n')
    with pytest.raises(GatewayConfigError, match="must be a number >= 0"):
        load_gateway_settings({}, config)


def test_a_split_between_versions_sets_the_version_a_kserve_request_left_empty():
    split = parse_splits({"scorer": {"scorer:1": 1, "scorer:2": 1}})
    picks = {split.choose("scorer", f"s-{i}") for i in range(200)}
    assert picks == {"scorer:1", "scorer:2"} and target_model("scorer:2") == "scorer"
    request = inference_pb2.ModelInferRequest(model_name="scorer", id="r1")
    request.raw_input_contents.append(b"\1" * 16)
    data = request.SerializeToString()
    moved = inference_pb2.ModelInferRequest.FromString(retarget(data, 1, "scorer:2", 2))
    assert (moved.model_name, moved.model_version, moved.id) == ("scorer", "2", "r1")
    assert moved.raw_input_contents == [b"\1" * 16]
    # the client's own version wins over the split's
    pinned = inference_pb2.ModelInferRequest(model_name="scorer", model_version="1").SerializeToString()
    assert inference_pb2.ModelInferRequest.FromString(retarget(pinned, 1, "scorer:2", 2)).model_version == "1"
    # a message without a version field (Generate: field 2 is the prompt) gets the model only
    prompt = generation_pb2.GenerateRequest(model="scorer", prompt="hello").SerializeToString()
    moved_prompt = generation_pb2.GenerateRequest.FromString(retarget(prompt, 1, "scorer:2"))
    assert (moved_prompt.model, moved_prompt.prompt) == ("scorer", "hello")
    # a plain-name target leaves the version alone
    assert inference_pb2.ModelInferRequest.FromString(retarget(data, 1, "canary", 2)).model_version == ""
