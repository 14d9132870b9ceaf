"""RemoteModel, what every engine shares: the final event and its usage,
failures mid-stream, limits, cancellation, health and load figures. No
sockets: httpx answers from functions."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from modeld.backends.errors import ErrorKind, ResourceExhausted, Unavailable, Unimplemented
from modeld.backends.generation.params import (
    FinalEvent, FinishReason, GenerateRequest, SamplingParams, SpeculativeMode, TokenEvent,
)
from modeld.backends.options import RemoteOptions
from modeld.backends.remote.http import Endpoint, RemoteHttp
from modeld.backends.remote.model import RemoteModel
from modeld.backends.remote.vllm import VllmProtocol
from polling import wait_until_async

SSE = {"content-type": "text/event-stream"}
METRICS = ('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m"} 2\n'
           '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name="m"} 1\n'
           '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name="m"} 0.5\n')


def _chunk(text: str, token_id: int, finish=None) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": {
        "tokens": [f"token_id:{token_id}"], "token_logprobs": [-0.1], "top_logprobs": [None]}}]}


def _complete(n: int = 3) -> bytes:
    events = [_chunk(f" w{i}", i) for i in range(n)]
    events.append({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
    events.append({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": n}})
    return ("".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n").encode()


class Observer:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __getattr__(self, name):
        if name.startswith("on_"):
            return lambda *args: self.calls.append((name, *args))
        raise AttributeError(name)

    def named(self, name: str) -> list[tuple]:
        return [c[1:] for c in self.calls if c[0] == name]


async def _model(handler, **options) -> RemoteModel:
    http = RemoteHttp(Endpoint("vllm", "http://engine:1"), transport=httpx.MockTransport(handler))
    settings = {"url": "http://engine:1", "engine": "vllm", "probe_interval_s": 60.0, "max_probe_interval_s": 60.0,
                **options}
    model = RemoteModel(VllmProtocol(http, "m"), RemoteOptions(**settings), "llm")
    await model.start()
    return model


async def _collect(model: RemoteModel, **params) -> list:
    request = GenerateRequest("llm", prompt="Hello", params=SamplingParams(**params))
    return [e async for e in model.generate(request)]


async def test_a_complete_stream_ends_with_usage_and_timing():
    model = await _model(lambda r: httpx.Response(200, headers=SSE, content=_complete(3)))
    observer = Observer()
    model.set_observer(observer)
    events = await _collect(model, max_tokens=3)
    assert [e.token_ids for e in events[:-1]] == [(0,), (1,), (2,)]
    final = events[-1]
    assert final.finish_reason is FinishReason.LENGTH and not final.error
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (4, 3)
    assert final.usage.time_to_first_token_s > 0
    assert sum(c[0] for c in observer.named("on_tokens")) == 3
    assert observer.named("on_finish")[0][1] is FinishReason.LENGTH
    assert model.nbytes == 0 and model.is_healthy
    await model.stop()


class _Breaks(httpx.AsyncByteStream):
    def __init__(self, events: int) -> None:
        self.events = events

    async def __aiter__(self):
        for i in range(self.events):
            yield f"data: {json.dumps(_chunk(f' w{i}', i))}\n\n".encode()
        raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")


async def test_dying_mid_stream_ends_with_an_error_finish_and_no_replay():
    calls = []

    def handler(request):
        calls.append(request.url.path)
        return httpx.Response(200, headers=SSE, stream=_Breaks(2))

    model = await _model(handler)
    events = await _collect(model, max_tokens=10)
    assert [e.text for e in events[:-1]] == [" w0", " w1"]
    final = events[-1]
    assert final.finish_reason is FinishReason.ERROR and final.error_kind is ErrorKind.UNAVAILABLE
    assert "broke off its answer mid-stream" in final.error and "not replayed" in final.error
    assert final.usage.time_to_first_token_s > 0
    assert calls == ["/v1/completions"]
    assert model.health.num_failures == 1
    await model.stop()


async def test_failing_before_any_token_raises_the_cause():
    def refuse(request):
        raise httpx.ConnectError("connection refused")

    model = await _model(refuse)
    with pytest.raises(Unavailable, match="unreachable"):
        await _collect(model)
    assert not model.is_healthy  # nothing listens: unhealthy at once
    await model.stop()


async def test_a_stream_that_ends_without_a_finish_is_an_error():
    body = f"data: {json.dumps(_chunk(' w0', 0))}\n\n".encode()  # no finish, no [DONE]
    model = await _model(lambda r: httpx.Response(200, headers=SSE, content=body))
    final = (await _collect(model))[-1]
    assert final.finish_reason is FinishReason.ERROR and "before saying how the sequence finished" in final.error
    await model.stop()


async def test_a_refusal_is_unimplemented_before_anything_is_sent():
    calls = []
    model = await _model(lambda r: calls.append(r) or httpx.Response(500))
    with pytest.raises(Unimplemented, match="model 'llm': speculative decoding is a setting"):
        await _collect(model, speculative=SpeculativeMode.NGRAM)
    assert calls == []
    await model.stop()


class _Slow(httpx.AsyncByteStream):
    def __init__(self) -> None:
        self.closed = asyncio.Event()

    async def __aiter__(self):
        for i in range(1000):
            yield f"data: {json.dumps(_chunk(f' w{i}', i))}\n\n".encode()
            await asyncio.sleep(0.01)

    async def aclose(self) -> None:
        self.closed.set()


async def test_max_in_flight_refuses_the_next_request_and_leaving_closes_the_stream():
    streams: list[_Slow] = []

    def handler(request):
        streams.append(_Slow())
        return httpx.Response(200, headers=SSE, stream=streams[-1])

    model = await _model(handler, max_in_flight=1)
    first = model.generate(GenerateRequest("llm", prompt="a", params=SamplingParams(max_tokens=1000)))
    assert isinstance(await first.__anext__(), TokenEvent)
    with pytest.raises(ResourceExhausted, match="max_in_flight"):
        await _collect(model)
    await first.aclose()  # the client went away
    await asyncio.wait_for(streams[0].closed.wait(), 30)
    assert model.num_in_flight == 0
    events = model.generate(GenerateRequest("llm", prompt="b"))
    assert isinstance(await events.__anext__(), TokenEvent)  # room again
    await events.aclose()
    await model.stop()


async def test_probes_mark_it_unhealthy_then_healthy_and_carry_the_load_figures():
    state = {"up": False}

    def handler(request):
        if not state["up"]:
            return httpx.Response(503, text="starting")
        return httpx.Response(200, text=METRICS) if request.url.path == "/metrics" else httpx.Response(200)

    model = await _model(handler, unhealthy_after=2, probe_interval_s=0.01, max_probe_interval_s=0.02)
    model.protocol.has_metrics = True
    changes, observer = [], Observer()
    model.set_health_listener(changes.append)
    model.set_observer(observer)
    await wait_until_async(lambda: changes, what="the model marked unhealthy")
    assert changes == [False] and not model.is_healthy
    state["up"] = True
    await wait_until_async(lambda: len(changes) == 2 and model.load is not None,
                           what="the model healthy again, with load figures")
    assert changes == [False, True]
    assert (model.num_running, model.num_waiting, model.kv_cache_usage) == (2, 1, 0.5)
    assert (2, 1, 0, 0) in observer.named("on_step")
    assert [c[0] for c in observer.named("on_remote_health")] == [True, False, True]
    assert observer.named("on_remote_failure")[0] == ("server_error",)
    await model.stop()


async def test_stop_lets_requests_in_flight_finish():
    stream = _Slow()
    model = await _model(lambda r: httpx.Response(200, headers=SSE, stream=stream))
    events = model.generate(GenerateRequest("llm", prompt="a", params=SamplingParams(max_tokens=1000)))
    await events.__anext__()
    stopping = asyncio.create_task(model.stop())
    await asyncio.sleep(0.05)
    assert not stopping.done()
    await events.aclose()
    await asyncio.wait_for(stopping, 30)


async def test_a_final_error_event_from_the_engine_counts_against_its_health():
    body = ("data: " + json.dumps({"error": {"message": "engine crashed", "code": 500}}) + "\n\n").encode()
    model = await _model(lambda r: httpx.Response(200, headers=SSE, content=body), unhealthy_after=1)
    final = (await _collect(model))[-1]
    assert isinstance(final, FinalEvent) and "engine crashed" in final.error
    assert not model.is_healthy
    await model.stop()
