"""Conformance rows for the `vllm` remote backend against a real vLLM: what
modeld streams equals what the same server answers when called directly."""

from __future__ import annotations

import queue
import threading
import time

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc

from modeld.clients.client import Client
from modeld.gen import generation_pb2 as g
from remote_setup import REMOTE_MODEL, direct_completion, direct_stream, generate, remote_config
from vllm_server import SERVED_NAME

pytestmark = pytest.mark.remote

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
FINISH = {"length": g.FINISH_REASON_LENGTH, "stop": g.FINISH_REASON_STOP}


# -- greedy text, streams and usage ------------------------------------------------------

@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_text_equals_a_direct_call(stub, direct, prompt):
    expected = direct_completion(direct, prompt)
    _, text, responses = generate(stub, prompt)
    final = responses[-1]
    assert text == expected["choices"][0]["text"]
    assert final.finish_reason == FINISH[expected["choices"][0]["finish_reason"]]
    assert final.usage.prompt_tokens == expected["usage"]["prompt_tokens"]
    assert final.usage.completion_tokens == expected["usage"]["completion_tokens"]
    assert not final.error


def test_token_id_prompts_equal_a_direct_call(stub, direct):
    ids = direct.post("/tokenize", json={"model": SERVED_NAME, "prompt": PROMPTS[0]}).json()["tokens"]
    expected = direct_completion(direct, ids)
    _, text, responses = generate(stub, token_ids=ids)
    assert text == expected["choices"][0]["text"]
    assert responses[-1].usage.prompt_tokens == len(ids)


def test_stream_carries_the_server_tokens_and_usage(stub, direct):
    chunks = direct_stream(direct, PROMPTS[2], max_tokens=48, return_token_ids=True)
    expected_ids = [t for c in chunks for choice in c.get("choices", []) for t in choice.get("token_ids") or []]
    expected_text = "".join(choice["text"] for c in chunks for choice in c.get("choices", []))
    usage = next(c["usage"] for c in reversed(chunks) if c.get("usage"))

    arrivals = []
    params = g.SamplingParams(max_tokens=48, temperature=0.0)
    responses = []
    started = time.perf_counter()
    for response in stub.Generate(g.GenerateRequest(model=REMOTE_MODEL, prompt=PROMPTS[2], sampling=params), timeout=120):
        arrivals.append(time.perf_counter() - started)
        responses.append(response)
    ids = [t for r in responses for t in r.token_ids]
    final = responses[-1]
    assert "".join(r.text for r in responses) == expected_text
    # ids are the engine's own, not re-tokenized text (which may merge or split differently)
    assert len(expected_ids) == 48, "vLLM streamed no token ids (return_token_ids)"
    assert ids == expected_ids
    assert len(ids) == final.usage.completion_tokens == usage["completion_tokens"] == 48
    assert final.usage.prompt_tokens == usage["prompt_tokens"]
    assert final.finish_reason == g.FINISH_REASON_LENGTH
    assert final.usage.time_to_first_token_s > 0
    # a stream, not one answer cut in pieces at the end: tokens arrive while the engine decodes
    assert len(responses) >= 10
    assert arrivals[0] < 0.6 * arrivals[-1], arrivals


def test_ignore_eos_runs_to_max_tokens(stub, direct):
    expected = direct_completion(direct, "Hi.", max_tokens=96, ignore_eos=True)
    _, text, responses = generate(stub, "Hi.", max_tokens=96, ignore_eos=True)
    assert responses[-1].usage.completion_tokens == 96
    assert text == expected["choices"][0]["text"]


def test_chat_messages_equal_a_direct_chat_call(stub, direct):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = direct.post("/v1/chat/completions", json={"model": SERVED_NAME, "messages": messages,
                                                          "max_tokens": 24, "temperature": 0.0}).json()
    request = g.GenerateRequest(model=REMOTE_MODEL, messages=g.ChatMessages(messages=[g.ChatMessage(**m) for m in messages]),
                                sampling=g.SamplingParams(max_tokens=24, temperature=0.0))
    responses = list(stub.Generate(request, timeout=120))
    assert "".join(r.text for r in responses) == expected["choices"][0]["message"]["content"]
    assert responses[-1].usage.prompt_tokens == expected["usage"]["prompt_tokens"]


def test_seeded_sampling_repeats(stub):
    first = generate(stub, PROMPTS[1], temperature=0.8, top_p=0.9, seed=7)[1]
    again = generate(stub, PROMPTS[1], temperature=0.8, top_p=0.9, seed=7)[1]
    assert first == again


# -- stop sequences ----------------------------------------------------------------------

@pytest.mark.parametrize("stop", [["\n"], [" answer", "."]])
def test_stop_sequences_match_the_server(stub, direct, stop):
    prompt = PROMPTS[0]  # greedy: " Paris.\n\nThe answer is: ..."
    expected = direct_completion(direct, prompt, max_tokens=64, stop=stop)
    assert expected["choices"][0]["finish_reason"] == "stop", "the prompt must hit a stop sequence"
    _, text, responses = generate(stub, prompt, max_tokens=64, stop=stop)
    assert text == expected["choices"][0]["text"]
    assert not any(s in text for s in stop)
    assert responses[-1].finish_reason == g.FINISH_REASON_STOP
    assert responses[-1].usage.completion_tokens == expected["usage"]["completion_tokens"]


