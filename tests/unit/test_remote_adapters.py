"""Each engine's adapter on its own: what it sends for modeld's sampling
parameters, what it refuses and why, how it reads the engine's events and
load figures. No sockets: httpx answers from functions, with the shapes the
engines' API documentation gives."""

from __future__ import annotations

import json

import httpx
import pytest

from modeld.backends.errors import ErrorKind
from modeld.backends.generation.params import (
    ChatMessage, FinishReason, GenerateRequest, SamplingParams, SpeculativeMode, TokenEvent, TokenLogprob,
)
from modeld.backends.remote.health import FailureKind
from modeld.backends.remote.http import Endpoint, RemoteFailure, RemoteHttp
from modeld.backends.remote.openai_compat import OpenAIProtocol
from modeld.backends.remote.protocol import RemoteFinish, parse_metrics
from modeld.backends.remote.sglang import SglangProtocol
from modeld.backends.remote.tgi import TgiProtocol
from modeld.backends.remote.vllm import VllmProtocol

SSE = {"content-type": "text/event-stream"}


def _sse(*events, done: bool = True) -> bytes:
    text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + ("data: [DONE]\n\n" if done else "")
    return text.encode()


def _protocol(cls, handler=None, model: str = "m"):
    http = RemoteHttp(Endpoint(cls.engine, "http://engine:1"),
                      transport=httpx.MockTransport(handler or (lambda r: httpx.Response(404))))
    http.open()
    return cls(http, model)


def _request(prompt: str = "Hi", **params) -> GenerateRequest:
    return GenerateRequest("m", prompt=prompt, params=SamplingParams(**params))


async def _run(protocol, request) -> list:
    return [item async for item in protocol.stream(request)]


# -- vLLM --------------------------------------------------------------------------------------


def test_vllm_sends_modelds_meaning_explicitly():
    vllm = _protocol(VllmProtocol)
    body = vllm.body(_request(max_tokens=7))
    assert body["top_k"] == -1 and body["min_p"] == 0.0 and body["repetition_penalty"] == 1.0
    assert body["logprobs"] == 0 and body["return_tokens_as_token_ids"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 7 and body["temperature"] == 0.0 and body["top_p"] == 1.0
    assert "seed" not in body and "stop" not in body
    body = vllm.body(_request(top_k=5, min_p=0.1, seed=3, stop=("\n",), stop_token_ids=(7,), ignore_eos=True,
                              logprobs=2))
    assert (body["top_k"], body["min_p"], body["seed"], body["stop"], body["stop_token_ids"], body["ignore_eos"],
            body["logprobs"]) == (5, 0.1, 3, ["\n"], [7], True, 2)


def test_vllm_chat_asks_for_logprobs_its_way():
    vllm = _protocol(VllmProtocol)
    request = GenerateRequest("m", messages=(ChatMessage("user", "Hi"),), params=SamplingParams(logprobs=3))
    body = vllm.body(request)
    assert vllm.path(request) == "/v1/chat/completions"
    assert body["messages"] == [{"role": "user", "content": "Hi"}]
    assert body["logprobs"] is True and body["top_logprobs"] == 3


def test_vllm_refuses_only_per_request_speculation():
    vllm = _protocol(VllmProtocol)
    assert vllm.refusal(_request(logprobs=5, top_k=3)) is None
    reason = vllm.refusal(_request(speculative=SpeculativeMode.NGRAM))
    assert "speculative decoding is a setting of the vllm engine" in reason


def _completion_chunk(text, token_id, logprob, tops, finish=None):
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": {
        "tokens": [f"token_id:{token_id}"], "token_logprobs": [logprob], "text_offset": [0],
        "top_logprobs": [{f"token_id:{i}": lp for i, lp in tops}]}}]}


async def test_vllm_reads_token_ids_and_logprobs_best_first():
    body = _sse(
        _completion_chunk(" Paris", 42, -0.1, [(42, -0.1), (7, -2.5), (9, -1.5)]),
        # the chosen token is not among the top 2 here: vLLM lists it anyway
        _completion_chunk(".", 13, -3.0, [(5, -0.5), (6, -1.0), (13, -3.0)]),
        {"choices": [{"index": 0, "text": "", "finish_reason": "length", "logprobs": None}]},
        {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2,
                                  "prompt_tokens_details": {"cached_tokens": 4}}},
    )
    vllm = _protocol(VllmProtocol, lambda r: httpx.Response(200, headers=SSE, content=body))
    items = await _run(vllm, _request(max_tokens=2, logprobs=2))
    assert items[0] == TokenEvent((42,), " Paris", (TokenLogprob(42, -0.1),),
                                  ((TokenLogprob(42, -0.1), TokenLogprob(9, -1.5)),))
    assert items[1].top_logprobs == ((TokenLogprob(5, -0.5), TokenLogprob(6, -1.0)),)
    assert items[2] == RemoteFinish(FinishReason.LENGTH, prompt_tokens=5, cached_prompt_tokens=4, completion_tokens=2)


