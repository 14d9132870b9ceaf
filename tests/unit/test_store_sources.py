"""The store's sources choose and fetch what the issue asks, against real
clients and servers on loopback:

- hf://: the files a backend needs are picked from a repository's listing
  (an ONNX graph with its tokenizer and config; else safetensors shards
  with config and tokenizer; else one GGUF, by quantisation: Q4_K_M where
  there are several, another with ?include); HF_TOKEN reaches the hub
  (through huggingface_hub) for a private repository;
- s3://: credentials from a shared credentials file (boto3's chain, no
  variables set), and virtual-hosted addressing against moto's S3 server
  (the bucket in the Host name).
"""

from __future__ import annotations

import socket

import pytest

from modeld.backends.errors import FailedPrecondition, NotFound
from modeld.server.store import ModelStore, S3Settings, StoreSettings
from modeld.server.store.hf import select_files
from store_servers import HubServer, start_s3

GGUF_REPO = ["README.md", "config.json", "model-Q2_K.gguf", "model-Q4_K_M.gguf", "model-Q8_0.gguf",
             "model.toml", "tokenizer.json"]
SAFETENSORS_REPO = [".gitattributes", "README.md", "config.json", "generation_config.json",
                    "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                    "model.safetensors.index.json", "pytorch_model.bin", "special_tokens_map.json",
                    "tokenizer.json", "tokenizer_config.json", "vocab.txt", "merges.txt"]
ONNX_REPO = ["README.md", "config.json", "onnx/model.onnx", "onnx/model_quantized.onnx", "onnx/config.json",
             "tokenizer.json", "pytorch_model.bin", "1_Pooling/config.json"]


def test_a_gguf_repository_gives_one_file_by_its_quantisation():
    assert select_files(GGUF_REPO) == ["model-Q4_K_M.gguf", "model.toml"]
    assert select_files(GGUF_REPO, "*Q8_0.gguf") == ["model-Q8_0.gguf"]
    assert select_files(GGUF_REPO, "*Q2_K.gguf,tokenizer.json") == ["model-Q2_K.gguf", "tokenizer.json"]
    # without Q4_K_M, the first by name
    assert select_files(["b-Q5_K_S.gguf", "a-Q6_K.gguf"]) == ["a-Q6_K.gguf"]


def test_a_safetensors_repository_gives_its_shards_config_and_tokenizer():
    assert select_files(SAFETENSORS_REPO) == sorted([
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
        "config.json", "generation_config.json", "special_tokens_map.json", "tokenizer.json",
        "tokenizer_config.json", "vocab.txt", "merges.txt"])  # not the README, .bin weights or .gitattributes
    # a repository with an ONNX export beside its checkpoint serves the export (the ONNX backend)
    assert "onnx/model.onnx" in select_files(SAFETENSORS_REPO + ["onnx/model.onnx"])


def test_an_onnx_repository_gives_its_graphs_and_their_side_files():
    assert select_files(ONNX_REPO) == ["config.json", "onnx/config.json", "onnx/model.onnx",
                                       "onnx/model_quantized.onnx", "tokenizer.json"]
    assert select_files(["README.md", "LICENSE"]) == []


def test_hf_token_reaches_the_hub_for_a_private_repository(tmp_path, monkeypatch):
    from huggingface_hub import constants

    (tmp_path / "hub" / "org" / "private").mkdir(parents=True)
    (tmp_path / "hub" / "org" / "private" / "model.onnx").write_bytes(b"private graph")
    hub = HubServer(tmp_path / "hub", token="hf_secret_token")
    monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no saved login either
    try:
        with pytest.raises(NotFound, match="HF_TOKEN"):
            ModelStore(StoreSettings(tmp_path / "c1", 10**6)).pull_sync("hf://org/private")
        monkeypatch.setenv("HF_TOKEN", "hf_secret_token")
        pulled = ModelStore(StoreSettings(tmp_path / "c2", 10**6)).pull_sync("hf://org/private")
    finally:
        hub.stop()
    assert (pulled.folder / "model.onnx").read_bytes() == b"private graph"
    # the listing and the download both carried the token
    assert hub.authorizations[-2:] == ["Bearer hf_secret_token"] * 2


def _upload(s3, tmp_path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.onnx").write_bytes(b"graph in s3")
    s3.upload("models", "m/", folder)


def test_s3_credentials_come_from_a_shared_credentials_file(tmp_path, monkeypatch):
    s3 = start_s3()
    try:
        _upload(s3, tmp_path)
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
            monkeypatch.delenv(key, raising=False)
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none-yet"))
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role to find either
        settings = S3Settings(endpoint=s3.endpoint, region="us-east-1", addressing_style="path")
        with pytest.raises(FailedPrecondition, match="no S3 credentials"):
            ModelStore(StoreSettings(tmp_path / "c1", 10_000, s3=settings)).pull_sync("s3://models/m/")
        credentials = tmp_path / "credentials"
        credentials.write_text("[default]\naws_access_key_id = from-file\naws_secret_access_key = secret\n")
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
        pulled = ModelStore(StoreSettings(tmp_path / "c2", 10_000, s3=settings)).pull_sync("s3://models/m/")
        assert (pulled.folder / "model.onnx").read_bytes() == b"graph in s3"
    finally:
        s3.stop()


def test_s3_virtual_hosted_addressing_names_the_bucket_in_the_host(tmp_path, monkeypatch):
    from store_servers import S3_ENV

    for key, value in S3_ENV.items():
        monkeypatch.setenv(key, value)
    s3 = start_s3()
    port = int(s3.endpoint.rsplit(":", 1)[1])
    hosts: list[str] = []
    real = socket.getaddrinfo

    def resolve(host, *args, **kwargs):
        # no resolver here answers for <bucket>.localhost: point every such name at loopback, as a
        # wildcard DNS entry for the store's domain would
        if isinstance(host, str) and host.endswith(".localhost"):
            hosts.append(host)
            return real("127.0.0.1", *args, **kwargs)
        return real(host, *args, **kwargs)
    try:
        _upload(s3, tmp_path)
        monkeypatch.setattr(socket, "getaddrinfo", resolve)
        settings = S3Settings(endpoint=f"http://localhost:{port}", region="us-east-1", addressing_style="virtual")
        pulled = ModelStore(StoreSettings(tmp_path / "cache", 10_000, s3=settings)).pull_sync("s3://models/m/")
        assert (pulled.folder / "model.onnx").read_bytes() == b"graph in s3"
        assert hosts and set(hosts) == {"models.localhost"}  # every request named the bucket in its host
    finally:
        s3.stop()


def test_modeld_pull_draws_a_progress_bar_on_a_terminal(monkeypatch):
    import io
    import threading

    from modeld.server.store import cli

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True
    screen = Terminal()
    monkeypatch.setattr("sys.stderr", screen)
    done = threading.Event()
    seen = []

    def figures() -> tuple[int, int]:
        seen.append(1)
        if len(seen) >= 3:
            done.set()
        return 512 * 1024, 1024 * 1024  # half of 1 MiB
    cli._show(figures, done)
    assert "[###############...............]" in screen.getvalue() and "512.0KiB / 1.0MiB" in screen.getvalue()
