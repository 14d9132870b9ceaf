"""smollm2-onnx (onnxruntime-genai's engine) through the real daemon: Generate
and the KServe text path, streaming, usage, cancellation, and what it lacks
failing closed. Uses the session's daemon, which preloads the repository."""

from __future__ import annotations

import re
import threading
import time
import tomllib
import urllib.request

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc

from daemon import MODELS
from polling import wait_until
from modeld.gen import generation_pb2 as g
from modeld.gen import generation_pb2_grpc as gg

MODEL = "smollm2-onnx"
ARTIFACT = tomllib.loads((MODELS / MODEL / "model.toml").read_text())["artifact"]


@pytest.fixture(scope="module")
def stub(daemon):
    with grpc.insecure_channel(daemon.address) as channel:
        yield gg.GenerationStub(channel)


def _request(prompt: str, model: str = MODEL, **sampling) -> g.GenerateRequest:
    return g.GenerateRequest(model=model, prompt=prompt, sampling=g.SamplingParams(**{"max_tokens": 16, **sampling}))


def _timed(stub, request) -> tuple[list[int], str, object, list[float]]:
    """Tokens, text, the final message, and when each message arrived."""
    started, arrivals, responses = time.monotonic(), [], []
    for response in stub.Generate(request, timeout=120):
        arrivals.append(time.monotonic() - started)
        responses.append(response)
    tokens = [t for r in responses for t in r.token_ids]
    return tokens, "".join(r.text for r in responses), responses[-1], arrivals


def _metric(daemon, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics").read().decode()
    match = re.search(re.escape(name) + r'\{backend="onnx-genai",model="smollm2-onnx"\} ([0-9.e+]+)', text)
    return float(match.group(1)) if match else 0.0


def test_tokens_stream_as_they_are_generated_with_real_usage(stub, daemon):
    tokens, text, final, arrivals = _timed(stub, _request("The capital of France is", ignore_eos=True))
    assert len(tokens) == 16
    if ARTIFACT.startswith("fp32/"):
        assert text.startswith(" Paris")
    assert len(arrivals) == 17  # one message per token, then the final one
    # the first message comes while the sequence still runs, not when it is done
    # (read from the daemon, not from the arrival times a busy machine spreads)
    streaming = stub.Generate(_request("Count to one thousand:", max_tokens=400, ignore_eos=True), timeout=120)
    next(streaming)
    assert _metric(daemon, "modeld_running_sequences") == 1
    streaming.cancel()
    wait_until(lambda: _metric(daemon, "modeld_running_sequences") == 0, what="the sequence to leave the batch")
    usage = final.usage
    prompt_ids = stub.Tokenize(g.TokenizeRequest(model=MODEL, text="The capital of France is"), timeout=30).token_ids
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_prompt_tokens) == (len(prompt_ids), 16, 0)
    assert 0 < usage.time_to_first_token_s <= arrivals[0] + 0.05
    assert final.finish_reason == g.FINISH_REASON_LENGTH


@pytest.mark.skipif(not ARTIFACT.startswith("fp32/"), reason="int4 re-quantizes the weights")
def test_greedy_tokens_are_the_torch_backends_on_the_same_weights(stub):
    for prompt in ("Once upon a time", "def fibonacci(n):"):
        ours = _timed(stub, _request(prompt, ignore_eos=True))[0]
        torch = _timed(stub, _request(prompt, model="smollm2-torch", ignore_eos=True))[0]
        assert ours == torch


def test_chat_messages_end_at_the_end_of_turn(stub):
    request = g.GenerateRequest(model=MODEL, sampling=g.SamplingParams(max_tokens=64), messages=g.ChatMessages(
        messages=[g.ChatMessage(role="user", content="What is the capital of France? One word.")]))
    tokens, text, final, _ = _timed(stub, request)
    assert final.finish_reason == g.FINISH_REASON_STOP and tokens[-1] == 2 and "<|im_end|>" not in text  # 2: <|im_end|>
    assert final.usage.completion_tokens == len(tokens)


def test_concurrent_streams_batch_and_match_their_solo_output(stub):
    prompts = ["One", "Two", "Three", "Four", "Five", "Six"]
    solo = {p: _timed(stub, _request(p, max_tokens=8, ignore_eos=True))[0] for p in prompts[:2]}
    results: dict[str, list[int]] = {}

    def run(prompt):
        results[prompt] = _timed(stub, _request(prompt, max_tokens=8, ignore_eos=True))[0]

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(len(results[p]) == 8 for p in prompts)
    assert all(results[p] == solo[p] for p in solo)  # a batch pads, it does not change greedy tokens


def test_kserve_text_input_gives_text_output_and_usage(daemon):
    client = tc.InferenceServerClient(daemon.address)
    prompt = tc.InferInput("text_input", [1], "BYTES")
    prompt.set_data_from_numpy(np.array([b"The capital of France is"], dtype=object))
    result = client.infer(MODEL, [prompt], parameters={"max_tokens": 6})
    text = result.as_numpy("text_output")[0].decode()
    assert text and result.get_response().parameters["completion_tokens"].int64_param == 6
    client.close()


def test_a_cancelled_call_leaves_the_batch_at_the_next_step(stub, daemon):
    call = stub.Generate(_request("Count slowly to one thousand:", max_tokens=600, ignore_eos=True), timeout=120)
    next(call)
    assert _metric(daemon, "modeld_running_sequences") >= 1
    call.cancel()
    wait_until(lambda: _metric(daemon, "modeld_running_sequences") == 0, what="the sequence to leave the batch")


@pytest.mark.parametrize("sampling, lacks", [
    ({"logprobs": 2}, "logprobs"),
    ({"speculative": g.SPECULATIVE_NGRAM}, "speculative_decoding"),
    ({"temperature": 0.8, "seed": 7}, "seed"),
])
def test_what_the_engine_lacks_fails_closed(stub, sampling, lacks):
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(_request("Hello", max_tokens=2, **sampling), timeout=60))
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "onnx-genai" in err.value.details() and lacks in err.value.details()
