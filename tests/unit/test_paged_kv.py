"""Block manager and paged scheduler: prefix sharing, preemption, and no
leaked block after many random requests (pure Python, no torch)."""

from __future__ import annotations

import random

from modeld.backends.generation.block_manager import BlockManager
from modeld.backends.generation.interface import SeqResult
from modeld.backends.generation.paged_scheduler import PagedConfig, PagedScheduler
from modeld.backends.generation.params import FinishReason, SamplingParams
from modeld.backends.generation.sequence import Sequence


def _seq(tokens, max_tokens=8, cache=True) -> Sequence:
    return Sequence(list(tokens), SamplingParams(max_tokens=max_tokens, cache_prompt=cache))


def test_full_blocks_are_shared_by_chained_hash():
    blocks = BlockManager(num_blocks=16, block_size=4)
    a = list(range(10))
    blocks.start_sequence(1)
    assert blocks.grow(1, len(a))
    blocks.commit(1, a, num_computed=10)  # two full blocks hashed
    assert blocks.match_prefix(2, a) == 8  # both full blocks before the last token
    assert blocks.tables[2] == blocks.tables[1][:2]
    assert [blocks.blocks[b].ref_count for b in blocks.tables[1][:2]] == [2, 2]
    # same second block but a different first one: the chained hash refuses it
    assert blocks.match_prefix(3, [99] + a[1:]) == 0


def test_freed_cached_blocks_are_revived_until_reused():
    blocks = BlockManager(num_blocks=4, block_size=4)
    tokens = list(range(9))
    blocks.start_sequence(1)
    blocks.grow(1, 9)
    blocks.commit(1, tokens, 9)
    blocks.free_sequence(1)
    assert blocks.num_free == 4
    assert blocks.match_prefix(2, tokens) == 8  # revived from the free queue
    blocks.free_sequence(2)
    blocks.start_sequence(3)
    assert blocks.grow(3, 16)  # takes every block, evicting the cached ones
    assert blocks.match_prefix(4, tokens) == 0


def _fake_step(scheduler: PagedScheduler, rng: random.Random, vocab: int = 50) -> None:
    """A step the way the generation loop runs one, with random tokens."""
    plan = scheduler.schedule()
    results = {}
    for work in plan.work:
        if work.num_logits:
            seq = next(s for s in scheduler.running if s.seq_id == work.seq_id)
            done = seq.num_output + 1 >= seq.params.max_tokens or rng.random() < 0.05
            results[work.seq_id] = SeqResult((rng.randrange(vocab),), 0, FinishReason.LENGTH if done else None)
    scheduler.update(plan, results)


def test_no_block_leaks_after_500_random_requests_with_cancels_and_preemptions():
    rng = random.Random(0)
    scheduler = PagedScheduler(PagedConfig(num_blocks=48, block_size=4, context_length=128,
                                           max_running=8, max_step_tokens=64, max_waiting=1000))
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 24))] for _ in range(5)]
    live: list[Sequence] = []
    for _ in range(500):
        prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
        seq = _seq(prompt, max_tokens=rng.randrange(1, 40), cache=rng.random() < 0.8)
        scheduler.add(seq)
        live.append(seq)
        for _ in range(rng.randrange(0, 3)):
            _fake_step(scheduler, rng)
        if rng.random() < 0.15:
            victim = rng.choice(live)
            victim.is_cancelled = True
    while scheduler.has_work():
        _fake_step(scheduler, rng)
    assert scheduler.num_preemptions > 0, "the pool is small enough that preemption must happen"
    blocks = scheduler.blocks
    assert all(b.ref_count == 0 for b in blocks.blocks)
    assert blocks.num_free == len(blocks.blocks)  # every block is free (cached ones included)
    assert not blocks.tables
    cached = [b for b in blocks.blocks if b.hash is not None]
    assert all(blocks.cached[b.hash] == b.block_id for b in cached)


def test_preempted_sequence_recomputes_and_finishes():
    scheduler = PagedScheduler(PagedConfig(num_blocks=8, block_size=4, context_length=64,
                                           max_running=4, max_step_tokens=64))
    first, second = _seq(range(7), max_tokens=16, cache=False), _seq(range(100, 107), max_tokens=16, cache=False)
    scheduler.add(first)
    scheduler.add(second)
    rng = random.Random(1)
    rng.random = lambda: 1.0  # never stop early
    steps = 0
    while scheduler.has_work() and steps < 200:
        _fake_step(scheduler, rng)
        steps += 1
    assert scheduler.num_preemptions >= 1  # 2 x 23 tokens do not fit in 32 cells at once
    assert first.num_output == second.num_output == 16
    assert scheduler.blocks.num_free == 8


def test_both_schedulers_refuse_what_cannot_fit_and_bound_the_queue():
    import pytest

    from modeld.backends.errors import InvalidArgument, ResourceExhausted
    from modeld.backends.generation.slot_scheduler import SlotConfig, SlotScheduler

    schedulers = [
        PagedScheduler(PagedConfig(num_blocks=64, block_size=4, context_length=32, max_waiting=2)),
        SlotScheduler(SlotConfig(num_slots=4, kv_capacity=256, context_length=32, max_waiting=2)),
    ]
    for scheduler in schedulers:
        with pytest.raises(InvalidArgument, match="plus max_tokens 30 is 40, beyond the context window of 32"):
            scheduler.add(_seq(range(10), max_tokens=30))
        scheduler.add(_seq(range(4)))
        scheduler.add(_seq(range(4)))
        with pytest.raises(ResourceExhausted, match="2 requests are already waiting"):
            scheduler.add(_seq(range(4)))