async def test_vllm_without_token_ids_fails_a_logprobs_request_closed():
    chunk = {"choices": [{"index": 0, "text": " Paris", "finish_reason": None,
                          "logprobs": {"tokens": [" Paris"], "token_logprobs": [-0.1], "top_logprobs": [{}]}}]}
    vllm = _protocol(VllmProtocol, lambda r: httpx.Response(200, headers=SSE, content=_sse(chunk)))
    items = await _run(vllm, _request(logprobs=1))
    assert items[0].reason is FinishReason.ERROR and items[0].error_kind is ErrorKind.UNIMPLEMENTED
    assert "return_tokens_as_token_ids" in items[0].error
    # without logprobs the text still streams
    assert (await _run(vllm, _request()))[0] == TokenEvent((), " Paris")


VLLM_V1_METRICS = """
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="0",model_name="other"} 9.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="1000"} 1.0
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 400.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 100.0
"""

VLLM_V0_METRICS = """
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 0.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.1
# TYPE vllm:gpu_prefix_cache_hit_rate gauge
vllm:gpu_prefix_cache_hit_rate{model_name="m"} 0.3
"""


def test_vllm_load_figures_from_its_metrics():
    vllm = _protocol(VllmProtocol)
    load = vllm.read_load(parse_metrics(VLLM_V1_METRICS))
    assert (load.num_running, load.num_waiting, load.kv_cache_usage, load.kv_capacity, load.kv_used) == (
        3, 2, 0.5, 16000, 8000)
    assert load.prefix_cache_hit_ratio == 0.25
    old = vllm.read_load(parse_metrics(VLLM_V0_METRICS))
    assert (old.num_running, old.kv_cache_usage, old.kv_capacity, old.prefix_cache_hit_ratio) == (1, 0.1, 0, 0.3)
    assert vllm.read_load(parse_metrics("# TYPE other gauge\nother 1\n")) is None


# -- any OpenAI-compatible server ------------------------------------------------------------------

