"""The openai backend against a real OpenAI-compatible server: llama-cpp-python's
own (`python -m llama_cpp.server`) on the smollm2 GGUF, through a real
daemon on loopback. The model's folder also holds the GGUF, so the daemon
can fall back to its local llamacpp backend when the server dies.

The server starts once for the module (a few seconds); the test that kills
and restarts it runs last.
"""

from __future__ import annotations

import queue
import re
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from daemon import start_daemon
from modeld.gen import generation_pb2 as g
from modeld.gen import generation_pb2_grpc as gg
from polling import wait_until
from remote_fakes import LlamaCppPythonServer

ROOT = Path(__file__).resolve().parents[2]
GGUF = (ROOT / "models/smollm2/model.gguf").resolve()
MODEL = "remote-smol"
PROMPT = "The capital of France is"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# what modeld sends for greedy decoding, so the direct call asks the same:
# llama-cpp-python's own defaults (top_k 40, min_p 0.05, repeat_penalty 1.1) would change the answer
NEUTRAL = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not GGUF.is_file():
        pytest.skip("models/smollm2/model.gguf is missing: run `make models`")
    llama = LlamaCppPythonServer(GGUF, tmp_path_factory.mktemp("llama") / "server.log").start()
    yield llama
    llama.kill()


@pytest.fixture(scope="module")
def remote_daemon(server, tmp_path_factory):
    repository = tmp_path_factory.mktemp("repo")
    folder = repository / MODEL
    folder.mkdir()
    (folder / "model.gguf").symlink_to(GGUF)
    (folder / "model.toml").write_text(f"""
format = "remote"
backends = ["openai", "llamacpp"]   # the server first, the local file if it fails
artifact = "model.gguf"

[remote]
engine = "openai"
url = "{server.url}"
model = "{server.model_id}"
timeout_s = 120
probe_interval_s = 0.2
max_probe_interval_s = 1.0

[llamacpp]
n_ctx = 2048
n_slots = 2
context_length = 1024
n_threads = 1   # the server beside it has the other core
""")
    daemon = start_daemon(repository=repository)
    yield daemon
    daemon.stop()


@pytest.fixture(scope="module")
def stub(remote_daemon):
    with grpc.insecure_channel(remote_daemon.address) as channel:
        yield gg.GenerationStub(channel)


def _generate(stub, prompt: str = PROMPT, **sampling):
    request = g.GenerateRequest(model=MODEL, prompt=prompt, sampling=g.SamplingParams(**{"max_tokens": 16, **sampling}))
    responses = list(stub.Generate(request, timeout=120))
    return "".join(r.text for r in responses), responses


def _direct(server, prompt: str = PROMPT, **fields) -> dict:
    return server.post("/v1/completions", {"prompt": prompt, "max_tokens": 16, **NEUTRAL, **fields})


def _metric(daemon, pattern: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics").read().decode()
    match = re.search(pattern + r" ([0-9.e+]+)", text)
    return float(match.group(1)) if match else 0.0


def test_the_model_loads_on_the_remote_with_no_local_bytes(remote_daemon):
    loaded = [e for e in remote_daemon.events("model_loaded") if e.get("model") == MODEL]
    assert loaded and loaded[-1]["backend"] == "openai" and loaded[-1]["nbytes"] == 0
    inspected = remote_daemon.events("remote_model_inspected")[-1]
    assert inspected["tokenize"] == "yes: /extras/tokenize"
    assert inspected["usage"].startswith("counted by modeld")  # llama-cpp-python streams no usage


def test_greedy_text_equals_a_direct_call_to_the_same_server(stub, server):
    for prompt in (PROMPT, "def fibonacci(n):"):
        text, _ = _generate(stub, prompt)
        assert text == _direct(server, prompt)["choices"][0]["text"]


def test_chat_messages_use_the_servers_chat_template(stub, server):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    request = g.GenerateRequest(model=MODEL, messages=g.ChatMessages(messages=[g.ChatMessage(**m) for m in messages]),
                                sampling=g.SamplingParams(max_tokens=12))
    text = "".join(r.text for r in stub.Generate(request, timeout=120))
    direct = server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 12, **NEUTRAL})
    assert text == direct["choices"][0]["message"]["content"]


def test_streams_and_usage_match_the_servers_own_count(stub, server):
    text, responses = _generate(stub, max_tokens=12)
    assert len(responses) >= 3  # streamed, not one answer
    final = responses[-1]
    direct = _direct(server, max_tokens=12)
    assert final.finish_reason == g.FINISH_REASON_LENGTH
    assert final.usage.prompt_tokens == direct["usage"]["prompt_tokens"]
    assert final.usage.completion_tokens == direct["usage"]["completion_tokens"] == 12
    assert final.usage.time_to_first_token_s > 0


def test_stop_sequences(stub, server):
    text, _ = _generate(stub)
    cut = text.index(" ", 2)  # the second word, wherever it starts
    stop = text[cut:cut + 4]
    stopped, responses = _generate(stub, stop=[stop])
    assert stopped == text[:text.index(stop)]
    assert responses[-1].finish_reason == g.FINISH_REASON_STOP
    assert stopped == _direct(server, stop=[stop])["choices"][0]["text"]


