"""SlotPool keeps a finished conversation's history while a slot is free:
another conversation on the same system prompt copies the prompt out of its
slot rather than taking the slot over and cutting the history off."""

from __future__ import annotations

from dataclasses import dataclass, field

from modeld.backends.generation.slots import KV_BLOCK_TOKENS, KvOpKind, SlotPool


@dataclass
class _User:
    token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0


SYSTEM = list(range(1000, 1100))


def _finish(pool: SlotPool, prompt: list[int], answer: list[int]) -> int:
    user = _User(list(prompt), len(prompt))
    grant = pool.grant(prompt, user, use_cache=True)
    user.token_ids += answer
    user.num_computed = len(user.token_ids)
    pool.release(grant.slot, user.num_computed, keep=True)
    return grant.slot


def test_a_conversation_on_a_shared_system_prompt_leaves_another_s_history_in_its_slot_while_one_is_free():
    pool = SlotPool(4, min_copy=16)
    history = [2000 + i for i in range(2 * KV_BLOCK_TOKENS)]  # the first conversation's question and answer
    first = _finish(pool, SYSTEM + history[:10], history[10:])
    grant = pool.grant(SYSTEM + [3000, 3001], _User(), use_cache=True)  # a second conversation
    assert grant.slot != first and grant.num_reused == len(SYSTEM)
    assert [op.kind for op in grant.ops][-1] is KvOpKind.COPY
    assert pool.cached[first] == SYSTEM + history  # still whole: its next turn reuses all of it
    # its next turn: the whole history from cache
    assert pool.grant(SYSTEM + history + [4000], _User(), use_cache=True).num_reused == len(SYSTEM + history)


def test_with_no_slot_free_the_shared_prefix_is_taken_over_in_place():
    pool = SlotPool(1, min_copy=16)
    first = _finish(pool, SYSTEM + [1, 2], list(range(50, 90)))
    grant = pool.grant(SYSTEM + [3000, 3001], _User(), use_cache=True)
    assert (grant.slot, grant.num_reused) == (first, len(SYSTEM))
    assert [op.kind for op in grant.ops] == [KvOpKind.TRIM]
