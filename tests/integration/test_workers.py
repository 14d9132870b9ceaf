"""Worker processes through a real daemon: a model with isolation =
"process" answers exactly as in-process, its process is named after it,
its memory is its resident memory, and its death fails only its own calls
(UNAVAILABLE, naming the signal) while every other model keeps serving;
the next request loads it again, after a backoff that keeps a crash loop
from spinning."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import onnx_fixtures
from daemon import MODELS, start_daemon
from modeld.clients import Client
from modeld.gen import generation_pb2 as g
from modeld.gen import generation_pb2_grpc as gg
from polling import wait_until

LLM_TABLE = """
format = "gguf"
backends = ["llamacpp"]
artifact = "model.gguf"
isolation = "{isolation}"
lazy_load = true

[llamacpp]
n_ctx = 4096
n_slots = 8
context_length = 512
n_threads = 2
"""


def _minilm_toml(isolation: str) -> str:
    text = (MODELS / "minilm" / "model.toml").read_text()
    return text.replace('format = "onnx"', f'format = "onnx"\nisolation = "{isolation}"', 1)


def _repository(root: Path) -> Path:
    for name, isolation in (("minilm", "in-process"), ("minilm-worker", "process")):
        folder = root / name
        folder.mkdir()
        (folder / "model.toml").write_text(_minilm_toml(isolation))
        for artifact in ("model.onnx", "tokenizer.json"):
            (folder / artifact).symlink_to((MODELS / "minilm" / artifact).resolve())
    for name, isolation in (("llm", "process"), ("llm-inproc", "in-process")):
        folder = root / name
        folder.mkdir()
        (folder / "model.toml").write_text(LLM_TABLE.format(isolation=isolation))
        (folder / "model.gguf").symlink_to((MODELS / "smollm2" / "model.gguf").resolve())
    return root


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    repository = _repository(tmp_path_factory.mktemp("workers_repo"))
    proc = start_daemon("--no-preload", "--memory-budget", "4GiB", repository=repository,
                        env={"MODELD_WORKER_RESTART_BACKOFF_S": "1", "MODELD_WORKER_RESTART_BACKOFF_MAX_S": "4"})
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def client(daemon):
    with Client(daemon.address, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def stub(daemon):
    with grpc.insecure_channel(daemon.address) as channel:
        yield gg.GenerationStub(channel)


def worker_pids(daemon, model: str) -> list[int]:
    """Children of the daemon whose command line is `modeld-worker <model>`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == daemon.proc.pid and cmdline == f"modeld-worker {model}":
            pids.append(int(entry.name))
    return pids


def worker_pid(daemon, model: str) -> int:
    pids = worker_pids(daemon, model)
    assert len(pids) == 1, f"workers of {model}: {pids}"
    return pids[0]


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _metric(daemon, name: str, **labels) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics").read().decode()
    label_text = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    match = re.search(re.escape(f"{name}{{{label_text}}}") + r" ([0-9.e+]+)", text)
    return float(match.group(1)) if match else 0.0


