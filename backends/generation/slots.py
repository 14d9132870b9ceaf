"""KV slots (llama.cpp sequence ids) and the prefix cache over them.

A slot is free, active (a running sequence) or cached (a finished
sequence's KV kept for reuse, in LRU order). Admission looks for the slot
whose tokens share the longest prefix with the new prompt: a cached slot is
taken over in place; an active one is copied. Pure bookkeeping; the KV
operations it decides are returned as plain data for the executor.

Where a sequence goes matters as much as what it reuses. With one KV stream
per slot, llama.cpp runs a step as one forward pass per run of consecutive
slot ids: active slots {0..7} decode in one pass, {6, 7} + {0..5} in two,
{0, 2, 4, 6} in four, each pass reading every weight again. So a new
sequence is placed where it extends the block of active slots, preferring
a free slot to evicting a cached prefix, and a cached prefix in a slot that
would split the block is copied next to it (when it saves enough prompt
tokens to pay for a stream copy) or recomputed there.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum
from typing import Iterable, Protocol

from modeld.backends.generation.block_manager import chain_hash, prompt_hashes

# Slots reuse any common prefix, token by token; what a gateway is told of
# them (kv_block_hashes) is each slot's computed tokens cut into blocks of
# this many, chain-hashed as the paged cache hashes its blocks, so a prompt
# whose first k blocks match a slot's reuses at least k blocks there.
KV_BLOCK_TOKENS = 16


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


def slot_runs(slots: Iterable[int]) -> int:
    """Runs of consecutive ids in a set of slots: llama.cpp's forward passes
    for a step over them (batch sorted by slot, within n_batch tokens)."""
    present = set(slots)
    return sum(1 for s in present if s - 1 not in present)


class SlotPool:
    def __init__(self, num_slots: int, min_copy: int = 1) -> None:
        # llama.cpp copies a KV stream whole, whatever the prefix length; a
        # copy that saves fewer prompt tokens than this is not worth it
        self.min_copy = min_copy
        self.free: list[int] = list(range(num_slots - 1, -1, -1))
        self.cached: OrderedDict[int, list[int]] = OrderedDict()  # LRU first
        self.active: dict[int, SlotUser] = {}  # slot -> the running sequence in it
        # kv_block_hashes' memo, touched only by its reader: slot -> (the
        # token list hashed, its block hashes so far)
        self._hashed: dict[int, tuple[list[int], list[int]]] = {}
        # the round the grant in progress belongs to, when that round takes
        # every empty slot (see grant): cached slot -> the most prompt tokens
        # a sequence of the round reuses there; None outside such a round
        self._round: dict[int, int] | None = None

    @property
    def num_cached_cells(self) -> int:
        return sum(len(t) for t in self.cached.values())

    @property
    def num_runs(self) -> int:
        """Forward passes a step over every active slot costs."""
        return slot_runs(self.active)

    # -- what a gateway reads (server/services/kv_events.py) -------------------

    kv_cache_kind = "slots"
    kv_block_size = KV_BLOCK_TOKENS

    def kv_block_hashes(self) -> frozenset[int]:
        """Block hashes of every cached slot's tokens and every running
        slot's computed ones. Read from another thread than the one that
        changes the pool: the dict copies run without releasing the GIL; a
        slot's list is only appended to while it runs, and a cached slot's
        is a list of its own, so hashes remembered for a list stay true for
        its first blocks."""
        hashes, memo = set(), {}
        lists = [(slot, tokens, len(tokens)) for slot, tokens in self.cached.copy().items()]
        lists += [(slot, user.token_ids, user.num_computed) for slot, user in self.active.copy().items()]
        for slot, tokens, num_tokens in lists:
            done = self._slot_hashes(slot, tokens, num_tokens)
            memo[slot] = (tokens, done)
            hashes.update(done)
        self._hashed = memo
        return frozenset(hashes)

    def _slot_hashes(self, slot: int, tokens: list[int], num_tokens: int) -> list[int]:
        num_blocks = min(num_tokens, len(tokens)) // KV_BLOCK_TOKENS
        seen = self._hashed.get(slot)
        done = seen[1][:num_blocks] if seen is not None and seen[0] is tokens else []
        previous = done[-1] if done else 0
        for index in range(len(done), num_blocks):
            previous = chain_hash(previous, tuple(tokens[index * KV_BLOCK_TOKENS:(index + 1) * KV_BLOCK_TOKENS]))
            done.append(previous)
        return done

    def kv_prompt_hashes(self, token_ids: list[int], salt: bytes = b"") -> list[int]:
        return prompt_hashes(token_ids, KV_BLOCK_TOKENS, salt)

    def can_grant(self) -> bool:
        return bool(self.free or self.cached)

    def grant(self, prompt: list[int], user: SlotUser, use_cache: bool,
              round_wants: dict[int, int] | None = None) -> SlotGrant:
        """A slot for a new sequence (only when can_grant()): one that keeps
        the active slots in as few runs as possible, reusing the longest
        prefix it can get there.

        `round_wants` (from wanted_by): this grant is one of a round of new
        sequences that takes every empty slot, so the active slots end as
        one block wherever each goes. A cached prefix is then taken over in
        place wherever it lies, rather than recomputed next to the block;
        a slot whose prefix another sequence of the round reuses further
        is neither taken over nor given to a sequence that reuses nothing.
        Nor is a cached conversation's history spared for a free slot: the
        round takes the free slots too."""
        self._round = round_wants
        try:
            return self._grant(prompt, user, use_cache)
        finally:
            self._round = None

    def wanted_by(self, prompts: Iterable[list[int]]) -> dict[int, int]:
        """For a round of new sequences' prompts: each cached slot that holds
        the longest prefix of one of them, and the most tokens reused there."""
        wanted: dict[int, int] = {}
        for prompt in prompts:
            best = max(((n, slot) for slot, n in self._reusable_cached(prompt).items()), default=None)
            if best is not None:
                wanted[best[1]] = max(wanted.get(best[1], 0), best[0])
        return wanted

    def _grant(self, prompt: list[int], user: SlotUser, use_cache: bool) -> SlotGrant:
        reusable = self._reusable(prompt) if use_cache else {}
        fewest = min(self._splits(s) for s in (*self.free, *self.cached))
        # a cached prefix in a slot that does not split the block is taken over
        # in place, unless that would cut off a block or more of the slot's
        # other tokens while a slot is free: those are another conversation's
        # history (only its system prompt is shared), which its next turn
        # comes back for; the prefix is copied into the free slot instead.
        # (Taken over in place, 24 conversations over 3 system prompts kept
        # 3 histories a node whatever its slots: 0.8 of the ideal cache hits.)
        wanted = self._round or {}
        in_place = max(((n, -rank, slot) for rank, slot in enumerate(self.cached)
                        if (n := reusable.get(slot, 0)) and self._splits(slot) == fewest
                        and n >= wanted.get(slot, 0)
                        and (not self.free or self._round is not None
                             or len(self.cached[slot]) - n < KV_BLOCK_TOKENS)), default=None)
        src, longest = max(reusable.items(), key=lambda item: item[1], default=(-1, 0))
        kept = in_place[0] if in_place else 0
        if in_place and longest - kept < self.min_copy:
            slot = in_place[2]
            del self.cached[slot]
            self.active[slot] = user
            return SlotGrant(slot, kept, (KvOp(KvOpKind.TRIM, slot, pos=kept),))
        copy = longest >= self.min_copy
        slot = self._placement(keep=src if copy else None)
        ops = self._take(slot)
        self.active[slot] = user
        if not copy:
            return SlotGrant(slot, 0, ops)
        # the source stays as it was (cached or running); the copy is cut to the prefix
        return SlotGrant(slot, longest, (*ops, KvOp(KvOpKind.COPY, slot, pos=longest, src=src)))

    def _reusable(self, prompt: list[int]) -> dict[int, int]:
        """Prompt tokens each slot could supply, for slots with any."""
        found = self._reusable_cached(prompt)
        limit = len(prompt) - 1
        for slot, other in self.active.items():
            # only tokens whose KV is already computed can be shared
            found[slot] = min(common_prefix(other.token_ids[:other.num_computed], prompt), limit)
        return {slot: n for slot, n in found.items() if n > 0}

    def _reusable_cached(self, prompt: list[int]) -> dict[int, int]:
        limit = len(prompt) - 1  # at least one prompt token must be fed to get logits
        found = {slot: min(common_prefix(tokens, prompt), limit) for slot, tokens in self.cached.items()}
        return {slot: n for slot, n in found.items() if n > 0}

    def _splits(self, slot: int) -> int:
        """How many more runs the active slots would form with `slot` among
        them (none in a round that fills every slot: see grant)."""
        if self._round is not None:
            return 0
        return 1 - (slot - 1 in self.active) - (slot + 1 in self.active)

    def _placement(self, keep: int | None) -> int:
        """The empty slot a new sequence should take: the one that adds the
        fewest runs; then, in a round that fills every slot, one whose prefix
        no sequence of the round reuses; then a free one before a cached one
        (no prefix lost); then the least recently used cached one. `keep`: a
        cached slot not to evict (the prefix about to be copied)."""
        lru = {slot: rank for rank, slot in enumerate(self.cached)}
        wanted = self._round or {}
        candidates = [*self.free, *(s for s in self.cached if s != keep)]
        return min(candidates, key=lambda s: (self._splits(s), s in wanted, s in lru, lru.get(s, 0), s))

    def _take(self, slot: int) -> tuple[KvOp, ...]:
        if slot in self.cached:
            del self.cached[slot]
            return (KvOp(KvOpKind.CLEAR, slot),)
        self.free.remove(slot)
        return ()

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
