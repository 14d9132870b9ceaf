"""Structured outputs and the full sampling surface through real clients:
the openai SDK (parse() with a Pydantic model, response_format, vLLM's
structured_outputs and guided_* fields through extra_body), gRPC Generate
with a Constraint and n, KServe parameters through tritonclient, and the
/tokenize and /detokenize routes, all on smollm2 (llama.cpp) in a daemon
of its own (the repository's other models would only slow its start)."""

from __future__ import annotations

import json
import re
from typing import Literal

import grpc
import httpx
import jsonschema
import numpy as np
import openai
import pytest
import tritonclient.grpc as tc
from pydantic import BaseModel, Field

from daemon import MODELS, start_daemon
from modeld.gen import generation_pb2 as g
from modeld.gen import generation_pb2_grpc as gg

MODEL = "smollm2"
GGUF = MODELS / "smollm2/model.gguf"
ASK = [{"role": "user", "content": "Describe Paris as JSON: its name, its country and whether it is a capital."}]


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    capital: bool


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                    "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    if not GGUF.exists():
        pytest.skip("models/smollm2/model.gguf is missing: run `make models`")
    folder = tmp_path_factory.mktemp("repo") / MODEL
    folder.mkdir()
    (folder / "model.gguf").symlink_to(GGUF.resolve())
    (folder / "model.toml").write_text('format = "gguf"\nbackends = ["llamacpp"]\nartifact = "model.gguf"\n'
                                       "[llamacpp]\nn_ctx = 8192\nn_slots = 8\ncontext_length = 1024\n"
                                       "n_threads = 2\nmax_prefill_tokens = 64\n")
    proc = start_daemon(repository=folder.parent)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(daemon):
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


def _error(reply: httpx.Response) -> dict:
    assert reply.status_code == 400, reply.text
    return reply.json()["error"]


# -- constraints -----------------------------------------------------------------------------


def test_parse_with_a_pydantic_model_returns_a_validated_object(client):
    completion = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=City, max_tokens=96,
                                               temperature=0)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, City)
    assert City.model_validate_json(choice.message.content) == choice.message.parsed


@pytest.mark.slow
def test_a_json_schema_with_nested_objects_arrays_and_enums_holds(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    answer = client.with_options(timeout=600).chat.completions.create(
        model=MODEL, max_tokens=160, temperature=0.8, seed=7, n=3, response_format=fmt,
        messages=[{"role": "user", "content": "Invent a person as JSON."}])
    assert len(answer.choices) == 3
    for choice in answer.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)


@pytest.mark.slow
def test_json_object_mode_gives_an_object(client):
    answer = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=96, temperature=0,
                                            response_format={"type": "json_object"})
    assert isinstance(json.loads(answer.choices[0].message.content), dict)


def test_regex_and_choice_through_vllms_fields(client):
    phone = client.completions.create(model=MODEL, prompt="Call me at", max_tokens=16, temperature=0,
                                      extra_body={"structured_outputs": {"regex": r" [0-9]{3}-[0-9]{4}"}})
    assert re.fullmatch(r" [0-9]{3}-[0-9]{4}", phone.choices[0].text), phone.choices[0].text
    verdict = client.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0, extra_body={"guided_choice": ["positive", "negative"]},
        messages=[{"role": "user", "content": "Is 'I love this film' positive or negative?"}])
    assert verdict.choices[0].message.content in ("positive", "negative")
    grammar = client.completions.create(model=MODEL, prompt="Answer yes or no:", max_tokens=8, temperature=0,
                                        extra_body={"grammar": 'root ::= " yes" | " no"'})
    assert grammar.choices[0].text in (" yes", " no")


@pytest.mark.slow
def test_a_constraint_streams_the_same_text(client):
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=96, temperature=0, response_format={"type": "json_object"})
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    assert streamed == whole


# -- sampling surface --------------------------------------------------------------------------


def test_penalties_and_logit_bias_change_the_greedy_output(client, raw):
    prompt = "one two one two one two one two one two"
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    plain = client.completions.create(logprobs=1, **kwargs).choices[0]
    assert client.completions.create(frequency_penalty=2.0, **kwargs).choices[0].text != plain.text
    first = plain.logprobs.tokens[0]
    banned = client.completions.create(**{**kwargs, "max_tokens": 1}, logprobs=1,
                                       logit_bias={str(_token_id(raw, first)): -100})
    assert banned.choices[0].logprobs.tokens[0] != first


@pytest.mark.slow
def test_presence_and_repetition_penalties_change_the_greedy_output(client):
    kwargs = dict(model=MODEL, prompt="one two one two one two one two one two", max_tokens=6, temperature=0)
    plain = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(presence_penalty=2.0, **kwargs).choices[0].text != plain
    assert client.completions.create(extra_body={"repetition_penalty": 1.8}, **kwargs).choices[0].text != plain