def _health(daemon, service: str) -> int:
    with grpc.insecure_channel(daemon.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def _greedy(stub, model: str, prompt: str, max_tokens: int = 16) -> list[int]:
    request = g.GenerateRequest(model=model, prompt=prompt,
                                sampling=g.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return [t for r in stub.Generate(request, timeout=300) for t in r.token_ids]


def _wait_until(predicate, timeout: float = 60.0, what: str = "condition") -> None:
    wait_until(predicate, timeout, what)


SENTENCES = ["a worker process of its own", "the same answer either way", "hello world"]


def test_outputs_match_in_process(daemon, client, stub):
    np.testing.assert_array_equal(client.embed(SENTENCES, "minilm-worker"), client.embed(SENTENCES, "minilm"))
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    in_worker = [_greedy(stub, "llm", p) for p in prompts]
    in_process = [_greedy(stub, "llm-inproc", p) for p in prompts]
    assert in_worker == in_process and all(len(t) == 16 for t in in_worker)
    client.unload("llm-inproc")  # frees the CPU and memory the rest of the module needs


def test_worker_is_named_after_its_model(daemon, client):
    client.embed(["load it"], "minilm-worker")
    pid = worker_pid(daemon, "minilm-worker")
    assert Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"modeld-worker minilm-worker")
    assert not worker_pids(daemon, "minilm"), "an in-process model has no worker"


def test_memory_is_the_workers_resident_memory(daemon, client):
    client.embed(["load it"], "minilm-worker")
    pid = worker_pid(daemon, "minilm-worker")

    def refreshed():  # the worker's resident memory is re-read every 2 s; until then the books hold its estimate
        held = {m.name: m.memory_bytes for m in client.node_stats().models}
        reported, rss = held["minilm-worker"], _rss(pid)
        return (held, reported, rss) if abs(reported - rss) <= 0.1 * rss else None

    held, reported, rss = wait_until(refreshed, what="the worker's figure to follow its resident memory")
    estimate = 120 * 2**20  # minilm's memory_estimate
    file_size = (MODELS / "minilm" / "model.onnx").stat().st_size
    # the process holds the interpreter and runtime too: more than the model's own estimate
    assert reported >= max(file_size, estimate)
    assert abs(reported - rss) <= 0.1 * rss, (reported, rss)
    assert held["minilm"] < reported, "in-process, the same model is counted without an interpreter"


def test_unload_ends_the_process_and_frees_its_bytes(daemon, client):
    client.embed(["load it"], "minilm-worker")
    pid = worker_pid(daemon, "minilm-worker")
    def worker_share():
        # The books less the daemon's own share and every other model's, read
        # from one snapshot: both move on their own (a model's measured bytes
        # are refreshed after it runs), so only the worker's share is compared.
        stats = client.node_stats()
        others = sum(m.memory_bytes for m in stats.models if m.name != "minilm-worker")
        return stats.memory_used_bytes - stats.daemon_memory_bytes - others

    held = {m.name: m.memory_bytes for m in client.node_stats().models}["minilm-worker"]
    assert held > 0
    assert worker_share() == held
    client.unload("minilm-worker")
    _wait_until(lambda: not Path(f"/proc/{pid}").exists(), what="the worker to exit")
    assert worker_share() == 0
    assert "minilm-worker" not in {m.name for m in client.node_stats().models if m.state == "READY"}


async def _stream_until_failure(address: str, model: str, started: asyncio.Event, counter: list[int]):
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gg.GenerationStub(channel)
        request = g.GenerateRequest(model=model, prompt="Count slowly to one thousand:",
                                    sampling=g.SamplingParams(max_tokens=400, ignore_eos=True))
        try:
            async for response in stub.Generate(request, timeout=300):
                if response.token_ids:
                    counter[0] += 1
                    if counter[0] >= 8 * 3:
                        started.set()
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details()
        return grpc.StatusCode.OK, ""


def _in_flight(client: Client, model: str) -> int:
    return next((m.in_flight for m in client.node_stats().models if m.name == model), 0)


def _embedding_traffic(address: str, stop: threading.Event, outcomes: list) -> None:
    with Client(address, timeout=60) as c:
        while not stop.is_set():
            try:
                c.embed(["other models keep serving"], "minilm")
                outcomes.append("ok")
            except grpc.RpcError as exc:
                outcomes.append(f"{exc.code().name}: {exc.details()}")


@pytest.mark.parametrize("sig", [signal.SIGSEGV, signal.SIGKILL], ids=["SIGSEGV", "SIGKILL"])
def test_a_dead_worker_fails_only_its_own_calls(daemon, client, stub, sig):
    _greedy(stub, "llm", "warm", 1)  # loaded (again, after the previous case's death)
    pid = worker_pid(daemon, "llm")
    deaths = _metric(daemon, "modeld_worker_deaths_total", model="llm", backend="llamacpp", stage="run")
    stop, embeddings = threading.Event(), []
    traffic = threading.Thread(target=_embedding_traffic, args=(daemon.address, stop, embeddings))
    traffic.start()

    async def run():
        started, counter = asyncio.Event(), [0]
        streams = [asyncio.create_task(_stream_until_failure(daemon.address, "llm", started, counter))
                   for _ in range(8)]
        await asyncio.wait_for(started.wait(), 120)
        os.kill(pid, sig)
        return await asyncio.gather(*streams)

    try:
        results = asyncio.run(run())
    finally:
        stop.set()
        traffic.join()
    for code, details in results:
        assert code == grpc.StatusCode.UNAVAILABLE, (code, details)
        assert f"worker for model 'llm' (pid {pid}) died: signal {sig.name}" in details
    assert embeddings and all(o == "ok" for o in embeddings), set(embeddings)
    assert _health(daemon, "") == health_pb2.HealthCheckResponse.SERVING
    _wait_until(lambda: _metric(daemon, "modeld_worker_deaths_total", model="llm", backend="llamacpp",
                                stage="run") == deaths + 1, what="the death to be counted")
    assert _health(daemon, "llm") == health_pb2.HealthCheckResponse.NOT_SERVING
    reason = {m.name: m for m in client.models()}["llm"]
    assert reason.state == "UNAVAILABLE" and f"signal {sig.name}" in reason.reason
    # the next request loads it again (after the backoff), in a new process
    _wait_until(lambda: _serves_again(stub), 60, "the model to serve again")
    new_pid = worker_pid(daemon, "llm")
    assert new_pid != pid
    assert _health(daemon, "llm") == health_pb2.HealthCheckResponse.SERVING


def _serves_again(stub) -> bool:
    try:
        return len(_greedy(stub, "llm", "The capital of France is", 4)) == 4
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc.details()
        assert "the next start may happen in" in exc.details(), exc.details()
        return False


def test_a_worker_killed_between_batches_fails_its_calls_in_flight(daemon, client):
    """Tensor models: the batches in flight on the dead worker fail
    UNAVAILABLE, the in-process model's all succeed."""
    client.embed(["load it"], "minilm-worker")
    pid = worker_pid(daemon, "minilm-worker")
    stop, others = threading.Event(), []
    traffic = threading.Thread(target=_embedding_traffic, args=(daemon.address, stop, others))
    traffic.start()
    failures = []

    def victim_traffic():
        with Client(daemon.address, timeout=60) as c:
            while not stop.is_set():
                try:
                    c.embed(["a batch in flight " * 20] * 16, "minilm-worker")
                except grpc.RpcError as exc:
                    failures.append((exc.code(), exc.details()))
                    return

    victims = [threading.Thread(target=victim_traffic) for _ in range(4)]
    for t in victims:
        t.start()
    # a batch on the worker when it dies (the victims keep one there from now on)
    _wait_until(lambda: _in_flight(client, "minilm-worker"), what="a batch in flight on the worker")
    os.kill(pid, signal.SIGKILL)
    for t in victims:
        t.join(60)
    stop.set()
    traffic.join()
    assert failures and all(code == grpc.StatusCode.UNAVAILABLE for code, _ in failures), failures
    assert any(f"(pid {pid}) died: signal SIGKILL" in details for _, details in failures), failures
    assert others and all(o == "ok" for o in others), set(others)
    assert _health(daemon, "") == health_pb2.HealthCheckResponse.SERVING


# On this PYTHONPATH the daemon and its workers load tests/worker_faults: its
# onnx backend fails a load as the model folder's FAULT file says.
FAULTS = Path(__file__).resolve().parents[1] / "worker_faults"


def _faulty_model(root: Path, name: str, fault: str) -> dict:
    """A model whose worker fails its load with `fault`, and the daemon's
    environment that makes it so."""
    (root / name).mkdir()
    (root / name / "model.onnx").write_bytes(onnx_fixtures.double_int64())
    (root / name / "model.toml").write_text('format = "onnx"\nbackends = ["onnx"]\nisolation = "process"\n')
    (root / name / "FAULT").write_text(fault)
    return {"PYTHONPATH": os.pathsep.join(filter(None, (str(FAULTS), os.environ.get("PYTHONPATH"))))}


def test_a_crash_loop_backs_off(tmp_path):
    """A worker that aborts while loading (tests/worker_faults stands in for
    a runtime that crashes on a bad file): each load fails naming the
    signal, and the wait before the next start grows."""
    env = _faulty_model(tmp_path, "crashy", "abort")
    daemon = start_daemon("--no-preload", repository=tmp_path, env={
        **env, "MODELD_WORKER_RESTART_BACKOFF_S": "0.5", "MODELD_WORKER_RESTART_BACKOFF_MAX_S": "4"})
    try:
        with Client(daemon.address, timeout=60) as c:
            x = {"x": np.array([[1, 2, 3]], np.int64)}
            waits = []
            for attempt in range(3):
                with pytest.raises(grpc.RpcError) as failed:
                    c.infer("crashy", x)
                assert "died while loading: signal SIGABRT" in failed.value.details(), failed.value.details()
                with pytest.raises(grpc.RpcError) as backing_off:
                    c.infer("crashy", x)
                assert backing_off.value.code() == grpc.StatusCode.UNAVAILABLE
                wait = float(re.search(r"may happen in ([0-9.]+) s", backing_off.value.details()).group(1))
                waits.append(wait)
                time.sleep(wait + 0.2)
            assert waits[0] <= 0.5 < waits[1] <= 1.0 < waits[2] <= 2.0, waits
            assert _metric(daemon, "modeld_worker_deaths_total", model="crashy", backend="onnx", stage="load") == 3
            assert _health(daemon, "") == health_pb2.HealthCheckResponse.SERVING
            # an operator's unload clears the backoff
            c.unload("crashy")
            with pytest.raises(grpc.RpcError) as again:
                c.infer("crashy", x)
            assert "died while loading" in again.value.details()
    finally:
        assert daemon.stop() == 0


def test_a_worker_that_hangs_while_loading_is_killed(tmp_path):
    env = _faulty_model(tmp_path, "stuck", "hang")
    daemon = start_daemon("--no-preload", repository=tmp_path, env={**env, "MODELD_WORKER_LOAD_TIMEOUT_S": "3"})
    try:
        with Client(daemon.address, timeout=60) as c:
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as failed:
                c.infer("stuck", {"x": np.array([[1, 2, 3]], np.int64)})
            assert "did not finish loading within 3 s and was killed" in failed.value.details()
            assert time.monotonic() - started < 30
            assert not worker_pids(daemon, "stuck")
            assert _health(daemon, "") == health_pb2.HealthCheckResponse.SERVING
    finally:
        assert daemon.stop() == 0
