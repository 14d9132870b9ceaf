"""`modeld gateway`'s HTTP surface in front of three real daemons on
loopback: the stock openai SDK, tritonclient.http and curl through it with
the answers a daemon gives directly; the fleet's merged model list; request
ids and tokens; bad input (400, 404 from the owning node, 413); a client
that leaves (the node's stream ends); a node killed mid-stream (an error
event, never a hang); every node down (503).

The destructive tests run last, in file order, on the module's fleet."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import numpy as np
import openai
import pytest
import tritonclient.http as th

from daemon import MODELS, add_small_smollm2, metric_sum, start_daemon, start_gateway
from modeld.gen import node_pb2, node_pb2_grpc
from polling import wait_until

TOKEN = "gateway-http-test-token-0123456789"
METERED = "gateway-http-metered-0123456789"   # tenant gamma: 4 generated tokens per minute
COUNTED = "gateway-http-counted-0123456789"   # tenant delta: 2 generated tokens per minute
MAX_BODY = 64 * 1024
CHAT = [{"role": "user", "content": "Name three colours."}]


def _gateway_args(daemons, *extra: str, mapped: bool = True) -> tuple[str, ...]:
    """--node-http names each daemon's HTTP address; without it the gateway
    takes the port each daemon advertises in its Stats."""
    args = ["--http-port", "0"]
    for d in daemons:
        args += ["--node-http", f"{d.address}=127.0.0.1:{d.http_port}"] if mapped else []
    return (*args, *extra)


def _serving(gateway) -> float:
    return metric_sum(gateway, "modeld_gateway_node_serving")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    (repo / "minilm").symlink_to(MODELS / "minilm")
    add_small_smollm2(repo)
    with ThreadPoolExecutor(3) as pool:
        daemons = list(pool.map(lambda _: start_daemon("--no-preload", repository=repo), range(3)))
    config = tmp_path_factory.mktemp("gateway") / "gateway.toml"
    config.write_text(f"[gateway]\nhttp_max_body_bytes = {MAX_BODY}\n")
    tokens = config.parent / "tokens"
    tokens.write_text(f"{TOKEN} infer\n{METERED} infer tenant=gamma tokens_per_minute=4\n"
                      f"{COUNTED} infer tenant=delta tokens_per_minute=2\n")
    gateway = start_gateway(*(d.address for d in daemons), args=_gateway_args(daemons, "--config", str(config)))
    locked = start_gateway(*(d.address for d in daemons),
                           args=_gateway_args(daemons, "--auth-token-file", str(tokens), mapped=False))
    try:
        wait_until(lambda: _serving(gateway) == 3 and _serving(locked) == 3, timeout=60, what="3 nodes serving")
    except BaseException:
        for process in (gateway, locked, *daemons):
            process.proc.kill()
        raise
    yield {"daemons": daemons, "gateway": gateway, "locked": locked, "url": f"http://127.0.0.1:{gateway.http_port}"}
    for process in (gateway, locked, *daemons):
        if process.proc.poll() is None:
            process.stop()


def _sdk(url: str, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120, **kwargs)


def _streamed_text(client: openai.OpenAI) -> str:
    stream = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=12, temperature=0,
                                            stream=True)
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def _stats(daemon) -> node_pb2.NodeStats:
    with grpc.insecure_channel(daemon.address) as channel:
        return node_pb2_grpc.NodeStub(channel).Stats(node_pb2.NodeStatsRequest(), timeout=60)


def _served(daemons, model: str):
    """A daemon that holds `model` ready (the direct call then loads nothing new)."""
    return next(d for d in daemons if d.proc.poll() is None
                and any(m.name == model and m.state == "READY" for m in _stats(d).models))


def _running(daemon) -> float:
    return metric_sum(daemon, "modeld_running_sequences", model="smollm2")


def test_openai_sdk_chat_stream_and_embeddings_equal_a_direct_call(fleet):
    gateway = _sdk(fleet["url"])
    through = _streamed_text(gateway)
    assert through and through == _streamed_text(_sdk(_served(fleet["daemons"], "smollm2").http_url))
    sentences = ["the gateway forwards bytes", "a second sentence"]
    got = gateway.embeddings.create(model="minilm", input=sentences)
    want = _sdk(_served(fleet["daemons"], "minilm").http_url).embeddings.create(model="minilm", input=sentences)
    assert len(got.data) == 2
    np.testing.assert_array_equal([d.embedding for d in got.data], [d.embedding for d in want.data])


def test_tritonclient_http_works_unchanged_through_the_gateway(fleet):
    gateway = th.InferenceServerClient(f"127.0.0.1:{fleet['gateway'].http_port}")
    direct = th.InferenceServerClient(f"127.0.0.1:{_served(fleet['daemons'], 'minilm').http_port}")
    assert gateway.is_server_live() and gateway.is_server_ready()

    def infer(client):
        text = th.InferInput("text", [2], "BYTES")
        text.set_data_from_numpy(np.array([b"one sentence", b"and another"], dtype=object))
        return client.infer("minilm", [text]).as_numpy("embedding")

    through = infer(gateway)
    assert through.shape == (2, 384)
    np.testing.assert_array_equal(through, infer(direct))
    assert gateway.is_model_ready("minilm")
    assert gateway.get_model_metadata("minilm") == direct.get_model_metadata("minilm")


def test_curl_completion_with_its_request_id(fleet):
    body = json.dumps({"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 6,
                       "temperature": 0})
    out = subprocess.run(["curl", "-sS", "-D", "-", "-H", "content-type: application/json",
                          "-H", "x-request-id: curl-through-gateway-1", "--data", body,
                          f"{fleet['url']}/v1/completions"], capture_output=True, text=True, timeout=120, check=True)
    head, _, payload = out.stdout.partition("\n\n")  # text mode reads curl's CRLF as \n
    assert head.startswith("HTTP/1.1 200")
    assert "x-request-id: curl-through-gateway-1" in head.lower()
    direct = httpx.post(f"{_served(fleet['daemons'], 'smollm2').http_url}/v1/completions", content=body,
                        headers={"content-type": "application/json"}, timeout=120).json()
    assert json.loads(payload)["choices"][0]["text"] == direct["choices"][0]["text"]


def test_model_list_merges_the_fleet(fleet):
    listing = httpx.get(f"{fleet['url']}/v1/models", timeout=30).json()
    ids = [row["id"] for row in listing["data"]]
    assert ids == sorted({"minilm", "smollm2"})
    assert {row["id"] for row in listing["data"] if row["ready"]} == {"minilm", "smollm2"}  # loaded somewhere by now
    head = httpx.head(f"{fleet['url']}/v2/models/minilm", timeout=30)
    assert head.status_code == 200 and head.content == b""


def test_tokens_are_checked_at_the_gateway(fleet):
    """(This gateway finds the daemons' HTTP ports in their Stats: no --node-http.)"""
    url = f"http://127.0.0.1:{fleet['locked'].http_port}"
    refused = httpx.post(f"{url}/v1/embeddings", json={"model": "minilm", "input": ["x"]}, timeout=30)
    assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Bearer")
    assert "message" in refused.json()["error"]
    got = _sdk(url).with_options(api_key=TOKEN).embeddings.create(model="minilm", input=["x"])
    assert len(got.data[0].embedding) == 384
    assert httpx.get(f"{url}/v2/health/ready", timeout=30).status_code == 200  # probes stay open


def _stream_events(url: str, token: str, **extra) -> list[dict]:
    body = {"model": "smollm2", "prompt": "Count: 1, 2, 3,", "max_tokens": 6, "ignore_eos": True,
            "temperature": 0, "stream": True, **extra}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120,
                      headers={"authorization": f"Bearer {token}"}) as reply:
        assert reply.status_code == 200, reply.read()
        lines = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _refused_for_tokens(url: str, token: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers={"authorization": f"Bearer {token}"}, timeout=60,
                      json={"model": "smollm2", "prompt": "Hi", "max_tokens": 2})


