"""A registry that fails, against the real docker-registry on loopback
behind a proxy that injects the fault (tests/store_servers.py FaultyProxy):

- it answers 500 (or 503): the pull is UNAVAILABLE naming the status,
  nothing is cached, and once it answers again the same pull succeeds;
  with a cached pull of the URI, that serves meanwhile;
- it drops the connection mid-blob: the download resumes with a Range
  request from the bytes already received, and the folder holds exactly
  the pushed bytes.
"""

from __future__ import annotations

import hashlib
import os

import pytest

from modeld.backends.errors import Unavailable
from modeld.server.store import ModelStore, OciSettings, StoreSettings
from store_servers import FaultyProxy, start_registry


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    registry = start_registry(root / "registry")
    yield registry, root
    registry.stop()


@pytest.fixture()
def proxy(registry):
    proxy = FaultyProxy(registry[0].host)
    yield proxy
    proxy.stop()


def push(registry, root, repo: str, weights: bytes) -> None:
    folder = root / repo.replace("/", "-")
    folder.mkdir()
    (folder / "model.onnx").write_bytes(weights)
    store = ModelStore(StoreSettings(root / f"push-{repo.replace('/', '-')}", 10**8,
                                     OciSettings(plain_http=(registry.host,))))
    store.push(folder, registry.uri(repo, "v1"))


def through(proxy, path) -> ModelStore:
    return ModelStore(StoreSettings(path, 10**8, OciSettings(plain_http=(proxy.host,))))


@pytest.mark.parametrize("status", [500, 503])
def test_a_registry_answering_5xx_is_unavailable_and_nothing_is_cached(registry, proxy, tmp_path, status):
    reg, root = registry
    repo = f"faults/down-{status}"
    push(reg, root, repo, os.urandom(4096))
    store = through(proxy, tmp_path / "cache")
    proxy.fail_with = status
    with pytest.raises(Unavailable, match=f"answered {status}"):
        store.pull_sync(proxy.uri(repo, "v1"))
    assert list((tmp_path / "cache" / "models").iterdir()) == []
    proxy.fail_with = 0
    pulled = store.pull_sync(proxy.uri(repo, "v1"))
    assert (pulled.folder / "model.onnx").stat().st_size == 4096
    # down again: the cached pull of the same URI serves
    proxy.fail_with = status
    assert store.pull_sync(proxy.uri(repo, "v1")).folder == pulled.folder


def test_a_blob_cut_off_midway_is_resumed_from_where_it_broke(registry, proxy, tmp_path):
    reg, root = registry
    weights = os.urandom(3 * 1024 * 1024 + 123)
    push(reg, root, "faults/cut", weights)
    proxy.drop_after = 1024 * 1024
    pulled = through(proxy, tmp_path / "cache").pull_sync(proxy.uri("faults/cut", "v1"))
    assert (pulled.folder / "model.onnx").read_bytes() == weights
    digest = "sha256:" + hashlib.sha256(weights).hexdigest()
    gets = [r for r in proxy.requests if r.startswith(f"GET /v2/faults/cut/blobs/{digest}")]
    # the first GET broke off; the next asked for the rest only
    assert len(gets) == 2 and gets[0] == f"GET /v2/faults/cut/blobs/{digest}", gets
    offset = int(gets[1].rsplit("bytes=", 1)[1].rstrip("-"))
    assert 0 < offset <= 1024 * 1024, gets
    assert list((tmp_path / "cache" / "partial").iterdir()) == []
