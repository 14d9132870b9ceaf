"""modeld.v1.Node through a real daemon: every figure a gateway routes by
follows what the daemon really does (calls in flight, KV cells, memory,
latency, counts), and WatchStats streams until cancelled or drained."""

from __future__ import annotations

import re
import socket
import struct
import threading
import time
import urllib.request

import grpc
import pytest

from daemon import MODELS, add_small_smollm2, start_daemon
from modeld.clients import AsyncClient, Client
from modeld.gen import generation_pb2 as g
from modeld.gen import generation_pb2_grpc as gg
from modeld.gen import inference_pb2 as pb
from modeld.gen import inference_pb2_grpc as pb_grpc
from modeld.gen import node_pb2, node_pb2_grpc
from modeld.server.services.node import watch_interval_s
from polling import wait_until


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """minilm and a small-context smollm2 only: the full repository's torch
    model would compile for a minute before this module could start."""
    root = tmp_path_factory.mktemp("repo")
    (root / "minilm").symlink_to(MODELS / "minilm", target_is_directory=True)
    add_small_smollm2(root)
    proc = start_daemon(repository=root, env={"MODELD_DRAIN_DELAY_S": "1.0"})
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def channel(daemon):
    with grpc.insecure_channel(daemon.address) as channel:
        yield channel


@pytest.fixture(scope="module")
def node(channel):
    return node_pb2_grpc.NodeStub(channel)


def _stats(node) -> node_pb2.NodeStats:
    return node.Stats(node_pb2.NodeStatsRequest(), timeout=10)


def _model(stats: node_pb2.NodeStats, name: str) -> node_pb2.ModelLoad:
    return next(m for m in stats.models if m.name == name)


def _wait_for(node, predicate, timeout: float = 60.0) -> node_pb2.NodeStats:
    def reached() -> node_pb2.NodeStats | None:
        stats = _stats(node)
        return stats if predicate(stats) else None

    return wait_until(reached, timeout, "the node's figures")


def _embed(channel, input_name: str = "text") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="minilm")
    request.inputs.add(name=input_name, datatype="BYTES", shape=[1])
    request.raw_input_contents.append(struct.pack("<I", 5) + b"hello")
    return pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)


def _metric(daemon, name: str, **labels) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=10).read().decode()
    series = name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
    match = re.search("^" + re.escape(series) + r" ([0-9.e+]+)$", text, re.M)
    assert match, f"{series} is not in the metrics"
    return float(match.group(1))


def _long_generation(channel, max_tokens: int = 1000):
    request = g.GenerateRequest(model="smollm2", prompt="Count from one to a thousand: one, two,",
                                sampling=g.SamplingParams(max_tokens=max_tokens, ignore_eos=True, cache_prompt=False))
    return gg.GenerationStub(channel).Generate(request, timeout=120)


def test_the_node_describes_itself(node, daemon):
    stats = _stats(node)
    assert stats.node_id == socket.gethostname()
    assert {m.name for m in stats.models} == {"minilm", "smollm2"}
    assert stats.uptime_s > 0 and not stats.draining
    assert stats.memory_budget_bytes > 0
    # the daemon's own share is in the books beside its models: the budget holds for the whole process
    assert stats.daemon_memory_bytes > 0
    assert stats.memory_used_bytes == stats.daemon_memory_bytes + sum(m.memory_bytes for m in stats.models)
    assert stats.memory_used_bytes == _metric(daemon, "modeld_memory_used_bytes")
    assert (stats.gpu_memory_used_bytes, stats.gpu_memory_total_bytes) == (0, 0)  # no torch in this daemon


def test_an_infer_shows_in_memory_counts_and_latency(node, channel, daemon):
    before = _model(_stats(node), "minilm")
    for _ in range(3):
        _embed(channel)
    stats = _stats(node)
    minilm = _model(stats, "minilm")
    assert minilm.state == "READY" and minilm.backend == "onnx"
    assert minilm.memory_bytes > 0
    assert minilm.memory_bytes == _metric(daemon, "modeld_loaded_bytes", model="minilm", backend="onnx")
    assert minilm.request_count - before.request_count == 3
    assert minilm.failure_count == before.failure_count
    assert minilm.p99_latency_s > 0 and 0 < minilm.p95_latency_s <= minilm.p99_latency_s
    assert minilm.in_flight == 0 and minilm.queue_depth == 0
    assert minilm.kv_cells_capacity == 0  # a tensor model has no KV cache


def test_a_bad_request_counts_as_a_request_but_not_a_failure(node, channel):
    before = _model(_stats(node), "minilm")
    with pytest.raises(grpc.RpcError) as err:
        _embed(channel, input_name="no_such_input")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = _model(_stats(node), "minilm")
    assert after.request_count - before.request_count == 1
    assert after.failure_count == before.failure_count
    assert after.in_flight == 0


