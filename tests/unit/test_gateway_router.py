"""The gateway's Router over real Node objects (no daemons behind them):
which nodes a call may go to as their health, probes and breakers change."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from modeld.server.gateway.config import GatewaySettings
from modeld.server.gateway.metrics import GatewayMetrics
from modeld.server.gateway.nodes import Fleet, Node
from modeld.server.gateway.failure import CallFailed
from modeld.server.gateway.router import Router

ADDRESSES = tuple(f"127.0.0.1:{9100 + i}" for i in range(3))


@pytest.fixture
async def router():
    settings = GatewaySettings(nodes=ADDRESSES)
    metrics = GatewayMetrics()
    fleet = Fleet(settings, metrics)
    for address in ADDRESSES:  # as if each had said SERVING; no watch tasks run
        node = Node(address, settings, metrics, fleet._changed)
        node.serving = node.ever_served = True
        fleet.by_address[address] = node
    fleet._rebuild()
    yield Router(fleet, settings, metrics, rng=random.Random(0))
    await fleet.close()


async def test_calls_stay_on_the_model_s_homes(router):
    homes = set(router.fleet.ring.replicas("minilm", 2))
    picked = {router.place("minilm")[0].name for _ in range(50)}
    assert picked == homes  # both homes share the work; the third node gets none


async def test_a_node_that_missed_its_probe_is_skipped_while_others_answer(router):
    first, second = router.fleet.ring.replicas("minilm", 2)
    router.fleet.by_name[first].responsive = False
    assert {router.place("minilm")[0].name for _ in range(30)} == {second}


async def test_when_every_node_is_slow_to_answer_calls_still_go_somewhere(router):
    for node in router.fleet.nodes():
        node.responsive = False
    node, _ = router.place("minilm")
    assert node.name in router.fleet.ring.replicas("minilm", 2)


async def test_no_usable_node_is_unavailable_with_each_node_s_state(router):
    for node in router.fleet.nodes():
        node.breaker.trip()
    with pytest.raises(CallFailed) as err:
        router.place("minilm")
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert all(a in err.value.details for a in ADDRESSES) and "breaker open" in err.value.details


async def test_a_node_that_restarts_loses_its_prefixes(router):
    node, _ = router.place("smollm2", key="x" * 256)
    router.remember_prompt(node.name, "x" * 256)
    assert router.prefixes.match("x" * 256).get(node.name) == 256
    node._set_serving(False, "test")
    assert node.name not in router.prefixes.match("x" * 256)


class _Context:
    """The little of grpc.aio.ServicerContext that GatewayService reads."""

    def invocation_metadata(self):
        return ()

    def time_remaining(self):
        return None


async def test_a_load_goes_to_a_replica_that_is_only_late_with_its_stats(router):
    from modeld.gen import inference_pb2
    from modeld.server.gateway.service import GatewayService

    service = GatewayService(router.fleet, router, router.fleet.settings, router.metrics)
    first, second = router.fleet.ring.replicas("minilm", 2)
    router.fleet.by_name[first].responsive = False   # busy, say loading another model
    called = []

    async def fake_call(node, method, data, opts, model="", context=None, admitted=True):
        called.append((node.name, admitted))
        return b""

    service._call = fake_call
    load = service.to_replicas("RepositoryModelLoad")
    await load(inference_pb2.RepositoryModelLoadRequest(model_name="minilm").SerializeToString(), _Context())
    assert sorted(called) == sorted([(first, False), (second, False)])
    router.fleet.by_name[first].breaker.trip()      # frozen: its breaker opened
    called.clear()
    await load(inference_pb2.RepositoryModelLoadRequest(model_name="minilm").SerializeToString(), _Context())
    assert called == [(second, False)]


async def test_a_late_stats_answer_moves_routed_calls_but_leaves_fanouts_until_the_breaker_opens(router):
    node = router.fleet.by_name[router.fleet.ring.replicas("minilm", 2)[0]]
    routed = asyncio.create_task(asyncio.sleep(3600))
    fanout = asyncio.create_task(asyncio.sleep(3600))
    node.calls.add(routed)
    node.fanouts.add(fanout)
    node._abandon_calls()        # what a Stats poll past its deadline does
    await asyncio.sleep(0)
    assert routed.cancelled() and not fanout.done()
    node.breaker.trip()
    await asyncio.sleep(0)
    assert fanout.cancelled()


def _publish(node, model: str, hashes) -> None:
    from modeld.gen import node_pb2

    node.kv.apply(node_pb2.KvEvents(snapshot=True, models=[
        node_pb2.ModelKvEvents(model=model, block_size=16, stored=list(hashes))]))


async def test_a_prompt_goes_where_its_blocks_are_and_the_pick_says_kv(router):
    from modeld.server.gateway.kv_index import PromptBlocks

    homes = router.fleet.ring.replicas("llm", 2)
    for name in homes:
        _publish(router.fleet.by_name[name], "llm", [])
    _publish(router.fleet.by_name[homes[1]], "llm", [11, 12, 13])
    prompt = PromptBlocks("llm", 16, (11, 12, 13, 14))
    picks = {router.place("llm", kv=prompt, key="some text") for _ in range(20)}
    assert {(node.name, reason) for node, reason in picks} == {(homes[1], "kv")}


async def test_with_no_live_kv_stream_the_text_guess_routes(router):
    from modeld.server.gateway.kv_index import PromptBlocks

    homes = router.fleet.ring.replicas("llm", 2)
    _publish(router.fleet.by_name[homes[1]], "llm", [11])
    router.fleet.by_name[homes[1]].kv.clear()  # its stream ended (or sent garbage)
    router.remember_prompt(homes[0], "x" * 256)
    node, reason = router.place("llm", kv=PromptBlocks("llm", 16, (11,)), key="x" * 256)
    assert (node.name, reason) == (homes[0], "prefix")


async def test_a_route_counts_its_prompt_blocks_active_until_it_finishes(router):
    from modeld.server.gateway.call_options import CallOptions
    from modeld.server.gateway.kv_index import PromptBlocks

    class _Context:
        def invocation_metadata(self):
            return ()

        def time_remaining(self):
            return None

    homes = router.fleet.ring.replicas("llm", 2)
    for name in homes:
        _publish(router.fleet.by_name[name], "llm", [])
    route = router.route("/modeld.v1.Generation/Generate", "llm", CallOptions(_Context()),
                         kv=PromptBlocks("llm", 16, (1, 2, 3)))
    assert route.node.kv_active_blocks == 3
    route.finish()
    assert route.node.kv_active_blocks == 0


async def test_a_holder_with_a_call_in_flight_keeps_the_prompt_over_a_cold_replica(router):
    # with Dynamo's weight 1, N prompt blocks held were outweighed by one
    # call's N active blocks; a prefill block weighs more (OVERLAP_WEIGHT)
    from modeld.server.gateway.kv_index import PromptBlocks

    homes = router.fleet.ring.replicas("llm", 2)
    blocks = tuple(range(100, 125))
    for name in homes:
        _publish(router.fleet.by_name[name], "llm", [])
    holder = router.fleet.by_name[homes[0]]
    _publish(holder, "llm", blocks[:-1])
    holder.kv_active_blocks = len(blocks)  # one call of the same size running there
    assert router.place("llm", kv=PromptBlocks("llm", 16, blocks))[0] is holder


def _stats(*models):
    from modeld.gen import node_pb2

    return node_pb2.NodeStats(models=[node_pb2.ModelLoad(name=n, state=s, base=b) for n, s, b in models])


def _adapter_whose_homes_differ(router, base: str) -> str:
    """An adapter name whose own ring homes are not its base's: otherwise a
    router hashing the adapter's own name would pass by luck."""
    base_homes = set(router.fleet.ring.replicas(base, 2))
    return next(name for name in (f"{base}-adapter-{i}" for i in range(100))
                if set(router.fleet.ring.replicas(name, 2)) != base_homes)


