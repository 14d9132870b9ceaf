"""OCI layers that pack a folder (tar, tar+gzip), against a real registry on
loopback: a folder pushed by the oras library and hand-made image layers are
unpacked into the model folder and served; a member that would leave the
folder, or a link, refuses the pull and nothing lands outside."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tarfile

import numpy as np
import pytest
import tritonclient.grpc as tc
from onnx import TensorProto, helper, numpy_helper
from tritonclient.utils import InferenceServerException

from daemon import start_daemon
from store_servers import start_registry

MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def scale_model(factor: float) -> bytes:
    w = numpy_helper.from_array(np.full(4, factor, dtype=np.float32), "w")
    graph = helper.make_graph([helper.make_node("Mul", ["x", "w"], ["y"])], "scale",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
                              initializer=[w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def tar_bytes(members: list[tuple[str, bytes | None, str]], compress: bool) -> bytes:
    """(name, contents, kind) with kind "file", "symlink" or "dir"."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, data, kind in members:
            info = tarfile.TarInfo(name)
            if kind == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
                archive.addfile(info)
            elif kind == "dir":
                info.type = tarfile.DIRTYPE
                archive.addfile(info)
            else:
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
    raw = buffer.getvalue()
    return gzip.compress(raw) if compress else raw


def push_layer(registry, repo: str, layer: bytes, media: str, annotations: dict | None = None) -> str:
    from modeld.server.store.oci import OciSettings, Registry

    client = Registry(registry.host, OciSettings(plain_http=(registry.host,)))
    try:
        digest = "sha256:" + hashlib.sha256(layer).hexdigest()
        client.put_blob(repo, digest, layer, len(layer))
        config = b"{}"
        config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
        client.put_blob(repo, config_digest, config, len(config))
        entry = {"mediaType": media, "digest": digest, "size": len(layer)}
        if annotations:
            entry["annotations"] = annotations
        manifest = {"schemaVersion": 2, "mediaType": MANIFEST, "layers": [entry],
                    "config": {"mediaType": "application/vnd.oci.empty.v1+json", "digest": config_digest, "size": 2}}
        client.put_manifest(repo, "v1", json.dumps(manifest).encode(), MANIFEST)
    finally:
        client.close()
    return registry.uri(repo, "v1")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("tar-layers")
    registry = start_registry(root / "registry")
    settings = root / "modeld.toml"
    settings.write_text(f'store_cache_dir = "{root / "cache"}"\nstore_oci_plain_http = ["{registry.host}"]\n')
    (root / "empty").mkdir()
    daemon = start_daemon("--config", str(settings), "--no-preload", repository=root / "empty")
    client = tc.InferenceServerClient(daemon.address)
    yield client, registry, root
    client.close()
    daemon.stop()
    registry.stop()


def infer(client, model: str) -> list:
    inp = tc.InferInput("x", [1, 4], "FP32")
    inp.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
    return client.infer(model, [inp]).as_numpy("y").tolist()


@pytest.mark.parametrize("compress", [False, True], ids=["tar", "tar+gzip"])
def test_an_image_layer_is_unpacked_into_the_model_folder(fleet, compress):
    client, registry, root = fleet
    media = "application/vnd.oci.image.layer.v1.tar" + ("+gzip" if compress else "")
    layer = tar_bytes([("./", None, "dir"), ("./model.onnx", scale_model(3), "file"),
                       ("./extra/notes.txt", b"kept", "file")], compress)
    uri = push_layer(registry, f"tar/image-{int(compress)}", layer, media)
    name = f"tarred-{int(compress)}"
    client.load_model(name, config=json.dumps({"source": uri, "format": "onnx"}))
    assert infer(client, name) == [[3, 3, 3, 3]]
    folders = [p for p in (root / "cache" / "models").iterdir() if p.is_dir() and (p / "extra" / "notes.txt").is_file()]
    assert folders and (folders[0] / "extra" / "notes.txt").read_bytes() == b"kept"
    assert not any(p.name.startswith(".layers") for p in folders[0].iterdir())  # the archive itself is not a file
    client.unload_model(name)


def test_a_folder_pushed_by_the_oras_library_is_unpacked(fleet, tmp_path):
    import oras.client

    client, registry, _ = fleet
    folder = tmp_path / "weights"
    folder.mkdir()
    (folder / "model.onnx").write_bytes(scale_model(5))
    oras_client = oras.client.OrasClient(hostname=registry.host, insecure=True)
    here = os.getcwd()
    os.chdir(tmp_path)  # oras names a layer by the path it is given
    try:
        assert oras_client.push(files=["weights"], target=f"{registry.host}/tar/by-oras:v1").status_code == 201
    finally:
        os.chdir(here)
    client.load_model("oras-folder", config=json.dumps({"source": registry.uri("tar/by-oras", "v1"),
                                                        "format": "onnx", "artifact": "weights/model.onnx"}))
    assert infer(client, "oras-folder") == [[5, 5, 5, 5]]
    client.unload_model("oras-folder")


@pytest.mark.parametrize("members, reason", [
    ([("../escaped.onnx", b"x", "file"), ("model.onnx", b"x", "file")], "would leave the model folder"),
    ([("/abs.onnx", b"x", "file")], "would leave the model folder"),
    ([("model.onnx", None, "symlink")], "is a link"),
], ids=["dot-dot", "absolute", "symlink"])
def test_members_that_leave_the_folder_or_link_are_refused(fleet, members, reason):
    client, registry, root = fleet
    repo = f"tar/bad-{abs(hash(reason + members[0][0])) % 10_000}"
    uri = push_layer(registry, repo, tar_bytes(members, True), "application/vnd.oci.image.layer.v1.tar+gzip")
    with pytest.raises(InferenceServerException) as refused:
        client.load_model("bad-tar", config=json.dumps({"source": uri, "format": "onnx"}))
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT", refused.value.message()
    assert reason in refused.value.message()
    cache = root / "cache"
    assert not (cache / "escaped.onnx").exists() and not (cache / "models" / "escaped.onnx").exists()
    assert not client.is_model_ready("bad-tar")
    assert not list((cache / "partial").glob("unpack-*"))  # no half-written member left behind
