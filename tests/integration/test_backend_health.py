"""Backend health through a real daemon: softcap_demo's graph fails to load on
onnxruntime every time, so each load falls back to the reference backend;
at the threshold onnx turns unhealthy (metric, log, node stats, `modeld
models`), later loads skip it, and it recovers when the cool-down ends."""

from __future__ import annotations

import re
import time
import urllib.request

import pytest

from daemon import MODELS, start_daemon
from modeld.clients import Client
from modeld.server.cli import main as cli_main

COOLDOWN_S = 10  # room for the checks below on a busy machine, before onnx is tried again


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("repo")
    (root / "softcap_demo").symlink_to(MODELS / "softcap_demo", target_is_directory=True)
    proc = start_daemon("--no-preload", "--http-port", "-1", repository=root,
                        env={"MODELD_BACKEND_UNHEALTHY_AFTER": "2", "MODELD_BACKEND_COOLDOWN_S": str(COOLDOWN_S)})
    yield proc
    proc.stop()


def _metric(daemon, name: str, **labels) -> float | None:
    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=10).read().decode()
    selector = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    found = re.search(rf"^{name}\{{{selector}\}} (\S+)$", text, re.M)
    return float(found.group(1)) if found else None


def _models_output(daemon, capsys) -> list[str]:
    capsys.readouterr()
    assert cli_main(["models", "--address", daemon.address]) == 0
    return capsys.readouterr().out.splitlines()


def _reload(client: Client) -> None:
    client.load("softcap_demo")
    client.unload("softcap_demo")


def test_fallbacks_mark_onnx_unhealthy_and_the_cool_down_brings_it_back(daemon, capsys):
    fallbacks = {"model": "softcap_demo", "from_backend": "onnx", "stage": "load"}
    assert _metric(daemon, "modeld_backend_healthy", backend="onnx") == 1
    with Client(daemon.address, timeout=60) as client:
        _reload(client)
        assert len(client.node_stats().unhealthy_backends) == 0
        _reload(client)  # the second fallback within the window: onnx is unhealthy
        _reload(client)  # skipped: straight to reference, no third fallback
        assert _metric(daemon, "modeld_backend_fallbacks_total", **fallbacks) == 2
        assert _metric(daemon, "modeld_backend_healthy", backend="onnx") == 0
        [stats] = client.node_stats().unhealthy_backends
        assert stats.name == "onnx" and 0 < stats.retry_in_s <= COOLDOWN_S
        assert stats.reason.startswith("2 fallbacks within 60s; last: model 'softcap_demo' (load): ")
    [event] = daemon.events("backend_unhealthy")
    assert event["backend"] == "onnx" and event["cooldown_s"] == COOLDOWN_S
    assert [e["backend"] for e in daemon.events("backend_load_failed")] == ["onnx", "onnx"]
    [line] = [line for line in _models_output(daemon, capsys) if "UNHEALTHY" in line]
    assert line.startswith("onnx\tbackend\tUNHEALTHY\t2 fallbacks within 60s") and "new loads skip it" in line

    deadline = time.monotonic() + COOLDOWN_S + 20
    while _metric(daemon, "modeld_backend_healthy", backend="onnx") != 1:
        assert time.monotonic() < deadline, "onnx never recovered"
        time.sleep(0.2)
    assert [e["backend"] for e in daemon.events("backend_recovered")] == ["onnx"]
    assert not any("UNHEALTHY" in line for line in _models_output(daemon, capsys))
    with Client(daemon.address, timeout=60) as client:
        assert len(client.node_stats().unhealthy_backends) == 0
        _reload(client)  # onnx is tried again, and fails again: counted again
    assert _metric(daemon, "modeld_backend_fallbacks_total", **fallbacks) == 3
