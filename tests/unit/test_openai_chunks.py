"""A streamed chunk's bytes from the frame encoded once per stream are the
bytes of the whole chunk encoded each time."""

from __future__ import annotations

import json

import pytest

from modeld.server.http.openai_chat import _MARK, _Generation, _sse


def _generation(chat: bool, include_usage: bool, model: str = "smollm2") -> _Generation:
    g = _Generation.__new__(_Generation)  # the fields a chunk reads, without a request behind them
    g.chat, g.include_usage, g.model = chat, include_usage, model
    g.id, g.created, g._frames = ("chatcmpl-" if chat else "cmpl-") + "req-7", 1796593000, {}
    return g


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("include_usage", [True, False])
@pytest.mark.parametrize("model", ["smollm2", 'a "quoted" model \u00e9', f"x-{_MARK}-y", _MARK])
def test_a_plain_chunk_is_the_whole_chunk_encoded(chat, include_usage, model):
    g = _generation(chat, include_usage, model)
    for index in (0, 2):
        for text in (" the", "", 'quote " and \\ and \u00e9\U0001f600', "\n"):
            value = {"content": text} if chat else text
            whole = (_sse(g._chunk(value, "", None, None, index)) if chat else
                     _sse(g._chunk(None, value, None, None, index)))
            assert g._plain_event(index, value) == whole
            payload = json.loads(whole[len(b"data: "):])
            assert payload["choices"][0]["index"] == index
    # a model named as the mark itself gets no frame: every chunk is encoded whole
    assert bool(g._frames[0]) is (model != _MARK)


def test_a_chat_delta_with_a_tool_call_is_encoded_as_it_is():
    g = _generation(True, False)
    delta = {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                             "function": {"name": "get_weather", "arguments": ""}}]}
    assert g._plain_event(0, delta) == _sse(g._chunk(delta, "", None, None, 0))
