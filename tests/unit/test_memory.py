"""MemoryManager: one budget and one LRU over every loaded model."""

from __future__ import annotations

import pytest

from modeld.backends.errors import ResourceExhausted
from modeld.server.memory import MemoryManager, ModelKey

MiB = 1024**2


def snapshot(mm: MemoryManager) -> list[tuple[str, int, bool, int]]:
    return [(k, mm.entry(k).nbytes, mm.entry(k).is_pinned, mm.entry(k).num_in_flight) for k in mm.keys_lru_first()]


def test_budget_arithmetic_used_and_free():
    mm = MemoryManager(1000)
    assert (mm.used, mm.free) == (0, 1000)
    mm.add("onnx/a", 300)
    mm.add("onnx/b", 200)
    assert (mm.used, mm.free) == (500, 500)
    mm.resize("onnx/a", 350)
    assert (mm.used, mm.free) == (550, 450)
    mm.remove("onnx/b")
    assert (mm.used, mm.free) == (350, 650)
    assert "onnx/b" not in mm and "onnx/a" in mm
    mm.remove("onnx/missing")  # removing an unknown key is a no-op
    assert mm.used == 350


def test_resize_may_pass_the_budget_and_free_goes_negative():
    mm = MemoryManager(100)
    mm.add("onnx/a", 50)
    mm.resize("onnx/a", 150)
    assert mm.used == 150
    assert mm.free == -50


def test_add_beyond_free_is_refused_with_a_helpful_message():
    mm = MemoryManager(100)
    mm.add("onnx/a", 60)
    with pytest.raises(ResourceExhausted) as info:
        mm.add("onnx/b", 41)
    assert "memory budget" in str(info.value) and "--memory-budget" in str(info.value)
    assert mm.keys_lru_first() == ["onnx/a"]
    mm.add("onnx/b", 40)  # exactly fits
    assert mm.free == 0


def test_plan_returns_nothing_when_it_already_fits():
    mm = MemoryManager(100)
    mm.add("onnx/a", 40)
    assert mm.plan(60) == []
    assert mm.plan(0) == []


def test_plan_returns_least_recently_used_first_and_only_what_is_needed():
    mm = MemoryManager(100)
    for key in ("onnx/a", "onnx/b", "onnx/c", "onnx/d"):
        mm.add(key, 25)
    assert mm.plan(10) == ["onnx/a"]
    assert mm.plan(25) == ["onnx/a"]
    assert mm.plan(26) == ["onnx/a", "onnx/b"]
    assert mm.plan(100) == ["onnx/a", "onnx/b", "onnx/c", "onnx/d"]
    # planning is read-only
    assert mm.keys_lru_first() == ["onnx/a", "onnx/b", "onnx/c", "onnx/d"]
    assert mm.used == 100


def test_touch_moves_to_most_recent():
    mm = MemoryManager(100)
    for key in ("onnx/a", "onnx/b", "onnx/c"):
        mm.add(key, 30)
    mm.touch("onnx/a")
    assert mm.keys_lru_first() == ["onnx/b", "onnx/c", "onnx/a"]
    assert mm.plan(41) == ["onnx/b", "onnx/c"]  # 10 free + b (30) is one byte short
    mm.touch("onnx/unknown")  # no-op, no KeyError
    assert mm.keys_lru_first() == ["onnx/b", "onnx/c", "onnx/a"]


def test_acquire_moves_to_most_recent_and_release_makes_it_evictable_again():
    mm = MemoryManager(100)
    for key in ("onnx/a", "onnx/b", "onnx/c"):
        mm.add(key, 30)
    mm.acquire("onnx/a")
    assert mm.keys_lru_first() == ["onnx/b", "onnx/c", "onnx/a"]
    assert mm.entry("onnx/a").num_in_flight == 1
    assert not mm.entry("onnx/a").is_evictable
    mm.release("onnx/a")
    assert mm.entry("onnx/a").num_in_flight == 0
    assert mm.entry("onnx/a").is_evictable
    # release does not change recency
    assert mm.keys_lru_first() == ["onnx/b", "onnx/c", "onnx/a"]
    mm.release("onnx/gone")  # releasing an evicted model is a no-op


