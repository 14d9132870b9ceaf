"""HashRing: the model ring's determinism, replica sets, and how little moves
when the fleet changes."""

from __future__ import annotations

import random

import pytest
import xxhash

from modeld.server.gateway import ring as ring_module
from modeld.server.gateway.ring import HashRing

KEYS = [f"model-{i}" for i in range(2000)]


def ring_of(nodes: list[str], vnodes: int = 150) -> HashRing:
    ring = HashRing(vnodes)
    for node in nodes:
        ring.add(node)
    return ring


def names(n: int) -> list[str]:
    return [f"node-{i}" for i in range(n)]


def test_the_ring_depends_only_on_its_nodes_not_on_their_order():
    forward = ring_of(names(12))
    backward = ring_of(list(reversed(names(12))))
    assert all(list(forward.walk(k)) == list(backward.walk(k)) for k in KEYS)


def test_colliding_points_are_ordered_by_node_whatever_the_join_order(monkeypatch):
    # 64-bit collisions never happen by chance; a 5-bit hash makes them common
    monkeypatch.setattr(ring_module, "ring_hash", lambda text: xxhash.xxh64_intdigest(text.encode()) % 32)
    shuffled = names(6)
    random.Random(0).shuffle(shuffled)
    rings = [ring_of(names(6), vnodes=20), ring_of(list(reversed(names(6))), vnodes=20), ring_of(shuffled, vnodes=20)]
    assert all(len({tuple(r.walk(k)) for r in rings}) == 1 for k in KEYS[:300])
    for r in rings:
        r.remove("node-2")
    assert all(len({tuple(r.walk(k)) for r in rings}) == 1 for k in KEYS[:300])


def test_the_same_key_gets_the_same_replicas_every_time():
    ring = ring_of(names(8))
    assert [ring.replicas(k, 3) for k in KEYS[:100]] == [ring.replicas(k, 3) for k in KEYS[:100]]


def test_keys_spread_over_the_nodes():
    ring = ring_of(names(8))
    primaries = {ring.replicas(k, 1)[0] for k in KEYS}
    assert primaries == set(names(8))


def test_walk_gives_every_node_exactly_once():
    ring = ring_of(names(10))
    for key in KEYS[:200]:
        walked = list(ring.walk(key))
        assert sorted(walked) == sorted(names(10))


def test_replicas_are_distinct_and_a_prefix_of_the_walk():
    ring = ring_of(names(10))
    for key in KEYS[:200]:
        replicas = ring.replicas(key, 3)
        assert len(set(replicas)) == 3
        assert replicas == list(ring.walk(key))[:3]


def test_replicas_with_fewer_nodes_than_asked():
    ring = ring_of(names(2))
    assert sorted(ring.replicas("m", 5)) == names(2)
    assert ring.replicas("m", 0) == []
    assert HashRing().replicas("m", 3) == []
    assert list(HashRing().walk("m")) == []


def test_add_and_remove_are_idempotent_and_remove_restores_the_ring():
    ring = ring_of(names(5))
    before = [list(ring.walk(k)) for k in KEYS[:300]]
    ring.add("node-0")
    ring.add("extra")
    ring.add("extra")
    assert ring.nodes == frozenset(names(5)) | {"extra"}
    assert len(ring) == 6 and "extra" in ring
    ring.remove("extra")
    ring.remove("extra")
    ring.remove("never-added")
    assert ring.nodes == frozenset(names(5))
    assert [list(ring.walk(k)) for k in KEYS[:300]] == before


def test_a_joining_node_only_inserts_itself_into_each_walk():
    # the consistency property: with the newcomer taken out, every key's walk
    # is exactly what it was, so no replica set changes except by the newcomer
    ring = ring_of(names(10))
    before = {k: list(ring.walk(k)) for k in KEYS}
    ring.add("newcomer")
    for key in KEYS:
        after = list(ring.walk(key))
        assert [n for n in after if n != "newcomer"] == before[key]


def test_replicas_are_stable_when_an_unrelated_node_joins():
    ring = ring_of(names(10))
    before = {k: ring.replicas(k, 2) for k in KEYS}
    ring.add("newcomer")
    unrelated = [k for k in KEYS if "newcomer" not in ring.replicas(k, 2)]
    assert len(unrelated) > len(KEYS) * 0.7
    assert all(ring.replicas(k, 2) == before[k] for k in unrelated)


def test_a_join_moves_about_one_key_in_n_and_only_to_the_newcomer():
    ring = ring_of(names(20))
    before = {k: ring.replicas(k, 1)[0] for k in KEYS}
    ring.add("node-20")
    moved = [k for k in KEYS if ring.replicas(k, 1)[0] != before[k]]
    assert 0.5 / 21 <= len(moved) / len(KEYS) <= 2 / 21
    assert all(ring.replicas(k, 1)[0] == "node-20" for k in moved)


def test_a_walk_in_progress_is_not_disturbed_by_a_change():
    ring = ring_of(names(6))
    walk = ring.walk("m")
    first = next(walk)
    ring.add("late")
    ring.remove(first)
    assert sorted([first, *walk]) == names(6)


def test_invalid_vnodes():
    with pytest.raises(ValueError, match="vnodes"):
        HashRing(0)