def _token_id(raw, token: str) -> int:
    return raw.post("/tokenize", json={"model": MODEL, "prompt": token}).json()["tokens"][-1]


@pytest.mark.slow
def test_min_tokens_and_stop_token_ids(client, raw):
    eos = raw.post("/tokenize", json={"model": MODEL, "prompt": "<|im_end|>"}).json()["tokens"][-1]
    short = client.chat.completions.create(model=MODEL, max_tokens=40, temperature=0,
                                           messages=[{"role": "user", "content": "Say hi."}])
    n = short.usage.completion_tokens
    assert n < 40
    longer = client.chat.completions.create(model=MODEL, max_tokens=40, temperature=0, extra_body={
        "min_tokens": n + 5, "stop_token_ids": [eos]}, messages=[{"role": "user", "content": "Say hi."}])
    assert longer.usage.completion_tokens >= n + 5


def test_n_choices_are_reproducible_by_seed_and_stream_tagged(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=11, n=3)
    first = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert len({c.text for c in first.choices}) > 1  # seed + i: the choices differ from each other
    texts = ["", "", ""]
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in first.choices]
    # choice i is the n=1 request with seed + i
    single = client.completions.create(**{**kwargs, "n": 1, "seed": 12})
    assert single.choices[0].text == first.choices[1].text


@pytest.mark.slow
def test_best_of_returns_the_n_most_likely(client):
    answer = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=6, temperature=1.0, seed=3,
                                       n=2, best_of=4, logprobs=1)
    assert [c.index for c in answer.choices] == [0, 1]
    sums = [sum(c.logprobs.token_logprobs) for c in answer.choices]
    assert sums[0] >= sums[1]
    every = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=6, temperature=1.0, seed=3,
                                      n=4, logprobs=1)
    ranked = sorted(every.choices, key=lambda c: -sum(c.logprobs.token_logprobs))
    assert [c.text for c in answer.choices] == [c.text for c in ranked[:2]]


@pytest.mark.slow
def test_echo_leads_with_the_prompt(client):
    answer = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                                       echo=True)
    plain = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert answer.choices[0].text == "The capital of France is" + plain.choices[0].text


# -- bad input ---------------------------------------------------------------------------------

BAD = {
    "invalid schema": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "response_format"),
    "schema not an object": ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
                             "response_format"),
    "bad regex": ({"structured_outputs": {"regex": "(["}}, "structured_outputs"),
    "grammar that does not compile": ({"grammar": "root ::= ("}, "grammar"),
    "empty choice": ({"guided_choice": []}, "guided_choice"),
    "two constraints": ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    "too many logit_bias entries": ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    "logit_bias key not a token id": ({"logit_bias": {"hello": 1}}, "logit_bias"),
    "n over the limit": ({"n": 17}, "n"),
    "best_of under n": ({"n": 3, "best_of": 2}, "best_of"),
    "best_of streamed": ({"n": 1, "best_of": 2, "stream": True}, "best_of"),
    "too many stop_token_ids": ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
    "min_tokens over max_tokens": ({"min_tokens": 50}, "min_tokens"),
    "prompt_logprobs": ({"prompt_logprobs": 1}, "prompt_logprobs"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_fields_are_400_naming_the_field_before_any_token(raw, case):
    fields, param = BAD[case]
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 8, **fields}
    error = _error(raw.post("/v1/completions", json=body))
    assert param in error["message"] or error["param"] == param, error
    assert error["type"] == "invalid_request_error"


def test_prompt_logprobs_is_refused_naming_the_backend(raw):
    error = _error(raw.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "prompt_logprobs": 1}))
    assert error["param"] == "prompt_logprobs" and "llamacpp backend" in error["message"], error
    error = _error(raw.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "echo": True, "logprobs": 1}))
    assert error["param"] == "echo" and "llamacpp backend" in error["message"], error


def test_the_daemon_keeps_serving_after_bad_constraints(client):
    answer = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length")


# -- gRPC, KServe, token routes ----------------------------------------------------------------


