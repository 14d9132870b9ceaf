"""vLLM killed and brought back, in order (conftest runs this file last):
the model with a local fallback moves to llama.cpp and back; a remote-only
model fails fast while the engine is away. Both models' health Watch follows
the engine down and up (the engine's rule: NOT_SERVING while the remote is
unhealthy, even where the fallback answers)."""

from __future__ import annotations

import re
import threading
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from modeld.clients.client import Client
from modeld.gen import generation_pb2 as g
from remote_setup import REMOTE_MODEL, direct_completion, generate, remote_config

pytestmark = pytest.mark.remote

ONLY_REMOTE = "smollm2-vllm-only"
PROMPT = "The capital of France is"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def modeld_metric(daemon, name: str, **labels: str) -> float:
    """Sum of a modeld series over the samples whose labels include `labels`."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=5).read().decode()
    total = 0.0
    for label_text, value in re.findall(rf"^{re.escape(name)}\{{([^}}]*)\}} ([0-9.eE+-]+)$", text, re.M):
        found = dict(re.findall(r'(\w+)="([^"]*)"', label_text))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(value)
    return total


def served_by(daemon, backend: str) -> float:
    return modeld_metric(daemon, "modeld_requests_total", model=REMOTE_MODEL, backend=backend)


class Watcher:
    """Every status a health Watch stream sends for one service, with its time."""

    def __init__(self, address: str, service: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.call = health_pb2_grpc.HealthStub(self.channel).Watch(health_pb2.HealthCheckRequest(service=service))
        self.seen: list[tuple[float, int]] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        try:
            for response in self.call:
                self.seen.append((time.monotonic(), response.status))
        except grpc.RpcError:
            pass

    def wait_for(self, status: int, after: float, timeout: float) -> float | None:
        """When `status` was first sent at or after `after`, waiting up to `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hits = [t for t, s in list(self.seen) if s == status and t >= after]
            if hits:
                return hits[0]
            time.sleep(0.1)
        return None

    def latest(self) -> int | None:
        return self.seen[-1][1] if self.seen else None

    def close(self) -> None:
        self.call.cancel()
        self.channel.close()


@pytest.fixture(scope="module")
def outage(daemon, vllm, direct):
    """Watchers on both models and the healthy baseline, before vLLM goes down."""
    with Client(daemon.address) as client:
        client.load(ONLY_REMOTE, config=remote_config(vllm.url, fallback=False))
    state = {
        "expected": direct_completion(direct, PROMPT, max_tokens=16)["choices"][0]["text"],
        "only_remote": Watcher(daemon.address, ONLY_REMOTE),
        "fallback": Watcher(daemon.address, REMOTE_MODEL),
    }
    yield state
    for key in ("only_remote", "fallback"):
        state[key].close()
    if vllm.proc.poll() is not None:  # a row failed between kill and restart: leave a server for what follows
        vllm.start()


def test_fallback_to_llamacpp_when_the_remote_is_killed(daemon, stub, vllm, outage):
    assert generate(stub, PROMPT, max_tokens=16)[1] == outage["expected"]
    assert outage["only_remote"].wait_for(SERVING, 0, 10) is not None
    before = served_by(daemon, "llamacpp")
    outage["killed_at"] = time.monotonic()
    vllm.kill()

    _, text, responses = generate(stub, PROMPT, max_tokens=16, timeout=300)
    assert not responses[-1].error and responses[-1].usage.completion_tokens == 16
    assert text.strip(), "the fallback answered nothing"
    assert served_by(daemon, "llamacpp") == before + 1, "the answer did not come from llama.cpp"
    assert modeld_metric(daemon, "modeld_backend_fallbacks_total", model=REMOTE_MODEL, from_backend="vllm") >= 1


def test_health_watch_follows_the_remote_down(daemon, stub, outage):
    for key in ("only_remote", "fallback"):
        down = outage[key].wait_for(NOT_SERVING, outage["killed_at"], 15)
        assert down is not None, f"{key}: Watch sent {outage[key].seen}"
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, PROMPT, model=ONLY_REMOTE, max_tokens=4, timeout=30)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()


def test_recovery_when_the_remote_returns(daemon, stub, vllm, outage):
    vllm.start()  # the same port, as a restarted engine behind a stable address
    returned = time.monotonic()
    # probes back off to max_probe_interval_s (2 s) while the engine is down
    for key in ("only_remote", "fallback"):
        assert outage[key].wait_for(SERVING, returned - vllm.start_s, 20) is not None, \
            f"{key}: Watch sent {outage[key].seen}"
    assert generate(stub, PROMPT, model=ONLY_REMOTE, max_tokens=16)[1] == outage["expected"]

    before = served_by(daemon, "vllm")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        _, text, _ = generate(stub, PROMPT, max_tokens=16)
        if served_by(daemon, "vllm") > before:
            break
        time.sleep(1)
    assert served_by(daemon, "vllm") > before, "the fallback model stayed on llama.cpp after vLLM returned"
    assert text == outage["expected"]
    assert outage["fallback"].latest() == SERVING
    with Client(daemon.address) as client:
        assert client.health(REMOTE_MODEL) == client.health(ONLY_REMOTE) == "SERVING"


def test_generation_params_survive_the_round_trip(stub):
    # after the outage the remote path carries sampling options as before
    _, _, responses = generate(stub, PROMPT, max_tokens=8, ignore_eos=True)
    assert responses[-1].usage.completion_tokens == 8
    assert responses[-1].finish_reason == g.FINISH_REASON_LENGTH
