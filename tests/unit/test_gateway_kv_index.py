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
from modeld.server.gateway.kv_index import PENDING_GRACE_S, KvEventError, NodeKvIndex, PromptBlocks
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


def test_a_model_loaded_with_an_empty_cache_is_known_to_the_gateway_until_unloaded():
    watch, index = KvWatch(), NodeKvIndex()
    index.apply(watch.message({}))  # the snapshot: nothing loaded yet
    loaded = watch.message({"llm": _view(set())})
    assert not loaded.snapshot and not loaded.models[0].cleared and not loaded.models[0].stored
    index.apply(loaded)
    assert "llm" in index.models and index.num_blocks("llm") == 0  # routed on blocks from its first prompt
    index.apply(watch.message({"llm": _view({4})}))
    reloaded = watch.message({"llm": _view(set(), identity=2)})  # a new, empty cache
    assert reloaded.models[0].cleared and not reloaded.models[1].cleared
    index.apply(reloaded)
    assert "llm" in index.models and index.num_blocks("llm") == 0
    index.apply(watch.message({}))
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


def test_a_prompt_no_replica_holds_half_of_goes_to_the_emptiest_cache_whatever_its_first_block():
    ring = HashRing(150)
    for name in ("a", "b", "c"):
        ring.add(name)
    fuller, emptier = ring.replicas("llm", 2)
    held = {fuller: 40, emptier: 0}
    # the fuller one holds the prompt's first block (a header every prompt shares): a new prefix all the same
    kv = KvRequest({fuller: 1}, 12, lambda n: 0, held_blocks=lambda n: held[n])
    assert {_place(ring, kv).node for _ in range(20)} == {emptier}
    # half of it or more held there: its least KV cost
    kv = KvRequest({fuller: 6}, 12, lambda n: 0, held_blocks=lambda n: held[n])
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


def test_a_prompt_sent_to_a_node_counts_as_held_there_until_shortly_after_its_call_ends():
    now = [100.0]
    index = NodeKvIndex(clock=lambda: now[0])
    index.apply(_events(0, _model([1]), snapshot=True))
    prompt = PromptBlocks("llm", 16, (1, 2, 3))
    assert index.overlap(prompt) == 1
    index.expect(prompt)
    index.expect(PromptBlocks("llm", 16, (1, 2, 7)))  # a second call sharing blocks 1 and 2
    assert index.overlap(prompt) == 3 and index.num_blocks("llm") == 4
    assert index.overlap(PromptBlocks("other", 16, (1, 2, 3))) == 0  # another model's blocks
    assert index.overlap(PromptBlocks("llm", 32, (2,))) == 0  # another block size
    index.settle(prompt)
    now[0] += PENDING_GRACE_S / 2
    assert index.overlap(prompt) == 3  # the node's events may not have told yet
    now[0] += PENDING_GRACE_S
    # past the grace only what the events say, and what the running call holds
    assert index.overlap(prompt) == 2 and index.num_blocks("llm") == 3
    index.settle(PromptBlocks("llm", 16, (1, 2, 7)))
    index.clear()  # the stream ended: the node's cache is gone, and what was sent there with it
    index.apply(_events(0, _model([]), snapshot=True))
    assert index.overlap(prompt) == 0 and not index.pending


@pytest.fixture
async def router():
    from modeld.server.gateway.nodes import Fleet
    from modeld.server.gateway.router import Router

    addresses = tuple(f"127.0.0.1:{9200 + i}" for i in range(3))
    settings, metrics = GatewaySettings(nodes=addresses, replicas=3), GatewayMetrics()
    fleet = Fleet(settings, metrics)
    for address in addresses:  # as if each had said SERVING and sent an empty snapshot; no tasks run
        node = Node(address, settings, metrics, fleet._changed)
        node.serving = node.ever_served = True
        node.kv.apply(_events(0, _model([]), snapshot=True))
        fleet.by_address[address] = node
    fleet._rebuild()
    yield Router(fleet, settings, metrics, rng=random.Random(0))
    await fleet.close()


class _Context:
    def invocation_metadata(self):
        return ()

    def time_remaining(self):
        return None


async def test_conversations_on_a_new_system_prompt_follow_the_first_before_its_blocks_are_reported(router):
    """Before any node's events show a new system prompt's blocks (its
    first call still prefilling), the next conversations on it go where
    the first went, not to a node holding none, which would split the
    prompt's conversations over two caches; a prompt on another system
    prompt starts elsewhere."""
    from modeld.server.gateway.call_options import CallOptions

    system = tuple(range(1000, 1020))
    routes = [router.route("/modeld.v1.Generation/Generate", "llm", CallOptions(_Context()),
                           kv=PromptBlocks("llm", 16, system + (i,))) for i in range(3)]
    assert len({r.node.name for r in routes}) == 1, [r.node.name for r in routes]
    other = router.route("/modeld.v1.Generation/Generate", "llm", CallOptions(_Context()),
                         kv=PromptBlocks("llm", 16, tuple(range(2000, 2020))))
    assert other.node is not routes[0].node
    for route in (*routes, other):
        route.finish()