async def test_an_adapter_goes_to_its_base_s_homes_before_any_node_loaded_it(router):
    adapter = _adapter_whose_homes_differ(router, "smollm2-torch")
    for node in router.fleet.nodes():  # every repository lists it, none has it loaded
        node._take_stats(_stats(("smollm2-torch", "UNAVAILABLE", ""), (adapter, "UNAVAILABLE", "smollm2-torch")))
    assert router.fleet.ring_key(adapter) == "smollm2-torch"
    homes = set(router.fleet.ring.replicas("smollm2-torch", 2))
    assert {router.place(adapter)[0].name for _ in range(50)} == homes
    assert set(router.fleet.replicas(adapter, 2)) == homes  # loads and unloads fan out there too


async def test_an_adapter_goes_where_its_base_is_resident(router):
    adapter = _adapter_whose_homes_differ(router, "smollm2-torch")
    first, second = router.fleet.ring.replicas("smollm2-torch", 2)
    for node in router.fleet.nodes():
        state = "READY" if node.name == second else "UNAVAILABLE"
        node._take_stats(_stats(("smollm2-torch", state, ""), (adapter, "UNAVAILABLE", "smollm2-torch")))
    assert {router.place(adapter)[0].name for _ in range(30)} == {second}


def test_nodes_that_disagree_on_a_base_settle_on_the_one_most_name():
    from types import SimpleNamespace

    from modeld.server.gateway.nodes import _fleet_bases

    nodes = [SimpleNamespace(bases={"sql": "b2"}), SimpleNamespace(bases={"sql": "b1", "chat": "b1"}),
             SimpleNamespace(bases={"sql": "b2"}), SimpleNamespace(bases={})]
    assert _fleet_bases(nodes) == {"sql": "b2", "chat": "b1"}
    assert _fleet_bases([SimpleNamespace(bases={"x": "z"}), SimpleNamespace(bases={"x": "a"})]) == {"x": "a"}
