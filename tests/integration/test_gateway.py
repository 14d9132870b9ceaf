"""`modeld gateway` in front of three real daemons on loopback: the stock
tritonclient and our stubs through it, placement on the ring, prefix
affinity, a frozen node, a node joining, a node killed under load, and
what the gateway answers to bad input."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.utils import InferenceServerException

import onnx_fixtures
from daemon import MODELS, start_daemon, start_gateway
from modeld.gen import generation_pb2 as gen
from modeld.gen import generation_pb2_grpc as gen_grpc
from modeld.gen import inference_pb2 as pb
from modeld.gen import inference_pb2_grpc as pb_grpc
from modeld.server.gateway.ring import HashRing

SENTENCES = ["the gateway forwards bytes", "a second sentence"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _repository(tmp: Path) -> Path:
    for name in ("minilm", "smollm2", "smollm2-draft"):
        (tmp / name).symlink_to(MODELS / name)
    return tmp


def _metrics(process) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{process.metrics_port}/metrics", timeout=5).read().decode()


def _metric(process, name: str, **labels) -> float:
    """The sum of every series of `name` whose labels include `labels`."""
    total, found = 0.0, False
    for line in _metrics(process).splitlines():
        match = re.match(rf"{re.escape(name)}(?:\{{(.*)\}})? ([0-9.e+-]+)$", line)
        if not match:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total, found = total + float(match.group(2)), True
    return total if found else 0.0


def _served(daemon, model: str) -> float:
    return _metric(daemon, "modeld_requests_total", model=model)


def _wait(predicate, timeout: float, what: str) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if predicate():
            return time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError(f"{what} did not happen within {timeout} s")


def _texts(texts) -> tc.InferInput:
    x = tc.InferInput("text", [len(texts)], "BYTES")
    x.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
    return x


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Three daemons, and a fourth address that comes up later (joining)."""
    repo = _repository(tmp_path_factory.mktemp("repo"))
    with ThreadPoolExecutor(3) as pool:
        daemons = list(pool.map(lambda _: start_daemon("--no-preload", repository=repo), range(3)))
    late_port = _free_port()
    # hedging's default budget (5% of calls) is spent on the natural p95 tail
    # of the warm-up calls; a larger one lets the frozen-node test see hedges
    # fire without thousands of calls first
    config = tmp_path_factory.mktemp("gateway") / "gateway.toml"
    config.write_text("[gateway]\nhedge_ratio = 0.25\n[gateway.splits.canary-demo]\ncanary-a = 1\ncanary-b = 1\n")
    gateway = start_gateway(*(d.address for d in daemons), f"127.0.0.1:{late_port}", args=("--config", str(config)))
    client = tc.InferenceServerClient(f"127.0.0.1:{gateway.port}")
    _wait(lambda: client.is_server_ready(), 20, "gateway ready")
    state = {"daemons": daemons, "gateway": gateway, "repo": repo, "late_port": late_port, "late": None,
             "revived": None}
    yield state
    for process in [gateway, *daemons, *(state[k] for k in ("late", "revived") if state[k])]:
        if process.proc.poll() is None:
            os.kill(process.proc.pid, signal.SIGCONT)
            process.stop()


def _ring(addresses) -> HashRing:
    ring = HashRing(150)
    for address in addresses:
        ring.add(address)
    return ring


