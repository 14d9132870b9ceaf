"""Token generation on llama.cpp through the real daemon (smollm2)."""

from __future__ import annotations

import asyncio
import queue
import re
import time
import urllib.request

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

from daemon import MODELS
from modeld.gen import generation_pb2 as g
from modeld.gen import generation_pb2_grpc as gg
from polling import wait_until, wait_until_async

PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,",
    "Water boils at", "The best way to learn a language is", "In 1492,", "Python is a",
]
COPY_PROMPT = (
    "Rewrite this function, renaming total to result and changing nothing else:\n"
    "def add_all(values):\n    total = 0\n    for value in values:\n        total = total + value\n"
    "    return total\n\nRewritten:\ndef add_all(values):\n"
)


@pytest.fixture(scope="module")
def stub(daemon):
    with grpc.insecure_channel(daemon.address) as channel:
        yield gg.GenerationStub(channel)


def _params(**kw) -> g.SamplingParams:
    return g.SamplingParams(**{"max_tokens": 32, **kw})


def _generate(stub, prompt=None, token_ids=None, **kw):
    if token_ids is not None:
        request = g.GenerateRequest(model="smollm2", token_ids=g.TokenIds(ids=token_ids), sampling=_params(**kw))
    else:
        request = g.GenerateRequest(model="smollm2", prompt=prompt, sampling=_params(**kw))
    responses = list(stub.Generate(request, timeout=120))
    tokens = [t for r in responses[:-1] for t in r.token_ids]
    text = "".join(r.text for r in responses)
    return tokens, text, responses[-1]


def _metric(daemon, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics").read().decode()
    match = re.search(re.escape(name) + r'\{backend="llamacpp",model="smollm2"\} ([0-9.e+]+)', text)
    return float(match.group(1)) if match else 0.0


def test_greedy_matches_llama_cpp_python(stub):
    from llama_cpp import Llama

    # flash attention, as the daemon runs it (see backends/llamacpp/context.py)
    llm = Llama(str(MODELS / "smollm2/model.gguf"), n_ctx=512, n_threads=2, flash_attn=True, verbose=False)
    for prompt in PROMPTS[:4]:
        ids = llm.tokenize(prompt.encode())
        expected = []
        for token in llm.generate(ids, temp=0.0, reset=True):
            if token == llm.token_eos() or len(expected) == 32:
                break
            expected.append(token)
        got, _, final = _generate(stub, token_ids=ids, cache_prompt=False)
        assert got[:len(expected)] == expected, prompt
        assert final.usage.prompt_tokens == len(ids)


def test_concurrent_streams_give_the_tokens_each_gives_alone(daemon):
    alone = {}
    with grpc.insecure_channel(daemon.address) as channel:
        stub = gg.GenerationStub(channel)
        for i, prompt in enumerate(PROMPTS):
            alone[prompt] = _generate(stub, prompt, max_tokens=16 + 4 * i, cache_prompt=False)[0]

    async def run_all():
        async with grpc.aio.insecure_channel(daemon.address) as channel:
            stub = gg.GenerationStub(channel)

            async def one(i, prompt):
                request = g.GenerateRequest(model="smollm2", prompt=prompt, sampling=_params(max_tokens=16 + 4 * i))
                return [t async for r in stub.Generate(request, timeout=120) for t in r.token_ids]

            return await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))

    together = asyncio.run(run_all())
    for prompt, tokens in zip(PROMPTS, together):
        assert tokens == alone[prompt], prompt


def test_after_unrelated_requests_concurrent_streams_match_a_cold_run(daemon):
    """Issue 14: prefixes left cached by finished requests move where new
    streams go and in which order llama.cpp is fed; the tokens must not move."""
    unrelated = ["Tell me a joke about cats.", "What is the capital of Peru?", "Name three primary colours.",
                 "How do airplanes fly?", "Translate 'good morning' into French.", "Write a haiku about rain."]
    with grpc.insecure_channel(daemon.address) as channel:
        stub = gg.GenerationStub(channel)
        cold = {p: _generate(stub, p, max_tokens=16, cache_prompt=False, ignore_eos=True)[0] for p in PROMPTS}
        for prompt in unrelated:  # one at a time; each leaves its prefix cached in a slot
            _generate(stub, prompt, max_tokens=8)

    async def run_all():
        async with grpc.aio.insecure_channel(daemon.address) as channel:
            stub = gg.GenerationStub(channel)

            async def one(prompt):
                request = g.GenerateRequest(model="smollm2", prompt=prompt, sampling=_params(max_tokens=16, ignore_eos=True))
                return [t async for r in stub.Generate(request, timeout=120) for t in r.token_ids]

            return await asyncio.gather(*(one(p) for p in PROMPTS))

    for prompt, tokens in zip(PROMPTS, asyncio.run(run_all())):
        assert tokens == cold[prompt], prompt


