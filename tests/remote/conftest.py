"""One real vLLM server and one modeld daemon in front of it, per session.

The daemon's repository is a temporary folder holding `smollm2-vllm`: a remote
model on that vLLM with the local SmolLM2 GGUF as its llama.cpp fallback.
Without .venv-vllm and the HF weights (`make test-remote` builds both) every
test here is skipped with the reason.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import httpx
import pytest

from daemon import MODELS, start_daemon
from modeld.gen import generation_pb2_grpc as gg
from remote_setup import REMOTE_MODEL, remote_config, toml_text
from vllm_server import VllmServer, missing


@pytest.fixture(scope="session")
def vllm():
    reason = missing()
    if reason:
        pytest.skip(reason)
    # with run-time LoRA loading for test_vllm_lora.py (eager either way: vLLM's CPU build
    # turns compilation off with LoRA on)
    server = VllmServer(lora=True).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def repository(vllm, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("remote-repo")
    model_dir = root / REMOTE_MODEL
    model_dir.mkdir()
    (model_dir / "model.toml").write_text(toml_text(remote_config(vllm.url)))
    gguf = MODELS / "smollm2/model.gguf"
    if not gguf.exists():
        pytest.fail(f"{gguf} is missing: run `make models` (modeld prepare)")
    (model_dir / "model.gguf").symlink_to(gguf.resolve())
    return root


@pytest.fixture(scope="session")
def daemon(repository):
    """Overrides the top-level daemon: this one serves only the remote model."""
    proc = start_daemon(repository=repository)
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def stub(daemon):
    with grpc.insecure_channel(daemon.address) as channel:
        yield gg.GenerationStub(channel)


@pytest.fixture(scope="session")
def direct(vllm):
    """Straight to vLLM's OpenAI API, the reference every row compares with."""
    with httpx.Client(base_url=vllm.url, timeout=120) as client:
        yield client


def pytest_collection_modifyitems(items):
    # the failover rows kill and restart vLLM: run them after everything else
    items.sort(key=lambda item: "test_remote_failover" in item.nodeid)
