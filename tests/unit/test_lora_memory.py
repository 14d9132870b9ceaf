"""The memory budget with LoRA adapters: an adapter's entry is tied to its
base's (pure bookkeeping, no model)."""

from __future__ import annotations

import pytest

from modeld.backends.errors import ResourceExhausted
from modeld.server.memory import MemoryManager, ModelKey

BASE, OTHER = ModelKey("torch", "base"), ModelKey("onnx", "other")
SQL, CHAT = ModelKey("torch", "sql"), ModelKey("torch", "chat")


def _books() -> MemoryManager:
    memory = MemoryManager(budget=1000)
    memory.add(BASE, 500)
    memory.add(SQL, 20, base=BASE)
    memory.add(CHAT, 30, base=BASE)
    memory.add(OTHER, 400)
    return memory


def test_choosing_the_base_chooses_its_adapters_first_and_counts_their_bytes():
    memory = _books()
    # 50 free; 540 needed: the base (the least recent) frees 500 + its adapters' 50
    assert memory.plan(540) == [SQL, CHAT, BASE]


def test_an_adapter_with_work_in_flight_keeps_its_base_and_is_itself_kept():
    memory = _books()
    memory.acquire(SQL)
    # sql's request made it and its base the most recent; the base cannot go while sql has work,
    # and the idle adapter can
    assert memory.plan(470) == [CHAT, OTHER]
    with pytest.raises(ResourceExhausted):
        memory.plan(600)  # only the base could make that much room, and it is busy through sql
    memory.release(SQL)
    assert memory.plan(600) == [CHAT, OTHER, SQL, BASE]  # the base's adapters just before it


def test_an_adapters_request_makes_its_base_recent():
    memory = _books()
    memory.acquire(CHAT)
    memory.release(CHAT)
    # base and chat are now the most recent: the idle sql adapter and the other model go first
    assert memory.plan(100) == [SQL, OTHER]
    assert memory.adapters_of(BASE) == [SQL, CHAT]


def test_a_pinned_adapter_pins_its_base():
    memory = MemoryManager(budget=1000)
    memory.add(BASE, 500)
    memory.add(SQL, 20, is_pinned=True, base=BASE)
    with pytest.raises(ResourceExhausted):
        memory.plan(600)
