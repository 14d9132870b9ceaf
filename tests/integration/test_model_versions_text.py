"""A language model's versions on the KServe text path: ModelInfer (gRPC
and REST) and ModelStreamInfer with `text_input` and a `model_version` run
on that version, as the tensor path does (test_model_versions.py). Version
1 is SmolLM2-135M at Q4_1 and version 2 the same model requantized to
Q4_0 (the draft model's file), so each version's greedy answer is checked
against the model it holds, served on its own by the same daemon."""

from __future__ import annotations

import queue

import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from daemon import MODELS, start_daemon

PROMPT = b"The capital of France is"
PARAMS = {"max_tokens": 8, "top_k": 1}  # greedy: the answer is the model's own
LLAMACPP = "[llamacpp]\nn_ctx = 1024\nn_slots = 1\ncontext_length = 1024\nn_threads = 1\n"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("versions-text")
    folder = root / "lm"
    for version, source in ((1, "smollm2"), (2, "smollm2-draft")):
        (folder / str(version)).mkdir(parents=True)
        (folder / str(version) / "model.gguf").symlink_to((MODELS / source / "model.gguf").resolve())
    (folder / "model.toml").write_text('format = "gguf"\nbackends = ["llamacpp"]\nversion_policy = "all"\n' + LLAMACPP)
    for version, source in ((1, "v1-alone"), (2, "v2-alone")):  # each file served as a model of its own
        (root / source).mkdir()
        (root / source / "model.gguf").symlink_to((folder / str(version) / "model.gguf").resolve())
        (root / source / "model.toml").write_text('format = "gguf"\nbackends = ["llamacpp"]\n' + LLAMACPP)
    process = start_daemon("--no-preload", repository=root)
    yield process
    process.stop()


@pytest.fixture()
def client(daemon):
    with tc.InferenceServerClient(daemon.address) as client:
        yield client


def _prompt(module=tc):
    prompt = module.InferInput("text_input", [1], "BYTES")
    prompt.set_data_from_numpy(np.array([PROMPT], dtype=object))
    return prompt


def grpc_text(client, model: str, version: str = "") -> tuple[str, str]:
    result = client.infer(model, [_prompt()], model_version=version, parameters=PARAMS)
    return result.as_numpy("text_output")[0].decode(), result.get_response().model_version


def _successes(client, version: str) -> int:
    return client.get_inference_statistics("lm", version).model_stats[0].inference_stats.success.count


def test_model_version_picks_the_version_that_generates(client):
    alone = {v: grpc_text(client, f"v{v}-alone")[0] for v in ("1", "2")}
    one, two = _successes(client, "1"), _successes(client, "2")
    assert grpc_text(client, "lm", "1") == (alone["1"], "1")
    assert (_successes(client, "1"), _successes(client, "2")) == (one + 1, two)
    assert grpc_text(client, "lm", "2") == (alone["2"], "2")
    assert (_successes(client, "1"), _successes(client, "2")) == (one + 1, two + 1)
    # no version: the highest the policy serves
    assert grpc_text(client, "lm") == (alone["2"], "2")


def test_rest_text_infer_honours_the_version(daemon, client):
    alone = grpc_text(client, "v1-alone")[0]
    http = th.InferenceServerClient(daemon.http_url.removeprefix("http://"))
    try:
        result = http.infer("lm", [_prompt(th)], model_version="1", parameters=PARAMS)
        assert result.as_numpy("text_output")[0].decode() == alone
        assert result.get_response()["model_version"] == "1"
    finally:
        http.close()


def test_streamed_text_runs_on_the_version_asked_for(client):
    expected = grpc_text(client, "v1-alone")[0]
    before = _successes(client, "1")
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        client.async_stream_infer("lm", [_prompt()], model_version="1", parameters=PARAMS)
        chunks, versions = [], set()
        while True:
            result, error = answers.get(timeout=120)
            assert error is None, error
            response = result.get_response()
            versions.add(response.model_version)
            if response.outputs:
                chunks.append(result.as_numpy("text_output")[0].decode())
            if response.parameters["triton_final_response"].bool_param:
                break
    finally:
        client.stop_stream()
    assert "".join(chunks) == expected and versions == {"1"}
    assert _successes(client, "1") == before + 1


def test_a_version_the_model_does_not_serve_is_not_found(client):
    with pytest.raises(InferenceServerException) as caught:
        grpc_text(client, "lm", "3")
    assert "StatusCode.NOT_FOUND" in str(caught.value.status()) and "1, 2" in caught.value.message()
