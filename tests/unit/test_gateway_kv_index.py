"""KV-aware routing's parts without daemons: a node's index from its event
stream (garbage drops it), the daemon's watch that builds the stream, the
placement on Dynamo's cost, replicas that are still pulling a model, and a
node whose stream sends bytes that do not parse."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from modeld.gen import node_pb2 as pb
from modeld.server.gateway.balance import KvRequest, PickReason, place
from modeld.server.gateway.config import GatewaySettings
from modeld.server.gateway.kv_index import KvEventError, NodeKvIndex, PromptBlocks
from modeld.server.gateway.metrics import GatewayMetrics
from modeld.server.gateway.nodes import Node
from modeld.server.gateway.ring import HashRing
from modeld.server.services.kv_events import CacheView, KvWatch


def _events(sequence: int, *models: pb.ModelKvEvents, snapshot: bool = False) -> pb.KvEvents:
    return pb.KvEvents(snapshot=snapshot, sequence=sequence, models=list(models))


def _model(stored=(), removed=(), cleared=False, block_size=16, model="llm") -> pb.ModelKvEvents:
    return pb.ModelKvEvents(model=model, block_size=block_size, stored=list(stored), removed=list(removed),
                            cleared=cleared)


def test_an_index_follows_its_snapshot_and_deltas_and_counts_leading_blocks():
    index = NodeKvIndex()
    index.apply(_events(0, _model([1, 2, 3]), snapshot=True))
    index.apply(_events(1, _model([4], removed=[2])))
    assert index.models["llm"].hashes == {1, 3, 4}
    # a cache serves a prefix: block 3 without block 2 before it is no use
    assert index.overlap(PromptBlocks("llm", 16, (1, 2, 3))) == 1
    assert index.overlap(PromptBlocks("llm", 16, (1, 3, 4, 9))) == 3
    assert index.overlap(PromptBlocks("llm", 32, (1,))) == 0  # another block size: other hashes
    index.apply(_events(2, _model(cleared=True)))
    assert "llm" not in index.models


@pytest.mark.parametrize("garbage", [
    [_events(0, _model([1]))],  # a change before the snapshot
    [_events(0, _model([1]), snapshot=True), _events(5, _model([2]))],  # a message out of order
    [_events(0, _model([1], block_size=0), snapshot=True)],
    [_events(0, _model([1]), snapshot=True), _events(1, _model([2], block_size=32))],  # size changed, not cleared
    [_events(0, _model([1], model=""), snapshot=True)],
])
def test_garbage_drops_the_node_s_index(garbage):
    index = NodeKvIndex()
    with pytest.raises(KvEventError):
        for message in garbage:
            index.apply(message)
    assert not index.models and not index.live


def _view(hashes, identity=1, model="llm") -> CacheView:
    return CacheView(model, "paged", 16, identity, frozenset(hashes))


def test_a_watch_sends_a_snapshot_then_differences_and_a_reload_clears():
    watch, index = KvWatch(), NodeKvIndex()
    first = watch.message({"llm": _view({1, 2})})
    assert first.snapshot and set(first.models[0].stored) == {1, 2}
    assert watch.message({"llm": _view({1, 2})}) is None  # nothing changed: nothing sent
    second = watch.message({"llm": _view({1, 3})})
    assert not second.snapshot and list(second.models[0].stored) == [3] and list(second.models[0].removed) == [2]
    third = watch.message({"llm": _view({7}, identity=2)})  # reloaded: a new cache
    assert third.models[0].cleared and list(third.models[0].stored) == [7]
    fourth = watch.message({})  # unloaded
    assert fourth.models[0].cleared and not fourth.models[0].stored
    for message in (first, second, third, fourth):
        index.apply(message)  # what the gateway makes of the stream
    assert "llm" not in index.models


def test_a_difference_larger_than_the_cache_goes_as_a_snapshot():
    watch = KvWatch()
    watch.message({"llm": _view(range(0, 1000))})
    message = watch.message({"llm": _view(range(1000, 1100))})  # 1,100 changes, a cache of 100
    assert message.snapshot and len(message.models[0].stored) == 100 and message.sequence == 1


def _place(ring, kv=None, loaded=None, pulling=None, load=None):
    return place("llm", ring, 2, admitted=lambda n: True, load=load or (lambda n: 0.0), score=lambda n: 1.0,
                 rng=random.Random(0), loaded=loaded, kv=kv, pulling=pulling)


def test_the_replica_of_least_kv_cost_takes_the_prompt():
    ring = HashRing(150)
    for name in ("a", "b", "c"):
        ring.add(name)
    homes = ring.replicas("llm", 2)
    holder, other = homes[1], homes[0]
    active = {holder: 0, other: 0}
    kv = KvRequest({holder: 10}, 12, lambda n: active.get(n, 0))
    assert _place(ring, kv) == _place(ring, kv)
    pick = _place(ring, kv)
    assert pick.node == holder and pick.reason is PickReason.KV
    # the holder's running blocks outweigh what its cache saves: the other computes the prompt
    active[holder] = 11
    assert _place(ring, kv).node == other


def test_a_prompt_no_replica_holds_starts_on_the_cache_holding_the_fewest_blocks():
    ring = HashRing(150)
    for name in ("a", "b", "c"):
        ring.add(name)
    fuller, emptier = ring.replicas("llm", 2)
    held = {fuller: 40, emptier: 3}
    kv = KvRequest({}, 12, lambda n: 0, held_blocks=lambda n: held[n])
    # equal cost on both (nothing cached, nothing running): the emptier cache, every time
    assert {_place(ring, kv).node for _ in range(20)} == {emptier}
    held[emptier] = 90
    assert {_place(ring, kv).node for _ in range(20)} == {fuller}


def test_a_replica_still_pulling_the_model_takes_no_call_while_another_has_it_ready():
    ring = HashRing(150)
    for name in ("a", "b", "c"):
        ring.add(name)
    ready, pulling = ring.replicas("llm", 2)
    loads = {ready: 100.0, pulling: 0.0}  # the ready one is far past the bound
    for _ in range(20):
        pick = _place(ring, loaded=lambda n: n == ready, pulling=lambda n: n == pulling, load=lambda n: loads.get(n, 0.0))
        assert pick.node != pulling
    # with no replica ready, the pulling one is where the model comes up first
    picks = {_place(ring, loaded=lambda n: False, pulling=lambda n: n == pulling).node for _ in range(20)}
    assert pulling in picks


async def test_a_stream_of_bytes_that_do_not_parse_leaves_the_node_without_an_index():
    async def garbage(request: bytes, context):
        yield pb.KvEvents(snapshot=True, models=[_model([1, 2])]).SerializeToString()
        yield b"\xff\xff\xff\xff not a protobuf"

    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("modeld.v1.Node", {
        "WatchKvEvents": grpc.unary_stream_rpc_method_handler(garbage)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    node = Node(f"127.0.0.1:{port}", GatewaySettings(), GatewayMetrics(), lambda _node: None)
    seen = []
    original = node.kv.apply

    def apply(events):
        original(events)
        seen.append(set(node.kv.models["llm"].hashes))
    node.kv.apply = apply
    task = asyncio.get_running_loop().create_task(node._watch_kv())
    try:
        for _ in range(6000):  # up to a minute: a busy machine may be slow to schedule the watch
            if seen and not node.kv.models:
                break
            await asyncio.sleep(0.01)
        assert seen and seen[0] == {1, 2}  # the snapshot was taken, then the garbage dropped it
        assert not node.kv.models and not node.kv.live
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await node.channel.close()
        await server.stop(0)
