"""The model store's disk cache (server/store/cache.py), its URIs, and its
sources' faults: budget and LRU, digests, resumed transfers, shared pulls,
names that would leave the model folder, a registry that wants credentials,
a hub connection that drops mid-file."""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from pathlib import Path

import pytest

from modeld.backends.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from modeld.server.store import ModelStore, OciSettings, StoreSettings, parse_uri
from modeld.server.store.cache import BlobCache, Listing, RemoteFile, TransferBroken, safe_path
from store_servers import HubServer, TokenServer, start_registry


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class Served:
    """A file's bytes behind the cache's fetch interface, counting each call's offset."""

    def __init__(self, data: bytes, break_at: int = 0, honour_range: bool = True, gate=None) -> None:
        self.data, self.break_at, self.honour_range, self.gate = data, break_at, honour_range, gate
        self.offsets: list[int] = []

    def __call__(self, offset: int):
        self.offsets.append(offset)
        start = offset if self.honour_range else 0

        def chunks():
            if self.gate is not None:
                self.gate.wait(30)
            if self.break_at and len(self.offsets) == 1:
                yield self.data[start:self.break_at]
                raise TransferBroken("connection reset")
            yield self.data[start:]
        return chunks(), start


def listing(name: str, files: dict[str, bytes], digests: bool = True, **served) -> tuple[Listing, dict[str, Served]]:
    fetchers = {path: Served(data, **served) for path, data in files.items()}
    remote = tuple(RemoteFile(path, len(data), digest_of(data) if digests else None, fetchers[path], f"file {path}")
                   for path, data in files.items())
    return Listing(f"oci://r/{name}:v1", f"id-{name}", remote), fetchers


def test_a_full_cache_of_models_in_use_is_resource_exhausted_naming_its_budget(tmp_path):
    in_use: list[Path] = []
    cache = BlobCache(tmp_path, budget=1000, in_use=lambda: in_use)
    folder_a, _ = cache.pull(listing("a", {"model.onnx": b"a" * 600})[0])
    in_use.append(folder_a)
    with pytest.raises(ResourceExhausted) as full:
        cache.pull(listing("b", {"model.onnx": b"b" * 600})[0])
    assert "store_cache_budget" in str(full.value) and "oci://r/b:v1" in str(full.value)
    assert (folder_a / "model.onnx").read_bytes() == b"a" * 600  # what is in use stays
    in_use.clear()  # a unloaded: the least recently used model leaves the disk for b
    folder_b, _ = cache.pull(listing("b", {"model.onnx": b"b" * 600})[0])
    assert (folder_b / "model.onnx").read_bytes() == b"b" * 600
    assert not folder_a.exists() and [e.uri for e in cache.entries()] == ["oci://r/b:v1"]
    assert cache.used_bytes() == 600


def test_a_blob_named_by_two_models_is_stored_once(tmp_path):
    cache = BlobCache(tmp_path, budget=10_000)
    shared = b"w" * 500
    a, _ = cache.pull(listing("a", {"model.onnx": shared, "model.toml": b"format = 'onnx'\n"})[0])
    second, fetchers = listing("b", {"model.onnx": shared})
    b, _ = cache.pull(second)
    assert fetchers["model.onnx"].offsets == []  # found in the cache, not fetched
    assert (a / "model.onnx").stat().st_ino == (b / "model.onnx").stat().st_ino
    assert cache.used_bytes() == 500 + len(b"format = 'onnx'\n")


def test_a_mismatched_digest_is_discarded_and_names_the_file(tmp_path):
    cache = BlobCache(tmp_path, budget=10_000)
    good, _ = listing("a", {"model.onnx": b"x" * 100})
    lying = Listing(good.uri, good.identity, (RemoteFile("model.onnx", 100, digest_of(b"y" * 100),
                                                         Served(b"x" * 100), "layer sha256:abc (model.onnx)"),))
    with pytest.raises(InvalidArgument, match=r"layer sha256:abc \(model.onnx\) does not match its digest"):
        cache.pull(lying)
    assert list((tmp_path / "blobs" / "sha256").iterdir()) == []
    assert list((tmp_path / "partial").iterdir()) == []
    assert cache.entries() == []