def test_a_tenant_s_streamed_tokens_are_charged_at_the_gateway(fleet):
    """A stream relayed through the HTTP front spends its tenant's
    tokens_per_minute as the gRPC side does: the next call is refused 429."""
    locked = fleet["locked"]
    url = f"http://127.0.0.1:{locked.http_port}"
    # with include_usage the stream's usage event gives the exact figure
    events = _stream_events(url, METERED, stream_options={"include_usage": True})
    generated = events[-1]["usage"]["completion_tokens"]
    assert generated == 6
    assert metric_sum(locked, "modeld_tenant_generated_tokens_total", tenant="gamma") == generated
    refused = _refused_for_tokens(url, METERED)
    assert refused.status_code == 429 and "tokens per minute" in refused.json()["error"]["message"]
    assert int(refused.headers["retry-after"]) >= 1
    # without it, each event with text counts one token (never more than were generated)
    events = _stream_events(url, COUNTED)
    counted = metric_sum(locked, "modeld_tenant_generated_tokens_total", tenant="delta")
    assert 2 <= counted <= 6 and counted == sum(1 for e in events if e["choices"] and e["choices"][0]["text"])
    assert _refused_for_tokens(url, COUNTED).status_code == 429
    # another tenant's calls go on
    assert _refused_for_tokens(url, TOKEN).status_code == 200