def test_tritonclient_works_unchanged_through_the_gateway(fleet):
    gw = tc.InferenceServerClient(f"127.0.0.1:{fleet['gateway'].port}")
    direct = tc.InferenceServerClient(fleet["daemons"][0].address)
    assert gw.is_server_live() and gw.is_server_ready()
    through = gw.infer("minilm", [_texts(SENTENCES)]).as_numpy("embedding")
    expected = direct.infer("minilm", [_texts(SENTENCES)]).as_numpy("embedding")
    assert through.shape == (2, 384)
    np.testing.assert_allclose(through, expected, atol=1e-5)
    metadata = gw.get_model_metadata("minilm")
    assert metadata.name == "minilm" and [i.name for i in metadata.inputs] == ["text"]
    assert gw.is_model_ready("minilm")
    names = {m.name for m in gw.get_model_repository_index().models}
    assert {"minilm", "smollm2"} <= names

    results = []
    done = threading.Event()
    gw.start_stream(callback=lambda result, error: (results.append((result, error)),
                                                    len(results) == 3 and done.set()))
    for i in range(3):
        gw.async_stream_infer("minilm", [_texts([f"stream {i}"])], request_id=str(i))
    assert done.wait(30)
    gw.stop_stream()
    assert all(error is None for _, error in results)
    assert sorted(r.get_response().id for r, _ in results) == ["0", "1", "2"]


def test_a_model_always_lands_on_its_replicas(fleet):
    daemons = fleet["daemons"]
    gw = tc.InferenceServerClient(f"127.0.0.1:{fleet['gateway'].port}")
    replicas = set(_ring([d.address for d in daemons]).replicas("minilm", 2))
    before = {d.address: _served(d, "minilm") for d in daemons}
    for _ in range(30):
        gw.infer("minilm", [_texts(["placement"])])
    grew = {d.address: _served(d, "minilm") - before[d.address] for d in daemons}
    assert sum(grew.values()) == 30
    outsider = next(d.address for d in daemons if d.address not in replicas)
    assert grew[outsider] == 0, grew
    picks = _metric(fleet["gateway"], "modeld_gateway_picks_total")
    assert picks >= 30


def test_a_split_model_shares_its_calls_and_a_session_keeps_its_target(fleet):
    gw = tc.InferenceServerClient(f"127.0.0.1:{fleet['gateway'].port}")
    for name in ("canary-a", "canary-b"):
        config = onnx_fixtures.triton_config(name, [("x", "FP32", [4])], [("y", "FP32", [4])])
        gw.load_model(name, config=json.dumps(config), files={"file:1/model.onnx": onnx_fixtures.add_fp32()})
    x = tc.InferInput("x", [1, 4], "FP32")
    x.set_data_from_numpy(np.zeros((1, 4), np.float32))

    def target(session: str) -> str:
        result = gw.infer("canary-demo", [x], headers={"x-session-id": session})
        np.testing.assert_allclose(result.as_numpy("y"), 1.0, rtol=1e-5)
        return result.get_response().model_name

    first = {f"conversation-{i}": target(f"conversation-{i}") for i in range(24)}
    assert set(first.values()) == {"canary-a", "canary-b"}, first
    assert all(target(session) == name for session, name in list(first.items())[:8])
    assert _metric(fleet["gateway"], "modeld_gateway_split_calls_total") >= 32
    with pytest.raises(InferenceServerException, match="canary-demo"):
        tc.InferenceServerClient(fleet["daemons"][0].address).infer("canary-demo", [x])


def test_bad_input_gets_a_clear_status(fleet):
    channel = grpc.insecure_channel(f"127.0.0.1:{fleet['gateway'].port}")
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(pb.ModelInferRequest(model_name="no-such-model"))
    # the owning replica's answer, not the gateway's guess
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "no-such-model" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelReady(pb.ModelReadyRequest(name="minilm"), metadata=[("x-modeld-urgency", "very")])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "x-modeld-urgency" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelReady(pb.ModelReadyRequest(name="minilm"), metadata=[("x-modeld-request-type", "bulk")])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    raw = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
    with pytest.raises(grpc.RpcError) as err:
        raw(b"\x0a\xff\xff\xff\xff\x0f")  # field 1 claims 4 GB
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # update traffic is accepted and served
    assert stub.ModelReady(pb.ModelReadyRequest(name="minilm"),
                           metadata=[("x-modeld-request-type", "update")]).ready in (True, False)
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(service="")).status == health_pb2.HealthCheckResponse.SERVING
    channel.close()


