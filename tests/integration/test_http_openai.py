"""The OpenAI API (/v1) on the daemon's HTTP port, through the real `openai`
SDK and raw HTTP, checked against the gRPC paths on the same daemon."""

from __future__ import annotations

import base64
import threading
import time
import urllib.request

import grpc
import httpx
import numpy as np
import openai
import pytest
import tritonclient.grpc as tc

from daemon import start_daemon
from polling import wait_until
from modeld.gen import generation_pb2 as g
from modeld.gen import generation_pb2_grpc as gg

CHAT = [{"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name three colours of the rainbow."}]
PROMPT = "The capital of France is"
SENTENCES = ["The cat sits on the mat.", "modeld serves many models from one process.", "Ünïcödé text works too ✓"]


@pytest.fixture(scope="module")
def client(daemon):
    assert daemon.http_port > 0, "the test daemon must log its bound http_port"
    with openai.OpenAI(base_url=f"http://127.0.0.1:{daemon.http_port}/v1", api_key="none", max_retries=0,
                       timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def raw(daemon):
    with httpx.Client(base_url=f"http://127.0.0.1:{daemon.http_port}", timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def stub(daemon):
    with grpc.insecure_channel(daemon.address) as channel:
        yield gg.GenerationStub(channel)


def _grpc(stub, max_tokens: int, messages=None, prompt=None, **sampling):
    """Text, logprob responses and final message of modeld.v1.Generation/Generate."""
    params = g.SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling)
    if messages is not None:
        request = g.GenerateRequest(model="smollm2", sampling=params, messages=g.ChatMessages(
            messages=[g.ChatMessage(role=m["role"], content=m["content"]) for m in messages]))
    else:
        request = g.GenerateRequest(model="smollm2", prompt=prompt, sampling=params)
    responses = list(stub.Generate(request, timeout=120))
    return "".join(r.text for r in responses), responses[:-1], responses[-1]


_FINISH = {g.FINISH_REASON_STOP: "stop", g.FINISH_REASON_LENGTH: "length"}


def _metric(daemon, name: str, default: float | None = None, **labels) -> float:
    """A sample's value; a missing one fails unless a default says it may not exist yet
    (a renamed gauge read as 0 would make "back to 0" checks pass by themselves)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics").read().decode()
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    assert default is not None, f"no sample {name} {labels} in /metrics"
    return default


def _running(daemon, default: float | None = None) -> float:
    return _metric(daemon, "modeld_running_sequences", default, backend="llamacpp", model="smollm2")


# -- generation through the SDK equals gRPC Generate ---------------------------------------


def test_chat_equals_grpc_generate(client, stub):
    expected, _, final = _grpc(stub, 24, messages=CHAT)
    answer = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=24, temperature=0)
    choice = answer.choices[0]
    assert choice.message.content == expected and expected
    assert choice.message.role == "assistant"
    assert choice.finish_reason == _FINISH[final.finish_reason]
    assert answer.usage.prompt_tokens == final.usage.prompt_tokens
    assert answer.usage.completion_tokens == final.usage.completion_tokens
    assert answer.usage.total_tokens == final.usage.prompt_tokens + final.usage.completion_tokens
    # the same prompt again: its prefix is cached, and usage says so
    again = client.chat.completions.create(model="smollm2", messages=CHAT, max_completion_tokens=24, temperature=0)
    assert again.choices[0].message.content == expected
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    # cache_prompt false (llama-server's field): the prompt computed afresh, the same answer
    fresh = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=24, temperature=0,
                                           extra_body={"cache_prompt": False})
    assert fresh.choices[0].message.content == expected
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-") and answer.model == "smollm2"


def test_chat_stream_equals_grpc_and_ends_with_usage(client, stub):
    expected, _, final = _grpc(stub, 24, messages=CHAT)
    chunks = list(client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    *body, last = chunks
    assert body[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in body) == expected
    assert [c.choices[0].finish_reason for c in body][-1] == _FINISH[final.finish_reason]
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    assert all(c.usage is None for c in body) and len({c.id for c in chunks}) == 1
    assert last.choices == [] and last.usage.completion_tokens == final.usage.completion_tokens
    assert last.usage.prompt_tokens == final.usage.prompt_tokens
    plain = list(client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=4, temperature=0,
                                                stream=True))
    assert plain[-1].choices[0].finish_reason == "length" and all(c.usage is None for c in plain)


def test_completion_equals_grpc_generate_streaming_or_not(client, stub):
    expected, _, final = _grpc(stub, 20, prompt=PROMPT)
    answer = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=20, temperature=0)
    assert answer.choices[0].text == expected and expected
    assert answer.choices[0].finish_reason == _FINISH[final.finish_reason]
    assert answer.usage.prompt_tokens == final.usage.prompt_tokens
    assert answer.usage.completion_tokens == final.usage.completion_tokens
    chunks = list(client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == final.usage.completion_tokens


def test_stop_strings_and_token_id_prompts_match_grpc(client, stub):
    expected, _, final = _grpc(stub, 32, prompt=PROMPT, stop=["States"])
    for stop in ("States", ["States", "never appears"]):
        answer = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=32, temperature=0, stop=stop)
        assert answer.choices[0].text == expected and "States" not in expected
        assert answer.choices[0].finish_reason == "stop" == _FINISH[final.finish_reason]
    ids = list(stub.Tokenize(g.TokenizeRequest(model="smollm2", text=PROMPT), timeout=30).token_ids)
    by_ids = client.completions.create(model="smollm2", prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == _grpc(stub, 8, prompt=PROMPT)[0]


def test_chat_logprobs_match_grpc(client, stub):
    _, responses, _ = _grpc(stub, 8, messages=CHAT, logprobs=3)
    grpc_logprobs = [lp.logprob for r in responses for lp in r.logprobs]
    answer = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=8, temperature=0,
                                            logprobs=True, top_logprobs=3)
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens == len(grpc_logprobs)
    assert [c.logprob for c in content] == pytest.approx(grpc_logprobs, abs=1e-4)
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy takes the best
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
    assert "".join(c.token for c in content) == answer.choices[0].message.content
    # logprobs without alternatives, streamed
    chunks = list(client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=8, temperature=0,
                                                 logprobs=True, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx(grpc_logprobs, abs=1e-4)
    assert all(e.top_logprobs == [] for e in streamed)


def test_completion_logprobs_match_grpc(client, stub):
    _, responses, _ = _grpc(stub, 6, prompt=PROMPT, logprobs=2)
    answer = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    lp = answer.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([x.logprob for r in responses for x in r.logprobs], abs=1e-4)
    assert "".join(lp.tokens) == answer.choices[0].text
    assert all(len(top) == 2 and max(top.values()) == pytest.approx(chosen, abs=1e-6)
               for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_seeded_sampling_repeats(client):
    runs = {client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=12, temperature=1.0,
                                      top_p=0.95, seed=1234).choices[0].text for _ in range(2)}
    assert len(runs) == 1


def test_request_id_header_is_used_and_echoed(raw):
    reply = raw.post("/v1/chat/completions", headers={"x-request-id": "oai-test-42"},
                     json={"model": "smollm2", "messages": CHAT, "max_tokens": 2})
    assert reply.status_code == 200 and reply.headers["x-request-id"] == "oai-test-42"
    assert reply.json()["id"] == "chatcmpl-oai-test-42"
    reply = raw.post("/v1/completions", json={"model": "nope", "prompt": "x"}, headers={"x-request-id": "oai-err-1"})
    assert reply.status_code == 404 and reply.headers["x-request-id"] == "oai-err-1"


# -- embeddings ----------------------------------------------------------------------------


def _grpc_embeddings(daemon, sentences) -> np.ndarray:
    triton = tc.InferenceServerClient(daemon.address)
    try:
        text = tc.InferInput("text", [len(sentences)], "BYTES")
        text.set_data_from_numpy(np.array([s.encode() for s in sentences], dtype=object))
        return triton.infer("minilm", [text]).as_numpy("embedding")
    finally:
        triton.close()


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_embeddings_float_and_base64_match_grpc(client, raw, daemon):
    expected = _grpc_embeddings(daemon, SENTENCES)
    answer = client.embeddings.create(model="minilm", input=SENTENCES, encoding_format="float")
    assert [d.index for d in answer.data] == [0, 1, 2] and answer.model == "minilm"
    floats = np.array([d.embedding for d in answer.data], dtype=np.float32)
    assert floats.shape == (3, 384) and _cosines(floats, expected).min() >= 0.999
    reply = raw.post("/v1/embeddings", json={"model": "minilm", "input": SENTENCES, "encoding_format": "base64"})
    assert reply.status_code == 200, reply.text
    decoded = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in reply.json()["data"]])
    assert decoded.shape == (3, 384) and _cosines(decoded, expected).min() >= 0.999
    np.testing.assert_array_equal(decoded, floats)
    one = client.embeddings.create(model="minilm", input=SENTENCES[0])  # the SDK's default asks for base64
    assert _cosines(np.array([one.data[0].embedding]), expected[:1])[0] >= 0.999


def test_embeddings_larger_than_a_batch_keep_their_order(raw, daemon):
    sentences = [f"sentence number {i} about {'cats' if i % 2 else 'rivers'}" for i in range(150)]  # > max_batch_size 64
    reply = raw.post("/v1/embeddings", json={"model": "minilm", "input": sentences})
    assert reply.status_code == 200, reply.text
    got = np.array([d["embedding"] for d in reply.json()["data"]], dtype=np.float32)
    picks = [0, 63, 64, 127, 149]
    assert _cosines(got[picks], _grpc_embeddings(daemon, [sentences[i] for i in picks])).min() >= 0.999


# -- models --------------------------------------------------------------------------------


def test_models_list_with_readiness(client, raw):
    ids = {m.id for m in client.models.list()}
    assert {"minilm", "smollm2", "softcap_demo"} <= ids
    listed = raw.get("/v1/models").json()
    assert listed["object"] == "list"
    minilm = next(m for m in listed["data"] if m["id"] == "minilm")
    assert minilm["object"] == "model" and minilm["owned_by"] == "modeld" and isinstance(minilm["created"], int)
    assert minilm["ready"] is True and minilm["state"] == "READY"
    assert client.models.retrieve("minilm").id == "minilm"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no_such_model")


# -- errors: OpenAI's shape, the right status, the field named -------------------------------


def _error(reply: httpx.Response, status: int) -> dict:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_malformed_bodies_are_400(raw):
    for content in (b"{not json", b"\xff\xfe", b""):
        assert "not valid JSON" in _error(raw.post("/v1/chat/completions", content=content), 400)["message"]
    for body in ([1, 2], "text", 3):
        assert "JSON object" in _error(raw.post("/v1/completions", json=body), 400)["message"]


def test_unknown_model_is_404_on_every_endpoint(raw, client):
    for path, body in (("/v1/chat/completions", {"messages": CHAT}), ("/v1/completions", {"prompt": "x"}),
                       ("/v1/embeddings", {"input": "x"})):
        error = _error(raw.post(path, json={"model": "no_such_model", **body}), 404)
        assert "no_such_model" in error["message"] and error["code"] == "not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no_such_model", messages=CHAT)


WRONG = {
    "max_tokens as a string": ("/v1/completions", {"max_tokens": "ten"}, "max_tokens"),
    "max_tokens as a boolean": ("/v1/completions", {"max_tokens": True}, "max_tokens"),
    "temperature as a string": ("/v1/chat/completions", {"temperature": "hot"}, "temperature"),
    "stream as a string": ("/v1/chat/completions", {"stream": "yes"}, "stream"),
    "stop as a number": ("/v1/completions", {"stop": 5}, "stop"),
    "messages as a string": ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    "message without role": ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages[0].role"),
    "tool message without a call id": ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]},
                                       "messages[0].tool_call_id"),
    "image content": ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages[0].content[0]"),
    "model as a number": ("/v1/completions", {"model": 7}, "model"),
    "prompt missing": ("/v1/completions", {"prompt": None}, "prompt"),
    "two prompts": ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    "n over the limit": ("/v1/chat/completions", {"n": 17}, "n"),
    "response_format of an unknown type": ("/v1/chat/completions", {"response_format": {"type": "xml"}},
                                           "response_format"),
    "unsupported field": ("/v1/chat/completions", {"functions": []}, "functions"),
    "unsupported field on completions": ("/v1/completions", {"top_logprobs": 2}, "top_logprobs"),
    "penalty out of range": ("/v1/completions", {"frequency_penalty": 5}, "frequency_penalty"),
    "echo with logprobs": ("/v1/completions", {"echo": True, "logprobs": 1}, "echo"),
    "top_logprobs without logprobs": ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    "top_logprobs too many": ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    "completion logprobs too many": ("/v1/completions", {"logprobs": 50}, "logprobs"),
    "temperature out of range": ("/v1/completions", {"temperature": -1}, "temperature"),
    "max_tokens zero": ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    "max_completion_tokens zero": ("/v1/chat/completions", {"max_tokens": None, "max_completion_tokens": 0},
                                   "max_completion_tokens"),
    "max_tokens disagreeing": ("/v1/chat/completions", {"max_completion_tokens": 3}, "max_completion_tokens"),
    "stream_options without stream": ("/v1/chat/completions", {"stream_options": {"include_usage": True}},
                                      "stream_options"),
    "unknown stream option": ("/v1/chat/completions", {"stream": True, "stream_options": {"x": 1}},
                              "stream_options.x"),
    "include_usage as a string": ("/v1/completions", {"stream": True, "stream_options": {"include_usage": "yes"}},
                                  "stream_options.include_usage"),
    "negative priority": ("/v1/completions", {"priority": -1}, "priority"),
    "embedding of a token array": ("/v1/embeddings", {"input": [[1, 2, 3]]}, "input"),
    "embedding of nothing": ("/v1/embeddings", {"input": []}, "input"),
    "embedding format": ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, "encoding_format"),
    "embedding dimensions": ("/v1/embeddings", {"input": "x", "dimensions": 128}, "dimensions"),
}
_BASE = {"/v1/completions": {"model": "smollm2", "prompt": "Hi", "max_tokens": 2},
         "/v1/chat/completions": {"model": "smollm2", "messages": CHAT, "max_tokens": 2},
         "/v1/embeddings": {"model": "minilm"}}


@pytest.mark.parametrize("case", WRONG)
def test_wrong_fields_are_400_naming_the_field(raw, case):
    path, fields, param = WRONG[case]
    body = {**_BASE[path], **fields}
    body = {k: v for k, v in body.items() if v is not None}
    error = _error(raw.post(path, json=body), 400)
    assert error["param"] == param, error
    assert param.split("[")[0].split(".")[0] in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_refusals_the_sdk_reports(client):
    with pytest.raises(openai.BadRequestError, match="n must be in"):
        client.chat.completions.create(model="smollm2", messages=CHAT, n=17)
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(model="smollm2", messages=CHAT, response_format={"type": "xml"})
    with pytest.raises(openai.BadRequestError, match="not an embedding model"):
        client.embeddings.create(model="smollm2", input="x")
    with pytest.raises(openai.BadRequestError, match="not a text embedding model"):
        client.embeddings.create(model="softcap_demo", input="x")
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model="minilm", prompt="x")
    assert err.value.status_code == 501


def test_accepted_extensions_and_neutral_fields(raw):
    body = {"model": "smollm2", "max_tokens": 3, "temperature": 0, "user": "someone",
            "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "response_format": {"type": "text"},
            "priority": 1, "top_k": 5, "min_p": 0.0, "n": 1, "stop": None,
            "messages": [{"role": "developer", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi."}]}]}
    reply = raw.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] <= 3


def test_a_stream_that_cannot_start_answers_with_its_status(raw):
    body = {"model": "smollm2", "prompt": "word " * 3000, "max_tokens": 2000, "stream": True}
    reply = raw.post("/v1/completions", json=body)
    error = _error(reply, 400)
    assert "context window" in error["message"]
    assert not reply.headers["content-type"].startswith("text/event-stream")


def test_failures_are_counted_by_model_and_protocol(raw, daemon):
    labels = dict(model="smollm2", status="INVALID_ARGUMENT", protocol="http")
    before = _metric(daemon, "modeld_request_failures_total", default=0.0, **labels)  # none failed yet
    _error(raw.post("/v1/chat/completions", json={**_BASE["/v1/chat/completions"], "n": 17}), 400)
    assert _metric(daemon, "modeld_request_failures_total", **labels) == before + 1


@pytest.fixture(scope="module")
def small_daemon():
    proc = start_daemon("--no-preload", env={"MODELD_MAX_MESSAGE_BYTES": "64KiB"})
    yield proc
    proc.stop()


def test_oversize_body_is_413_in_openai_shape(small_daemon):
    with httpx.Client(base_url=f"http://127.0.0.1:{small_daemon.http_port}", timeout=60) as c:
        body = {"model": "smollm2", "messages": [{"role": "user", "content": "x" * 100_000}]}
        error = _error(c.post("/v1/chat/completions", json=body), 413)
        assert "max_message_bytes" in error["message"]
        error = _error(c.post("/v1/embeddings", json={"model": "minilm", "input": ["y" * 1000] * 100}), 413)
        assert "max_message_bytes" in error["message"]


# -- a client that leaves frees its sequence -------------------------------------------------


def _wait_until_free(daemon, seconds: float = 60) -> bool:
    wait_until(lambda: _running(daemon) == 0, seconds, "no sequence running")
    return True


def test_closing_a_stream_frees_the_sequence(daemon):
    body = {"model": "smollm2", "prompt": "Count to one thousand:", "max_tokens": 2000, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=120) as c:
        with c.stream("POST", f"http://127.0.0.1:{daemon.http_port}/v1/completions", json=body) as reply:
            assert reply.status_code == 200
            chunks = 0
            # held: an iterator left to the garbage collector closes the
            # response, and the client would leave before the check below
            lines = reply.iter_lines()
            for line in lines:
                chunks += line.startswith("data: ")
                if chunks == 3:
                    break
            assert _running(daemon) == 1
    closed = _metric(daemon, "modeld_generated_tokens_total", backend="llamacpp", model="smollm2")
    assert _wait_until_free(daemon), "the sequence kept running after its client left"
    # without the close reaching the engine it would run on to 2000 tokens
    assert _metric(daemon, "modeld_generated_tokens_total", backend="llamacpp", model="smollm2") - closed < 50


def test_a_client_that_leaves_a_plain_request_frees_the_sequence(daemon):
    body = {"model": "smollm2", "prompt": "Count to one thousand:", "max_tokens": 2000, "ignore_eos": True}
    url = f"http://127.0.0.1:{daemon.http_port}/v1/completions"
    started = _metric(daemon, "modeld_generated_tokens_total", 0.0, backend="llamacpp", model="smollm2")

    outcome = []

    def leave_early():  # gives up waiting for the answer after 2 s
        try:
            outcome.append(httpx.post(url, json=body, timeout=httpx.Timeout(60, read=2)).status_code)
        except httpx.ReadTimeout:
            outcome.append("left")

    thread = threading.Thread(target=leave_early)
    thread.start()
    deadline = time.monotonic() + 30
    while _running(daemon, default=0.0) != 1 and time.monotonic() < deadline:  # no step yet: no gauge
        time.sleep(0.05)
    thread.join()
    assert outcome == ["left"]
    assert _wait_until_free(daemon), "a non-streaming generation ran on after its client left"
    # left after 2 s: a generation that ran on would reach all of max_tokens
    # (how far it got first depends on the machine's speed, not on the rule)
    assert _metric(daemon, "modeld_generated_tokens_total", backend="llamacpp", model="smollm2") - started < \
        body["max_tokens"]