def test_grpc_generate_with_a_constraint_and_n(stub):
    sampling = g.SamplingParams(max_tokens=8, temperature=1.0, seed=5,
                                constraint=g.Constraint(choice=g.ChoiceList(choices=["red", "green", "blue"])))
    request = g.GenerateRequest(model=MODEL, prompt="My favourite colour is", sampling=sampling, n=4)
    responses = list(stub.Generate(request, timeout=120))
    texts, finals = {}, {}
    for r in responses:
        texts[r.index] = texts.get(r.index, "") + r.text
        if r.finish_reason:
            finals[r.index] = r
    assert sorted(finals) == [0, 1, 2, 3] and all(t in ("red", "green", "blue") for t in texts.values()), texts
    again = list(stub.Generate(request, timeout=120))
    assert {i: "".join(r.text for r in again if r.index == i) for i in range(4)} == texts
    bad = g.GenerateRequest(model=MODEL, prompt="x", sampling=g.SamplingParams(
        constraint=g.Constraint(json_schema="{not json")))
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(bad, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "json_schema" in err.value.details()


def test_n_computes_the_shared_prompt_once(stub):
    prompt = "A long shared prompt about the sea and its many moods, " * 6
    sampling = g.SamplingParams(max_tokens=4, temperature=1.0, seed=1)
    responses = list(stub.Generate(g.GenerateRequest(model=MODEL, prompt=prompt, sampling=sampling, n=4), timeout=120))
    finals = [r for r in responses if r.finish_reason]
    assert len(finals) == 4
    prompt_tokens = finals[0].usage.prompt_tokens
    computed = sum(f.usage.prompt_tokens - f.usage.cached_prompt_tokens for f in finals)
    # one choice computes the prompt; the others take it from the prefix
    # cache (the last prompt token is always computed, for its logits)
    assert computed <= prompt_tokens + 3 * 16, [(f.usage.prompt_tokens, f.usage.cached_prompt_tokens) for f in finals]


def test_kserve_text_generation_takes_the_same_parameters(daemon):
    client = tc.InferenceServerClient(daemon.address)
    text = tc.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"Is water wet? Answer:"], dtype=object))
    result = client.infer(MODEL, [text], parameters={"max_tokens": 8, "guided_choice": '[" yes", " no"]',
                                                     "presence_penalty": 1, "logit_bias": '{"1": -5}'})
    assert result.as_numpy("text_output")[0].decode() in (" yes", " no")
    with pytest.raises(tc.InferenceServerException, match="guided_json"):
        client.infer(MODEL, [text], parameters={"guided_json": "{bad"})
    client.close()


def test_tokenize_and_detokenize_round_trip(raw):
    tokens = raw.post("/tokenize", json={"model": MODEL, "prompt": "Hello, world!"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    assert tokens["max_model_len"] in (None, 1024)
    text = raw.post("/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]}).json()["prompt"]
    assert text.endswith("Hello, world!")
    assert _error(raw.post("/detokenize", json={"model": MODEL, "tokens": ["a"]}))["param"] == "tokens"
    assert raw.post("/tokenize", json={"model": "nope", "prompt": "x"}).status_code == 404


def test_tokenize_messages_gives_the_prompt_a_chat_completion_runs_on(raw):
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = raw.post("/tokenize", json={"model": MODEL, "messages": messages}).json()
    assert "tokens" in chat, chat
    answer = raw.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1}).json()
    assert chat["count"] == len(chat["tokens"]) == answer["usage"]["prompt_tokens"]
    text = raw.post("/detokenize", json={"model": MODEL, "tokens": chat["tokens"]}).json()["prompt"]
    assert "Name a colour." in text and text.rstrip().endswith("assistant")
    # the generation prompt off, as a field or as a template variable: the same shorter prompt
    off = raw.post("/tokenize", json={"model": MODEL, "messages": messages, "add_generation_prompt": False}).json()
    kwarg = raw.post("/tokenize", json={"model": MODEL, "messages": messages,
                                        "chat_template_kwargs": {"add_generation_prompt": False}}).json()
    assert off["tokens"] == kwarg["tokens"] == chat["tokens"][:off["count"]] and off["count"] < chat["count"]
    # chat_template_kwargs reach the template a completion renders, too
    shorter = raw.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1,
                                                     "chat_template_kwargs": {"add_generation_prompt": False}}).json()
    assert shorter["usage"]["prompt_tokens"] == off["count"]
    for body, param in (({"messages": messages, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
                        ({"messages": messages, "prompt": "x"}, "prompt"),
                        ({"messages": [{"role": "tool", "tool_call_id": "x", "content": "1"}]},
                         "messages[0].tool_call_id")):
        assert _error(raw.post("/tokenize", json={"model": MODEL, **body}))["param"] == param


# -- an agent library --------------------------------------------------------------------------


def test_pydantic_ai_extracts_a_structured_object(daemon):
    """pydantic-ai's NativeOutput asks for OpenAI's json_schema response_format."""
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=f"http://127.0.0.1:{daemon.http_port}/v1", api_key="none")
    agent = Agent(OpenAIChatModel(MODEL, provider=provider), output_type=NativeOutput(City),
                  model_settings={"temperature": 0.0, "max_tokens": 96})
    result = agent.run_sync("Describe Paris: its name, its country and whether it is a capital.")
    assert isinstance(result.output, City)
