"""The shared HTTP layer: status codes mapped by meaning with the remote's
own message, event streams read strictly, transport faults classified for
the health tracker. No sockets: httpx answers from functions."""

from __future__ import annotations

import json

import httpx
import pytest

from modeld.backends.errors import ErrorKind, InvalidArgument, NotFound, ResourceExhausted
from modeld.backends.remote.health import FailureKind
from modeld.backends.remote.http import Endpoint, RemoteFailure, RemoteHttp, error_for_status, remote_message

SSE = {"content-type": "text/event-stream"}


@pytest.mark.parametrize("status, kind, failure", [
    (400, ErrorKind.INVALID_ARGUMENT, None),
    (422, ErrorKind.INVALID_ARGUMENT, None),
    (404, ErrorKind.NOT_FOUND, None),
    (413, ErrorKind.RESOURCE_EXHAUSTED, None),
    (429, ErrorKind.RESOURCE_EXHAUSTED, None),
    (401, ErrorKind.FAILED_PRECONDITION, None),
    (403, ErrorKind.FAILED_PRECONDITION, None),
    (408, ErrorKind.UNAVAILABLE, FailureKind.TIMEOUT),
    (424, ErrorKind.UNAVAILABLE, FailureKind.SERVER_ERROR),
    (500, ErrorKind.UNAVAILABLE, FailureKind.SERVER_ERROR),
    (503, ErrorKind.UNAVAILABLE, FailureKind.SERVER_ERROR),
])
def test_status_codes_map_by_meaning(status, kind, failure):
    error = error_for_status("the vllm engine at http://x", status, '{"message": "the reason"}')
    assert error.kind is kind
    assert f"answered HTTP {status}: the reason" in str(error)
    assert getattr(error, "failure", None) is failure


@pytest.mark.parametrize("body, message", [
    ('{"error": {"message": "max_tokens too large", "type": "invalid_request_error"}}', "max_tokens too large"),
    ('{"object": "error", "message": "model x not found", "code": 404}', "model x not found"),
    ('{"error": "Input validation error: `inputs` must not be empty", "error_type": "validation"}',
     "Input validation error"),
    ('{"detail": [{"loc": ["body", "max_tokens"], "msg": "must be >= 0"}]}', "must be >= 0"),
])
def test_the_remote_message_is_kept(body, message):
    assert message in remote_message(body)


@pytest.mark.parametrize("body", ["Internal Server Error", "", "<html>internal page: token=abc</html>",
                                  '{"Code": "Success", "SecretAccessKey": "abc"}'])
def test_a_body_that_is_no_engine_error_is_summarised_by_its_status(body):
    assert remote_message(body, 502) == "Bad Gateway (no message)"


def test_a_huge_error_body_is_cut():
    assert len(remote_message("x" * 10_000)) < 600


def _http(handler, api_key: str = "") -> RemoteHttp:
    http = RemoteHttp(Endpoint("vllm", "http://engine:1", api_key=api_key, timeout_s=30),
                      transport=httpx.MockTransport(handler))
    http.open()
    return http


async def _events(http: RemoteHttp) -> list:
    return [e async for e in http.events("/v1/completions", {"prompt": "x"})]


async def test_events_end_at_done_and_skip_comments_and_keepalives():
    body = b': ping\n\ndata: {"a": 1}\n\n\ndata: \n\ndata: {"a": 2}\n\ndata: [DONE]\n\ndata: {"a": 3}\n\n'
    http = _http(lambda request: httpx.Response(200, headers=SSE, content=body))
    assert await _events(http) == [{"a": 1}, {"a": 2}]


async def test_the_key_travels_as_a_bearer_token():
    seen = []

    def handler(request):
        seen.append(request.headers.get("authorization"))
        return httpx.Response(200, json={"ok": True})

    await _http(handler, api_key="s3cret").get_json("/v1/models")
    assert seen == ["Bearer s3cret"]


async def test_a_malformed_event_is_a_broken_stream():
    http = _http(lambda request: httpx.Response(200, headers=SSE, content=b'data: {"a": 1}\n\ndata: {oops\n\n'))
    with pytest.raises(RemoteFailure) as err:
        await _events(http)
    assert err.value.failure is FailureKind.BROKEN_STREAM and "malformed event" in str(err.value)


async def test_an_answer_that_is_not_an_event_stream_is_a_broken_stream():
    http = _http(lambda request: httpx.Response(200, json={"choices": []}))
    with pytest.raises(RemoteFailure) as err:
        await _events(http)
    assert err.value.failure is FailureKind.BROKEN_STREAM and "event stream" in str(err.value)


async def test_an_error_status_on_a_stream_keeps_the_remote_message():
    http = _http(lambda request: httpx.Response(400, json={"message": "prompt too long"}))
    with pytest.raises(InvalidArgument, match="HTTP 400: prompt too long"):
        await _events(http)
    http = _http(lambda request: httpx.Response(404, json={"message": "no such model"}))
    with pytest.raises(NotFound):
        await _events(http)
    http = _http(lambda request: httpx.Response(429, json={"error": "Model is overloaded"}))
    with pytest.raises(ResourceExhausted, match="overloaded"):
        await _events(http)


async def test_a_5xx_is_unavailable_and_counted():
    http = _http(lambda request: httpx.Response(503, text="engine dead"))
    with pytest.raises(RemoteFailure) as err:
        await _events(http)
    assert err.value.kind is ErrorKind.UNAVAILABLE and err.value.failure is FailureKind.SERVER_ERROR


def _raises(exc):
    def handler(request):
        raise exc
    return handler


@pytest.mark.parametrize("exc, failure, words", [
    (httpx.ConnectError("connection refused"), FailureKind.UNREACHABLE, "unreachable"),
    (httpx.ConnectTimeout("connect"), FailureKind.TIMEOUT, "timeout_s is 30"),
    (httpx.ReadTimeout("read"), FailureKind.TIMEOUT, "did not answer within its timeout"),
    (httpx.RemoteProtocolError("bad"), FailureKind.BROKEN_STREAM, "failed"),
])
async def test_transport_faults_are_classified(exc, failure, words):
    for call in (lambda http: _events(http), lambda http: http.get_json("/health")):
        with pytest.raises(RemoteFailure) as err:
            await call(_http(_raises(exc)))
        assert err.value.failure is failure and words in str(err.value)
        assert "the vllm engine at http://engine:1" in str(err.value)


class _DiesAfterOneEvent(httpx.AsyncByteStream):
    async def __aiter__(self):
        yield b'data: {"a": 1}\n\n'
        raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")


async def test_a_stream_that_breaks_off_says_so():
    http = _http(lambda request: httpx.Response(200, headers=SSE, stream=_DiesAfterOneEvent()))
    got = []
    with pytest.raises(RemoteFailure) as err:
        async for event in http.events("/generate", {}):
            got.append(event)
    assert got == [{"a": 1}]
    assert err.value.failure is FailureKind.BROKEN_STREAM and "mid-stream" in str(err.value)


async def test_json_answers_that_are_not_json_are_a_fault():
    http = _http(lambda request: httpx.Response(200, text="<html>proxy error</html>"))
    with pytest.raises(RemoteFailure, match="not JSON"):
        await http.get_json("/info")


async def test_calls_before_open_say_the_model_is_not_started():
    http = RemoteHttp(Endpoint("tgi", "http://engine:1"))
    with pytest.raises(Exception, match="not started"):
        await http.get("/health")


def test_error_for_status_passes_json_lists():
    body = json.dumps([{"msg": "a"}, {"msg": "b"}])
    assert remote_message(body) == "a; b"
