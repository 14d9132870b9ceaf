"""The iree backend through a real daemon: minilm compiled by IREE against
onnxruntime, a graph IREE refuses served by onnxruntime with the fallback
counted once, and the compiled module cached in the daemon's own cache
directory (iree_cache_dir), never in the model's folder.

One daemon for the module, on a repository in a temp folder whose models
name `backends = ["iree", "onnx"]`, its cache in another temp folder;
minilm compiles once (15-60 s on a shared 2-core machine).
"""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from daemon import MODELS, ROOT, start_daemon

SENTENCES = [
    "The cat sits on the mat.",
    "modeld serves many models from one process.",
    "Ünïcödé text works too ✓",
    "A long sentence about compilers, " * 12 + "which pads every shorter sentence in its bucket.",
    "Short.",
] * 4
IREE_FIRST = 'backends = ["iree", "onnx"]'


def _unique_graph() -> bytes:
    """y = the distinct values of x, sorted: onnxruntime runs Unique, IREE's
    ONNX lowering has no pattern for it (found by trying)."""
    graph = helper.make_graph(
        [helper.make_node("Unique", ["x"], ["y"], sorted=1)], "unique",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def _add_graph() -> bytes:
    """z = a + b, both [batch, n]: the two inputs share the named dimension n."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["z"])], "add_shared",
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", "n"]) for name in ("a", "b")],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", "n"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def _repository(root: Path) -> Path:
    minilm = root / "minilm"
    minilm.mkdir()
    for name in ("model.onnx", "tokenizer.json"):
        (minilm / name).symlink_to(MODELS / "minilm" / name)
    toml = (MODELS / "minilm" / "model.toml").read_text()
    (minilm / "model.toml").write_text(re.sub(r"(?m)^backends = .*$", IREE_FIRST, toml))
    for name, graph, batching in (("unique_demo", _unique_graph(), ""),
                                  ("add_shared", _add_graph(), "[batching]\nmax_batch_size = 8\n")):
        (root / name).mkdir()
        (root / name / "model.onnx").write_bytes(graph)
        (root / name / "model.toml").write_text(f'format = "onnx"\n{IREE_FIRST}\n{batching}')
    return root


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    return _repository(tmp_path_factory.mktemp("iree_repo"))


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("iree_cache") / "modules"


@pytest.fixture(scope="module")
def iree_daemon(repo, cache):
    daemon = start_daemon(repository=repo, env={"MODELD_IREE_CACHE_DIR": str(cache)}, timeout=900)
    yield daemon
    assert daemon.stop() == 0


@pytest.fixture
def client(iree_daemon):
    client = tc.InferenceServerClient(iree_daemon.address)
    yield client
    client.close()


def _text(values: list[str]) -> tc.InferInput:
    tensor = tc.InferInput("text", [len(values)], "BYTES")
    tensor.set_data_from_numpy(np.array([v.encode() for v in values], dtype=object))
    return tensor


def _fp32(name: str, array: np.ndarray) -> tc.InferInput:
    tensor = tc.InferInput(name, list(array.shape), "FP32")
    tensor.set_data_from_numpy(array)
    return tensor


def _metrics(daemon) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics").read().decode()


def _onnxruntime_embeddings(sentences: list[str]) -> np.ndarray:
    """The same files through the onnx backend in this process: its tokenizer
    front end and graph, onnxruntime's arithmetic."""
    from modeld.backends.model_config import load_model_toml
    from modeld.backends.onnx.backend import OnnxBackend

    config = load_model_toml("minilm", MODELS / "minilm" / "model.toml")
    model = OnnxBackend().load(config, MODELS / "minilm")
    try:
        texts = np.array([s.encode() for s in sentences], dtype=object)
        return model.execute({"text": texts}, ("embedding",))["embedding"]
    finally:
        model.unload()


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_minilm_on_iree_matches_onnxruntime(client):
    assert client.get_model_metadata("minilm").platform == "modeld_iree"
    expected = _onnxruntime_embeddings(SENTENCES)
    # one request of every sentence: several length buckets, each one run
    together = client.infer("minilm", [_text(SENTENCES)]).as_numpy("embedding")
    assert together.shape == (len(SENTENCES), 384)
    assert _cosines(together, expected).min() >= 0.999
    # one sentence per request, sent at once: the batcher merges them
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        singles = list(pool.map(lambda s: client.infer("minilm", [_text([s])]).as_numpy("embedding")[0], SENTENCES))
    assert _cosines(np.stack(singles), expected).min() >= 0.999


def test_the_compiled_module_is_cached_in_the_daemons_own_folder(client, iree_daemon, repo, cache):
    assert cache.stat().st_mode & 0o777 == 0o700
    assert not (repo / "minilm" / ".iree-cache").exists()
    first = [e for e in iree_daemon.events("iree_module_loaded") if e["model"] == "minilm"]
    module = Path(first[0]["module"])
    assert module.parent == cache and module.stat().st_size > 50_000_000  # the weights travel in the module
    modules = sorted(cache.glob("*.vmfb"))
    compiled = module.stat().st_mtime_ns
    client.unload_model("minilm")
    client.load_model("minilm")
    loads = [e for e in iree_daemon.events("iree_module_loaded") if e["model"] == "minilm"]
    assert [e["cached"] for e in loads] == [False, True]
    assert loads[0]["compile_s"] > 1 and loads[1]["compile_s"] == 0
    # a reload must not compile again: the module on disk is the one the first load wrote
    # (not a reload faster than the compile, which a busy machine can stretch)
    assert sorted(cache.glob("*.vmfb")) == modules and Path(loads[1]["module"]) == module
    assert module.stat().st_mtime_ns == compiled, "a reload must not compile again"
    assert client.get_model_metadata("minilm").platform == "modeld_iree"


def test_a_graph_iree_refuses_falls_back_to_onnxruntime_once(client, iree_daemon, repo, cache):
    x = np.array([3.0, 1.0, 3.0, 2.0], dtype=np.float32)
    assert client.get_model_metadata("unique_demo").platform == "modeld_onnx"
    np.testing.assert_array_equal(client.infer("unique_demo", [_fp32("x", x)]).as_numpy("y"), [1.0, 2.0, 3.0])
    counted = 'modeld_backend_fallbacks_total{from_backend="iree",model="unique_demo",stage="load"} 1.0'
    assert counted in _metrics(iree_daemon)
    refusals = list(cache.glob("*.refused"))
    assert len(refusals) == 1 and "operator Unique is not supported" in refusals[0].read_text()
    # the refusal is remembered: a reload goes straight to onnx, without
    # compiling again and without counting another fallback
    client.unload_model("unique_demo")
    client.load_model("unique_demo")
    assert client.get_model_metadata("unique_demo").platform == "modeld_onnx"
    assert counted in _metrics(iree_daemon)
    failed = [e for e in iree_daemon.events("backend_load_failed") if e.get("model") == "unique_demo"]
    assert len(failed) == 1 and "Unique" in failed[0]["reason"]


def test_inputs_that_disagree_on_a_named_dimension_are_refused(client):
    assert client.get_model_metadata("add_shared").platform == "modeld_iree"
    a, b = np.ones((2, 3), np.float32), np.full((2, 3), 2.0, np.float32)
    np.testing.assert_array_equal(client.infer("add_shared", [_fp32("a", a), _fp32("b", b)]).as_numpy("z"), a + b)
    with pytest.raises(InferenceServerException) as err:
        client.infer("add_shared", [_fp32("a", a), _fp32("b", np.ones((2, 4), np.float32))])
    assert err.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT) and "'n'" in err.value.message()


def test_the_embedded_minilm_still_defaults_to_onnx():
    # only a model that names iree gets it: the shipped minilm names onnx first
    toml = (ROOT / "models" / "minilm" / "model.toml").read_text()
    assert re.search(r'(?m)^backends = \["onnx"', toml)