def test_bad_input_is_answered_in_the_routes_shape(fleet):
    url = fleet["url"]
    missing = httpx.post(f"{url}/v1/chat/completions", json={"messages": CHAT}, timeout=30)
    assert missing.status_code == 400
    assert missing.json()["error"]["param"] == "model" and "model is required" in missing.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/embeddings", content=b"{not json", timeout=30).status_code == 400
    with pytest.raises(openai.NotFoundError, match="unknown model 'no-such-model'"):  # the owning node's words
        _sdk(url, default_headers={"x-request-id": "gateway-http-404"}).embeddings.create(
            model="no-such-model", input=["x"])
    # the node logged its refusal under the client's id
    wait_until(lambda: any(e.get("request_id") == "gateway-http-404" for d in fleet["daemons"] for e in d.logs),
               what="the node's log line under the client's request id")
    kserve = httpx.post(f"{url}/v2/models/no-such-model/infer", json={"inputs": []}, timeout=30)
    assert kserve.status_code == 404 and "no-such-model" in kserve.json()["error"]


def test_an_oversized_body_is_refused_before_it_is_read_whole(fleet):
    big = json.dumps({"model": "minilm", "input": ["x" * (2 * MAX_BODY)]}).encode()
    declared = httpx.post(f"{fleet['url']}/v1/embeddings", content=big, timeout=30)
    assert declared.status_code == 413 and "http_max_body_bytes" in declared.json()["error"]["message"]

    def chunks():  # no Content-Length: refused as it streams in
        for i in range(0, len(big), 4096):
            yield big[i:i + 4096]

    streamed = httpx.post(f"{fleet['url']}/v2/models/minilm/infer", content=chunks(), timeout=30)
    assert streamed.status_code == 413 and "http_max_body_bytes" in streamed.json()["error"]


def test_a_node_that_refuses_the_connection_is_retried_elsewhere_before_the_client_sees_it(fleet):
    """A node whose HTTP port refuses connections (its mapping points at a
    closed port): each call placed there goes once more to the other node."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    bad = _served(fleet["daemons"], "minilm")  # the model is loaded there: placement prefers it
    good = next(d for d in fleet["daemons"] if d is not bad)
    gateway = start_gateway(bad.address, good.address, args=(
        "--http-port", "0", "--replicas", "2", "--node-http", f"{bad.address}=127.0.0.1:{closed}",
        "--node-http", f"{good.address}=127.0.0.1:{good.http_port}"))
    try:
        wait_until(lambda: _serving(gateway) == 2, what="2 nodes serving")
        url = f"http://127.0.0.1:{gateway.http_port}"
        for _ in range(20):
            answer = httpx.post(f"{url}/v1/embeddings", json={"model": "minilm", "input": ["x"]}, timeout=60)
            assert answer.status_code == 200, answer.text
        assert metric_sum(gateway, "modeld_gateway_retries_total", method="http:Embeddings") >= 1
    finally:
        gateway.stop()


def _long_stream(url: str):
    return httpx.stream("POST", f"{url}/v1/chat/completions", timeout=120, json={
        "model": "smollm2", "messages": CHAT, "max_tokens": 900, "ignore_eos": True, "stream": True})


def _streaming_node(daemons):
    return wait_until(lambda: next((d for d in daemons if d.proc.poll() is None and _running(d)), None),
                      timeout=30, what="a node streaming")


def test_a_client_that_leaves_ends_the_nodes_stream(fleet):
    with _long_stream(fleet["url"]) as response:
        assert response.status_code == 200
        next(response.iter_raw())
        node = _streaming_node(fleet["daemons"])
    # 900 tokens would take far longer than this bound
    wait_until(lambda: _running(node) == 0, timeout=20, what="the node's stream cancelled")


def test_a_node_killed_mid_stream_ends_the_stream_with_an_error_event(fleet):
    client = _sdk(fleet["url"])
    stream = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=900, stream=True,
                                            extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices
    node = _streaming_node(fleet["daemons"])
    os.kill(node.proc.pid, signal.SIGKILL)
    node.proc.wait(30)
    with pytest.raises(openai.APIError, match="the stream broke off"):
        for _ in stream:
            pass


def test_every_node_down_is_503_at_once(fleet):
    for daemon in fleet["daemons"]:
        if daemon.proc.poll() is None:
            daemon.proc.kill()
            daemon.proc.wait(30)
    url = fleet["url"]
    wait_until(lambda: httpx.get(f"{url}/v2/health/ready", timeout=10).status_code == 503, timeout=30,
               what="the gateway seeing every node down")
    answer = httpx.post(f"{url}/v1/embeddings", json={"model": "minilm", "input": ["x"]}, timeout=10)
    assert answer.status_code == 503
    assert "no healthy node" in answer.json()["error"]["message"]
    with pytest.raises(openai.InternalServerError):
        _sdk(url).chat.completions.create(model="smollm2", messages=CHAT, max_tokens=4, stream=True)
    assert httpx.post(f"{url}/v2/models/minilm/infer", json={"inputs": []}, timeout=10).status_code == 503
