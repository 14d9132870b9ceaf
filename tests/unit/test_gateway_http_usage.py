"""The HTTP front's count of a relayed generation's tokens (a tenant's
tokens_per_minute), from the OpenAI events as they pass."""

from __future__ import annotations

import json

from modeld.server.gateway.http.usage import StreamTokens, charge_answer


def _event(chunk) -> bytes:
    return b"data: " + (chunk if isinstance(chunk, bytes) else json.dumps(chunk).encode()) + b"\n\n"


def _chat(delta: dict, finish=None) -> bytes:
    return _event({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta,
                                                                   "finish_reason": finish}]})


def test_each_event_with_output_counts_one_token_and_none_else_does():
    charged = []
    meter = StreamTokens(charged.append)
    meter.feed(_chat({"role": "assistant", "content": ""}))  # the opening role event: no token
    meter.feed(_chat({"content": "Hel"}) + _chat({"content": "lo"}))  # two events in one run
    meter.feed(_chat({"reasoning_content": "hm"}) + _chat({"tool_calls": [{"index": 0}]}))
    meter.feed(_chat({}, "stop") + _event(b"[DONE]") + b": a comment\n\n")
    assert charged == [2, 2] and meter.counted == 4


def test_a_usage_event_charges_the_exact_remainder_once():
    charged = []
    meter = StreamTokens(charged.append)
    text = [_event({"object": "text_completion", "choices": [{"index": i % 2, "text": "x"}]}) for i in range(4)]
    meter.feed(b"".join(text))
    usage = _event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}})
    meter.feed(usage + _event(b"[DONE]"))
    meter.feed(text[0])  # nothing counts after the exact figure
    assert charged == [4, 3] and meter.counted == 7


def test_garbage_counts_nothing():
    charged = []
    meter = StreamTokens(charged.append)
    meter.feed(b"data: {not json\n\ndata: [1, 2]\n\ndata: {\"choices\": [\"x\", null]}\n\nevent: ping\n\n")
    assert charged == [] and meter.counted == 0


def test_a_whole_answer_charges_its_usage():
    charged = []
    charge_answer(json.dumps({"choices": [], "usage": {"completion_tokens": 5}}).encode(), charged.append)
    charge_answer(b"[]", charged.append)
    charge_answer(b"{oops", charged.append)
    assert charged == [5]
