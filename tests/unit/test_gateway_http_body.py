"""The HTTP gateway's bounded body reads (server/gateway/http/body.py) and
hedge.race, without sockets."""

from __future__ import annotations

import asyncio
import gzip
import json

import pytest

from modeld.server.gateway.hedge import race
from modeld.server.gateway.http.body import (
    BodyError, BodyTooLarge, chat_turns, inflate, model_of, prompt_key, read_body, routing_fields, with_model,
)

WANTED = frozenset({"model", "messages", "prompt"})


def test_only_the_wanted_top_level_values_are_read():
    body = json.dumps({"tools": [{"a": "}]{[\"\\"}], "messages": [{"role": "user", "content": "hi {"}],
                       "nested": {"model": "not this one"}, "model": "smollm2", "n": -1.5e3, "x": None}).encode()
    fields = routing_fields(body, WANTED, 100)
    assert fields.values == {"messages": [{"role": "user", "content": "hi {"}], "model": "smollm2"}
    assert fields.num_keys == 6
    assert model_of(fields) == "smollm2"
    assert chat_turns(fields) == [("user", "hi {")]
    assert prompt_key(fields) == "user\x1fhi {\x1e"


def test_a_repeated_key_reads_as_json_loads_reads_it():
    body = b'{"model": "a", "input": "x", "model": "b"}'
    assert model_of(routing_fields(body, WANTED, 100)) == json.loads(body)["model"] == "b"


@pytest.mark.parametrize("body, why", [
    (b"[1]", "must be a JSON object"), (b'{"a" 1}', "':'"), (b'{"a": 1,}', "a string key"),
    (b'{"a": [1, 2', "nested value"), (b'{"a": 1} trailing', "end of the body"), (b"", "must be a JSON object"),
    (b'\xff{}', "not UTF-8"), (b'{"model": "unterminated}', "the end of a string"),
])
def test_a_body_routing_cannot_read_is_refused(body, why):
    with pytest.raises(BodyError, match=why):
        routing_fields(body, WANTED, 100)


@pytest.mark.parametrize("body, why", [
    (b'{"input": "x"}', "model is required"), (b'{"model": ""}', "model is required"),
    (b'{"model": null}', "model is required"), (b'{"model": 3}', "must be a string"),
])
def test_a_missing_or_unusable_model_is_named(body, why):
    with pytest.raises(BodyError, match=why):
        model_of(routing_fields(body, WANTED, 100))


def test_the_walk_is_bounded_by_the_number_of_top_level_keys():
    body = json.dumps({f"k{i}": i for i in range(11)}).encode()
    with pytest.raises(BodyError, match="more than 10 top-level keys"):
        routing_fields(body, WANTED, 10)
    assert routing_fields(body, WANTED, 11).num_keys == 11


def test_a_split_target_is_appended_and_wins():
    for body, keys in ((b'{"model": "a", "input": ["x"]}  \n', 2), (b"{}", 0)):
        retargeted = with_model(body, keys, "b\"c")
        assert json.loads(retargeted)["model"] == 'b"c'
        if keys:
            assert json.loads(retargeted)["input"] == ["x"]


def test_a_compressed_body_inflates_only_up_to_the_limit():
    data = json.dumps({"model": "m", "input": "x" * 10_000}).encode()
    assert inflate(gzip.compress(data), "gzip", 20_000) == data
    with pytest.raises(BodyTooLarge):
        inflate(gzip.compress(data), "gzip", 5_000)
    with pytest.raises(BodyError, match="not valid gzip"):
        inflate(b"plain", "gzip", 5_000)
    with pytest.raises(BodyError, match="not supported"):
        inflate(data, "br", 20_000)


def test_a_body_past_the_limit_is_refused_as_it_arrives():
    received = []

    async def receive():
        received.append(1)
        return {"type": "http.request", "body": b"x" * 1000, "more_body": True}

    with pytest.raises(BodyTooLarge):
        asyncio.run(read_body(receive, None, 4500))
    assert len(received) == 5  # refused at the chunk that passed the limit, not at the end
    with pytest.raises(BodyTooLarge):
        asyncio.run(read_body(receive, "999999", 4500))
    assert len(received) == 5  # a declared length over the limit: not a byte read


def test_a_hedge_wins_only_when_the_first_is_late_and_the_loser_is_cancelled():
    async def scenario():
        cancelled = []

        async def answer(value, delay):
            try:
                await asyncio.sleep(delay)
                return value
            except asyncio.CancelledError:
                cancelled.append(value)
                raise

        fast = await race(answer("first", 0), lambda: answer("second", 0), 10)
        hedged = await race(answer("first", 10), lambda: answer("second", 0), 0.001)
        declined = await race(answer("first", 0.01), lambda: None, 0.001)
        return fast, hedged, declined, cancelled

    fast, hedged, declined, cancelled = asyncio.run(scenario())
    assert fast == ("first", False) and hedged == ("second", True) and declined == ("first", False)
    assert cancelled == ["first"]


def test_when_both_fail_the_first_ones_failure_is_raised():
    async def fail(message, delay):
        await asyncio.sleep(delay)
        raise ValueError(message)

    with pytest.raises(ValueError, match="primary"):
        asyncio.run(race(fail("primary", 0.02), lambda: fail("hedge", 0), 0.001))
