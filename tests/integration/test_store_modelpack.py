"""CNCF ModelPack artifacts against a real registry (Debian's docker-registry
on loopback):

- what `modeld push` writes follows the ModelPack spec: artifactType, the
  config's media type and fields (descriptor, config.format, modelfs with a
  diffId per layer), a layer per file typed by kind (weight, weight.config,
  doc, code) and packing (`.v1.raw`, `.v1.tar`), each named by
  `org.cncf.model.filepath`; a tar layer holds exactly its file, with the
  fixed metadata that makes the archive the same bytes from any machine;
- `modeld push --layers tar` round-trips: pulled back, the folder holds the
  same bytes and onnxruntime runs the graph;
- ModelPack artifacts another tool made (the oras library) with `.tar`,
  `.tar+gzip` and `.tar+zstd` layers are unpacked;
- `oras pull` of what `modeld push` wrote gets the folder's files;
- a zstd layer that is not zstd, or that unpacks past the cache budget, is
  refused and leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import shutil
import tarfile

import httpx
import numpy as np
import pytest

from modeld.backends.errors import InvalidArgument, ResourceExhausted
from modeld.server.store import ModelStore, OciSettings, StoreSettings
from store_servers import start_registry
from test_model_versions import scale_model

MANIFEST = "application/vnd.oci.image.manifest.v1+json"
ARTIFACT = "application/vnd.cncf.model.manifest.v1+json"
CONFIG = "application/vnd.cncf.model.config.v1+json"
FILEPATH = "org.cncf.model.filepath"
TITLE = "org.opencontainers.image.title"
# each file of the test folder and the kind of layer the spec gives it
KINDS = {"model.onnx": "weight", "tokenizer.json": "weight.config", "README.md": "doc",
         "sub/vocab.txt": "weight.config", "tools/convert.py": "code"}


def make_folder(path, factor: float) -> dict[str, bytes]:
    contents = {"model.onnx": scale_model(factor), "tokenizer.json": b'{"version": "1.0"}',
                "README.md": b"# scale\n", "sub/vocab.txt": b"a\nb\n", "tools/convert.py": b"print('hi')\n"}
    for rel, data in contents.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(data)
    return contents


def run_graph(folder) -> list:
    import onnxruntime as ort

    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    return session.run(["y"], {"x": np.ones((1, 4), dtype=np.float32)})[0].tolist()


def modeld_cli(*args: str) -> tuple[int, str]:
    from modeld.server.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:
            code = exc.code
    return code, out.getvalue() + err.getvalue()


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    registry = start_registry(tmp_path_factory.mktemp("modelpack") / "registry")
    yield registry
    registry.stop()


def store(registry, path, budget: int = 10**8) -> ModelStore:
    return ModelStore(StoreSettings(path, budget, OciSettings(plain_http=(registry.host,))))


def manifest_of(registry, repo: str, tag: str) -> tuple[dict, str]:
    answer = httpx.get(f"http://{registry.host}/v2/{repo}/manifests/{tag}", headers={"Accept": MANIFEST})
    answer.raise_for_status()
    return answer.json(), "sha256:" + hashlib.sha256(answer.content).hexdigest()


def blob(registry, repo: str, digest: str) -> bytes:
    answer = httpx.get(f"http://{registry.host}/v2/{repo}/blobs/{digest}", follow_redirects=True)
    answer.raise_for_status()
    assert "sha256:" + hashlib.sha256(answer.content).hexdigest() == digest
    return answer.content


@pytest.mark.parametrize("packing", ["raw", "tar"])
def test_modeld_push_writes_a_modelpack_artifact(registry, tmp_path, packing):
    contents = make_folder(tmp_path / "model", 2.0)
    repo = f"pack/{packing}"
    code, output = modeld_cli("push", str(tmp_path / "model"), registry.uri(repo, "v1"), "--plain-http",
                              "--layers", packing)
    assert code == 0, output
    manifest, digest = manifest_of(registry, repo, "v1")
    assert digest in output
    assert (manifest["schemaVersion"], manifest["mediaType"], manifest["artifactType"]) == (2, MANIFEST, ARTIFACT)
    assert manifest["config"]["mediaType"] == CONFIG
    layers = {layer["annotations"][FILEPATH]: layer for layer in manifest["layers"]}
    assert sorted(layers) == sorted(KINDS)
    for rel, layer in layers.items():
        assert layer["mediaType"] == f"application/vnd.cncf.model.{KINDS[rel]}.v1.{packing}", rel
        # a raw layer is the file, titled for `oras pull`; a tar layer is not (oras would write the archive)
        assert (TITLE in layer["annotations"]) == (packing == "raw")
        data = blob(registry, repo, layer["digest"])
        assert len(data) == layer["size"]
        if packing == "raw":
            assert data == contents[rel]
            continue
        with tarfile.open(fileobj=io.BytesIO(data)) as archive:
            members = archive.getmembers()
            assert [m.name for m in members] == [rel]
            member = members[0]
            assert member.isfile() and (member.mode, member.uid, member.gid, member.mtime) == (0o644, 0, 0, 0)
            assert (member.uname, member.gname) == ("", "")
            assert archive.extractfile(member).read() == contents[rel]
    config = json.loads(blob(registry, repo, manifest["config"]["digest"]))
    assert config["descriptor"]["name"] == packing
    assert config["config"]["format"] == "onnx"
    # uncompressed layers: each diffId is its layer's digest, in the manifest's order
    assert config["modelfs"] == {"type": "layers", "diffIds": [layer["digest"] for layer in manifest["layers"]]}


def test_tar_layers_pushed_by_modeld_round_trip_and_are_the_same_bytes_from_any_copy(registry, tmp_path):
    contents = make_folder(tmp_path / "model", 3.0)
    uri = registry.uri("pack/round-trip", "v1")
    pusher = store(registry, tmp_path / "push-cache")
    first = pusher.push(tmp_path / "model", uri, packing="tar")
    pulled = store(registry, tmp_path / "cache").pull_sync(uri)
    assert pulled.identity == first
    assert {p.relative_to(pulled.folder).as_posix(): p.read_bytes()
            for p in pulled.folder.rglob("*") if p.is_file()} == contents
    assert pulled.hints == {"format": "onnx"}
    assert run_graph(pulled.folder) == [[3.0, 3.0, 3.0, 3.0]]
    # a copy with other times and modes packs to the same archives: the same manifest
    shutil.copytree(tmp_path / "model", tmp_path / "copy")
    for path in (tmp_path / "copy").rglob("*"):
        if path.is_file():
            os.utime(path, (1_000_000, 1_000_000))
            path.chmod(0o600)
    assert pusher.push(tmp_path / "copy", registry.uri("pack/round-trip", "again"), packing="tar") == first


def oras_push(registry, tmp_path, repo: str, layer: bytes, media: str) -> str:
    """A ModelPack artifact written by the oras library: one layer packing
    the model folder, a ModelPack config."""
    import oras.client

    work = tmp_path / "oras-push"
    work.mkdir()
    (work / "model.tar").write_bytes(layer)
    (work / "config.json").write_text(json.dumps({"descriptor": {"name": "scale"}, "config": {"format": "onnx"},
                                                  "modelfs": {"type": "layers", "diffIds": []}}))
    client = oras.client.OrasClient(hostname=registry.host, insecure=True)
    here = os.getcwd()
    os.chdir(work)  # oras names a layer by the path it is given
    try:
        answer = client.push(target=f"{registry.host}/{repo}:v1", files=[f"model.tar:{media}"],
                             manifest_config=f"config.json:{CONFIG}")
        assert answer.status_code == 201
    finally:
        os.chdir(here)
    return registry.uri(repo, "v1")


def folder_tar(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for rel, data in files.items():
            info = tarfile.TarInfo(rel)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


@pytest.mark.parametrize("compression", ["tar", "tar+gzip", "tar+zstd"])
def test_a_modelpack_artifact_the_oras_library_pushed_is_unpacked(registry, tmp_path, compression):
    import zstandard

    files = {"model.onnx": scale_model(5.0), "tokenizer.json": b"{}"}
    raw = folder_tar(files)
    layer = {"tar": raw, "tar+gzip": gzip.compress(raw), "tar+zstd": zstandard.ZstdCompressor().compress(raw)}
    repo = f"oras/{compression.replace('+', '-')}"
    uri = oras_push(registry, tmp_path, repo, layer[compression],
                    f"application/vnd.cncf.model.weight.v1.{compression}")
    manifest, _ = manifest_of(registry, repo, "v1")
    assert manifest["config"]["mediaType"] == CONFIG
    pulled = store(registry, tmp_path / "cache").pull_sync(uri)
    assert sorted(p.name for p in pulled.folder.iterdir()) == ["model.onnx", "tokenizer.json"]
    assert pulled.hints == {"format": "onnx"}
    assert run_graph(pulled.folder) == [[5.0] * 4]
    assert list((tmp_path / "cache" / "partial").iterdir()) == []  # the zstd scratch copy is gone


def test_oras_pull_gets_the_files_modeld_push_wrote(registry, tmp_path):
    import oras.client

    contents = make_folder(tmp_path / "model", 4.0)
    uri = registry.uri("pack/for-oras", "v1")
    store(registry, tmp_path / "push-cache").push(tmp_path / "model", uri)
    client = oras.client.OrasClient(hostname=registry.host, insecure=True)
    client.pull(target=f"{registry.host}/pack/for-oras:v1", outdir=str(tmp_path / "out"))
    got = {p.relative_to(tmp_path / "out").as_posix(): p.read_bytes()
           for p in (tmp_path / "out").rglob("*") if p.is_file()}
    assert got == contents


def test_a_zstd_layer_that_is_not_zstd_or_unpacks_past_the_budget_is_refused(registry, tmp_path):
    import zstandard

    media = "application/vnd.cncf.model.weight.v1.tar+zstd"
    (tmp_path / "a").mkdir()
    broken = oras_push(registry, tmp_path / "a", "oras/broken-zstd", gzip.compress(folder_tar({"m.onnx": b"x"})), media)
    with pytest.raises(InvalidArgument, match="not readable zstd"):
        store(registry, tmp_path / "cache-a").pull_sync(broken)
    assert list((tmp_path / "cache-a" / "partial").iterdir()) == []
    # 4 MB of zeros squeeze into a few hundred bytes: the layer fits the budget, what it unpacks to does not
    bomb = zstandard.ZstdCompressor().compress(folder_tar({"model.onnx": bytes(4 * 1024 * 1024)}))
    assert len(bomb) < 10_000
    (tmp_path / "b").mkdir()
    uri = oras_push(registry, tmp_path / "b", "oras/bomb", bomb, media)
    with pytest.raises((InvalidArgument, ResourceExhausted), match="store_cache_budget"):
        store(registry, tmp_path / "cache-b", budget=1024 * 1024).pull_sync(uri)
    assert list((tmp_path / "cache-b" / "partial").iterdir()) == []
    assert list((tmp_path / "cache-b" / "models").iterdir()) == []