@pytest.mark.parametrize("honour_range", [True, False])
def test_a_transfer_that_breaks_off_is_resumed_from_where_it_broke(tmp_path, honour_range):
    cache = BlobCache(tmp_path, budget=10_000)
    data = bytes(range(256)) * 8
    pulled, fetchers = listing("a", {"model.onnx": data}, break_at=700, honour_range=honour_range)
    folder, _ = cache.pull(pulled)
    assert (folder / "model.onnx").read_bytes() == data
    assert fetchers["model.onnx"].offsets == [0, 700]  # a source ignoring the range starts over, checked alike


def test_files_without_a_digest_are_hashed_into_the_cache(tmp_path):
    cache = BlobCache(tmp_path, budget=10_000)
    folder, entry = cache.pull(listing("s3", {"model.onnx": b"z" * 64, "sub/tokenizer.json": b"{}"},
                                       digests=False)[0])
    assert entry.files["model.onnx"] == digest_of(b"z" * 64)
    assert (folder / "sub" / "tokenizer.json").read_bytes() == b"{}"


def test_two_threads_pulling_one_model_fetch_each_file_once(tmp_path):
    cache = BlobCache(tmp_path, budget=10_000)
    gate = threading.Event()
    pulled, fetchers = listing("a", {"model.onnx": b"q" * 300}, gate=gate)
    folders: list[Path] = []
    threads = [threading.Thread(target=lambda: folders.append(cache.pull(pulled)[0])) for _ in range(2)]
    for t in threads:
        t.start()
    from polling import wait_until

    wait_until(lambda: fetchers["model.onnx"].offsets, what="the first fetch")
    gate.set()
    for t in threads:
        t.join()
    assert fetchers["model.onnx"].offsets == [0] and folders[0] == folders[1]


async def test_concurrent_pulls_of_one_uri_share_one_pull(tmp_path):
    store = ModelStore(StoreSettings(tmp_path, 10_000))
    first, progress = store.start_pull("oci://127.0.0.1:1/models/x:v1")
    again, same_progress = store.start_pull("oci://127.0.0.1:1/models/x:v1")
    assert again is first and same_progress is progress
    with pytest.raises(Exception):
        await first  # nothing listens on port 1: both callers get the one failure
    assert store.pulling() == {}


@pytest.mark.parametrize("name", ["../model.onnx", "/etc/passwd", "a/../../b", "a//b", "a\\b", "", "./x", "~/x"])
def test_names_that_would_leave_the_model_folder_are_refused(name):
    with pytest.raises(InvalidArgument):
        safe_path(name, "oci://r/x:v1")


def test_a_listing_naming_an_escaping_file_fetches_nothing(tmp_path):
    cache = BlobCache(tmp_path, budget=10_000)
    pulled, fetchers = listing("a", {"../evil.onnx": b"e"})
    with pytest.raises(InvalidArgument, match="would leave the model folder"):
        cache.pull(pulled)
    assert fetchers["../evil.onnx"].offsets == []


def test_uris():
    tagged = parse_uri("oci://registry.example:5000/org/model:v2")
    assert (tagged.host, tagged.path, tagged.reference) == ("registry.example:5000", "org/model", "v2")
    assert parse_uri("oci://ghcr.io/org/model").reference == "latest"
    pinned = parse_uri("oci://ghcr.io/org/model@sha256:" + "a" * 64)
    assert pinned.is_digest and pinned.path == "org/model"
    assert parse_uri("s3://bucket/some/prefix").path == "some/prefix/"
    hub = parse_uri("hf://Org/Name@main?include=*.Q8_0.gguf")
    assert (hub.path, hub.reference, hub.option("include")) == ("Org/Name", "main", "*.Q8_0.gguf")
    for bad, reason in (("gs://bucket/x", "'gs' is not known"), ("oci://host/UPPER:v1", "lower-case"),
                        ("hf://a/b?token=x", "unknown option"), ("oci://h/r@sha256:12", "digest reference")):
        with pytest.raises(InvalidArgument, match=reason):
            parse_uri(bad)


