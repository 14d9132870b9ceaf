"""Model versions as Triton serves them: numbered folders under one entry,
its version_policy, model_version on every path, checked with the stock
tritonclient over gRPC and HTTP against a real daemon on loopback. Each
version of a model is a different ONNX graph (y = x * version), so every
answer says which version computed it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.http as th
from onnx import TensorProto, helper, numpy_helper
from tritonclient.utils import InferenceServerException

from daemon import start_daemon
from polling import wait_until

X = np.ones((1, 4), dtype=np.float32)


def scale_model(factor: float) -> bytes:
    """y = x * factor for FP32 x of shape [batch, 4]."""
    w = numpy_helper.from_array(np.full(4, factor, dtype=np.float32), "w")
    graph = helper.make_graph([helper.make_node("Mul", ["x", "w"], ["y"])], "scale",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
                              initializer=[w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def versioned_entry(root: Path, name: str, versions: list[int], policy: str | None = None) -> Path:
    folder = root / name
    for version in versions:
        (folder / str(version)).mkdir(parents=True)
        (folder / str(version) / "model.onnx").write_bytes(scale_model(version))
    toml = 'format = "onnx"\n' + (f"version_policy = {policy}\n" if policy else "")
    (folder / "model.toml").write_text(toml)
    return folder


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("versions")
    versioned_entry(root, "latest2", [1, 2, 3], "{ latest = 2 }")
    versioned_entry(root, "every", [1, 2], '"all"')
    versioned_entry(root, "picked", [1, 2, 3], "{ specific = [1, 3] }")
    versioned_entry(root, "default", [1, 2])  # Triton's default policy: latest 1
    (root / "plain").mkdir()
    (root / "plain" / "model.onnx").write_bytes(scale_model(7))
    (root / "plain" / "model.toml").write_text('format = "onnx"\n')
    return root


@pytest.fixture(scope="module")
def daemon(repo):
    process = start_daemon("--no-preload", repository=repo)
    yield process
    process.stop()


@pytest.fixture()
def grpc_client(daemon):
    with tc.InferenceServerClient(daemon.address) as client:
        yield client


@pytest.fixture()
def http_client(daemon):
    client = th.InferenceServerClient(daemon.http_url.removeprefix("http://"))
    yield client
    client.close()


def grpc_infer(client, model: str, version: str = ""):
    inp = tc.InferInput("x", [1, 4], "FP32")
    inp.set_data_from_numpy(X)
    result = client.infer(model, [inp], model_version=version)
    return result.as_numpy("y")[0, 0], result.get_response().model_version


def http_infer(client, model: str, version: str = ""):
    inp = th.InferInput("x", [1, 4], "FP32")
    inp.set_data_from_numpy(X)
    result = client.infer(model, [inp], model_version=version)
    return result.as_numpy("y")[0, 0], result.get_response()["model_version"]


def refusal(call) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        call()
    return caught.value


@pytest.mark.parametrize("infer", [grpc_infer, http_infer], ids=["grpc", "http"])
def test_model_version_picks_the_version_that_computes(infer, grpc_client, http_client):
    client = grpc_client if infer is grpc_infer else http_client
    assert infer(client, "latest2", "2") == (2.0, "2")
    assert infer(client, "latest2", "3") == (3.0, "3")
    assert infer(client, "latest2") == (3.0, "3")  # no version: the highest the policy serves
    assert infer(client, "every", "1") == (1.0, "1")
    assert infer(client, "every") == (2.0, "2")
    assert infer(client, "picked", "1") == (1.0, "1")
    assert infer(client, "picked") == (3.0, "3")
    assert infer(client, "default") == (2.0, "2")
    assert infer(client, "plain") == infer(client, "plain", "1") == (7.0, "1")


def test_a_version_the_policy_does_not_serve_is_not_found_naming_those_it_does(grpc_client, http_client):
    cases = {("latest2", "1"): "it serves versions 2, 3", ("picked", "2"): "it serves versions 1, 3",
             ("default", "1"): "it serves version 2", ("plain", "2"): "it serves version 1",
             ("latest2", "x"): "it serves versions 2, 3", ("latest2", "02"): "it serves versions 2, 3"}
    for (model, version), named in cases.items():
        over_grpc = refusal(lambda: grpc_infer(grpc_client, model, version))
        assert over_grpc.status() == "StatusCode.NOT_FOUND", (model, version, over_grpc)
        assert f"has no version {version!r}" in over_grpc.message() and named in over_grpc.message()
        over_http = refusal(lambda: http_infer(http_client, model, version))
        assert over_http.status() == "404" and named in over_http.message(), (model, version, over_http)
    unknown = refusal(lambda: grpc_infer(grpc_client, "no-such-model", "2"))
    assert unknown.status() == "StatusCode.NOT_FOUND" and "unknown model 'no-such-model'" in unknown.message()


def test_metadata_and_readiness_per_version(grpc_client, http_client):
    grpc_infer(grpc_client, "every", "1")
    grpc_infer(grpc_client, "every", "2")
    meta = grpc_client.get_model_metadata("every", "1")
    assert list(meta.versions) == ["1", "2"]
    assert http_client.get_model_metadata("every", "2")["versions"] == ["1", "2"]
    assert grpc_client.is_model_ready("every", "1") and grpc_client.is_model_ready("every", "2")
    assert http_client.is_model_ready("every", "2")
    assert refusal(lambda: grpc_client.is_model_ready("every", "3")).status() == "StatusCode.NOT_FOUND"
    assert refusal(lambda: http_client.get_model_metadata("latest2", "1")).status() == "404"


def test_repository_index_lists_each_version_with_its_state(grpc_client, http_client):
    grpc_client.unload_model("latest2")
    before = {(m.name, m.version): m.state for m in grpc_client.get_model_repository_index().models}
    assert before[("latest2", "2")] == before[("latest2", "3")] == "UNAVAILABLE"
    assert ("latest2", "1") not in before  # outside its policy
    grpc_infer(grpc_client, "latest2", "2")
    after = {(m["name"], m["version"]): m["state"] for m in http_client.get_model_repository_index()}
    assert after[("latest2", "2")] == "READY" and after[("latest2", "3")] == "UNAVAILABLE"
    assert after[("plain", "1")] in ("READY", "UNAVAILABLE")


def test_load_loads_every_version_the_policy_serves_and_unload_unloads_them(grpc_client):
    grpc_client.unload_model("picked")
    grpc_client.load_model("picked")
    assert grpc_client.is_model_ready("picked", "1") and grpc_client.is_model_ready("picked", "3")
    grpc_client.unload_model("picked")
    assert not grpc_client.is_model_ready("picked", "1") and not grpc_client.is_model_ready("picked", "3")


def test_statistics_are_kept_per_version(grpc_client):
    def count(version: str) -> int:
        stats = grpc_client.get_inference_statistics("every", version).model_stats
        return stats[0].inference_stats.success.count

    grpc_infer(grpc_client, "every", "1")
    one, two = count("1"), count("2")
    grpc_infer(grpc_client, "every", "2")
    assert (count("1"), count("2")) == (one, two + 1)
    both = grpc_client.get_inference_statistics("every").model_stats
    assert [(s.name, s.version) for s in both] == [("every", "1"), ("every", "2")]


def test_an_inline_model_with_version_folders(grpc_client):
    config = json.dumps({"format": "onnx", "version_policy": {"latest": {"num_versions": 2}}})
    files = {f"file:{v}/model.onnx": scale_model(10 * v) for v in (1, 2, 3)}
    grpc_client.load_model("inline-versions", config=config, files=files)
    try:
        assert grpc_infer(grpc_client, "inline-versions") == (30.0, "3")
        assert grpc_infer(grpc_client, "inline-versions", "2") == (20.0, "2")
        assert "it serves versions 2, 3" in refusal(lambda: grpc_infer(grpc_client, "inline-versions", "1")).message()
    finally:
        grpc_client.unload_model("inline-versions")


def test_a_new_version_folder_becomes_the_default(repo, grpc_client):
    versioned_entry(repo, "growing", [1])
    assert grpc_infer(grpc_client, "growing") == (1.0, "1")
    (repo / "growing" / "2").mkdir()
    (repo / "growing" / "2" / "model.onnx").write_bytes(scale_model(2))
    wait_until(lambda: grpc_infer(grpc_client, "growing") == (2.0, "2"), what="version 2 to serve")
    grpc_client.load_model("growing")  # a load unloads the version that left the policy (latest 1)
    assert grpc_client.is_model_ready("growing", "2")
    states = {(m.name, m.version): m.state for m in grpc_client.get_model_repository_index().models}
    assert ("growing", "1") not in states and states[("growing", "2")] == "READY"
