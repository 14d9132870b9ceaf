"""Paged KV-cache bookkeeping: a pool of fixed-size blocks, a block table per
sequence, reference counts, and automatic prefix caching.

Full blocks are keyed by a chained hash of their tokens (the hash of a block
covers every token before it too), so two prompts share a block only when
everything up to and including it is equal. Freed blocks keep their hash and
sit in the free queue in LRU order: a later prompt can revive them until their
space is handed to someone else. No torch, no numpy: tested in microseconds.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and computed


def chain_hash(previous: int | None, tokens: tuple[int, ...]) -> int:
    return hash((previous, tokens))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        # free blocks, least recently used first; cached ones keep their hash
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # hash -> block id
        self.tables: dict[int, list[int]] = {}  # seq id -> block ids
        self._hashes: dict[int, list[int]] = {}  # seq id -> hashes of its committed full blocks

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return len(self.blocks) - len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache ----------------------------------------------------------

    def start_sequence(self, seq_id: int) -> None:
        self.tables[seq_id], self._hashes[seq_id] = [], []

    def match_prefix(self, seq_id: int, token_ids: list[int]) -> int:
        """Give a new sequence the cached blocks of its longest cached prefix.

        At least one prompt token is left uncomputed (its logits are needed),
        so only blocks wholly before the last token can match. Returns the
        number of tokens covered.
        """
        table, hashes, previous = [], [], None
        for index in range((len(token_ids) - 1) // self.block_size):
            chunk = tuple(token_ids[index * self.block_size:(index + 1) * self.block_size])
            key = chain_hash(previous, chunk)
            block_id = self.cached.get(key)
            if block_id is None:
                break
            self._take(block_id)
            table.append(block_id)
            hashes.append(key)
            previous = key
        self.tables[seq_id] = table
        self._hashes[seq_id] = hashes
        return len(table) * self.block_size

    def commit(self, seq_id: int, token_ids: list[int], num_computed: int) -> None:
        """Register the hashes of blocks that became full and computed."""
        hashes, table = self._hashes[seq_id], self.tables[seq_id]
        previous = hashes[-1] if hashes else None
        for index in range(len(hashes), min(num_computed // self.block_size, len(table))):
            chunk = tuple(token_ids[index * self.block_size:(index + 1) * self.block_size])
            key = chain_hash(previous, chunk)
            block = self.blocks[table[index]]
            if block.hash is None and key not in self.cached:
                block.hash = key
                self.cached[key] = block.block_id
            hashes.append(key)
            previous = key

    # -- allocation ------------------------------------------------------------

    def can_grow(self, seq_id: int, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(self.tables.get(seq_id, ())) <= self.num_free

    def grow(self, seq_id: int, num_tokens: int) -> bool:
        """Make the table cover num_tokens positions; False (nothing taken) if it can't."""
        table = self.tables.setdefault(seq_id, [])
        self._hashes.setdefault(seq_id, [])
        extra = self.blocks_for(num_tokens) - len(table)
        if extra > self.num_free:
            return False
        for _ in range(extra):
            block_id = next(iter(self.free))
            self._take(block_id)
            self._forget_hash(block_id)
            table.append(block_id)
        return True

    def shrink(self, seq_id: int, num_tokens: int) -> None:
        """Drop blocks wholly past num_tokens (rejected draft tokens)."""
        table = self.tables[seq_id]
        keep = self.blocks_for(num_tokens)
        for block_id in table[keep:]:
            self._release(block_id)
        del table[keep:]
        del self._hashes[seq_id][keep:]

    def free_sequence(self, seq_id: int) -> None:
        """Release a finished or preempted sequence; its hashed blocks stay cached."""
        for block_id in reversed(self.tables.pop(seq_id, [])):
            self._release(block_id)
        self._hashes.pop(seq_id, None)

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None  # most recently used end

    def _forget_hash(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.hash is not None:
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash = None