OPENAPI = {
    "paths": {
        "/v1/completions": {"post": {"requestBody": {"content": {"application/json": {
            "schema": {"$ref": "#/components/schemas/CreateCompletionRequest"}}}}}},
        "/v1/chat/completions": {"post": {"requestBody": {"content": {"application/json": {
            "schema": {"anyOf": [{"$ref": "#/components/schemas/Chat"}]}}}}}},
        "/extras/tokenize": {}, "/extras/detokenize": {},
    },
    "components": {"schemas": {
        "CreateCompletionRequest": {"properties": {k: {} for k in (
            "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "repeat_penalty")}},
        "Chat": {"properties": {"messages": {}, "top_k": {}}},
    }},
}


def _openai_with_schema(handler=None):
    def answer(request):
        if request.url.path == "/openapi.json":
            return httpx.Response(200, json=OPENAPI)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        return handler(request) if handler else httpx.Response(404)
    return _protocol(OpenAIProtocol, answer)


async def test_openai_learns_the_servers_fields_and_sends_modelds_values():
    server = _openai_with_schema()
    await server.inspect()
    body = server.body(_request())
    # the server's own defaults (top_k 40, min_p 0.05, repeat_penalty 1.1) must not apply
    assert (body["top_k"], body["min_p"], body["repeat_penalty"]) == (0, 0.0, 1.0)
    assert "ignore_eos" not in body and "stream_options" not in body
    assert server.refusal(_request(top_k=5, min_p=0.2, seed=1)) is None
    assert "does not take ignore_eos" in server.refusal(_request(ignore_eos=True))
    chat = GenerateRequest("m", messages=(ChatMessage("user", "x"),), params=SamplingParams(min_p=0.1))
    assert "does not take min_p" in server.refusal(chat)
    assert "cannot report logprobs" in server.refusal(_request(logprobs=1))
    assert server.tokenize_route[0] == "/extras/tokenize" and server.detokenize_route[0] == "/extras/detokenize"


async def test_openai_without_a_schema_sends_only_openais_fields():
    server = _protocol(OpenAIProtocol, lambda r: httpx.Response(200, json={"data": [{"id": "m"}]})
                       if r.url.path == "/v1/models" else httpx.Response(404))
    await server.inspect()
    body = server.body(_request(seed=4))
    assert set(body) == {"model", "stream", "max_tokens", "temperature", "top_p", "prompt", "seed", "stream_options"}
    assert "cannot tell whether it honours top_k" in server.refusal(_request(top_k=3))
    assert "no tokenize endpoint" in server.server_capabilities()["tokenize"]


async def test_openai_load_fails_when_the_model_is_not_listed():
    from modeld.backends.errors import LoadFailed

    server = _protocol(OpenAIProtocol, lambda r: httpx.Response(200, json={"data": [{"id": "other"}]}))
    with pytest.raises(LoadFailed, match="does not serve 'm'.*lists 'other'"):
        await server.inspect()


async def test_openai_counts_usage_when_the_server_streams_none():
    chunks = [{"choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in (" a", " b", " c")]
    chunks.append({"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]})

    def handler(request):
        if request.url.path == "/extras/tokenize":
            return httpx.Response(200, json={"tokens": [1, 2, 3, 4]})
        return httpx.Response(200, headers=SSE, content=_sse(*chunks))

    server = _openai_with_schema(handler)
    await server.inspect()
    items = await _run(server, _request("four tokens here"))
    assert [i.text for i in items[:-1]] == [" a", " b", " c"]
    assert items[-1] == RemoteFinish(FinishReason.STOP, prompt_tokens=4, completion_tokens=3)


async def test_openai_an_unknown_finish_reason_is_an_error_not_a_stop():
    chunk = {"choices": [{"index": 0, "text": "", "finish_reason": "content_filter"}]}
    server = _protocol(OpenAIProtocol, lambda r: httpx.Response(200, headers=SSE, content=_sse(chunk)))
    items = await _run(server, _request())
    assert items[-1].reason is FinishReason.ERROR and "content_filter" in items[-1].error


async def test_openai_an_error_event_ends_the_sequence_with_the_remote_message():
    events = _sse({"choices": [{"index": 0, "text": " a", "finish_reason": None}]},
                  {"error": {"message": "CUDA out of memory", "code": 500}}, done=False)
    server = _protocol(OpenAIProtocol, lambda r: httpx.Response(200, headers=SSE, content=events))
    items = await _run(server, _request())
    assert items[0].text == " a"
    assert items[1].reason is FinishReason.ERROR and "CUDA out of memory" in items[1].error


async def test_openai_a_stream_ending_without_a_finish_reason_yields_no_finish():
    server = _protocol(OpenAIProtocol, lambda r: httpx.Response(
        200, headers=SSE, content=_sse({"choices": [{"index": 0, "text": " a", "finish_reason": None}]})))
    items = await _run(server, _request())
    assert items == [TokenEvent((), " a")]  # the model layer reports the missing end


# -- SGLang ----------------------------------------------------------------------------------------


def _sglang_event(text, ids, finish=None, **meta):
    return {"text": text, "output_ids": ids, "index": 0, "meta_info": {
        "id": "x", "prompt_tokens": 3, "completion_tokens": len(ids), "cached_tokens": 2, "finish_reason": finish,
        **meta}}


def test_sglang_body_is_its_native_request():
    sglang = _protocol(SglangProtocol)
    body = sglang.body(_request("Hello", max_tokens=9, stop=("x",), top_k=0))
    assert body["text"] == "Hello" and body["stream"] is True and body["return_logprob"] is True
    assert body["sampling_params"]["max_new_tokens"] == 9 and body["sampling_params"]["top_k"] == -1
    assert body["sampling_params"]["stop"] == ["x"] and body["sampling_params"]["repetition_penalty"] == 1.0
    ids = sglang.body(GenerateRequest("m", token_ids=(1, 2), params=SamplingParams()))
    assert ids["input_ids"] == [1, 2] and "text" not in ids


def test_sglang_refuses_chat_and_seeds_with_the_reason():
    sglang = _protocol(SglangProtocol)
    assert "chat messages need its OpenAI API" in sglang.refusal(
        GenerateRequest("m", messages=(ChatMessage("user", "x"),)))
    assert "no per-request seed" in sglang.refusal(_request(seed=1))
    assert sglang.refusal(_request(logprobs=3, min_p=0.1, ignore_eos=True)) is None


async def test_sglang_turns_cumulative_events_into_deltas():
    events = _sse(_sglang_event(" one", [10]), _sglang_event(" one two", [10, 11]),
                  _sglang_event(" one two three", [10, 11, 12], {"type": "length", "length": 3}))
    sglang = _protocol(SglangProtocol, lambda r: httpx.Response(200, headers=SSE, content=events))
    items = await _run(sglang, _request())
    assert items[:3] == [TokenEvent((10,), " one"), TokenEvent((11,), " two"), TokenEvent((12,), " three")]
    assert items[3] == RemoteFinish(FinishReason.LENGTH, prompt_tokens=3, cached_prompt_tokens=2, completion_tokens=3)


async def test_sglang_logprobs_come_from_meta_info():
    first = _sglang_event(" one", [10], output_token_logprobs=[[-0.1, 10, None]],
                          output_top_logprobs=[[[-0.1, 10, None], [-2.0, 99, None], [-1.0, 98, None]]])
    last = _sglang_event(" one two", [10, 11], {"type": "stop", "matched": 2},
                         output_token_logprobs=[[-0.1, 10, None], [-0.2, 11, None]],
                         output_top_logprobs=[[[-0.1, 10, None]], [[-0.2, 11, None], [-0.9, 97, None]]])
    sglang = _protocol(SglangProtocol, lambda r: httpx.Response(200, headers=SSE, content=_sse(first, last)))
    items = await _run(sglang, _request(logprobs=2))
    assert items[0].logprobs == (TokenLogprob(10, -0.1),)
    assert items[0].top_logprobs == ((TokenLogprob(10, -0.1), TokenLogprob(98, -1.0)),)
    assert items[1].top_logprobs == ((TokenLogprob(11, -0.2), TokenLogprob(97, -0.9)),)
    assert items[2].reason is FinishReason.STOP


async def test_sglang_in_incremental_mode_is_refused_as_malformed():
    events = _sse(_sglang_event(" one", [10]), _sglang_event(" two", [11]))
    sglang = _protocol(SglangProtocol, lambda r: httpx.Response(200, headers=SSE, content=events))
    with pytest.raises(RemoteFailure) as err:
        await _run(sglang, _request())
    assert err.value.failure is FailureKind.BROKEN_STREAM and "incremental" in str(err.value)


async def test_sglang_an_abort_keeps_its_meaning():
    abort = _sglang_event("", [], {"type": "abort", "message": "input is too long", "status_code": 400})
    sglang = _protocol(SglangProtocol, lambda r: httpx.Response(200, headers=SSE, content=_sse(abort)))
    items = await _run(sglang, _request())
    assert items[-1].reason is FinishReason.ERROR and items[-1].error_kind is ErrorKind.INVALID_ARGUMENT
    assert "input is too long" in items[-1].error


SGLANG_METRICS = """
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 4.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 1.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.2
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="m"} 0.6
"""


def test_sglang_load_figures():
    load = _protocol(SglangProtocol).read_load(parse_metrics(SGLANG_METRICS))
    assert (load.num_running, load.num_waiting, load.kv_cache_usage, load.prefix_cache_hit_ratio) == (4, 1, 0.2, 0.6)


# -- TGI -------------------------------------------------------------------------------------------


def test_tgi_greedy_is_do_sample_false_without_the_knobs_it_refuses():
    tgi = _protocol(TgiProtocol)
    parameters = tgi.body(_request("Hi", max_tokens=4))["parameters"]
    assert parameters["do_sample"] is False and parameters["details"] is True and parameters["max_new_tokens"] == 4
    assert not {"temperature", "top_p", "top_k", "top_n_tokens"} & set(parameters)
    sampled = tgi.body(_request(temperature=0.7, top_p=0.9, top_k=20, seed=5, logprobs=2))["parameters"]
    assert (sampled["do_sample"], sampled["temperature"], sampled["top_p"], sampled["top_k"], sampled["seed"],
            sampled["top_n_tokens"]) == (True, 0.7, 0.9, 20, 5, 2)
    assert "top_p" not in tgi.body(_request(temperature=0.7))["parameters"]  # TGI refuses top_p = 1


@pytest.mark.parametrize("request_, word", [
    (_request(min_p=0.1), "min_p"), (_request(ignore_eos=True), "ignore_eos"),
    (_request(stop_token_ids=(3,)), "stop_token_ids"),
    (GenerateRequest("m", token_ids=(1, 2)), "token ids"),
    (GenerateRequest("m", messages=(ChatMessage("user", "x"),)), "chat messages"),
])
def test_tgi_refuses_what_its_api_lacks(request_, word):
    assert word in _protocol(TgiProtocol).refusal(request_)


def _tgi_event(token_id, text, special=False, details=None, top=None):
    return {"index": token_id, "token": {"id": token_id, "text": text, "logprob": -0.5, "special": special},
            "top_tokens": top, "generated_text": None if details is None else "x", "details": details}


async def test_tgi_trims_the_stop_sequence_it_keeps_and_hides_special_tokens():
    events = _sse(_tgi_event(1, " one"), _tgi_event(2, " tw"),
                  _tgi_event(3, "o three", details={"finish_reason": "stop_sequence", "generated_tokens": 3,
                                                    "input_length": 2, "seed": None}), done=False)
    tgi = _protocol(TgiProtocol, lambda r: httpx.Response(200, headers=SSE, content=events))
    items = await _run(tgi, _request(stop=(" two",)))
    assert "".join(i.text for i in items[:-1]) == " one"
    assert [i.token_ids for i in items[:-1]] == [(1,), (2,), (3,)]
    assert items[-1] == RemoteFinish(FinishReason.STOP, prompt_tokens=2, completion_tokens=3)
    eos = _sse(_tgi_event(1, " one"), _tgi_event(0, "</s>", special=True, details={
        "finish_reason": "eos_token", "generated_tokens": 2, "input_length": 2}), done=False)
    tgi = _protocol(TgiProtocol, lambda r: httpx.Response(200, headers=SSE, content=eos))
    items = await _run(tgi, _request())
    assert "".join(i.text for i in items[:-1]) == " one" and items[-1].reason is FinishReason.STOP


async def test_tgi_logprobs_and_error_events():
    top = [{"id": 5, "text": "a", "logprob": -2.0, "special": False}, {"id": 1, "text": " one", "logprob": -0.5,
                                                                       "special": False}]
    events = _sse(_tgi_event(1, " one", top=top),
                  {"error": "Request failed during generation: Server error: OOM", "error_type": "generation"},
                  done=False)
    tgi = _protocol(TgiProtocol, lambda r: httpx.Response(200, headers=SSE, content=events))
    items = await _run(tgi, _request(logprobs=1))
    assert items[0].logprobs == (TokenLogprob(1, -0.5),) and items[0].top_logprobs == ((TokenLogprob(1, -0.5),),)
    assert items[1].reason is FinishReason.ERROR and "OOM" in items[1].error
    assert items[1].error_kind is ErrorKind.UNAVAILABLE


async def test_tgi_detokenize_is_unimplemented_with_the_reason():
    from modeld.backends.errors import Unimplemented

    with pytest.raises(Unimplemented, match="no detokenize endpoint"):
        await _protocol(TgiProtocol).detokenize([1])


def test_tgi_load_figures():
    text = "# TYPE tgi_batch_current_size gauge\ntgi_batch_current_size 5\n# TYPE tgi_queue_size gauge\ntgi_queue_size 7\n"
    load = _protocol(TgiProtocol).read_load(parse_metrics(text))
    assert (load.num_running, load.num_waiting) == (5, 7)


async def test_openai_refuses_token_id_prompts_where_the_schema_types_prompt_as_text():
    server = _openai_with_schema()
    await server.inspect()  # OPENAPI has no type for prompt: nothing says it cannot
    assert server.refusal(GenerateRequest("m", token_ids=(1, 2))) is None
    text_only = {**OPENAPI, "components": {"schemas": {
        **OPENAPI["components"]["schemas"],
        "CreateCompletionRequest": {"properties": {"prompt": {"anyOf": [
            {"type": "string"}, {"type": "array", "items": {"type": "string"}}]}}}}}}
    server = _protocol(OpenAIProtocol, lambda r: httpx.Response(200, json=text_only)
                       if r.url.path == "/openapi.json" else httpx.Response(200, json={"data": [{"id": "m"}]}))
    await server.inspect()
    assert "does not take a prompt of token ids" in server.refusal(GenerateRequest("m", token_ids=(1, 2)))


async def test_vllm_error_events_keep_their_code():
    events = _sse({"object": "error", "message": "prompt too long for this model", "type": "BadRequestError",
                   "code": 400}, done=False)
    vllm = _protocol(VllmProtocol, lambda r: httpx.Response(200, headers=SSE, content=events))
    items = await _run(vllm, _request())
    assert items[0].reason is FinishReason.ERROR and items[0].error_kind is ErrorKind.INVALID_ARGUMENT
    assert "prompt too long" in items[0].error
