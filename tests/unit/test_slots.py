"""SlotPool: llama.cpp's KV slots and the prefix cache over them, and the
KV operations each decision hands the executor (pure Python)."""

from __future__ import annotations

from dataclasses import dataclass, field

from modeld.backends.generation.slots import KvOp, KvOpKind, SlotPool, common_prefix, slot_runs


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


# -- placement: llama.cpp runs one forward pass per run of consecutive active slots --


def _running(pool: SlotPool, tokens: list[int]) -> int:
    user = _User(list(tokens), len(tokens))
    return pool.grant(tokens, user, use_cache=False).slot


def test_slot_runs_counts_blocks_of_consecutive_slots():
    assert slot_runs([]) == 0
    assert slot_runs([3]) == 1
    assert slot_runs([0, 1, 2, 3, 4, 5, 6, 7]) == 1
    assert slot_runs([6, 7, 0, 1, 2, 3, 4, 5]) == 1  # a set: llama's batch is fed in slot order
    assert slot_runs([0, 6, 7]) == 2
    assert slot_runs([0, 2, 4, 6]) == 4


def test_a_new_sequence_extends_the_block_of_active_slots():
    pool = SlotPool(8)
    for i in range(6):
        _cache(pool, [10 + i, 1, 1])  # slots 0..5 cached, 6 and 7 free
    first = _running(pool, [50, 1])
    second = _running(pool, [51, 1])
    third = _running(pool, [52, 1])
    assert (first, second) == (6, 7)  # free slots before cached prefixes
    assert third == 5  # the cached slot next to the block, not the least recently used one (0)
    assert pool.num_runs == 1


def test_a_long_cached_prefix_away_from_the_block_is_copied_next_to_it():
    pool = SlotPool(8, min_copy=4)
    prefix = list(range(100, 120))
    far = _cache(pool, prefix + [1])  # slot 0
    for i in range(5):
        _cache(pool, [10 + i, 1])  # slots 1..5
    a, b = _running(pool, [50, 1]), _running(pool, [51, 1])  # 6, 7
    assert (far, a, b) == (0, 6, 7)
    grant = pool.grant(prefix + [2, 3], _User(), use_cache=True)
    assert grant.slot == 5 and grant.num_reused == len(prefix)
    assert grant.ops == (KvOp(KvOpKind.CLEAR, 5), KvOp(KvOpKind.COPY, 5, pos=len(prefix), src=far))
    assert pool.cached[far] == prefix + [1]  # the source keeps its prefix for later requests
    assert pool.num_runs == 1


def test_a_short_cached_prefix_away_from_the_block_is_recomputed_next_to_it():
    pool = SlotPool(8, min_copy=4)
    far = _cache(pool, [100, 101, 102, 1])  # slot 0: 3 tokens to share, fewer than a copy is worth
    for i in range(5):
        _cache(pool, [10 + i, 1])
    _running(pool, [50, 1]), _running(pool, [51, 1])
    grant = pool.grant([100, 101, 102, 2], _User(), use_cache=True)
    assert (grant.slot, grant.num_reused, grant.ops) == (5, 0, (KvOp(KvOpKind.CLEAR, 5),))
    assert far in pool.cached and pool.num_runs == 1


def test_a_cached_prefix_is_taken_in_place_when_nothing_runs():
    pool = SlotPool(8, min_copy=4)
    _cache(pool, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    slot = _cache(pool, [20, 21, 22, 23, 24, 25])
    grant = pool.grant([20, 21, 22, 23, 24, 30], _User(), use_cache=True)
    assert (grant.slot, grant.num_reused, grant.ops) == (slot, 5, (KvOp(KvOpKind.TRIM, slot, pos=5),))


def test_an_active_prefix_shorter_than_a_copy_is_worth_is_recomputed():
    pool = SlotPool(2, min_copy=4)
    running = _User([1, 2, 3, 4, 5, 6], num_computed=3)
    pool.grant(running.token_ids, running, use_cache=True)
    grant = pool.grant([1, 2, 3, 4, 5, 7], _User(), use_cache=True)
    assert (grant.num_reused, grant.ops) == (0, ())
