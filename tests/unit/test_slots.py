"""SlotPool: llama.cpp's KV slots and the prefix cache over them, and the
KV operations each decision hands the executor (pure Python)."""

from __future__ import annotations

from dataclasses import dataclass, field

from modeld.backends.generation.slots import KvOp, KvOpKind, SlotPool, common_prefix


@dataclass
class _User:
    token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0


def _cache(pool: SlotPool, tokens: list[int]) -> int:
    """Run a sequence of `tokens` to the end and keep its KV; returns its slot."""
    user = _User(list(tokens), len(tokens))
    grant = pool.grant(tokens, user, use_cache=False)
    assert pool.release(grant.slot, len(tokens), keep=True) == (KvOp(KvOpKind.TRIM, grant.slot, pos=len(tokens)),)
    return grant.slot


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0


def test_a_new_sequence_takes_a_free_slot_with_nothing_to_do():
    pool = SlotPool(2)
    grant = pool.grant([1, 2, 3], _User(), use_cache=True)
    assert (grant.slot, grant.num_reused, grant.ops) == (0, 0, ())
    assert pool.active and pool.can_grant()
    assert pool.grant([4], _User(), use_cache=True).slot == 1
    assert not pool.can_grant()


def test_release_keeps_the_valid_prefix_or_clears_the_slot():
    pool = SlotPool(3)
    a, b, c = (pool.grant([i], _User([i, i, i, i]), use_cache=False).slot for i in range(3))
    assert pool.release(a, 3, keep=True) == (KvOp(KvOpKind.TRIM, a, pos=3),)
    assert pool.cached[a] == [0, 0, 0] and pool.num_cached_cells == 3
    assert pool.release(b, 3, keep=False) == (KvOp(KvOpKind.CLEAR, b),)
    assert b in pool.free and b not in pool.cached
    # nothing valid to keep: the slot is cleared and freed even when asked to keep
    assert pool.release(c, 0, keep=True) == (KvOp(KvOpKind.CLEAR, c),)
    assert c in pool.free and not pool.active


def test_grant_takes_over_the_cached_slot_with_the_longest_prefix():
    pool = SlotPool(3)
    short = _cache(pool, [1, 2, 9, 9])
    long = _cache(pool, [1, 2, 3, 4, 9])
    grant = pool.grant([1, 2, 3, 4, 5, 6], _User(), use_cache=True)
    assert (grant.slot, grant.num_reused) == (long, 4)
    assert grant.ops == (KvOp(KvOpKind.TRIM, long, pos=4),)  # cut the cached tail, keep the prefix in place
    assert long in pool.active and long not in pool.cached and short in pool.cached


def test_at_least_one_prompt_token_is_left_to_feed():
    pool = SlotPool(1)
    slot = _cache(pool, [1, 2, 3])
    grant = pool.grant([1, 2, 3], _User(), use_cache=True)
    assert (grant.slot, grant.num_reused) == (slot, 2)  # the last token is fed again for its logits


def test_grant_copies_the_computed_prefix_of_an_active_sequence():
    pool = SlotPool(2)
    running = _User([1, 2, 3, 4, 5, 6], num_computed=3)
    src = pool.grant(running.token_ids, running, use_cache=True).slot
    grant = pool.grant([1, 2, 3, 4, 5, 7], _User(), use_cache=True)
    # only the 3 computed tokens can be shared, though 5 are equal
    assert grant.num_reused == 3 and grant.slot != src
    assert grant.ops == (KvOp(KvOpKind.COPY, grant.slot, pos=3, src=src),)


def test_without_the_cache_nothing_is_reused():
    pool = SlotPool(2)
    _cache(pool, [1, 2, 3, 4])
    grant = pool.grant([1, 2, 3, 4, 5], _User(), use_cache=False)
    assert grant.num_reused == 0 and grant.ops == ()  # a free slot was left


def test_a_full_pool_recycles_the_least_recently_used_cached_slot():
    pool = SlotPool(2)
    old = _cache(pool, [1, 1, 1])
    new = _cache(pool, [2, 2, 2])
    grant = pool.grant([3, 3], _User(), use_cache=True)
    assert grant.slot == old and grant.ops == (KvOp(KvOpKind.CLEAR, old),)
    assert list(pool.cached) == [new]


def test_evict_lru_frees_the_oldest_cached_slot():
    pool = SlotPool(3)
    old = _cache(pool, [1, 1])
    new = _cache(pool, [2, 2])
    assert pool.evict_lru() == (KvOp(KvOpKind.CLEAR, old),)
    assert old in pool.free and list(pool.cached) == [new] and pool.num_cached_cells == 2