def _conversation_turn(stub, messages, request_id):
    stream = stub.Generate(gen.GenerateRequest(
        model="smollm2", messages=gen.ChatMessages(messages=messages),
        sampling=gen.SamplingParams(max_tokens=8, temperature=0.0)), metadata=[("x-request-id", request_id)])
    replies = list(stream)
    return "".join(r.text for r in replies), replies[-1].usage


def test_prefix_affinity_sends_a_conversation_back_to_its_cache(fleet):
    daemons = fleet["daemons"]
    stub = gen_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{fleet['gateway'].port}"))
    system = "You are a terse assistant for the modeld gateway tests. " * 12
    before = {d.address: _metric(d, "modeld_prefix_cache_hit_tokens_total", model="smollm2") for d in daemons}
    served_before = {d.address: _served(d, "smollm2") for d in daemons}
    messages = [gen.ChatMessage(role="system", content=system), gen.ChatMessage(role="user", content="Hello?")]
    cached = []
    for turn in range(3):
        reply, usage = _conversation_turn(stub, messages, f"affinity-{turn}")
        cached.append(usage.cached_prompt_tokens)
        messages += [gen.ChatMessage(role="assistant", content=reply),
                     gen.ChatMessage(role="user", content=f"And turn {turn}?")]
    served = {d.address: _served(d, "smollm2") - served_before[d.address] for d in daemons}
    picks = [line for line in _metrics(fleet["gateway"]).splitlines() if line.startswith("modeld_gateway_picks_total")]
    # one node took the whole conversation
    assert sorted(served.values()) == [0, 0, 3], (served, picks, [
        e for e in fleet["gateway"].logs if e.get("event") in ("retry", "node_unresponsive", "breaker_transition")])
    assert cached[1] > 100 and cached[2] > cached[1] - 20, cached
    hits = sum(_metric(d, "modeld_prefix_cache_hit_tokens_total", model="smollm2") - before[d.address]
               for d in daemons)
    assert hits == sum(cached)
    # placed by the cache, not by chance: on the daemons' KV events (worker models publish them
    # too) or, before a node's event stream is up, on the gateway's own prefix guess
    assert sum(_metric(fleet["gateway"], "modeld_gateway_picks_total", reason=r) for r in ("kv", "prefix")) >= 2, picks