def test_prefix_reuse_matches_a_cold_run_and_reports_cached_tokens(stub):
    shared = "You are a careful assistant. " * 20
    cold, _, cold_final = _generate(stub, shared + "Tell me about rivers.", cache_prompt=False)
    _generate(stub, shared + "Tell me about mountains.")  # leaves the shared prefix cached
    warm, _, warm_final = _generate(stub, shared + "Tell me about rivers.")
    assert warm == cold
    assert cold_final.usage.cached_prompt_tokens == 0
    assert warm_final.usage.cached_prompt_tokens >= 100
    assert warm_final.usage.cached_prompt_tokens < warm_final.usage.prompt_tokens


def test_ngram_speculation_is_identical_to_greedy(stub):
    plain, _, _ = _generate(stub, COPY_PROMPT, max_tokens=48, cache_prompt=False)
    fast, _, final = _generate(stub, COPY_PROMPT, max_tokens=48, cache_prompt=False,
                               speculative=g.SPECULATIVE_NGRAM, num_speculative_tokens=4)
    assert fast == plain
    assert final.usage.drafted_tokens > 0
    assert 0 < final.usage.accepted_tokens <= final.usage.drafted_tokens


def test_draft_model_speculation_is_identical_to_greedy(stub):
    for prompt in (COPY_PROMPT, "The capital of France is"):
        plain, _, _ = _generate(stub, prompt, max_tokens=40, cache_prompt=False)
        fast, _, final = _generate(stub, prompt, max_tokens=40, cache_prompt=False,
                                   speculative=g.SPECULATIVE_DRAFT, num_speculative_tokens=4)
        assert fast == plain, prompt
        assert final.usage.drafted_tokens > 0 and final.usage.accepted_tokens > 0


def test_cancelling_mid_stream_frees_the_sequence(stub, daemon):
    call = stub.Generate(g.GenerateRequest(model="smollm2", prompt="Count to one thousand:",
                                           sampling=_params(max_tokens=2000, ignore_eos=True)), timeout=120)
    got = 0
    for response in call:
        got += len(response.token_ids)
        if got >= 5:
            call.cancel()
            break
    wait_until(lambda: _metric(daemon, "modeld_running_sequences") == 0, what="the sequence to leave the batch")
    tokens, _, final = _generate(stub, "Hello", max_tokens=4)
    assert len(tokens) == 4 and final.finish_reason == g.FINISH_REASON_LENGTH


def test_stop_conditions(stub):
    tokens, text, final = _generate(stub, "The capital of France is", max_tokens=32, stop=["States"])
    assert final.finish_reason == g.FINISH_REASON_STOP and "States" not in text and text.endswith("United ")
    tokens, text, final = _generate(stub, "The capital of France is", max_tokens=5)
    assert final.finish_reason == g.FINISH_REASON_LENGTH and final.usage.completion_tokens == 5 == len(tokens)
    chat = g.GenerateRequest(model="smollm2", sampling=_params(max_tokens=200), messages=g.ChatMessages(
        messages=[g.ChatMessage(role="user", content="Say hi.")]))
    responses = list(stub.Generate(chat, timeout=120))
    assert responses[-1].finish_reason == g.FINISH_REASON_STOP  # the model's end-of-turn token
    assert responses[-1].usage.completion_tokens < 200
    first, _, _ = _generate(stub, "The capital of France is", max_tokens=3)
    tokens, _, final = _generate(stub, "The capital of France is", stop_token_ids=[first[1]])
    assert final.finish_reason == g.FINISH_REASON_STOP and tokens == first[:2]


def test_text_deltas_reassemble_and_logprobs(stub):
    tokens, text, _ = _generate(stub, "Write the word café three times:", max_tokens=24, logprobs=3)
    detok = stub.Detokenize(g.DetokenizeRequest(model="smollm2", token_ids=tokens), timeout=30).text
    assert text == detok
    request = g.GenerateRequest(model="smollm2", prompt="Hi", sampling=_params(max_tokens=3, logprobs=2))
    responses = list(stub.Generate(request, timeout=60))[:-1]
    for r in responses:
        assert len(r.logprobs) == len(r.token_ids) and all(lp.logprob <= 0 for lp in r.logprobs)
        assert [len(t.candidates) for t in r.top_logprobs] == [2] * len(r.token_ids)
        assert r.top_logprobs[0].candidates[0].token_id == r.token_ids[0]  # greedy takes the best
    ids = stub.Tokenize(g.TokenizeRequest(model="smollm2", text="Hello world"), timeout=30).token_ids
    assert stub.Detokenize(g.DetokenizeRequest(model="smollm2", token_ids=ids), timeout=30).text == "Hello world"


