"""Prefix caching in the BlockManager: a hash hit is checked against the
block's tokens and the block before it, so a collision never serves
another prompt's KV (pure Python)."""

from __future__ import annotations

import pytest

from modeld.backends.generation import block_manager
from modeld.backends.generation.block_manager import BlockManager


def _computed(blocks: BlockManager, seq_id: int, tokens: list[int]) -> None:
    """A sequence whose every token has its KV in the cache, committed."""
    blocks.start_sequence(seq_id)
    assert blocks.grow(seq_id, len(tokens))
    blocks.commit(seq_id, tokens, len(tokens))


@pytest.mark.parametrize("collide", [
    lambda previous, tokens: 7,  # every block hashes alike
    lambda previous, tokens: hash((previous, tokens[1:])),  # blind to a block's first token
])
def test_a_hash_collision_serves_no_cached_block(monkeypatch, collide):
    monkeypatch.setattr(block_manager, "chain_hash", collide)
    blocks = BlockManager(num_blocks=16, block_size=4)
    _computed(blocks, 1, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert blocks.match_prefix(2, [99, 2, 3, 4, 5, 6, 7, 8, 9]) == 0
    assert blocks.tables[2] == []


def test_a_block_is_served_only_after_the_block_it_was_computed_after(monkeypatch):
    # a hash blind to the chain: equal tokens after different prefixes collide
    monkeypatch.setattr(block_manager, "chain_hash", lambda previous, tokens: hash(tokens))
    blocks = BlockManager(num_blocks=16, block_size=4)
    _computed(blocks, 1, [1, 1, 1, 1, 2, 2, 2, 2, 0])
    _computed(blocks, 2, [3, 3, 3, 3, 4, 4, 4, 4, 0])
    # block 0 really is cached (from sequence 2); block 1's tokens are, but after another block 0
    assert blocks.match_prefix(3, [3, 3, 3, 3, 2, 2, 2, 2, 0]) == 4
    assert blocks.tables[3] == blocks.tables[2][:1]


def test_a_block_whose_predecessor_was_handed_out_anew_is_not_served(monkeypatch):
    monkeypatch.setattr(block_manager, "chain_hash", lambda previous, tokens: hash(tokens))
    blocks = BlockManager(num_blocks=4, block_size=2)
    _computed(blocks, 1, [1, 2, 3, 4, 0])
    first = blocks.tables[1][0]
    blocks.free_sequence(1)
    blocks.free.move_to_end(first, last=False)  # make it the next block handed out
    _computed(blocks, 2, [5, 6, 0])  # new content in the block that held (1, 2)
    assert blocks.tables[2][0] == first
    # (3, 4) is still cached, but its KV was computed after (1, 2), not after (5, 6)
    assert blocks.match_prefix(3, [5, 6, 3, 4, 0]) == 2


def test_a_prefix_computed_twice_at_once_is_still_found_whole():
    blocks = BlockManager(num_blocks=16, block_size=4)
    shared = [1, 2, 3, 4, 5, 6, 7, 8]
    for seq_id, tokens in ((1, shared + [0]), (2, shared + [9, 9, 9, 9, 0])):
        blocks.start_sequence(seq_id)
        assert blocks.grow(seq_id, len(tokens))
    blocks.commit(1, shared + [0], 9)
    blocks.commit(2, shared + [9, 9, 9, 9, 0], 13)  # its first two blocks duplicate sequence 1's
    assert blocks.match_prefix(3, shared + [9, 9, 9, 9, 0, 1]) == 12
    assert blocks.tables[3] == blocks.tables[1][:2] + [blocks.tables[2][2]]


def test_equal_prompts_share_blocks_and_every_block_returns():
    blocks = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(11))
    _computed(blocks, 1, tokens)
    assert blocks.match_prefix(2, tokens) == 8
    blocks.free_sequence(1)
    blocks.free_sequence(2)
    assert blocks.num_free == 8 and all(b.ref_count == 0 for b in blocks.blocks)


def test_a_salt_keys_its_blocks_apart_and_the_empty_salt_is_no_salt():
    blocks = BlockManager(num_blocks=16, block_size=4)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    blocks.start_sequence(1, salt=b"adapter-a")
    assert blocks.grow(1, len(tokens))
    blocks.commit(1, tokens, len(tokens))
    blocks.free_sequence(1)
    assert blocks.match_prefix(2, tokens) == 0  # unsalted: not the adapter's KV
    assert blocks.match_prefix(3, tokens, salt=b"adapter-b") == 0
    assert blocks.match_prefix(4, tokens, salt=b"adapter-a") == 8
    _computed(blocks, 5, tokens)
    assert blocks.match_prefix(6, tokens, salt=b"") == 8


def test_a_salt_collision_on_the_first_block_serves_no_other_namespace(monkeypatch):
    monkeypatch.setattr(block_manager, "chain_hash", lambda previous, tokens: hash(tokens))  # blind to the salt
    blocks = BlockManager(num_blocks=16, block_size=4)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    blocks.start_sequence(1, salt=b"adapter-a")
    assert blocks.grow(1, len(tokens))
    blocks.commit(1, tokens, len(tokens))
    blocks.free_sequence(1)
    assert blocks.match_prefix(2, tokens, salt=b"adapter-b") == 0


def test_prompt_hashes_are_the_keys_the_cache_holds_and_stable_values():
    blocks = BlockManager(num_blocks=16, block_size=4)
    tokens = list(range(100, 113))
    _computed(blocks, 1, tokens)
    # 13 tokens: three whole blocks committed, three a later prompt can match
    assert set(block_manager.prompt_hashes(tokens, 4)) == set(blocks.cached)
    assert block_manager.prompt_hashes(tokens[:8], 4) == block_manager.prompt_hashes(tokens, 4)[:1]
    # a value another process (the gateway) must reproduce: xxh3-64, seed 0, int32 ids
    import xxhash
    from array import array
    assert block_manager.prompt_hashes([1, 2, 3, 4, 5], 4) == [xxhash.xxh3_64_intdigest(array("i", [1, 2, 3, 4]).tobytes())]
    assert block_manager.prompt_hashes([1, 2, 3, 4, 5], 4, salt=b"x") != block_manager.prompt_hashes([1, 2, 3, 4, 5], 4)