def test_a_registry_that_wants_credentials_is_refused_clearly_until_it_has_them(tmp_path):
    registry = start_registry(tmp_path / "registry", htpasswd=("alice", "secret"))
    try:
        uri = registry.uri("models/locked", "v1")
        folder = tmp_path / "model"
        folder.mkdir()
        (folder / "model.onnx").write_bytes(b"graph")
        anonymous = ModelStore(StoreSettings(tmp_path / "c1", 10_000, OciSettings(plain_http=(registry.host,))))
        with pytest.raises(FailedPrecondition, match=r"refused access .*\(401\).*store_oci_auth_file"):
            anonymous.push(folder, uri)
        auth = tmp_path / "config.json"
        token = base64.b64encode(b"alice:secret").decode()
        auth.write_text(json.dumps({"auths": {registry.host: {"auth": token}}}))
        settings = OciSettings(plain_http=(registry.host,), auth_file=auth)
        ModelStore(StoreSettings(tmp_path / "c2", 10_000, settings)).push(folder, uri)
        with pytest.raises(FailedPrecondition, match="refused access"):
            anonymous.pull_sync(uri)
        pulled = ModelStore(StoreSettings(tmp_path / "c3", 10_000, settings)).pull_sync(uri)
        assert (pulled.folder / "model.onnx").read_bytes() == b"graph"
    finally:
        registry.stop()


def test_a_hub_download_that_drops_mid_file_is_resumed(tmp_path, monkeypatch):
    from huggingface_hub import constants

    (tmp_path / "hub" / "org" / "m").mkdir(parents=True)
    weights = bytes(range(256)) * 64
    (tmp_path / "hub" / "org" / "m" / "model.onnx").write_bytes(weights)
    hub = HubServer(tmp_path / "hub", drop_after=5000)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint)
    try:
        pulled = ModelStore(StoreSettings(tmp_path / "cache", 10**6)).pull_sync("hf://org/m")
    finally:
        hub.stop()
    assert (pulled.folder / "model.onnx").read_bytes() == weights
    assert hub.downloads == ["model.onnx", "model.onnx bytes=5000-"]


def test_offline_a_cached_pull_still_serves(tmp_path, monkeypatch):
    from huggingface_hub import constants

    (tmp_path / "hub" / "org" / "m").mkdir(parents=True)
    (tmp_path / "hub" / "org" / "m" / "model.onnx").write_bytes(b"graph")
    hub = HubServer(tmp_path / "hub")
    monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    store = ModelStore(StoreSettings(tmp_path / "cache", 10**6))
    try:
        online = store.pull_sync("hf://org/m")
    finally:
        hub.stop()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert store.pull_sync("hf://org/m").folder == online.folder
    with pytest.raises(Exception, match="HF_HUB_OFFLINE"):
        store.pull_sync("hf://org/other")


def test_an_artifact_with_nothing_to_load_is_refused_before_fetching(tmp_path):
    from modeld.server.store import check_loadable

    pulled, fetchers = listing("a", {"README.md": b"hello"})
    with pytest.raises(InvalidArgument, match="no file a backend can load"):
        check_loadable(pulled)
    assert fetchers["README.md"].offsets == []


def test_a_tls_registry_with_token_auth_is_pulled_with_its_ca_and_credentials(tmp_path):
    import trustme

    from modeld.backends.errors import Unavailable

    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1")
    cert, key, ca_file = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "ca.pem"
    leaf.private_key_and_cert_chain_pem.write_to_path(str(cert))
    leaf.private_key_pem.write_to_path(str(key))
    ca.cert_pem.write_to_path(str(ca_file))
    tokens = TokenServer(tmp_path, "alice", "secret")
    registry = start_registry(tmp_path / "registry", token=tokens, tls=(cert, key), ca_file=ca_file)
    try:
        uri = registry.uri("models/tls", "v1")
        folder = tmp_path / "model"
        folder.mkdir()
        (folder / "model.onnx").write_bytes(b"graph over tls")
        auth = tmp_path / "config.json"
        auth.write_text(json.dumps({"auths": {registry.host: {"auth": base64.b64encode(b"alice:secret").decode()}}}))
        with pytest.raises(Unavailable, match="store_oci_ca_file"):  # the system's CAs do not know ours
            ModelStore(StoreSettings(tmp_path / "c0", 10_000, OciSettings(auth_file=auth))).push(folder, uri)
        anonymous = ModelStore(StoreSettings(tmp_path / "c1", 10_000, OciSettings(ca_file=ca_file)))
        with pytest.raises(FailedPrecondition, match="refused access"):
            anonymous.push(folder, uri)
        trusted = OciSettings(ca_file=ca_file, auth_file=auth)
        ModelStore(StoreSettings(tmp_path / "c2", 10_000, trusted)).push(folder, uri)
        with pytest.raises(FailedPrecondition, match="refused access"):
            anonymous.pull_sync(uri)
        pulled = ModelStore(StoreSettings(tmp_path / "c3", 10_000, trusted)).pull_sync(uri)
        assert (pulled.folder / "model.onnx").read_bytes() == b"graph over tls"
        assert "repository:models/tls:pull" in tokens.requests  # the Bearer challenge was followed
    finally:
        registry.stop()
        tokens.stop()


