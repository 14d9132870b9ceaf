"""Model files that try to reach outside their folder, run native code or
send the daemon's secrets, through a real daemon over RepositoryModelLoad
(inline uploads and repository models alike): each is refused at load with
INVALID_ARGUMENT naming the model and the key, and no error shows an
absolute path.

One daemon for the module, on a repository in a temp folder, that lets
remote models send one variable (MODELD_TEST_ALLOWED_KEY) and not another
(MODELD_TEST_SECRET), both set in its environment.
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tc
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

import onnx_fixtures
from daemon import start_daemon

SECRET = np.arange(4, dtype=np.float32)
# a machine path in a message (a remote engine's route such as /v1/models is none)
_ABSOLUTE = re.compile(r"(?:^|[\s'\"(=])/(?:tmp|home|root|var|etc|opt|usr|srv|work|proc|dev|run|mnt|private)\b")


def _identity_of_external(location: str) -> bytes:
    """y = x + w, where w's four floats are external data at `location`: a
    runtime that follows it hands the file back through y (x = 0)."""
    w = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[4], data_location=TensorProto.EXTERNAL)
    for key, value in (("location", location), ("offset", "0"), ("length", "16")):
        w.external_data.add(key=key, value=value)
    graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "leak",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], initializer=[w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


class _Recorder(BaseHTTPRequestHandler):
    """An OpenAI-compatible engine on loopback that serves model "m" and
    records every request it gets (path and Authorization header)."""

    seen: list[tuple[str, str | None]] = []

    def do_GET(self):  # noqa: N802 - http.server's name
        self.seen.append((self.path, self.headers.get("authorization")))
        if self.path == "/v1/models":
            self._answer(200, {"object": "list", "data": [{"id": "m", "object": "model"}]})
        else:
            self._answer(404, {"error": {"message": "no such route"}})

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def engine():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def outside(tmp_path_factory) -> Path:
    """A folder next to the repository holding what no model may read."""
    folder = tmp_path_factory.mktemp("outside")
    (folder / "secret").write_bytes(SECRET.tobytes())
    return folder


@pytest.fixture(scope="module")
def repo(tmp_path_factory, outside) -> Path:
    root = tmp_path_factory.mktemp("safety_repo")
    linked = root / "linked"
    linked.mkdir()
    (linked / "weights").symlink_to(outside / "secret")  # a link inside the folder that points out
    (linked / "model.onnx").write_bytes(_identity_of_external("weights"))
    (linked / "model.toml").write_text('format = "onnx"\nbackends = ["onnx"]\n')
    return root


@pytest.fixture(scope="module")
def iree_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("iree") / "cache"


@pytest.fixture(scope="module")
def daemon(repo, iree_cache):
    env = {"MODELD_REMOTE_API_KEY_ENVS": "MODELD_TEST_ALLOWED_KEY", "MODELD_TEST_ALLOWED_KEY": "allowed-key",
           "MODELD_TEST_SECRET": "s3cret-value", "MODELD_IREE_CACHE_DIR": str(iree_cache)}
    daemon = start_daemon("--no-preload", repository=repo, env=env)
    yield daemon
    assert daemon.stop() == 0


@pytest.fixture
def client(daemon):
    client = tc.InferenceServerClient(daemon.address)
    yield client
    client.close()


def _refusal(client, name: str, config: dict | None = None, files: dict | None = None) -> str:
    with pytest.raises(InferenceServerException) as err:
        client.load_model(name, config=json.dumps(config) if config is not None else None, files=files)
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT", err.value.message()
    message = err.value.message()
    assert not _ABSOLUTE.search(message), f"an absolute path reached the client: {message}"
    return message


@pytest.mark.parametrize("location", ["../secret", "ABSOLUTE", "sub/../../../secret"])
def test_an_uploaded_graph_whose_external_data_leaves_its_folder_is_refused(client, outside, location):
    location = str(outside / "secret") if location == "ABSOLUTE" else location
    files = {"file:model.onnx": _identity_of_external(location)}
    message = _refusal(client, "leak", {"format": "onnx", "backends": ["onnx"]}, files)
    assert "model 'leak'" in message and "tensor 'w' external data location" in message
    assert str(outside) not in message and "modeld-inline" not in message


def test_a_repository_graph_reading_through_a_symlink_is_refused(client, outside):
    message = _refusal(client, "linked")
    assert "'weights' leaves the model folder (through a symbolic link)" in message
    assert str(outside) not in message


def test_external_data_inside_the_folder_still_loads(client):
    files = {"file:model.onnx": _identity_of_external("data/w.bin"), "file:data/w.bin": SECRET.tobytes()}
    client.load_model("inside", config=json.dumps({"format": "onnx", "backends": ["onnx"]}), files=files)
    x = tc.InferInput("x", [4], "FP32")
    x.set_data_from_numpy(np.zeros(4, np.float32))
    np.testing.assert_array_equal(client.infer("inside", [x]).as_numpy("y"), SECRET)
    client.unload_model("inside")


def test_a_genai_config_naming_a_custom_op_library_is_refused_before_onnxruntime_genai(client):
    genai = {"model": {"type": "llama", "context_length": 64, "decoder": {
        "filename": "model.onnx", "num_hidden_layers": 1, "num_key_value_heads": 1, "head_size": 8,
        "session_options": {"log_id": "x", "custom_ops_library": "libops.so", "provider_options": []}}}}
    files = {"file:model.onnx": onnx_fixtures.add_fp32(), "file:genai_config.json": json.dumps(genai).encode(),
             # not a shared object: had onnxruntime-genai got the config, its error would say so instead
             "file:libops.so": b"\x7fELF not really", "file:tokenizer.json": b"{}"}
    message = _refusal(client, "genai", {"format": "onnx", "backends": ["onnx-genai"]}, files)
    assert "genai_config.json key model.decoder.session_options.custom_ops_library" in message
    assert "onnx_genai_allowed_keys" in message and "ELF" not in message


def test_an_uploaded_iree_cache_is_ignored(client, daemon, tmp_path, iree_cache):
    pytest.importorskip("iree.runtime")
    from modeld.backends.iree.cache import ModuleCache
    from modeld.backends.iree.compiler import compiler_path, toolchain

    if compiler_path() is None:
        pytest.skip("iree-base-compiler is not installed")
    graph = onnx_fixtures.double_int64()
    (tmp_path / "model.onnx").write_bytes(graph)
    chain = toolchain()
    # the key a cache in the model's folder was looked up by
    key = f"{ModuleCache(tmp_path / 'c').digest([tmp_path / 'model.onnx'])}-{chain.version}-{chain.target}"
    files = {"file:model.onnx": graph,
             # what an uploader wants run: a module the daemon did not compile
             f"file:.iree-cache/{key}.vmfb": b"not a module the daemon compiled",
             f"file:.iree-cache/{key}.refused": b"pretend IREE refused it"}
    client.load_model("planted", config=json.dumps({"format": "onnx", "backends": ["iree"]}), files=files)
    result = client.infer("planted", [_int64("x", np.array([[1, 2, 3]], dtype=np.int64))]).as_numpy("y")
    np.testing.assert_array_equal(result, [[2, 4, 6]])
    loads = [e for e in daemon.events("iree_module_loaded") if e["model"] == "planted"]
    assert len(loads) == 1 and not loads[0]["cached"] and Path(loads[0]["module"]).parent == iree_cache
    client.unload_model("planted")


def _int64(name: str, array: np.ndarray) -> tc.InferInput:
    tensor = tc.InferInput(name, list(array.shape), "INT64")
    tensor.set_data_from_numpy(array)
    return tensor


# -- remote engines --------------------------------------------------------------------------------


def _remote(url: str, **remote) -> dict:
    return {"format": "remote", "backends": ["openai"], "remote": {"engine": "openai", "url": url, "model": "m",
                                                                   **remote}}


def test_an_api_key_env_not_on_the_allow_list_is_refused_and_nothing_is_sent(client, engine):
    _Recorder.seen.clear()
    message = _refusal(client, "exfil", _remote(engine, api_key_env="MODELD_TEST_SECRET"))
    assert "api_key_env MODELD_TEST_SECRET is not a variable" in message and "remote_api_key_envs" in message
    assert "s3cret-value" not in message
    assert _Recorder.seen == []
    # the same engine with the allowed variable: the key goes, so the recorder would have seen the other
    client.load_model("keyed", config=json.dumps(_remote(engine, api_key_env="MODELD_TEST_ALLOWED_KEY")))
    assert ("/v1/models", "Bearer allowed-key") in _Recorder.seen
    assert all(auth in (None, "Bearer allowed-key") for _, auth in _Recorder.seen)
    client.unload_model("keyed")


def test_a_key_over_plain_http_to_another_host_is_refused(client):
    message = _refusal(client, "clear", _remote("http://192.0.2.1:9", api_key_env="MODELD_TEST_ALLOWED_KEY"))
    assert "clear text" in message and "allowed-key" not in message


@pytest.mark.parametrize("url", ["http://169.254.169.254/latest", "http://metadata.google.internal",
                                 "http://[fe80::1]:80"])
def test_a_metadata_address_is_refused(client, url):
    assert "link-local or cloud metadata" in _refusal(client, "meta", _remote(url))


def test_a_url_with_userinfo_is_shown_without_it(client):
    message = _refusal(client, "creds", _remote("http://admin:hunter2@169.254.169.254/"))
    assert "hunter2" not in message and "admin" not in message and "http://169.254.169.254/" in message