BAD_REQUESTS = {
    "context overflow": (dict(prompt="word " * 3000, sampling=_params(max_tokens=2000)),
                         grpc.StatusCode.INVALID_ARGUMENT, "beyond the context window"),
    "negative temperature": (dict(prompt="x", sampling=_params(temperature=-1.0)),
                             grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    "top_p zero": (dict(prompt="x", sampling=_params(top_p=0.0)), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    "max_tokens zero": (dict(prompt="x", sampling=_params(max_tokens=0)), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    "no input": (dict(sampling=_params()), grpc.StatusCode.INVALID_ARGUMENT, "exactly one of"),
    "token outside vocabulary": (dict(token_ids=g.TokenIds(ids=[10**7])), grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
    "unknown model": (dict(model="no_such_llm", prompt="x"), grpc.StatusCode.NOT_FOUND, "unknown model"),
    "tensor model": (dict(model="minilm", prompt="x"), grpc.StatusCode.UNIMPLEMENTED, "generation"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_generation_requests(stub, case):
    fields, code, fragment = BAD_REQUESTS[case]
    request = g.GenerateRequest(**{"model": "smollm2", **fields})
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request, timeout=60))
    assert err.value.code() == code, err.value.details()
    assert fragment in err.value.details()


def test_tritonclient_streams_tokens_from_smollm2(daemon):
    client = tc.InferenceServerClient(daemon.address)
    prompt = tc.InferInput("text_input", [1], "BYTES")
    prompt.set_data_from_numpy(np.array([b"The capital of France is"], dtype=object))
    whole = client.infer("smollm2", [prompt], parameters={"max_tokens": 8})
    expected = whole.as_numpy("text_output")[0].decode()
    assert whole.get_response().parameters["completion_tokens"].int64_param == 8
    for empty_final in (False, True):
        answers: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        try:
            client.async_stream_infer("smollm2", [prompt], parameters={"max_tokens": 8},
                                      enable_empty_final_response=empty_final)
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
        assert "".join(chunks) == expected and len(chunks) >= 2
        assert response.parameters["completion_tokens"].int64_param == 8
        assert bool(response.outputs) is not empty_final
    with pytest.raises(InferenceServerException) as err:
        client.infer("smollm2", [prompt], parameters={"temperature": "hot"})
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"


def test_the_torch_runtime_serves_through_the_daemon(daemon):
    with grpc.insecure_channel(daemon.address) as channel:
        stub = gg.GenerationStub(channel)
        request = g.GenerateRequest(model="smollm2-torch", prompt="The capital of France is",
                                    sampling=_params(max_tokens=8, logprobs=1))
        responses = list(stub.Generate(request, timeout=120))
    assert responses[-1].usage.completion_tokens == 8
    assert "".join(r.text for r in responses).startswith(" Paris")
    client = tc.InferenceServerClient(daemon.address)
    assert client.get_model_metadata("smollm2-torch").platform == "modeld_torch"


def test_cancelling_a_draft_stream_releases_the_llama_draft_state():
    """In process: a cancelled speculative stream leaves no draft state behind."""
    import dataclasses

    from modeld.backends.generation.params import GenerateRequest, SamplingParams, SpeculativeMode
    from modeld.backends.llamacpp.backend import LlamaCppBackend
    from modeld.backends.model_config import load_model_toml

    config = load_model_toml("smollm2", MODELS / "smollm2/model.toml")
    options = dataclasses.replace(config.backend_options.llamacpp, n_ctx=2048, n_slots=2,
                                  draft_path=str(MODELS / "smollm2-draft/model.gguf"))
    config = dataclasses.replace(config, backend_options=dataclasses.replace(config.backend_options, llamacpp=options))
    model = LlamaCppBackend().load(config, MODELS / "smollm2")

    async def go():
        await model.start()
        try:
            stream = model.generate(GenerateRequest("smollm2", prompt="Count to one thousand:", params=SamplingParams(
                max_tokens=500, ignore_eos=True, speculative=SpeculativeMode.DRAFT, num_speculative_tokens=3)))
            got = 0
            while got < 6:
                got += len((await stream.__anext__()).token_ids)
            assert model.draft.computed  # the draft follows the running sequence
            await stream.aclose()  # the client went away
            await wait_until_async(lambda: not model.scheduler.has_work(), what="the sequence to leave the batch")
        finally:
            await model.stop()
    try:
        asyncio.run(go())
        assert not model.scheduler.running and model.draft.computed == {}
    finally:
        model.unload()