def _put(client, repo: str, data: bytes) -> dict:
    client.put_blob(repo, digest_of(data), data, len(data))
    return {"digest": digest_of(data), "size": len(data)}


def test_docker_model_runner_and_modelpack_artifacts_name_their_files(tmp_path):
    from modeld.server.store.oci import DMR_CONFIG, MODELPACK_CONFIG, OCI_MANIFEST, Registry

    registry = start_registry(tmp_path / "registry")
    try:
        client = Registry(registry.host, OciSettings(plain_http=(registry.host,)))
        # Docker Model Runner: unnamed layers, their kind in the media type
        config = _put(client, "ai/tiny", json.dumps({"config": {"format": "gguf", "quantization": "Q4_K_M"}}).encode())
        gguf = _put(client, "ai/tiny", b"GGUF fake weights")
        license_ = _put(client, "ai/tiny", b"Apache-2.0")
        manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": {"mediaType": DMR_CONFIG, **config},
                    "layers": [{"mediaType": "application/vnd.docker.ai.gguf.v3", **gguf},
                               {"mediaType": "application/vnd.docker.ai.license", **license_},
                               {"mediaType": "application/vnd.example.unknown", **license_}]}
        client.put_manifest("ai/tiny", "latest", json.dumps(manifest).encode(), OCI_MANIFEST)
        # a ModelPack artifact another tool wrote: files by org.cncf.model.filepath
        mp_config = _put(client, "mp/tiny", json.dumps({"config": {"format": "onnx"}}).encode())
        graph = _put(client, "mp/tiny", b"onnx graph")
        manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": "application/vnd.cncf.model.manifest.v1+json",
                    "config": {"mediaType": MODELPACK_CONFIG, **mp_config},
                    "layers": [{"mediaType": "application/vnd.cncf.model.weight.v1.raw", **graph,
                                "annotations": {"org.cncf.model.filepath": "onnx/model.onnx"}}]}
        client.put_manifest("mp/tiny", "v1", json.dumps(manifest).encode(), OCI_MANIFEST)
        client.close()
        store = ModelStore(StoreSettings(tmp_path / "cache", 10_000, OciSettings(plain_http=(registry.host,))))
        dmr = store.pull_sync(f"oci://{registry.host}/ai/tiny")
        assert sorted(p.name for p in dmr.folder.iterdir()) == ["LICENSE", "model.gguf"]
        assert dmr.hints == {"format": "gguf"}
        pack = store.pull_sync(f"oci://{registry.host}/mp/tiny:v1")
        assert (pack.folder / "onnx" / "model.onnx").read_bytes() == b"onnx graph"
        from modeld.server.repository import pulled_config

        config = pulled_config("tiny", pack.uri, {}, pack)
        assert (config.format.value, config.artifact) == ("onnx", "onnx/model.onnx")
        # pinned by digest, found in the cache: the registry is not asked again
        registry.stop()
        assert store.pull_sync(f"oci://{registry.host}/mp/tiny@{pack.identity}").folder == pack.folder
    finally:
        registry.stop()


