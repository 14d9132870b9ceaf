"""KV slots (llama.cpp sequence ids) and the prefix cache over them.

A slot is free, active (a running sequence) or cached (a finished
sequence's KV kept for reuse, in LRU order). Admission looks for the slot
whose tokens share the longest prefix with the new prompt: a cached slot is
taken over in place; an active one is copied. Pure bookkeeping; the KV
operations it decides are returned as plain data for the executor.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum
from typing import Protocol


class SlotUser(Protocol):
    token_ids: list[int]
    num_computed: int


class KvOpKind(Enum):
    CLEAR = "clear"  # drop every cell of `slot`
    TRIM = "trim"  # drop cells of `slot` from position `pos` on
    COPY = "copy"  # share positions [0, pos) of `src` into `slot`


@dataclass(frozen=True)
class KvOp:
    kind: KvOpKind
    slot: int
    pos: int = 0
    src: int | None = None  # COPY's source slot


@dataclass(frozen=True)
class SlotGrant:
    slot: int
    num_reused: int  # prompt tokens whose KV is already there
    ops: tuple[KvOp, ...]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class SlotPool:
    def __init__(self, num_slots: int) -> None:
        self.free: list[int] = list(range(num_slots - 1, -1, -1))
        self.cached: OrderedDict[int, list[int]] = OrderedDict()  # LRU first
        self.active: dict[int, SlotUser] = {}  # slot -> the running sequence in it

    @property
    def num_cached_cells(self) -> int:
        return sum(len(t) for t in self.cached.values())

    def can_grant(self) -> bool:
        return bool(self.free or self.cached)

    def grant(self, prompt: list[int], user: SlotUser, use_cache: bool) -> SlotGrant:
        """A slot for a new sequence, reusing the longest cached prefix."""
        best_slot, best_len, best_cached = -1, 0, False
        if use_cache:
            # at least one prompt token must be fed to get logits
            limit = len(prompt) - 1
            for slot, cached_tokens in self.cached.items():
                n = min(common_prefix(cached_tokens, prompt), limit)
                if n > best_len:
                    best_slot, best_len, best_cached = slot, n, True
            for slot, other in self.active.items():
                # only tokens whose KV is already computed can be shared
                n = min(common_prefix(other.token_ids[:other.num_computed], prompt), limit)
                if n > best_len:
                    best_slot, best_len, best_cached = slot, n, False
        if best_cached:
            del self.cached[best_slot]
            self.active[best_slot] = user
            return SlotGrant(best_slot, best_len, (KvOp(KvOpKind.TRIM, best_slot, pos=best_len),))
        slot, ops = self._take_empty()
        self.active[slot] = user
        if best_len:
            ops += (KvOp(KvOpKind.COPY, slot, pos=best_len, src=best_slot),)
        return SlotGrant(slot, best_len, ops)

    def _take_empty(self) -> tuple[int, tuple[KvOp, ...]]:
        if self.free:
            return self.free.pop(), ()
        slot, _ = self.cached.popitem(last=False)
        return slot, (KvOp(KvOpKind.CLEAR, slot),)

    def release(self, slot: int, num_valid: int, keep: bool) -> tuple[KvOp, ...]:
        """A sequence ended; keep its first num_valid tokens' KV for reuse or drop it."""
        user = self.active.pop(slot)
        if keep and num_valid > 0:
            self.cached[slot] = list(user.token_ids[:num_valid])
            return (KvOp(KvOpKind.TRIM, slot, pos=num_valid),)
        self.free.append(slot)
        return (KvOp(KvOpKind.CLEAR, slot),)

    def evict_lru(self) -> tuple[KvOp, ...]:
        """Free the least recently used cached slot's cells."""
        slot, _ = self.cached.popitem(last=False)
        self.free.append(slot)
        return (KvOp(KvOpKind.CLEAR, slot),)