def test_pinned_entries_are_never_planned():
    mm = MemoryManager(100)
    mm.add("onnx/pinned", 50, is_pinned=True)
    mm.add("onnx/b", 30)
    # the pinned one is least recently used but is skipped
    assert mm.plan(40) == ["onnx/b"]
    with pytest.raises(ResourceExhausted) as info:
        mm.plan(60)
    assert "onnx/pinned" in str(info.value)
    assert "pinned or busy" in str(info.value)


def test_entries_with_requests_in_flight_are_never_planned():
    mm = MemoryManager(100)
    mm.add("onnx/a", 40)
    mm.add("onnx/b", 40)
    mm.acquire("onnx/a")
    mm.acquire("onnx/a")
    mm.touch("onnx/b")  # b is now most recent, a is busy
    assert mm.keys_lru_first() == ["onnx/a", "onnx/b"]
    assert mm.plan(30) == ["onnx/b"]
    with pytest.raises(ResourceExhausted):
        mm.plan(70)
    mm.release("onnx/a")
    with pytest.raises(ResourceExhausted):
        mm.plan(70)  # still one request in flight
    mm.release("onnx/a")
    assert mm.plan(70) == ["onnx/a", "onnx/b"]


def test_excluded_keys_are_never_planned():
    mm = MemoryManager(100)
    mm.add("onnx/a", 50)
    mm.add("onnx/b", 50)
    assert mm.plan(10, exclude=frozenset({"onnx/a"})) == ["onnx/b"]
    with pytest.raises(ResourceExhausted):
        mm.plan(60, exclude=frozenset({"onnx/a"}))


def test_plan_that_cannot_fit_raises_and_changes_nothing():
    mm = MemoryManager(100)
    mm.add("onnx/a", 30)
    mm.add("onnx/b", 30, is_pinned=True)
    mm.add("onnx/c", 30)
    mm.acquire("onnx/c")
    before = snapshot(mm)
    with pytest.raises(ResourceExhausted) as info:
        mm.plan(80)  # only a (30) is evictable: 10 free + 30 < 80
    message = str(info.value)
    assert "80B" in message and "100B" in message  # needed and budget
    assert "onnx/b" in message and "onnx/c" in message
    assert snapshot(mm) == before
    assert mm.used == 90


def test_plan_larger_than_whole_budget_raises():
    mm = MemoryManager(100)
    with pytest.raises(ResourceExhausted):
        mm.plan(101)
    assert mm.keys_lru_first() == []


def test_eviction_sequence_two_model_budget():
    """Budget for two models; add A, B; touch A, B, A; a plan for C evicts B."""
    mm = MemoryManager(200 * MiB)
    mm.add("onnx/A", 100 * MiB)
    mm.add("onnx/B", 100 * MiB)
    mm.touch("onnx/A")
    mm.touch("onnx/B")
    mm.touch("onnx/A")
    assert mm.keys_lru_first() == ["onnx/B", "onnx/A"]
    victims = mm.plan(100 * MiB)
    assert victims == ["onnx/B"]
    # carrying out the plan makes room for C
    for key in victims:
        mm.remove(key)
    mm.add("onnx/C", 100 * MiB)
    assert mm.keys_lru_first() == ["onnx/A", "onnx/C"]
    assert mm.free == 0


def test_the_daemon_s_own_share_counts_in_used_and_in_what_a_load_may_take():
    mm = MemoryManager(budget=1000)
    mm.daemon_bytes = 300
    mm.add(ModelKey("onnx", "a"), 400)
    assert mm.used == 700 and mm.models_used == 400 and mm.free == 300
    # 500 more fits only by evicting a: the daemon's 300 is never a victim
    assert mm.plan(500) == [ModelKey("onnx", "a")]
    with pytest.raises(ResourceExhausted) as info:
        mm.plan(800)
    assert "the daemon itself holds 300" in str(info.value)
