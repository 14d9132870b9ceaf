"""Placement: power of two choices, the load bound, and place()'s cases."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable

import pytest

from modeld.server.gateway.balance import Pick, PickReason, capacity, p2c, place, place_update
from modeld.server.gateway.ring import HashRing

NODES = [f"node-{i}" for i in range(10)]
KEY = "llama-3-8b"


@pytest.fixture
def ring() -> HashRing:
    ring = HashRing()
    for node in NODES:
        ring.add(node)
    return ring


class Fleet:
    """What the gateway would know about each node, as plain tables."""

    def __init__(self) -> None:
        self.broken: set[str] = set()
        self.loads: dict[str, float] = {}
        self.scores: dict[str, float] = {}
        self.resident: set[str] = set()
        self.asked: Counter[str] = Counter()

    def admitted(self, node: str) -> bool:
        self.asked[node] += 1
        return node not in self.broken

    def load(self, node: str) -> float:
        return self.loads.get(node, 0.0)

    def score(self, node: str) -> float:
        return self.scores.get(node, 1.0)

    def loaded(self, node: str) -> bool:
        return node in self.resident

    def place(self, ring: HashRing, k: int = 2, seed: int = 0, **kwargs) -> Pick | None:
        return place(
            KEY, ring, k, admitted=self.admitted, load=self.load, score=self.score, rng=random.Random(seed), **kwargs
        )

    def place_update(self, nodes: Iterable[str], rng: random.Random) -> Pick | None:
        return place_update(nodes, admitted=self.admitted, load=self.load, score=self.score, rng=rng)


def test_capacity_is_the_bounded_share_of_the_load_including_this_call():
    assert capacity(9, 4) == 4  # ceil(1.25 * 10 / 4) = ceil(3.125)
    assert capacity(0, 10) == 1  # an idle fleet still has room for one
    assert capacity(7, 10) == 1  # 1.25 * 8 / 10 is exactly 1
    assert capacity(9, 11, bound=1.1) == 1  # 1.1 * 10 / 11 is 1.0000000000000002 in floats


def test_capacity_refuses_nonsense():
    with pytest.raises(ValueError):
        capacity(5, 0)
    with pytest.raises(ValueError):
        capacity(5, 3, bound=0.9)


def test_p2c_with_one_candidate_returns_it():
    assert p2c(["a"], lambda n: 100, lambda n: 0.01, random.Random(0)) == "a"
    with pytest.raises(ValueError):
        p2c([], lambda n: 0, lambda n: 1, random.Random(0))


def test_p2c_between_two_takes_the_less_loaded():
    loads = {"a": 5, "b": 1}
    picks = {p2c(["a", "b"], loads.__getitem__, lambda n: 1.0, random.Random(s)) for s in range(50)}
    assert picks == {"b"}


def test_p2c_weighs_load_by_score():
    # a: (1 + 1) / 0.25 = 8, b: (2 + 1) / 1 = 3
    loads, scores = {"a": 1, "b": 2}, {"a": 0.25, "b": 1.0}
    picks = {p2c(["a", "b"], loads.__getitem__, scores.__getitem__, random.Random(s)) for s in range(50)}
    assert picks == {"b"}


def test_p2c_prefers_the_less_loaded_and_never_the_most_loaded():
    candidates = [f"n{i}" for i in range(10)]
    rng = random.Random(1)
    picks = Counter(p2c(candidates, lambda n: int(n[1:]), lambda n: 1.0, rng) for _ in range(5000))
    mean_load = sum(int(n[1:]) * count for n, count in picks.items()) / 5000
    assert mean_load < 3.5  # uniform choice would give 4.5; p2c gives 3
    assert picks["n9"] == 0  # it loses every duel it is drawn into
    assert picks["n0"] > picks["n5"]


def test_p2c_rarely_duels_a_low_score_node():
    candidates = ["a", "b", "weak"]
    scores = {"a": 1.0, "b": 1.0, "weak": 0.02}
    rng = random.Random(2)
    # the weak node is idle, so it wins every duel it is in: its share shows how often it is drawn
    picks = Counter(p2c(candidates, lambda n: 0 if n == "weak" else 3, scores.__getitem__, rng) for _ in range(4000))
    assert picks["weak"] < 4000 * 0.1


def test_p2c_splits_equal_loads_in_proportion_to_score():
    rng = random.Random(4)
    picks = Counter(p2c(["a", "b"], lambda n: 0, {"a": 0.5, "b": 1.0}.__getitem__, rng) for _ in range(3000))
    assert 850 < picks["a"] < 1150  # a third: a recovering node still gets its share


def test_p2c_ties_are_split_evenly():
    rng = random.Random(3)
    picks = Counter(p2c(["a", "b"], lambda n: 1, lambda n: 1.0, rng) for _ in range(2000))
    assert 800 < picks["a"] < 1200


def test_the_only_good_replica_is_a_ring_pick(ring):
    fleet = Fleet()
    first, second = ring.replicas(KEY, 2)
    fleet.broken.add(first)  # its breaker is open
    assert fleet.place(ring) == Pick(second, PickReason.RING)
    assert fleet.place(ring, k=1).reason is PickReason.SPILL


def test_a_low_score_replica_is_skipped(ring):
    fleet = Fleet()
    first, second = ring.replicas(KEY, 2)
    fleet.scores[second] = 0.15
    assert fleet.place(ring) == Pick(first, PickReason.RING)
    fleet.scores[second] = 0.25  # above min_score: back in the running
    assert fleet.place(ring).reason is PickReason.P2C


def test_two_good_replicas_go_to_the_less_loaded(ring):
    fleet = Fleet()
    first, second = ring.replicas(KEY, 2)
    fleet.loads = {n: 3 for n in NODES}
    fleet.loads[second] = 0
    for seed in range(20):
        assert fleet.place(ring, seed=seed) == Pick(second, PickReason.P2C)


def test_full_replicas_spill_along_the_ring(ring):
    fleet = Fleet()
    walk = list(ring.walk(KEY))
    fleet.loads = {walk[0]: 10, walk[1]: 10}  # capacity: ceil(1.25 * 21 / 10) = 3
    assert fleet.place(ring) == Pick(walk[2], PickReason.SPILL)
    fleet.broken.add(walk[2])
    fleet.scores[walk[3]] = 0.1
    assert fleet.place(ring) == Pick(walk[4], PickReason.SPILL)


def test_when_no_good_node_has_room_the_call_stays_on_its_replicas(ring):
    fleet = Fleet()
    first, second = ring.replicas(KEY, 2)
    fleet.loads = {first: 10, second: 12}
    fleet.scores = {n: 0.1 for n in NODES if n not in (first, second)}  # idle but unhealthy
    assert fleet.place(ring) == Pick(first, PickReason.P2C)


def test_with_no_good_replica_the_call_spills_to_the_next_good_node(ring):
    fleet = Fleet()
    walk = list(ring.walk(KEY))
    fleet.broken = {walk[0]}
    fleet.scores = {walk[1]: 0.1, walk[2]: 0.05}
    assert fleet.place(ring) == Pick(walk[3], PickReason.SPILL)


def test_with_no_good_node_at_all_the_first_admitted_one_takes_it(ring):
    fleet = Fleet()
    walk = list(ring.walk(KEY))
    fleet.broken = {walk[0], walk[2]}
    fleet.scores = {n: 0.1 for n in NODES}
    assert fleet.place(ring) == Pick(walk[1], PickReason.SPILL)


def test_no_admitted_node_means_no_pick(ring):
    fleet = Fleet()
    fleet.broken = set(NODES)
    assert fleet.place(ring) is None
    assert fleet.place(HashRing()) is None


def test_residency_beats_load_within_the_bound(ring):
    fleet = Fleet()
    first, second = ring.replicas(KEY, 2)
    fleet.loads = {n: 2 for n in NODES}
    fleet.loads[first] = 0
    fleet.resident = {second}  # busier, but the model is already there
    assert fleet.place(ring, loaded=fleet.loaded) == Pick(second, PickReason.RING)
    fleet.loads[second] = 4  # capacity ceil(1.25 * 23 / 10) = 3: over the bound, within twice it
    assert fleet.place(ring, loaded=fleet.loaded) == Pick(second, PickReason.RING)
    fleet.loads[second] = 5  # capacity ceil(1.25 * 22 / 10) = 3, twice that 6: still resident
    assert fleet.place(ring, loaded=fleet.loaded) == Pick(second, PickReason.RING)
    fleet.loads[second] = 9  # capacity ceil(1.25 * 26 / 10) = 4, twice 8: past it, the other home loads it
    assert fleet.place(ring, loaded=fleet.loaded) == Pick(first, PickReason.RING)


def test_the_longest_prefix_wins_within_the_bound(ring):
    fleet = Fleet()
    first, second = ring.replicas(KEY, 2)
    fleet.loads = {n: 3 for n in NODES}
    fleet.loads[first] = 0  # capacity ceil(1.25 * 28 / 10) = 4: the busier one still has room
    prefix = {first: 64, second: 192, "node-elsewhere": 640}
    assert fleet.place(ring, prefix=prefix) == Pick(second, PickReason.PREFIX)
    fleet.loads = {second: 10}  # full: the warm cache is not worth the overload
    assert fleet.place(ring, prefix=prefix) == Pick(first, PickReason.PREFIX)
    assert fleet.place(ring, prefix={second: 192}) == Pick(first, PickReason.RING)
    assert fleet.place(ring, prefix={}).reason is PickReason.RING


def test_a_prefix_shared_by_both_replicas_is_spread(ring):
    fleet = Fleet()
    first, second = ring.replicas(KEY, 2)
    prefix = {first: 128, second: 128}
    picks = Counter(fleet.place(ring, seed=s, prefix=prefix) for s in range(200))
    assert set(picks) == {Pick(first, PickReason.PREFIX), Pick(second, PickReason.PREFIX)}


def test_residency_comes_before_the_prefix(ring):
    fleet = Fleet()
    first, second = ring.replicas(KEY, 2)
    fleet.resident = {first}
    assert fleet.place(ring, loaded=fleet.loaded, prefix={second: 640}) == Pick(first, PickReason.RING)


def test_each_node_is_asked_once_per_placement(ring):
    fleet = Fleet()
    walk = list(ring.walk(KEY))
    fleet.broken = {walk[0], walk[1]}
    fleet.loads = {n: 5 for n in walk[2:6]}
    fleet.place(ring)
    assert set(fleet.asked) == set(NODES) and set(fleet.asked.values()) == {1}


def test_k_beyond_the_fleet_uses_every_node(ring):
    fleet = Fleet()
    picks = {fleet.place(ring, k=50, seed=s).node for s in range(200)}
    assert picks == set(NODES)


def test_placement_is_deterministic_for_a_seed(ring):
    fleet = Fleet()
    fleet.loads = {n: i % 3 for i, n in enumerate(NODES)}
    assert [fleet.place(ring, k=3, seed=s) for s in range(30)] == [fleet.place(ring, k=3, seed=s) for s in range(30)]


def test_update_traffic_goes_anywhere_good_and_prefers_the_idle():
    fleet = Fleet()
    fleet.loads = {n: 5 for n in NODES}
    fleet.loads["node-7"] = 0
    fleet.broken = {"node-3"}
    rng = random.Random(4)
    picks = Counter(fleet.place_update(set(NODES), rng) for _ in range(500))
    assert all(p.reason is PickReason.UPDATE for p in picks)
    nodes = Counter(p.node for p in picks.elements())
    assert "node-3" not in nodes
    assert nodes.most_common(1)[0][0] == "node-7"
    assert len(nodes) == 9  # all the admitted ones get some


def test_update_traffic_avoids_low_scores_unless_there_is_nothing_else():
    fleet = Fleet()
    fleet.scores = {"a": 0.1, "b": 0.9}
    assert fleet.place_update(["a", "b"], random.Random(0)) == Pick("b", PickReason.UPDATE)
    fleet.broken = {"b"}
    assert fleet.place_update(["a", "b"], random.Random(0)) == Pick("a", PickReason.UPDATE)
    fleet.broken = {"a", "b"}
    assert fleet.place_update(["a", "b"], random.Random(0)) is None
