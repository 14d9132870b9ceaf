"""Scale-in under load: one of three daemons behind the gateway drains
(SIGTERM, as the kubelet sends it after the preStop hook) while generation
streams and unary embedding calls run through the gateway. Every call
succeeds, every stream ends with its finish reason, the gateway stops
placing calls on the leaving node at once, and the node exits cleanly
after its streams finished."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

from daemon import MODELS, add_small_smollm2, metric_sum, start_daemon, start_gateway
from modeld.gen import generation_pb2 as gen
from modeld.gen import generation_pb2_grpc as gen_grpc
from polling import wait_until

LLM = "smollm2"
NUM_STREAMS = 4
STREAM_TOKENS = 24


def _texts(texts) -> tc.InferInput:
    x = tc.InferInput("text", [len(texts)], "BYTES")
    x.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
    return x


@pytest.mark.slow
def test_a_daemon_drained_under_load_fails_no_call_and_truncates_no_stream(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    add_small_smollm2(repo)
    (repo / "minilm").symlink_to(MODELS / "minilm")
    # a drain long enough for every stream in flight (a busy 2-core machine)
    env = {"MODELD_SHUTDOWN_GRACE_S": "120", "MODELD_DRAIN_DELAY_S": "1"}
    with ThreadPoolExecutor(3) as pool:
        daemons = list(pool.map(lambda _: start_daemon("--no-preload", repository=repo, env=env), range(3)))
    gateway = start_gateway(*(d.address for d in daemons), args=("--http-port", "-1"))
    try:
        address = f"127.0.0.1:{gateway.port}"
        wait_until(lambda: metric_sum(gateway, "modeld_gateway_node_serving") == 3, 30, "every node serving")
        client = tc.InferenceServerClient(address)
        client.load_model(LLM)
        client.load_model("minilm")
        stub = gen_grpc.GenerationStub(grpc.insecure_channel(address))
        failures, unary_ok, stop = [], [0], threading.Event()

        def unary():
            c = tc.InferenceServerClient(address)
            while not stop.is_set():
                try:
                    c.infer("minilm", [_texts(["draining under load"])], client_timeout=30)
                    unary_ok[0] += 1
                except InferenceServerException as exc:
                    failures.append(f"unary: {exc}")
                time.sleep(0.05)

        def stream(i: int) -> tuple[str, int]:
            replies = list(stub.Generate(gen.GenerateRequest(
                model=LLM, prompt=f"Count slowly from {i}:",
                sampling=gen.SamplingParams(max_tokens=STREAM_TOKENS, temperature=0.0, ignore_eos=True)),
                timeout=180))
            final = replies[-1]
            return gen.FinishReason.Name(final.finish_reason), sum(len(r.token_ids) for r in replies)

        threads = [threading.Thread(target=unary) for _ in range(2)]
        for t in threads:
            t.start()
        wait_until(lambda: unary_ok[0] >= 5, 60, "unary traffic running")
        before = {d.address: metric_sum(d, "modeld_requests_total", model=LLM) for d in daemons}
        with ThreadPoolExecutor(NUM_STREAMS) as pool:
            streams = [pool.submit(stream, i) for i in range(NUM_STREAMS)]
            # the leaving node: one that has streams of this round in flight
            leaving = wait_until(lambda: next((d for d in daemons if metric_sum(
                d, "modeld_requests_total", model=LLM) > before[d.address]), None), 60, "a stream started")
            leaving.proc.send_signal(15)  # SIGTERM: the drain
            drained_at = time.monotonic()
            results = [s.result() for s in streams]
        # its streams finished, then it left, cleanly
        assert leaving.proc.wait(150) == 0
        wait_until(lambda: metric_sum(gateway, "modeld_gateway_node_serving", node=leaving.address) == 0, 10,
                   "the gateway marking the node not serving")
        left_s = time.monotonic() - drained_at
        # more calls after the drain: none reaches the leaving node (it is gone), none fails
        mark = unary_ok[0]
        wait_until(lambda: unary_ok[0] >= mark + 10, 60, "unary calls after the drain")
        stop.set()
        for t in threads:
            t.join()
        assert failures == [], failures[:3]
        assert all(reason == "FINISH_REASON_LENGTH" and n == STREAM_TOKENS for reason, n in results), results
        assert left_s < 150
    finally:
        for process in [gateway, *daemons]:
            if process.proc.poll() is None:
                process.stop()


def _x() -> tc.InferInput:
    x = tc.InferInput("x", [1, 4], "FP32")
    x.set_data_from_numpy(np.array([[1.0, 2.0, 3.0, 4.0]], dtype=np.float32))
    return x


@pytest.mark.slow
def test_a_daemon_that_joins_under_load_takes_its_ring_share_and_fails_no_call(tmp_path):
    """Scale-out: a fourth daemon added to the gateway's nodes file while
    calls run joins the ring and serves the models whose homes moved to
    it; no call fails meanwhile. (Other models' calls may reach it too:
    a home over the load bound spills to the next node with room.)"""
    import onnx_fixtures
    from modeld.server.gateway.ring import HashRing

    repo = tmp_path / "repo"
    repo.mkdir()
    with ThreadPoolExecutor(4) as pool:
        daemons = list(pool.map(lambda _: start_daemon("--no-preload", repository=repo), range(4)))
    old, joining = daemons[:3], daemons[3]
    # models named so that the joining node becomes a home of some of them
    # (the repository is read on each listing: models added now are listed)
    after = HashRing(150)
    for d in daemons:
        after.add(d.address)
    names = [f"add-{i}" for i in range(200)]
    moved = [n for n in names if joining.address in after.replicas(n, 2)][:3]
    models = moved + [n for n in names if n not in moved][:3]
    for name in models:
        (repo / name).mkdir()
        (repo / name / "model.onnx").write_bytes(onnx_fixtures.add_fp32())
        (repo / name / "model.toml").write_text('format = "onnx"\nbackends = ["onnx"]\n')
    nodes_file = tmp_path / "nodes"
    nodes_file.write_text("".join(f"{d.address}\n" for d in old))
    config = tmp_path / "gateway.toml"
    config.write_text("[gateway]\ndns_interval_s = 0.5\n")
    gateway = start_gateway(args=("--nodes-file", str(nodes_file), "--config", str(config), "--http-port", "-1"))
    try:
        address = f"127.0.0.1:{gateway.port}"
        wait_until(lambda: metric_sum(gateway, "modeld_gateway_node_serving") == 3, 60, "three nodes serving")
        failures, ok, stop = [], [0], threading.Event()

        def calls(offset: int):
            client = tc.InferenceServerClient(address)
            i = offset
            while not stop.is_set():
                try:
                    result = client.infer(models[i % len(models)], [_x()], client_timeout=60)
                    if result.as_numpy("y").tolist() != [[2.0, 3.0, 4.0, 5.0]]:
                        failures.append(f"wrong answer {result.as_numpy('y')}")
                    ok[0] += 1
                except InferenceServerException as exc:
                    failures.append(str(exc))
                i += 1
                time.sleep(0.02)

        threads = [threading.Thread(target=calls, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        wait_until(lambda: ok[0] >= 3 * len(models), 120, "calls on every model")
        assert all(metric_sum(joining, "modeld_requests_total", model=m) == 0 for m in models)
        nodes_file.write_text("".join(f"{d.address}\n" for d in daemons))  # scale-out
        wait_until(lambda: metric_sum(gateway, "modeld_gateway_node_serving", node=joining.address) == 1, 60,
                   "the new node serving")
        wait_until(lambda: all(metric_sum(joining, "modeld_requests_total", model=m) >= 3 for m in moved), 120,
                   "calls for the models homed on the new node reaching it")
        mark = ok[0]
        wait_until(lambda: ok[0] >= mark + 20, 60, "calls after the join")
        stop.set()
        for t in threads:
            t.join()
        assert failures == [], failures[:3]
    finally:
        for process in [gateway, *daemons]:
            if process.proc.poll() is None:
                process.stop()