def test_a_mirror_is_tried_first_and_the_origin_when_it_lacks_the_model(tmp_path):
    origin, mirror = start_registry(tmp_path / "origin"), start_registry(tmp_path / "mirror")
    try:
        folder = tmp_path / "model"
        folder.mkdir()
        (folder / "model.onnx").write_bytes(b"from the origin")
        plain = (origin.host, mirror.host)
        ModelStore(StoreSettings(tmp_path / "p1", 10_000, OciSettings(plain_http=plain))).push(
            folder, origin.uri("models/m", "v1"))
        (folder / "model.onnx").write_bytes(b"from the mirror")
        ModelStore(StoreSettings(tmp_path / "p2", 10_000, OciSettings(plain_http=plain))).push(
            folder, mirror.uri("models/m", "v1"))
        mirrored = OciSettings(mirror=mirror.host, plain_http=plain)
        pulled = ModelStore(StoreSettings(tmp_path / "c1", 10_000, mirrored)).pull_sync(origin.uri("models/m", "v1"))
        assert (pulled.folder / "model.onnx").read_bytes() == b"from the mirror"
        (folder / "model.onnx").write_bytes(b"only at the origin")
        ModelStore(StoreSettings(tmp_path / "p3", 10_000, OciSettings(plain_http=plain))).push(
            folder, origin.uri("models/other", "v1"))
        pulled = ModelStore(StoreSettings(tmp_path / "c2", 10_000, mirrored)).pull_sync(origin.uri("models/other", "v1"))
        assert (pulled.folder / "model.onnx").read_bytes() == b"only at the origin"
    finally:
        origin.stop()
        mirror.stop()


def test_a_store_answering_500_is_unavailable_and_a_cached_pull_serves(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from modeld.backends.errors import Unavailable

    (tmp_path / "hub" / "org" / "m").mkdir(parents=True)
    (tmp_path / "hub" / "org" / "m" / "model.onnx").write_bytes(b"graph")
    hub = HubServer(tmp_path / "hub")
    monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    store = ModelStore(StoreSettings(tmp_path / "cache", 10**6))
    try:
        hub.fail_with = 500
        with pytest.raises(Unavailable, match="500"):
            store.pull_sync("hf://org/m")
        hub.fail_with = 0
        first = store.pull_sync("hf://org/m")
        hub.fail_with = 500
        assert store.pull_sync("hf://org/m").folder == first.folder  # the store is down: what the cache has
    finally:
        hub.stop()


def test_a_model_larger_than_the_whole_budget_evicts_nothing(tmp_path):
    cache = BlobCache(tmp_path, budget=1000)
    folder, _ = cache.pull(listing("a", {"model.onnx": b"a" * 600})[0])
    with pytest.raises(ResourceExhausted, match="more than the model store's whole cache budget"):
        cache.pull(listing("huge", {"model.onnx": b"h" * 1001})[0])
    assert folder.exists()


def test_s3_objects_under_a_prefix_are_the_model_folder_and_faults_are_named(tmp_path, monkeypatch):
    from modeld.backends.errors import NotFound
    from modeld.server.store import S3Settings
    from store_servers import S3_ENV, start_s3

    for key, value in S3_ENV.items():
        monkeypatch.setenv(key, value)
    s3 = start_s3()
    try:
        folder = tmp_path / "model"
        (folder / "sub").mkdir(parents=True)
        (folder / "model.onnx").write_bytes(b"graph")
        (folder / "sub" / "tokenizer.json").write_bytes(b"{}")
        s3.upload("models", "m/v1/", folder)
        store = ModelStore(StoreSettings(tmp_path / "cache", 10_000,
                                         s3=S3Settings(endpoint=s3.endpoint, addressing_style="path")))
        pulled = store.pull_sync("s3://models/m/v1")
        assert (pulled.folder / "model.onnx").read_bytes() == b"graph"
        assert (pulled.folder / "sub" / "tokenizer.json").read_bytes() == b"{}"
        again = store.pull_sync("s3://models/m/v1/")  # the same objects (ETags): the same cached folder
        assert again.folder == pulled.folder and again.identity == pulled.identity
        with pytest.raises(NotFound, match="no objects under that prefix"):
            store.pull_sync("s3://models/m/v2/")
        with pytest.raises(NotFound, match="NoSuchBucket"):
            store.pull_sync("s3://no-bucket/m/")
    finally:
        s3.stop()


def test_the_files_of_one_model_are_fetched_in_parallel(tmp_path):
    started = threading.Barrier(4, timeout=30)

    class AllStarted:  # each file's body waits until all four downloads are under way
        def wait(self, timeout: float) -> None:
            started.wait()
    files = {f"part-{i}.onnx": bytes([i]) * 1000 for i in range(4)}
    pulled, fetchers = listing("parallel", files, gate=AllStarted())
    folder, _ = BlobCache(tmp_path, 10**6, parallel=4).pull(pulled)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == files
    assert all(f.offsets == [0] for f in fetchers.values())