def test_kserve_text_input_is_served_the_same(remote_daemon, stub):
    client = tc.InferenceServerClient(remote_daemon.address)
    prompt = tc.InferInput("text_input", [1], "BYTES")
    prompt.set_data_from_numpy(np.array([PROMPT.encode()], dtype=object))
    result = client.infer(MODEL, [prompt], parameters={"max_tokens": 16})
    assert result.as_numpy("text_output")[0].decode() == _generate(stub)[0]
    assert result.get_response().parameters["finish_reason"].string_param in ("length", "stop")


def test_what_the_server_cannot_do_fails_closed(stub):
    for sampling, code, fragment in (
        ({"logprobs": 2}, grpc.StatusCode.UNIMPLEMENTED, "lacks logprobs"),
        ({"speculative": g.SPECULATIVE_NGRAM}, grpc.StatusCode.UNIMPLEMENTED, "lacks speculative_decoding"),
        ({"ignore_eos": True}, grpc.StatusCode.UNIMPLEMENTED, "does not take ignore_eos"),
        ({"top_p": 0.0}, grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    ):
        with pytest.raises(grpc.RpcError) as err:
            _generate(stub, **sampling)
        assert err.value.code() == code and fragment in err.value.details(), err.value.details()
    # llama-cpp-python's schema types prompt as text
    request = g.GenerateRequest(model=MODEL, token_ids=g.TokenIds(ids=[504, 3575]))
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request, timeout=60))
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED and "prompt of token ids" in err.value.details()


def test_tokenize_and_detokenize_use_the_servers_endpoints(stub, server):
    ids = list(stub.Tokenize(g.TokenizeRequest(model=MODEL, text=PROMPT), timeout=30).token_ids)
    assert ids == server.post("/extras/tokenize", {"input": PROMPT})["tokens"]
    text = stub.Detokenize(g.DetokenizeRequest(model=MODEL, token_ids=ids), timeout=30).text
    assert text == server.post("/extras/detokenize", {"tokens": ids})["text"] == PROMPT


def test_cancellation_reaches_the_server(stub, server):
    before = server.log().count("Disconnected from client")
    request = g.GenerateRequest(model=MODEL, prompt="Count from one to one thousand: one, two,",
                                sampling=g.SamplingParams(max_tokens=1000))
    call = stub.Generate(request, timeout=120)
    for _, _ in zip(range(3), call):
        pass
    call.cancel()
    wait_until(lambda: server.log().count("Disconnected from client") != before,
               what="the server to see the client leave")
    assert server.log().count("Disconnected from client") == before + 1
    started = time.monotonic()
    _generate(stub, max_tokens=4)  # the server is free again, not still generating 1000 tokens
    assert time.monotonic() - started < 10


def _watch(remote_daemon, statuses: queue.Queue, stop: threading.Event) -> None:
    with grpc.insecure_channel(remote_daemon.address) as channel:
        stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=MODEL))
        threading.Thread(target=lambda: (stop.wait(), stream.cancel()), daemon=True).start()
        try:
            for reply in stream:
                statuses.put(reply.status)
        except grpc.RpcError:
            pass


def _wait_for(statuses: queue.Queue, wanted: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if statuses.get(timeout=max(deadline - time.monotonic(), 0.01)) == wanted:
                return
        except queue.Empty:
            break
    raise AssertionError(f"health Watch never reported {health_pb2.HealthCheckResponse.ServingStatus.Name(wanted)}")


def test_fallback_to_local_llamacpp_when_the_server_dies_and_recovery_when_it_returns(remote_daemon, stub, server):
    statuses: queue.Queue = queue.Queue()
    stop = threading.Event()
    threading.Thread(target=_watch, args=(remote_daemon, statuses, stop), daemon=True).start()
    try:
        _wait_for(statuses, SERVING, 60)
        expected, _ = _generate(stub)

        server.kill()
        text, responses = _generate(stub)  # at once: served by the local file
        assert responses[-1].finish_reason in (g.FINISH_REASON_LENGTH, g.FINISH_REASON_STOP) and text
        _wait_for(statuses, NOT_SERVING, 60)  # health follows the remote
        fallbacks = rf'modeld_backend_fallbacks_total\{{from_backend="openai",model="{MODEL}",stage="run"\}}'
        assert _metric(remote_daemon, fallbacks) >= 1
        local = rf'modeld_requests_total\{{backend="llamacpp",model="{MODEL}",protocol="grpc"\}}'
        assert _metric(remote_daemon, local) >= 1
        assert _metric(remote_daemon, rf'modeld_remote_healthy\{{backend="openai",model="{MODEL}"\}}') == 0

        requests_before = server.log().count("POST /v1/completions")
        server.start()
        _wait_for(statuses, SERVING, 60)  # the probe brings it back
        assert _generate(stub)[0] == expected
        assert server.log().count("POST /v1/completions") > requests_before  # the remote answered again
        remote = rf'modeld_requests_total\{{backend="openai",model="{MODEL}",protocol="grpc"\}}'
        assert _metric(remote_daemon, remote) >= 2
    finally:
        stop.set()
