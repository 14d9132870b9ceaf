"""Deadlines and disconnects through a real daemon.

A gRPC deadline and KServe's `timeout` parameter (microseconds) both bound
a call: a request whose deadline passes while it waits in the dynamic
batcher is dropped without running; a generation past its deadline leaves
the running batch and frees its KV; a deadline already passed runs
nothing. A client killed mid-stream (SIGKILL: no cancel is ever sent, the
connection just dies) frees its sequence the same way. What ran is read
from ModelStatistics' counts and modeld.v1.Node's figures, never from
timings; no test sleeps and then asserts, and each timeout is far from
what the machine's speed could reach (see LONG_MAX_TOKENS).

An expired gRPC deadline is sent as a negative timeout, never as
`timeout=0`: grpc computes that deadline as "now", rounded up to the
next millisecond, so the daemon may receive it with a millisecond left,
and a tensor model that runs in less answers OK (a fresh machine did).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.request

import grpc
import numpy as np
import pytest

import onnx_fixtures
from daemon import ROOT, add_small_smollm2, start_daemon
from modeld.gen import generation_pb2 as g
from modeld.gen import generation_pb2_grpc as gg
from modeld.gen import inference_pb2 as pb
from modeld.gen import inference_pb2_grpc as pb_grpc
from modeld.gen import node_pb2, node_pb2_grpc
from polling import wait_until

QUEUE_DELAY_S = 1.5
# A generation meant to outlive its deadline asks for this many tokens:
# finishing within GENERATION_DEADLINE_S would take 800 tokens/s, several
# times what smollm2 (135M) reaches on its two threads (1000 tokens in
# 8 s is within reach of a fast machine).
LONG_MAX_TOKENS = 8000
GENERATION_DEADLINE_S = 10  # the first token of a warm model comes in well under a second
EXPIRED_S = -1.0  # a deadline one second past: grpc refuses the call before it leaves


def _tensor_model(root, name: str, batching: str) -> None:
    (root / name).mkdir()
    (root / name / "model.onnx").write_bytes(onnx_fixtures.add_fp32())
    (root / name / "model.toml").write_text(f'format = "onnx"\nbackends = ["onnx"]\n[batching]\n{batching}\n')


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("repo")
    # a lone request waits QUEUE_DELAY_S in the batcher for company
    _tensor_model(root, "waiting", f"max_batch_size = 8\nmax_queue_delay_us = {int(QUEUE_DELAY_S * 1e6)}")
    _tensor_model(root, "prompt", "max_batch_size = 8")
    # room for LONG_MAX_TOKENS in each of two sequences (smollm2's 8192-token window)
    add_small_smollm2(root, n_ctx=16384, n_slots=2, context_length=8192)
    proc = start_daemon(repository=root, env={"MODELD_DRAIN_DELAY_S": "0"})
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def channel(daemon):
    with grpc.insecure_channel(daemon.address) as channel:
        yield channel


@pytest.fixture(scope="module")
def stub(channel):
    return pb_grpc.GRPCInferenceServiceStub(channel)


@pytest.fixture(scope="module")
def node(channel):
    return node_pb2_grpc.NodeStub(channel)


def _add_request(model: str, timeout_us: int | None = None) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    request.raw_input_contents.append(np.ones((1, 4), np.float32).tobytes())
    if timeout_us is not None:
        request.parameters["timeout"].int64_param = timeout_us
    return request


def _counts(stub, model: str) -> tuple[int, int]:
    """(backend runs, rows run) of `model`, as ModelStatistics reports them."""
    stats = stub.ModelStatistics(pb.ModelStatisticsRequest(name=model), timeout=10).model_stats[0]
    return stats.execution_count, stats.inference_count


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def _smollm2(node) -> node_pb2.ModelLoad:
    stats = node.Stats(node_pb2.NodeStatsRequest(), timeout=10)
    return next(m for m in stats.models if m.name == "smollm2")


def _smollm2_metric(daemon, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=10).read().decode()
    match = re.search(rf'^{name}\{{backend="llamacpp",model="smollm2"\}} ([0-9.e+]+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def _running_sequences(daemon) -> float:
    return _smollm2_metric(daemon, "modeld_running_sequences")


def _wait_freed(daemon, node, timeout: float = 60.0) -> node_pb2.ModelLoad:
    """Until smollm2 has nothing in flight, no running sequence and no KV in use."""
    def freed() -> node_pb2.ModelLoad | None:
        load = _smollm2(node)
        if load.in_flight == 0 and load.kv_cells_used == 0 and _running_sequences(daemon) == 0:
            return load
        return None

    return wait_until(freed, timeout, "smollm2 to free its sequence")


def _long_generation(max_tokens: int = LONG_MAX_TOKENS) -> g.GenerateRequest:
    # cache_prompt off: a freed sequence then leaves no KV cells behind at all
    return g.GenerateRequest(model="smollm2", prompt="Count from one to a thousand: one, two,",
                             sampling=g.SamplingParams(max_tokens=max_tokens, ignore_eos=True, cache_prompt=False))


@pytest.mark.parametrize("how", ["timeout parameter", "grpc deadline"])
def test_a_request_whose_deadline_passes_in_the_queue_is_dropped_unrun(stub, how):
    runs, rows = _counts(stub, "waiting")
    # 0.3 s of a wait that lasts QUEUE_DELAY_S from arrival, however slow the machine
    if how == "timeout parameter":
        code = _code(lambda: stub.ModelInfer(_add_request("waiting", timeout_us=300_000), timeout=30))
    else:
        code = _code(lambda: stub.ModelInfer(_add_request("waiting"), timeout=0.3))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    # the model still serves a request that waits out the delay; the batcher
    # takes requests in order, so the batch the expired one waited in has
    # formed by the time this one is answered: in that batch or one of its
    # own, the expired request was dropped, not run
    response = stub.ModelInfer(_add_request("waiting"), timeout=30)
    assert np.frombuffer(response.raw_output_contents[0], np.float32).tolist() == [2.0] * 4
    assert _counts(stub, "waiting") == (runs + 1, rows + 1)


def test_an_expired_timeout_runs_nothing(stub):
    runs, rows = _counts(stub, "prompt")
    # 1 us, the shortest the parameter can say, counted from the request's
    # arrival: decoding and checking it alone take longer, so it has passed
    # when the batcher looks, and the model would otherwise run it at once
    code = _code(lambda: stub.ModelInfer(_add_request("prompt", timeout_us=1), timeout=30))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    expired = _code(lambda: stub.ModelInfer(_add_request("prompt"), timeout=EXPIRED_S))
    assert expired == grpc.StatusCode.DEADLINE_EXCEEDED
    assert _counts(stub, "prompt") == (runs, rows)
    stub.ModelInfer(_add_request("prompt"), timeout=30)
    assert _counts(stub, "prompt") == (runs + 1, rows + 1)


def test_a_generation_past_its_deadline_stops_and_frees_its_sequence(daemon, channel, node):
    generation = gg.GenerationStub(channel)
    list(generation.Generate(_long_generation(max_tokens=1), timeout=300))  # warm: no load inside the deadline
    before = _smollm2(node)
    stream = generation.Generate(_long_generation(), timeout=GENERATION_DEADLINE_S)
    next(stream)
    assert _smollm2(node).kv_cells_used > 0  # running, holding KV
    received = 1
    with pytest.raises(grpc.RpcError) as err:
        for _ in stream:
            received += 1
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert received < LONG_MAX_TOKENS
    after = _wait_freed(daemon, node)
    assert after.request_count == before.request_count + 1
    # the next generation runs normally
    done = list(generation.Generate(_long_generation(max_tokens=4), timeout=60))
    assert done[-1].usage.completion_tokens == 4


def test_a_generation_with_an_expired_deadline_runs_nothing(daemon, channel, node):
    _wait_freed(daemon, node)
    tokens_before = _smollm2_metric(daemon, "modeld_generated_tokens_total")
    requests_before = _smollm2(node).request_count
    generation = gg.GenerationStub(channel)
    code = _code(lambda: list(generation.Generate(_long_generation(), timeout=EXPIRED_S)))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_freed(daemon, node)
    assert _smollm2_metric(daemon, "modeld_generated_tokens_total") == tokens_before
    assert _smollm2(node).request_count == requests_before  # never reached the engine


def test_a_kserve_text_request_past_its_timeout_frees_its_sequence(daemon, stub, node):
    request = pb.ModelInferRequest(model_name="smollm2")
    request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    prompt = b"Count from one to a thousand: one, two,"
    request.raw_input_contents.append(len(prompt).to_bytes(4, "little") + prompt)
    request.parameters["max_tokens"].int64_param = LONG_MAX_TOKENS
    request.parameters["ignore_eos"].bool_param = True
    request.parameters["cache_prompt"].bool_param = False
    request.parameters["timeout"].int64_param = 1_000_000
    assert _code(lambda: stub.ModelInfer(request, timeout=60)) == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_freed(daemon, node)


CHILD = """
import sys, grpc
from modeld.gen import generation_pb2 as g, generation_pb2_grpc as gg
from modeld.gen import inference_pb2 as pb, inference_pb2_grpc as pbg
address, rpc, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
channel = grpc.insecure_channel(address)
if rpc == "Generate":
    request = g.GenerateRequest(model="smollm2", prompt="Count from one to a thousand: one, two,",
                                sampling=g.SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                        cache_prompt=False))
    stream = gg.GenerationStub(channel).Generate(request)