def test_a_frozen_node_trips_its_breaker_hedging_covers_it_and_it_recovers(fleet):
    daemons, gateway = fleet["daemons"], fleet["gateway"]
    gw = tc.InferenceServerClient(f"127.0.0.1:{gateway.port}")
    urgent = {"x-modeld-urgency": "high"}
    served_before = {d.address: _served(d, "minilm") for d in daemons}
    for _ in range(60):  # the p95 the hedge waits for
        gw.infer("minilm", [_texts(["warm"])], headers=urgent)
    # freeze the node the gateway routes minilm to: the one that served the
    # warm-up. The gateway's ring also holds the late node's address, so a
    # ring of the three daemons alone can name another primary.
    frozen = max(daemons, key=lambda d: _served(d, "minilm") - served_before[d.address])
    hedged_before = _metric(gateway, "modeld_gateway_hedges_fired_total")
    os.kill(frozen.proc.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        for _ in range(20):
            gw.infer("minilm", [_texts(["while frozen"])], headers=urgent, client_timeout=10)
        assert time.monotonic() - started < 15
        _wait(lambda: _metric(gateway, "modeld_gateway_breaker_state", node=frozen.address) == 2, 10,
              "the frozen node's breaker opening")
    finally:
        os.kill(frozen.proc.pid, signal.SIGCONT)
    assert _metric(gateway, "modeld_gateway_hedges_fired_total") > hedged_before, [
        e for e in gateway.logs if e.get("event") in ("hedge", "breaker_transition", "retry", "node_stats_timeout")]
    _wait(lambda: _metric(gateway, "modeld_gateway_breaker_state", node=frozen.address) == 0, 20,
          "the breaker closing after SIGCONT")
    before = _served(frozen, "minilm")

    def frozen_node_serves_again() -> bool:
        gw.infer("minilm", [_texts(["back"])])
        return _served(frozen, "minilm") > before

    _wait(frozen_node_serves_again, 20, "the recovered node taking calls again")


def test_a_node_joining_takes_its_share_of_the_ring(fleet):
    daemons, gateway = fleet["daemons"], fleet["gateway"]
    late_address = f"127.0.0.1:{fleet['late_port']}"
    everyone = [d.address for d in daemons] + [late_address]
    ring = _ring(everyone)
    mine = [f"joined-{i}" for i in range(40) if late_address in ring.replicas(f"joined-{i}", 2)][:2]
    other = next(f"joined-{i}" for i in range(40) if late_address not in ring.replicas(f"joined-{i}", 2))
    fleet["late"] = late = start_daemon("--no-preload", "--grpc-port", str(fleet["late_port"]),
                                        repository=fleet["repo"])
    _wait(lambda: _metric(gateway, "modeld_gateway_node_serving", node=late_address) == 1, 20, "the late node joining")
    # its breaker opened while the address refused calls; until the half-open
    # probe closes it, a load skips the node (it is not `usable`)
    _wait(lambda: _metric(gateway, "modeld_gateway_breaker_state", node=late_address) == 0, 30,
          "the late node's breaker closing")
    gw = tc.InferenceServerClient(f"127.0.0.1:{gateway.port}")
    for name in [*mine, other]:
        config = onnx_fixtures.triton_config(name, [("x", "FP32", [4])], [("y", "FP32", [4])])
        gw.load_model(name, config=json.dumps(config), files={"file:1/model.onnx": onnx_fixtures.add_fp32()})
    late_models = {m.name: m.state for m in tc.InferenceServerClient(late.address).get_model_repository_index().models}
    for name in mine:
        assert late_models.get(name) == "READY", late_models
    assert other not in late_models
    # the other replicas of `mine` hold them too: loads go to every replica
    for name in mine:
        holders = [d for d in [*daemons, late] if d.address in ring.replicas(name, 2)]
        for d in holders:
            assert tc.InferenceServerClient(d.address).is_model_ready(name)
    x = tc.InferInput("x", [1, 4], "FP32")
    x.set_data_from_numpy(np.zeros((1, 4), np.float32))
    np.testing.assert_allclose(gw.infer(mine[0], [x]).as_numpy("y"), 1.0, rtol=1e-5)


def test_a_node_killed_under_load_loses_no_call(fleet):
    daemons, gateway = fleet["daemons"], fleet["gateway"]
    gw_address = f"127.0.0.1:{gateway.port}"
    victim = next(d for d in daemons if d.address == _ring([d.address for d in daemons]).replicas("minilm", 2)[0])
    failures, successes, stop = [], [0], threading.Event()

    def traffic():
        client = tc.InferenceServerClient(gw_address)
        while not stop.is_set():
            try:
                client.infer("minilm", [_texts(["under load"])], client_timeout=10)
                successes[0] += 1
            except InferenceServerException as exc:
                failures.append(str(exc))
            time.sleep(0.02)

    threads = [threading.Thread(target=traffic) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    victim.proc.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    opened = _wait(lambda: _metric(gateway, "modeld_gateway_breaker_state", node=victim.address) == 2, 5,
                   "the killed node's breaker opening")
    time.sleep(2)
    stop.set()
    for t in threads:
        t.join()
    assert failures == []
    assert successes[0] >= 20  # traffic ran throughout (fewer calls on a busy machine)
    assert opened < 1.0, f"breaker opened {opened:.2f} s after the kill"
    assert time.monotonic() - killed_at > 2


def test_a_node_restarted_on_the_same_address_rejoins_and_one_killed_mid_load_loses_no_load(fleet):
    daemons, gateway = fleet["daemons"], fleet["gateway"]
    dead = next(d for d in daemons if d.proc.poll() is not None)  # the previous test's victim
    revived = start_daemon("--no-preload", "--grpc-port", str(dead.port), repository=fleet["repo"])
    fleet["revived"] = revived
    daemons[daemons.index(dead)] = revived
    _wait(lambda: _metric(gateway, "modeld_gateway_breaker_state", node=revived.address) == 0
          and _metric(gateway, "modeld_gateway_node_serving", node=revived.address) == 1, 20,
          "the restarted node rejoining")
    gw = tc.InferenceServerClient(f"127.0.0.1:{gateway.port}")
    # the other home has minilm loaded and keeps its calls (residency) until
    # this one holds it too: a load through the gateway reaches both homes
    gw.load_model("minilm")

    def revived_serves_minilm() -> bool:
        gw.infer("minilm", [_texts(["again"])])
        return _served(revived, "minilm") > 0

    _wait(revived_serves_minilm, 20, "the restarted node taking calls")

    # a load whose homes include the revived node, which dies while loading
    ring = _ring([d.address for d in daemons] + [f"127.0.0.1:{fleet['late_port']}"])
    name = next(f"big-{i}" for i in range(100) if revived.address in ring.replicas(f"big-{i}", 2))
    config = onnx_fixtures.triton_config(name, [("x", "FP32", [4])], [("y", "FP32", [4])])
    files = {"file:1/model.onnx": onnx_fixtures.add_fp32(10_000_000)}
    result: list = []

    def load() -> None:
        try:
            result.append(gw.load_model(name, config=json.dumps(config), files=files, client_timeout=60))
        except InferenceServerException as exc:
            result.append(exc)

    loader = threading.Thread(target=load)
    loader.start()
    time.sleep(0.3)
    revived.proc.send_signal(signal.SIGKILL)
    loader.join(60)
    assert not loader.is_alive(), "the load hung"
    # the other home normally loads it (OK); if the gateway answered while the
    # dying node's failure was the only one in, loading again must succeed
    if result != [None]:
        gw.load_model(name, config=json.dumps(config), files=files, client_timeout=60)
    x = tc.InferInput("x", [1, 4], "FP32")
    x.set_data_from_numpy(np.zeros((1, 4), np.float32))
    np.testing.assert_allclose(gw.infer(name, [x]).as_numpy("y"), 1.0, rtol=1e-5)


def test_with_every_node_down_calls_fail_unavailable_at_once(fleet):
    gateway = fleet["gateway"]
    for process in [*fleet["daemons"], fleet["late"]]:
        if process is not None and process.proc.poll() is None:
            process.proc.send_signal(signal.SIGKILL)
    channel = grpc.insecure_channel(f"127.0.0.1:{gateway.port}")
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    _wait(lambda: not stub.ServerReady(pb.ServerReadyRequest()).ready, 10, "the gateway noticing")
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(pb.ModelInferRequest(model_name="minilm"), timeout=30)
    assert time.monotonic() - started < 2
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "not serving" in err.value.details()
    health = health_pb2_grpc.HealthStub(channel)
    _wait(lambda: health.Check(health_pb2.HealthCheckRequest(service="")).status
          == health_pb2.HealthCheckResponse.NOT_SERVING, 2, "the gateway's own health turning NOT_SERVING")
    channel.close()


def test_a_dns_name_that_resolves_to_nothing_answers_unavailable():
    gateway = start_gateway(args=("--dns", "no-such-host.invalid:8001"))
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{gateway.port}")
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        assert stub.ServerLive(pb.ServerLiveRequest()).live
        assert not stub.ServerReady(pb.ServerReadyRequest()).ready
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(pb.ModelInferRequest(model_name="minilm"), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "resolves to no address" in err.value.details()
        channel.close()
    finally:
        assert gateway.stop() == 0