def test_stop_token_ids_end_the_stream(stub, direct):
    # the token after the first greedy one, as a stop token
    ids = direct_completion(direct, PROMPTS[0], max_tokens=4, return_token_ids=True)["choices"][0].get("token_ids")
    if not ids:
        pytest.skip("this vLLM does not return token ids")
    got, _, responses = generate(stub, PROMPTS[0], max_tokens=32, stop_token_ids=[ids[1]])
    assert responses[-1].finish_reason == g.FINISH_REASON_STOP
    assert got[:1] == ids[:1] and len(got) <= 2


# -- cancellation --------------------------------------------------------------------------

def _wait_for(predicate, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def test_cancelling_the_call_aborts_it_on_the_server(stub, vllm):
    assert _wait_for(lambda: vllm.metric("vllm:num_requests_running") == 0, 30)
    params = g.SamplingParams(max_tokens=1500, ignore_eos=True)
    call = stub.Generate(g.GenerateRequest(model=REMOTE_MODEL, prompt=PROMPTS[3], sampling=params), timeout=300)
    received = [next(call), next(call)]
    assert any(r.token_ids for r in received)
    assert vllm.metric("vllm:num_requests_running") >= 1
    call.cancel()
    # 1,500 tokens take over a minute here; the gauge drops within a step or two of the abort
    assert _wait_for(lambda: vllm.metric("vllm:num_requests_running") == 0, 10), "vLLM still runs the request"


def test_a_deadline_aborts_it_on_the_server(stub, vllm):
    assert _wait_for(lambda: vllm.metric("vllm:num_requests_running") == 0, 30)
    params = g.SamplingParams(max_tokens=1500, ignore_eos=True)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(g.GenerateRequest(model=REMOTE_MODEL, prompt=PROMPTS[3], sampling=params), timeout=3))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert _wait_for(lambda: vllm.metric("vllm:num_requests_running") == 0, 10), "vLLM still runs the request"


# -- tokenizer ----------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["The capital of France is", "naïve café ☕ — 42", "<|im_start|>user\nhi<|im_end|>"])
def test_tokenize_and_detokenize_match_the_server(stub, direct, text):
    expected = direct.post("/tokenize", json={"model": SERVED_NAME, "prompt": text}).json()["tokens"]
    ids = list(stub.Tokenize(g.TokenizeRequest(model=REMOTE_MODEL, text=text), timeout=30).token_ids)
    assert ids == expected
    expected_text = direct.post("/detokenize", json={"model": SERVED_NAME, "tokens": ids}).json()["prompt"]
    back = stub.Detokenize(g.DetokenizeRequest(model=REMOTE_MODEL, token_ids=ids), timeout=30).text
    assert back == expected_text


# -- KServe text_input / text_output ---------------------------------------------------------

def test_kserve_text_input_equals_a_direct_call(daemon, direct):
    expected = direct_completion(direct, PROMPTS[0], max_tokens=12)
    client = tc.InferenceServerClient(daemon.address)
    prompt = tc.InferInput("text_input", [1], "BYTES")
    prompt.set_data_from_numpy(np.array([PROMPTS[0].encode()], dtype=object))
    whole = client.infer(REMOTE_MODEL, [prompt], parameters={"max_tokens": 12})
    assert whole.as_numpy("text_output")[0].decode() == expected["choices"][0]["text"]
    assert whole.get_response().parameters["completion_tokens"].int64_param == 12

    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        client.async_stream_infer(REMOTE_MODEL, [prompt], parameters={"max_tokens": 12})
        chunks = []
        while True:
            result, error = answers.get(timeout=60)
            assert error is None, error
            response = result.get_response()
            if response.outputs:
                chunks.append(result.as_numpy("text_output")[0].decode())
            if response.parameters["triton_final_response"].bool_param:
                break
    finally:
        client.stop_stream()
        client.close()
    assert "".join(chunks) == expected["choices"][0]["text"] and len(chunks) >= 2


# -- concurrency and inline load ------------------------------------------------------------

def test_concurrent_streams_each_equal_a_direct_call(stub, direct):
    expected = {p: direct_completion(direct, p, max_tokens=24)["choices"][0]["text"] for p in PROMPTS}
    got: dict[str, str] = {}

    def run(prompt):
        got[prompt] = generate(stub, prompt, max_tokens=24)[1]

    threads = [threading.Thread(target=run, args=(p,)) for p in PROMPTS * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == expected


@pytest.mark.parametrize("engine", ["vllm", "openai"])
def test_an_inline_loaded_remote_model_serves(daemon, vllm, direct, engine):
    """The same keys through RepositoryModelLoad's JSON config; `openai` is the
    generic engine, and vLLM speaks its protocol too."""
    name = f"inline-{engine}"
    expected = direct_completion(direct, PROMPTS[0], max_tokens=16)["choices"][0]["text"]
    with Client(daemon.address) as client:
        client.load(name, config=remote_config(vllm.url, engine=engine, fallback=False))
        try:
            assert client.health(name) == "SERVING"
            with grpc.insecure_channel(daemon.address) as channel:
                from modeld.gen import generation_pb2_grpc as gg

                _, text, _ = generate(gg.GenerationStub(channel), PROMPTS[0], model=name, max_tokens=16)
            assert text == expected
        finally:
            client.unload(name)
