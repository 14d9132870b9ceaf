"""Models from a store, against real stores on loopback: Debian's
docker-registry (OCI), moto's S3 server, and a local server of the Hugging
Face Hub's routes (tests/store_servers.py). Artifacts are pushed by `modeld
push` and by the `oras` library, pulled by a real daemon, loaded and run."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as tc
from onnx import TensorProto, helper, numpy_helper
from tritonclient.utils import InferenceServerException

from daemon import ROOT, start_daemon
from polling import wait_until
from store_servers import S3_ENV, HubServer, start_registry, start_s3


def scale_model(weights: list[float]) -> bytes:
    """y = x * w for FP32 x of shape [batch, 4]."""
    w = numpy_helper.from_array(np.array(weights, dtype=np.float32), "w")
    graph = helper.make_graph([helper.make_node("Mul", ["x", "w"], ["y"])], "scale",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
                              initializer=[w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def model_folder(path: Path, weights: list[float], toml: bool = True) -> Path:
    path.mkdir(parents=True)
    (path / "model.onnx").write_bytes(scale_model(weights))
    if toml:
        (path / "model.toml").write_text('format = "onnx"\n')
    return path


def modeld(*args: str) -> subprocess.CompletedProcess:
    """The `modeld` command line, in this process (a subprocess costs seconds
    of interpreter start on a busy machine); `modeld_process` runs it apart."""
    import contextlib
    import io

    from modeld.server.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's refusals
            code = exc.code
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def modeld_process(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "modeld.server.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def infer(client: tc.InferenceServerClient, model: str) -> np.ndarray:
    x = np.ones((1, 4), dtype=np.float32)
    inp = tc.InferInput("x", [1, 4], "FP32")
    inp.set_data_from_numpy(x)
    return client.infer(model, [inp]).as_numpy("y")


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("stores")
    registry = start_registry(root / "registry")
    s3 = start_s3()
    hub = HubServer(root / "hub")
    yield registry, s3, hub, root
    hub.stop()
    s3.stop()
    registry.stop()


@pytest.fixture(scope="module")
def served(stores):
    registry, s3, hub, root = stores
    # `modeld push` writes the repository entry's artifact
    pushed = modeld("push", str(model_folder(root / "pushed", [1, 2, 3, 4])), registry.uri("models/scale", "v1"),
                    "--plain-http")
    assert pushed.returncode == 0, pushed.stderr
    # the oras library writes another, with no model.toml: the format follows the file
    import oras.client

    oras_folder = model_folder(root / "by-oras", [2, 2, 2, 2], toml=False)
    client = oras.client.OrasClient(hostname=registry.host, insecure=True)
    import os

    here = os.getcwd()
    os.chdir(oras_folder)  # oras names a layer by the path it is given
    try:
        assert client.push(files=["model.onnx"], target=f"{registry.host}/models/by-oras:v1").status_code == 201
    finally:
        os.chdir(here)
    s3.upload("models", "scale/", model_folder(root / "for-s3", [3, 3, 3, 3]))
    model_folder(root / "hub" / "org" / "scale", [4, 4, 4, 4], toml=False)
    (root / "hub" / "org" / "scale" / "config.json").write_text("{}")

    repository = root / "repo"
    (repository / "scale").mkdir(parents=True)
    (repository / "scale" / "model.toml").write_text(f'source = "{registry.uri("models/scale", "v1")}"\n'
                                                     'served_names = ["scale-stable"]\n')
    settings = root / "modeld.toml"
    settings.write_text(f'shutdown_grace_s = 1\nstore_cache_dir = "{root / "cache"}"\nstore_cache_budget = "64MiB"\n'
                        f'store_oci_plain_http = ["{registry.host}"]\n'
                        f'store_s3_endpoint = "{s3.endpoint}"\nstore_s3_addressing_style = "path"\n')
    daemon = start_daemon("--config", str(settings), repository=repository,
                          env={**S3_ENV, "HF_ENDPOINT": hub.endpoint, "HF_HUB_OFFLINE": "0"})
    client = tc.InferenceServerClient(daemon.address)
    yield daemon, client, registry, root, hub
    client.close()
    daemon.stop()


def test_a_repository_entry_serves_what_modeld_push_wrote(served):
    daemon, client, _, _, _ = served
    assert infer(client, "scale").tolist() == [[1, 2, 3, 4]]
    index = {m["name"]: m for m in client.get_model_repository_index(as_json=True)["models"]}
    assert index["scale"]["state"] == "READY"
    metrics = httpx.get(f"http://127.0.0.1:{daemon.metrics_port}/metrics").text
    assert 'modeld_store_pulls_total{outcome="pulled",scheme="oci"}' in metrics


def test_an_inline_load_serves_what_the_oras_library_pushed(served):
    _, client, registry, _, _ = served
    client.load_model("by-oras", config=json.dumps({"source": registry.uri("models/by-oras", "v1")}))
    assert infer(client, "by-oras").tolist() == [[2, 2, 2, 2]]


def test_a_push_with_tar_layers_serves(served, tmp_path):
    _, client, registry, _, _ = served
    uri = registry.uri("models/tarred", "v1")
    pushed = modeld("push", str(model_folder(tmp_path / "tarred", [6, 7, 8, 9])), uri, "--plain-http",
                    "--layers", "tar")
    assert pushed.returncode == 0, pushed.stderr
    client.load_model("tarred", config=json.dumps({"source": uri}))
    assert infer(client, "tarred").tolist() == [[6, 7, 8, 9]]


def test_s3_and_hub_sources_load_through_their_own_clients(served):
    daemon, client, _, _, _ = served
    client.load_model("from-s3", config=json.dumps({"source": "s3://models/scale/"}))
    assert infer(client, "from-s3").tolist() == [[3, 3, 3, 3]]
    # the HTTP load route takes the same config
    answer = httpx.post(f"{daemon.http_url}/v2/repository/models/from-hub/load",
                        json={"parameters": {"config": json.dumps({"source": "hf://org/scale"})}}, timeout=60)
    assert answer.status_code == 200, answer.text
    assert infer(client, "from-hub").tolist() == [[4, 4, 4, 4]]


def test_a_blob_that_does_not_match_its_digest_is_discarded_naming_the_layer(served, tmp_path):
    _, client, registry, root, _ = served
    uri = registry.uri("models/corrupt", "v1")
    assert modeld("push", str(model_folder(tmp_path / "corrupt", [5, 6, 7, 8])), uri, "--plain-http").returncode == 0
    manifest = httpx.get(f"http://{registry.host}/v2/models/corrupt/manifests/v1",
                         headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}).json()
    layer = next(x for x in manifest["layers"] if x["annotations"]["org.opencontainers.image.title"] == "model.onnx")
    stored = registry.blob_file(layer["digest"])
    data = bytearray(stored.read_bytes())
    data[-1] ^= 0xFF  # same length, other bytes: only the digest tells
    stored.write_bytes(bytes(data))
    with pytest.raises(InferenceServerException) as failed:
        client.load_model("corrupt", config=json.dumps({"source": uri}))
    assert failed.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert f"layer {layer['digest'][:19]}" in failed.value.message() and "does not match" in failed.value.message()
    cache = root / "cache"
    assert not (cache / "blobs" / "sha256" / layer["digest"].removeprefix("sha256:")).exists()
    assert list((cache / "partial").iterdir()) == []
    assert infer(client, "scale").tolist() == [[1, 2, 3, 4]]  # every other model keeps serving


def test_unknown_tags_schemes_and_escaping_names_are_refused(served):
    _, client, registry, root, _ = served
    cases = [(registry.uri("models/scale", "nope"), "StatusCode.NOT_FOUND", "has no manifest"),
             ("ftp://example.com/model", "StatusCode.INVALID_ARGUMENT", "'ftp'")]
    # a manifest whose layer names a file outside the model folder
    from modeld.server.store.oci import OciSettings, Registry

    client_registry = Registry(registry.host, OciSettings(plain_http=(registry.host,)))
    blob = b"not a model"
    import hashlib

    digest = "sha256:" + hashlib.sha256(blob).hexdigest()
    client_registry.put_blob("models/escape", digest, blob, len(blob))
    config = b"{}"
    config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
    client_registry.put_blob("models/escape", config_digest, config, len(config))
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.empty.v1+json", "digest": config_digest, "size": 2},
                "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": digest,
                            "size": len(blob), "annotations": {"org.opencontainers.image.title": "../../model.onnx"}}]}
    client_registry.put_manifest("models/escape", "v1", json.dumps(manifest).encode(),
                                 "application/vnd.oci.image.manifest.v1+json")
    client_registry.close()
    cases.append((registry.uri("models/escape", "v1"), "StatusCode.INVALID_ARGUMENT", "would leave the model folder"))
    for uri, status, reason in cases:
        with pytest.raises(InferenceServerException) as failed:
            client.load_model("refused", config=json.dumps({"source": uri}))
        assert failed.value.status() == status, (uri, failed.value.message())
        assert reason in failed.value.message(), (uri, failed.value.message())
    # nothing landed where "../../model.onnx" points from a model folder
    assert not (root / "cache" / "model.onnx").exists() and not (root / "cache" / "models" / "model.onnx").exists()


def test_two_models_naming_one_artifact_pull_it_once(served):
    daemon, client, registry, root, _ = served
    uri = registry.uri("models/shared", "v1")
    assert modeld("push", str(model_folder(root / "shared", [9, 9, 9, 9])), uri, "--plain-http").returncode == 0
    errors: list[Exception] = []

    def load(name: str) -> None:
        try:
            client.load_model(name, config=json.dumps({"source": uri}))
        except Exception as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)
    threads = [threading.Thread(target=load, args=(n,)) for n in ("shared-a", "shared-b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert infer(client, "shared-a").tolist() == infer(client, "shared-b").tolist() == [[9, 9, 9, 9]]
    # one folder in the cache, its blobs stored once
    entries = [json.loads(p.read_text()) for p in (root / "cache" / "models").glob("*.json")]
    assert [e["uri"] for e in entries].count(uri) == 1


def test_a_model_being_pulled_reports_pulling_with_its_bytes(served):
    daemon, client, _, root, hub = served
    folder = model_folder(root / "hub" / "org" / "slow", [0, 1, 2, 3], toml=False)
    size = (folder / "model.onnx").stat().st_size
    hub.hold, hub.hold_file, hub.hold_after = threading.Event(), "model.onnx", 100  # 100 bytes, then held
    loaded: list[object] = []
    loader = threading.Thread(target=lambda: loaded.append(
        client.load_model("slow", config=json.dumps({"source": "hf://org/slow"}))))
    loader.start()
    try:
        def pulling():
            models = client.get_model_repository_index(as_json=True)["models"]
            return next((m for m in models if m["name"] == "slow" and m.get("state") == "PULLING"
                         and f"100 of {size} bytes" in m.get("reason", "")), None)
        wait_until(pulling, what="slow to report PULLING with its bytes")
        from modeld.clients import Client

        with Client(daemon.address) as modeld_client:
            stats = {m.name: m for m in modeld_client.node_stats().models}
        assert stats["slow"].state == "PULLING"
        assert (stats["slow"].pull_bytes_done, stats["slow"].pull_bytes_total) == (100, size)
        listed = httpx.get(f"{daemon.http_url}/v1/models/slow", timeout=10).json()
        assert (listed["state"], listed["ready"]) == ("PULLING", False)
        assert f"100 of {size} bytes" in listed["reason"]
    finally:
        hub.hold.set()
        loader.join()
        hub.hold = None
    assert infer(client, "slow").tolist() == [[0, 1, 2, 3]]


def test_modeld_pull_loads_a_model_into_a_running_daemon(served):
    daemon, client, registry, _, _ = served
    done = modeld_process("pull", registry.uri("models/scale", "v1"), "--name", "by-cli", "--address",
                          daemon.address)
    assert done.returncode == 0, done.stderr
    assert "loaded it as by-cli" in done.stdout
    assert infer(client, "by-cli").tolist() == [[1, 2, 3, 4]]
    refused = modeld("pull", "gs://bucket/model", "--address", daemon.address)
    assert refused.returncode != 0 and "'gs'" in refused.stderr


def test_the_disk_cache_evicts_unused_models_and_refuses_when_all_are_in_use(stores):
    registry, _, _, root = stores
    base = root / "tier"
    uris = {}
    for name, value in (("tier-a", 1.0), ("tier-b", 2.0)):
        folder = model_folder(base / name, [value] * 4, toml=False)
        (folder / "padding.bin").write_bytes(bytes([int(value)]) * 4000)  # 4 KB each, no blob shared
        uris[name] = registry.uri(f"models/{name}", "v1")
        assert modeld("push", str(folder), uris[name], "--plain-http").returncode == 0
    settings = base / "modeld.toml"
    settings.write_text(f'store_cache_dir = "{base / "cache"}"\nstore_cache_budget = 6000\n'
                        f'store_oci_plain_http = ["{registry.host}"]\n')
    (base / "empty").mkdir()
    daemon = start_daemon("--config", str(settings), repository=base / "empty")
    client = tc.InferenceServerClient(daemon.address)
    try:
        client.load_model("tier-a", config=json.dumps({"source": uris["tier-a"]}))
        with pytest.raises(InferenceServerException) as full:  # tier-a is served: its files stay
            client.load_model("tier-b", config=json.dumps({"source": uris["tier-b"]}))
        assert full.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        assert "store_cache_budget" in full.value.message()
        assert infer(client, "tier-a").tolist() == [[1, 1, 1, 1]]
        client.unload_model("tier-a")  # out of memory, still on disk, now the least recently used
        client.load_model("tier-b", config=json.dumps({"source": uris["tier-b"]}))
        assert infer(client, "tier-b").tolist() == [[2, 2, 2, 2]]
        entries = [json.loads(p.read_text())["uri"] for p in (base / "cache" / "models").glob("*.json")]
        assert entries == [uris["tier-b"]]  # tier-a left the disk for it
        client.unload_model("tier-b")
        client.load_model("tier-a", config=json.dumps({"source": uris["tier-a"]}))  # pulled again
        assert infer(client, "tier-a").tolist() == [[1, 1, 1, 1]]
        metrics = httpx.get(f"http://127.0.0.1:{daemon.metrics_port}/metrics").text
        assert 'modeld_store_pulls_total{outcome="pulled",scheme="oci"} 3.0' in metrics
    finally:
        client.close()
        daemon.stop()


def test_served_names_reach_their_model(served):
    _, client, registry, _, _ = served
    assert infer(client, "scale-stable").tolist() == [[1, 2, 3, 4]]  # the repository entry's alias
    assert client.is_model_ready("scale-stable")
    client.load_model("aliased", config=json.dumps({"source": registry.uri("models/by-oras", "v1"),
                                                    "served_names": ["by-oras-latest"]}))
    assert infer(client, "by-oras-latest").tolist() == [[2, 2, 2, 2]]
    stats = client.get_inference_statistics("aliased", as_json=True)["model_stats"][0]
    assert int(stats["inference_count"]) >= 1  # counted under the model, not the alias
    with pytest.raises(InferenceServerException) as unknown:
        infer(client, "no-such-alias")
    assert unknown.value.status() == "StatusCode.NOT_FOUND"



def test_last_a_daemon_stopped_mid_pull_exits_and_serves_nothing_half_written(served):
    """Stops the module's daemon: keep this test last in the file."""
    daemon, client, _, root, hub = served
    folder = model_folder(root / "hub" / "org" / "held", [7, 7, 7, 7], toml=False)
    hub.hold, hub.hold_file, hub.hold_after = threading.Event(), "model.onnx", 50
    loader = threading.Thread(target=lambda: pytest.raises(InferenceServerException, client.load_model, "held",
                                                           config=json.dumps({"source": "hf://org/held"})))
    loader.start()
    try:
        wait_until(lambda: any(m["name"] == "held" and m.get("state") == "PULLING"
                               for m in client.get_model_repository_index(as_json=True)["models"]),
                   what="held to be PULLING")
        assert daemon.stop(timeout=30) == 0  # the grace period (1 s), not the download, bounds the exit
    finally:
        hub.hold.set()
        loader.join()
        hub.hold = None
    # nothing half-written became a model: a partial file at most, for the next pull to resume
    assert all(p.stat().st_size <= 50 for p in (root / "cache" / "partial").glob("*.part"))
    uris = [json.loads(p.read_text())["uri"] for p in (root / "cache" / "models").glob("*.json")]
    assert "hf://org/held" not in uris and folder.exists()