else:
    request = pb.ModelInferRequest(model_name="smollm2")
    request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    prompt = b"Count from one to a thousand: one, two,"
    request.raw_input_contents.append(len(prompt).to_bytes(4, "little") + prompt)
    request.parameters["max_tokens"].int64_param = max_tokens
    request.parameters["ignore_eos"].bool_param = True
    request.parameters["cache_prompt"].bool_param = False
    stream = pbg.GRPCInferenceServiceStub(channel).ModelStreamInfer(iter([request]))
for _ in stream:
    print("streaming", flush=True)
    break
sys.stdin.read()  # hold the stream open until killed
"""


@pytest.mark.parametrize("rpc", ["Generate", "ModelStreamInfer"])
def test_a_client_killed_mid_stream_frees_its_sequence(daemon, node, rpc):
    child = subprocess.Popen([sys.executable, "-c", CHILD, daemon.address, rpc, str(LONG_MAX_TOKENS)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert child.stdout.readline().strip() == "streaming"
        during = _smollm2(node)
        assert during.in_flight == 1 and during.kv_cells_used > 0
        child.kill()  # SIGKILL: the client never says goodbye
        child.wait(10)
        _wait_freed(daemon, node)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
    assert daemon.proc.poll() is None


# -- the rules themselves, without a daemon ---------------------------------------------


class _CallContext:
    """What a grpc.aio servicer context tells of its deadline."""

    def __init__(self, time_remaining: float | None) -> None:
        self._time_remaining = time_remaining

    def time_remaining(self) -> float | None:
        return self._time_remaining


def test_a_call_whose_deadline_passed_on_its_way_is_refused_before_it_starts():
    """The daemon's own check behind the negative-timeout calls above, which
    grpc refuses before they leave the client: a deadline that passes on the
    wire arrives as grpc.aio's time_remaining() of 0, and fails before the
    engine sees the request rather than running work nobody waits for."""
    from modeld.backends.errors import DeadlineExceeded
    from modeld.server.services.limits import call_timeout_s

    with pytest.raises(DeadlineExceeded, match="passed before the request started"):
        call_timeout_s(_CallContext(0.0))
    assert call_timeout_s(_CallContext(None)) is None  # no deadline: no timeout
    assert call_timeout_s(_CallContext(2.5)) == 2.5


async def test_the_batcher_runs_no_request_past_its_deadline():
    import asyncio

    from modeld.backends.errors import DeadlineExceeded
    from modeld.server.batcher import DynamicBatcher

    runs = []

    def execute(inputs, names):
        runs.append(inputs["x"].shape[0])
        return {"y": inputs["x"] + 1}

    batcher = DynamicBatcher(execute, max_batch_size=8, max_queue_delay_us=200_000)
    batcher.start()
    x = {"x": np.zeros((1, 4), np.float32)}
    try:
        with pytest.raises(DeadlineExceeded, match="was not run"):  # expired on arrival
            await batcher.submit(x, (), deadline=time.monotonic() - 1)
        # one expires while its batch waits for company, one leaves (its client
        # cancelled), one is still wanted: only that one runs
        expiring = asyncio.ensure_future(batcher.submit(x, (), deadline=time.monotonic() + 0.05))
        leaving = asyncio.ensure_future(batcher.submit(x, ()))
        wanted = asyncio.ensure_future(batcher.submit(x, ()))
        await asyncio.sleep(0)  # each has queued its request; the batch forms 0.2 s later at the soonest
        leaving.cancel()
        assert (await wanted)["y"].tolist() == [[1.0] * 4]
        with pytest.raises(DeadlineExceeded):
            await expiring
        assert runs == [1]
    finally:
        await batcher.stop()