def test_a_call_that_runs_out_of_time_is_a_server_side_failure(node, channel):
    request = pb.ModelInferRequest(model_name="smollm2")
    request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(struct.pack("<I", 5) + b"Hello")
    request.parameters["max_tokens"].int64_param = 500
    request.parameters["ignore_eos"].bool_param = True
    request.parameters["timeout"].int64_param = 2000  # microseconds: far less than 500 tokens take
    before = _model(_stats(node), "smollm2")
    with pytest.raises(grpc.RpcError) as err:
        pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    after = _model(_stats(node), "smollm2")
    assert after.failure_count - before.failure_count == 1
    assert after.request_count - before.request_count == 1
    assert after.in_flight == 0


def test_a_generation_is_in_flight_with_its_kv_cells_until_it_ends(node, channel):
    stream = _long_generation(channel)
    next(stream)  # the sequence is running
    during = _wait_for(node, lambda s: _model(s, "smollm2").kv_cells_used > 0)
    smollm2 = _model(during, "smollm2")
    assert smollm2.in_flight >= 1 and during.in_flight >= smollm2.in_flight
    assert 0 < smollm2.kv_cells_used <= smollm2.kv_cells_capacity == 4096
    assert during.kv_cells_capacity == smollm2.kv_cells_capacity
    stream.cancel()
    after = _wait_for(node, lambda s: _model(s, "smollm2").in_flight == 0)
    assert after.in_flight == 0

    finished = list(_long_generation(channel, max_tokens=8))
    assert finished[-1].usage.completion_tokens == 8
    assert _model(_stats(node), "smollm2").in_flight == 0  # counted out before the stream's end reached us


def test_a_finished_generation_counts_once_with_its_latency(node, channel):
    before = _model(_stats(node), "smollm2")
    list(_long_generation(channel, max_tokens=4))
    after = _model(_stats(node), "smollm2")
    assert after.request_count - before.request_count == 1
    assert after.p99_latency_s > 0 and after.failure_count == before.failure_count


def test_watch_streams_snapshots_until_cancelled(node, channel):
    call = node.WatchStats(node_pb2.WatchStatsRequest(interval_ms=100), timeout=30)
    seen, started = [], time.monotonic()
    for stats in call:
        seen.append(stats)
        if len(seen) == 3:
            break
    elapsed = time.monotonic() - started
    call.cancel()
    assert len(seen) == 3 and all(s.node_id == socket.gethostname() for s in seen)
    assert seen[0].uptime_s < seen[1].uptime_s < seen[2].uptime_s
    # two intervals of 100 ms between three snapshots, by the daemon's clock
    # and by ours; how much longer a busy machine takes is no fact about the
    # watch, so the interval asked for is checked where the daemon reads it
    gaps = [later.uptime_s - earlier.uptime_s for earlier, later in zip(seen, seen[1:])]
    assert all(gap >= 0.1 - 1e-3 for gap in gaps), gaps
    assert elapsed >= 0.15
    assert watch_interval_s(100) == 0.1  # what was asked, not the one-second default
    with pytest.raises(grpc.RpcError) as err:
        next(call)
    assert err.value.code() == grpc.StatusCode.CANCELLED


def test_reflection_lists_the_node_service(channel):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
    assert "modeld.v1.Node" in {s.name for r in responses for s in r.list_services_response.service}
    file_request = reflection_pb2.ServerReflectionRequest(file_containing_symbol="modeld.v1.Node")
    answer = next(stub.ServerReflectionInfo(iter([file_request]), timeout=10))
    assert answer.file_descriptor_response.file_descriptor_proto  # grpcurl can describe it


def test_python_clients_read_node_stats(daemon):
    with Client(daemon.address) as client:
        assert {m.name for m in client.node_stats().models} == {"minilm", "smollm2"}


async def test_async_client_reads_node_stats(daemon):
    async with AsyncClient(daemon.address) as client:
        stats = await client.node_stats()
    assert stats.node_id == socket.gethostname()


def test_a_watch_ends_cleanly_when_the_daemon_drains(daemon, node):
    """Last in the module: it stops the module's daemon."""
    call = node.WatchStats(node_pb2.WatchStatsRequest(interval_ms=60_000), timeout=60)
    seen: list[node_pb2.NodeStats] = []
    ended: list[grpc.StatusCode] = []

    def follow():
        try:
            seen.extend(call)
            ended.append(grpc.StatusCode.OK)
        except grpc.RpcError as exc:
            ended.append(exc.code())

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    _wait_for_len(seen, 1)
    daemon.proc.send_signal(15)
    follower.join(60)
    # the watch saw the drain within its poll, long before its own minute-long interval
    assert ended == [grpc.StatusCode.OK], ended
    assert len(seen) == 2 and not seen[0].draining and seen[-1].draining
    assert daemon.proc.wait(30) == 0


def _wait_for_len(items: list, n: int, timeout: float = 60.0) -> None:
    wait_until(lambda: len(items) >= n, timeout, f"{n} items", interval=0.02)
