"""A worker model's prefix cache as the daemon mirrors it (server/workers/
kv_cache.py), over a real BlockManager: the mirror, fed only the worker's
answers, always equals the cache after random traffic, a lost answer is
repaired by a snapshot, and an unchanged cache costs an empty answer."""

from __future__ import annotations

import asyncio
import random

from modeld.backends.generation.block_manager import BlockManager
from modeld.server.workers import kv_cache
from modeld.server.workers.kv_cache import KvDeltaSource, KvMirror


def _commit(blocks: BlockManager, seq_id: int, tokens: list[int]) -> None:
    blocks.match_prefix(seq_id, tokens)
    assert blocks.grow(seq_id, len(tokens))
    blocks.commit(seq_id, tokens, len(tokens))


def test_answers_are_a_snapshot_then_differences_then_nothing():
    blocks, source = BlockManager(num_blocks=32, block_size=4), KvDeltaSource()
    _commit(blocks, 1, list(range(13)))
    first = source.delta(blocks, -1)
    assert first.is_snapshot and set(first.stored) == blocks.kv_block_hashes() and len(first.stored) == 3
    assert source.delta(blocks, first.sequence) is None  # nothing changed: nothing to send
    before = blocks.kv_block_hashes()
    _commit(blocks, 2, [7] * 9)
    second = source.delta(blocks, first.sequence)
    assert not second.is_snapshot and set(second.stored) == blocks.kv_block_hashes() - before and not second.removed
    # an answer the daemon never got (its call was cancelled): the next asks from the older one, and gets it all
    third = source.delta(blocks, first.sequence)
    assert third is not None and third.is_snapshot and set(third.stored) == blocks.kv_block_hashes()


def test_the_mirror_follows_random_traffic_exactly():
    rng = random.Random(7)
    blocks, source = BlockManager(num_blocks=24, block_size=4), KvDeltaSource()
    answers: list = []

    async def fetch(since):
        answer = source.delta(blocks, since)
        if answer is not None and rng.random() < 0.1:
            return None  # the reply lost on the way: the mirror must recover on a later answer
        return answer

    async def main():
        mirror = KvMirror(fetch)
        live: list[int] = []
        for step in range(400):
            if live and rng.random() < 0.4:
                blocks.free_sequence(live.pop(rng.randrange(len(live))))
            else:
                seq_id = step + 1
                tokens = [rng.randrange(3) for _ in range(rng.randrange(2, 30))]
                if blocks.num_free >= blocks.blocks_for(len(tokens)):
                    _commit(blocks, seq_id, tokens)
                    live.append(seq_id)
            # a lost reply leaves it behind; the next answer (a snapshot) catches it up
            for _ in range(20):
                await mirror.refresh()
                if mirror.state is not None and mirror.state.hashes == blocks.kv_block_hashes():
                    break
            assert mirror.state.hashes == blocks.kv_block_hashes(), step
            answers.append(step)
    asyncio.run(main())


def test_a_read_asks_in_the_background_and_at_most_once_at_a_time():
    blocks, source = BlockManager(num_blocks=8, block_size=4), KvDeltaSource()
    calls = []
    gate = asyncio.Event()

    async def fetch(since):
        calls.append(since)
        await gate.wait()
        return source.delta(blocks, since)

    async def main():
        now = [0.0]
        mirror = KvMirror(fetch, clock=lambda: now[0])
        _commit(blocks, 1, list(range(9)))
        assert mirror.read() is None  # nothing heard yet; the question goes out
        await asyncio.sleep(0)
        now[0] += 1
        assert mirror.read() is None and calls == [-1]  # one question in flight at a time
        gate.set()
        await asyncio.sleep(0.01)
        assert mirror.read().hashes == blocks.kv_block_hashes()
    asyncio.run(main())


def test_a_model_without_a_cache_is_asked_once():
    calls = []

    async def fetch(since):
        calls.append(since)
        return False

    async def main():
        now = [0.0]
        mirror = KvMirror(fetch, clock=lambda: now[0])
        for _ in range(5):
            assert mirror.read() is None
            await asyncio.sleep(0.01)
            now[0] += 1
    asyncio.run(main())
    assert calls == [-1]


def test_an_answer_is_cut_at_the_bound(monkeypatch):
    monkeypatch.setattr(kv_cache, "MAX_HASHES", 5)
    blocks = BlockManager(num_blocks=16, block_size=2)
    _commit(blocks, 1, list(range(17)))
    assert len(blocks.kv_block_hashes()) == 8
    source = KvDeltaSource()
    first = source.delta(blocks, -1)
    assert len(first.stored) == 5
    assert source.delta(blocks, first.sequence) is None  # the cut is stable: no endless snapshots
